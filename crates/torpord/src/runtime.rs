//! Instances and invocations: per function, a pool of live workers restored from the function
//! snapshot, a bounded queue of requests waiting for one, and the routing of each request to an
//! idle instance (`warm`), else to a newly restored one (`restored`; `booted` when the restore
//! fails) while below `scaling.max_instances`, else to the queue (429 when full, 503 after
//! `queue.timeout_s`). A request's timeout counts from its handler's start (`started`).
//!
//! At startup, the live instances an earlier daemon left are re-adopted once their workers
//! reconnect ([`Runtime::readopt`]).
//!
//! Each live instance has one connection to the daemon and a reader task that hands every
//! `result` to the request waiting for its id. The connection ending, a malformed frame or a frame
//! out of place removes that instance only: its in-flight requests fail, its process tree is
//! killed, its registry row goes. The warm path touches no database.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{oneshot, Notify};

use crate::config::{ColdStart, Config, Keepalive};
use crate::frames;
use crate::metrics::{outcome, start, Metrics};
use crate::registry::{now_ms, FunctionState, Instance as InstanceRow, Registry, Stage};
use crate::workers::{self, ConnError, Hub, WorkerConn};

/// How long a restored worker has to reconnect after SIGUSR2.
pub const RECONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a restarted daemon waits for the workers of an earlier one to reconnect (they retry
/// at least twice a second).
pub const READOPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Consecutive failed restores of a function snapshot after which its cold starts boot
/// without trying to restore, for [`RESTORE_PAUSE`].
pub const RESTORE_FAILURES_TO_PAUSE: u32 = 3;
/// How long restores of a failing function snapshot are skipped; a redeploy ends it at once.
pub const RESTORE_PAUSE: Duration = Duration::from_secs(300);

/// Everything the deploy and invoke paths share.
pub struct Runtime {
    pub config: Config,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub hub: Arc<Hub>,
    pub state_root: PathBuf,
    pub workers_socket: PathBuf,
    /// Where the `torpor` Python package lives, or why it was not found (reported at deploy).
    pub python_dir: Result<PathBuf, String>,
    /// Which deploys wait for which (crate::deploy_locks): one function, one base key, or all.
    pub deploy_locks: crate::deploy_locks::DeployLocks,
    pub(crate) pools: Mutex<HashMap<String, Arc<Pool>>>,
    next_id: AtomicU64,
    /// The CUDA driver, loaded on first use (GPU release and resume).
    pub(crate) cuda: std::sync::OnceLock<Result<Arc<torpor_cuda::CudaDriver>, String>>,
    /// NVML, if it loads, for per-worker GPU memory.
    pub(crate) nvml: std::sync::OnceLock<Option<torpor_cuda::Nvml>>,
    /// Instances being booted or restored, metered as `starting` (crate::accounting).
    pub(crate) starts: crate::accounting::Starts,
    /// Per function: how restores of its function snapshot have been failing.
    restore_health: Mutex<HashMap<String, RestoreHealth>>,
    /// The split path: chunk store, restore server, caches (crate::split).
    pub split: Arc<crate::split::Split>,
    /// Function snapshots staged in memory (crate::staging).
    pub staging: Arc<crate::staging::StageArea>,
}

/// Failed restores of one function's snapshot in a row, and until when restores are skipped.
#[derive(Debug, Default)]
struct RestoreHealth {
    failures: u32,
    paused_until: Option<Instant>,
}

/// What every way of starting one instance shares: its id, its log file, its GPU meter.
struct NewInstance<'a, 'g> {
    id: &'a str,
    log: &'a Path,
    charge: &'a crate::accounting::StartGuard<'g>,
}

/// A request sent to a worker: told when its handler starts, then given its result.
struct Pending {
    started: Option<oneshot::Sender<()>>,
    result: oneshot::Sender<Answer>,
}

/// A worker's `result` frame: its fields, and its `value` as the bytes the worker sent (so the
/// daemon never re-encodes a function's result: no float or big integer changes on the way).
#[derive(Debug)]
struct Answer {
    msg: Map<String, Value>,
    value: Option<Box<RawValue>>,
}

impl Answer {
    /// The `value` of a result frame's payload, as sent.
    fn value_of(payload: &[u8]) -> Result<Option<Box<RawValue>>, frames::FrameError> {
        #[derive(serde::Deserialize)]
        struct RawResult {
            value: Option<Box<RawValue>>,
        }
        serde_json::from_slice::<RawResult>(payload)
            .map(|r| r.value)
            .map_err(|e| frames::FrameError::NotJson(e.to_string()))
    }
}

/// The invoke frame; `request` is sent as the bytes the client sent.
#[derive(serde::Serialize)]
struct InvokeFrame<'a> {
    r#type: &'static str,
    id: u64,
    request: &'a RawValue,
    timeout_s: f64,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Runtime { .. }")
    }
}

/// A live worker of a function.
pub struct Instance {
    pub id: String,
    pub function: String,
    /// Host pid of its init (the root of its process tree).
    pub init_pid: i32,
    /// Host pid of the worker (the Python process).
    pub worker_pid: i32,
    /// The deploy it belongs to; an older one is retired once idle.
    pub(crate) generation: u64,
    pub(crate) writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Its harness sends `started` when a handler starts (protocol 2).
    announces_start: bool,
    pending: Mutex<HashMap<u64, Pending>>,
    pub(crate) dead: AtomicBool,
    pub(crate) why_dead: Mutex<Option<String>>,
    /// Keep-alive state.
    pub(crate) keep: Mutex<Keep>,
    /// Set while it is being hibernated: its reader then takes `quiet` and the EOF after it.
    pub(crate) hibernating: AtomicBool,
    /// Told when `quiet` arrives while hibernating: the reader hands over the frame and the
    /// connection's read half, and the hibernation reads the rest (segment fds, EOF).
    pub(crate) quiet_tx: Mutex<Option<oneshot::Sender<QuietHandOver>>>,
    /// A GPU release failed: it stays warm until it hibernates.
    pub(crate) gpu_release_failed: AtomicBool,
    /// The segments it has from the restore server (split path), mapped or, while its GPU is
    /// released, saved (crate::split::release).
    pub(crate) segments: Mutex<crate::split::release::InstanceSegments>,
    /// Set while the daemon unmaps its segments (GPU release): its reader forwards the
    /// `unmapped` answer here.
    pub(crate) segment_replies: Mutex<Option<SegmentReplies>>,
    /// Its `map` frames and the worker's `mapped` answers, counted by its reader: after a split
    /// restore (it takes requests before every segment is mapped) and during a GPU resume.
    pub(crate) mapping: Mutex<Option<crate::split::server::Mapping>>,
    /// Restored with lazy pages that CRIU's lazy-pages daemon is still serving: no keep-alive
    /// step (a snapshot or GPU checkpoint) until every page is in.
    pub(crate) pages_pending: AtomicBool,
    /// An unused standby instance (crate::standby): no keep-alive step, `standby` to its first
    /// request.
    pub(crate) standby: AtomicBool,
    /// Told once it joined its pool, or was removed: a restore's background segment hand-over
    /// waits for it, so that a failed fill always finds the instance in its pool (and fails its
    /// request there) instead of racing the start that is adding it.
    pub(crate) joined: tokio::sync::Notify,
}

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

/// Where an instance's reader forwards the worker's answer to `unmap`.
pub(crate) type SegmentReplies = tokio::sync::mpsc::UnboundedSender<Map<String, Value>>;

/// The `quiet` frame of a hibernating instance and its connection's read half, handed from the
/// instance's reader to the hibernation.
pub(crate) type QuietHandOver = (Map<String, Value>, OwnedReadHalf);

