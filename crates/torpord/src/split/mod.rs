//! The split snapshot path on the daemon's side (docs/split.md): **capture** takes a quiet
//! worker's segments into the chunk store before the transparent snapshot of what remains, and
//! the **restore server** gives each restored instance its segments back, in first-use order,
//! while CRIU restores the rest.
//!
//! | module | idea |
//! |---|---|
//! | [`fds`] | frames carrying an fd (`SCM_RIGHTS`) on a worker connection |
//! | [`device`] | a segment's memory on either backend, as the daemon copies it |
//! | [`index`] | the segments index of a snapshot, kept in the chunk store |
//! | [`capture`] | quiesce with `split`, hash, store, release |
//! | [`cache`] | the byte-bounded LRU of the host and GPU caches |
//! | [`server`] | filling segments for a restore; shared read-only copies |
//! | [`fill`] | a plan's fills: several segments at once, bounded, each sent as it completes |
//! | [`migrate`] | an instance's segments copied to another device while it serves, the changed blocks in the stop |
//! | [`pcie`] | the fair PCIe scheduler every host→device copy of a device goes through |
//! | [`precopy`] | a concurrent hibernation: segments copied while the instance serves, the changed blocks in the stop |
//! | [`release`] | an instance's segments across gpu_released: saved, given back, filled again |
//!
//! The chunk store is `<state>/chunks`; a snapshot's record there is named by the snapshot id,
//! and is released (then GC runs) whenever the daemon removes the snapshot's directory
//! ([`release_snapshot_of_dir`]).

pub mod cache;
pub mod capture;
pub mod device;
pub mod fds;
pub mod fill;
pub mod index;
pub mod migrate;
pub mod pcie;
pub mod pool;
pub mod precopy;
pub mod prefill;
pub mod release;
pub mod server;
#[cfg(test)]
mod test_worker;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts};
use torpor_image::store::{ChunkStore, StoreError};

use crate::config::{PcieConfig, RestoreServer};
use cache::Lru;
use device::{Backend, HostBuffer, Memory, SegmentDevice};
use index::Planned;
use server::SharedCopy;

/// The chunk store's directory under the state directory.
pub const STORE_DIR: &str = "chunks";
/// The environment variable naming the hook library (for the daemon and its workers alike).
pub const HOOK_LIB_ENV: &str = "TORPOR_HOOK_LIB";
/// The hook library's file name, looked for beside the daemon's executable.
pub const HOOK_LIB_FILE: &str = "libtorpor_hook.so";

/// The restore server's metrics.
#[derive(Clone)]
pub struct SplitMetrics {
    /// `torpor_restore_cache_bytes{cache}`: bytes held by the host and the GPU cache.
    pub cache_bytes: IntGaugeVec,
    /// `torpor_restore_cache_requests_total{cache, result}`: hits and misses.
    pub cache_requests: IntCounterVec,
    /// `torpor_restore_fill_gbps{source}`: fill bandwidth of each segment, GB/s.
    pub fill_gbps: HistogramVec,
    /// `torpor_restore_shared_bytes`: bytes of resident shared read-only copies.
    pub shared_bytes: IntGauge,
    /// `torpor_pcie_wait_seconds{device}`: how long each host→device transfer waited for its
    /// first block.
    pub pcie_wait: HistogramVec,
    /// `torpor_pcie_bytes_total{device}`: bytes copied host→device.
    pub pcie_bytes: IntCounterVec,
    /// `torpor_pcie_transfers{device}`: host→device transfers in progress.
    pub pcie_active: IntGaugeVec,
    /// `torpor_host_pool_bytes{state}`: the pinned host pool's bytes (`total`) and those not
    /// handed out (`free`); 0 until it is made (crate::split::pool).
    pub host_pool_bytes: IntGaugeVec,
}

