//! Keep-alive in stages (docs/torpord.md, "Keep-alive stages"). An idle instance steps down
//! warm → gpu_released (only `gpus = 1`: CUDA driver lock + checkpoint in place, the process
//! kept; on the split path its segments are unmapped first and mapped back on resume,
//! crate::split::release) → hibernated (quiesced and snapshotted in kill mode to `snapshots/hib-<fn>-<id>-<unix ms>`, the
//! process gone) → evicted (the hibernation snapshot's pages dropped from the page cache). The
//! delays are idle times, counted from the end of the instance's last request.
//!
//! A ticker checks every [`TICK`]: it starts the due stage changes (each in a task of its own,
//! with the instance marked busy so that nothing routes to it meanwhile) and adds the time spent
//! in each stage, and GPU memory·seconds, to the metrics: for live instances, for instances being
//! started and for hibernated ones ([`crate::accounting`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::accounting::{self, Meter};
use crate::config::ColdStart;
use crate::journal::hibernation_step as step;
use crate::journal::Journal;
use crate::protocol::{Empty, Quiesce, ToWorker, Unmap};
use crate::registry::{now_ms, JournalOp, RegistryError, Stage};
use crate::runtime::lifecycle::{Doing, State, Transition};
use crate::runtime::pool::FnInfo;
use crate::runtime::process::{CUDA_LOCK_TIMEOUT, QUIET_TIMEOUT};
use crate::runtime::{lock, remove_snapshot_dir, Instance, Keep, Pool, Runtime, Sleeper};
use crate::split::server::SegmentsError;
use crate::workers;

/// How often the keep-alive ticker runs.
pub const TICK: Duration = Duration::from_millis(200);

/// A stage change the ticker decided on.
enum Step {
    ReleaseGpu(Arc<Instance>),
    Hibernate(Arc<Instance>),
    /// A split instance due to hibernate: copy its segments first, while it serves
    /// (crate::split::precopy); the hibernation follows on a later tick.
    PreCopy(Arc<Instance>),
    /// `cold_start = "boot"`: no snapshot to hibernate to; the process is stopped.
    Stop(Arc<Instance>),
    Evict(String),
    /// Start a standby instance (counted in `starting` already: crate::runtime::start::standby::plan).
    StartStandby(Box<FnInfo>, u64),
}