/// Keep-alive state of an instance (live or hibernated).
#[derive(Debug)]
pub struct Keep {
    pub stage: Stage,
    /// When it last became idle (no request in flight).
    pub idle_since: Instant,
    /// Its stage time and GPU memory, up to when they were added to the metrics.
    pub meter: crate::accounting::Meter,
    /// A stage change (or a resume) is in progress: not routable, not to be stepped down.
    pub busy: bool,
}

impl Keep {
    pub(crate) fn new(stage: Stage, idle_since: Instant) -> Self {
        Self {
            stage,
            idle_since,
            meter: crate::accounting::Meter::new(Instant::now()),
            busy: false,
        }
    }
}

/// A hibernated (or evicted) instance: no process, a snapshot on disk.
#[derive(Debug)]
pub struct Sleeper {
    pub id: String,
    pub snapshot_id: String,
    pub snapshot_dir: PathBuf,
    pub keep: Keep,
}

impl Instance {
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    pub(crate) fn reason(&self) -> String {
        lock(&self.why_dead)
            .clone()
            .unwrap_or_else(|| "the worker closed its connection".to_string())
    }

    /// Some of its segments are not mapped yet: it serves, but must not be stepped down (the
    /// worker refuses a quiesce meanwhile).
    pub(crate) fn still_mapping(&self) -> bool {
        lock(&self.mapping)
            .as_ref()
            .is_some_and(|m| m.unmapped() > 0)
    }
}

/// What a pool needs from the function's registry row.
#[derive(Debug, Clone)]
pub(crate) struct FnInfo {
    pub(crate) snapshot_dir: PathBuf,
    pub(crate) snapshot_id: String,
    timeout: Duration,
    pub(crate) max_instances: usize,
    per_instance: usize,
    /// `scaling.standby`: idle standby instances to keep (crate::standby).
    pub(crate) standby: usize,
    /// Idle delays of the stages (cumulative).
    pub(crate) keepalive: Keepalive,
    /// `gpus = 1`: the instances hold GPU memory, and gpu_released applies.
    pub(crate) gpu: bool,
    /// The spec's `gpu_memory` estimate, in bytes.
    pub(crate) gpu_bytes: u64,
    /// The spec (for `load` when booting instead of restoring).
    spec: Arc<Value>,
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
    pub(crate) standby: crate::standby::PoolStandby,
    queued: usize,
    /// The function was deleted: no new requests, no new instances.
    pub(crate) closed: bool,
}

/// The instances and queue of one function.
pub struct Pool {
    pub(crate) name: String,
    pub(crate) state: Mutex<PoolState>,
    pub(crate) changed: Notify,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How an invocation went wrong; the API maps each to a status.
#[derive(Debug)]
pub enum InvokeError {
    /// 400: the request is not usable.
    BadRequest(String),
    /// 404.
    NotFound(String),
    /// 409: deploying or failed.
    NotReady(String),
    /// 429: the queue is full.
    QueueFull(String),
    /// 503 with Retry-After: waited in the queue too long.
    QueueTimeout { message: String, retry_after_s: u64 },
    /// 500: the function raised; the error document of the worker.
    User(Value, Timings),
    /// 502: the worker died or broke the protocol while holding the request.
    Crashed(String),
    /// 504: the request ran past the function's timeout_s; the worker was killed.
    Timeout(String),
    /// 500: the daemon could not start an instance, or another failure of its own.
    Internal(String),
}

/// Phase timings of one invocation, in seconds, in order.
pub type Timings = Vec<(String, f64)>;

/// A successful invocation.
#[derive(Debug)]
pub struct Invoked {
    /// The function's value as the worker encoded it.
    pub value: Box<RawValue>,
    pub start: &'static str,
    pub timings: Timings,
}

/// What `acquire` does next, decided under the pool's lock.
enum Next {
    /// An idle instance; `true` when its GPU must be resumed first; its start label.
    Warm(Lease, bool, &'static str),
    /// Start one: from the function snapshot, or by waking a hibernated instance.
    Start(Box<(FnInfo, u64, Option<Sleeper>)>),
    /// Wait in the queue.
    Wait,
}

/// The pool slot of an acquired instance; released (and the queue woken) on drop.
struct Lease {
    pool: Arc<Pool>,
    instance: Arc<Instance>,
    runtime: Arc<Runtime>,
}

impl Drop for Lease {
    fn drop(&mut self) {
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
struct QueueSlot<'a> {
    pool: &'a Pool,
    metrics: &'a Metrics,
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
struct Starting {
    pool: Arc<Pool>,
    armed: bool,
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
    pub fn new(
        config: Config,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        state_root: PathBuf,
        workers_socket: PathBuf,
    ) -> Self {
        Self {
            python_dir: crate::launcher::python_dir(),
            deploy_locks: Default::default(),
            pools: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            cuda: std::sync::OnceLock::new(),
            nvml: std::sync::OnceLock::new(),
            starts: crate::accounting::Starts::default(),
            restore_health: Mutex::new(HashMap::new()),
            split: Arc::new(crate::split::Split::new(
                &state_root,
                config.split,
                config.split_gpu,
                &config.restore_server,
                &metrics,
            )),
            staging: Arc::new(crate::staging::StageArea::open(
                &state_root,
                config.restore_server.stage_bytes,
                &metrics,
            )),
            config,
            registry,
            metrics,
            hub: Arc::new(Hub::default()),
            state_root,
            workers_socket,
        }
    }

    pub fn snapshots_dir(&self) -> PathBuf {
        self.state_root.join("snapshots")
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.state_root.join("logs")
    }

    pub(crate) fn next(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Live instances of `name` (in memory).
    pub fn live_instances(&self, name: &str) -> usize {
        let pool = lock(&self.pools).get(name).cloned();
        pool.map_or(0, |p| lock(&p.state).instances.len())
    }

    /// At daemon stop: every live instance is stopped (its worker would exit anyway once the
    /// daemon's end of its connection closes) and its registry row removed, synchronously.
    pub fn shutdown(&self) {
        self.stop_every_instance();
        self.staging.shut_down();
    }

    fn stop_every_instance(&self) {
        let pools: Vec<Arc<Pool>> = lock(&self.pools).drain().map(|(_, p)| p).collect();
        let mut ids = Vec::new();
        for pool in pools {
            for (inst, _) in lock(&pool.state).instances.drain(..) {
                inst.dead.store(true, Ordering::SeqCst);
                lock(&inst.pending).clear();
                kill_tree(inst.init_pid);
                ids.push(inst.id.clone());
            }
        }
        if ids.is_empty() {
            return;
        }
        let removed = self.registry.transaction(|s| {
            for id in &ids {
                s.delete_instance(id)?;
            }
            Ok::<_, crate::registry::RegistryError>(())
        });
        match removed {
            Ok(()) => tracing::info!(instances = ids.len(), "stopped the live instances"),
            Err(e) => {
                tracing::error!(error = %e, "cannot remove the stopped instances' registry rows")
            }
        }
    }

    /// Stops every live instance of `name` (for a delete): requests in flight fail, requests
    /// waiting in the queue or starting an instance get 404. Returns the stopped instances' ids.
    pub fn stop_function(self: &Arc<Self>, name: &str) -> Vec<String> {
        let Some(pool) = lock(&self.pools).remove(name) else {
            return Vec::new();
        };
        let live: Vec<Arc<Instance>> = {
            let mut st = lock(&pool.state);
            st.closed = true;
            st.instances.iter().map(|(i, _)| Arc::clone(i)).collect()
        };
        for inst in &live {
            self.remove_instance_of(&pool, inst, "stopped: its function was deleted", true);
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

    /// At startup: stages every deployed function's snapshot again (the stage area was mounted
    /// empty; crate::staging), most recently deployed first, so that the area keeps the newest
    /// when it cannot hold them all. Until a function's copy is staged, its restores read the
    /// disk copy. Deploys and deletes wait meanwhile (they stage and drop copies themselves).
    pub async fn restage(self: &Arc<Self>) {
        if self.staging.dir().is_none() {
            return;
        }
        let _deploys = self.deploy_locks.all().await;
        let (registry, staging) = (Arc::clone(&self.registry), Arc::clone(&self.staging));
        let done = tokio::task::spawn_blocking(move || {
            let mut snapshots = registry.with(|s| {
                let mut found = Vec::new();
                for f in s.functions()? {
                    let Some(id) = f.snapshot.as_deref() else {
                        continue;
                    };
                    if f.state != FunctionState::Ready {
                        continue;
                    }
                    if let Some(snap) = s.snapshot(id)? {
                        found.push((f.updated, f.name, snap.path));
                    }
                }
                Ok::<_, crate::registry::RegistryError>(found)
            })?;
            snapshots.sort_by_key(|(updated, _, _)| std::cmp::Reverse(*updated));
            let mut staged = 0;
            // Oldest last: staging it must not push out a newer one.
            for (_, name, path) in &snapshots {
                match staging.stage_if_room(path) {
                    Ok(true) => staged += 1,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(function = %name, error = %e, "cannot stage the function snapshot again: its restores read the disk copy"),
                }
            }
            // Then the newest is the most recently used: a later deploy drops the oldest first.
            for (_, _, path) in snapshots.iter().rev() {
                let _ = staging.get(path);
            }
            Ok::<_, crate::registry::RegistryError>(staged)
        })
        .await;
        match done {
            Ok(Ok(n)) if n > 0 => {
                tracing::info!(functions = n, "staged the function snapshots again")
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot list the function snapshots to stage")
            }
            Err(e) => tracing::error!(error = %e, "staging task failed"),
        }
    }

    /// At startup: the pools of functions with hibernated instances left by an earlier daemon,
    /// so that their keep-alive (eviction) goes on before any request comes.
    pub async fn take_up_hibernated(self: &Arc<Self>) {
        let registry = Arc::clone(&self.registry);
        let names = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                let mut names: Vec<String> = s
                    .instances()?
                    .into_iter()
                    .filter(|i| !i.stage.has_process())
                    .map(|i| i.function)
                    .collect();
                names.sort();
                names.dedup();
                Ok::<_, crate::registry::RegistryError>(names)
            })
        })
        .await;
        let names = match names {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "cannot list the hibernated instances");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "registry task failed");
                return;
            }
        };
        for name in names {
            match self.pool(&name).await {
                Ok(pool) => {
                    let n = lock(&pool.state).sleepers.len();
                    tracing::info!(function = %name, hibernated = n, "took up the hibernated instances of an earlier torpord");
                }
                Err(e) => {
                    tracing::warn!(function = %name, error = ?e, "cannot take up the hibernated instances")
                }
            }
        }
    }

