//! Starting an instance. Each way has a file of its own, behind one entry point,
//! [`Runtime::start`] with a [`StartKind`]:
//!
//! - [`boot`]: a fresh `--role function` worker loads the function (`X-Torpor-Start: booted`);
//! - [`restore`]: the function snapshot restored by CRIU, its worker woken (`restored`);
//! - [`wake`]: a hibernated instance restored from its own snapshot (`restored`);
//! - [`standby`]: the function snapshot restored ahead of time, without the driver restore, held
//!   idle in gpu_released until a request takes it (`standby`).
//!
//! Here too: the cold-start policy ([`Runtime::cold_start`]: restore, else boot; restores paused
//! after [`RESTORE_FAILURES_TO_PAUSE`] failures in a row) and the start of an instance for a
//! request in a task of its own ([`Runtime::start_in_task`]). Every way ends in
//! [`Runtime::adopt`] (crate::runtime::lifecycle), which makes the worker a warm instance.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::ColdStart;
use crate::registry::now_ms;
use crate::runtime::instance::{Instance, Sleeper};
use crate::runtime::invoke::{InvokeError, Timings};
use crate::runtime::lifecycle::AdoptError;
use crate::runtime::pool::{Closed, FnInfo, Pool, Starting};
use crate::runtime::process::{RestoreTreeError, WakeFunctionError};
use crate::runtime::Runtime;
use crate::split::server::SegmentsError;
use crate::sync::lock;

pub mod boot;
pub mod pooled;
pub mod restore;
pub mod standby;
pub mod wake;

/// The ways an instance starts; [`Runtime::start`] runs one.
#[derive(Debug, Clone, Copy)]
pub(crate) enum StartKind<'a> {
    /// Boot a fresh worker (boot.rs).
    Boot,
    /// Restore the function snapshot (restore.rs).
    Restore,
    /// Restore a hibernated instance from its own snapshot (wake.rs).
    Wake(&'a Sleeper),
    /// Restore the function snapshot as a standby (standby.rs; GPU functions only).
    Standby,
}

