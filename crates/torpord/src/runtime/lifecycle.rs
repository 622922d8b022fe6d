//! An instance's life, in one place: the states it goes through, the transitions between them,
//! and what each transition charges to the metrics (stage seconds and GPU memory·seconds,
//! crate::accounting) and writes to the registry (the instance's row).
//!
//! ```text
//!   (start: boot | restore | wake | standby, crate::runtime::start)      metered as `starting`
//!        │ adopt()                        standby start: Transition::Standby
//!        ▼                                          │
//!      warm ── Transition::ReleaseGpu ──▶ gpu_released ◀┘
//!        ▲ ◀── Transition::ResumeGpu ──────┘  │
//!        │                                   │ Transition::Hibernate (charged `hibernating`
//!        └──────────── Transition::Hibernate ─┤  until the snapshot is in)
//!                                            ▼
//!    wake (Runtime::close_sleeper) ◀─── hibernated ── Transition::Evict ──▶ evicted
//!                                                            │
//!   any state ── remove_instance() / discard_sleeper() ──▶ gone (row deleted)
//! ```
//!
//! The stage an instance is in lives in its [`Keep`] (`Stage`, the registry's four stages);
//! the states around them are flags of the instance: `starting` (counted in its pool, metered by
//! `Runtime::starts`), `standby` (an unused standby, in gpu_released on a GPU function), `busy`
//! (a transition in progress: not routable, not stepped down), `hibernating`, `dead`. Every
//! change of `Keep::stage` goes through [`Runtime::step`], which checks the transition against
//! [`Transition::from`] and charges the time up to it to the stage being left.
//!
//! States that later work adds (a migration, a concurrent checkpoint, a sandbox member) are new
//! [`Transition`]s here, and, where they need a row of their own, new `Stage`s in the registry.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::unix::OwnedReadHalf;

use crate::protocol::{Attached, ToWorker};
use crate::registry::{now_ms, Instance as InstanceRow, Stage};
use crate::runtime::instance::{kill_tree, new_instance, Instance, Keep, Sleeper};
use crate::runtime::pool::{FnInfo, Pool};
use crate::runtime::Runtime;
use crate::sync::lock;
use crate::workers::{self, WorkerConn};

impl Runtime {
    /// Adds the time since the last account to `label` (`keep`'s stage, or hibernating), with
    /// the GPU memory last read for it; `reading`, where one was taken now, stands from now on.
    pub(crate) fn account(
        &self,
        function: &str,
        label: &str,
        keep: &mut Keep,
        reading: Option<u64>,
    ) {
        let charge = keep.meter.close(Instant::now(), reading);
        self.metrics.add_charge(function, label, charge);
    }

    /// Moves `keep` (an instance of `function`) along `t`: accounts the time since the last
    /// account to what [`Transition::charged_as`] says (between ticks nothing is read: the
    /// interval is charged at the last reading, as the next tick would have charged it), then
    /// sets the new stage. A transition from a stage it does not start from is a bug: it is
    /// logged and the stage set anyway (the instance's state must follow what was done to it).
    pub(crate) fn step(&self, function: &str, keep: &mut Keep, t: Transition) {
        if !t.from().contains(&keep.stage) {
            tracing::error!(function, from = %keep.stage, transition = ?t, "an instance took a transition that does not start from its stage");
        }
        if let Some(label) = t.charged_as(keep.stage) {
            self.account(function, label, keep, None);
        }
        keep.stage = t.to();
    }

    /// A hibernated instance (`sleeper`) is taken to be woken: its time as a sleeper is charged
    /// up to now, with no GPU memory from now on (the start is metered as `starting`).
    pub(crate) fn close_sleeper(&self, function: &str, sleeper: &mut Sleeper) {
        let stage = sleeper.keep.stage.as_str();
        self.account(function, stage, &mut sleeper.keep, Some(0));
    }

