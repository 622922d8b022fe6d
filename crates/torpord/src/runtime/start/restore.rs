//! Start by restoring a snapshot: the function snapshot (a cold start) or a hibernation (a wake,
//! [`super::wake`]). CRIU restores the tree (pages lazily or copied, from the staged copy when
//! there is one), the worker is woken and says hello, and on the split path its segments are
//! handed over in the background while it already takes requests.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::config::DriverLanes;
use crate::metrics::start;
use crate::runtime::instance::{kill_tree, Instance, Sleeper};
use crate::runtime::invoke::Timings;
use crate::runtime::lifecycle::RemoveWhenDone;
use crate::runtime::lifecycle::{Adopted, WorkerTree};
use crate::runtime::pool::FnInfo;
use crate::runtime::process::{restore_with, HowToRestore, RestoredTree};
use crate::runtime::start::{NewInstance, StartError, RESTORE_PAUSE};
use crate::runtime::Runtime;
use crate::sync::lock;

/// The instance's pages-pending marker (crate::runtime::pages_pending), removed when dropped:
/// once its pages are all in, or when its start fails.
struct PagesMark {
    root: std::path::PathBuf,
    id: String,
}

impl Drop for PagesMark {
    fn drop(&mut self) {
        crate::runtime::pages_pending::served(&self.root, &self.id);
    }
}

