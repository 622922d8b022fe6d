//! The restore server: while CRIU restores an instance of a split snapshot (on the blocking
//! pool), it produces each segment's memory, several at once, started in fill order
//! ([`super::index::fill_order`]; [`super::fill`] bounds them), and once the worker said
//! `hello {resumed}` hands each to it with a `map` frame carrying the fd, as soon as it is
//! filled.
//!
//! Where a segment's memory comes from, first that applies:
//! 1. **read-only**: the shared copy of its contents if one is resident (one physical copy
//!    mapped read-only into every instance; a sealed memfd on the host), else a new shared copy
//!    filled as below, then sealed and kept while an instance maps it;
//! 2. the **GPU cache** (device memory): a read-only segment's cache entry *is* its shared copy
//!    (entries are sealed read-only when they go in, so the instance maps the cache's memory:
//!    no copy, whatever the model's size); a writable one gets a device-to-device copy;
//! 3. the **host cache** (host memory; on a hit the segment is hot and is also put in the GPU
//!    cache);
//! 4. the **chunk store** (every chunk verified), and the bytes then go into the host cache.
//!
//! Every key (shared copies, both caches) is scoped by the function's tenant as well as the
//! contents ([`crate::tenant::scoped_key`]): two tenants with the same weights never share a
//! copy or a cache entry, so neither can observe the other's through timing or a mapping.
//!
//! Both caches are LRU and bounded by `[restore_server] host_cache_bytes` and
//! `gpu_cache_bytes`. On the host backend the "GPU" cache holds memfd memory, so every path runs
//! without a GPU.
//!
//! A live instance whose GPU was released gets its segments back the same way
//! ([`Split::begin_refill`], crate::split::release): writable ones from the contents the daemon
//! saved, read-only ones from the sources above.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};

use crate::protocol::{self, ToWorker};
use crate::split::device::{HostBuffer, Memory, SegmentDevice};
use crate::split::index::{Planned, SegmentEntry};
use crate::split::{fds, lock, DeviceOpenError, PlanError, Split, StoreOpenError};
use crate::workers::ConnError;
use torpor_device::DeviceError;
use torpor_image::store::StoreError;

/// How long a restored worker has to map all its segments.
pub const MAP_TIMEOUT: Duration = Duration::from_secs(60);

/// One physical copy of a read-only segment, mapped by every instance holding an `Arc` of it.
pub struct SharedCopy {
    /// Its own memory, or a GPU cache entry's (the same `Arc`: the cache may evict it while
    /// instances still map it; it goes with the last holder).
    memory: Arc<Memory>,
    bytes: u64,
    gauge: prometheus::IntGauge,
}

impl SharedCopy {
    /// Its memory (read to move it to another device, crate::split::migrate).
    pub(crate) fn memory(&self) -> &Arc<Memory> {
        &self.memory
    }
}

impl std::fmt::Debug for SharedCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCopy")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for SharedCopy {
    fn drop(&mut self) {
        self.gauge.sub(i64::try_from(self.bytes).unwrap_or(0));
    }
}

/// A handle the daemon keeps on memory it handed to an instance, while the instance maps it:
/// the driver does not promise that exported device memory outlives every handle in the
/// exporting process until the importer has mapped it, so the daemon never drops its handle
/// first. A clone is another handle on the same memory.
#[derive(Debug, Clone)]
pub enum Lease {
    /// A shared read-only copy; it goes when the last instance holding it goes.
    Shared(Arc<SharedCopy>),
    /// The instance's own writable memory.
    Own(OwnMemory),
}

/// Writable memory filled for one instance.
#[derive(Clone)]
pub struct OwnMemory {
    /// Read only to save its contents when the instance's GPU is released; dropping the last
    /// handle releases the daemon's memory.
    pub(crate) memory: Arc<Memory>,
}

impl std::fmt::Debug for OwnMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnMemory")
    }
}

/// What an instance holds from the restore server.
pub type Leases = Vec<Lease>;

/// A filled segment, ready for its `map` frame.
pub struct Filled {
    pub va: u64,
    pub size: u64,
    pub readonly: bool,
    pub fd: OwnedFd,
    pub lease: Lease,
}