    pub(crate) async fn pool(self: &Arc<Self>, name: &str) -> Result<Arc<Pool>, InvokeError> {
        if let Some(p) = lock(&self.pools).get(name) {
            return Ok(Arc::clone(p));
        }
        let registry = Arc::clone(&self.registry);
        let n = name.to_string();
        let keepalive = self.config.keepalive;
        let (info, sleepers) = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                let Some(f) = s.function(&n)? else {
                    return Ok(Err(InvokeError::NotFound(format!(
                        "no function named {n:?} (see `torpor ls`)"
                    ))));
                };
                if f.state != FunctionState::Ready {
                    return Ok(Err(InvokeError::NotReady(format!(
                        "function {n:?} is {}, not ready: {}",
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
                        keep: Keep::new(i.stage, idle_since),
                    });
                }
                sleepers.sort_by_key(|s| s.keep.idle_since);
                Ok::<_, crate::registry::RegistryError>(Ok((
                    fn_info(&f.spec, &snap.id, &snap.path, &keepalive),
                    sleepers,
                )))
            })
        })
        .await
        .map_err(|e| InvokeError::Internal(format!("registry task failed: {e}")))?
        .map_err(|e| InvokeError::Internal(e.to_string()))??;
        let mut pools = lock(&self.pools);
        let pool = pools.entry(name.to_string()).or_insert_with(|| {
            Arc::new(Pool {
                name: name.to_string(),
                state: Mutex::new(PoolState {
                    info,
                    generation: 0,
                    instances: Vec::new(),
                    sleepers,
                    starting: 0,
                    standby: Default::default(),
                    queued: 0,
                    closed: false,
                }),
                changed: Notify::new(),
            })
        });
        Ok(Arc::clone(pool))
    }

    /// Runs one request of function `name`.
    pub async fn invoke(
        self: &Arc<Self>,
        name: &str,
        request: Box<RawValue>,
    ) -> Result<Invoked, InvokeError> {
        let t0 = Instant::now();
        let result = self.invoke_inner(name, request, t0).await;
        let o = match &result {
            Ok(_) => outcome::OK,
            Err(InvokeError::User(..)) => outcome::ERROR,
            Err(InvokeError::QueueFull(_) | InvokeError::QueueTimeout { .. }) => outcome::REJECTED,
            Err(
                InvokeError::NotFound(_) | InvokeError::BadRequest(_) | InvokeError::NotReady(_),
            ) => return result,
            Err(_) => outcome::FAILED,
        };
        self.metrics.invocations.with_label_values(&[name, o]).inc();
        result
    }

    async fn invoke_inner(
        self: &Arc<Self>,
        name: &str,
        request: Box<RawValue>,
        t0: Instant,
    ) -> Result<Invoked, InvokeError> {
        let pool = self.pool(name).await?;
        let (lease, kind, mut timings) = self.acquire(&pool).await?;
        let (timeout, per_instance) = {
            let st = lock(&pool.state);
            (st.info.timeout, st.info.per_instance)
        };
        let inst = Arc::clone(&lease.instance);
        let t_call = Instant::now();
        let res = self.call(&inst, request, timeout, per_instance).await;
        drop(lease);
        if kind == start::RESTORED {
            // hello → every segment mapped, when that happened before the answer (a request
            // that needs only some segments may finish first).
            let mapped_s = lock(&inst.mapping)
                .as_ref()
                .and_then(crate::split::server::Mapping::segments_s);
            if let Some(s) = mapped_s {
                timings.push(("segments".to_string(), s));
            }
        }
        let call_s = t_call.elapsed().as_secs_f64();
        let total = t0.elapsed().as_secs_f64();
        self.metrics.starts.with_label_values(&[name, kind]).inc();
        let finish = |timings: &mut Timings, handler: Option<f64>| {
            if let Some(h) = handler {
                timings.push(("handler".into(), h));
                timings.push(("overhead".into(), (call_s - h).max(0.0)));
            }
            timings.push(("total".into(), total));
            for (phase, s) in timings.iter() {
                self.metrics.observe_phase(name, phase, *s);
            }
        };
        match res {
            Ok(Answer { msg, value }) => {
                let handler = msg.get("handler_s").and_then(Value::as_f64);
                finish(&mut timings, handler);
                if msg.get("ok").and_then(Value::as_bool) == Some(true) {
                    Ok(Invoked {
                        value: value.unwrap_or_else(|| {
                            RawValue::from_string("null".into()).expect("null is JSON")
                        }),
                        start: kind,
                        timings,
                    })
                } else {
                    let err = msg.get("error").cloned().unwrap_or_else(
                        || json!({"type": "Error", "message": "the worker sent ok: false without an error", "traceback": ""}),
                    );
                    Err(InvokeError::User(err, timings))
                }
            }
            Err(e) => {
                finish(&mut timings, None);
                Err(e)
            }
        }
    }

    /// Sends the request to `inst` and waits for its result, killing the worker at `timeout`
    /// after the handler started (`per_instance` requests may share the worker).
    async fn call(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        request: Box<RawValue>,
        timeout: Duration,
        per_instance: usize,
    ) -> Result<Answer, InvokeError> {
        let id = self.next();
        let (tx, rx) = oneshot::channel();
        let (started_tx, started_rx) = oneshot::channel();
        lock(&inst.pending).insert(
            id,
            Pending {
                started: Some(started_tx),
                result: tx,
            },
        );
        let frame = InvokeFrame {
            r#type: "invoke",
            id,
            request: &request,
            timeout_s: timeout.as_secs_f64(),
        };
        let frame = match frames::encode(&frame) {
            Ok(frame) => frame,
            Err(e) => {
                lock(&inst.pending).remove(&id);
                return Err(InvokeError::BadRequest(format!(
                    "the request cannot be sent ({e}): send less data (e.g. a path)"
                )));
            }
        };
        let crashed = |inst: &Instance| {
            InvokeError::Crashed(format!(
                "the worker of function {:?} (instance {}, pid {}) failed while handling the \
                 request: {}; the instance was removed and the next request starts a new one",
                inst.function,
                inst.id,
                inst.worker_pid,
                inst.reason()
            ))
        };
        if inst.is_dead() {
            // Removed before its request was recorded (e.g. a split restore whose segments
            // failed in the background): the removal did not see this request to fail it.
            lock(&inst.pending).remove(&id);
            return Err(crashed(inst));
        }
        // In a task of its own: a caller given up mid-write (its client went away) must not
        // leave half a frame on the connection, which a restore's map frames share.
        let to = Arc::clone(inst);
        let sent = tokio::spawn(async move {
            let mut wr = to.writer.lock().await;
            workers::send_frame(&mut wr, &frame).await
        })
        .await
        .unwrap_or_else(|e| Err(ConnError::Write(std::io::Error::other(e))));
        if let Err(e) = sent {
            lock(&inst.pending).remove(&id);
            return match e {
                ConnError::Frame(frames::FrameError::TooLong(n)) => Err(InvokeError::BadRequest(
                    format!("the request is {n} bytes, over the 64 MiB frame limit: send less data (e.g. a path)"),
                )),
                e => {
                    self.remove_instance(inst, &e.to_string(), true);
                    Err(crashed(inst))
                }
            };
        }
        if inst.announces_start {
            // With requests_per_instance > 1 the request may wait inside the worker behind
            // others, each of which ends or is killed within its own timeout_s: the timeout
            // counts from the start of the handler, and this bound only catches a worker that
            // never starts it. Passing it fails this request alone (503); the worker lives.
            let ahead = u32::try_from(per_instance.saturating_sub(1)).unwrap_or(u32::MAX);
            let bound = timeout
                .saturating_mul(ahead)
                .saturating_add(self.config.queue.timeout);
            // A restored instance's worker also waits here for the segments the request may
            // touch: that wait is bounded by the hand-over (MAP_TIMEOUT, then the instance
            // goes), so the bound counts only once every segment is mapped.
            let mut started_rx = started_rx;
            let mut waited = Duration::ZERO;
            let started = loop {
                match tokio::time::timeout(bound, &mut started_rx).await {
                    Err(_) if inst.still_mapping() => waited += bound,
                    r => break r,
                }
            };
            match started {
                Ok(Ok(())) => {}
                Ok(Err(_)) => {
                    // A result without `started` can only mean the instance is gone.
                    if inst.is_dead() {
                        return Err(crashed(inst));
                    }
                }
                Err(_) => {
                    lock(&inst.pending).remove(&id);
                    let retry = bound.as_secs().clamp(1, 60);
                    return Err(InvokeError::QueueTimeout {
                        message: format!(
                            "the request waited {:.1} s inside instance {} of {:?} without its \
                             handler starting: retry after {retry} s",
                            (waited + bound).as_secs_f64(),
                            inst.id,
                            inst.function
                        ),
                        retry_after_s: retry,
                    });
                }
            }
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(msg)) => Ok(msg),
            Ok(Err(_)) => Err(crashed(inst)),
            Err(_) => {
                lock(&inst.pending).remove(&id);
                let why = format!("the request ran past timeout_s = {}", timeout.as_secs_f64());
                self.remove_instance(inst, &why, true);
                Err(InvokeError::Timeout(format!(
                    "function {:?} did not answer within its timeout_s of {} s: its worker (pid {}) \
                     was killed and will be replaced; raise timeout_s in torpor.toml if the \
                     handler needs longer",
                    inst.function,
                    timeout.as_secs_f64(),
                    inst.worker_pid
                )))
            }
        }
    }

    /// An instance for one request: idle warm, else restored, else after a wait in the queue.
    async fn acquire(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
    ) -> Result<(Lease, &'static str, Timings), InvokeError> {
        let t0 = Instant::now();
        let limits = self.config.queue;
        let deadline = tokio::time::Instant::now() + limits.timeout;
        let mut slot: Option<QueueSlot<'_>> = None;
        loop {
            let notified = pool.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next = {
                let mut st = lock(&pool.state);
                if st.closed {
                    return Err(InvokeError::NotFound(format!(
                        "function {:?} was deleted",
                        pool.name
                    )));
                }
                let generation = st.generation;
                let per = st.info.per_instance;
                // Warm before gpu_released, standbys last (using another leaves them standing);
                // among equals, the least loaded.
                let idle = st
                    .instances
                    .iter_mut()
                    .filter(|(i, _)| !i.is_dead() && i.generation == generation)
                    .filter(|(i, n)| *n < per && !lock(&i.keep).busy)
                    .min_by_key(|(i, n)| {
                        let warm = lock(&i.keep).stage == Stage::Warm;
                        (!warm, crate::standby::is_standby(i), *n)
                    });
                if let Some((inst, n)) = idle {
                    *n += 1;
                    let kind = if crate::standby::take(inst) {
                        start::STANDBY
                    } else {
                        start::WARM
                    };
                    let released = {
                        let mut k = lock(&inst.keep);
                        let released = k.stage == Stage::GpuReleased;
                        k.busy |= released;
                        released
                    };
                    let lease = Lease {
                        pool: Arc::clone(pool),
                        instance: Arc::clone(inst),
                        runtime: Arc::clone(self),
                    };
                    Next::Warm(lease, released, kind)
                } else if let Some(ix) = st.sleepers.iter().rposition(|s| !s.keep.busy) {
                    // Every instance counts towards max_instances, in every stage: waking a
                    // hibernated one comes before restoring a new one.
                    let sleeper = st.sleepers.remove(ix);
                    st.starting += 1;
                    Next::Start(Box::new((st.info.clone(), st.generation, Some(sleeper))))
                } else if st.instances.len() + st.starting + st.sleepers.len()
                    < st.info.max_instances
                {
                    st.starting += 1;
                    Next::Start(Box::new((st.info.clone(), st.generation, None)))
                } else {
                    if slot.is_none() {
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
            if let Next::Warm(lease, released, kind) = next {
                drop(slot);
                let mut timings = vec![("queue".to_string(), t0.elapsed().as_secs_f64())];
                if released {
                    let inst = Arc::clone(&lease.instance);
                    match self.gpu_resume(&inst, false).await {
                        Ok((s, segments)) => {
                            timings.push(("gpu_resume".to_string(), s));
                            if let Some(s) = segments {
                                timings.push(("segments".to_string(), s));
                            }
                        }
                        Err(e) => {
                            let why = format!("resuming its GPU failed: {e}");
                            self.remove_instance(&inst, &why, true);
                            return Err(InvokeError::Internal(format!(
                                "cannot resume the GPU of instance {} of {:?}: {e}; the \
                                 instance was removed and the next request starts a new one",
                                inst.id, pool.name
                            )));
                        }
                    }
                }
                return Ok((lease, kind, timings));
            }
            if let Next::Start(start) = next {
                let (info, generation, sleeper) = *start;
                drop(slot);
                let queue_s = t0.elapsed().as_secs_f64();
                let (inst, mut timings, kind) =
                    self.start_in_task(pool, info, generation, sleeper).await?;
                timings.insert(0, ("queue".to_string(), queue_s));
                let lease = Lease {
                    pool: Arc::clone(pool),
                    instance: inst,
                    runtime: Arc::clone(self),
                };
                return Ok((lease, kind, timings));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
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

    /// Restores an instance in a task of its own, so that a request given up mid-way leaves no
    /// half-counted instance: the instance then joins the pool idle.
    async fn start_in_task(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        info: FnInfo,
        generation: u64,
        sleeper: Option<Sleeper>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), InvokeError> {
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
                let stage = s.keep.stage.as_str();
                rt.account(&pool2.name, stage, &mut s.keep, Some(0));
            }
            let gpu_fallback = if info.gpu { info.gpu_bytes } else { 0 };
            let charge = rt
                .starts
                .begin(&pool2.name, gpu_fallback, Arc::clone(&rt.metrics));
            let mut started = rt
                .start_instance(&pool2.name, &info, generation, sleeper.as_ref(), &charge)
                .await;
            if let (Err(e), Some(s)) = (&started, &sleeper) {
                tracing::warn!(function = %pool2.name, instance = %s.id, error = %e, "cannot wake the hibernated instance; discarding it and restoring the function snapshot");
                rt.discard_sleeper(s.id.clone(), s.snapshot_id.clone(), s.snapshot_dir.clone())
                    .await;
                started = rt
                    .start_instance(&pool2.name, &info, generation, None, &charge)
                    .await;
            }
            match &started {
                Ok((inst, _, _)) => charge.finish_into(&mut lock(&inst.keep).meter),
                Err(_) => drop(charge),
            }
            guard.armed = false;
            let mut st = lock(&pool2.state);
            st.starting -= 1;
            let out = match started {
                Ok((inst, _, _)) if st.closed => {
                    drop(st);
                    rt.remove_instance_of(&pool2, &inst, "stopped: its function was deleted", true);
                    st = lock(&pool2.state);
                    Err(format!("function {:?} was deleted", pool2.name))
                }
                // Removed already (its worker died): its removal found it in no pool, so it must
                // not join one now.
                Ok((inst, _, _)) if inst.is_dead() => Err(format!(
                    "the new instance of {:?} was removed: {}",
                    pool2.name,
                    inst.reason()
                )),
                Ok((inst, timings, kind)) => {
                    st.instances.push((Arc::clone(&inst), 1));
                    Ok((inst, timings, kind))
                }
                Err(e) => Err(e),
            };
            drop(st);
            if let Ok((inst, _, _)) = &out {
                inst.joined.notify_one();
            }
            if let Err(Ok((inst, _, _))) = tx.send(out) {
                // The request went away: the instance is idle.
                if let Some(slot) = lock(&pool2.state)
                    .instances
                    .iter_mut()
                    .find(|(i, _)| Arc::ptr_eq(i, &inst))
                {
                    slot.1 = 0;
                    lock(&inst.keep).idle_since = Instant::now();
                }
            }
            pool2.changed.notify_waiters();
        });
        rx.await
            .map_err(|_| InvokeError::Internal("the instance start task failed".to_string()))?
            .map_err(InvokeError::Internal)
    }

    /// Starts an instance: wakes `sleeper`, else restores the function snapshot, else (with
    /// `cold_start = "boot"`, or when the restore fails) boots one.
    pub(crate) async fn start_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: Option<&Sleeper>,
        charge: &crate::accounting::StartGuard<'_>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), String> {
        // A woken instance keeps its id and appends to its log.
        let id = sleeper.map_or_else(
            || format!("{name}-{}-{}", now_ms(), self.next()),
            |s| s.id.clone(),
        );
        let log = crate::instance_logs::instance_log(&self.logs_dir(), name, &id);
        crate::instance_logs::prune_in_background(
            Arc::clone(&self.registry),
            self.logs_dir(),
            name.to_string(),
        );
        let new = NewInstance {
            id: &id,
            log: &log,
            charge,
        };
        if sleeper.is_some() {
            return self
                .restore_instance(name, info, generation, sleeper, &new)
                .await;
        }
        if self.config.cold_start == ColdStart::Boot {
            return self.boot_instance(name, info, generation, &new).await;
        }
        let paused = lock(&self.restore_health)
            .get(name)
            .and_then(|h| h.paused_until)
            .is_some_and(|until| Instant::now() < until);
        let mut restore_error = None;
        if !paused {
            match self
                .restore_instance(name, info, generation, None, &new)
                .await
            {
                Ok(started) => {
                    // The failure count only: a pause the instance's background segment
                    // hand-over set meanwhile (a corrupt chunk) must stand.
                    if let Some(h) = lock(&self.restore_health).get_mut(name) {
                        h.failures = 0;
                    }
                    return Ok(started);
                }
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
        self.boot_instance(name, info, generation, &new)
            .await
            .map_err(|e| match restore_error {
                Some(r) => format!("{r}; booting one instead failed too: {e}"),
                None => format!("{e} (restores are paused after failing)"),
            })
    }

    /// Counts a failed restore of `name`'s function snapshot (pausing restores after
    /// [`RESTORE_FAILURES_TO_PAUSE`] in a row, or at once with `pause_now`); the count.
    fn restore_failed(&self, name: &str, pause_now: bool) -> u32 {
        let mut health = lock(&self.restore_health);
        let h = health.entry(name.to_string()).or_default();
        h.failures += 1;
        if pause_now || h.failures >= RESTORE_FAILURES_TO_PAUSE {
            h.paused_until = Some(Instant::now() + RESTORE_PAUSE);
        }
        h.failures
    }

    /// Boots an instance: launches a `--role function` worker, loads the function.
    async fn boot_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        new: &NewInstance<'_, '_>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), String> {
        let t = Instant::now();
        let fdir = PathBuf::from(info.spec["dir"].as_str().unwrap_or_default());
        let (init, worker, conn, mut timings) =
            crate::deploy::boot_function(self, &info.spec, &fdir, new.log, Some(new.charge))
                .await
                .map_err(|e| format!("cannot boot an instance of {name:?}: {e}"))?;
        timings.push(("start".to_string(), t.elapsed().as_secs_f64()));
        let inst = self
            .adopt(
                new.id.to_string(),
                name,
                info,
                generation,
                None,
                init,
                worker,
                conn,
            )
            .await?;
        tracing::info!(function = name, instance = %inst.id, pid = init, boot_ms = t.elapsed().as_secs_f64() * 1e3, "instance booted");
        Ok((inst, timings, start::BOOTED))
    }

    /// Restores the function snapshot (or `sleeper`'s), wakes the worker and waits for its
    /// `hello`.
    async fn restore_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: Option<&Sleeper>,
        new: &NewInstance<'_, '_>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), String> {
        let t = Instant::now();
        let from = sleeper.map_or(&info.snapshot_dir, |s| &s.snapshot_dir);
        // A function snapshot staged in memory is restored from there; a hibernation is never
        // staged (restored once, copying it first would only add a read).
        let staged = match sleeper {
            None => self.staging.get(from),
            Some(_) => None,
        };
        // The restore server fills the segments of a split snapshot meanwhile.
        let restoring = self
            .split
            .begin_restore(sleeper.map_or(&info.snapshot_id, |s| &s.snapshot_id));
        // The page source itself (lazy or copy), as `auto` chose it for this function.
        let how_pages = self.config.restore_server.pages.source(info.gpu);
        let how = HowToRestore {
            pages: how_pages,
            staged,
            ..HowToRestore::default()
        };
        let staged = how.staged.is_some();
        // Until the instance is adopted, `pages` stops the lazy-pages daemon if dropped (each
        // failure below kills the tree first).
        let RestoredTree {
            init,
            worker,
            pages,
        } = restore_with(from, &self.logs_dir(), new.log, how)
            .await
            .map_err(|e| format!("cannot start an instance of {name:?}: {e}"))?;
        new.charge.process_started(init);
        let restore_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let what = format!("an instance of {name:?} restored from {}", from.display());
        let conn = self.wake_function(name, init, worker, &what).await?;
        let reconnect_s = t.elapsed().as_secs_f64();
        let hello = Instant::now();
        // The instance takes requests once the plan is known; its segments follow.
        let handing = match restoring.planned().await {
            Ok(h) => h,
            Err(e) => {
                kill_tree(init);
                return Err(format!(
                    "an instance of {name:?} restored from {} did not get its segments: {e}",
                    from.display()
                ));
            }
        };
        let plan_s = hello.elapsed().as_secs_f64();
        let inst = self
            .adopt(
                new.id.to_string(),
                name,
                info,
                generation,
                sleeper,
                init,
                worker,
                conn,
            )
            .await?;
        // A woken instance's hibernation snapshot goes once nothing reads it any more: its
        // segments are mapped (they are read from its record meanwhile) and every lazy page is in.
        let hibernation = sleeper.map(|s| Arc::new(RemoveWhenDone(s.snapshot_dir.clone())));
        if handing.count() > 0 {
            let (mapping, done) = crate::split::server::Mapping::new(hello, handing.count());
            *lock(&inst.mapping) = Some(mapping);
            *lock(&inst.segments) =
                crate::split::release::InstanceSegments::handing(handing.plan());
            let rt = Arc::clone(self);
            let what = format!("an instance restored from {}", from.display());
            let function_snapshot = sleeper.is_none();
            let inst = Arc::clone(&inst);
            let reading = hibernation.clone();
            tokio::spawn(async move {
                rt.hand_over(inst, handing, done, &what, function_snapshot)
                    .await;
                drop(reading);
            });
        }
        if let Some(served) = pages.map(PendingPages::finish_in_background) {
            // A page the lazy-pages daemon failed to serve may be missing: the tree was killed.
            inst.pages_pending.store(true, Ordering::SeqCst);
            let (rt, inst) = (Arc::clone(self), Arc::clone(&inst));
            let reading = hibernation.clone();
            tokio::spawn(async move {
                let served = served.await;
                drop(reading);
                match served {
                    Ok(Ok(())) => inst.pages_pending.store(false, Ordering::SeqCst),
                    Ok(Err(e)) => {
                        rt.remove_instance(&inst, &format!("its lazy pages failed: {e}"), true)
                    }
                    Err(_) => rt.remove_instance(
                        &inst,
                        "its lazy pages daemon was lost (the task reaping it ended)",
                        true,
                    ),
                }
            });
        }
        drop(hibernation);
        tracing::info!(function = name, instance = %inst.id, pid = init, restore_ms = restore_s * 1e3, pages = ?how_pages, staged, "instance restored");
        let timings = vec![
            ("restore".to_string(), restore_s),
            ("reconnect".to_string(), reconnect_s),
            ("start".to_string(), restore_s + reconnect_s + plan_s),
        ];
        Ok((inst, timings, start::RESTORED))
    }

    /// Sends a restored instance its `map` frames as the fills complete, while it already takes
    /// requests, and waits for the last `mapped` (its reader counts them). A failed fill, a
    /// refused map or a timeout removes the instance (its requests are answered with the cause)
    /// and, for the function snapshot, pauses its restores: a retry would read the same store.
    async fn hand_over(
        self: Arc<Self>,
        inst: Arc<Instance>,
        handing: crate::split::server::HandingOver,
        done: oneshot::Receiver<()>,
        what: &str,
        function_snapshot: bool,
    ) {
        inst.joined.notified().await;
        let deadline = tokio::time::Instant::now() + crate::split::server::MAP_TIMEOUT;
        let sent = handing
            .send_maps(&inst.writer, |va, lease| {
                if inst.is_dead() {
                    return;
                }
                if let Some(m) = lock(&inst.mapping).as_mut() {
                    m.sent(va);
                }
                lock(&inst.segments).push(lease);
            })
            .await;
        let failed = match sent {
            Err(e) => e,
            Ok(()) => match tokio::time::timeout_at(deadline, done).await {
                Ok(Ok(())) => return,
                // The mapping was dropped: the instance is gone already, for its own reason.
                Ok(Err(_)) => return,
                Err(_) => {
                    let left = lock(&inst.mapping).as_ref().map_or(0, |m| m.unmapped());
                    format!(
                        "the worker did not map {left} segment(s) within {} s",
                        crate::split::server::MAP_TIMEOUT.as_secs()
                    )
                }
            },
        };
        if inst.is_dead() {
            return;
        }
        let why = format!("{what} did not get its segments: {failed}");
        if function_snapshot {
            self.restore_failed(&inst.function, true);
            tracing::warn!(function = %inst.function, instance = %inst.id, error = %why, pause_s = RESTORE_PAUSE.as_secs(), "restoring the function snapshot failed after the instance took requests; booting an instance instead of restoring until the pause ends or the function is deployed again");
        }
        self.remove_instance(&inst, &why, true);
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
    async fn attach(self: &Arc<Self>, inst: &Arc<Instance>, rd: OwnedReadHalf) {
        if inst.announces_start {
            let frame =
                json!({"type": "attached", "reattach_s": self.config.reattach.as_secs_f64()});
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

    /// At startup: takes back the live instances an earlier daemon left, whose workers
    /// reconnect on their own. Each counts as starting in its function's pool (so requests wait
    /// for it rather than start another past max_instances) until it reconnects, within
    /// [`READOPT_TIMEOUT`], or is killed and its row removed.
    pub async fn readopt(self: &Arc<Self>, orphans: Vec<InstanceRow>) {
        for row in orphans {
            let pool = match self.pool(&row.function).await {
                Ok(p) => p,
                Err(e) => {
                    self.drop_orphan(&row, &format!("its function cannot serve: {e:?}"))
                        .await;
                    continue;
                }
            };
            let generation = {
                let mut st = lock(&pool.state);
                st.starting += 1;
                st.generation
            };
            let guard = Starting {
                pool: Arc::clone(&pool),
                armed: true,
            };
            let rt = Arc::clone(self);
            tokio::spawn(async move { rt.readopt_one(pool, guard, generation, row).await });
        }
    }

    async fn readopt_one(
        self: Arc<Self>,
        pool: Arc<Pool>,
        mut guard: Starting,
        generation: u64,
        row: InstanceRow,
    ) {
        let Some(init) = row.pid else {
            return self.drop_orphan(&row, "its row has no pid").await;
        };
        let split = self.split_function(&pool).await;
        if row.stage == Stage::GpuReleased && split {
            // Its segments' contents were saved in the earlier daemon's memory (crate::split::
            // release): nothing can map them back.
            let why = "it released its GPU on the split path, and its segments' saved contents \
                       went with the earlier torpord";
            return self.drop_orphan(&row, why).await;
        }
        let worker = match crate::launcher::worker_pid(init) {
            Ok(w) => w,
            Err(e) => return self.drop_orphan(&row, &e).await,
        };
        let conn = match self.hub.claim(worker).wait(READOPT_TIMEOUT).await {
            Ok(c) => c,
            Err(e) => {
                let why = format!("its worker did not reconnect: {e}");
                return self.drop_orphan(&row, &why).await;
            }
        };
        let hello = &conn.hello;
        if !hello.reattach || hello.function.as_deref() != Some(row.function.as_str()) {
            let why = format!(
                "its worker reconnected as {:?} (reattach: {}), not as a lost instance of {:?}",
                hello.function, hello.reattach, row.function
            );
            return self.drop_orphan(&row, &why).await;
        }
        // Its idle time counts from now: the warm path does not write last_used, so the row
        // cannot say when it was last busy.
        let (inst, rd) = new_instance(
            row.id.clone(),
            &row.function,
            generation,
            init,
            worker,
            conn,
            Keep::new(row.stage, Instant::now()),
        );
        if split {
            // Its worker maps segments the earlier daemon handed it, and this daemon holds no
            // record of them to unmap and save: an in-place checkpoint would leave a process the
            // driver refuses to resume. It stays warm until it hibernates (the capture reads its
            // segments through the worker).
            inst.gpu_release_failed.store(true, Ordering::SeqCst);
        }
        guard.armed = false;
        {
            let mut st = lock(&pool.state);
            st.starting -= 1;
            st.instances.push((Arc::clone(&inst), 0));
        }
        self.attach(&inst, rd).await;
        pool.changed.notify_waiters();
        tracing::info!(function = %row.function, instance = %row.id, pid = init, stage = %row.stage, "re-adopted an instance of an earlier torpord");
    }

    /// Whether the function snapshot of `pool` is a split snapshot (unknown counts as split).
    async fn split_function(&self, pool: &Pool) -> bool {
        let (split, id) = (
            Arc::clone(&self.split),
            lock(&pool.state).info.snapshot_id.clone(),
        );
        !matches!(
            tokio::task::spawn_blocking(move || split.plan(&id)).await,
            Ok(Ok(None))
        )
    }

    /// An instance of an earlier daemon that cannot be taken back: killed, its row removed.
    async fn drop_orphan(&self, row: &InstanceRow, why: &str) {
        if let Some(pid) = row.pid {
            kill_tree(pid);
        }
        tracing::warn!(function = %row.function, instance = %row.id, pid = row.pid, "killed an instance of an earlier torpord: {why}");
        let registry = Arc::clone(&self.registry);
        let id = row.id.clone();
        let deleted =
            tokio::task::spawn_blocking(move || registry.with(|s| s.delete_instance(&id))).await;
        if !matches!(deleted, Ok(Ok(_))) {
            tracing::error!(instance = %row.id, "cannot remove the registry row of an instance that was not re-adopted");
        }
    }

    /// Hands each `result` to its request; anything else, or the end, removes the instance.
    async fn read_results(self: Arc<Self>, inst: Arc<Instance>, mut rd: OwnedReadHalf) {
        let why = loop {
            match frames::read_payload(&mut rd).await {
                Ok(Some(payload)) => {
                    let msg = match frames::parse(&payload) {
                        Ok(msg) => msg,
                        Err(e) => break format!("it sent a malformed frame ({e})"),
                    };
                    let kind = msg.get("type").and_then(Value::as_str);
                    if kind == Some("quiet") && inst.hibernating.load(Ordering::SeqCst) {
                        // The hibernation reads the rest: segment fds (split), then the EOF.
                        let tx = lock(&inst.quiet_tx).take();
                        match tx {
                            Some(tx) => match tx.send((msg, rd)) {
                                Ok(()) => return,
                                Err(_) => break "its hibernation was given up".to_string(),
                            },
                            None => break "it sent quiet twice".to_string(),
                        }
                    }
                    if kind == Some("mapped") {
                        // The segments of a restore (mapped while the instance takes requests)
                        // or of a GPU resume.
                        let answered = lock(&inst.mapping)
                            .as_mut()
                            .filter(|m| m.unmapped() > 0)
                            .map(|m| m.answer(&msg));
                        match answered {
                            Some(Ok(())) => continue,
                            Some(Err(why)) => break why,
                            None => {}
                        }
                    }
                    if kind == Some("unmapped") {
                        // The answer to the daemon's `unmap` (a GPU release).
                        let forward = lock(&inst.segment_replies).clone();
                        match forward {
                            Some(tx) if tx.send(msg).is_ok() => continue,
                            _ => {
                                break "it broke the protocol (sent unmapped while no segment was being unmapped)".to_string()
                            }
                        }
                    }
                    if kind == Some("started") {
                        let Some(id) = msg.get("id").and_then(Value::as_u64) else {
                            break "it broke the protocol (started without a numeric id)"
                                .to_string();
                        };
                        // Unknown: a request the daemon gave up on.
                        if let Some(p) = lock(&inst.pending).get_mut(&id) {
                            if let Some(tx) = p.started.take() {
                                let _ = tx.send(());
                            }
                        }
                        continue;
                    }
                    if kind != Some("result") {
                        break format!(
                            "it broke the protocol (sent a {} frame while serving requests)",
                            msg.get("type").unwrap_or(&Value::Null)
                        );
                    }
                    let Some(id) = msg.get("id").and_then(Value::as_u64) else {
                        break "it broke the protocol (a result without a numeric id)".to_string();
                    };
                    let value = match Answer::value_of(&payload) {
                        Ok(value) => value,
                        Err(e) => break format!("it sent a malformed result ({e})"),
                    };
                    let waiter = lock(&inst.pending).remove(&id);
                    match waiter {
                        Some(p) => {
                            let _ = p.result.send(Answer { msg, value });
                        }
                        None => {
                            tracing::debug!(instance = %inst.id, id, "result for a request that was given up")
                        }
                    }
                }
                Ok(None) => {
                    break "its connection closed (the worker exited or crashed)".to_string()
                }
                Err(e) => break format!("it sent a malformed frame ({e})"),
            }
        };
        self.remove_instance(&inst, &why, true);
    }

    /// Takes an instance out of service for good: fails its requests, kills its tree, drops
    /// its registry row. Idempotent.
    pub fn remove_instance(self: &Arc<Self>, inst: &Arc<Instance>, why: &str, kill: bool) {
        match lock(&self.pools).get(&inst.function).cloned() {
            Some(pool) => self.remove_instance_of(&pool, inst, why, kill),
            None => self.remove_instance_from(None, inst, why, kill),
        }
    }

    fn remove_instance_of(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
        why: &str,
        kill: bool,
    ) {
        self.remove_instance_from(Some(pool), inst, why, kill);
    }

    fn remove_instance_from(
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
            if let Err(e) = registry.with(|s| s.delete_instance(&id)) {
                tracing::error!(instance = %id, error = %e, "cannot remove the instance's registry row");
            }
        });
    }
}

/// An instance around a connected worker; its reader half is for [`Runtime::attach`].
fn new_instance(
    id: String,
    function: &str,
    generation: u64,
    init: i32,
    worker: i32,
    conn: WorkerConn,
    keep: Keep,
) -> (Arc<Instance>, OwnedReadHalf) {
    let inst = Arc::new(Instance {
        id,
        function: function.to_string(),
        init_pid: init,
        worker_pid: worker,
        generation,
        writer: tokio::sync::Mutex::new(conn.wr),
        announces_start: conn.hello.protocol >= 2,
        pending: Mutex::new(HashMap::new()),
        dead: AtomicBool::new(false),
        why_dead: Mutex::new(None),
        keep: Mutex::new(keep),
        hibernating: AtomicBool::new(false),
        quiet_tx: Mutex::new(None),
        gpu_release_failed: AtomicBool::new(false),
        segments: Mutex::new(Default::default()),
        segment_replies: Mutex::new(None),
        mapping: Mutex::new(None),
        pages_pending: AtomicBool::new(false),
        joined: tokio::sync::Notify::new(),
        standby: AtomicBool::new(false),
    });
    (inst, conn.rd)
}

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

/// Removes a snapshot directory the daemon wrote (a hibernation), logging a failure.
pub(crate) fn remove_snapshot_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove a hibernation snapshot");
        }
    }
    // Its segments in the chunk store, if it is a split snapshot.
    crate::split::release_snapshot_of_dir(dir);
}