impl Runtime {
    /// Restores the function snapshot (or `sleeper`'s), wakes the worker and waits for its
    /// `hello`.
    pub(crate) async fn restore_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: Option<&Sleeper>,
        new: &NewInstance<'_, '_>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), StartError> {
        let t = Instant::now();
        let from = sleeper.map_or(&info.snapshot_dir, |s| &s.snapshot_dir);
        // A function snapshot staged in memory is restored from there; a hibernation is never
        // staged (restored once, copying it first would only add a read).
        let staged = match sleeper {
            None => self.staging.get(from),
            Some(_) => None,
        };
        // A cold start goes onto the node's least loaded device (crate::runtime::device_choice);
        // a wake restores where its hibernation was taken.
        let placed = match sleeper {
            None => self.place_cold_start(name, new.id, info),
            Some(_) => None,
        };
        let onto = placed.as_ref().map(|p| p.ordinal).filter(|&d| d != 0);
        // Where the hibernated instance was: it keeps its id, and the file its placed start or
        // migration wrote. The driver restores its CUDA state onto the GPUs it was taken on.
        let woken_on = sleeper.and_then(|s| self.placement_of(&s.id));
        // The restore server fills the segments of a split snapshot meanwhile.
        let restoring = self.split.begin_restore_onto(
            sleeper.map_or(&info.snapshot_id, |s| &s.snapshot_id),
            crate::tenant::of_spec(&info.spec),
            onto.map(|d| i32::try_from(d).unwrap_or(0)),
        );
        // The hot set recorded at deploy (crate::runtime::page_profile), for the function
        // snapshot's restores by Torpor's page server; `auto` picks lazy for a GPU function only
        // with one.
        let profile = match sleeper {
            None => crate::profiles::recorded(&self.state_root, &info.snapshot_id),
            Some(_) => None,
        };
        let how_pages = self
            .config
            .restore_server
            .pages
            .source(info.gpu, profile.is_some());
        // Its own new cgroup, never its source's: CRIU restores the tree into it.
        let cgroup = self.worker_cgroup(new.id, &info.spec)?;
        let profile_in =
            profile.filter(|_| how_pages == torpor_snapshot::restore::PageSource::Lazy);
        let how = HowToRestore {
            pages: how_pages,
            staged,
            profile_in,
            background_threads: Some(self.config.restore_server.background_threads as usize),
            prefetch_file_pages: self.config.restore_server.prefetch_file_pages,
            cgroup: cgroup
                .as_ref()
                .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files),
            state_dir: Some(self.state_root.clone()),
            gpu_restore_slots: self.gpu_restore_slots.clone(),
            gpu_lane: match self.config.restore_server.driver_lanes {
                DriverLanes::Gpu => placed
                    .as_ref()
                    .map(|p| p.ordinal)
                    .or(woken_on.as_ref().map(|p| p.gpu))
                    .unwrap_or(0),
                DriverLanes::Node => 0,
            },
            // A burst's first instance (it serves the burst) restores in the driver alone; the
            // rest side by side, a lane per GPU.
            gpu_alone: placed.as_ref().is_some_and(|p| p.leads),
            // The driver moves the CUDA state of the deploy's GPU onto the chosen one.
            gpu_map: onto.filter(|_| info.gpu).map_or_else(
                Vec::new,
                crate::runtime::device_choice::from_deploy_gpu_onto,
            ),
            ..HowToRestore::default()
        };
        let staged = how.staged.is_some();
        // Until the instance is adopted, `pages` stops the lazy-pages daemon if dropped (each
        // failure below kills the tree first).
        let RestoredTree {
            init,
            worker,
            pages,
            phases,
            // Passed to its driver restore already.
            gpu_pairs: _,
        } = match restore_with(from, &self.logs_dir(), new.log, how, &self.snapshot_key).await {
            Ok(tree) => tree,
            Err(source) => {
                // CRIU is born in the cgroup, and so is all it forks: what a CRIU killed or
                // crashed mid-restore left there goes now, not with the daemon's next start.
                if let Some(files) = cgroup.as_ref().map(crate::cgroup::Cgroup::procs_files) {
                    let left =
                        tokio::task::spawn_blocking(move || crate::cgroup::kill_procs(&files))
                            .await
                            .unwrap_or(0);
                    if left > 0 {
                        tracing::warn!(
                            function = name,
                            killed = left,
                            "killed what a failed restore left in the instance's cgroup"
                        );
                    }
                }
                let e = StartError::Restore {
                    function: name.to_string(),
                    source,
                };
                if e.gpu_memory_short().is_some() {
                    match (&placed, sleeper) {
                        (Some(p), _) => p.short_of_memory(),
                        // A wake restores where its hibernation was taken: that GPU is
                        // passed over by the cold start that replaces it (wake.rs).
                        (None, Some(_)) if info.gpu => self
                            .placing
                            .short_of_memory_on(woken_on.as_ref().map_or(0, |p| p.gpu)),
                        _ => {}
                    }
                }
                return Err(e);
            }
        };
        new.charge.process_started(init);
        // The test switch of the fault suite: CRIU has restored the tree, the worker is not
        // woken yet, nothing is adopted (`TORPORD_DELAY=restored:<ms>`, or `woken` for a wake).
        crate::journal::delay(if sleeper.is_some() {
            "woken"
        } else {
            "restored"
        })
        .await;
        // Before the instance's registry row (adopt): a daemon killed while its pages are
        // still served must not re-adopt it (crate::recovery::drop_pages_pending).
        if pages.is_some() {
            let hibernation = sleeper.map(|s| s.snapshot_id.as_str());
            if let Err(e) =
                crate::runtime::pages_pending::mark(&self.state_root, new.id, hibernation)
            {
                kill_tree(init);
                return Err(StartError::Restore {
                    function: name.to_string(),
                    source: crate::runtime::process::RestoreTreeError::PagesPending(e),
                });
            }
        }
        let served_mark = pages.is_some().then(|| PagesMark {
            root: self.state_root.clone(),
            id: new.id.to_string(),
        });
        let restore_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let what = format!("an instance of {name:?} restored from {}", from.display());
        // A page server that dies meanwhile fails the start at once: the worker would wait on
        // its next fault until the reconnect timed out.
        let conn = match &pages {
            Some(p) => tokio::select! {
                conn = self.wake_function(name, init, worker, &what) => conn?,
                source = p.failure() => {
                    torpor_snapshot::restore::kill_every_task(init);
                    return Err(StartError::Restore {
                        function: name.to_string(),
                        source: source.into(),
                    });
                }
            },
            None => self.wake_function(name, init, worker, &what).await?,
        };
        let reconnect_s = t.elapsed().as_secs_f64();
        let hello = Instant::now();
        // The instance takes requests once the plan is known; its segments follow.
        let handing = match restoring.planned().await {
            Ok(h) => h,
            Err(source) => {
                kill_tree(init);
                return Err(StartError::Segments { what, source });
            }
        };
        let plan_s = hello.elapsed().as_secs_f64();
        let tree = WorkerTree::new(init, worker, conn, cgroup);
        let adopted = Adopted::new(name, info, generation, sleeper, tree)
            .keeping_hibernation(sleeper.is_some() && pages.is_some());
        let hibernation_row = sleeper
            .filter(|_| pages.is_some())
            .map(|s| s.snapshot_id.clone());
        let inst = self.adopt(new.id, adopted).await?;
        if let Some(d) = onto {
            inst.placed_on(d, info.gpu);
        } else if let Some(p) = &woken_on {
            Self::apply_placement(&inst, p);
        }
        // A woken instance's hibernation snapshot goes once nothing reads it any more: its
        // segments are mapped (they are read from its record meanwhile) and every lazy page is in.
        let hibernation = sleeper.map(|s| Arc::new(RemoveWhenDone(s.snapshot_dir.clone())));
        if handing.count() > 0 {
            let (mapping, done) = crate::split::server::Mapping::new(hello, handing.count());
            *lock(&inst.mapping) = Some(mapping);
            let plan = handing.plan();
            // A hibernation of a migrated instance without its placement file (one an older
            // daemon took): its CUDA state and segments are on the GPU the migration moved it to
            // (workers start on their ordinal 0; crate::runtime::migrate).
            if let Some(d) = plan
                .iter()
                .find(|(e, _)| e.backend == "cuda" && e.ordinal > 0)
                .map(|(e, _)| e.ordinal)
                .filter(|_| onto.is_none() && woken_on.is_none())
            {
                inst.placed_on(u32::try_from(d).unwrap_or(0), true);
            }
            *lock(&inst.segments) = crate::split::release::InstanceSegments::handing(plan);
            // Filled already (from the GPU cache, a shared copy): the first request waits
            // for the map frames, which are all that is left (HandingOver::all_filled).
            let sent_all = handing.all_filled().then(|| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                *lock(&inst.maps_first) = Some(rx);
                tx
            });
            let rt = Arc::clone(self);
            let what = format!("an instance restored from {}", from.display());
            let function_snapshot = sleeper.is_none();
            let inst = Arc::clone(&inst);
            let reading = hibernation.clone();
            tokio::spawn(async move {
                rt.hand_over(inst, handing, done, sent_all, &what, function_snapshot)
                    .await;
                drop(reading);
            });
        }
        if let Some(pages) = pages {
            // A page the lazy-pages daemon failed to serve may be missing: the instance is
            // removed with the cause, then the tree is killed (in that order, or the worker's
            // closed connection would remove it first as a crash).
            inst.pages_pending.store(true, Ordering::SeqCst);
            let (rt, inst) = (Arc::clone(self), Arc::clone(&inst));
            let served = pages.finish_in_background({
                let (rt, inst) = (Arc::clone(&rt), Arc::clone(&inst));
                move |e| rt.remove_instance(&inst, &format!("its lazy pages failed: {e}"), true)
            });
            let reading = hibernation.clone();
            let mark = served_mark;
            tokio::spawn(async move {
                let served = served.await;
                // The fault suite's switch: the pages are in, the marker not yet removed (as
                // a daemon killed while they come leaves it).
                crate::journal::delay("pages-served").await;
                // The marker first: from here a daemon that dies re-adopts the instance (every
                // page is in) or finds it gone; then the hibernation it woke from, whose row
                // was kept for a daemon that died while the pages came.
                drop(mark);
                if let Some(hib) = hibernation_row {
                    let registry = Arc::clone(&rt.registry);
                    let forgot = tokio::task::spawn_blocking(move || {
                        registry.with(|s| s.delete_snapshot(&hib).map(|_| ()))
                    })
                    .await;
                    if let Ok(Err(e)) = forgot {
                        tracing::warn!(instance = %inst.id, error = %e, "cannot remove the row of the hibernation a woken instance came from");
                    }
                }
                drop(reading);
                match served {
                    Ok(Ok(())) => {
                        inst.pages_pending.store(false, Ordering::SeqCst);
                        inst.pages_served.notify_waiters();
                    }
                    // Removed already, before its tree was killed.
                    Ok(Err(_)) => {}
                    Err(_) => rt.remove_instance(
                        &inst,
                        "its lazy pages daemon was lost (the task reaping it ended)",
                        true,
                    ),
                }
            });
        }
        drop(hibernation);
        if onto.is_some() {
            // Where it is, for a daemon that re-adopts it after a crash (as a migration's).
            self.record_placement(&inst).await;
        }
        let leads = placed.as_ref().is_some_and(|p| p.leads);
        drop(placed);
        tracing::info!(function = name, instance = %inst.id, pid = init, device = inst.gpu.load(Ordering::SeqCst), leads, restore_ms = restore_s * 1e3, pages = ?how_pages, staged, "instance restored");
        let mut timings = vec![
            ("restore".to_string(), restore_s),
            ("reconnect".to_string(), reconnect_s),
            ("start".to_string(), restore_s + reconnect_s + plan_s),
        ];
        timings.extend(restore_phases(phases));
        Ok((inst, timings, start::RESTORED))
    }

    /// Sends a restored instance its `map` frames as the fills complete, while it already takes
    /// requests, and waits for the last `mapped` (its reader counts them). A failed fill, a
    /// refused map or a timeout removes the instance (its requests are answered with the cause)
    /// and, for the function snapshot, pauses its restores: a retry would read the same store.
    pub(crate) async fn hand_over(
        self: Arc<Self>,
        inst: Arc<Instance>,
        handing: crate::split::server::HandingOver,
        done: oneshot::Receiver<()>,
        sent_all: Option<oneshot::Sender<()>>,
        what: &str,
        function_snapshot: bool,
    ) {
        inst.joined.notified().await;
        let deadline = tokio::time::Instant::now() + crate::split::server::MAP_TIMEOUT;
        crate::journal::delay("map-frames").await;
        let sent = handing
            .send_maps(&inst.writer, |va, lease| {
                if inst.is_dead() {
                    return;
                }
                if let Some(m) = lock(&inst.mapping).as_mut() {
                    m.sent(va);
                }
                lock(&inst.segments).push(va, lease);
            })
            .await;
        // The first request goes now (on an error too: it then fails with the instance).
        drop(sent_all);
        let failed = match sent {
            Err(e) => e,
            Ok(()) => match tokio::time::timeout_at(deadline, done).await {
                Ok(Ok(())) => return,
                // The mapping was dropped: the instance is gone already, for its own reason.
                Ok(Err(_)) => return,
                Err(_) => {
                    let left = lock(&inst.mapping).as_ref().map_or(0, |m| m.unmapped());
                    crate::split::server::SegmentsError::MapTimeout {
                        left,
                        bound: crate::split::server::MAP_TIMEOUT,
                    }
                }
            },
        };
        if inst.is_dead() {
            return;
        }
        let why = format!("{what} did not get its segments: {failed}");
        if failed.is_out_of_gpu_memory() {
            // The GPU's memory, not the snapshot: restores go on (the next one may find room).
            tracing::warn!(function = %inst.function, instance = %inst.id, error = %why, "a restored instance's segments found too little free GPU memory; its requests fail, restores of the function go on");
        } else if function_snapshot {
            self.restore_failed(&inst.function, true);
            tracing::warn!(function = %inst.function, instance = %inst.id, error = %why, pause_s = RESTORE_PAUSE.as_secs(), "restoring the function snapshot failed after the instance took requests; booting an instance instead of restoring until the pause ends or the function is deployed again");
        }
        self.remove_instance(&inst, &why, true);
    }
}

/// The restore library's phases as request timings, each under `restore.<phase>` so that none
/// can take the name of a request's own phase.
fn restore_phases(phases: torpor_snapshot::phases::Phases) -> impl Iterator<Item = (String, f64)> {
    phases
        .0
        .into_iter()
        .map(|(name, s)| (format!("restore.{name}"), s))
}
