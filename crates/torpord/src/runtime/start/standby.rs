//! Standby instances (`[scaling] standby = N`; docs/split.md, "Standby instances"): the CRIU part
//! of a cold start done ahead of time. On the H100 a split restore of GPT-2-Large spends almost
//! all of its ~1.3 s in CRIU copying host pages; the driver restore and the segments take the
//! rest. So the daemon keeps N instances per function restored by CRIU *without* the driver
//! restore (`RestoreOptions::resume_gpu = false`): their CUDA state stays locked + checkpointed,
//! which is exactly an instance in keep-alive stage gpu_released, and their segments are not
//! handed over (released since the capture). A request takes one through the gpu_released resume
//! (driver restore + unlock, then the segments filled and mapped), `X-Torpor-Start: standby`.
//!
//! A standby holds no GPU memory, only the host memory of its process. It counts towards
//! `max_instances` in every state (a start in progress in `starting`), is exempt from the
//! keep-alive stages while unused (stepping it down would only churn), and becomes an ordinary
//! instance once it serves a request; the ticker then starts another.
//!
//! A CPU function (`gpus = 0`) has no driver restore to put off: its standbys are fully restored
//! idle instances (segments mapped), which saves the whole restore.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ColdStart;
use crate::registry::Stage;
use crate::runtime::instance::Instance;
use crate::runtime::keepalive::ResumeGpuError;
use crate::runtime::lifecycle::{Adopted, WorkerTree};
use crate::runtime::lifecycle::{State, Transition};
use crate::runtime::pool::{Closed, FnInfo, Pool, PoolState};
use crate::runtime::process::{restore_with, HowToRestore};
use crate::runtime::start::{NewInstance, StartError, StartKind};
use crate::runtime::Runtime;
use crate::spec::StandbyGpu;
use crate::sync::lock;

/// The longest wait between failed standby starts of one function.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// A pool's standby bookkeeping.
#[derive(Debug, Default)]
pub struct PoolStandby {
    /// Standby starts under way (each also counted in the pool's `starting`).
    pub starting: usize,
    /// Failed standby starts in a row.
    failures: u32,
    /// No standby start before this (after a failure).
    retry_at: Option<Instant>,
}

impl PoolStandby {
    /// A start worked, or a new deploy gives its snapshot a fresh start.
    pub fn clear_failures(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }

    fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let delay = retry_delay(self.failures);
        self.retry_at = Some(now + delay);
        delay
    }
}

/// How long to wait after `failures` failed standby starts in a row: 1 s, doubling, at most
/// [`MAX_RETRY_DELAY`] (a snapshot that cannot be restored must not be retried every tick).
pub fn retry_delay(failures: u32) -> Duration {
    let secs = 1u64 << failures.saturating_sub(1).min(6);
    Duration::from_secs(secs).min(MAX_RETRY_DELAY)
}

/// How many standbys to start now: enough for `want` idle ones counting those `ready` and those
/// `starting`, as far as `max_instances` allows with `occupied` (every instance of the pool in any
/// state, starts included).
pub fn to_start(
    want: usize,
    ready: usize,
    starting: usize,
    occupied: usize,
    max_instances: usize,
) -> usize {
    let missing = want.saturating_sub(ready + starting);
    missing.min(max_instances.saturating_sub(occupied))
}

/// Whether `inst` is an unused standby (a request takes it through `Transition::TakeStandby`,
/// in crate::runtime::pool's `acquire`).
pub fn is_standby(inst: &Instance) -> bool {
    matches!(inst.state(), State::Standby(_))
}

/// The unused standbys of the pool's current deploy.
pub(crate) fn ready(st: &PoolState) -> usize {
    st.instances
        .iter()
        .filter(|(i, n)| *n == 0 && is_standby(i) && !i.is_dead() && i.generation == st.generation)
        .count()
}

/// The ticker's decision for one pool, under its lock: how many standbys are ready, and the
/// starts to spawn (already counted in `starting`).
pub(crate) fn plan(st: &mut PoolState, cold_start: ColdStart, now: Instant) -> (usize, usize) {
    let ready = ready(st);
    let want = st.info.standby;
    if st.closed.is_some() || want == 0 || cold_start != ColdStart::Restore {
        return (ready, 0);
    }
    if st.standby.retry_at.is_some_and(|t| now < t) {
        return (ready, 0);
    }
    let occupied = st.instances.len() + st.starting + st.sleepers.len();
    let n = to_start(
        want,
        ready,
        st.standby.starting,
        occupied,
        st.info.max_instances,
    );
    st.starting += n;
    st.standby.starting += n;
    (ready, n)
}