fn fn_info(spec: &Value, snapshot_id: &str, dir: &Path, keepalive: &Keepalive) -> FnInfo {
    use crate::limits;
    let num = |v: Option<&Value>, default: f64| v.and_then(Value::as_f64).unwrap_or(default);
    FnInfo {
        keepalive: keepalive_of(spec, keepalive),
        gpu: num(spec.get("gpus"), 0.0) >= 1.0,
        gpu_bytes: num(spec.get("gpu_memory"), 0.0).clamp(0.0, limits::MAX_GPU_MEMORY as f64)
            as u64,
        spec: Arc::new(spec.clone()),
        snapshot_dir: dir.to_path_buf(),
        snapshot_id: snapshot_id.to_string(),
        timeout: limits::spec_secs(
            spec.get("timeout_s"),
            Duration::from_secs(30),
            0.001,
            limits::MAX_TIMEOUT_S,
        ),
        max_instances: limits::spec_count(
            spec.pointer("/scaling/max_instances"),
            1,
            1,
            limits::MAX_INSTANCES,
        ),
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
    }
}

/// A snapshot directory removed once the last holder drops it (e.g. a woken hibernation, read
/// by its segment fills and its lazy pages).
struct RemoveWhenDone(PathBuf);

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

/// SIGKILL to the init of an instance: its whole PID namespace goes.
pub fn kill_tree(init: i32) {
    if init > 1 {
        // SAFETY: kill(2) only sends a signal; the pid is one this daemon started or restored.
        unsafe { libc::kill(init, libc::SIGKILL) };
    }
}