/// Why an instance could not be started ([`Runtime::start`], [`Runtime::cold_start`]); every
/// way's failure names the function, and a tree that was started is killed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The instance's cgroup could not be made (crate::cgroup); nothing was started.
    #[error("cannot make the worker's cgroup: {0}")]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// Booting a worker failed (boot.rs).
    #[error("cannot boot an instance of {function:?}: {source}")]
    Boot {
        function: String,
        #[source]
        source: boot::BootError,
    },
    /// CRIU could not restore the function snapshot or hibernation (restore.rs; CRIU's log is
    /// named inside).
    #[error("cannot start an instance of {function:?}: {source}")]
    Restore {
        function: String,
        #[source]
        source: RestoreTreeError,
    },
    /// CRIU could not restore a standby instance (standby.rs).
    #[error("cannot restore a standby instance of {function:?}: {source}")]
    Standby {
        function: String,
        #[source]
        source: RestoreTreeError,
    },
    /// The driver's restore of a `standby_gpu = "live"` standby failed (the standby was removed).
    #[error("cannot restore the GPU context of a live standby of {function:?}: {source}; set scaling.standby_gpu = \"released\" if it keeps failing")]
    LiveStandby {
        function: String,
        #[source]
        source: Box<crate::runtime::keepalive::ResumeGpuError>,
    },
    /// The restored worker did not come back as an instance of the function.
    #[error(transparent)]
    Wake(#[from] WakeFunctionError),
    /// The restored instance did not get its segments (`what` names it and its snapshot).
    #[error("{what} did not get its segments: {source}")]
    Segments {
        what: String,
        #[source]
        source: SegmentsError,
    },
    /// The task loading the snapshot's segment plan did not finish.
    #[error("split plan task failed: {0}")]
    PlanTask(#[source] tokio::task::JoinError),
    /// The snapshot's segment plan cannot be read.
    #[error(transparent)]
    Plan(#[from] crate::split::PlanError),
    /// The started worker could not be made an instance.
    #[error(transparent)]
    Adopt(#[from] AdoptError),
    /// The function was deleted while its instance started (the instance was stopped).
    #[error("function {function:?} was deleted")]
    Deleted { function: String },
    /// The new instance died before it joined its pool.
    #[error("the new instance of {function:?} was removed: {reason}")]
    Removed { function: String, reason: String },
    /// The restore failed, and the boot that followed it too: both causes.
    #[error("{restore}; booting one instead failed too: {boot}")]
    BootAfterRestore {
        restore: Box<StartError>,
        #[source]
        boot: Box<StartError>,
    },
    /// Restores are paused after failing, and the boot failed.
    #[error("{0} (restores are paused after failing)")]
    BootWhilePaused(#[source] Box<StartError>),
}

impl StartError {
    /// The GPU [`Self::gpu_memory_short`] found too full, when the error names it.
    pub(crate) fn gpu_memory_short_on(&self) -> Option<u32> {
        use torpor_snapshot::restore::RestoreError;
        match self {
            StartError::Restore { source, .. } | StartError::Standby { source, .. } => match source
            {
                RestoreTreeError::Restore(RestoreError::NoRoom { ordinal, .. }) => Some(*ordinal),
                _ => None,
            },
            _ => None,
        }
    }

    /// Why a restore found too little free GPU memory for the snapshot, when that is why this
    /// start failed: the restore's own check, before any process was restored, or the driver's
    /// restore answering `CUDA_ERROR_OUT_OF_MEMORY` (another process took the memory after the
    /// check; the restored tree was killed). Neither says anything about the snapshot.
    pub(crate) fn gpu_memory_short(&self) -> Option<String> {
        use torpor_snapshot::restore::RestoreError;
        match self {
            StartError::Restore { source, .. } | StartError::Standby { source, .. } => match source
            {
                // Without the CLI's advice (`--gpu`): the daemon places its restores itself.
                RestoreTreeError::Restore(RestoreError::NoRoom {
                    ordinal,
                    free,
                    need,
                }) => Some(format!(
                    "GPU {ordinal} has {free} MiB free but the snapshot needs {need} MiB"
                )),
                RestoreTreeError::Restore(e @ RestoreError::Gpu { source })
                    if source.source.is_out_of_memory() =>
                {
                    Some(format!("{e}"))
                }
                _ => None,
            },
            _ => None,
        }
    }
}

/// What one request's starts found short of GPU memory, the latest figures per GPU: its 503
/// names every GPU it tried, as on a node of several each retry may be placed on another.
#[derive(Debug, Default)]
pub(crate) struct GpuShortfalls {
    /// (the GPU, when the error names it; why), in the order first found; one entry per GPU.
    found: Vec<(Option<u32>, String)>,
}

impl GpuShortfalls {
    /// Adds `e` when a start failed for too little GPU memory (whether it did).
    pub(crate) fn add(&mut self, e: &StartError) -> bool {
        let Some(why) = e.gpu_memory_short() else {
            return false;
        };
        let gpu = e.gpu_memory_short_on();
        // A driver's out-of-memory names no GPU: its latest one stands for all of them (each
        // names another pid).
        match self.found.iter_mut().find(|(g, _)| *g == gpu) {
            Some(seen) => seen.1 = why,
            None => self.found.push((gpu, why)),
        }
        true
    }

    /// The request's answer: 503, every shortfall found in one line.
    pub(crate) fn error(&self, function: &str) -> InvokeError {
        let why = self
            .found
            .iter()
            .map(|(_, w)| w.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        InvokeError::NoGpuMemory {
            message: format!(
                "cannot start an instance of {function:?}: {why}; the request was not run: \
                 retry later, or free GPU memory on this node (its other processes, \
                 or other functions' idle instances: a shorter keepalive.gpu_release_s)"
            ),
            retry_after_s: 1,
        }
    }
}

/// A started instance, the timings of its start, and its start label (`X-Torpor-Start`).
pub(crate) type Started = (Arc<Instance>, Timings, &'static str);
/// Consecutive failed restores of a function snapshot after which its cold starts boot
/// without trying to restore, for [`RESTORE_PAUSE`].
pub const RESTORE_FAILURES_TO_PAUSE: u32 = 3;
/// How long restores of a failing function snapshot are skipped; a redeploy ends it at once.
pub const RESTORE_PAUSE: Duration = Duration::from_secs(300);

/// Failed restores of one function's snapshot in a row, and until when restores are skipped.
#[derive(Debug, Default)]
pub(crate) struct RestoreHealth {
    pub(crate) failures: u32,
    pub(crate) paused_until: Option<Instant>,
}

/// What every way of starting one instance shares: its id, its log file, its GPU meter.
pub(crate) struct NewInstance<'a, 'g> {
    pub(crate) id: &'a str,
    pub(crate) log: &'a Path,
    pub(crate) charge: &'a crate::accounting::StartGuard<'g>,
}

impl Runtime {
    /// Starts an instance for a request in a task of its own, so that a request given up
    /// mid-way, or one that took another instance first (late binding, crate::runtime::pool),
    /// leaves no half-counted instance: the instance then joins the pool idle. The receiver
    /// gets the instance counted for the request; [`Self::start_outcome`] maps its error.
    /// A receiver closed before the instance was sent makes the task give the request's count
    /// back; one closed after must give it back itself ([`Self::unclaimed_start`]).
    pub(crate) fn start_in_task(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        info: FnInfo,
        generation: u64,
        sleeper: Option<Sleeper>,
        demand: Option<crate::runtime::memory::Demand>,
    ) -> oneshot::Receiver<Result<Started, StartError>> {
        let (tx, rx) = oneshot::channel();
        let rt = Arc::clone(self);
        let pool2 = Arc::clone(pool);
        tokio::spawn(async move {
            let mut guard = Starting {
                pool: Arc::clone(&pool2),
                armed: true,
            };
            let mut sleeper = sleeper;
            if let Some(s) = sleeper.as_mut() {
                rt.close_sleeper(&pool2.name, s);
            }
            let gpu_fallback = if info.gpu { info.gpu_bytes } else { 0 };
            let charge = rt
                .starts
                .begin(&pool2.name, gpu_fallback, Arc::clone(&rt.metrics));
            let started = match &sleeper {
                Some(s) => {
                    rt.wake_or_cold_start(&pool2.name, &info, generation, s, &charge)
                        .await
                }
                None => rt.cold_start(&pool2.name, &info, generation, &charge).await,
            };
            match &started {
                Ok((inst, _, _)) => charge.finish_into(&mut lock(&inst.keep).meter),
                Err(_) => drop(charge),
            }
            guard.armed = false;
            let mut st = lock(&pool2.state);
            st.starting -= 1;
            let out = match started {
                Ok((inst, _, _)) if st.closed.is_some() => {
                    let why = st.closed.map_or("stopped", Closed::why);
                    drop(st);
                    rt.remove_instance_of(&pool2, &inst, why, true);
                    st = lock(&pool2.state);
                    Err(StartError::Deleted {
                        function: pool2.name.clone(),
                    })
                }
                // Removed already (its worker died): its removal found it in no pool, so it must
                // not join one now.
                Ok((inst, _, _)) if inst.is_dead() => Err(StartError::Removed {
                    function: pool2.name.clone(),
                    reason: inst.reason(),
                }),
                Ok((inst, timings, kind)) => {
                    st.instances.push((Arc::clone(&inst), 1));
                    // Its request's room, taken as it joins (under the pool's lock, like
                    // every reservation: crate::runtime::memory).
                    if let Some(d) = &demand {
                        rt.memory_reserve(&inst.id, d);
                    }
                    Ok((inst, timings, kind))
                }
                Err(e) => Err(e),
            };
            drop(st);
            if let Ok((inst, _, _)) = &out {
                inst.joined.notify_one();
            }
            if let Err(Ok((inst, _, _))) = tx.send(out) {
                // The request went away, or took another instance: this one is idle.
                rt.unclaimed_start(&pool2, &inst, demand.as_ref());
            }
            pool2.changed.notify_waiters();
        });
        rx
    }

    /// Gives back the request's count on an instance started for it that it did not take (it
    /// went away, or took another instance first): the instance is idle from now on.
    pub(crate) fn unclaimed_start(
        &self,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
        demand: Option<&crate::runtime::memory::Demand>,
    ) {
        if let Some(slot) = lock(&pool.state)
            .instances
            .iter_mut()
            .find(|(i, _)| Arc::ptr_eq(i, inst))
        {
            // Another request may have taken it meanwhile (requests_per_instance > 1).
            slot.1 = slot.1.saturating_sub(1);
            if slot.1 == 0 {
                lock(&inst.keep).idle_since = Instant::now();
            }
            if let Some(d) = demand {
                self.memory_unreserve(&inst.id, &d.function, d.peak);
            }
        }
        pool.changed.notify_waiters();
    }

    /// The outcome of [`Self::start_in_task`] as the request's answer (`short`: what the
    /// request's starts found short of GPU memory so far, this one's added).
    /// `None`: the task ended without an answer.
    pub(crate) fn start_outcome(
        pool: &Pool,
        got: Option<Result<Started, StartError>>,
        short: &mut GpuShortfalls,
    ) -> Result<Started, InvokeError> {
        got.ok_or_else(|| InvokeError::Internal("the instance start task failed".to_string()))?
            .map_err(|e| {
                if short.add(&e) {
                    short.error(&pool.name)
                } else {
                    InvokeError::Internal(e.to_string())
                }
            })
    }

    /// Runs one way of starting an instance of `name` (`new`: its id, log and meter).
    pub(crate) async fn start(
        self: &Arc<Self>,
        kind: StartKind<'_>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        new: &NewInstance<'_, '_>,
    ) -> Result<Started, StartError> {
        match kind {
            StartKind::Boot => self.boot_instance(name, info, generation, new).await,
            StartKind::Restore => {
                self.restore_instance(name, info, generation, None, new)
                    .await
            }
            StartKind::Wake(sleeper) => {
                self.wake_instance(name, info, generation, sleeper, new)
                    .await
            }
            StartKind::Standby => {
                let inst = self.restore_standby(name, info, generation, new).await?;
                Ok((inst, Vec::new(), crate::metrics::start::STANDBY))
            }
        }
    }

    /// The id and log of a new instance of `name` (`id`: a woken instance keeps its own);
    /// the function's older logs are pruned meanwhile.
    pub(crate) fn instance_files(&self, name: &str, id: Option<&str>) -> (String, PathBuf) {
        let id = id.map_or_else(
            || format!("{name}-{}-{}", now_ms(), self.next()),
            str::to_string,
        );
        let log = crate::instance_logs::instance_log(&self.logs_dir(), name, &id);
        crate::instance_logs::prune_in_background(
            Arc::clone(&self.registry),
            self.logs_dir(),
            name.to_string(),
        );
        (id, log)
    }

    /// A cold start: restores the function snapshot, else (with `cold_start = "boot"`, when
    /// the restore fails, or while restores are paused) boots an instance.
    pub(crate) async fn cold_start(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        charge: &crate::accounting::StartGuard<'_>,
    ) -> Result<Started, StartError> {
        let (id, log) = self.instance_files(name, None);
        let new = NewInstance {
            id: &id,
            log: &log,
            charge,
        };
        if self.config.cold_start == ColdStart::Boot {
            return self
                .start(StartKind::Boot, name, info, generation, &new)
                .await;
        }
        // A sandboxed function's first start on the node: into a ready sandbox (pooled).
        match self.pooled_start(name, info, generation, &new).await {
            Ok(Some(started)) => return Ok(started),
            Ok(None) => {}
            Err(e) => {
                self.sandbox_pool_failed(name);
                tracing::warn!(function = name, error = %e, "starting in a ready sandbox failed; restoring the function snapshot instead, and its later starts too until it is deployed again")
            }
        }
        let paused = lock(&self.restore_health)
            .get(name)
            .and_then(|h| h.paused_until)
            .is_some_and(|until| Instant::now() < until);
        if info.stale_credentials.is_some() {
            // Its snapshot would restore the credentials of before (pool(): warned once).
            self.metrics
                .restore_fallbacks
                .with_label_values(&[name])
                .inc();
            return self
                .start(StartKind::Boot, name, info, generation, &new)
                .await;
        }
        let mut restore_error = None;
        if !paused {
            let t = Instant::now();
            match self
                .start(StartKind::Restore, name, info, generation, &new)
                .await
            {
                Ok(started) => {
                    self.sandbox_pool_restored(name, &info.spec, t.elapsed().as_secs_f64());
                    // The failure count only: a pause the instance's background segment
                    // hand-over set meanwhile (a corrupt chunk) must stand.
                    if let Some(h) = lock(&self.restore_health).get_mut(name) {
                        h.failures = 0;
                    }
                    return Ok(started);
                }
                // Too little free GPU memory says nothing about the snapshot, and a boot
                // needs the same memory: the request waits for it instead (pool::acquire).
                Err(e) if e.gpu_memory_short().is_some() => return Err(e),
                // The daemon stops: no boot now (the pool is closed; it would be stopped).
                Err(e) if self.stopping.load(std::sync::atomic::Ordering::SeqCst) => return Err(e),
                Err(e) => {
                    let failures = self.restore_failed(name, false);
                    tracing::warn!(function = name, error = %e, failures, "restoring the function snapshot failed; booting an instance instead");
                    if failures >= RESTORE_FAILURES_TO_PAUSE {
                        tracing::warn!(function = name, pause_s = RESTORE_PAUSE.as_secs(), "{failures} restores in a row failed: booting instances without trying to restore until the pause ends or the function is deployed again");
                    }
                    restore_error = Some(e);
                }
            }
        }
        self.metrics
            .restore_fallbacks
            .with_label_values(&[name])
            .inc();
        self.start(StartKind::Boot, name, info, generation, &new)
            .await
            .map_err(|boot| match restore_error {
                Some(restore) => StartError::BootAfterRestore {
                    restore: Box::new(restore),
                    boot: Box::new(boot),
                },
                None => StartError::BootWhilePaused(Box::new(boot)),
            })
    }

    /// Counts a failed restore of `name`'s function snapshot (pausing restores after
    /// [`RESTORE_FAILURES_TO_PAUSE`] in a row, or at once with `pause_now`); the count.
    pub(crate) fn restore_failed(&self, name: &str, pause_now: bool) -> u32 {
        let mut health = lock(&self.restore_health);
        let h = health.entry(name.to_string()).or_default();
        h.failures += 1;
        if pause_now || h.failures >= RESTORE_FAILURES_TO_PAUSE {
            h.paused_until = Some(Instant::now() + RESTORE_PAUSE);
        }
        h.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_restore_out_of_gpu_memory_is_a_lack_of_memory_not_a_bad_snapshot() {
        use torpor_snapshot::gpu_tasks::StepError;
        use torpor_snapshot::restore::RestoreError;
        let driver = |code| StartError::Restore {
            function: "f".into(),
            source: RestoreTreeError::Restore(RestoreError::Gpu {
                source: StepError {
                    step: "restore",
                    pid: 7,
                    source: torpor_cuda::CudaError::Call {
                        function: "cuCheckpointProcessRestore",
                        pid: Some(7),
                        code,
                        name: "CUDA_ERROR_X".into(),
                    },
                },
            }),
        };
        let why = driver(2).gpu_memory_short().expect("out of memory");
        assert!(why.contains("cuCheckpointProcessRestore"), "{why}");
        assert!(why.contains("too little free memory"), "{why}");
        // Any other driver failure is the snapshot's, and counts as a failed restore.
        assert_eq!(driver(304).gpu_memory_short(), None);
        let check = StartError::Restore {
            function: "f".into(),
            source: RestoreTreeError::Restore(RestoreError::NoRoom {
                ordinal: 0,
                free: 10,
                need: 64,
            }),
        };
        assert!(check.gpu_memory_short().is_some());
    }

    #[test]
    fn a_request_short_of_gpu_memory_names_every_gpu_it_tried_with_the_latest_figures() {
        use torpor_snapshot::restore::RestoreError;
        let full = |ordinal, free| StartError::Restore {
            function: "f".into(),
            source: RestoreTreeError::Restore(RestoreError::NoRoom {
                ordinal,
                free,
                need: 64,
            }),
        };
        let mut short = GpuShortfalls::default();
        assert!(short.add(&full(0, 20)));
        assert!(short.add(&full(1, 10)));
        assert!(short.add(&full(0, 30)));
        let other = StartError::Deleted {
            function: "f".into(),
        };
        assert!(!short.add(&other), "not a lack of memory");
        // The driver's out-of-memory names a pid, not a GPU: the latest one stands.
        let driver = |pid| StartError::Restore {
            function: "f".into(),
            source: RestoreTreeError::Restore(RestoreError::Gpu {
                source: torpor_snapshot::gpu_tasks::StepError {
                    step: "restore",
                    pid,
                    source: torpor_cuda::CudaError::Call {
                        function: "cuCheckpointProcessRestore",
                        pid: Some(pid),
                        code: 2,
                        name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
                    },
                },
            }),
        };
        assert!(short.add(&driver(7)) && short.add(&driver(8)));
        let InvokeError::NoGpuMemory {
            message,
            retry_after_s,
        } = short.error("f")
        else {
            panic!("a 503 for GPU memory");
        };
        assert_eq!(retry_after_s, 1);
        assert!(
            message.contains(
                "GPU 0 has 30 MiB free but the snapshot needs 64 MiB; \
                 GPU 1 has 10 MiB free but the snapshot needs 64 MiB; restore of CUDA process 8"
            ),
            "{message}"
        );
        assert!(
            !message.contains("20 MiB"),
            "GPU 0's earlier figures: {message}"
        );
        assert!(
            message.contains("pid 8") && !message.contains("pid 7"),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message}");
    }

    #[test]
    fn a_boot_after_a_failed_restore_keeps_both_errors() {
        let restore = StartError::Removed {
            function: "f".into(),
            reason: "its worker exited".into(),
        };
        let boot = StartError::Deleted {
            function: "f".into(),
        };
        let both = StartError::BootAfterRestore {
            restore: Box::new(restore),
            boot: Box::new(boot),
        };
        assert_eq!(
            both.to_string(),
            "the new instance of \"f\" was removed: its worker exited; booting one instead \
             failed too: function \"f\" was deleted"
        );
        let StartError::BootAfterRestore { restore, .. } = &both else {
            unreachable!()
        };
        assert!(matches!(**restore, StartError::Removed { .. }));
        let source = std::error::Error::source(&both).map(ToString::to_string);
        assert_eq!(source.as_deref(), Some("function \"f\" was deleted"));
        let paused = StartError::BootWhilePaused(Box::new(StartError::Deleted {
            function: "f".into(),
        }));
        assert_eq!(
            paused.to_string(),
            "function \"f\" was deleted (restores are paused after failing)"
        );
    }
}