/// `plan` with its GPU segments on GPU `ordinal` (the cache keys and the devices of the fills
/// follow the entries' ordinals); host segments as they are.
pub fn on_gpu(plan: &[Planned], ordinal: i32) -> Vec<Planned> {
    plan.iter()
        .map(|(e, recipe)| {
            let mut e = e.clone();
            if e.backend == "cuda" {
                e.ordinal = ordinal;
            }
            (e, recipe.clone())
        })
        .collect()
}

/// The GPU cache's key of a segment: its device and its contents.
pub fn gpu_key(e: &SegmentEntry) -> String {
    gpu_key_of(&e.backend, e.ordinal, &e.blake3)
}

/// The GPU cache's key of memory on `backend`/`ordinal` whose contents hash to `blake3` (hex).
pub fn gpu_key_of(backend: &str, ordinal: i32, blake3: &str) -> String {
    format!("{backend}{ordinal}:{blake3}")
}

pub(super) enum Event {
    /// The segments that will come, in this order (none: a transparent snapshot).
    Plan(Arc<Vec<Planned>>),
    Filled(Filled),
    Failed(SegmentsError),
}

/// Where the memory of one segment of a plan comes from.
pub enum Source {
    /// The restore server's sources, first that applies: shared copy, GPU cache, host cache,
    /// chunk store.
    Fill,
    /// Contents the daemon saved when the instance released its GPU (a writable segment).
    Saved(HostBuffer),
    /// Memory the daemon still holds for the instance: exported again, nothing copied.
    Held(Lease),
}

/// A restore's segments being filled.
pub struct Restoring {
    rx: mpsc::UnboundedReceiver<Event>,
}

impl Split {
    /// The resident shared read-only copy under `key` (a tenant-scoped [`gpu_key`]), if any.
    pub(crate) fn resident_copy(&self, key: &str) -> Option<Arc<SharedCopy>> {
        lock(&self.shared)
            .get(key)
            .and_then(std::sync::Weak::upgrade)
    }

    /// Makes `memory` (sealed) the shared copy under `key`, unless another one got there first:
    /// then that one.
    pub(crate) fn share(&self, key: String, memory: Arc<Memory>, bytes: u64) -> Arc<SharedCopy> {
        let copy = Arc::new(SharedCopy {
            memory,
            bytes,
            gauge: self.metrics.shared_bytes.clone(),
        });
        self.metrics
            .shared_bytes
            .add(i64::try_from(bytes).unwrap_or(0));
        let mut shared = lock(&self.shared);
        let winner = match shared.get(&key).and_then(std::sync::Weak::upgrade) {
            Some(s) => s,
            None => {
                shared.insert(key, Arc::downgrade(&copy));
                copy
            }
        };
        shared.retain(|_, w| w.strong_count() > 0);
        winner
    }

    /// A new fd for memory the daemon holds (`lease`), on device `dev`.
    pub(crate) fn export_lease(
        dev: &dyn SegmentDevice,
        lease: &Lease,
    ) -> Result<OwnedFd, DeviceError> {
        match lease {
            Lease::Own(o) => dev.export(&o.memory),
            Lease::Shared(s) => dev.export(&s.memory),
        }
    }

    /// Starts filling the segments of snapshot `id`, a function of `tenant`, on the blocking
    /// pool, in parallel with the caller's CRIU restore.
    pub fn begin_restore(self: &Arc<Self>, id: &str, tenant: &str) -> Restoring {
        self.begin_restore_onto(id, tenant, None)
    }

    /// [`Self::begin_restore`] onto GPU `onto` of this node instead of the snapshot's (a cold
    /// start placed there, crate::runtime::device_choice): its GPU segments are filled there,
    /// from that GPU's cache entries or the host cache and the store; host segments stay.
    pub fn begin_restore_onto(
        self: &Arc<Self>,
        id: &str,
        tenant: &str,
        onto: Option<i32>,
    ) -> Restoring {
        let (tx, rx) = mpsc::unbounded_channel();
        let split = Arc::clone(self);
        let id = id.to_string();
        let tenant = tenant.to_string();
        let asked = Instant::now();
        tokio::task::spawn_blocking(move || {
            tracing::debug!(snapshot = %id, started_s = asked.elapsed().as_secs_f64(), "segment fills started");
            let plan = match split.plan(&id, &tenant) {
                Ok(Some(p)) => p,
                Ok(None) => Arc::new(Vec::new()),
                Err(e) => {
                    let _ = tx.send(Event::Failed(SegmentsError::Plan(e)));
                    return;
                }
            };
            let plan = match onto {
                Some(d) => Arc::new(on_gpu(&plan, d)),
                None => plan,
            };
            let sources = plan.iter().map(|_| Source::Fill).collect();
            split.fill_all(&tx, &format!("snapshot {id}"), &tenant, plan, sources);
        });
        Restoring { rx }
    }