/// How [`restore_with`] restores: where the pages come from, and the staged copy of the
/// snapshot to read instead of its disk copy.
#[derive(Default)]
pub struct HowToRestore {
    pub pages: torpor_snapshot::restore::PageSource,
    /// Restored from with sizes checked only (hashed when staged, on the daemon's root-only
    /// tmpfs since); held until CRIU's lazy-pages daemon has read every page.
    pub staged: Option<Arc<crate::staging::StagedCopy>>,
    /// Skip the driver's restore and unlock: the tree's CUDA state stays locked and
    /// checkpointed, as an in-place GPU release leaves it (a standby instance, crate::standby).
    /// Only the worker may use CUDA then: the GPU resume restores that one process.
    pub leave_gpu_checkpointed: bool,
}

/// A restored tree.
pub struct RestoredTree {
    pub init: i32,
    pub worker: i32,
    /// With lazy pages: the daemon still serving them.
    pub pages: Option<PendingPages>,
}

/// CRIU's lazy-pages daemon serving a restored tree, and the staged copy it reads from. Dropped
/// unfinished (the start of the instance failed and its tree was killed), the daemon is stopped
/// and reaped on a blocking thread.
pub struct PendingPages {
    lazy: Option<torpor_snapshot::restore::LazyRestore>,
    staged: Option<Arc<crate::staging::StagedCopy>>,
}