impl Runtime {
    /// Starts the keep-alive ticker; it runs as long as the runtime.
    pub fn spawn_keepalive(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let rt = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                rt.tick();
            }
        })
    }

    /// The CUDA driver (loaded once).
    pub(crate) fn cuda(&self) -> Result<Arc<torpor_cuda::CudaDriver>, CudaLoadError> {
        self.cuda
            .get_or_init(|| {
                torpor_cuda::CudaDriver::load()
                    .map(Arc::new)
                    .map_err(|e| CudaLoadError(Arc::new(e)))
            })
            .clone()
    }

    /// GPU memory per host pid, from NVML, if NVML loads.
    pub(crate) fn gpu_memory_by_pid(&self) -> Option<std::collections::HashMap<i32, u64>> {
        let procs = self.nvml()?.process_memory().ok()?;
        let mut out = std::collections::HashMap::new();
        for p in procs {
            if let (Ok(pid), Some(bytes)) = (i32::try_from(p.pid), p.used_memory) {
                *out.entry(pid).or_insert(0) += bytes;
            }
        }
        Some(out)
    }

    /// NVML (loaded once), if it loads.
    fn nvml(&self) -> Option<&torpor_cuda::Nvml> {
        self.nvml
            .get_or_init(|| torpor_cuda::Nvml::load().ok())
            .as_ref()
    }

    /// What process `pid` holds on each GPU, from NVML, if NVML loads.
    fn gpu_memory_of(&self, pid: i32) -> Option<Vec<(torpor_cuda::GpuUuid, u64)>> {
        let mut out: Vec<(torpor_cuda::GpuUuid, u64)> = Vec::new();
        for p in self.nvml()?.process_memory().ok()? {
            if i32::try_from(p.pid) != Ok(pid) {
                continue;
            }
            let bytes = p.used_memory.unwrap_or(0);
            match out.iter_mut().find(|(g, _)| *g == p.gpu) {
                Some((_, b)) => *b += bytes,
                None => out.push((p.gpu, bytes)),
            }
        }
        Some(out)
    }

    fn tick(self: &Arc<Self>) {
        self.sandbox_pool_tick();
        self.store_tick();
        let pools: Vec<Arc<Pool>> = lock(&self.pools).values().cloned().collect();
        // NVML's figures, per instance root (live and starting). Every function's processes are
        // measured, not only `gpus = 1` ones': memory NVML sees is held, whatever the spec says.
        let by_root = if pools.is_empty() && !self.starts.any() {
            None
        } else {
            self.gpu_memory_by_pid().map(|by_pid| {
                let mut roots: std::collections::HashSet<i32> =
                    self.starts.roots().into_iter().collect();
                for p in &pools {
                    roots.extend(lock(&p.state).instances.iter().map(|(i, _)| i.init_pid));
                }
                accounting::memory_by_root(&by_pid, &roots, accounting::parent_pid)
            })
        };
        let now = Instant::now();
        let mut gpu_total = self.starts.tick(now, by_root.as_ref(), &self.metrics);
        let mut steps = Vec::new();
        for pool in pools {
            let mut st = lock(&pool.state);
            if st.closed.is_some() {
                continue;
            }
            let info = st.info.clone();
            let generation = st.generation;
            let k = info.keepalive;
            let (mut standby_gpu, mut standby_host) = (0u64, 0u64);
            for (inst, n) in &st.instances {
                let mut keep = lock(&inst.keep);
                let bytes = match by_root.as_ref() {
                    // NVML reads what the instance's processes really hold. A tree it does not
                    // list holds nothing: e.g. gpu_released, or a hibernation past its CUDA
                    // checkpoint.
                    Some(m) => m.get(&inst.init_pid).copied().unwrap_or(0),
                    // Without NVML, the spec's estimate while warm, through a hibernation's
                    // quiesce and snapshot too: when the driver checkpoint frees the memory
                    // inside the snapshot cannot be seen, so the figure errs high, not low.
                    None if info.gpu && keep.state.stage() == Some(Stage::Warm) => info.gpu_bytes,
                    None => 0,
                };
                gpu_total += bytes;
                if *n == 0 && matches!(keep.state, State::Standby(_)) {
                    // What keeping it costs (docs/split.md, "Standby instances").
                    standby_gpu += bytes;
                    standby_host += resident_bytes(inst.worker_pid);
                }
                let charge = keep.meter.close(now, Some(bytes));
                if let Some(label) = keep.state.charged_as() {
                    self.metrics.add_charge(&pool.name, label, charge);
                }
                // At rest, not a standby, not being changed or removed.
                if *n > 0
                    || !matches!(keep.state, State::Warm | State::GpuReleased)
                    || inst.generation != generation
                    || inst.still_mapping()
                    || inst.pages_pending.load(Ordering::SeqCst)
                    || inst.migrating.load(Ordering::SeqCst)
                {
                    continue;
                }
                let idle = keep.idle_since.elapsed();
                if idle >= k.hibernate
                    && self.config.cold_start != ColdStart::Boot
                    && self.config.restore_server.concurrent_snapshot
                    && keep.state == State::Warm
                    && lock(&inst.segments).is_held()
                {
                    use crate::split::precopy::PreCopyState;
                    let mut pre = lock(&inst.precopy);
                    match *pre {
                        PreCopyState::None => {
                            *pre = PreCopyState::Running;
                            steps.push((Arc::clone(&pool), Step::PreCopy(Arc::clone(inst))));
                            continue;
                        }
                        PreCopyState::Running => continue,
                        PreCopyState::Done(_) | PreCopyState::Failed => {}
                    }
                }
                let (doing, step) = if idle >= k.hibernate {
                    if self.config.cold_start == ColdStart::Boot {
                        (Doing::Stop, Step::Stop(Arc::clone(inst)))
                    } else {
                        (Doing::Hibernate, Step::Hibernate(Arc::clone(inst)))
                    }
                } else if info.gpu
                    && keep.state == State::Warm
                    && idle >= k.gpu_release
                    && !inst.gpu_release_failed.load(Ordering::SeqCst)
                {
                    (Doing::ReleaseGpu, Step::ReleaseGpu(Arc::clone(inst)))
                } else {
                    continue;
                };
                if self
                    .step(&pool.name, &mut keep, Transition::Begin(doing))
                    .is_ok()
                {
                    steps.push((Arc::clone(&pool), step));
                }
            }
            for s in &mut st.sleepers {
                let charge = s.keep.meter.close(now, Some(0));
                if let Some(label) = s.keep.state.charged_as() {
                    self.metrics.add_charge(&pool.name, label, charge);
                }
                if s.keep.state == State::Hibernated
                    && s.keep.idle_since.elapsed() >= k.evict
                    && self
                        .step(&pool.name, &mut s.keep, Transition::Begin(Doing::Evict))
                        .is_ok()
                {
                    steps.push((Arc::clone(&pool), Step::Evict(s.id.clone())));
                }
            }
            let (ready, start) =
                crate::runtime::start::standby::plan(&mut st, self.config.cold_start, now);
            self.metrics
                .standby_instances
                .with_label_values(&[&pool.name])
                .set(i64::try_from(ready).unwrap_or(i64::MAX));
            self.metrics
                .standby_gpu_memory_bytes
                .with_label_values(&[&pool.name])
                .set(i64::try_from(standby_gpu).unwrap_or(i64::MAX));
            self.metrics
                .standby_host_memory_bytes
                .with_label_values(&[&pool.name])
                .set(i64::try_from(standby_host).unwrap_or(i64::MAX));
            for _ in 0..start {
                let step = Step::StartStandby(Box::new(st.info.clone()), st.generation);
                steps.push((Arc::clone(&pool), step));
            }
        }
        self.metrics
            .gpu_memory_bytes
            .set(i64::try_from(gpu_total).unwrap_or(i64::MAX));
        self.update_placement_gauges();
        for (pool, step) in steps {
            let rt = Arc::clone(self);
            match step {
                Step::ReleaseGpu(inst) => {
                    tokio::spawn(async move { rt.release_gpu(pool, inst).await });
                }
                Step::Hibernate(inst) => {
                    tokio::spawn(async move { rt.hibernate(pool, inst).await });
                }
                Step::PreCopy(inst) => {
                    tokio::spawn(async move { rt.precopy(pool, inst).await });
                }
                Step::Stop(inst) => {
                    // Its stage time was accounted up to now just above.
                    rt.remove_instance(
                        &inst,
                        "stopped: idle past hibernate_s, and cold_start = boot keeps no snapshot",
                        true,
                    );
                }
                Step::Evict(id) => {
                    tokio::spawn(async move { rt.evict(pool, id).await });
                }
                Step::StartStandby(info, generation) => {
                    tokio::spawn(async move { rt.start_standby(pool, *info, generation).await });
                }
            }
        }
    }

    /// warm → gpu_released: CUDA driver lock + checkpoint of the worker, in place; on the split
    /// path its segments are unmapped and given back first.
    async fn release_gpu(self: Arc<Self>, pool: Arc<Pool>, inst: Arc<Instance>) {
        let pools_released = match self.release_gpu_inner(&inst).await {
            Ok(bytes) => bytes,
            Err(e) => {
                if inst.is_dead() {
                    // Its segments could not be mapped back: removed already, with the reason.
                    pool.changed.notify_waiters();
                    return;
                }
                // The instance stays warm; it will hibernate at its time.
                tracing::warn!(instance = %inst.id, function = %inst.function, error = %e, "cannot release the GPU; the instance stays warm");
                inst.gpu_release_failed.store(true, Ordering::SeqCst);
                let _ = self.step(&inst.function, &mut lock(&inst.keep), Transition::Abort);
                pool.changed.notify_waiters();
                return;
            }
        };
        let released = self.step(
            &inst.function,
            &mut lock(&inst.keep),
            Transition::ReleaseGpu,
        );
        if released.is_err() {
            // Removed meanwhile: no row to record.
            pool.changed.notify_waiters();
            return;
        }
        if let Err(e) = self
            .record_stage(&inst.id, Stage::GpuReleased, Some(inst.init_pid), None)
            .await
        {
            tracing::warn!(instance = %inst.id, error = %e, "cannot record the gpu_released stage");
        }
        // pools_released: what the worker's idle pools gave back first (protocol 3; none for
        // an older harness).
        tracing::info!(instance = %inst.id, function = %inst.function, pools_released = ?pools_released, "GPU released in place");
        pool.changed.notify_waiters();
    }

    /// The steps of a GPU release; the bytes the worker's idle pools gave back first (`None`:
    /// a harness older than protocol 3). A failure leaves the instance warm with its segments
    /// mapped, or removes it when they cannot be mapped back.
    async fn release_gpu_inner(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
    ) -> Result<Option<u64>, ReleaseGpuError> {
        // The driver will not resume a process that maps memory it imported from the daemon
        // (crate::split::release): such an instance gives its segments back first.
        let cuda = self.cuda()?;
        if let Some(reason) = crate::launcher::unrestorable(inst.init_pid, false).await {
            return Err(ReleaseGpuError::Unrestorable { reason });
        }
        let pools_released = self.quiet_gpu(inst).await?;
        let split = !lock(&inst.segments).is_empty();
        if split {
            self.unmap_segments(inst).await?;
        }
        let pid = inst.worker_pid;
        // What a snapshot taken while released must record as the GPU memory its restore needs
        // (hibernate_inner): NVML stops showing it once the driver has checkpointed it.
        *lock(&inst.released_gpu) = self.gpu_memory_of(pid);
        let checkpointed = tokio::task::spawn_blocking(move || {
            cuda.lock(pid, CUDA_LOCK_TIMEOUT)?;
            if let Err(e) = cuda.checkpoint(pid) {
                let _ = cuda.unlock(pid);
                return Err(ReleaseGpuError::Cuda(e));
            }
            Ok(())
        })
        .await
        .map_err(ReleaseGpuError::Task)
        .and_then(|r| r);
        if let Err(e) = checkpointed {
            if split {
                self.map_segments_back(inst, None).await?;
            }
            return Err(e);
        }
        Ok(pools_released)
    }

    /// Before the driver checkpoints a worker's GPU in place (protocol 3): `release_gpu`, and
    /// its answer `gpu_quiet` once its CUDA work is done and its idle pools are given back. From
    /// then until the daemon serves it again the worker starts no CUDA work of its own: on the
    /// H200 a sandbox's timed pool release ran into the checkpointed context and the process
    /// died in libcuda (docs/sandboxes.md). Any other outcome removes the instance: what
    /// it runs meanwhile is unknown.
    /// Returns the bytes the pools gave back (`None`: an older harness, not asked).
    pub(crate) async fn quiet_gpu(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
    ) -> Result<Option<u64>, ReleaseGpuError> {
        if !inst.quiets_gpu {
            return Ok(None);
        }
        let mut replies = ForwardedReplies::new(inst)?;
        {
            let mut wr = inst.writer.lock().await;
            if let Err(e) = workers::send(&mut wr, &ToWorker::ReleaseGpu(Empty {})).await {
                drop(wr);
                let e = ReleaseGpuError::SendQuiet(e);
                self.remove_instance(inst, &e.to_string(), true);
                return Err(e);
            }
        }
        let e = match tokio::time::timeout(QUIET_TIMEOUT, replies.rx.recv()).await {
            Ok(Some(m))
                if m.get("type").and_then(serde_json::Value::as_str) == Some("gpu_quiet") =>
            {
                let bytes = m
                    .get("bytes")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                return Ok(Some(bytes));
            }
            Ok(Some(m)) => ReleaseGpuError::QuietAnswer {
                answer: serde_json::Value::Object(m),
            },
            Ok(None) => ReleaseGpuError::Removed {
                reason: inst.reason(),
            },
            Err(_) => ReleaseGpuError::QuietTimeout {
                bound: QUIET_TIMEOUT,
            },
        };
        drop(replies);
        self.remove_instance(inst, &e.to_string(), true);
        Err(e)
    }

    /// Split path: the worker unmaps the segments the daemon handed over (`unmap` →
    /// `unmapped`), the daemon saves the writable ones' contents to host memory and drops its
    /// handles on all of them. On failure the segments the worker released are mapped back (the
    /// instance stays warm), or the
    /// instance is removed when that fails too.
    async fn unmap_segments(self: &Arc<Self>, inst: &Arc<Instance>) -> Result<(), ReleaseGpuError> {
        let Some((plan, leases)) = lock(&inst.segments).leases() else {
            return Err(ReleaseGpuError::AlreadyReleased);
        };
        let mut replies = ForwardedReplies::new(inst)?;
        {
            // Only the daemon's memory: segments the worker made since are its own and stay in
            // the driver's checkpoint.
            let vas: Vec<u64> = plan.iter().map(|(e, _)| e.va).collect();
            let mut wr = inst.writer.lock().await;
            if let Err(e) = workers::send(&mut wr, &ToWorker::Unmap(Unmap { vas })).await {
                drop(wr);
                let e = ReleaseGpuError::SendUnmap(e);
                self.remove_instance(inst, &e.to_string(), true);
                return Err(e);
            }
        }
        let answer = match tokio::time::timeout(QUIET_TIMEOUT, replies.rx.recv()).await {
            Ok(Some(m))
                if m.get("type").and_then(serde_json::Value::as_str) == Some("unmapped") =>
            {
                m
            }
            other => {
                // What the worker holds is unknown: it cannot serve on.
                let e = match other {
                    Ok(Some(m)) => ReleaseGpuError::UnmapAnswer {
                        answer: serde_json::Value::Object(m),
                    },
                    Ok(None) => ReleaseGpuError::Removed {
                        reason: inst.reason(),
                    },
                    Err(_) => ReleaseGpuError::UnmapTimeout {
                        bound: QUIET_TIMEOUT,
                    },
                };
                drop(replies);
                self.remove_instance(inst, &e.to_string(), true);
                return Err(e);
            }
        };
        drop(replies);
        if let Some((message, released)) = unmap_refused(&answer) {
            drop(leases);
            self.map_segments_back(inst, Some(&released)).await?;
            return Err(ReleaseGpuError::UnmapRefused { message });
        }
        let split = Arc::clone(&self.split);
        let plan2 = Arc::clone(&plan);
        let saved = tokio::task::spawn_blocking(move || {
            let saved = split.save_writable(&plan2, &leases);
            drop(leases);
            saved
        })
        .await
        .map_err(ReleaseGpuError::SaveTask)
        .and_then(|r| r.map_err(ReleaseGpuError::Save));
        match saved {
            Ok(saved) => {
                // Every handle on the memory goes: the instance holds no device memory now.
                lock(&inst.segments).release(saved);
                Ok(())
            }
            Err(e) => {
                self.map_segments_back(inst, None).await?;
                Err(e)
            }
        }
    }

    /// Hands the instance's segments to its worker again with `map` frames (all of them, or
    /// those at `only`): from the memory still held, or, once released, from the saved contents
    /// and the restore server. Returns the seconds it took. A failure removes the instance.
    pub(crate) async fn map_segments_back(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        only: Option<&std::collections::HashSet<u64>>,
    ) -> Result<f64, MapBackError> {
        let t = Instant::now();
        let (released, plan, sources) = {
            let mut s = lock(&inst.segments);
            let released = s.is_released();
            let (plan, sources) = s.sources();
            (released, plan, sources)
        };
        let (plan, sources) = match only {
            None => (plan, sources),
            Some(only) => {
                let (p, s): (Vec<_>, Vec<_>) = plan
                    .iter()
                    .cloned()
                    .zip(sources)
                    .filter(|((e, _), _)| only.contains(&e.va))
                    .unzip();
                (Arc::new(p), s)
            }
        };
        if plan.is_empty() {
            return Ok(0.0);
        }
        // Its function's tenant: its caches and chunk store.
        let tenant = self.function_tenant(&inst.function);
        let refill =
            self.split
                .begin_refill(plan, sources, format!("instance {}", inst.id), tenant);
        // As after a restore (crate::split::server::Mapping): the instance's reader counts the
        // `mapped` answers; the request waits for all of them (the worker's main loop maps them).
        let handed = async {
            let handing = refill.planned().await.map_err(MapBackError::Segments)?;
            let (mapping, done) =
                crate::split::server::Mapping::new(Instant::now(), handing.count());
            *lock(&inst.mapping) = Some(mapping);
            let mut back = crate::split::release::InstanceSegments::handing(handing.plan());
            handing
                .send_maps(&inst.writer, |va, lease| {
                    if let Some(m) = lock(&inst.mapping).as_mut() {
                        m.sent(va);
                    }
                    back.push(va, lease);
                })
                .await
                .map_err(MapBackError::Segments)?;
            match tokio::time::timeout(crate::split::server::MAP_TIMEOUT, done).await {
                Ok(Ok(())) => Ok(back),
                Ok(Err(_)) => Err(MapBackError::Removed {
                    reason: inst.reason(),
                }),
                Err(_) => {
                    let left = lock(&inst.mapping).as_ref().map_or(0, |m| m.unmapped());
                    Err(MapBackError::Segments(SegmentsError::MapTimeout {
                        left,
                        bound: crate::split::server::MAP_TIMEOUT,
                    }))
                }
            }
        }
        .await;
        lock(&inst.mapping).take();
        match handed {
            Ok(back) => {
                if released {
                    *lock(&inst.segments) = back;
                }
                Ok(t.elapsed().as_secs_f64())
            }
            Err(e) => {
                self.remove_instance(inst, &e.to_string(), true);
                Err(e)
            }
        }
    }

    /// gpu_released → warm: driver restore + unlock, then (split path) the segments are mapped
    /// back. Returns the seconds of each: (driver, segments if any). The instance is in a
    /// resume already (`Doing::ResumeGpu`, for a request: it ends warm) or in a hibernation
    /// (`Doing::Hibernate`: it goes on hibernating). A failure to map the segments back removes
    /// the instance.
    pub(crate) async fn gpu_resume(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
    ) -> Result<(f64, Option<f64>), ResumeGpuError> {
        // A released standby placed on another GPU owes its driver restore the pairs.
        let owed = lock(&inst.owed_gpu_pairs).clone();
        let paying = !owed.is_empty();
        let s = self.driver_resume(inst.worker_pid, owed).await?;
        if paying {
            lock(&inst.owed_gpu_pairs).clear();
            // Paid: a restarted daemon must not pass them again.
            self.record_placement(inst).await;
        }
        let segments_s = self.segments_resume(inst).await?;
        let resumed = self.step(&inst.function, &mut lock(&inst.keep), Transition::ResumeGpu);
        if let Err(e) = resumed {
            return Err(ResumeGpuError::Removed(e));
        }
        if let Err(e) = self
            .record_stage(&inst.id, Stage::Warm, Some(inst.init_pid), None)
            .await
        {
            tracing::warn!(instance = %inst.id, error = %e, "cannot record the warm stage");
        }
        Ok((s, segments_s))
    }

    /// The driver's restore and unlock of a live process whose CUDA state is checkpointed in
    /// place (a `standby_gpu = "live"` standby, ahead of its first request); `gpu_pairs` move
    /// it onto other GPUs (a placed standby's, from its CRIU restore), empty: where it was.
    pub(crate) async fn driver_resume(
        &self,
        pid: i32,
        gpu_pairs: Vec<(torpor_cuda::GpuUuid, torpor_cuda::GpuUuid)>,
    ) -> Result<f64, ResumeGpuError> {
        let t = Instant::now();
        let cuda = self.cuda()?;
        tokio::task::spawn_blocking(move || {
            restore_in_place(&cuda, pid, &gpu_pairs)?;
            cuda.unlock(pid).map_err(ResumeGpuError::from)
        })
        .await
        .map_err(ResumeGpuError::Task)??;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Maps an instance's released segments back (`None`: none were released): the part of a
    /// resume after the driver's, and all a live standby's first request needs.
    pub(crate) async fn segments_resume(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
    ) -> Result<Option<f64>, ResumeGpuError> {
        let released = lock(&inst.segments).is_released();
        if !released {
            return Ok(None);
        }
        Ok(Some(self.map_segments_back(inst, None).await?))
    }

    /// The pre-copy of a split instance due to hibernate (crate::split::precopy): its writable
    /// segments are read, hashed and stored while it stays warm and routable; the hibernation's
    /// stop then copies only what changed. A failure is logged and leaves the whole capture to
    /// the stop.
    async fn precopy(self: Arc<Self>, pool: Arc<Pool>, inst: Arc<Instance>) {
        use crate::split::precopy::PreCopyState;
        let leases = lock(&inst.segments).leases();
        let state = match leases {
            None => PreCopyState::Failed,
            Some((plan, leases)) => {
                let split = Arc::clone(&self.split);
                let tenant = self.function_tenant(&inst.function);
                let copied = tokio::task::spawn_blocking(move || {
                    let store = split.store_for(&tenant)?;
                    split.precopy(&store, &plan, &leases)
                })
                .await;
                // Test switch: the copy is read; a request now writes after it.
                crate::journal::delay("precopy").await;
                match copied {
                    Ok(Ok(p)) => {
                        tracing::info!(instance = %inst.id, function = %inst.function, segments = p.segments.len(), bytes = p.bytes, seconds = p.seconds, "hibernation: segments pre-copied while the instance serves");
                        self.metrics.observe_phase(
                            &inst.function,
                            "hibernation_precopy",
                            p.seconds,
                        );
                        PreCopyState::Done(p)
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(instance = %inst.id, function = %inst.function, "{e}; the hibernation will copy every segment in its stop");
                        PreCopyState::Failed
                    }
                    Err(e) => {
                        tracing::warn!(instance = %inst.id, function = %inst.function, "pre-copy task: {e}; the hibernation will copy every segment in its stop");
                        PreCopyState::Failed
                    }
                }
            }
        };
        *lock(&inst.precopy) = state;
        pool.changed.notify_waiters();
    }

    /// → hibernated: quiesce, snapshot in kill mode, keep the snapshot as a sleeper.
    async fn hibernate(self: Arc<Self>, pool: Arc<Pool>, inst: Arc<Instance>) {
        // The instance takes no request from here (the ticker began the change): its stop.
        let stop = Instant::now();
        if self.hibernation_refused(&inst).await {
            pool.changed.notify_waiters();
            return;
        }
        // The quiesce gives every pool of a sandbox's functions back (torpor.mempool): its
        // account starts afresh, whether it sleeps or serves on (crate::runtime::memory).
        self.memory_forget(&inst.id);
        let out =
            self.snapshots_dir()
                .join(format!("hib-{}-{}-{}", inst.function, inst.id, now_ms()));
        // Recorded before the quiesce: a crash from here on is finished or undone at the next
        // start (crate::recovery).
        let journal = Journal::begin(
            &self.registry,
            JournalOp::Hibernate,
            &inst.id,
            step::QUIESCE,
        )
        .await;
        journal.step(step::QUIESCE, Some(&out)).await;
        let hibernated = self.hibernate_inner(&pool, &inst, &out, &journal).await;
        journal.end().await;
        match hibernated {
            Ok((stale, delta, phases)) => {
                let stop_s = stop.elapsed().as_secs_f64();
                self.metrics
                    .observe_phase(&inst.function, "hibernation_stop", stop_s);
                let delta_json = delta
                    .as_ref()
                    .and_then(|d| serde_json::to_string(d).ok())
                    .unwrap_or_default();
                // Where the stop went: the daemon's steps, then the snapshot's own (`snapshot.*`).
                let phases_json = serde_json::to_string(
                    &phases
                        .into_iter()
                        .map(|(k, v)| (k, serde_json::json!((v * 1e4).round() / 1e4)))
                        .collect::<serde_json::Map<String, serde_json::Value>>(),
                )
                .unwrap_or_default();
                tracing::info!(instance = %inst.id, function = %inst.function, stop_s, concurrent = delta.is_some(), delta = %delta_json, phases = %phases_json, "hibernation stop");
                tracing::info!(instance = %inst.id, function = %inst.function, snapshot = %out.display(), "instance hibernated");
                if let Some(s) = stale {
                    self.discard_sleeper(s.id, s.snapshot_id, s.snapshot_dir)
                        .await;
                }
                tokio::spawn(Arc::clone(&self).flush_hibernation(
                    inst.id.clone(),
                    inst.function.clone(),
                    out,
                ));
            }
            Err(e) => {
                self.remove_instance(&inst, &format!("hibernation failed: {e}"), true);
                let out2 = out.clone();
                let _ = tokio::task::spawn_blocking(move || remove_snapshot_dir(&out2)).await;
            }
        }
        pool.changed.notify_waiters();
    }

    /// Puts a hibernation's snapshot, sealed before the instance's stop ended, on disk. Until
    /// then it lives in the page cache: a daemon killed meanwhile loses nothing (the kernel
    /// writes it back), and after a machine crash a torn file fails the wake's check of every
    /// hash (hibernation snapshots are never staged, so always restored with Verify::Hashes),
    /// which discards the sleeper and cold-starts the request instead (start/wake.rs).
    async fn flush_hibernation(self: Arc<Self>, id: String, function: String, out: PathBuf) {
        // Test switch: the window between the registry's record and the disk.
        crate::journal::delay("hibernate-flush").await;
        let dir = out.clone();
        match tokio::task::spawn_blocking(move || torpor_image::flush_snapshot(&dir)).await {
            Ok(Ok(flush_s)) => {
                self.metrics
                    .observe_phase(&function, "hibernation_flush", flush_s);
                tracing::info!(instance = %id, function = %function, snapshot = %out.display(), flush_s, "hibernation snapshot on disk");
            }
            Ok(Err(e)) => {
                tracing::warn!(instance = %id, function = %function, error = %e, "cannot flush the hibernation snapshot to disk; the kernel writes it back later, and a wake refuses it if a crash tore it");
            }
            Err(e) => {
                tracing::warn!(instance = %id, function = %function, error = %e, "hibernation flush task failed");
            }
        }
    }

    /// The preflight of a hibernation, before the quiesce: a tree the driver cannot restore
    /// (crate::launcher::unrestorable) or a snapshot that would not fit
    /// (torpor_snapshot::space::check_tree) is refused while the instance is untouched, so it
    /// stays warm (logged, counted in `torpor_hibernations_refused_total`), and is tried again
    /// after another `hibernate_s` of idleness.
    async fn hibernation_refused(&self, inst: &Arc<Instance>) -> bool {
        // What the driver cannot restore (CUDA IPC, managed memory, multi-rank NCCL), asked
        // again after another hibernate_s idle: the program may have let go by then.
        let refusal = match crate::launcher::unrestorable(inst.init_pid, true).await {
            Some(why) => why,
            None => {
                let (root, dir) = (inst.init_pid, self.snapshots_dir());
                let checked = tokio::task::spawn_blocking(move || {
                    torpor_snapshot::space::check_tree(root, &dir)
                })
                .await;
                let Ok(Err(refusal)) = checked else {
                    return false;
                };
                refusal.to_string()
            }
        };
        tracing::warn!(instance = %inst.id, function = %inst.function, "hibernation refused, the instance stays warm: {refusal}");
        self.metrics
            .hibernations_refused
            .with_label_values(&[&inst.function])
            .inc();
        // Back to the stage it began the hibernation in, idle from now.
        let mut k = lock(&inst.keep);
        let _ = self.step(&inst.function, &mut k, Transition::Abort);
        k.idle_since = Instant::now();
        true
    }

    /// The split part of a hibernation: the segments go to the chunk store as the record of
    /// `hib_id`, then the worker releases them. A segment read-only in the function snapshot
    /// stays read-only while its contents are the same.
    async fn hibernate_segments(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        quiet: &serde_json::Map<String, serde_json::Value>,
        rd: &mut tokio::net::unix::OwnedReadHalf,
        hib_id: &str,
        plan: &[crate::split::index::Planned],
    ) -> Result<crate::split::capture::Captured, HibernateError> {
        let mut listed = crate::split::capture::segment_fds(rd, quiet)
            .await
            .map_err(HibernateError::SegmentFds)?;
        // The worker names its own CUDA ordinals; after a migration they are other GPUs of the
        // daemon's (crate::runtime::migrate).
        for l in listed.iter_mut().filter(|l| l.backend == "cuda") {
            l.ordinal = inst.daemon_ordinal(l.ordinal);
        }
        // Test switch: inside the stop (quiet, nothing captured yet).
        crate::journal::delay("hibernate-stop").await;
        // A concurrent snapshot: what the pre-copy read and the segments mapped read-only
        // (crate::split::precopy); without, every segment is read in the stop.
        let known = if self.config.restore_server.concurrent_snapshot {
            use crate::split::precopy::{Known, PreCopyState};
            let pre = match std::mem::take(&mut *lock(&inst.precopy)) {
                PreCopyState::Done(p) => Some(p),
                _ => None,
            };
            let plan = lock(&inst.segments).leases().map(|(p, _)| p);
            Some(Known::new(
                plan.as_deref().map_or(&[][..], |p| p.as_slice()),
                pre,
            ))
        } else {
            None
        };
        let readonly: std::collections::HashMap<u64, String> = plan
            .iter()
            .filter(|(e, _)| e.readonly)
            .map(|(e, _)| (e.va, e.blake3.clone()))
            .collect();
        let (split, id) = (Arc::clone(&self.split), hib_id.to_string());
        // As for a refill: its function's tenant's caches and chunk store.
        let tenant = self.function_tenant(&inst.function);
        let captured = tokio::task::spawn_blocking(move || {
            let store = split.store_for(&tenant)?;
            crate::split::capture::store_all_with(
                &split, &store, &id, &tenant, listed, &readonly, known,
            )
        })
        .await
        .map_err(HibernateError::CaptureTask)??;
        let released = {
            let mut wr = inst.writer.lock().await;
            crate::split::capture::release_halves(&mut wr, rd, QUIET_TIMEOUT).await
        };
        if let Err(e) = released {
            let tenant = self.function_tenant(&inst.function);
            let (store, id) = (self.split.store_for(&tenant), hib_id.to_string());
            let _ = tokio::task::spawn_blocking(move || store.map(|s| s.release(&id))).await;
            return Err(HibernateError::ReleaseSegments(e));
        }
        tracing::info!(instance = %inst.id, segments = captured.segments.len(), bytes = captured.bytes, new_bytes = captured.new_bytes, "hibernation: segments stored");
        Ok(captured)
    }

    /// [`Runtime::hibernate_segments`] of an instance whose GPU stays released: its segments
    /// were given back at `unmap`; what the release saved of them (and the recipes of the rest)
    /// is the record of `hib_id` (crate::split::capture::store_released). Nothing is read from
    /// the worker. On a failure the saved contents stay with the instance.
    async fn hibernate_released_segments(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        hib_id: &str,
    ) -> Result<crate::split::capture::Captured, HibernateError> {
        // Test switch: inside the stop, as for a warm instance.
        crate::journal::delay("hibernate-stop").await;
        let Some((plan, saved)) = lock(&inst.segments).take_saved() else {
            return Err(HibernateError::NotReleased);
        };
        let (split, id) = (Arc::clone(&self.split), hib_id.to_string());
        let tenant = self.function_tenant(&inst.function);
        let (stored, saved) = tokio::task::spawn_blocking(move || {
            let stored = split
                .store_for(&tenant)
                .map_err(Into::into)
                .and_then(|store| {
                    crate::split::capture::store_released(&split, &store, &id, &plan, &saved)
                });
            (stored, saved)
        })
        .await
        .map_err(HibernateError::CaptureTask)?;
        match stored {
            Ok(captured) => {
                tracing::info!(instance = %inst.id, segments = captured.segments.len(), bytes = captured.bytes, new_bytes = captured.new_bytes, "hibernation: segments stored from the GPU release, the GPU not resumed");
                Ok(captured)
            }
            Err(e) => {
                lock(&inst.segments).release(saved);
                Err(e.into())
            }
        }
    }
}

