//! Pools and routing: per function, its live instances (with their requests in flight), its
//! hibernated ones, its starts under way and its bounded queue; [`Runtime::acquire`] routes one
//! request to an idle instance (warm before gpu_released, standbys last), else a wake of a
//! hibernated one, else a new start while below `scaling.max_instances`, else the queue (429 when
//! full, 503 after `queue.timeout_s`). A request that started an instance is bound late: it
//! takes whichever is ready first, its own start or an instance another request leaves idle
//! meanwhile (Knative's activator does the same), so a burst's first instance serves the burst
//! while the others still restore; the start it leaves joins the pool idle.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{oneshot, Notify};

use crate::config::Keepalive;
use crate::metrics::{start, Metrics};
use crate::registry::{now_ms, FunctionState, Stage};
use crate::runtime::instance::{Instance, Keep, Sleeper};
use crate::runtime::invoke::{InvokeError, Timings};
use crate::runtime::lifecycle::{Doing, State, Transition};
use crate::runtime::Runtime;
use crate::sync::lock;

/// What [`Runtime::stop_instances`] took out of service.
#[derive(Debug)]
pub struct StoppedInstances {
    /// Idle instances, stopped now.
    pub stopped: Vec<String>,
    /// Busy instances, stopped when their requests end.
    pub retiring: Vec<String>,
    /// Hibernated instances taken from the pool, to discard.
    pub sleepers: Vec<Sleeper>,
}

/// What a pool needs from the function's registry row.
#[derive(Debug, Clone)]
pub(crate) struct FnInfo {
    pub(crate) snapshot_dir: PathBuf,
    pub(crate) snapshot_id: String,
    pub(crate) timeout: Duration,
    pub(crate) max_instances: usize,
    pub(crate) per_instance: usize,
    /// `scaling.standby`: idle standby instances to keep (crate::runtime::start::standby).
    pub(crate) standby: usize,
    /// `scaling.standby_gpu`: whether a GPU standby's driver restore is done ahead.
    pub(crate) standby_gpu: crate::spec::StandbyGpu,
    /// Idle delays of the stages (cumulative).
    pub(crate) keepalive: Keepalive,
    /// `gpus = 1`: the instances hold GPU memory, and gpu_released applies.
    pub(crate) gpu: bool,
    /// The spec's `gpu_memory` estimate, in bytes.
    pub(crate) gpu_bytes: u64,
    /// The spec (for `load` when booting instead of restoring).
    pub(crate) spec: Arc<Value>,
    /// Its function snapshot was taken from a worker of another user than its workers run as
    /// now (deployed before `workers.unprivileged`): restoring it would bring back the
    /// credentials it was dumped with (root). Its instances are booted instead, as the tenant's
    /// user, until it is deployed again; this is the warning that says so.
    pub(crate) stale_credentials: Option<String>,
}

/// Why a function whose base was `base_key` must not be restored for workers that run as
/// `user` (`None`: root), or `None` when its snapshot's credentials are the ones its workers
/// get now. The user is the base key's last part (crate::runtime::start::boot::base_key).
pub(crate) fn stale_credentials(
    name: &str,
    base_key: &str,
    user: Option<torpor_snapshot::launch::User>,
) -> Option<String> {
    let user = user?;
    if base_key.ends_with(&format!("|uid {}:{}", user.uid, user.gid)) {
        return None;
    }
    let then = match base_key.rsplit_once("|uid ") {
        Some((_, ids)) => format!("uid:gid {ids}"),
        None => "root".to_string(),
    };
    Some(format!(
        "function {name:?} was deployed when its workers ran as {then}, and a restore of its \
         snapshot would run as {then} again: its instances are booted as uid {} instead (slower \
         cold starts) and its hibernated instances of before are discarded; deploy it again \
         (`torpor deploy` its directory) to restore it as uid {}",
        user.uid, user.uid
    ))
}