impl SplitMetrics {
    /// Creates the metrics and registers them with `metrics` (a failure to register is logged:
    /// the restore server works without its metrics).
    pub fn new(metrics: &crate::metrics::Metrics) -> Self {
        let m = Self::create().expect("the restore server's metric names and labels are valid");
        for c in [
            Box::new(m.cache_bytes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.cache_requests.clone()),
            Box::new(m.fill_gbps.clone()),
            Box::new(m.shared_bytes.clone()),
            Box::new(m.pcie_wait.clone()),
            Box::new(m.pcie_bytes.clone()),
            Box::new(m.pcie_active.clone()),
            Box::new(m.host_pool_bytes.clone()),
        ] {
            if let Err(e) = metrics.register(c) {
                tracing::warn!(error = %e, "cannot register a restore server metric");
            }
        }
        for state in ["total", "free"] {
            m.host_pool_bytes.with_label_values(&[state]).set(0);
        }
        for cache in ["host", "gpu"] {
            m.cache_bytes.with_label_values(&[cache]).set(0);
            for result in ["hit", "miss"] {
                m.cache_requests.with_label_values(&[cache, result]);
            }
        }
        m
    }

    fn create() -> Result<Self, prometheus::Error> {
        Ok(Self {
            cache_bytes: IntGaugeVec::new(
                Opts::new(
                    "torpor_restore_cache_bytes",
                    "Bytes held by the restore server's caches (host, gpu).",
                ),
                &["cache"],
            )?,
            cache_requests: IntCounterVec::new(
                Opts::new(
                    "torpor_restore_cache_requests_total",
                    "Restore server cache look-ups, by cache and result (hit, miss).",
                ),
                &["cache", "result"],
            )?,
            fill_gbps: HistogramVec::new(
                HistogramOpts::new(
                    "torpor_restore_fill_gbps",
                    "Fill bandwidth of each restored segment in GB/s, by source (shared, gpu, host, store, saved).",
                )
                .buckets(vec![0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 200.0]),
                &["source"],
            )?,
            host_pool_bytes: IntGaugeVec::new(
                Opts::new(
                    "torpor_host_pool_bytes",
                    "The pinned host pool the host cache's buffers come from, by state (total, free).",
                ),
                &["state"],
            )?,
            shared_bytes: IntGauge::new(
                "torpor_restore_shared_bytes",
                "Bytes of shared read-only segment copies resident for live instances.",
            )?,
            pcie_wait: HistogramVec::new(
                HistogramOpts::new(
                    "torpor_pcie_wait_seconds",
                    "How long each host-to-device transfer waited for its first block, by device.",
                )
                .buckets(vec![
                    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
                ]),
                &["device"],
            )?,
            pcie_bytes: IntCounterVec::new(
                Opts::new(
                    "torpor_pcie_bytes_total",
                    "Bytes copied host-to-device through the PCIe scheduler, by device.",
                ),
                &["device"],
            )?,
            pcie_active: IntGaugeVec::new(
                Opts::new(
                    "torpor_pcie_transfers",
                    "Host-to-device transfers in progress (waiting for their turn or copying), by device.",
                ),
                &["device"],
            )?,
        })
    }

    /// The scheduler metrics of device `label` (`host`, `cuda0`).
    fn pcie(&self, label: &str) -> pcie::PcieMetrics {
        pcie::PcieMetrics {
            wait: self.pcie_wait.with_label_values(&[label]),
            bytes: self.pcie_bytes.with_label_values(&[label]),
            active: self.pcie_active.with_label_values(&[label]),
        }
    }
}