/// What a hibernation's stop hands back: the sleeper it replaced, what its pre-copy saved
/// (concurrent), and where its time went (seconds by step).
type HibernatedParts = (
    Option<Sleeper>,
    Option<crate::split::precopy::Delta>,
    Vec<(String, f64)>,
);

/// The steps of a hibernation's stop, each the seconds since the one before.
struct StopMarks {
    last: Instant,
    phases: Vec<(String, f64)>,
}

impl StopMarks {
    fn start() -> Self {
        StopMarks {
            last: Instant::now(),
            phases: Vec::new(),
        }
    }

    fn mark(&mut self, step: &str) {
        let now = Instant::now();
        self.phases
            .push((step.to_string(), (now - self.last).as_secs_f64()));
        self.last = now;
    }
}

impl Runtime {
    async fn hibernate_inner(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
        out: &Path,
        journal: &Journal,
    ) -> Result<HibernatedParts, HibernateError> {
        let mut marks = StopMarks::start();
        let mut released_gpu = None;
        if inst.state() == State::Changing(Stage::GpuReleased, Doing::Hibernate) {
            // Its GPU state is in its memory already (the driver's checkpoint in place) and the
            // daemon has its segments (saved at `unmap`): a harness that can reach a quiet point
            // without CUDA is snapshotted as it is, which saves the resume (GPU memory it would
            // need back, the driver's restore), the segments' reads and a second checkpoint.
            // Otherwise (an older harness; a release this daemon did not see, so with no record
            // of the GPU memory a restore needs): resume first, then hibernate as a warm one.
            released_gpu = lock(&inst.released_gpu)
                .clone()
                .filter(|_| inst.quiets_released && self.config.restore_server.hibernate_released);
            if released_gpu.is_none() {
                self.gpu_resume(inst).await?;
                marks.mark("gpu_resume");
            }
        }
        // A split function snapshot: its instances hibernate split too.
        let function_snapshot = lock(&pool.state).info.snapshot_id.clone();
        let split = {
            let (s, id) = (Arc::clone(&self.split), function_snapshot.clone());
            let tenant = self.function_tenant(&inst.function);
            tokio::task::spawn_blocking(move || s.plan(&id, &tenant))
                .await
                .map_err(HibernateError::PlanTask)??
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        *lock(&inst.quiet_tx) = Some(tx);
        let quiescing = self.step(&inst.function, &mut lock(&inst.keep), Transition::Quiesce);
        if let Err(e) = quiescing {
            lock(&inst.quiet_tx).take();
            return Err(HibernateError::Quiesce(e));
        }
        {
            let mut wr = inst.writer.lock().await;
            workers::send(
                &mut wr,
                &ToWorker::Quiesce(Quiesce {
                    split: Some(split.is_some()),
                    released: released_gpu.is_some().then_some(true),
                }),
            )
            .await
            .map_err(HibernateError::SendQuiesce)?;
        }
        let (quiet, mut rd) = match tokio::time::timeout(QUIET_TIMEOUT, rx).await {
            Ok(Ok(q)) => q,
            Ok(Err(_)) => {
                return Err(HibernateError::Removed {
                    reason: inst.reason(),
                })
            }
            Err(_) => {
                return Err(HibernateError::QuietTimeout {
                    bound: QUIET_TIMEOUT,
                })
            }
        };
        marks.mark("quiesce");
        let hib_id = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Quiet: from here a crash is undone by waking the worker, until the split path hands
        // its segments over (crate::recovery).
        let quiet_step = if split.is_some() {
            step::SEGMENTS
        } else {
            step::QUIET
        };
        journal.step(quiet_step, None).await;
        let stored = match split {
            Some(_) if released_gpu.is_some() => {
                Some(self.hibernate_released_segments(inst, &hib_id).await?)
            }
            Some(plan) => Some(
                self.hibernate_segments(inst, &quiet, &mut rd, &hib_id, plan.as_slice())
                    .await?,
            ),
            None => None,
        };
        if stored.is_some() {
            marks.mark("segments");
        }
        let closed = match tokio::time::timeout(QUIET_TIMEOUT, crate::frames::read(&mut rd)).await {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(m))) => Err(HibernateError::NotClosed {
                sent: m.get("type").cloned().unwrap_or(serde_json::Value::Null),
            }),
            Ok(Err(e)) => Err(HibernateError::Frame(e)),
            Err(_) => Err(HibernateError::CloseTimeout {
                bound: QUIET_TIMEOUT,
            }),
        };
        let snapshotted = match closed {
            Ok(()) => {
                marks.mark("close");
                if stored.is_none() {
                    journal.step(step::DUMP, None).await;
                }
                // Sealed from the page cache, flushed after the stop (flush_hibernation): the
                // instance's stop no longer waits for its whole image to reach the disk.
                self.snapshot_released_and_kill(
                    inst.init_pid,
                    out,
                    torpor_image::Durability::Deferred,
                    released_gpu.clone(),
                )
                .await
                .map_err(HibernateError::from)
            }
            Err(e) => Err(e),
        };
        let snapshot_phases = match snapshotted {
            Ok(phases) => phases,
            Err(e) => {
                if stored.is_some() {
                    let o = out.to_path_buf();
                    let _ = tokio::task::spawn_blocking(move || remove_snapshot_dir(&o)).await;
                }
                return Err(e);
            }
        };
        marks.mark("snapshot");
        journal.step(step::RECORD, None).await;
        // The instance's own keep-alive state moves on (the ticker goes on accounting it until
        // the sleeper takes its place, which copies it then).
        let (idle_since, keep) = {
            let mut k = lock(&inst.keep);
            let _ = self.step(&inst.function, &mut k, Transition::Hibernate);
            (k.idle_since, Keep::new(State::Hibernated, k.idle_since))
        };
        let idle_ms = now_ms() - i64::try_from(idle_since.elapsed().as_millis()).unwrap_or(0);
        let sleeper = Sleeper {
            id: inst.id.clone(),
            snapshot_id: hib_id.clone(),
            snapshot_dir: out.to_path_buf(),
            keep,
        };
        let (pool2, inst2) = (Arc::clone(pool), Arc::clone(inst));
        let stale = self
            .record_hibernation(inst, &hib_id, out, idle_ms, move || {
                join_sleeper(&pool2, &inst2, sleeper)
            })
            .await?;
        marks.mark("record");
        let mut phases = marks.phases;
        phases.extend(
            snapshot_phases
                .into_iter()
                .map(|(k, v)| (format!("snapshot.{k}"), v)),
        );
        Ok((stale, stored.and_then(|c| c.delta), phases))
    }

    /// hibernated → evicted: the snapshot's files leave the page cache.
    async fn evict(self: Arc<Self>, pool: Arc<Pool>, id: String) {
        let found = lock(&pool.state)
            .sleepers
            .iter()
            .find(|s| s.id == id)
            .map(|s| (s.snapshot_dir.clone(), s.snapshot_id.clone()));
        let Some((dir, hib)) = found else {
            return;
        };
        let d = dir.clone();
        let evicted = async {
            let files = tokio::task::spawn_blocking(move || drop_from_page_cache(&d))
                .await
                .map_err(EvictError::Task)??;
            // The sleeper becomes evicted (idle, wakeable) right after the registry says so,
            // on the same thread: a request that saw `evicted` never finds it still changing
            // and passes it over for a restore of the function snapshot.
            let (rt, pool2, id2) = (Arc::clone(&self), Arc::clone(&pool), id.clone());
            self.record_stage_then(&id, Stage::Evicted, None, Some(hib), move || {
                let mut st = lock(&pool2.state);
                if let Some(s) = st.sleepers.iter_mut().find(|s| s.id == id2) {
                    let _ = rt.step(&pool2.name, &mut s.keep, Transition::Evict);
                }
            })
            .await?;
            Ok::<_, EvictError>(files)
        }
        .await;
        let mut st = lock(&pool.state);
        if let Some(s) = st.sleepers.iter_mut().find(|s| s.id == id) {
            match &evicted {
                Ok(files) => {
                    let (split, hib, keep) = (
                        Arc::clone(&self.split),
                        s.snapshot_id.clone(),
                        st.info.snapshot_id.clone(),
                    );
                    let tenant = crate::tenant::of_spec(&st.info.spec).to_string();
                    tokio::task::spawn_blocking(move || {
                        split.drop_cached(&hib, Some(&keep), &tenant);
                    });
                    tracing::info!(instance = %id, files, snapshot = %dir.display(), "hibernated instance evicted from the page cache");
                }
                Err(e) => {
                    let _ = self.step(&pool.name, &mut s.keep, Transition::Abort);
                    // Stays hibernated; tried again at the next tick would loop, so count it
                    // as evicted only once it works: push its idle time back one delay.
                    s.keep.idle_since = Instant::now();
                    tracing::warn!(instance = %id, error = %e, "cannot evict the hibernation snapshot");
                }
            }
        }
        drop(st);
        pool.changed.notify_waiters();
    }

    /// Deletes a hibernated instance for good: its row, its snapshot row and directory.
    pub(crate) async fn discard_sleeper(&self, id: String, snapshot_id: String, dir: PathBuf) {
        self.forget_placement(&id);
        let registry = Arc::clone(&self.registry);
        let done = tokio::task::spawn_blocking(move || {
            let r = registry.transaction(|s| {
                s.delete_instance(&id)?;
                s.delete_snapshot(&snapshot_id)?;
                Ok::<_, RegistryError>(())
            });
            remove_snapshot_dir(&dir);
            r
        })
        .await;
        if let Ok(Err(e)) = done {
            tracing::error!(error = %e, "cannot remove a discarded hibernated instance's rows");
        }
    }

    /// After a redeploy (or a `torpor stop` of a function without a pool): every hibernated
    /// instance of `name` (rows, snapshots) goes. Returns the ids discarded.
    pub(crate) fn discard_sleepers_of(self: &Arc<Self>, name: &str) -> Vec<String> {
        let registry = Arc::clone(&self.registry);
        let name = name.to_string();
        let found = registry.with(|s| {
            let mut out = Vec::new();
            for i in s.instances_of(&name)? {
                if i.stage.has_process() {
                    continue;
                }
                let snap = match &i.snapshot {
                    Some(id) => s.snapshot(id)?,
                    None => None,
                };
                out.push((i.id, snap));
            }
            Ok::<_, RegistryError>(out)
        });
        let found = match found {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(function = %name, error = %e, "cannot list the hibernated instances to discard");
                return Vec::new();
            }
        };
        let mut discarded = Vec::new();
        for (id, snap) in found {
            let r = registry.transaction(|s| {
                s.delete_instance(&id)?;
                if let Some(snap) = &snap {
                    s.delete_snapshot(&snap.id)?;
                }
                Ok::<_, RegistryError>(())
            });
            if let Err(e) = r {
                tracing::error!(instance = %id, error = %e, "cannot discard a hibernated instance");
                continue;
            }
            if let Some(snap) = snap {
                remove_snapshot_dir(&snap.path);
            }
            self.forget_placement(&id);
            tracing::info!(instance = %id, function = %name, "hibernated instance discarded");
            discarded.push(id);
        }
        discarded
    }
}