    /// Records a stage in the registry (blocking pool).
    pub(crate) async fn record_stage(
        &self,
        id: &str,
        stage: Stage,
        pid: Option<i32>,
        snapshot: Option<String>,
    ) -> Result<(), String> {
        let registry = Arc::clone(&self.registry);
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            registry.with(|s| s.set_instance_stage(&id, stage, pid, snapshot.as_deref()))
        })
        .await
        .map_err(|e| format!("registry task failed: {e}"))?
        .map_err(|e| e.to_string())
    }

    /// Makes a connected worker an instance of the pool: records it, starts its reader.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn adopt(
        self: &Arc<Self>,
        id: String,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: Option<&Sleeper>,
        init: i32,
        worker: i32,
        conn: WorkerConn,
    ) -> Result<Arc<Instance>, String> {
        let now = now_ms();
        let (inst, rd) = new_instance(
            id,
            name,
            generation,
            init,
            worker,
            conn,
            Keep::new(Stage::Warm, Instant::now()),
        );
        // Which process it is, so that a restarted daemon re-adopts this one only.
        let Some(process_start) = workers::process_start(init) else {
            kill_tree(init);
            return Err(format!(
                "the new instance of {name:?} (init pid {init}) exited before it was recorded"
            ));
        };
        let row = InstanceRow {
            id: inst.id.clone(),
            function: name.to_string(),
            pid: Some(init),
            stage: Stage::Warm,
            snapshot: Some(info.snapshot_id.clone()),
            started: now,
            last_used: now,
        };
        let registry = Arc::clone(&self.registry);
        let woken = sleeper.map(|s| s.snapshot_id.clone());
        let recorded = tokio::task::spawn_blocking(move || match woken {
            // A woken instance keeps its row; its hibernation snapshot has served.
            Some(hib) => registry.transaction(|s| {
                s.set_instance_stage(&row.id, Stage::Warm, Some(init), row.snapshot.as_deref())?;
                s.touch_instance(&row.id, now)?;
                s.delete_snapshot(&hib)?;
                s.set_instance_process(&row.id, init, process_start)?;
                Ok::<_, crate::registry::RegistryError>(())
            }),
            None => registry.transaction(|s| {
                s.insert_instance(&row)?;
                s.set_instance_process(&row.id, init, process_start)
            }),
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
        if let Err(e) = recorded {
            kill_tree(init);
            return Err(format!("cannot record the new instance of {name:?}: {e}"));
        }
        self.attach(&inst, rd).await;
        Ok(inst)
    }

    /// Tells the worker it is in service (and how long to outlive a lost daemon), then starts
    /// its reader.
    pub(crate) async fn attach(self: &Arc<Self>, inst: &Arc<Instance>, rd: OwnedReadHalf) {
        if inst.announces_start {
            let frame = ToWorker::Attached(Attached {
                reattach_s: self.config.reattach.as_secs_f64(),
            });
            let sent = workers::send(&mut *inst.writer.lock().await, &frame).await;
            if let Err(e) = sent {
                // Its reader sees the end of the connection and removes it.
                tracing::debug!(instance = %inst.id, error = %e, "cannot send attached");
            }
        }
        let rt = Arc::clone(self);
        let reader_inst = Arc::clone(inst);
        tokio::spawn(async move { rt.read_results(reader_inst, rd).await });
    }

    /// Takes an instance out of service for good: fails its requests, kills its tree, drops
    /// its registry row. Idempotent.
    pub fn remove_instance(self: &Arc<Self>, inst: &Arc<Instance>, why: &str, kill: bool) {
        match lock(&self.pools).get(&inst.function).cloned() {
            Some(pool) => self.remove_instance_of(&pool, inst, why, kill),
            None => self.remove_instance_from(None, inst, why, kill),
        }
    }

    pub(crate) fn remove_instance_of(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
        why: &str,
        kill: bool,
    ) {
        self.remove_instance_from(Some(pool), inst, why, kill);
    }

    pub(crate) fn remove_instance_from(
        self: &Arc<Self>,
        pool: Option<&Arc<Pool>>,
        inst: &Arc<Instance>,
        why: &str,
        kill: bool,
    ) {
        if inst.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        *lock(&inst.why_dead) = Some(why.to_string());
        // Dropping the senders fails every request still waiting on this instance.
        lock(&inst.pending).clear();
        lock(&inst.quiet_tx).take();
        // A step waiting for its segment replies sees the end.
        lock(&inst.segment_replies).take();
        lock(&inst.segments).clear();
        // Its hand-over, if one is still going, learns it from the dropped mapping.
        lock(&inst.mapping).take();
        inst.joined.notify_one();
        if kill {
            kill_tree(inst.init_pid);
        }
        if let Some(pool) = pool {
            lock(&pool.state)
                .instances
                .retain(|(i, _)| !Arc::ptr_eq(i, inst));
            pool.changed.notify_waiters();
        }
        if why.starts_with("retired") || why.starts_with("stopped: idle") {
            tracing::info!(instance = %inst.id, function = %inst.function, "instance removed: {why}");
        } else {
            tracing::warn!(instance = %inst.id, function = %inst.function, pid = inst.worker_pid, "instance removed: {why}");
        }
        let registry = Arc::clone(&self.registry);
        let id = inst.id.clone();
        tokio::task::spawn_blocking(move || {
            // Critical: a row left behind would list a process that is gone.
            if let Err(e) = registry.remove_instance_row(&id) {
                tracing::error!(instance = %id, error = %e, "cannot remove the instance's registry row even after releasing the disk reserve: it is out of service and no longer listed; its row goes at a later row removal that succeeds, or at the next start");
            }
        });
    }
}

/// Removes a snapshot directory the daemon wrote (a hibernation), logging a failure.
pub fn remove_snapshot_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove a hibernation snapshot");
        }
    }
    // Its segments in the chunk store, if it is a split snapshot.
    crate::split::release_snapshot_of_dir(dir);
}