/// The daemon's split-path state: the store, the devices, the caches and the shared copies.
pub struct Split {
    /// Split snapshots for functions deployed from now on (config `split`, and the hook found).
    pub enabled: bool,
    /// GPU memory too (config `split_gpu`): GPU workers get the hook preloaded.
    pub gpu_enabled: bool,
    /// The hook library workers are started with, if found: the state directory's copy of it.
    pub hook_lib: Option<PathBuf>,
    /// Where it was found ([`find_hook_lib`]), which `torpor status` names.
    pub hook_found: Option<PathBuf>,
    /// Why none was found ([`HookLibError`]'s line).
    pub hook_missing: Option<String>,
    store_root: PathBuf,
    /// Each tenant's chunk store, opened on first use ([`Split::store_for`]).
    stores: Mutex<HashMap<String, ChunkStore>>,
    host: OnceLock<Arc<dyn SegmentDevice>>,
    cuda: Mutex<HashMap<i32, Arc<dyn SegmentDevice>>>,
    pub(crate) host_cache: Mutex<Lru<Mutex<HostBuffer>>>,
    pub(crate) gpu_cache: Mutex<Lru<Memory>>,
    pub(crate) shared: Mutex<HashMap<String, Weak<SharedCopy>>>,
    /// Segment plans of function snapshots, loaded once (snapshot ids are never reused).
    plans: Mutex<HashMap<String, Option<Arc<Vec<Planned>>>>>,
    pub metrics: SplitMetrics,
    /// Each device's PCIe scheduler is made with this.
    pcie: PcieConfig,
    /// Seals the records of the segments it stores; restores refuse a record it did not seal.
    pub(crate) key: Arc<torpor_image::SnapshotKey>,
    /// How many segments of one plan are filled at once.
    pub(crate) fill_bounds: fill::FillBounds,
    /// `restore_server.peer_copy`: a GPU segment may be filled from another GPU's cache entry
    /// over the GPUs' peer path (a cold start placed on another GPU than the deploy's).
    pub(crate) peer_copy: bool,
    /// Tests: called at each step of a fill, with its plan index.
    #[cfg(test)]
    pub(crate) fill_hook: Option<FillHook>,
}

/// [`Split::fill_hook`]'s type.
#[cfg(test)]
pub(crate) type FillHook = Arc<dyn Fn(fill::FillStep, usize) + Send + Sync>;

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("enabled", &self.enabled)
            .field("hook_lib", &self.hook_lib)
            .finish_non_exhaustive()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The chunk store cannot be opened (kept: every later use gets the same answer, until the
/// daemon restarts).
#[derive(Debug, Clone, thiserror::Error)]
#[error(transparent)]
pub struct StoreOpenError(pub Arc<torpor_image::store::StoreError>);

/// Why the device holding a worker's segment cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceOpenError {
    /// The GPU cannot be opened for the split path (the driver's error code is inside).
    #[error("cannot open GPU {ordinal} for the split path: {source}")]
    Gpu {
        ordinal: i32,
        #[source]
        source: torpor_device::DeviceError,
    },
    /// The worker named a backend this daemon does not know (a newer harness).
    #[error(
        "the worker reported a segment of backend {backend:?}; this torpord knows host and cuda"
    )]
    UnknownBackend { backend: String },
}

/// Why the segment plan of a snapshot cannot be had.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The chunk store holding its record cannot be opened.
    #[error(transparent)]
    Store(#[from] StoreOpenError),
    /// Its record or index cannot be read, or does not hold together.
    #[error(transparent)]
    Index(#[from] index::IndexError),
}

/// Why no hook library was found.
#[derive(Debug, thiserror::Error)]
pub enum HookLibError {
    /// `$TORPOR_HOOK_LIB` names something that is not a file.
    #[error("${HOOK_LIB_ENV}={} is not a file: point it at libtorpor_hook.so", .0.display())]
    NotAFile(PathBuf),
    /// None in any of the places looked at (`looked`, in order).
    #[error(
        "no {HOOK_LIB_FILE} in {} and ${HOOK_LIB_ENV} is not set: install the wheel \
         (`make wheel`, which ships it in the torpor package), build it (`cargo build -p \
         torpor-hook --lib`, beside the torpor binary) or set ${HOOK_LIB_ENV}",
        .looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NotFound { looked: Vec<PathBuf> },
    /// It was found but could not be copied into the state directory.
    #[error("cannot copy {} into {}: {source}; free space there", lib.display(), dir.display())]
    Copy {
        lib: PathBuf,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where in the state directory workers' copies of the hook live (the directory `torpor run`'s
/// launcher copies preloaded libraries into, so one copy serves both).
pub const HOOK_COPY_DIR: &str = "preload";

/// The hook library: `$TORPOR_HOOK_LIB`, else `libtorpor_hook.so` beside the executable (a
/// build tree, `target/<profile>/`), else in the `torpor` Python package the daemon gives its
/// workers ([`crate::sdk_dir::python_dir`]), where the wheel installs it.
pub fn find_hook_lib() -> Result<PathBuf, HookLibError> {
    if let Some(p) = std::env::var_os(HOOK_LIB_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(std::path::absolute(&p).unwrap_or(p))
        } else {
            Err(HookLibError::NotAFile(p))
        };
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        let exe = exe.canonicalize().unwrap_or(exe);
        looked.push(exe.with_file_name(HOOK_LIB_FILE));
    }
    if let Ok(python) = crate::sdk_dir::python_dir() {
        looked.push(python.join("torpor").join(HOOK_LIB_FILE));
    }
    match looked.iter().find(|p| p.is_file()) {
        Some(found) => Ok(found.clone()),
        None => Err(HookLibError::NotFound { looked }),
    }
}

/// How a worker uses the hook library [`Split::worker_hook`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HookUse {
    /// `TORPOR_HOOK_LIB` names it, so that `torpor.buffer()` works: every worker on the split
    /// path.
    pub buffers: bool,
    /// Whether and how it is preloaded.
    pub preload: HookPreload,
}

/// Whether and how a worker has the hook preloaded (`LD_PRELOAD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookPreload {
    /// Not preloaded: CPU workers.
    No,
    /// Preloaded without `TORPOR_HOOK_CUDA`: no allocation changes, only the records of GPU
    /// state the driver's checkpoint cannot restore (CUDA IPC, managed memory, multi-rank NCCL),
    /// so that a snapshot of the worker refuses it before the driver is touched
    /// (crates/torpor-hook/src/markers.rs). GPU workers off the split GPU path.
    Watch,
    /// Preloaded with `TORPOR_HOOK_CUDA=1`: big allocations become segments (the split GPU
    /// path); it watches too.
    Segments,
}