/// Undoes a standby start's count in `starting` unless defused (its task went away mid-way).
struct Counted {
    pool: Arc<Pool>,
    armed: bool,
}

impl Counted {
    fn done(&mut self, st: &mut PoolState) {
        if std::mem::take(&mut self.armed) {
            st.starting -= 1;
            st.standby.starting -= 1;
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.armed {
            let pool = Arc::clone(&self.pool);
            self.done(&mut lock(&pool.state));
            pool.changed.notify_waiters();
        }
    }
}

impl Runtime {
    /// After a deploy, and at startup: a function that wants standbys gets its pool now, so that
    /// the keep-alive ticker starts them before the first request.
    pub async fn keep_standbys(self: &Arc<Self>, name: &str, spec: &serde_json::Value) {
        let want = spec
            .pointer("/scaling/standby")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0);
        if want == 0 {
            return;
        }
        if self.config.cold_start != ColdStart::Restore {
            tracing::warn!(function = name, standby = want, "scaling.standby is ignored: standby instances are restored, and this torpord runs with cold_start = \"boot\"; set cold_start = \"restore\" to keep them");
            return;
        }
        if let Err(e) = self.pool(name).await {
            tracing::warn!(function = name, error = ?e, "cannot keep standby instances");
        }
    }

    /// At startup: [`Runtime::keep_standbys`] for every ready function.
    pub async fn take_up_standbys(self: &Arc<Self>) {
        let registry = Arc::clone(&self.registry);
        let functions = tokio::task::spawn_blocking(move || registry.with(|s| s.functions())).await;
        let functions = match functions {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot list the functions to keep standby instances of");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "registry task failed");
                return;
            }
        };
        for f in functions {
            if f.state == crate::registry::FunctionState::Ready {
                self.keep_standbys(&f.name, &f.spec).await;
            }
        }
    }

    /// Starts one standby of `pool` (counted in `starting` by [`plan`]), and adds it to the pool
    /// idle; an instance of an older deploy, or of a deleted function, is removed instead.
    pub(crate) async fn start_standby(
        self: Arc<Self>,
        pool: Arc<Pool>,
        info: FnInfo,
        generation: u64,
    ) {
        let mut counted = Counted {
            pool: Arc::clone(&pool),
            armed: true,
        };
        // A released GPU standby holds no GPU memory: nothing to charge without NVML; a live
        // one holds its context, charged at the spec's estimate without NVML (errs high).
        let live = info.gpu && info.standby_gpu == StandbyGpu::Live;
        let fallback = if live { info.gpu_bytes } else { 0 };
        let charge = self
            .starts
            .begin(&pool.name, fallback, Arc::clone(&self.metrics));
        let t = Instant::now();
        let started = if info.gpu {
            let (id, log) = self.instance_files(&pool.name, None);
            let new = NewInstance {
                id: &id,
                log: &log,
                charge: &charge,
            };
            self.start(StartKind::Standby, &pool.name, &info, generation, &new)
                .await
                .map(|(inst, _, _)| inst)
        } else {
            // Nothing to put off on a CPU function: a fully restored idle instance.
            self.cold_start(&pool.name, &info, generation, &charge)
                .await
                .map(|(inst, _, _)| inst)
        };
        match &started {
            Ok(inst) => charge.finish_into(&mut lock(&inst.keep).meter),
            Err(_) => drop(charge),
        }
        let mut st = lock(&pool.state);
        counted.done(&mut st);
        match started {
            Ok(inst) if st.closed.is_some() || st.generation != generation => {
                let why = st.closed.map_or(
                    "retired: a newer deploy or `torpor stop` replaced it before it served",
                    Closed::why,
                );
                drop(st);
                self.remove_instance(&inst, why, true);
            }
            Ok(inst) => {
                {
                    // A CPU function's standby is a warm instance, from now on routed to last.
                    let mut keep = lock(&inst.keep);
                    if keep.state == State::Warm {
                        let t = Transition::Standby {
                            gpu_released: false,
                        };
                        let _ = self.step(&pool.name, &mut keep, t);
                    }
                }
                st.instances.push((Arc::clone(&inst), 0));
                st.standby.clear_failures();
                drop(st);
                inst.joined.notify_one();
                tracing::info!(function = %pool.name, instance = %inst.id, pid = inst.init_pid, start_ms = t.elapsed().as_secs_f64() * 1e3, "standby instance ready");
            }
            Err(e) => {
                let delay = st.standby.failed(Instant::now());
                drop(st);
                tracing::warn!(function = %pool.name, error = %e, retry_s = delay.as_secs(), "cannot start a standby instance");
            }
        }
        pool.changed.notify_waiters();
    }

    /// The CRIU part of a restore of the function snapshot, without the driver restore, then the
    /// worker's wake-up: an instance in gpu_released whose segments (split path) are all still
    /// to be filled.
    pub(crate) async fn restore_standby(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        new: &NewInstance<'_, '_>,
    ) -> Result<Arc<Instance>, StartError> {
        let (split, snapshot) = (Arc::clone(&self.split), info.snapshot_id.clone());
        let tenant = crate::tenant::of_spec(&info.spec).to_string();
        let plan = tokio::task::spawn_blocking(move || split.plan(&snapshot, &tenant))
            .await
            .map_err(StartError::PlanTask)??;
        // A standby goes onto the node's least loaded GPU, as a cold start does
        // (crate::runtime::device_choice): it serves there once a request takes it. A live
        // one's driver restore below passes the pairs; a released one owes them to the resume
        // of its first request (kept in its placement file across a daemon's restart).
        let live = info.standby_gpu == StandbyGpu::Live;
        let placed = self.place_standby(name, new.id, info);
        let onto = placed.as_ref().map(|p| p.ordinal).filter(|&d| d != 0);
        // Copy pages, from the staged copy when there is one: off the request's path, and a
        // GPU worker's driver restore would fault in lazy pages one by one later.
        let cgroup = self.worker_cgroup(new.id, &info.spec)?;
        let how = HowToRestore {
            pages: torpor_snapshot::restore::PageSource::Copy,
            staged: self.staging.get(&info.snapshot_dir),
            leave_gpu_checkpointed: true,
            prefetch_file_pages: self.config.restore_server.prefetch_file_pages,
            cgroup: cgroup
                .as_ref()
                .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files),
            state_dir: Some(self.state_root.clone()),
            // The pairs come back in the tree, for the driver restore below.
            gpu_map: onto.map_or_else(
                Vec::new,
                crate::runtime::device_choice::from_deploy_gpu_onto,
            ),
            ..HowToRestore::default()
        };
        let tree = match restore_with(
            &info.snapshot_dir,
            &self.logs_dir(),
            new.log,
            how,
            &self.snapshot_key,
        )
        .await
        {
            Ok(tree) => tree,
            Err(source) => {
                let e = StartError::Standby {
                    function: name.to_string(),
                    source,
                };
                // As for a cold start: a GPU without room is passed over for a while.
                if let (Some(p), Some(_)) = (&placed, e.gpu_memory_short()) {
                    p.short_of_memory();
                }
                return Err(e);
            }
        };
        let (init, worker, mut gpu_pairs) = (tree.init, tree.worker, tree.gpu_pairs);
        new.charge.process_started(init);
        let what = format!("a standby instance of {name:?}");
        let conn = self.wake_function(name, init, worker, &what).await?;
        let tree = WorkerTree::new(init, worker, conn, cgroup);
        // gpu_released until its driver restore: a live one's comes below.
        let adopted = Adopted::new(name, info, generation, None, tree).in_stage(Stage::GpuReleased);
        let inst = self.adopt(new.id, adopted).await?;
        if let Some(d) = onto {
            inst.placed_on(d, true);
        }
        // Owed until a driver restore pays them: a live one's just below, a released one's at
        // its first request's resume.
        *lock(&inst.owed_gpu_pairs) = std::mem::take(&mut gpu_pairs);
        if onto.is_some() {
            // Where it is and what it owes, for a daemon that re-adopts it after a crash (as a
            // placed start's).
            self.record_placement(&inst).await;
        }
        if let Some(plan) = plan {
            // Filled on the GPU it is on when a request takes it.
            let plan = match onto {
                Some(d) => Arc::new(crate::split::server::on_gpu(
                    &plan,
                    i32::try_from(d).unwrap_or(0),
                )),
                None => plan,
            };
            *lock(&inst.segments) = crate::split::release::InstanceSegments::unfilled(plan);
        }
        // `standby_gpu = "live"`: the driver's restore now, off the request's path; the
        // standby then holds its context's GPU memory, and a request pays only the segments.
        if live {
            crate::journal::delay("standby-driver").await;
            let pairs = lock(&inst.owed_gpu_pairs).clone();
            match self.driver_resume(inst.worker_pid, pairs).await {
                Ok(s) => {
                    lock(&inst.owed_gpu_pairs).clear();
                    if onto.is_some() {
                        // Paid: a restarted daemon must not pass them again.
                        self.record_placement(&inst).await;
                    }
                    tracing::debug!(instance = %inst.id, driver_restore_s = s, "live standby: GPU context restored")
                }
                Err(e) => {
                    if let (Some(p), ResumeGpuError::Cuda(c)) = (&placed, &e) {
                        if c.is_out_of_memory() {
                            p.short_of_memory();
                        }
                    }
                    let why = format!("the driver's restore of a live standby failed: {e}");
                    self.remove_instance(&inst, &why, true);
                    return Err(StartError::LiveStandby {
                        function: name.to_string(),
                        source: Box::new(e),
                    });
                }
            }
        }
        // Not in the pool yet: nothing routes to it before its stage is recorded.
        let _ = self.step(
            name,
            &mut lock(&inst.keep),
            Transition::Standby {
                gpu_released: !live,
            },
        );
        // Its row says gpu_released from its adoption: a live one's driver restore is done now.
        if live {
            if let Err(e) = self
                .record_stage(&inst.id, Stage::Warm, Some(init), None)
                .await
            {
                tracing::warn!(instance = %inst.id, error = %e, "cannot record the standby's stage");
            }
        }
        tracing::debug!(instance = %inst.id, device = inst.gpu.load(std::sync::atomic::Ordering::SeqCst), "standby placed");
        drop(placed);
        Ok(inst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_the_missing_standbys() {
        assert_eq!(to_start(2, 0, 0, 0, 4), 2);
        assert_eq!(to_start(2, 1, 0, 1, 4), 1);
        // One being started counts.
        assert_eq!(to_start(2, 1, 1, 2, 4), 0);
        assert_eq!(to_start(1, 1, 0, 1, 4), 0);
        assert_eq!(to_start(0, 0, 0, 0, 4), 0);
    }

    #[test]
    fn max_instances_holds_whatever_else_runs() {
        // Busy instances, sleepers and other starts fill the pool: no room for a standby.
        assert_eq!(to_start(1, 0, 0, 4, 4), 0);
        assert_eq!(to_start(3, 0, 0, 2, 4), 2);
        // More occupied than allowed (a redeploy lowered max_instances): none, no underflow.
        assert_eq!(to_start(2, 0, 0, 6, 4), 0);
        // More ready than wanted (standby lowered): none.
        assert_eq!(to_start(1, 3, 0, 3, 4), 0);
    }

    #[test]
    fn retries_back_off_to_a_minute() {
        assert_eq!(retry_delay(0), Duration::from_secs(1));
        assert_eq!(retry_delay(1), Duration::from_secs(1));
        assert_eq!(retry_delay(2), Duration::from_secs(2));
        assert_eq!(retry_delay(4), Duration::from_secs(8));
        assert_eq!(retry_delay(7), MAX_RETRY_DELAY);
        assert_eq!(retry_delay(u32::MAX), MAX_RETRY_DELAY);
    }

    #[test]
    fn a_failure_holds_back_the_next_start_and_a_success_clears_it() {
        let now = Instant::now();
        let mut s = PoolStandby::default();
        assert_eq!(s.failed(now), Duration::from_secs(1));
        assert_eq!(s.failed(now), Duration::from_secs(2));
        assert_eq!(s.retry_at, Some(now + Duration::from_secs(2)));
        s.clear_failures();
        assert_eq!((s.failures, s.retry_at), (0, None));
    }
}