    /// Starts filling `plan` (one source per entry, same order) on the blocking pool: the
    /// segments of a live instance of a function of `tenant` whose GPU comes back. `of` names
    /// them in errors.
    pub fn begin_refill(
        self: &Arc<Self>,
        plan: Arc<Vec<Planned>>,
        sources: Vec<Source>,
        of: String,
        tenant: String,
    ) -> Restoring {
        let (tx, rx) = mpsc::unbounded_channel();
        let split = Arc::clone(self);
        tokio::task::spawn_blocking(move || split.fill_all(&tx, &of, &tenant, plan, sources));
        Restoring { rx }
    }

    /// New memory holding a writable segment's saved contents.
    pub(super) fn fill_saved(&self, e: &SegmentEntry, saved: &[u8]) -> Result<Filled, FillError> {
        let dev = self.device(&e.backend, e.ordinal)?;
        let t = Instant::now();
        let m = dev
            .fill_from_bytes(saved, false)
            .map_err(|source| FillError::Copy {
                what: "copying its saved contents",
                source,
            })?;
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        self.metrics
            .fill_gbps
            .with_label_values(&["saved"])
            .observe(e.size as f64 / secs / 1e9);
        self.export_held(
            e,
            Lease::Own(OwnMemory {
                memory: Arc::new(m),
            }),
        )
    }

    /// A `map` frame's worth of memory the daemon holds: a new fd for it.
    pub(super) fn export_held(&self, e: &SegmentEntry, lease: Lease) -> Result<Filled, FillError> {
        let dev = self.device(&e.backend, e.ordinal)?;
        let fd = match &lease {
            Lease::Own(o) => dev.export(&o.memory),
            Lease::Shared(s) => dev.export(&s.memory),
        }
        .map_err(FillError::Export)?;
        Ok(Filled {
            va: e.va,
            size: e.size,
            readonly: e.readonly,
            fd,
            lease,
        })
    }

    /// The memory of one segment of a function of `tenant`, from the first source that has it.
    pub(super) fn fill(&self, (e, recipe): &Planned, tenant: &str) -> Result<Filled, FillError> {
        let dev = self.device(&e.backend, e.ordinal)?;
        let t = Instant::now();
        let (memory, lease, source) = if e.readonly {
            let key = crate::tenant::scoped_key(tenant, &gpu_key(e));
            match self.resident_copy(&key) {
                Some(s) => (None, Some(s), "shared"),
                None => {
                    // The GPU cache's entry (sealed) serves as the shared copy itself.
                    let cached =
                        lock(&self.gpu_cache).get(&crate::tenant::scoped_key(tenant, &gpu_key(e)));
                    let (m, source) = match cached {
                        Some(m) => {
                            self.metrics
                                .cache_requests
                                .with_label_values(&["gpu", "hit"])
                                .inc();
                            (m, "gpu")
                        }
                        None => self.fresh(&*dev, e, recipe, true, tenant)?,
                    };
                    // Another restore may have made one meanwhile: `share` keeps the first.
                    (None, Some(self.share(key, m, e.size)), source)
                }
            }
        } else {
            let (m, source) = self.fresh(&*dev, e, recipe, false, tenant)?;
            (Some(m), None, source)
        };
        let lease = match (memory, lease) {
            (Some(m), _) => Lease::Own(OwnMemory { memory: m }),
            (None, Some(s)) => Lease::Shared(s),
            (None, None) => unreachable!("a segment has memory or a shared copy"),
        };
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        self.metrics
            .fill_gbps
            .with_label_values(&[source])
            .observe(e.size as f64 / secs / 1e9);
        tracing::debug!(
            va = e.va,
            bytes = e.size,
            source,
            s = secs,
            "segment filled"
        );
        self.export_held(e, lease)
    }