impl Split {
    pub fn new(
        state_root: &Path,
        wanted: bool,
        wanted_gpu: bool,
        limits: &RestoreServer,
        metrics: &crate::metrics::Metrics,
        key: Arc<torpor_image::SnapshotKey>,
    ) -> Self {
        // Workers get a copy in the state directory, named by its hash: the state directory is
        // in every worker's mount namespace (a library under /tmp is not: workers have their own
        // /tmp, and a checkout there made every split deploy fail at quiesce), and a snapshot
        // that maps the library stays restorable when the build replaces the original.
        let found = find_hook_lib().and_then(|lib| {
            let dir = state_root.join(HOOK_COPY_DIR);
            match torpor_snapshot::launch::content_addressed_copy(&lib, &dir) {
                Ok(copy) => Ok((lib, copy)),
                Err(source) => Err(HookLibError::Copy { lib, dir, source }),
            }
        });
        let hook_missing = found.as_ref().err().map(ToString::to_string);
        let (hook_found, hook_lib) = match found {
            Ok((lib, copy)) => (Some(lib), Some(copy)),
            Err(e) => {
                let off = if wanted {
                    "split snapshots are off and "
                } else {
                    ""
                };
                tracing::warn!(
                    "{off}GPU workers start without the hook (CUDA IPC, managed memory and \
                     multi-rank NCCL are then seen only when the driver's checkpoint fails): {e}"
                );
                (None, None)
            }
        };
        Self {
            enabled: wanted && hook_lib.is_some(),
            gpu_enabled: wanted && wanted_gpu && hook_lib.is_some(),
            hook_lib,
            hook_found,
            hook_missing,
            store_root: state_root.join(STORE_DIR),
            stores: Mutex::new(HashMap::new()),
            host: OnceLock::new(),
            cuda: Mutex::new(HashMap::new()),
            host_cache: Mutex::new(Lru::new(limits.host_cache_bytes)),
            gpu_cache: Mutex::new(Lru::new(limits.gpu_cache_bytes)),
            shared: Mutex::new(HashMap::new()),
            plans: Mutex::new(HashMap::new()),
            metrics: SplitMetrics::new(metrics),
            pcie: PcieConfig::default(),
            key,
            fill_bounds: fill::FillBounds {
                segments: limits.fill_segments.max(1) as usize,
                bytes: limits.fill_bytes,
            },
            peer_copy: limits.peer_copy,
            #[cfg(test)]
            fill_hook: None,
        }
    }

    /// Devices opened from now on schedule their host→device copies with `config` (set once,
    /// before any device is opened).
    pub fn with_pcie(mut self, config: PcieConfig) -> Self {
        self.pcie = config;
        self
    }