pub(crate) struct PoolState {
    pub(crate) info: FnInfo,
    pub(crate) generation: u64,
    /// Live instances with their requests in flight.
    pub(crate) instances: Vec<(Arc<Instance>, usize)>,
    /// Hibernated and evicted instances, most recently idle last.
    pub(crate) sleepers: Vec<Sleeper>,
    /// Instances being restored.
    pub(crate) starting: usize,
    /// Standby instances being started (counted in `starting` too), and their failures.
    pub(crate) standby: crate::runtime::start::standby::PoolStandby,
    pub(crate) queued: usize,
    /// No new requests, no new instances: the function was deleted, or the daemon stops. A
    /// start that ends after the close removes its instance, saying why.
    pub(crate) closed: Option<Closed>,
}

/// Why a pool was closed ([`PoolState::closed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// `DELETE /v1/functions/{name}`.
    Deleted,
    /// The daemon's graceful stop ([`Runtime::shutdown`]).
    DaemonStop,
}

impl Closed {
    /// Why an instance of a closed pool was stopped (its removal's reason).
    pub(crate) fn why(self) -> &'static str {
        match self {
            Closed::Deleted => "stopped: its function was deleted",
            Closed::DaemonStop => "stopped: torpord is stopping",
        }
    }
}

/// The instances and queue of one function.
pub struct Pool {
    pub(crate) name: String,
    pub(crate) state: Mutex<PoolState>,
    pub(crate) changed: Notify,
}

/// What `acquire` does next, decided under the pool's lock.
pub(crate) enum Next {
    /// An idle instance; `true` when its GPU must be resumed first; its start label.
    Warm(Lease, bool, &'static str),
    /// Start one: from the function snapshot, or by waking a hibernated instance.
    Start(Box<(FnInfo, u64, Option<Sleeper>)>),
    /// Wait in the queue.
    Wait,
}

/// The pool slot of an acquired instance; released (and the queue woken) on drop.
pub(crate) struct Lease {
    pub(crate) pool: Arc<Pool>,
    pub(crate) instance: Arc<Instance>,
    pub(crate) runtime: Arc<Runtime>,
    /// The sandbox memory its request reserved: function and bytes (crate::runtime::memory).
    pub(crate) reserved: Option<(String, u64)>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some((function, peak)) = self.reserved.take() {
            self.runtime
                .memory_unreserve(&self.instance.id, &function, peak);
        }
        let retire = {
            let mut st = lock(&self.pool.state);
            let generation = st.generation;
            if let Some(slot) = st
                .instances
                .iter_mut()
                .find(|(i, _)| Arc::ptr_eq(i, &self.instance))
            {
                slot.1 = slot.1.saturating_sub(1);
                if slot.1 == 0 {
                    lock(&self.instance.keep).idle_since = Instant::now();
                }
                slot.1 == 0 && self.instance.generation != generation
            } else {
                false
            }
        };
        if retire {
            self.runtime.remove_instance(
                &self.instance,
                "retired: a newer deploy or `torpor stop` replaced it",
                true,
            );
        }
        self.pool.changed.notify_waiters();
    }
}

/// A place in a function's queue; given back on drop.
pub(crate) struct QueueSlot<'a> {
    pub(crate) pool: &'a Pool,
    pub(crate) metrics: &'a Metrics,
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.pool.state);
        st.queued = st.queued.saturating_sub(1);
        self.metrics
            .queue_length
            .with_label_values(&[&self.pool.name])
            .set(st.queued as i64);
    }
}

/// Decrements `starting` unless defused (the restore task was dropped mid-way).
pub(crate) struct Starting {
    pub(crate) pool: Arc<Pool>,
    pub(crate) armed: bool,
}

impl Drop for Starting {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.pool.state).starting -= 1;
            self.pool.changed.notify_waiters();
        }
    }
}