impl PendingPages {
    /// Reaps the daemon on a blocking thread once it has served every page; the answer says
    /// whether it did (if not, the tree was killed).
    pub fn finish_in_background(mut self) -> oneshot::Receiver<Result<(), String>> {
        let (tx, rx) = oneshot::channel();
        let (lazy, staged) = (self.lazy.take(), self.staged.take());
        tokio::task::spawn_blocking(move || {
            let served = lazy.map_or(Ok(()), |l| l.finish().map_err(|e| e.to_string()));
            let _ = tx.send(served);
            // The staged copy may go now: every page was read.
            drop(staged);
        });
        rx
    }
}

impl Drop for PendingPages {
    fn drop(&mut self) {
        if let Some(lazy) = self.lazy.take() {
            let staged = self.staged.take();
            tokio::task::spawn_blocking(move || {
                lazy.abandon();
                drop(staged);
            });
        }
    }
}

/// Restores a snapshot detached, every page copied and every file hashed first; returns
/// (init, worker). See [`restore_with`].
pub async fn restore(dir: &Path, log_dir: &Path, stdio: &Path) -> Result<(i32, i32), String> {
    let tree = restore_with(dir, log_dir, stdio, HowToRestore::default()).await?;
    Ok((tree.init, tree.worker))
}

/// Restores a snapshot (or its staged copy) detached (blocking work on the blocking pool), its
/// stdout and stderr going to `stdio`. A snapshot that does not record its stdio files (taken
/// by an older torpord) is restored onto the files it had, with a warning. With lazy pages, a
/// blocking thread reaps CRIU's lazy-pages daemon once it has served every page.
pub async fn restore_with(
    dir: &Path,
    log_dir: &Path,
    stdio: &Path,
    how: HowToRestore,
) -> Result<RestoredTree, String> {
    use torpor_snapshot::restore::{PageOptions, RestoreError, RestoreOptions, Verify};
    let (dir, verify) = match &how.staged {
        Some(copy) => (copy.dir().to_path_buf(), Verify::SizesOnly),
        None => (dir.to_path_buf(), Verify::Hashes),
    };
    let log_dir = log_dir.to_path_buf();
    let stdio = stdio.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let pages = PageOptions { source: how.pages };
        let restore_onto = |stdio: Option<&Path>| {
            torpor_snapshot::restore::restore_with(
                &RestoreOptions {
                    dir: &dir,
                    detach: true,
                    gpu_map: &[],
                    log_dir: &log_dir,
                    stdio,
                    verify,
                    resume_gpu: !how.leave_gpu_checkpointed,
                },
                &pages,
            )
        };
        let restored = match restore_onto(Some(&stdio)) {
            Err(RestoreError::StdioUnknown) => {
                tracing::warn!(snapshot = %dir.display(), "the snapshot records no stdout/stderr file: its instance keeps writing to the old log");
                restore_onto(None)
            }
            other => other,
        }
        .map_err(|e| e.to_string())?;
        let init = restored.pid;
        let cuda = restored.manifest.source.tree.iter().filter(|p| p.cuda).count();
        if how.leave_gpu_checkpointed && cuda > 1 {
            kill_tree(init);
            return Err(format!(
                "the snapshot has {cuda} CUDA processes; a standby instance resumes only the \
                 worker's: set scaling.standby = 0"
            ));
        }
        let pages = restored.lazy_pages.map(|lazy| PendingPages {
            lazy: Some(lazy),
            staged: how.staged,
        });
        match crate::launcher::worker_pid(init) {
            Ok(worker) => Ok(RestoredTree {
                init,
                worker,
                pages,
            }),
            Err(e) => {
                kill_tree(init);
                Err(e)
            }
        }
    })
    .await
    .map_err(|e| format!("restore task failed: {e}"))?
}