    fn scheduler(&self, label: &str) -> pcie::Pcie {
        pcie::Pcie::new(label, self.pcie, Some(self.metrics.pcie(label)))
    }

    /// How a worker gets the hook: (the library, how it is used); no library when the worker
    /// does not use it or none was found. With split on, every worker
    /// gets the library (`torpor.buffer()`), and with `split_gpu` a GPU worker has it preloaded
    /// with `TORPOR_HOOK_CUDA=1`, so that its big CUDA allocations become segments. Every other
    /// GPU worker has it preloaded to watch ([`HookPreload::Watch`]), so that CUDA IPC, managed
    /// memory and multi-rank NCCL are refused before the driver is touched, as for `torpor run`.
    /// With `split = false` no worker gets `TORPOR_HOOK_LIB`: the transparent path, where
    /// `torpor.buffer()` raises an error naming it (CRIU cannot restore the sealed memfds of
    /// read-only buffers).
    pub fn worker_hook(&self, gpu: bool) -> (Option<PathBuf>, HookUse) {
        let preload = match (gpu, self.gpu_enabled) {
            (false, _) => HookPreload::No,
            (true, true) => HookPreload::Segments,
            (true, false) => HookPreload::Watch,
        };
        let using = HookUse {
            buffers: self.enabled,
            preload,
        };
        let used = using.buffers || using.preload != HookPreload::No;
        (self.hook_lib.clone().filter(|_| used), using)
    }

