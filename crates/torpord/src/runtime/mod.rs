//! The runtime: a function's instances, from their start to their end, and the requests they
//! serve. One [`Runtime`] holds what they share; each part of its work has a module:
//!
//! - [`pool`]: per function, its instances, starts and queue, and the routing of a request
//!   ([`Runtime::acquire`]: warm, else wake a hibernated one, else start one below
//!   `scaling.max_instances`, else queue; 429 when full, 503 after `queue.timeout_s`);
//! - [`invoke`]: one request sent to its instance and answered by the instance's reader;
//! - [`start`]: each way an instance starts (boot, restore, wake, standby), behind
//!   [`Runtime::start`](start), and the cold-start policy;
//! - [`lifecycle`]: an instance's states and transitions with their accounting and registry
//!   rows, its adoption into a pool and its removal;
//! - [`keepalive`]: the ticker that steps idle instances down (gpu_released, hibernated,
//!   evicted) and meters every stage;
//! - [`process`]: a worker tree's snapshot, restore, wake-up and kill (CRIU, signals);
//! - [`readopt`]: at startup, the instances an earlier daemon left;
//! - [`sandbox`]: which instance serves a sandboxed function (an instance hosting several);
//! - [`memory`]: each function's memory in each sandbox, its model, and admission by it;
//! - [`store`]: the communication store's values handed between sandboxes (memfds);
//! - [`workflow`]: a DAG of functions run as one request, in one sandbox where it can;
//! - [`instance`]: the instance itself (its connection, requests in flight, keep-alive state).
//!
//! Deploys (crate::deploy) use the runtime (boot a worker, snapshot it, restore a base); the
//! runtime never uses the deploy. docs/architecture.md follows a deploy and a cold invoke
//! through these files.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Config;
use crate::metrics::Metrics;
use crate::registry::{FunctionState, Registry};
use crate::runtime::start::RestoreHealth;
use crate::sync::lock;
use crate::workers::Hub;

pub mod device_choice;
pub mod instance;
pub mod invoke;
pub mod keepalive;
pub mod lifecycle;
pub mod memory;
pub mod migrate;
pub mod page_profile;
pub mod pages_pending;
pub mod pool;
pub mod process;
pub mod readopt;
pub mod sandbox;
pub mod start;
pub mod store;
pub mod store_gpu;
pub mod store_nodes;
pub mod workflow;

pub use instance::{kill_tree, Instance, Keep, Sleeper};
pub use invoke::{InvokeError, Invoked, Timings};
pub use lifecycle::remove_snapshot_dir;
pub use pool::{keepalive_of, Pool, StoppedInstances};