/// The worker's `unmapped` frame, forwarded by the instance's reader while this lives.
pub(crate) struct ForwardedReplies<'a> {
    inst: &'a Instance,
    pub(crate) rx: tokio::sync::mpsc::UnboundedReceiver<serde_json::Map<String, serde_json::Value>>,
}

impl<'a> ForwardedReplies<'a> {
    pub(crate) fn new(inst: &'a Instance) -> Result<Self, ReleaseGpuError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        *lock(&inst.segment_replies) = Some(tx);
        // Removed meanwhile: its reader is gone and would never forward anything.
        if inst.is_dead() {
            lock(&inst.segment_replies).take();
            return Err(ReleaseGpuError::Removed {
                reason: inst.reason(),
            });
        }
        Ok(Self { inst, rx })
    }
}

impl Drop for ForwardedReplies<'_> {
    fn drop(&mut self) {
        lock(&self.inst.segment_replies).take();
    }
}

/// A worker's answer to `unmap` that is a refusal: its message and the segments it had
/// released before it refused (to be mapped back); `None` when it unmapped them all.
pub(crate) fn unmap_refused(
    answer: &serde_json::Map<String, serde_json::Value>,
) -> Option<(String, std::collections::HashSet<u64>)> {
    if answer.get("ok").and_then(serde_json::Value::as_bool) == Some(true) {
        return None;
    }
    let message = answer
        .get("error")
        .and_then(|e| e.get("message"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("no reason given")
        .to_string();
    let released = answer
        .get("released")
        .and_then(serde_json::Value::as_array)
        .map(|v| v.iter().filter_map(serde_json::Value::as_u64).collect())
        .unwrap_or_default();
    Some((message, released))
}

/// A hibernated instance leaves its pool's live instances and joins its sleepers, in one step
/// under the pool's lock. Returns the sleeper instead when its pool was closed or redeployed
/// meanwhile: the caller discards it.
fn join_sleeper(pool: &Pool, inst: &Arc<Instance>, mut sleeper: Sleeper) -> Option<Sleeper> {
    // Its process is gone: the shared segment copies it mapped may go too.
    lock(&inst.segments).clear();
    *lock(&inst.why_dead) = Some("hibernated".to_string());
    let mut st = lock(&pool.state);
    st.instances.retain(|(i, _)| !Arc::ptr_eq(i, inst));
    if st.closed.is_some() || st.generation != inst.generation {
        return Some(sleeper);
    }
    // Accounted up to where the instance's state was (under the pool lock, as the ticker's
    // accounting is).
    sleeper.keep.meter = Meter {
        accounted: lock(&inst.keep).meter.accounted,
        gpu_bytes: 0,
    };
    st.sleepers.push(sleeper);
    None
}

/// `posix_fadvise(POSIX_FADV_DONTNEED)` on every file under `dir` (after writing back any dirty
/// pages, which DONTNEED would skip). Returns how many files.
pub fn drop_from_page_cache(dir: &Path) -> Result<usize, PageCacheError> {
    use std::os::fd::AsRawFd;
    let io = |step: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| PageCacheError::Io { step, path, source }
    };
    // An entry that goes between the listing and its open (a wake or a removal took the file)
    // has no pages left to drop: skipped, not an error that would keep the sleeper from being
    // evicted. The directory itself missing stays an error.
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let mut n = 0;
    let entries = std::fs::read_dir(dir).map_err(io("read", dir))?;
    for e in entries {
        let e = e.map_err(io("read", dir))?;
        let path = e.path();
        let meta = match e.metadata() {
            Err(err) if gone(&err) => continue,
            m => m.map_err(io("stat", &path))?,
        };
        if meta.is_dir() {
            n += match drop_from_page_cache(&path) {
                Err(PageCacheError::Io { source, .. }) if gone(&source) => 0,
                r => r?,
            };
            continue;
        }
        if !meta.is_file() {
            continue;
        }
        let f = match std::fs::File::open(&path) {
            Err(err) if gone(&err) => continue,
            f => f.map_err(io("open", &path))?,
        };
        f.sync_all().map_err(io("write back", &path))?;
        // SAFETY: posix_fadvise only advises the kernel about the open descriptor `f`.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(PageCacheError::Fadvise { path, errno: rc });
        }
        n += 1;
    }
    Ok(n)
}