    /// New memory holding the segment: from the GPU cache, the host cache or the store; the
    /// caches' entries are `tenant`'s. A sealed copy (`seal`: a read-only segment's, shared by
    /// every instance) made from the host cache or a peer is also the GPU cache's entry itself,
    /// as a GPU cache entry is handed out as the shared copy: one copy of the bytes on the GPU,
    /// not two, and one transfer.
    fn fresh(
        &self,
        dev: &dyn SegmentDevice,
        e: &SegmentEntry,
        recipe: &torpor_image::store::Recipe,
        seal: bool,
        tenant: &str,
    ) -> Result<(Arc<Memory>, &'static str), FillError> {
        let count = |cache: &str, hit: bool| {
            self.metrics
                .cache_requests
                .with_label_values(&[cache, if hit { "hit" } else { "miss" }])
                .inc();
        };
        let gkey = crate::tenant::scoped_key(tenant, &gpu_key(e));
        let hkey = crate::tenant::scoped_key(tenant, &e.blake3);
        let size = e.size as usize;
        let cached = lock(&self.gpu_cache).get(&gkey);
        count("gpu", cached.is_some());
        if let Some(src) = cached {
            let m = dev
                .fill_from_memory(&src, size, seal)
                .map_err(|source| FillError::Copy {
                    what: "copying from the GPU cache",
                    source,
                })?;
            return Ok((Arc::new(m), "gpu"));
        }
        // Another GPU's cache entry, over the GPUs' peer path (NVLink on the H200s: a cold
        // start placed on another GPU than the deploy's, whose cache is still empty).
        if let Some(m) = self.copy_of_peer_cache_entry(dev, e, seal, tenant)? {
            count("peer", true);
            return Ok((m, "peer"));
        }
        let cached = lock(&self.host_cache).get(&hkey);
        count("host", cached.is_some());
        if let Some(src) = cached {
            let buf = lock(&src);
            let m = dev
                .fill_from_bytes(&buf, seal)
                .map(Arc::new)
                .map_err(|source| FillError::Copy {
                    what: "copying from the host cache",
                    source,
                })?;
            // A second use: hot, so it also goes to the GPU cache.
            self.cache_on_gpu(&gkey, e.size, &m, seal, || {
                dev.fill_from_bytes(&buf, true).map(Some)
            });
            return Ok((m, "host"));
        }
        let store = self.store_for(tenant)?;
        let t = Instant::now();
        let mut buf = dev.host_buffer(size).map_err(FillError::HostBuffer)?;
        let buffer_s = t.elapsed().as_secs_f64();
        store
            .read_into(recipe, &mut buf)
            .map_err(|e| FillError::Read(Box::new(e)))?;
        let read_s = t.elapsed().as_secs_f64() - buffer_s;
        let m = dev
            .fill_from_bytes(&buf, seal)
            .map_err(|source| FillError::Copy {
                what: "copying from the store",
                source,
            })?;
        // Where a fill from disk goes: the host buffer (pinned on cuda), the reads with every
        // check, the copy to the device.
        tracing::debug!(
            va = e.va,
            bytes = e.size,
            buffer_s,
            read_s,
            copy_s = t.elapsed().as_secs_f64() - buffer_s - read_s,
            "segment read from the store"
        );
        lock(&self.host_cache).insert(&hkey, Arc::new(Mutex::new(buf)), e.size);
        self.update_cache_gauges();
        Ok((Arc::new(m), "store"))
    }
}

impl Split {
    /// A copy of GPU segment `e` on `dev` made from another GPU's cache entry of the same
    /// contents, device to device; the copy also becomes `dev`'s cache entry (sealed), as a
    /// fill from the host cache does (a sealed one is that entry itself). `None`: no other GPU
    /// that reaches `dev` holds it.
    fn copy_of_peer_cache_entry(
        &self,
        dev: &dyn SegmentDevice,
        e: &SegmentEntry,
        seal: bool,
        tenant: &str,
    ) -> Result<Option<Arc<Memory>>, FillError> {
        if !self.peer_copy || e.backend != "cuda" {
            return Ok(None);
        }
        for other in self.open_gpus().into_iter().filter(|&o| o != e.ordinal) {
            let key = crate::tenant::scoped_key(tenant, &gpu_key_of("cuda", other, &e.blake3));
            let Some(src) = lock(&self.gpu_cache).get(&key) else {
                continue;
            };
            let from = self.device("cuda", other)?;
            let copy = |seal| {
                dev.fill_from_peer(&*from, &src, e.size as usize, seal)
                    .map_err(|source| FillError::Copy {
                        what: "copying from another GPU's cache",
                        source,
                    })
            };
            // No peer path between the two: another GPU may have one.
            let Some(m) = copy(seal)?.map(Arc::new) else {
                continue;
            };
            let gkey = crate::tenant::scoped_key(tenant, &gpu_key(e));
            self.cache_on_gpu(&gkey, e.size, &m, seal, || copy(true));
            return Ok(Some(m));
        }
        Ok(None)
    }