impl Runtime {
    /// Wakes a restored worker (`what` names it in errors) and checks that it is an instance of
    /// `name`; its tree is killed otherwise.
    pub(crate) async fn wake_function(
        &self,
        name: &str,
        init: i32,
        worker: i32,
        what: &str,
    ) -> Result<WorkerConn, String> {
        let conn = match wake(&self.hub, worker, RECONNECT_TIMEOUT).await {
            Ok(c) => c,
            Err(e) => {
                kill_tree(init);
                return Err(format!("{what} did not reconnect: {e}"));
            }
        };
        if conn.hello.role != "function" || conn.hello.function.as_deref() != Some(name) {
            kill_tree(init);
            return Err(format!(
                "{what} says it serves {:?} (role {}), not {name:?}: the snapshot is not this \
                 function's; deploy it again",
                conn.hello.function, conn.hello.role
            ));
        }
        Ok(conn)
    }
}

/// SIGUSR2 to a restored (or just snapshotted) worker, and its connection once it says hello
/// with `resumed: true`.
pub async fn wake(hub: &Arc<Hub>, worker: i32, timeout: Duration) -> Result<WorkerConn, String> {
    let claim = hub.claim(worker);
    // SAFETY: kill(2) only sends a signal to the worker this daemon restored.
    if unsafe { libc::kill(worker, libc::SIGUSR2) } != 0 {
        return Err(format!(
            "cannot signal worker {worker}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let conn = claim.wait(timeout).await.map_err(|e| e.to_string())?;
    if !conn.hello.resumed {
        return Err("its hello says resumed: false".to_string());
    }
    Ok(conn)
}