/// Everything the deploy and invoke paths share.
pub struct Runtime {
    pub config: Config,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub hub: Arc<Hub>,
    pub state_root: PathBuf,
    pub workers_socket: PathBuf,
    /// Where the `torpor` Python package lives, or why it was not found (reported at deploy).
    pub python_dir: Result<PathBuf, crate::sdk_dir::SdkDirError>,
    /// Deploys run one at a time (two deploys of one base must not both boot it).
    pub deploy_locks: crate::deploy_locks::DeployLocks,
    pub(crate) pools: Mutex<HashMap<String, Arc<Pool>>>,
    pub(crate) next_id: AtomicU64,
    /// The CUDA driver, loaded on first use (GPU release and resume).
    pub(crate) cuda:
        std::sync::OnceLock<Result<Arc<torpor_cuda::CudaDriver>, keepalive::CudaLoadError>>,
    /// NVML, if it loads, for per-worker GPU memory.
    pub(crate) nvml: std::sync::OnceLock<Option<torpor_cuda::Nvml>>,
    /// Instances being booted or restored, metered as `starting` (crate::accounting).
    pub(crate) starts: crate::accounting::Starts,
    /// Per function: how restores of its function snapshot have been failing.
    pub(crate) restore_health: Mutex<HashMap<String, RestoreHealth>>,
    /// The split path: chunk store, restore server, caches (crate::split).
    pub split: Arc<crate::split::Split>,
    /// Function snapshots staged in memory (crate::staging).
    pub staging: Arc<crate::staging::StageArea>,
    /// `restore_server.gpu_restores`: how many GPU restores may be in flight at once
    /// (torpor_snapshot::gpu_restore_slots); `None`: no bound.
    pub gpu_restore_slots: Option<Arc<torpor_snapshot::gpu_restore_slots::GpuRestoreSlots>>,
    /// Cold starts in flight per device, for their placement (device_choice).
    pub(crate) placing: device_choice::Placing,
    /// The node's GPUs of GPU 0's model, read once (device_choice).
    pub(crate) gpus_of_first_model: std::sync::OnceLock<Vec<u32>>,
    /// Seals every snapshot the daemon writes; restores refuse any it did not seal.
    pub snapshot_key: Arc<torpor_image::SnapshotKey>,
    /// Where each worker tree gets its cgroup (crate::cgroup); `None`: unconfined
    /// (`workers.allow_unconfined`, on a node without a usable cgroup file system).
    pub cgroups: Option<Arc<crate::cgroup::Cgroups>>,
    /// `[objstore]`: pushes after deploys, pulls of unknown functions (crate::objstore drives it; the Tier is crate::bucket).
    pub objstore: Option<Arc<crate::bucket::Tier>>,
    /// Live instances of an earlier daemon whose workers have not reconnected yet
    /// (crate::runtime::readopt): a stop kills them too.
    pub(crate) readopting: Mutex<readopt::Readopting>,
    /// The daemon is stopping ([`Runtime::shutdown`]): a start that fails then is not retried
    /// another way (a restore does not fall back to a boot).
    pub(crate) stopping: std::sync::atomic::AtomicBool,
    /// Which pool serves each sandboxed function (sandbox).
    pub(crate) sandbox_routes: sandbox::Routes,
    /// The communication store's values handed between processes (store).
    pub store: store::Store,
    /// The workers that mapped each block of the store's GPU memory and may have kept the
    /// mapping (store_gpu, "Kept mappings"): told to unmap it when the store lets go of it.
    pub(crate) store_mappers: Mutex<HashMap<u64, Vec<std::sync::Weak<Instance>>>>,
    /// The sandboxes' memory: models, accounts, admission (memory).
    pub(crate) memory: memory::Memory,
    /// Ready sandboxes per tenant and base (start::pooled).
    pub(crate) sandbox_pool: start::pooled::SandboxPool,
    /// Invocations sent with an Idempotency-Key, and the answers kept for their retries.
    pub keys: crate::idempotency::Keys,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Runtime { .. }")
    }
}

impl Runtime {
    /// The tenant of function `name`'s current deploy, when this daemon has a pool for it.
    pub fn pool_tenant(&self, name: &str) -> Option<String> {
        let pool = lock(&self.pools).get(name).cloned()?;
        let st = lock(&pool.state);
        Some(crate::tenant::of_spec(&st.info.spec).to_string())
    }

    /// The tenant of function `name`: its pool's spec's, else the registry's (a pool already
    /// gone), else the default tenant's. What its snapshots' chunk store and caches are scoped by.
    pub fn function_tenant(&self, name: &str) -> String {
        if let Some(t) = self.pool_tenant(name) {
            return t;
        }
        self.registry
            .with(|s| s.function(name))
            .ok()
            .flatten()
            .map_or_else(
                || crate::tenant::DEFAULT_TENANT.to_string(),
                |f| crate::tenant::of_spec(&f.spec).to_string(),
            )
    }