impl Runtime {
    /// Stops every live instance of `name` (for a delete): requests in flight fail, requests
    /// waiting in the queue or starting an instance get 404. Returns the stopped instances' ids.
    pub fn stop_function(self: &Arc<Self>, name: &str) -> Vec<String> {
        let Some(pool) = lock(&self.pools).remove(name) else {
            return Vec::new();
        };
        let live: Vec<Arc<Instance>> = {
            let mut st = lock(&pool.state);
            st.closed = Some(Closed::Deleted);
            st.instances.iter().map(|(i, _)| Arc::clone(i)).collect()
        };
        for inst in &live {
            self.remove_instance_of(&pool, inst, Closed::Deleted.why(), true);
        }
        pool.changed.notify_waiters();
        live.iter().map(|i| i.id.clone()).collect()
    }

    /// `torpor stop`: takes every live instance of `name` out of service without touching the
    /// deploy, as a redeploy does (the generation moves on): idle ones are stopped now, busy
    /// ones when their last request ends, and instances starting meanwhile after their first.
    /// Hibernated instances are taken too unless `keep_hibernated`; they are returned, for the
    /// caller to discard ([`Runtime::discard_sleeper`]). `None` when the function has no pool
    /// (no request since this daemon started): nothing of it is live.
    pub fn stop_instances(
        self: &Arc<Self>,
        name: &str,
        keep_hibernated: bool,
    ) -> Option<StoppedInstances> {
        let pool = lock(&self.pools).get(name).cloned()?;
        let (idle, busy, sleepers) = {
            let mut st = lock(&pool.state);
            st.generation += 1;
            let (idle, busy): (Vec<_>, Vec<_>) = st
                .instances
                .iter()
                .filter(|(i, _)| !i.is_dead())
                .map(|(i, n)| (Arc::clone(i), *n))
                .partition(|(_, n)| *n == 0);
            let sleepers = if keep_hibernated {
                Vec::new()
            } else {
                // A sleeper being woken is no longer listed: it joins with the older
                // generation and is retired after its request, like any starting instance.
                std::mem::take(&mut st.sleepers)
            };
            let only = |v: Vec<(Arc<Instance>, usize)>| -> Vec<Arc<Instance>> {
                v.into_iter().map(|(i, _)| i).collect()
            };
            (only(idle), only(busy), sleepers)
        };
        for inst in &idle {
            self.remove_instance_of(&pool, inst, "retired: stopped by `torpor stop`", true);
        }
        pool.changed.notify_waiters();
        Some(StoppedInstances {
            stopped: idle.iter().map(|i| i.id.clone()).collect(),
            retiring: busy.iter().map(|i| i.id.clone()).collect(),
            sleepers,
        })
    }

    /// After a (re)deploy: new instances come from `snapshot`; idle older ones are retired now,
    /// busy ones when their request ends.
    pub fn deployed(self: &Arc<Self>, name: &str, spec: &Value, snapshot_id: &str, dir: &Path) {
        // The older deploy's hibernated instances were discarded from the registry already
        // (`discard_sleepers_of`, before this call); the pool forgets them below.
        // A new snapshot: its restores get a fresh start.
        lock(&self.restore_health).remove(name);
        let Some(pool) = lock(&self.pools).get(name).cloned() else {
            return;
        };
        let idle: Vec<Arc<Instance>> = {
            let mut st = lock(&pool.state);
            st.info = fn_info(spec, snapshot_id, dir, &self.config.keepalive);
            st.generation += 1;
            st.standby.clear_failures();
            st.sleepers.clear();
            st.instances
                .iter()
                .filter(|(_, n)| *n == 0)
                .map(|(i, _)| Arc::clone(i))
                .collect()
        };
        for inst in idle {
            self.remove_instance(&inst, "retired: a newer deploy replaced it", true);
        }
        pool.changed.notify_waiters();
    }