    /// The part of a base key that says how the base's workers got the hook: a base booted
    /// otherwise is never restored for this daemon's deploys.
    pub fn base_key_suffix(&self, gpu: bool) -> &'static str {
        let (lib, using) = self.worker_hook(gpu);
        if lib.is_none() {
            return "";
        }
        match (using.buffers, using.preload) {
            (false, HookPreload::No) => "",
            (false, _) => "|watch",
            (true, HookPreload::No) => "|hook",
            (true, HookPreload::Watch) => "|hook+watch",
            (true, HookPreload::Segments) => "|hook+cuda",
        }
    }

    /// The chunk store of `tenant`'s snapshots (opened, and created, on first use). Each tenant
    /// has a store of its own, so chunks are deduplicated within a tenant only: with one store,
    /// a deploy's `stored_bytes` (and how long its store took) would tell a tenant whether
    /// another tenant had stored the same bytes (docs/security.md, "Tenants").
    pub fn store_for(&self, tenant: &str) -> Result<ChunkStore, StoreOpenError> {
        let mut stores = lock(&self.stores);
        if let Some(s) = stores.get(tenant) {
            return Ok(s.clone());
        }
        let store = ChunkStore::open(&store_root_of(&self.store_root, tenant))
            .map_err(|e| StoreOpenError(Arc::new(e)))?;
        stores.insert(tenant.to_string(), store.clone());
        Ok(store)
    }

    /// The GPUs opened so far (their ordinals, ascending).
    pub(crate) fn open_gpus(&self) -> Vec<i32> {
        let mut gpus: Vec<i32> = lock(&self.cuda).keys().copied().collect();
        gpus.sort_unstable();
        gpus
    }

    /// The device of `backend` (and GPU `ordinal` for cuda), opened on first use.
    pub fn device(
        &self,
        backend: &str,
        ordinal: i32,
    ) -> Result<Arc<dyn SegmentDevice>, DeviceOpenError> {
        match backend {
            "host" => Ok(Arc::clone(self.host.get_or_init(|| {
                Arc::new(Backend::new(
                    torpor_device::host::HostDevice::new(),
                    self.scheduler("host"),
                ))
            }))),
            "cuda" => {
                let mut cuda = lock(&self.cuda);
                if let Some(d) = cuda.get(&ordinal) {
                    return Ok(Arc::clone(d));
                }
                let d: Arc<dyn SegmentDevice> = Arc::new(Backend::new(
                    torpor_device::cuda::CudaDevice::open(ordinal)
                        .map_err(|source| DeviceOpenError::Gpu { ordinal, source })?,
                    self.scheduler(&format!("cuda{ordinal}")),
                ));
                cuda.insert(ordinal, Arc::clone(&d));
                Ok(d)
            }
            other => Err(DeviceOpenError::UnknownBackend {
                backend: other.to_string(),
            }),
        }
    }

    /// The segments of snapshot `id` in fill order; `None` for a transparent snapshot.
    pub fn plan(&self, id: &str, tenant: &str) -> Result<Option<Arc<Vec<Planned>>>, PlanError> {
        if let Some(p) = lock(&self.plans).get(id) {
            return Ok(p.clone());
        }
        if !store_root_of(&self.store_root, tenant).is_dir() {
            return Ok(None);
        }
        let plan = index::load(&self.store_for(tenant)?, id, &self.key)?.map(Arc::new);
        // Function snapshots are restored again and again; a hibernation once, so caching its
        // plan would only grow the map with every hibernation the daemon ever took.
        if !id.starts_with("hib-") {
            lock(&self.plans).insert(id.to_string(), plan.clone());
        }
        Ok(plan)
    }

    /// The evicted stage: drops the cached segments of snapshot `id`, a function of `tenant`,
    /// that snapshot `keep` (the function snapshot, whose restores go on) does not also hold.
    pub fn drop_cached(&self, id: &str, keep: Option<&str>, tenant: &str) {
        let Ok(Some(plan)) = self.plan(id, tenant) else {
            return;
        };
        let kept: std::collections::HashSet<String> = keep
            .and_then(|k| self.plan(k, tenant).ok().flatten())
            .map(|p| p.iter().map(|(e, _)| e.blake3.clone()).collect())
            .unwrap_or_default();
        let mut dropped = 0u64;
        for (e, _) in plan.iter().filter(|(e, _)| !kept.contains(&e.blake3)) {
            let hkey = crate::tenant::scoped_key(tenant, &e.blake3);
            if lock(&self.host_cache).remove(&hkey) {
                dropped += e.size;
            }
            let gkey = crate::tenant::scoped_key(tenant, &server::gpu_key(e));
            if lock(&self.gpu_cache).remove(&gkey) {
                dropped += e.size;
            }
        }
        self.update_cache_gauges();
        if dropped > 0 {
            tracing::info!(
                snapshot = id,
                bytes = dropped,
                "dropped an evicted snapshot's cached segments"
            );
        }
    }

    pub(crate) fn update_cache_gauges(&self) {
        let host = lock(&self.host_cache).used();
        let gpu = lock(&self.gpu_cache).used();
        let set = |cache: &str, v: u64| {
            self.metrics
                .cache_bytes
                .with_label_values(&[cache])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set("host", host);
        set("gpu", gpu);
        // The pool's device if it is open (never opened for a gauge).
        let opened = lock(&self.cuda)
            .get(&0)
            .cloned()
            .or_else(|| self.host.get().map(Arc::clone));
        if let Some((total, free)) = opened.and_then(|d| d.host_pool()) {
            for (state, v) in [("total", total), ("free", free)] {
                self.metrics
                    .host_pool_bytes
                    .with_label_values(&[state])
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
        }
    }

    /// The device whose host buffers the host cache holds: GPU 0 where the node has one (what
    /// a pull's prefill fills, crate::split::prefill), the host backend otherwise. Opened here
    /// if it was not.
    pub(crate) fn pool_device(&self) -> Option<Arc<dyn SegmentDevice>> {
        self.device("cuda", 0)
            .or_else(|_| self.device("host", -1))
            .ok()
    }

    /// At the daemon's start, off its path: opens every GPU of the node (driver, primary
    /// context, copy streams and staging: on the H100 the first pull paid this before its
    /// transfer began) and, when `pin_host_cache` holds, makes the host cache's memory as one
    /// pinned pool on GPU 0 (crate::split::pool). Without a GPU or with split off, nothing.
    /// Blocking.
    pub fn open_gpus_at_start(&self, pin_host_cache: bool) {
        if !self.gpu_enabled {
            return;
        }
        let count = match torpor_cuda::CudaDriver::load().and_then(|d| d.devices()) {
            Ok(devices) => devices.len(),
            Err(e) => {
                tracing::debug!(error = %e, "no GPU opened at start");
                return;
            }
        };
        let t = std::time::Instant::now();
        for ordinal in 0..count {
            if let Err(e) = self.device("cuda", ordinal as i32) {
                tracing::warn!(ordinal, error = %e, "cannot open a GPU at start: its first fill opens it");
            }
        }
        let opened_s = t.elapsed().as_secs_f64();
        let bytes = lock(&self.host_cache).capacity();
        if !pin_host_cache || bytes == 0 || count == 0 {
            tracing::info!(gpus = count, opened_s, "GPUs opened");
            return;
        }
        let Ok(dev) = self.device("cuda", 0) else {
            return;
        };
        match dev.make_host_pool(usize::try_from(bytes).unwrap_or(usize::MAX)) {
            Ok(pinned) => tracing::info!(
                gpus = count,
                opened_s,
                pinned_bytes = pinned,
                pinned_s = t.elapsed().as_secs_f64() - opened_s,
                "GPUs opened, the host cache's memory pinned"
            ),
            Err(e) => tracing::warn!(
                bytes,
                error = %e,
                "cannot pin the host cache's memory at start: its buffers are pinned as they are made"
            ),
        }
        self.update_cache_gauges();
    }
}

/// Where `tenant`'s chunk store lives under the default tenant's `root` (`<state>/chunks`): the
/// default tenant's is `root` itself, so a node from before tenants keeps its chunks; another
/// tenant's is `<root>-tenants/<tenant>` (tenant names are `[a-z0-9][a-z0-9_.-]*`: one path
/// component).
pub fn store_root_of(root: &Path, tenant: &str) -> PathBuf {
    if tenant == crate::tenant::DEFAULT_TENANT {
        return root.to_path_buf();
    }
    tenants_dir(root).join(crate::tenant::path_component(tenant))
}

/// `<root>-tenants`: the other tenants' stores.
fn tenants_dir(root: &Path) -> PathBuf {
    let mut dir = root.as_os_str().to_owned();
    dir.push("-tenants");
    PathBuf::from(dir)
}

/// Every tenant's store root that exists under the default `root`, the default's first.
pub fn store_roots(root: &Path) -> Vec<PathBuf> {
    let mut roots = vec![root.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(tenants_dir(root)) {
        let mut more: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        more.sort();
        roots.extend(more);
    }
    roots
}

/// Releases the chunk-store record of the snapshot in `dir` (`<state>/snapshots/<id>`), if it
/// has one, and collects the chunks nothing references any more. Chunks other snapshots hold
/// stay. Best effort: logged, never fails the removal of the snapshot.
pub fn release_snapshot_of_dir(dir: &Path) {
    let (Some(id), Some(parent)) = (dir.file_name().and_then(|n| n.to_str()), dir.parent()) else {
        return;
    };
    if parent.file_name().and_then(|n| n.to_str()) != Some("snapshots") {
        return;
    }
    let Some(state) = parent.parent() else {
        return;
    };
    // Whichever tenant's store holds it (a snapshot id is in one store at most).
    for store in store_roots(&state.join(STORE_DIR))
        .into_iter()
        .filter_map(|root| ChunkStore::open_existing(&root).ok())
    {
        release_from(&store, id);
    }
}

/// [`release_snapshot_of_dir`] in one store: nothing when the store does not hold `id`.
fn release_from(store: &ChunkStore, id: &str) {
    match store.release(id) {
        Ok(()) => {}
        Err(StoreError::UnknownSnapshot { .. } | StoreError::InvalidSnapshotId { .. }) => return,
        Err(e) => {
            tracing::warn!(snapshot = id, error = %e, "cannot release the snapshot's segments in the chunk store");
            return;
        }
    }
    match store.try_gc() {
        Ok(Some(r)) => {
            tracing::info!(
                snapshot = id,
                deleted_chunks = r.deleted_chunks,
                freed_bytes = r.freed_bytes,
                "released a split snapshot's chunks"
            );
        }
        // A writer is between its chunks and its commit: the next release collects.
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "chunk store GC failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tenant_has_a_store_of_its_own_and_a_bad_name_never_becomes_a_path() {
        let root = Path::new("/state/chunks");
        assert_eq!(store_root_of(root, "default"), root);
        assert_eq!(
            store_root_of(root, "team-a"),
            Path::new("/state/chunks-tenants/team-a")
        );
        for bad in ["../../etc", "a/b", "", "Team"] {
            let p = store_root_of(root, bad);
            assert_eq!(
                p.parent(),
                Some(Path::new("/state/chunks-tenants")),
                "{bad:?}"
            );
            let name = p.file_name().unwrap().to_str().unwrap();
            assert!(name.starts_with("not-a-tenant-"), "{bad:?}: {name}");
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("chunks");
        for t in ["default", "team-b", "team-a"] {
            std::fs::create_dir_all(store_root_of(&root, t)).unwrap();
        }
        assert_eq!(
            store_roots(&root),
            vec![
                root.clone(),
                store_root_of(&root, "team-a"),
                store_root_of(&root, "team-b")
            ]
        );
    }

    fn split(hook: Option<&str>, wanted: bool, wanted_gpu: bool) -> Split {
        let metrics = crate::metrics::Metrics::new().unwrap();
        let key = Arc::new(crate::staging::test_key());
        let state = tempfile::tempdir().unwrap();
        let mut s = Split::new(
            state.path(),
            wanted,
            wanted_gpu,
            &RestoreServer::default(),
            &metrics,
            key,
        );
        // What Split::new found in this environment is replaced by the case under test.
        s.hook_lib = hook.map(PathBuf::from);
        s.enabled = wanted && hook.is_some();
        s.gpu_enabled = s.enabled && wanted_gpu;
        s
    }

    fn uses(
        hook: Option<&str>,
        wanted: bool,
        wanted_gpu: bool,
        gpu: bool,
    ) -> (bool, bool, HookPreload) {
        let (lib, using) = split(hook, wanted, wanted_gpu).worker_hook(gpu);
        (lib.is_some(), using.buffers, using.preload)
    }

    #[test]
    fn every_gpu_worker_preloads_the_hook_and_only_split_workers_get_its_variable() {
        let lib = Some("/x/libtorpor_hook.so");
        use HookPreload::*;
        // (found, split, split_gpu, gpu worker) -> (library given, TORPOR_HOOK_LIB, preload)
        assert_eq!(uses(lib, true, true, true), (true, true, Segments));
        assert_eq!(uses(lib, true, false, true), (true, true, Watch));
        assert_eq!(uses(lib, false, true, true), (true, false, Watch));
        assert_eq!(uses(lib, false, false, true), (true, false, Watch));
        assert_eq!(uses(lib, true, true, false), (true, true, No));
        assert_eq!(uses(lib, false, false, false), (false, false, No));
        // No hook found: nothing to give, whatever the config wants.
        assert!(!uses(None, true, true, true).0);
        assert!(!uses(None, false, false, true).0);
    }

    #[test]
    fn the_base_key_says_how_the_workers_got_the_hook() {
        let lib = Some("/x/libtorpor_hook.so");
        let suffix =
            |hook, wanted, wanted_gpu, gpu| split(hook, wanted, wanted_gpu).base_key_suffix(gpu);
        assert_eq!(suffix(lib, true, true, true), "|hook+cuda");
        assert_eq!(suffix(lib, true, false, true), "|hook+watch");
        assert_eq!(suffix(lib, false, false, true), "|watch");
        assert_eq!(suffix(lib, true, true, false), "|hook");
        assert_eq!(suffix(lib, false, false, false), "");
        assert_eq!(suffix(None, true, true, true), "");
    }

    #[test]
    fn a_missing_hook_names_where_it_was_looked_for_and_the_fix() {
        let e = HookLibError::NotFound {
            looked: vec![
                PathBuf::from("/venv/bin/libtorpor_hook.so"),
                PathBuf::from("/venv/lib/python3.11/site-packages/torpor/libtorpor_hook.so"),
            ],
        }
        .to_string();
        assert!(!e.contains('\n'), "{e}");
        for part in [
            "/venv/bin/libtorpor_hook.so, /venv/lib/python3.11/site-packages/torpor/",
            "TORPOR_HOOK_LIB",
            "make wheel",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }
}