    pub fn new(
        config: Config,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        state_root: PathBuf,
        workers_socket: PathBuf,
        snapshot_key: Arc<torpor_image::SnapshotKey>,
        cgroups: Option<Arc<crate::cgroup::Cgroups>>,
    ) -> Self {
        let (store_gpu_bytes, store_gpu_spare) = (config.store_gpu_bytes, config.store_gpu_spare);
        Self {
            python_dir: crate::sdk_dir::python_dir(),
            deploy_locks: Default::default(),
            pools: Mutex::new(HashMap::new()),
            readopting: Mutex::new(Default::default()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            cuda: std::sync::OnceLock::new(),
            nvml: std::sync::OnceLock::new(),
            starts: crate::accounting::Starts::default(),
            restore_health: Mutex::new(HashMap::new()),
            split: Arc::new(
                crate::split::Split::new(
                    &state_root,
                    config.split,
                    config.split_gpu,
                    &config.restore_server,
                    &metrics,
                    Arc::clone(&snapshot_key),
                )
                .with_pcie(config.pcie),
            ),
            gpu_restore_slots: (config.restore_server.gpu_restores > 0).then(|| {
                Arc::new(torpor_snapshot::gpu_restore_slots::GpuRestoreSlots::new(
                    config.restore_server.gpu_restores as usize,
                ))
            }),
            placing: device_choice::Placing::default(),
            gpus_of_first_model: std::sync::OnceLock::new(),
            staging: Arc::new(crate::staging::StageArea::open(
                &state_root,
                config.restore_server.stage_bytes,
                &metrics,
                Arc::clone(&snapshot_key),
            )),
            snapshot_key,
            config,
            registry,
            metrics,
            hub: Arc::new(Hub::default()),
            state_root,
            workers_socket,
            cgroups,
            objstore: None,
            sandbox_routes: sandbox::Routes::default(),
            store: store::Store::new(store_gpu_bytes).with_spares(store_gpu_spare),
            store_mappers: Mutex::default(),
            memory: memory::Memory::default(),
            sandbox_pool: Default::default(),
            keys: Default::default(),
        }
    }

    /// The runtime with the object tier of `[objstore]` (crate::objstore drives it; the Tier is crate::bucket).
    pub fn with_objstore(mut self, objstore: Option<Arc<crate::bucket::Tier>>) -> Self {
        self.objstore = objstore;
        self
    }

    /// The cgroup of a new worker tree (`what` names it: an instance id, `base-…`), with the
    /// limits of `spec` (crate::limits::instance_limits); `Ok(None)`: workers are unconfined.
    pub(crate) fn worker_cgroup(
        &self,
        what: &str,
        spec: &serde_json::Value,
    ) -> Result<Option<crate::cgroup::Cgroup>, crate::cgroup::CgroupError> {
        let Some(cgroups) = &self.cgroups else {
            return Ok(None);
        };
        let limits = crate::limits::instance_limits(spec, &self.config.worker_limits);
        cgroups
            .create(&format!("{what}.{}", self.next()), limits)
            .map(Some)
    }

    /// The user a worker of `spec`'s tenant runs as (crate::users); `Ok(None)`: root.
    pub(crate) fn worker_user(
        &self,
        spec: &serde_json::Value,
    ) -> Result<Option<torpor_snapshot::launch::User>, crate::users::UserError> {
        crate::users::of_tenant(
            &self.registry,
            &self.config.worker_users,
            crate::tenant::of_spec(spec),
        )
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
    /// daemon's end of its connection closes) and its registry row removed, synchronously; the
    /// starts in flight are waited for, each stopping its instance as it ends.
    pub fn shutdown(&self) {
        self.stop_every_instance();
        self.sandbox_pool.clear();
        self.staging.shut_down();
    }

    pub(crate) fn stop_every_instance(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // The instances of an earlier daemon still waiting for their workers to reconnect: no
        // pool holds them yet, and a worker that reconnects after this finds no daemon and
        // retries for its reattach_s (60 s by default) before it exits. Closed first, so that
        // none joins a pool once the pools are drained below.
        let mut ids: Vec<String> = Vec::new();
        for (id, init) in lock(&self.readopting).close() {
            kill_tree(init);
            ids.push(id);
        }
        let pools: Vec<Arc<Pool>> = lock(&self.pools).drain().map(|(_, p)| p).collect();
        for pool in &pools {
            let live: Vec<Arc<Instance>> = {
                let mut st = lock(&pool.state);
                // A start still in flight (its request answered by another instance, or gone)
                // sees the close when it ends and stops its instance (crate::runtime::start).
                st.closed = Some(pool::Closed::DaemonStop);
                st.instances.drain(..).map(|(i, _)| i).collect()
            };
            for inst in live {
                let _ = self.step(
                    &inst.function,
                    &mut lock(&inst.keep),
                    lifecycle::Transition::Remove,
                );
                lock(&inst.pending).clear();
                kill_tree(inst.init_pid);
                ids.push(inst.id.clone());
            }
        }
        wait_for_starts(&pools, STARTS_AT_STOP);
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
}

/// How long a graceful stop waits for the starts in flight (restores or boots whose request
/// was answered by another instance, late binding) to end and stop their instances; a restore
/// takes well under a second on the CPU and a few on the GPU.
const STARTS_AT_STOP: std::time::Duration = std::time::Duration::from_secs(20);

/// Waits until no start of `pools` (all closed) is in flight, at most `bound`: each one that
/// ends stops its instance (crate::runtime::start), so none outlives the daemon. Blocking: the
/// daemon's stop runs it on the blocking pool while the starts' tasks run on.
fn wait_for_starts(pools: &[Arc<Pool>], bound: std::time::Duration) {
    let in_flight = || -> usize { pools.iter().map(|p| lock(&p.state).starting).sum() };
    let deadline = std::time::Instant::now() + bound;
    let mut left = in_flight();
    if left > 0 {
        tracing::info!(starts = left, "waiting for the starts in flight to end");
    }
    while left > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        left = in_flight();
    }
    if left > 0 {
        tracing::warn!(
            starts = left,
            bound_s = bound.as_secs(),
            "starts still in flight at the stop's bound; their instances may outlive this torpord"
        );
    }
}