    pub(crate) async fn pool(self: &Arc<Self>, name: &str) -> Result<Arc<Pool>, InvokeError> {
        if let Some(p) = lock(&self.pools).get(name) {
            return Ok(Arc::clone(p));
        }
        let registry = Arc::clone(&self.registry);
        let n = name.to_string();
        let keepalive = self.config.keepalive;
        let (info, sleepers, base_key) = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                let Some(f) = s.function(&n)? else {
                    return Ok(Err(InvokeError::NotFound(format!(
                        "no function named {n:?} (see `torpor ls`)"
                    ))));
                };
                if f.state != FunctionState::Ready {
                    let why = match s.function_failure(&n)? {
                        Some(m) if f.state == FunctionState::Failed => format!(" ({m})"),
                        _ => String::new(),
                    };
                    return Ok(Err(InvokeError::NotReady(format!(
                        "function {n:?} is {}{why}, not ready: {}",
                        f.state,
                        if f.state == FunctionState::Deploying {
                            "wait for its deploy to finish"
                        } else {
                            "deploy it again (`torpor deploy DIR`)"
                        }
                    ))));
                }
                let snap = match &f.snapshot {
                    Some(id) => s.snapshot(id)?,
                    None => None,
                };
                let Some(snap) = snap else {
                    return Ok(Err(InvokeError::NotReady(format!(
                        "function {n:?} has no function snapshot: deploy it again"
                    ))));
                };
                // Hibernated instances, from this daemon or an earlier one.
                let mut sleepers = Vec::new();
                for i in s.instances_of(&n)? {
                    if i.stage.has_process() {
                        continue;
                    }
                    let Some(hib) = i
                        .snapshot
                        .as_deref()
                        .map(|id| s.snapshot(id))
                        .transpose()?
                        .flatten()
                    else {
                        continue;
                    };
                    let idle_ms = u64::try_from(now_ms().saturating_sub(i.last_used)).unwrap_or(0);
                    let idle_since = Instant::now()
                        .checked_sub(Duration::from_millis(idle_ms))
                        .unwrap_or_else(Instant::now);
                    sleepers.push(Sleeper {
                        id: i.id,
                        snapshot_id: hib.id,
                        snapshot_dir: hib.path,
                        keep: Keep::new(State::at_rest(i.stage), idle_since),
                    });
                }
                sleepers.sort_by_key(|s| s.keep.idle_since);
                Ok::<_, crate::registry::RegistryError>(Ok((
                    fn_info(&f.spec, &snap.id, &snap.path, &keepalive),
                    sleepers,
                    f.base_key,
                )))
            })
        })
        .await
        .map_err(|e| InvokeError::Internal(format!("registry task failed: {e}")))?
        .map_err(|e| InvokeError::Internal(e.to_string()))??;
        let (mut info, mut sleepers, base_key) = (info, sleepers, base_key);
        let rt = Arc::clone(self);
        let spec = Arc::clone(&info.spec);
        // A user that cannot be found fails the boot later, with its own error.
        let user = tokio::task::spawn_blocking(move || rt.worker_user(&spec))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        // Hibernated instances of before hold the credentials of before too.
        let mut stale_sleepers = Vec::new();
        if let Some(why) = stale_credentials(name, &base_key, user) {
            info.standby = 0;
            info.stale_credentials = Some(why);
            stale_sleepers = std::mem::take(&mut sleepers);
        }
        let (pool, warn) = {
            let mut pools = lock(&self.pools);
            match pools.entry(name.to_string()) {
                // Another request made it meanwhile (and dealt with the same rows).
                std::collections::hash_map::Entry::Occupied(e) => (Arc::clone(e.get()), None),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let warning = info.stale_credentials.clone();
                    let pool = Arc::new(Pool {
                        name: name.to_string(),
                        state: Mutex::new(PoolState {
                            info,
                            generation: 0,
                            instances: Vec::new(),
                            sleepers,
                            starting: 0,
                            standby: Default::default(),
                            queued: 0,
                            closed: None,
                        }),
                        changed: Notify::new(),
                    });
                    e.insert(Arc::clone(&pool));
                    (pool, warning)
                }
            }
        };
        if let Some(why) = warn {
            tracing::warn!(function = name, "{why}");
            for s in stale_sleepers {
                self.discard_sleeper(s.id, s.snapshot_id, s.snapshot_dir)
                    .await;
            }
        }
        Ok(pool)
    }

    /// Takes the best idle instance of `pool` for one request, counting the request on it
    /// (and reserving its `demand` there): warm before gpu_released, standbys last (using
    /// another leaves them standing); among equals, the least loaded. Also whether it must be
    /// resumed from gpu_released, and the start kind the request reports.
    fn take_idle(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        st: &mut PoolState,
        demand: Option<&crate::runtime::memory::Demand>,
    ) -> Option<(Lease, bool, &'static str)> {
        let generation = st.generation;
        let per = st.info.per_instance;
        let (inst, n) = st
            .instances
            .iter_mut()
            .filter(|(i, _)| !i.is_dead() && i.generation == generation)
            .filter(|(i, n)| *n < per && i.state().is_routable())
            .filter(|(i, _)| demand.is_none_or(|d| self.memory_fits(&i.id, d)))
            // A migration's stop is draining it (crate::runtime::migrate).
            .filter(|(i, _)| !i.draining.load(std::sync::atomic::Ordering::SeqCst))
            .min_by_key(|(i, n)| {
                let state = i.state();
                let warm = state.stage() == Some(Stage::Warm);
                (!warm, matches!(state, State::Standby(_)), *n)
            })?;
        *n += 1;
        if let Some(d) = demand {
            self.memory_reserve(&inst.id, d);
        }
        // A standby becomes an ordinary instance; a gpu_released one is resumed (it is not
        // routable meanwhile).
        let (kind, released) = {
            let mut k = lock(&inst.keep);
            let (kind, t) = match k.state {
                State::Standby(_) => (start::STANDBY, Some(Transition::TakeStandby)),
                State::GpuReleased => (start::WARM, Some(Transition::Begin(Doing::ResumeGpu))),
                _ => (start::WARM, None),
            };
            if let Some(t) = t {
                let _ = self.step(&pool.name, &mut k, t);
            }
            (
                kind,
                matches!(k.state, State::Changing(_, Doing::ResumeGpu)),
            )
        };
        let lease = Lease {
            pool: Arc::clone(pool),
            instance: Arc::clone(inst),
            runtime: Arc::clone(self),
            reserved: demand.map(|d| (d.function.clone(), d.peak)),
        };
        Some((lease, released, kind))
    }

    /// Readies an instance [`Self::take_idle`] gave a request (queued since `t0`): a live
    /// standby's segments mapped, a gpu_released one resumed. A failure removes the instance.
    async fn ready_taken(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        lease: Lease,
        released: bool,
        kind: &'static str,
        t0: Instant,
    ) -> Result<(Lease, &'static str, Timings), InvokeError> {
        let mut timings = vec![("queue".to_string(), t0.elapsed().as_secs_f64())];
        // A live standby (`standby_gpu = "live"`): its context is restored, its segments are
        // still to be mapped; a CPU standby has none released.
        if !released && kind == start::STANDBY {
            let inst = Arc::clone(&lease.instance);
            match self.segments_resume(&inst).await {
                Ok(Some(s)) => timings.push(("segments".to_string(), s)),
                Ok(None) => {}
                Err(e) => {
                    let why = format!("mapping its segments failed: {e}");
                    self.remove_instance(&inst, &why, true);
                    return Err(InvokeError::Internal(format!(
                        "cannot map the segments of standby instance {} of {:?}: {e}; \
                         the instance was removed and the next request starts a new one",
                        inst.id, pool.name
                    )));
                }
            }
        }
        if released {
            let inst = Arc::clone(&lease.instance);
            match self.gpu_resume(&inst).await {
                Ok((s, segments)) => {
                    timings.push(("gpu_resume".to_string(), s));
                    if let Some(s) = segments {
                        timings.push(("segments".to_string(), s));
                    }
                }
                Err(e) => {
                    let why = format!("resuming its GPU failed: {e}");
                    self.remove_with_stacks(&inst, &why);
                    return Err(InvokeError::Internal(format!(
                        "cannot resume the GPU of instance {} of {:?}: {e}; the \
                         instance was removed (its log: torpor logs {} --instance {}) and \
                         the next request starts a new one",
                        inst.id, pool.name, pool.name, inst.id
                    )));
                }
            }
        }
        Ok((lease, kind, timings))
    }

    /// An instance for one request: idle warm, else restored, else after a wait in the queue.
    ///
    /// With `demand` (a sandboxed function's request in a sandbox with a memory budget:
    /// crate::runtime::memory) an instance is taken only where the request's peak fits, and
    /// the peak is reserved there with the choice; none fitting, a new sandbox is started while
    /// below max_instances, else the request waits until a request ends or a pool gives its
    /// memory back.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        demand: Option<crate::runtime::memory::Demand>,
    ) -> Result<(Lease, &'static str, Timings), InvokeError> {
        let t0 = Instant::now();
        let limits = self.config.queue;
        let deadline = tokio::time::Instant::now() + limits.timeout;
        let mut slot: Option<QueueSlot<'_>> = None;
        // After a start found too little free GPU memory: no new start before this instant;
        // the request waits for an instance to free up, or for the memory, meanwhile.
        let mut gpu_retry_at: Option<(tokio::time::Instant, InvokeError)> = None;
        // What its starts found short of GPU memory, for that answer.
        let mut gpu_short = crate::runtime::start::GpuShortfalls::default();
        loop {
            let notified = pool.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Sandboxes asked to give their idle pools back (the request waits for room).
            let mut reclaim: Vec<Arc<Instance>> = Vec::new();
            let next = {
                let mut st = lock(&pool.state);
                if st.closed.is_some() {
                    return Err(InvokeError::NotFound(format!(
                        "function {:?} was deleted",
                        pool.name
                    )));
                }
                if let Some((lease, released, kind)) =
                    self.take_idle(pool, &mut st, demand.as_ref())
                {
                    Next::Warm(lease, released, kind)
                } else if let Some(ix) = st
                    .sleepers
                    .iter()
                    .rposition(|s| s.keep.state.is_idle_stage())
                {
                    // Every instance counts towards max_instances, in every stage: waking a
                    // hibernated one comes before restoring a new one.
                    let sleeper = st.sleepers.remove(ix);
                    st.starting += 1;
                    Next::Start(Box::new((st.info.clone(), st.generation, Some(sleeper))))
                } else if st.instances.len() + st.starting + st.sleepers.len()
                    < st.info.max_instances
                    && gpu_retry_at
                        .as_ref()
                        .is_none_or(|(at, _)| tokio::time::Instant::now() >= *at)
                {
                    st.starting += 1;
                    Next::Start(Box::new((st.info.clone(), st.generation, None)))
                } else {
                    // Waiting although a sandbox has a free thread: for memory. Its idle
                    // functions' pools are asked back (each time the request looks again).
                    let memory_bound = demand.is_some()
                        && st.instances.iter().any(|(i, n)| {
                            *n < st.info.per_instance
                                && !i.is_dead()
                                && i.generation == st.generation
                        });
                    if memory_bound {
                        reclaim.extend(
                            st.instances
                                .iter()
                                .filter(|(i, _)| !i.is_dead())
                                .map(|(i, _)| Arc::clone(i)),
                        );
                    }
                    if slot.is_none() {
                        if memory_bound {
                            self.metrics
                                .sandbox_memory_waits
                                .with_label_values(&[demand.as_ref().map_or("", |d| &d.function)])
                                .inc();
                        }
                        if st.queued >= limits.length {
                            return Err(InvokeError::QueueFull(format!(
                                "function {:?} is at max_instances = {} and its queue is full \
                                 ({} waiting): retry later, or raise scaling.max_instances or \
                                 the daemon's queue.length",
                                pool.name, st.info.max_instances, st.queued
                            )));
                        }
                        st.queued += 1;
                        self.metrics
                            .queue_length
                            .with_label_values(&[&pool.name])
                            .set(st.queued as i64);
                        slot = Some(QueueSlot {
                            pool,
                            metrics: &self.metrics,
                        });
                    }
                    Next::Wait
                }
            };
            for inst in reclaim {
                self.reclaim_memory(inst);
            }
            if let Next::Warm(lease, released, kind) = next {
                drop(slot);
                return self.ready_taken(pool, lease, released, kind, t0).await;
            }
            if let Next::Start(start) = next {
                let (info, generation, sleeper) = *start;
                // A GPU start is placed: a cold start, or the cold start that replaces a wake
                // whose GPU had no room (start/wake.rs; that GPU is then passed over).
                let placed_gpu = info.gpu;
                // Out of the queue while it starts one (back in if it must wait after all).
                slot = None;
                let queue_s = t0.elapsed().as_secs_f64();
                let mut rx = self.start_in_task(pool, info, generation, sleeper, demand.clone());
                // Late binding: the request is served by whichever is ready first, the
                // instance it started or one another request leaves idle meanwhile (a burst's
                // first instance serves the burst while the rest still restore); a start it
                // leaves goes on, and its instance joins the pool idle.
                let got = loop {
                    let notified = pool.changed.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    match rx.try_recv() {
                        Ok(got) => break Some(got),
                        Err(oneshot::error::TryRecvError::Closed) => break None,
                        Err(oneshot::error::TryRecvError::Empty) => {}
                    }
                    let taken = {
                        let mut st = lock(&pool.state);
                        st.closed
                            .is_none()
                            .then(|| self.take_idle(pool, &mut st, demand.as_ref()))
                            .flatten()
                    };
                    if let Some((lease, released, kind)) = taken {
                        // Sent before the close: the request's count on it is given back
                        // here; after, the start task gives it back.
                        rx.close();
                        if let Ok(Ok((inst, _, _))) = rx.try_recv() {
                            self.unclaimed_start(pool, &inst, demand.as_ref());
                        }
                        tracing::debug!(function = %pool.name, instance = %lease.instance.id, "a request took an instance that was free before the one it started");
                        return self.ready_taken(pool, lease, released, kind, t0).await;
                    }
                    tokio::select! {
                        got = &mut rx => break got.ok(),
                        () = &mut notified => {}
                    }
                };
                let (inst, mut timings, kind) = match Self::start_outcome(pool, got, &mut gpu_short)
                {
                    Ok(started) => started,
                    Err(e @ InvokeError::NoGpuMemory { .. }) => {
                        let now = tokio::time::Instant::now();
                        if placed_gpu && self.another_gpu_to_try() {
                            // Placed again at once, on a GPU not found short.
                            tracing::info!(function = %pool.name, "too little free GPU memory on the GPU the start was placed on: starting again at once on another GPU");
                            gpu_retry_at = Some((now, e));
                            continue;
                        }
                        // Waits, within its queue timeout: an instance of the function
                        // may free up, or the memory; the last such error is its answer.
                        tracing::info!(function = %pool.name, "too little free GPU memory to start an instance: the request waits for one to free up or for the memory");
                        gpu_retry_at = Some((now + GPU_RETRY, e));
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                timings.insert(0, ("queue".to_string(), queue_s));
                let lease = Lease {
                    pool: Arc::clone(pool),
                    instance: inst,
                    runtime: Arc::clone(self),
                    reserved: demand.as_ref().map(|d| (d.function.clone(), d.peak)),
                };
                return Ok((lease, kind, timings));
            }
            let wake_at = match &gpu_retry_at {
                Some((at, _)) => deadline.min(*at),
                None => deadline,
            };
            if tokio::time::timeout_at(wake_at, notified).await.is_err() {
                if tokio::time::Instant::now() < deadline {
                    // Time to try the GPU again.
                    continue;
                }
                if let Some((_, e)) = gpu_retry_at {
                    return Err(e);
                }
                let retry = limits.timeout.as_secs().clamp(1, 60);
                return Err(InvokeError::QueueTimeout {
                    message: format!(
                        "function {:?} had no free instance within the queue timeout of {} s \
                         (max_instances = {}): retry after {retry} s",
                        pool.name,
                        limits.timeout.as_secs_f64(),
                        lock(&pool.state).info.max_instances
                    ),
                    retry_after_s: retry,
                });
            }
        }
    }
}

/// How long a request that found too little free GPU memory waits before trying to start an
/// instance again (unless an instance of its function frees up first).
pub(crate) const GPU_RETRY: Duration = Duration::from_secs(1);

/// The keep-alive delays of a spec: its `[keepalive]`, each key defaulting to the daemon's.
pub fn keepalive_of(spec: &Value, default: &Keepalive) -> Keepalive {
    let secs = |key: &str, d: Duration| {
        let v = spec.pointer(&format!("/keepalive/{key}"));
        crate::limits::spec_secs(v, d, 0.0, crate::limits::MAX_KEEPALIVE_S)
    };
    Keepalive {
        gpu_release: secs("gpu_release_s", default.gpu_release),
        hibernate: secs("hibernate_s", default.hibernate),
        evict: secs("evict_s", default.evict),
    }
}

/// `scaling.max_instances` as torpord reads it: the bound on a function's instances on this node,
/// every stage counted (a spec of before without it: 1).
pub(crate) fn max_instances_of(spec: &Value) -> usize {
    crate::limits::spec_count(
        spec.pointer("/scaling/max_instances"),
        1,
        1,
        crate::limits::MAX_INSTANCES,
    )
}

pub(crate) fn fn_info(
    spec: &Value,
    snapshot_id: &str,
    dir: &Path,
    keepalive: &Keepalive,
) -> FnInfo {
    use crate::limits;
    let num = |v: Option<&Value>, default: f64| v.and_then(Value::as_f64).unwrap_or(default);
    FnInfo {
        keepalive: keepalive_of(spec, keepalive),
        gpu: num(spec.get("gpus"), 0.0) >= 1.0,
        gpu_bytes: num(spec.get("gpu_memory"), 0.0).clamp(0.0, limits::MAX_GPU_MEMORY as f64)
            as u64,
        spec: Arc::new(spec.clone()),
        // A deploy made now keys its base with its workers' user; pool() checks older ones.
        stale_credentials: None,
        snapshot_dir: dir.to_path_buf(),
        snapshot_id: snapshot_id.to_string(),
        timeout: limits::spec_secs(
            spec.get("timeout_s"),
            limits::DEFAULT_TIMEOUT,
            0.001,
            limits::MAX_TIMEOUT_S,
        ),
        max_instances: max_instances_of(spec),
        per_instance: limits::spec_count(
            spec.pointer("/scaling/requests_per_instance"),
            1,
            1,
            limits::MAX_REQUESTS_PER_INSTANCE,
        ),
        standby: limits::spec_count(
            spec.pointer("/scaling/standby"),
            0,
            0,
            limits::MAX_INSTANCES,
        ),
        // Specs of before have none: released, as then.
        standby_gpu: match spec.pointer("/scaling/standby_gpu").and_then(Value::as_str) {
            Some("live") => crate::spec::StandbyGpu::Live,
            _ => crate::spec::StandbyGpu::Released,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_snapshot::launch::User;

    #[test]
    fn a_snapshot_of_another_user_than_its_workers_now_is_not_restored() {
        let now = Some(User { uid: 7, gid: 7 });
        // Deployed as the same user: restored.
        assert_eq!(
            stale_credentials("f", "py|torch|gpu|hook|uid 7:7", now),
            None
        );
        // Root workers now: nothing to protect (and nothing to compare).
        assert_eq!(stale_credentials("f", "py|torch|gpu", None), None);
        // Deployed while workers ran as root, or as another uid_base: booted instead.
        let root = stale_credentials("f", "py|torch|gpu", now).expect("stale");
        assert!(root.contains("\"f\"") && root.contains("as root"), "{root}");
        assert!(
            root.contains("torpor deploy") && root.contains("uid 7"),
            "{root}"
        );
        let other = stale_credentials("f", "py||cpu|uid 5:5", now).expect("stale");
        assert!(other.contains("uid:gid 5:5"), "{other}");
    }
}