/// The CUDA driver cannot be loaded (kept: every later GPU release or resume gets the same
/// answer until the daemon restarts).
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "cannot load the CUDA driver for GPU release ({0}): install the NVIDIA driver, or set gpus = 0"
)]
pub struct CudaLoadError(pub Arc<torpor_cuda::CudaError>);

/// Why the GPU of an idle instance was not released in place. The instance stays warm, unless
/// its segments could not be mapped back (or its worker broke the unmap): then it was removed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseGpuError {
    /// The CUDA driver cannot be loaded.
    #[error(transparent)]
    Driver(#[from] CudaLoadError),
    /// The tree holds what the driver's checkpoint cannot restore (the line names it and the
    /// way around it).
    #[error("{reason}")]
    Unrestorable { reason: String },
    /// Its segments were given back already (a bug: a release of a released instance).
    #[error("its segments are released already")]
    AlreadyReleased,
    /// It was removed meanwhile, for `reason`.
    #[error("{reason}")]
    Removed { reason: String },
    /// The `release_gpu` frame could not be sent (the instance was removed).
    #[error("cannot send release_gpu: {0}")]
    SendQuiet(#[source] workers::ConnError),
    /// The worker answered `release_gpu` with another frame (the instance was removed).
    #[error("it answered release_gpu with {answer}")]
    QuietAnswer { answer: serde_json::Value },
    /// No `gpu_quiet` in time (the instance was removed).
    #[error("no gpu_quiet within {} s of release_gpu", bound.as_secs())]
    QuietTimeout { bound: Duration },
    /// The `unmap` frame could not be sent (the instance was removed).
    #[error("cannot send unmap: {0}")]
    SendUnmap(#[source] workers::ConnError),
    /// The worker answered `unmap` with another frame (the instance was removed).
    #[error("it answered unmap with {answer}")]
    UnmapAnswer { answer: serde_json::Value },
    /// No `unmapped` in time (the instance was removed).
    #[error("no unmapped within {} s of unmap", bound.as_secs())]
    UnmapTimeout { bound: Duration },
    /// The worker could not unmap its segments; `message` is its own reason (those it released
    /// were mapped back).
    #[error("the worker could not unmap its segments: {message}")]
    UnmapRefused { message: String },
    /// The task saving the writable segments did not finish.
    #[error("cannot save its segments: segment save task failed: {0}")]
    SaveTask(#[source] tokio::task::JoinError),
    /// The writable segments could not be saved (they were mapped back).
    #[error("cannot save its segments: {0}")]
    Save(#[source] crate::split::release::SaveError),
    /// Mapping the segments back after a failure failed too (the instance was removed).
    #[error(transparent)]
    MapBack(#[from] MapBackError),
    /// The task running the driver calls did not finish.
    #[error("GPU release task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The driver's lock or checkpoint failed (its `CUresult` is inside).
    #[error(transparent)]
    Cuda(#[from] torpor_cuda::CudaError),
}

/// Why an instance's segments could not be mapped back into its worker; the instance was
/// removed with this as its reason.
#[derive(Debug, thiserror::Error)]
pub enum MapBackError {
    /// A segment could not be filled or handed over, or the worker did not map them in time.
    #[error("mapping its segments back failed: {0}")]
    Segments(#[source] SegmentsError),
    /// It was removed meanwhile, for `reason`.
    #[error("mapping its segments back failed: {reason}")]
    Removed { reason: String },
}

/// The driver's restore of live process `pid`, its CUDA state checkpointed in place. A worker
/// that died while released is what the driver calls "not a CUDA process": the error says so,
/// from the kernel's view of the pid (a zombie, or gone), and points at its log.
fn restore_in_place(
    cuda: &torpor_cuda::CudaDriver,
    pid: i32,
    gpu_pairs: &[(torpor_cuda::GpuUuid, torpor_cuda::GpuUuid)],
) -> Result<(), ResumeGpuError> {
    match cuda.restore(pid, gpu_pairs) {
        Ok(()) => Ok(()),
        Err(e) if e.is_process_lost() => match kernel_state(pid) {
            Some('Z') | None => Err(ResumeGpuError::WorkerDied { pid }),
            state => {
                tracing::warn!(pid, kernel_state = ?state, driver_state = ?cuda.process_state(pid), error = %e, "the driver refused to restore a live process in place");
                Err(e.into())
            }
        },
        Err(e) => Err(e.into()),
    }
}

/// The state letter of `pid` in /proc/PID/stat (R, S, D, T, Z...); `None`: no such process.
fn kernel_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces and parentheses: the state follows the last ")".
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Why the GPU of an instance in gpu_released could not be resumed (the caller removes it).
#[derive(Debug, thiserror::Error)]
pub enum ResumeGpuError {
    /// The CUDA driver cannot be loaded.
    #[error(transparent)]
    Driver(#[from] CudaLoadError),
    /// The task running the driver calls did not finish.
    #[error("GPU resume task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// The driver's restore or unlock failed (its `CUresult` is inside).
    #[error(transparent)]
    Cuda(#[from] torpor_cuda::CudaError),
    /// Its segments could not be mapped back.
    #[error(transparent)]
    MapBack(#[from] MapBackError),
    /// It was removed while its GPU was resumed.
    #[error("it was removed while its GPU was resumed ({0})")]
    Removed(#[source] crate::runtime::lifecycle::Refused),
    /// The worker died while its GPU was released (the driver calls it "not a CUDA process").
    #[error("its worker (pid {pid}) died while its GPU was released; its log says how")]
    WorkerDied { pid: i32 },
}

/// Why an instance could not be hibernated (the instance was removed with this as its reason,
/// and its partial snapshot deleted).
#[derive(Debug, thiserror::Error)]
pub enum HibernateError {
    /// Its GPU (released) could not be resumed first.
    #[error(transparent)]
    Resume(#[from] ResumeGpuError),
    /// The task loading the function snapshot's segment plan did not finish.
    #[error("split plan task failed: {0}")]
    PlanTask(#[source] tokio::task::JoinError),
    /// The function snapshot's segment plan cannot be read.
    #[error(transparent)]
    Plan(#[from] crate::split::PlanError),
    /// Its state does not allow a quiesce (it was removed or taken meanwhile).
    #[error("it cannot be quiesced ({0})")]
    Quiesce(#[source] crate::runtime::lifecycle::Refused),
    /// The `quiesce` frame could not be sent.
    #[error("sending quiesce: {0}")]
    SendQuiesce(#[source] workers::ConnError),
    /// It was removed meanwhile, for `reason`.
    #[error("{reason}")]
    Removed { reason: String },
    /// No `quiet` in time.
    #[error("no quiet within {} s of quiesce", bound.as_secs())]
    QuietTimeout { bound: Duration },
    /// The segments' fds did not come after `quiet`.
    #[error("receiving the segments: {0}")]
    SegmentFds(#[source] workers::ConnError),
    /// The task storing the segments did not finish.
    #[error("segment capture task failed: {0}")]
    CaptureTask(#[source] tokio::task::JoinError),
    /// Storing the segments failed.
    #[error(transparent)]
    Capture(#[from] crate::split::capture::CaptureError),
    /// A hibernation without a GPU resume found no segments saved by a release (a bug).
    #[error("its GPU is released but the daemon holds none of its segments' saved contents")]
    NotReleased,
    /// The worker did not release its segments (their record was released).
    #[error("releasing the segments: {0}")]
    ReleaseSegments(#[source] workers::ConnError),
    /// The worker sent a frame after `quiet` instead of closing.
    #[error("it sent {sent} after quiet instead of closing its connection")]
    NotClosed { sent: serde_json::Value },
    /// Its connection broke, or it sent a malformed frame, after `quiet`.
    #[error("{}", .0.what_happened())]
    Frame(#[source] crate::frames::FrameError),
    /// It did not close its connection in time after `quiet`.
    #[error("it did not close its connection within {} s of quiet", bound.as_secs())]
    CloseTimeout { bound: Duration },
    /// CRIU's snapshot failed (its errno and log are inside).
    #[error(transparent)]
    Snapshot(#[from] crate::runtime::process::SnapshotTreeError),
    /// The hibernation could not be recorded.
    #[error(transparent)]
    Record(#[from] crate::runtime::lifecycle::RecordError),
}

/// Why a hibernated instance's snapshot was not evicted (it stays hibernated, tried again one
/// delay later).
#[derive(Debug, thiserror::Error)]
pub enum EvictError {
    /// The task dropping the pages did not finish.
    #[error("eviction task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// Dropping the snapshot's pages failed.
    #[error(transparent)]
    PageCache(#[from] PageCacheError),
    /// The evicted stage could not be recorded.
    #[error(transparent)]
    Record(#[from] crate::runtime::lifecycle::RecordError),
}

/// Why [`drop_from_page_cache`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum PageCacheError {
    /// A file-system step on `path` failed.
    #[error("cannot {step} {}: {source}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `posix_fadvise(POSIX_FADV_DONTNEED)` refused; `errno` is its return value.
    #[error("posix_fadvise on {}: {}", path.display(), std::io::Error::from_raw_os_error(*errno))]
    Fadvise { path: PathBuf, errno: i32 },
}

/// The resident memory of `pid` (VmRSS), 0 when it cannot be read (it is gone).
fn resident_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_tells_a_live_process_from_a_dead_one() {
        // Alive (its main thread waits for the test threads: S, or R).
        let own = kernel_state(std::process::id() as i32);
        assert!(matches!(own, Some('R' | 'S')), "{own:?}");
        // A child that exited and was not reaped yet: what a worker that crashed while its GPU
        // was released looks like to the resume.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let deadline = Instant::now() + Duration::from_secs(10);
        while kernel_state(pid) != Some('Z') && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(kernel_state(pid), Some('Z'));
        child.wait().unwrap();
        // Reaped: gone.
        assert_eq!(kernel_state(pid), None);
    }

    #[test]
    fn a_page_cache_error_names_the_step_and_keeps_the_errno() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pages-1.img"), b"x").unwrap();
        assert_eq!(drop_from_page_cache(dir.path()).unwrap(), 1);
        let gone = dir.path().join("gone");
        let e = drop_from_page_cache(&gone).unwrap_err();
        let PageCacheError::Io { step, source, .. } = &e else {
            panic!("{e}");
        };
        assert_eq!((*step, source.raw_os_error()), ("read", Some(libc::ENOENT)));
        assert!(
            e.to_string()
                .starts_with(&format!("cannot read {}: ", gone.display())),
            "{e}"
        );
        let fadvise = PageCacheError::Fadvise {
            path: gone,
            errno: libc::EBADF,
        };
        assert!(
            fadvise.to_string().contains("Bad file descriptor"),
            "{fadvise}"
        );
    }

    #[test]
    fn files_that_go_while_the_page_cache_is_dropped_are_skipped_not_errors() {
        // A wake or a removal can take a snapshot's files while an eviction walks them: a
        // thread makes and removes files and directories under it the whole time.
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let (root, stop) = (root.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let sub = root.join(format!("d{}", i % 4));
                    let _ = std::fs::create_dir_all(&sub);
                    for k in 0..8 {
                        let _ = std::fs::write(sub.join(format!("pages-{k}.img")), b"x");
                        let _ = std::fs::write(root.join(format!("f{k}")), b"x");
                    }
                    let _ = std::fs::remove_dir_all(&sub);
                    for k in 0..8 {
                        let _ = std::fs::remove_file(root.join(format!("f{k}")));
                    }
                    i += 1;
                }
            })
        };
        let results: Vec<_> = (0..2000).map(|_| drop_from_page_cache(&root)).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
        let failed: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
            .collect();
        assert!(
            failed.is_empty(),
            "{} of 2000 failed, first: {}",
            failed.len(),
            failed[0]
        );
    }
}