/// A snapshot directory removed once the last holder drops it (e.g. a woken hibernation, read
/// by its segment fills and its lazy pages).
pub(crate) struct RemoveWhenDone(pub(crate) PathBuf);

impl Drop for RemoveWhenDone {
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.0);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || remove_snapshot_dir(&dir));
            }
            Err(_) => remove_snapshot_dir(&dir),
        }
    }
}

/// The transitions between an instance's stages (see the module doc). Starting and leaving
/// are not transitions of a stage: [`Runtime::adopt`] creates the stage (warm), and
/// [`Runtime::remove_instance`] / [`Runtime::discard_sleeper`] end it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// warm → gpu_released: the CUDA state checkpointed in place (keep-alive).
    ReleaseGpu,
    /// gpu_released → warm: restored for a request.
    ResumeGpu,
    /// A standby start's instance, just adopted, never served: gpu_released from the start
    /// (its CUDA state was left checkpointed by the restore), nothing charged as warm.
    Standby,
    /// warm or gpu_released → hibernated: quiesced, snapshotted, the process gone.
    Hibernate,
    /// hibernated → evicted: its snapshot's pages dropped from the page cache.
    Evict,
}

impl Transition {
    /// The stages the transition starts from.
    pub fn from(self) -> &'static [Stage] {
        match self {
            Transition::ReleaseGpu | Transition::Standby => &[Stage::Warm],
            Transition::ResumeGpu => &[Stage::GpuReleased],
            Transition::Hibernate => &[Stage::Warm, Stage::GpuReleased],
            Transition::Evict => &[Stage::Hibernated],
        }
    }

    /// The stage it ends in.
    pub fn to(self) -> Stage {
        match self {
            Transition::ReleaseGpu | Transition::Standby => Stage::GpuReleased,
            Transition::ResumeGpu => Stage::Warm,
            Transition::Hibernate => Stage::Hibernated,
            Transition::Evict => Stage::Evicted,
        }
    }

    /// The metrics label the time up to the transition is charged to, leaving `from`; `None`:
    /// nothing is charged (the time goes to the new stage).
    pub fn charged_as(self, from: Stage) -> Option<&'static str> {
        match self {
            Transition::Standby => None,
            // The quiesce and snapshot, until the hibernation is in.
            Transition::Hibernate => Some(crate::metrics::HIBERNATING),
            _ => Some(from.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Transition; 5] = [
        Transition::ReleaseGpu,
        Transition::ResumeGpu,
        Transition::Standby,
        Transition::Hibernate,
        Transition::Evict,
    ];

    #[test]
    fn live_stages_keep_a_process_and_the_others_do_not() {
        for t in ALL {
            for from in t.from() {
                assert!(from.has_process() || *from == Stage::Hibernated, "{t:?}");
            }
            // Only a hibernation ends the process; nothing brings one back in place.
            let ends_process = t.from().iter().all(|f| f.has_process()) && !t.to().has_process();
            assert_eq!(ends_process, t == Transition::Hibernate, "{t:?}");
            assert!(!t.from().contains(&t.to()), "{t:?} must change the stage");
        }
    }

    #[test]
    fn the_time_before_a_transition_goes_to_the_stage_left_except_hibernating_and_standby() {
        assert_eq!(Transition::ReleaseGpu.charged_as(Stage::Warm), Some("warm"));
        assert_eq!(
            Transition::ResumeGpu.charged_as(Stage::GpuReleased),
            Some("gpu_released")
        );
        assert_eq!(
            Transition::Evict.charged_as(Stage::Hibernated),
            Some("hibernated")
        );
        assert_eq!(
            Transition::Hibernate.charged_as(Stage::Warm),
            Some("hibernating")
        );
        assert_eq!(Transition::Standby.charged_as(Stage::Warm), None);
    }
}