    /// Makes `m`, the copy a fill just made of a segment of `size` bytes, also its GPU cache
    /// entry `gkey` when the cache has room. A sealed copy (a read-only segment's) is the entry
    /// itself, since an entry is handed out as the shared copy anyway; a writable one's entry is
    /// a second, sealed copy that `sealed_copy` makes (`None`: it could not).
    fn cache_on_gpu<E: std::fmt::Display>(
        &self,
        gkey: &str,
        size: u64,
        m: &Arc<Memory>,
        seal: bool,
        sealed_copy: impl FnOnce() -> Result<Option<Memory>, E>,
    ) {
        if lock(&self.gpu_cache).capacity() < size {
            return;
        }
        let entry = if seal {
            Ok(Some(Arc::clone(m)))
        } else {
            sealed_copy().map(|c| c.map(Arc::new))
        };
        match entry {
            Ok(Some(entry)) => {
                lock(&self.gpu_cache).insert(gkey, entry, size);
                self.update_cache_gauges();
            }
            Ok(None) => {}
            Err(x) => tracing::debug!(error = %x, "cannot fill the GPU cache"),
        }
    }
}

impl Restoring {
    /// After the worker's `hello {resumed}`: waits for the restore server's plan (empty for a
    /// transparent snapshot); the segments are then handed over while the instance already takes
    /// requests ([`HandingOver::send_maps`]). An error names the cause; the caller then kills
    /// the instance.
    pub async fn planned(mut self) -> Result<HandingOver, SegmentsError> {
        let deadline = tokio::time::Instant::now() + MAP_TIMEOUT;
        let plan = match next(&mut self.rx, deadline).await? {
            Event::Plan(p) => p,
            Event::Failed(e) => return Err(e),
            Event::Filled(_) => return Err(SegmentsError::FilledBeforePlan),
        };
        Ok(HandingOver {
            rx: self.rx,
            plan,
            deadline,
        })
    }
}

async fn next(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    deadline: tokio::time::Instant,
) -> Result<Event, SegmentsError> {
    tokio::time::timeout_at(deadline, rx.recv())
        .await
        .map_err(|_| SegmentsError::FillTimeout { bound: MAP_TIMEOUT })?
        .ok_or(SegmentsError::FillTaskEnded)
}

/// Why one segment's memory could not be produced (the caller names the segment).
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// The device of the segment cannot be opened.
    #[error(transparent)]
    Device(#[from] DeviceOpenError),
    /// The chunk store cannot be opened.
    #[error(transparent)]
    Store(#[from] StoreOpenError),
    /// Copying into new device memory failed (`what` names the source; the driver's code is
    /// inside).
    #[error("{what}: {source}")]
    Copy {
        what: &'static str,
        #[source]
        source: DeviceError,
    },
    /// No host memory to read the segment from the store into.
    #[error("host memory for the copy: {0}")]
    HostBuffer(#[source] DeviceError),
    /// The segment's chunks cannot be read from the store (gone, or altered: every chunk is
    /// verified).
    #[error("reading it from the chunk store: {0}")]
    Read(#[source] Box<StoreError>),
    /// The filled memory cannot be exported as an fd for the worker.
    #[error("exporting its memory: {0}")]
    Export(#[source] DeviceError),
}

/// Why a restored (or resumed) instance did not get all its segments; the caller removes it.
#[derive(Debug, thiserror::Error)]
pub enum SegmentsError {
    /// The snapshot's segment plan cannot be had.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// One segment could not be filled.
    #[error("cannot restore the segment at {va:#x} of {of}: {source}")]
    Fill {
        va: u64,
        /// What the segments belong to (`snapshot <id>`, `instance <id>`).
        of: String,
        #[source]
        source: FillError,
    },
    /// The fills took longer than [`MAP_TIMEOUT`] in all.
    #[error("segments not filled within {} s", bound.as_secs())]
    FillTimeout { bound: Duration },
    /// The fill task went away without a word (it panicked).
    #[error("the restore server's fill task ended early")]
    FillTaskEnded,
    /// The fill task broke its own order (a bug).
    #[error("the restore server sent a segment before its plan")]
    FilledBeforePlan,
    /// The fill task broke its own order (a bug).
    #[error("the restore server sent two plans")]
    TwoPlans,
    /// A `map` frame could not be sent to the worker.
    #[error("sending map for {va:#x}: {source}")]
    SendMap {
        va: u64,
        #[source]
        source: ConnError,
    },
    /// The worker answered a `map` wrongly, or refused it.
    #[error(transparent)]
    Map(#[from] MapAnswerError),
    /// The worker did not answer every `map` in time.
    #[error("the worker did not map {left} segment(s) within {} s", bound.as_secs())]
    MapTimeout { left: usize, bound: Duration },
}

impl SegmentsError {
    /// Whether a fill found too little free GPU memory for a segment (the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY` making or filling its memory): the snapshot is not at fault.
    pub fn is_out_of_gpu_memory(&self) -> bool {
        matches!(
            self,
            SegmentsError::Fill {
                source: FillError::Copy {
                    source: DeviceError::Cuda(e),
                    ..
                },
                ..
            } if e.is_out_of_memory()
        )
    }
}

/// A `mapped` answer the daemon cannot take: the instance must go.
#[derive(Debug, thiserror::Error)]
pub enum MapAnswerError {
    /// An answer to no `map` frame.
    #[error("it broke the protocol (mapped {va} with no map frame outstanding)")]
    Unsolicited { va: Value },
    /// An answer for another segment than the next one sent.
    #[error("it broke the protocol (mapped {va} while the segment at {expected:#x} was next)")]
    OutOfOrder { va: Value, expected: u64 },
    /// The worker could not map it; `message` is its own reason.
    #[error("the worker could not map the segment at {va:#x}: {message}")]
    Refused { va: u64, message: String },
}

/// A restore's segments, planned, to be handed to the worker as they are filled.
pub struct HandingOver {
    rx: mpsc::UnboundedReceiver<Event>,
    plan: Arc<Vec<Planned>>,
    deadline: tokio::time::Instant,
}

impl HandingOver {
    /// How many segments will be handed over.
    pub fn count(&self) -> usize {
        self.plan.len()
    }

    /// Whether every segment is filled already (its fill queued), so that only the `map`
    /// frames' trips are left. Then a first request is better sent after them: one that
    /// starts meanwhile runs its forward while the segments are mapped, and the driver's map
    /// calls wait behind its kernels (an 8B cold start's `segments` phase took 0.10 s so,
    /// 0.05 s without: docs/split.md).
    pub fn all_filled(&self) -> bool {
        self.rx.len() >= self.plan.len()
    }

    /// The segments, in the order their `map` frames go out.
    pub fn plan(&self) -> Arc<Vec<Planned>> {
        Arc::clone(&self.plan)
    }

    /// Sends one `map` frame per segment as each fill completes, in fill (first-use) order,
    /// while the instance already takes requests. Each frame goes out with `writer` locked for
    /// the whole frame, so it never interleaves with an `invoke`. `sent` is told of each segment
    /// (its VA and the daemon's lease on it) before its frame goes
    /// out, so that the `mapped` answer always finds it. An error names the segment and cause.
    pub async fn send_maps(
        mut self,
        writer: &tokio::sync::Mutex<OwnedWriteHalf>,
        mut sent: impl FnMut(u64, Lease),
    ) -> Result<(), SegmentsError> {
        for _ in 0..self.plan.len() {
            let f = match next(&mut self.rx, self.deadline).await? {
                Event::Filled(f) => f,
                Event::Failed(e) => return Err(e),
                Event::Plan(_) => return Err(SegmentsError::TwoPlans),
            };
            let frame = ToWorker::Map(protocol::Map {
                va: f.va,
                size: f.size,
                readonly: f.readonly,
                fd: true,
            });
            let fd = f.fd;
            sent(f.va, f.lease);
            let mut wr = writer.lock().await;
            fds::send_with_fd(&mut wr, &frame, fd.as_fd())
                .await
                .map_err(|source| SegmentsError::SendMap { va: f.va, source })?;
        }
        Ok(())
    }
}

/// The `map` frames sent to a restored instance and the worker's `mapped` answers. The
/// instance takes requests meanwhile; its reader hands each `mapped` here.
#[derive(Debug)]
pub struct Mapping {
    hello: Instant,
    total: usize,
    /// Sent and not answered yet, in order (the worker maps them in the order they come).
    sent: VecDeque<u64>,
    mapped: usize,
    /// The worker's own time in the hook's map calls (its `map_s`), summed.
    worker_map_s: f64,
    done_at: Option<Instant>,
    done: Option<oneshot::Sender<()>>,
}

impl Mapping {
    /// `total` segments to map, counted from the worker's `hello` at `hello`; the receiver is
    /// told once every one is mapped.
    pub fn new(hello: Instant, total: usize) -> (Self, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let mapping = Self {
            hello,
            total,
            sent: VecDeque::with_capacity(total),
            mapped: 0,
            worker_map_s: 0.0,
            done_at: None,
            done: Some(tx),
        };
        (mapping, rx)
    }

    pub fn sent(&mut self, va: u64) {
        self.sent.push_back(va);
    }

    /// A `mapped` frame from the worker; the error (a refused map, or an answer to no `map`)
    /// names the segment and the cause, and the instance must go.
    pub fn answer(&mut self, msg: &Map<String, Value>) -> Result<(), MapAnswerError> {
        let va = msg.get("va").and_then(Value::as_u64);
        let raw_va = || msg.get("va").cloned().unwrap_or(Value::Null);
        let Some(expected) = self.sent.front().copied() else {
            return Err(MapAnswerError::Unsolicited { va: raw_va() });
        };
        if va != Some(expected) {
            return Err(MapAnswerError::OutOfOrder {
                va: raw_va(),
                expected,
            });
        }
        if msg.get("ok").and_then(Value::as_bool) != Some(true) {
            return Err(MapAnswerError::Refused {
                va: expected,
                message: msg
                    .get("error")
                    .and_then(|e| e.get("message"))
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given")
                    .to_string(),
            });
        }
        self.sent.pop_front();
        self.mapped += 1;
        // Workers of before sent no `map_s`: then the sum is short, never wrong in kind.
        if let Some(s) = msg.get("map_s").and_then(Value::as_f64) {
            self.worker_map_s += s.max(0.0);
        }
        if self.mapped == self.total {
            self.done_at = Some(Instant::now());
            if let Some(tx) = self.done.take() {
                let _ = tx.send(());
            }
        }
        Ok(())
    }

    /// Seconds from the worker's `hello` until every segment was mapped; None until then.
    pub fn segments_s(&self) -> Option<f64> {
        self.done_at
            .map(|t| t.duration_since(self.hello).as_secs_f64())
    }

    /// Seconds the worker spent in the hook's map calls for every segment (the driver's import,
    /// map and access; the rest of `segments_s` is fills, frames and the worker's loop); None
    /// until every segment is mapped.
    pub fn worker_map_s(&self) -> Option<f64> {
        self.done_at.map(|_| self.worker_map_s)
    }

    /// Segments not mapped yet.
    pub fn unmapped(&self) -> usize {
        self.total - self.mapped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_fill_out_of_gpu_memory_is_told_apart_from_a_damaged_segment() {
        let fill = |source| SegmentsError::Fill {
            va: 0x1000,
            of: "snapshot s".into(),
            source,
        };
        let cuda = |code| FillError::Copy {
            what: "copying from the store",
            source: DeviceError::Cuda(torpor_cuda::CudaError::Call {
                function: "cuMemCreate",
                pid: None,
                code,
                name: "CUDA_ERROR_X".into(),
            }),
        };
        assert!(fill(cuda(2)).is_out_of_gpu_memory());
        assert!(!fill(cuda(1)).is_out_of_gpu_memory());
        assert!(!SegmentsError::FillTaskEnded.is_out_of_gpu_memory());
    }

    fn frame(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn mapping_counts_answers_in_order_and_tells_when_done() {
        let (mut m, mut done) = Mapping::new(Instant::now(), 2);
        m.sent(0x1000);
        m.sent(0x3000);
        m.answer(&frame(json!({"type": "mapped", "va": 0x1000, "ok": true})))
            .unwrap();
        assert_eq!(
            (m.unmapped(), m.segments_s(), m.worker_map_s()),
            (1, None, None)
        );
        assert!(done.try_recv().is_err());
        m.answer(&frame(
            json!({"type": "mapped", "va": 0x3000, "ok": true, "map_s": 0.25}),
        ))
        .unwrap();
        assert_eq!(m.unmapped(), 0);
        assert!(m.segments_s().is_some());
        // The first answer carried no map_s (a worker of before): only the second counts.
        assert_eq!(m.worker_map_s(), Some(0.25));
        assert!(done.try_recv().is_ok());
    }

    #[test]
    fn mapping_refuses_a_failed_map_and_answers_out_of_order() {
        let (mut m, _done) = Mapping::new(Instant::now(), 2);
        let e = m
            .answer(&frame(json!({"type": "mapped", "va": 0x1000, "ok": true})))
            .unwrap_err();
        assert!(e.to_string().contains("no map frame outstanding"), "{e}");
        m.sent(0x1000);
        let e = m
            .answer(&frame(json!({"type": "mapped", "va": 0x2000, "ok": true})))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("while the segment at 0x1000 was next"),
            "{e}"
        );
        let refused = json!({"type": "mapped", "va": 0x1000, "ok": false,
            "error": {"type": "HookError", "message": "not a memfd"}});
        let e = m.answer(&frame(refused)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the worker could not map the segment at 0x1000: not a memfd"
        );
        assert_eq!(m.unmapped(), 2);
    }

    /// A split whose caches are empty, on the host backend; its state directory with it.
    fn host_split() -> (crate::split::Split, tempfile::TempDir) {
        let state = tempfile::tempdir().unwrap();
        let metrics = crate::metrics::Metrics::new().unwrap();
        let split = crate::split::Split::new(
            state.path(),
            true,
            false,
            &crate::config::RestoreServer::default(),
            &metrics,
            Arc::new(crate::staging::test_key()),
        );
        (split, state)
    }

    /// Segment `bytes` at `va` of the host device, in the host cache of tenant "default".
    fn in_host_cache(
        split: &crate::split::Split,
        va: u64,
        bytes: &[u8],
        readonly: bool,
    ) -> Planned {
        let dev = split.device("host", -1).unwrap();
        let mut buf = dev.host_buffer(bytes.len()).unwrap();
        buf.copy_from_slice(bytes);
        let blake3 = blake3::hash(bytes).to_hex().to_string();
        let hkey = crate::tenant::scoped_key("default", &blake3);
        lock(&split.host_cache).insert(&hkey, Arc::new(Mutex::new(buf)), bytes.len() as u64);
        let entry = SegmentEntry {
            va,
            size: bytes.len() as u64,
            backend: "host".into(),
            ordinal: -1,
            order: 0,
            first_use: None,
            deferrable: false,
            readonly,
            readonly_why: String::new(),
            recipe: String::new(),
            blake3: blake3.clone(),
        };
        let recipe = torpor_image::store::Recipe {
            name: format!("segment-{va:x}"),
            size: bytes.len() as u64,
            blake3,
            chunks: Vec::new(),
        };
        (entry, recipe)
    }

    #[test]
    fn a_read_only_segment_filled_from_the_host_cache_is_its_gpu_cache_entry_itself() {
        let (split, _state) = host_split();
        let dev = split.device("host", -1).unwrap();
        let page = dev.granularity();
        let cached = |e: &SegmentEntry| {
            lock(&split.gpu_cache)
                .get(&crate::tenant::scoped_key("default", &gpu_key(e)))
                .expect("a GPU cache entry")
        };
        // Sealed: one copy, both the instances' shared copy and the cache's entry.
        let (ro, recipe) = in_host_cache(&split, 0x10_0000, &vec![7u8; 4 * page], true);
        let (m, source) = split.fresh(&*dev, &ro, &recipe, true, "default").unwrap();
        assert_eq!(source, "host");
        assert!(Arc::ptr_eq(&m, &cached(&ro)), "a second copy was made");
        // Writable: the instance's own copy, and a sealed one for the cache.
        let (rw, recipe) = in_host_cache(&split, 0x20_0000, &vec![9u8; 4 * page], false);
        let (w, source) = split.fresh(&*dev, &rw, &recipe, false, "default").unwrap();
        assert_eq!(source, "host");
        assert!(
            !Arc::ptr_eq(&w, &cached(&rw)),
            "a writable copy is the cache's entry"
        );
    }
}
