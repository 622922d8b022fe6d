//! The communication store's path between processes (docs/sandboxes.md, "The communication
//! store"): a sandbox's `torpor.put(key, value, shared=True)` copies the value once into a
//! memfd, seals it (no write, no resize) and hands the fd to the daemon (`store_put` +
//! `store_fd`); a `torpor.get(key)` in any sandbox of the same tenant on the node that does not
//! hold the key itself asks the daemon (`store_get`) and maps the very pages read-only (the
//! fd comes back attached to `store_value`): no copy. Workers never share a /dev/shm; the fd
//! is the only way between them, and it passes through the daemon, which scopes keys by tenant.
//! A CUDA tensor takes the GPU path of crate::runtime::store_gpu instead: its value lives in
//! GPU memory the daemon owns ([`Held::Gpu`]), and moves to a sealed memfd in host memory
//! ([`Held::Host`], spilled) when the store's GPU budget or the GPU's memory runs short.
//!
//! A value is dropped when it is consumed (a get without keep), when its `ttl_s` passes (looked
//! at on every put and get, and on the daemon's keep-alive tick), or with the daemon. Each
//! tenant holds at most [`MAX_KEYS`] keys and [`MAX_BYTES`] bytes (host and GPU memory
//! together, GPU puts in progress included); the store's GPU values take at most `[store]
//! gpu_bytes` of each GPU (all tenants together), oldest spilled first ([`spill_victims`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use torpor_device::DeviceError;

use crate::split::device::{Memory, SegmentDevice};
use crate::sync::lock;

/// Keys a tenant may hold at once.
pub const MAX_KEYS: usize = 4096;
/// Bytes a tenant may hold at once (the memfds' sizes and the GPU values' padded sizes).
pub const MAX_BYTES: u64 = 8 << 30;
/// The longest key.
pub const MAX_KEY: usize = 256;
/// The longest time to live.
pub const MAX_TTL_S: f64 = 86_400.0;
/// How long a worker has to fill the GPU memory of its put (`store_written`) before the
/// daemon takes it back.
pub const GPU_PUT_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a value was not stored (or not delivered).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key is empty or too long.
    #[error("store key of {0} bytes: a key is 1 to {MAX_KEY} bytes; use a shorter key")]
    Key(usize),
    /// The time to live is out of range.
    #[error("ttl_s {0} is not in (0, {MAX_TTL_S}]: pass a time to live in seconds within it")]
    Ttl(f64),
    /// The memfd is not sealed against writes and resizing: its sender could change it under
    /// its readers.
    #[error(
        "the value's memfd is not sealed (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): the SDK \
         seals it; send it through torpor.put"
    )]
    NotSealed,
    /// The fd could not be examined.
    #[error("cannot examine the value's fd: {0}")]
    Fd(#[source] std::io::Error),
    /// The tenant holds too much.
    #[error(
        "the tenant's store holds {keys} keys and {bytes} bytes, and this value of {adding} \
         bytes would pass its bound ({MAX_KEYS} keys, {MAX_BYTES} bytes): get (consume) values \
         or give them a shorter ttl_s"
    )]
    Full {
        keys: usize,
        bytes: u64,
        adding: u64,
    },
    /// A GPU value of no bytes.
    #[error("an empty tensor (0 bytes) has nothing to share: put it without shared=True")]
    EmptyGpu,
    /// One GPU value is larger than the store may keep on a GPU.
    #[error(
        "a GPU value of {padded} bytes (padded to the GPU's granularity) is larger than the \
         store's GPU budget of {budget} bytes per GPU: raise [store] gpu_bytes in torpord.toml, \
         or put tensor.cpu()"
    )]
    GpuBudget { padded: u64, budget: u64 },
    /// The GPU has no memory for the value, and no value of the store is left on it to move out.
    #[error(
        "no GPU memory for a value of {padded} bytes on the node's GPU {ordinal} ({source}), \
         and the store has nothing left there to move to host memory: free GPU memory, or put \
         tensor.cpu()"
    )]
    GpuMemory {
        ordinal: i32,
        padded: u64,
        #[source]
        source: DeviceError,
    },
    /// A device step failed (the driver's code is inside).
    #[error("{what}: {source}")]
    Device {
        what: &'static str,
        #[source]
        source: DeviceError,
    },
    /// Moving a GPU value to host memory failed.
    #[error("moving a GPU value to host memory (a memfd): {0}")]
    Spill(#[source] std::io::Error),
    /// The tensor is on a GPU the daemon cannot open.
    #[error(
        "the tensor is on the worker's GPU {worker} (the node's GPU {ordinal}), which torpord \
         cannot use for the store ({reason}): put a tensor on the function's GPU (cuda:0), or \
         put tensor.cpu()"
    )]
    NoGpu {
        worker: i32,
        ordinal: i32,
        reason: String,
    },
    /// The worker could not fill the memory (its own line).
    #[error("the worker did not fill the value's GPU memory: {0}")]
    Worker(String),
    /// A GPU value asked for by a function without a GPU.
    #[error(
        "store key {0:?} holds a CUDA tensor, which only a function with gpus = 1 can get; get \
         it there (it stays stored), or put tensor.cpu() instead"
    )]
    NeedsGpu(String),
    /// The daemon's task for it ended early (it panicked).
    #[error("the store's GPU task ended early: {0}")]
    Task(String),
    /// `nodes="all"` on a daemon without an object tier.
    #[error(
        "put(..., nodes=\"all\") needs the bucket every node shares: configure [objstore] in \
         torpord.toml on each node (docs/objstore.md), or put without nodes"
    )]
    NoObjstore,
    /// A bucket step of a value for every node failed (the object store's own line inside).
    #[error("{what}: {line}")]
    Bucket { what: &'static str, line: String },
    /// A store object in the bucket is not one this tenant's key may read.
    #[error(
        "store object {object} in the bucket is refused ({reason}): it is not one torpord \
         wrote for this key; delete it"
    )]
    BadObject { object: String, reason: String },
    /// A put into a lease the worker does not hold (a harness fault: it gave it back or never
    /// had it).
    #[error(
        "block {0} is not this worker's lease (it puts into memory the daemon did not set aside \
         for it): put the value again without the lease"
    )]
    NoLease(u64),
    /// A leased put of more bytes than the lease holds.
    #[error("the value's {bytes} bytes do not fit the lease's {padded}: put it without the lease")]
    LeaseTooSmall { bytes: u64, padded: u64 },
    /// A `store_written` for no GPU put in progress.
    #[error(
        "no GPU put {0} of this worker is in progress (it was taken back after \
         {secs} s without store_written, or never began): put the value again",
        secs = GPU_PUT_TIMEOUT.as_secs()
    )]
    NotPending(String),
}

/// What the store holds for a value.
pub enum Held {
    /// A sealed memfd: bytes or an array, or a GPU value spilled to host memory (its `padded`
    /// bytes).
    Host(OwnedFd),
    /// GPU memory the daemon allocated, filled by the putter and sealed.
    Gpu(GpuHeld),
}

/// A GPU value's memory, on the node's GPU `ordinal`.
#[derive(Clone)]
pub struct GpuHeld {
    pub ordinal: i32,
    pub device: Arc<dyn SegmentDevice>,
    pub memory: Arc<Memory>,
    pub padded: u64,
    /// The memory exported once, when it was made: the putter and every getter on this GPU
    /// get a `dup` of it. On the H100 an export (`cuMemExportToShareableHandle`) took 0.75 ms
    /// of a 100 MiB hand-off, a `dup` microseconds (bench/results/sandbox-vmm-steps-h100.json).
    pub exported: Arc<OwnedFd>,
    /// Its identity for the workers that keep their mappings of it ([`Block`]).
    pub block: Arc<Block>,
}

/// A block of the store's GPU memory, named for the workers that keep their mapping of it
/// after a put or a get (protocol 4) so that the block's next use by their tenant maps nothing
/// (docs/sandboxes.md, "Kept mappings"). When the daemon lets go of it, its id goes on the
/// store's `gone` list, and the runtime tells those workers to unmap it: their mappings would
/// otherwise keep the memory after the daemon counted it free.
pub struct Block {
    pub id: u64,
    gone: Arc<Mutex<Vec<u64>>>,
}

impl Drop for Block {
    fn drop(&mut self) {
        lock(&self.gone).push(self.id);
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({})", self.id)
    }
}

impl GpuHeld {
    /// An fd of the value's memory for a worker to import (a `dup` of the one export).
    pub fn fd(&self) -> Result<OwnedFd, StoreError> {
        self.exported.try_clone().map_err(StoreError::Fd)
    }

    /// The spare a put of `tenant` into this memory calls for: memory like it on its GPU.
    pub fn spare_for(&self, tenant: &str) -> SpareFor {
        SpareFor {
            tenant: tenant.to_string(),
            ordinal: self.ordinal,
            padded: self.padded,
            device: Arc::clone(&self.device),
        }
    }
}

/// Memory to make for the next put like one just sealed ([`Store::make_spare`]'s arguments).
#[derive(Clone)]
pub struct SpareFor {
    /// Whose put it was: a block of the tenant's kept for that size makes a spare needless.
    pub tenant: String,
    pub ordinal: i32,
    pub padded: u64,
    pub device: Arc<dyn SegmentDevice>,
}

impl std::fmt::Debug for SpareFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpareFor")
            .field("tenant", &self.tenant)
            .field("ordinal", &self.ordinal)
            .field("padded", &self.padded)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for GpuHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuHeld")
            .field("block", &self.block.id)
            .field("ordinal", &self.ordinal)
            .field("padded", &self.padded)
            .finish_non_exhaustive()
    }
}

struct Entry {
    held: Held,
    meta: Value,
    /// Bytes of the value.
    bytes: u64,
    /// A GPU value (on a GPU or spilled): a get hands it out as GPU memory.
    gpu: bool,
    expires: Instant,
    /// Put order (the oldest is spilled first).
    seq: u64,
    /// The memfd's size, while `held` is one.
    host_bytes: u64,
    /// A value put for every node: its put id in the bucket (crate::runtime::store_nodes).
    bucket: Option<String>,
}

impl Entry {
    /// Bytes of memory it holds: the memfd's or the GPU memory's.
    fn held_bytes(&self) -> u64 {
        match &self.held {
            Held::Host(_) => self.host_bytes,
            Held::Gpu(g) => g.padded,
        }
    }
}

/// A value taken from the store.
#[derive(Debug)]
pub enum TakenHeld {
    Host(OwnedFd),
    Gpu(GpuHeld),
}

/// A value taken from the store: what holds it, what it is, its size.
#[derive(Debug)]
pub struct Taken {
    pub held: TakenHeld,
    pub meta: Value,
    pub bytes: u64,
    /// A GPU value (on a GPU, or spilled to the memfd of `held`).
    pub gpu: bool,
    /// Bytes of the memfd or of the GPU memory.
    pub held_bytes: u64,
    /// A value put for every node: its put id in the bucket (crate::runtime::store_nodes).
    pub bucket: Option<String>,
    /// When it would have expired, and its put order: a value whose delivery failed goes back
    /// as it was ([`Store::put_back`]).
    expires: Instant,
    seq: u64,
}

impl Taken {
    /// Another handle of the same value (of its memfd, or of its GPU memory): what goes back
    /// when a get that took it cannot finish.
    pub(crate) fn duplicate(&self) -> Result<Taken, StoreError> {
        let held = match &self.held {
            TakenHeld::Host(fd) => TakenHeld::Host(fd.try_clone().map_err(StoreError::Fd)?),
            TakenHeld::Gpu(g) => TakenHeld::Gpu(g.clone()),
        };
        Ok(Taken {
            held,
            meta: self.meta.clone(),
            bytes: self.bytes,
            gpu: self.gpu,
            held_bytes: self.held_bytes,
            bucket: self.bucket.clone(),
            expires: self.expires,
            seq: self.seq,
        })
    }

    /// A value downloaded from the bucket (crate::runtime::store_nodes), held by the sealed
    /// memfd `fd` of its `bytes`; `gpu` when it was put from a CUDA tensor. Never put back.
    pub(crate) fn downloaded(fd: OwnedFd, meta: Value, bytes: u64, gpu: bool) -> Taken {
        Taken {
            held: TakenHeld::Host(fd),
            meta,
            bytes,
            gpu,
            held_bytes: bytes,
            bucket: None,
            expires: Instant::now(),
            seq: 0,
        }
    }
}

/// A GPU put whose memory the worker is filling.
struct Pending {
    tenant: String,
    key: String,
    meta: Value,
    bytes: u64,
    ttl: Duration,
    gpu: GpuHeld,
    since: Instant,
    /// Put with `nodes="all"`: sealed, it goes to the bucket before it is stored here.
    for_nodes: bool,
}

/// A GPU put for every node, filled and sealed read-only, not stored yet: the daemon uploads
/// it (crate::runtime::store_nodes), then stores it with [`Store::insert_gpu`].
#[derive(Debug)]
pub struct SealedGpu {
    pub tenant: String,
    pub key: String,
    pub meta: Value,
    /// The value's bytes (its memory is `gpu.padded`).
    pub bytes: u64,
    pub ttl: Duration,
    pub gpu: GpuHeld,
}

/// How [`Store::seal_gpu`] ended a GPU put.
#[derive(Debug)]
pub enum SealedPut {
    /// Stored under its key; the next put like it wants this spare.
    Stored(SpareFor),
    /// Not filled: dropped, the key keeps its value.
    Dropped,
    /// Put for every node: sealed, for the caller to upload and then store.
    ForNodes(SealedGpu),
}

/// What the store takes on one GPU ([`Store::gpu_usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuUsage {
    pub ordinal: i32,
    /// Values and puts in progress.
    pub held: u64,
    /// Its spare ([`Store::make_spare`]).
    pub spare: u64,
}

/// GPU memory given to a worker to fill ([`Store::reserve_gpu`]).
#[derive(Debug)]
pub struct Reserved {
    pub fd: OwnedFd,
    pub padded: u64,
    /// The memory's block, and whether it may come back to the tenant's puts (then a worker
    /// may keep its mapping of it: [`Block`]).
    pub block: u64,
    pub recycled: bool,
    /// GPU values moved to host memory to make room.
    pub spilled: usize,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<(String, String), Entry>,
    /// GPU puts in progress, by the caller's ticket (instance and put id).
    pending: HashMap<String, Pending>,
    seq: u64,
    /// Every GPU a value was put on (their gauges stay, at 0 when empty).
    gpus: std::collections::BTreeSet<i32>,
    /// Per GPU, memory made and exported ahead for the next put of the last put's size there
    /// ([`Store::make_spare`]).
    spares: HashMap<i32, Spare>,
    /// How long a spare waits for a put of its size ([`SPARE_IDLE`]; shorter in tests).
    spare_idle: Duration,
    /// What the store let go of under its lock, dropped after it ([`InnerGuard`]).
    dead: Vec<Box<dyn Send>>,
    /// Gets handed out in place and not released yet: block → holder → gets. Holder
    /// [`NO_RELEASE`] is a worker that never releases (protocol 3): its blocks never recycle.
    holds: HashMap<u64, HashMap<u64, u32>>,
    /// Blocks whose value a get consumed while a holder still maps them: each goes to its
    /// tenant's `free` once its last holder released it.
    parked: HashMap<u64, (String, GpuHeld)>,
    /// Blocks no value and no holder uses, kept for their tenant's next put of their size.
    free: Vec<Free>,
    /// Per holder, the block set aside for its next put ([`Store::lease`]).
    leases: HashMap<u64, Lease>,
}

/// A block set aside for one worker's next put of its size (protocol 4): the worker copies
/// the value in before it asks, so that put is one request instead of two (a round trip of
/// ~0.25 ms of a 100 MB hand-off on the H100). Only the worker gives it back (a put of another
/// size) or its end does ([`Store::forget_holder`]): the daemon never takes it back while the
/// worker may be writing it. Counted in the store's GPU budget like a put in progress.
struct Lease {
    tenant: String,
    gpu: GpuHeld,
}

/// A block kept for its tenant's next put of its size ([`Store::release`]): that put neither
/// allocates nor exports, and the tenant's workers that mapped the block map nothing (they kept
/// their mappings). Never another tenant's: those workers could still read it. Counted in the
/// store's GPU budget like a spare, let go first when a put needs room, and dropped after
/// [`SPARE_IDLE`] unused.
struct Free {
    tenant: String,
    gpu: GpuHeld,
    since: Instant,
}

impl Free {
    /// Whether a put of `tenant` of `padded` bytes on GPU `ordinal` can take it.
    fn fits(&self, tenant: &str, ordinal: i32, padded: u64) -> bool {
        self.tenant == tenant && self.gpu.ordinal == ordinal && self.gpu.padded == padded
    }
}

/// The holder of gets by a worker that does not release its mappings (protocol < 4).
pub const NO_RELEASE: u64 = 0;

/// Blocks a tenant may keep per GPU for its next puts: a steady hand-off between two
/// functions cycles through two or three.
pub const MAX_FREE: usize = 4;

/// The store's lock: on release, what was let go under it (GPU memory, memfds) is dropped
/// after the lock, on the blocking pool within the runtime. Letting GPU memory go is a driver
/// release and, for the last fd of its export, a close of 0.56 ms at 100 MiB on the H100
/// (bench/results/sandbox-vmm-contention-h100.json): neither another store call nor the
/// runtime's thread (whose frame handlers take this lock) waits for it.
struct InnerGuard<'a>(Option<std::sync::MutexGuard<'a, Inner>>);

impl std::ops::Deref for InnerGuard<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for InnerGuard<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.0.as_mut().expect("held until dropped")
    }
}

impl Drop for InnerGuard<'_> {
    fn drop(&mut self) {
        let Some(mut inner) = self.0.take() else {
            return;
        };
        let dead = std::mem::take(&mut inner.dead);
        drop(inner);
        if dead.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || drop(dead))),
            Err(_) => drop(dead),
        }
    }
}

/// GPU memory made and exported before a put asks for it: a put of its size takes it and skips
/// the driver's allocation and export (0.8 ms of a 100 MiB put on the H100,
/// bench/results/sandbox-vmm-steps-h100.json). Counted in the store's GPU budget like a value,
/// the first to go when a put needs room, and dropped after [`SPARE_IDLE`] unused.
struct Spare {
    gpu: GpuHeld,
    made: Instant,
}

/// How long a spare waits for a put of its size before its memory goes back.
pub const SPARE_IDLE: Duration = Duration::from_secs(30);

/// The values of every tenant, by (tenant, key).
pub struct Store {
    inner: Mutex<Inner>,
    /// Bytes of each GPU the store's GPU values may take (`[store] gpu_bytes`).
    gpu_budget: u64,
    /// GPU values moved to host memory, ever.
    spills: std::sync::atomic::AtomicU64,
    /// Whether a put leaves a spare of its size and a consumed value's memory goes back to its
    /// tenant's puts (`[store] gpu_spare`).
    spares_on: bool,
    /// Blocks the daemon let go of, for the runtime to tell their mappers ([`Block`]).
    gone: Arc<Mutex<Vec<u64>>>,
    /// The last block id given.
    blocks: std::sync::atomic::AtomicU64,
    /// Tests: host memory recycles too (its memfd seal is for good, so only on cuda otherwise).
    #[cfg(test)]
    recycle_host: bool,
}

impl Default for Store {
    fn default() -> Self {
        Self::new(crate::config::DEFAULT_STORE_GPU_BYTES)
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store { .. }")
    }
}

/// The size of a memfd whose seals forbid writing and resizing; `NotSealed` otherwise.
pub(crate) fn sealed_size(fd: &OwnedFd) -> Result<u64, StoreError> {
    // SAFETY: fcntl(F_GET_SEALS) on an fd this function borrows for the call; it reads the
    // seals and changes nothing.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::EINVAL) {
            StoreError::NotSealed
        } else {
            StoreError::Fd(e)
        });
    }
    let needed = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals & needed != needed {
        return Err(StoreError::NotSealed);
    }
    let file = std::fs::File::from(fd.try_clone().map_err(StoreError::Fd)?);
    Ok(file.metadata().map_err(StoreError::Fd)?.len())
}

/// Which GPU values to move to host memory so that `need` more bytes fit a GPU's `budget`,
/// given the values on it as (put order, bytes) and `used` bytes of it taken (values and puts in
/// progress): indices into `held`, oldest first, as few as will do. `None` when `need` alone is
/// larger than the budget (nothing spilled would make room).
pub fn spill_victims(held: &[(u64, u64)], used: u64, need: u64, budget: u64) -> Option<Vec<usize>> {
    if need > budget {
        return None;
    }
    let mut order: Vec<usize> = (0..held.len()).collect();
    order.sort_by_key(|&i| held[i].0);
    let mut used = used;
    let mut out = Vec::new();
    for i in order {
        if used.saturating_add(need) <= budget {
            break;
        }
        used = used.saturating_sub(held[i].1);
        out.push(i);
    }
    Some(out)
}

/// A sealed memfd holding the first `padded` bytes of `gpu`'s memory (a spill).
fn spill_to_memfd(gpu: &GpuHeld) -> Result<OwnedFd, StoreError> {
    use std::io::Write;
    let len = usize::try_from(gpu.padded)
        .map_err(|_| StoreError::Spill(std::io::Error::other("too large")))?;
    let mut buf = gpu
        .device
        .host_buffer(len)
        .map_err(|source| StoreError::Device {
            what: "moving a GPU value to host memory: staging",
            source,
        })?;
    gpu.device
        .read_memory(&gpu.memory, &mut buf)
        .map_err(|source| StoreError::Device {
            what: "moving a GPU value to host memory: copying it out",
            source,
        })?;
    let fd = new_memfd().map_err(StoreError::Spill)?;
    let mut f = std::fs::File::from(fd.try_clone().map_err(StoreError::Spill)?);
    f.write_all(&buf).map_err(StoreError::Spill)?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: adds seals to the memfd this function made and owns; no mapping of it exists.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(StoreError::Spill(std::io::Error::last_os_error()));
    }
    Ok(fd)
}

/// A new empty memfd that can be sealed.
pub(crate) fn new_memfd() -> std::io::Result<OwnedFd> {
    let name = c"torpor-store-spill";
    // SAFETY: memfd_create with a valid NUL-terminated name; the fd returned is owned here.
    let raw =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh fd nothing else owns.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) })
}

pub(crate) fn check_key_ttl(key: &str, ttl_s: f64) -> Result<(), StoreError> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(StoreError::Key(key.len()));
    }
    if !(ttl_s > 0.0 && ttl_s <= MAX_TTL_S) {
        return Err(StoreError::Ttl(ttl_s));
    }
    Ok(())
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        let idle = self.spare_idle;
        let dead = &mut self.dead;
        dead.extend(
            self.entries
                .extract_if(|_, e| e.expires <= now)
                .map(|(_, e)| Box::new(e) as Box<dyn Send>),
        );
        dead.extend(
            self.pending
                .extract_if(|_, p| now.duration_since(p.since) >= GPU_PUT_TIMEOUT)
                .map(|(_, p)| Box::new(p) as Box<dyn Send>),
        );
        dead.extend(
            self.spares
                .extract_if(|_, s| now.duration_since(s.made) >= idle)
                .map(|(_, s)| Box::new(s) as Box<dyn Send>),
        );
        dead.extend(
            self.free
                .extract_if(.., |f| now.duration_since(f.since) >= idle)
                .map(|f| Box::new(f.gpu) as Box<dyn Send>),
        );
    }

    /// A block of `tenant`'s kept for a put of `padded` bytes on GPU `ordinal`.
    fn take_free(&mut self, tenant: &str, ordinal: i32, padded: u64) -> Option<GpuHeld> {
        let i = self
            .free
            .iter()
            .position(|f| f.fits(tenant, ordinal, padded))?;
        Some(self.free.remove(i).gpu)
    }

    /// Bytes of GPU `ordinal` kept in blocks for the tenants' next puts.
    fn free_bytes(&self, ordinal: i32) -> u64 {
        self.free
            .iter()
            .filter(|f| f.gpu.ordinal == ordinal)
            .map(|f| f.gpu.padded)
            .sum()
    }

    /// Lets go of kept blocks on GPU `ordinal`, oldest first, until `room` more bytes fit in
    /// `budget` (or none is left).
    fn free_for_room(&mut self, ordinal: i32, room: u64, budget: u64) {
        while self.gpu_used(ordinal).saturating_add(room) > budget {
            let Some(i) = self.free.iter().position(|f| f.gpu.ordinal == ordinal) else {
                return;
            };
            let f = self.free.remove(i);
            self.bury(f.gpu);
        }
    }

    /// `gpu`, which no value and no holder uses any more: kept for `tenant`'s next put of its
    /// size when `recycles` and the tenant keeps fewer than [`MAX_FREE`] there, let go
    /// otherwise.
    fn recycle(&mut self, tenant: String, gpu: GpuHeld, recycles: bool) {
        let kept = self
            .free
            .iter()
            .filter(|f| f.tenant == tenant && f.gpu.ordinal == gpu.ordinal)
            .count();
        if recycles && kept < MAX_FREE {
            self.free.push(Free {
                tenant,
                gpu,
                since: Instant::now(),
            });
        } else {
            self.bury(gpu);
        }
    }

    /// Whether a holder that never releases got `block` in place.
    fn never_released(&self, block: u64) -> bool {
        self.holds
            .get(&block)
            .is_some_and(|h| h.contains_key(&NO_RELEASE))
    }

    /// Lets `thing` go once the lock is released ([`InnerGuard`]).
    fn bury(&mut self, thing: impl Send + 'static) {
        self.dead.push(Box::new(thing));
    }

    /// Stores `entry` under `id`; what the key held goes after the lock.
    fn insert_entry(&mut self, id: (String, String), entry: Entry) {
        if let Some(old) = self.entries.insert(id, entry) {
            self.bury(old);
        }
    }

    /// GPU `ordinal`'s spare when it is `padded` bytes; a spare of another size goes (the
    /// sizes changed, and its room may be needed now).
    fn take_spare(&mut self, ordinal: i32, padded: u64) -> Option<GpuHeld> {
        let spare = self.spares.remove(&ordinal)?;
        if spare.gpu.padded == padded {
            return Some(spare.gpu);
        }
        self.bury(spare);
        None
    }

    /// The tenant's keys and bytes, `key` left out (a put replaces it), puts in progress in.
    fn tenant_usage(&self, tenant: &str, key: &str) -> (usize, u64) {
        let held = self
            .entries
            .iter()
            .filter(|((t, k), _)| t == tenant && k != key)
            .fold((0usize, 0u64), |(n, b), (_, e)| (n + 1, b + e.held_bytes()));
        self.pending
            .values()
            .filter(|p| p.tenant == tenant)
            .fold(held, |(n, b), p| (n + 1, b + p.gpu.padded))
    }

    fn check_tenant(&self, tenant: &str, key: &str, adding: u64) -> Result<(), StoreError> {
        let (keys, bytes) = self.tenant_usage(tenant, key);
        if keys + 1 > MAX_KEYS || bytes.saturating_add(adding) > MAX_BYTES {
            return Err(StoreError::Full {
                keys,
                bytes,
                adding,
            });
        }
        Ok(())
    }

    /// Bytes of GPU `ordinal` the store takes: values, puts in progress and its spare.
    fn gpu_used(&self, ordinal: i32) -> u64 {
        let values: u64 = self
            .entries
            .values()
            .filter_map(|e| match &e.held {
                Held::Gpu(g) if g.ordinal == ordinal => Some(g.padded),
                _ => None,
            })
            .sum();
        values
            + self
                .pending
                .values()
                .filter(|p| p.gpu.ordinal == ordinal)
                .map(|p| p.gpu.padded)
                .sum::<u64>()
            + self
                .leases
                .values()
                .filter(|l| l.gpu.ordinal == ordinal)
                .map(|l| l.gpu.padded)
                .sum::<u64>()
            + self.spare_bytes(ordinal)
    }

    /// Bytes of GPU `ordinal` made ahead or kept for the next puts: its spare and kept blocks.
    fn spare_bytes(&self, ordinal: i32) -> u64 {
        self.spares.get(&ordinal).map_or(0, |s| s.gpu.padded) + self.free_bytes(ordinal)
    }

    /// The values on GPU `ordinal`, oldest first: (their id, put order, bytes).
    fn on_gpu(&self, ordinal: i32) -> Vec<((String, String), u64, u64)> {
        let mut v: Vec<_> = self
            .entries
            .iter()
            .filter_map(|(id, e)| match &e.held {
                Held::Gpu(g) if g.ordinal == ordinal => Some((id.clone(), e.seq, g.padded)),
                _ => None,
            })
            .collect();
        v.sort_by_key(|(_, seq, _)| *seq);
        v
    }

    /// Moves the value `id` (on a GPU) to a sealed memfd in host memory.
    /// `sealed` under its key, replacing what the key held.
    fn insert_gpu(&mut self, sealed: SealedGpu, now: Instant, bucket: Option<String>) {
        self.seq += 1;
        let seq = self.seq;
        self.insert_entry(
            (sealed.tenant, sealed.key),
            Entry {
                held: Held::Gpu(sealed.gpu),
                meta: sealed.meta,
                bytes: sealed.bytes,
                gpu: true,
                expires: now + sealed.ttl,
                seq,
                host_bytes: 0,
                bucket,
            },
        );
    }

    fn spill(&mut self, id: &(String, String)) -> Result<(), StoreError> {
        let Some(e) = self.entries.get_mut(id) else {
            return Ok(());
        };
        let Held::Gpu(g) = &e.held else {
            return Ok(());
        };
        let fd = spill_to_memfd(g)?;
        tracing::info!(tenant = %id.0, key = %id.1, bytes = g.padded, ordinal = g.ordinal,
            "store: a GPU value moved to host memory (GPU budget or memory short)");
        e.host_bytes = g.padded;
        let gpu = std::mem::replace(&mut e.held, Held::Host(fd));
        self.bury(gpu);
        Ok(())
    }
}

impl Store {
    /// The store's lock ([`InnerGuard`]).
    fn inner(&self) -> InnerGuard<'_> {
        InnerGuard(Some(lock(&self.inner)))
    }

    /// A store whose GPU values take at most `gpu_budget` bytes of each GPU.
    pub fn new(gpu_budget: u64) -> Self {
        Self {
            inner: Mutex::new(Inner {
                spare_idle: SPARE_IDLE,
                ..Inner::default()
            }),
            gpu_budget,
            spills: std::sync::atomic::AtomicU64::new(0),
            spares_on: true,
            gone: Arc::default(),
            blocks: std::sync::atomic::AtomicU64::new(0),
            #[cfg(test)]
            recycle_host: false,
        }
    }

    /// `memory` of `device`, exported as `fd`, as the store holds it: under a new block id.
    fn held(
        &self,
        ordinal: i32,
        device: Arc<dyn SegmentDevice>,
        memory: Memory,
        padded: u64,
        fd: OwnedFd,
    ) -> GpuHeld {
        let id = self
            .blocks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        GpuHeld {
            ordinal,
            device,
            memory: Arc::new(memory),
            padded,
            exported: Arc::new(fd),
            block: Arc::new(Block {
                id,
                gone: Arc::clone(&self.gone),
            }),
        }
    }

    /// Whether `gpu` may go back to its tenant's puts once nothing uses it: on cuda, whose seal
    /// is the daemon's own refusal of writable mappings (torpor_device's `seal_read_only`), not
    /// a property of the memory; a host memfd's seal is for good.
    pub fn recycles(&self, gpu: &GpuHeld) -> bool {
        #[cfg(test)]
        if self.recycle_host {
            return self.spares_on;
        }
        self.spares_on && gpu.device.backend() == "cuda"
    }

    /// `gpu`, which nothing uses any more, kept for `tenant`'s next puts where it recycles
    /// ([`Inner::recycle`]), let go otherwise.
    fn recycle(&self, inner: &mut Inner, tenant: String, gpu: GpuHeld) {
        let recycles = self.recycles(&gpu);
        inner.recycle(tenant, gpu, recycles);
    }

    /// The blocks let go of since the last call ([`Block`]); their holds are forgotten.
    pub fn take_gone(&self) -> Vec<u64> {
        let gone = std::mem::take(&mut *lock(&self.gone));
        if !gone.is_empty() {
            let mut inner = self.inner();
            for id in &gone {
                inner.holds.remove(id);
            }
        }
        gone
    }

    /// The same store, leaving spares after puts or not (`[store] gpu_spare`).
    pub fn with_spares(mut self, on: bool) -> Self {
        self.spares_on = on;
        self
    }

    /// Stores `fd` (a sealed memfd) under `key` of `tenant`, replacing what the key held.
    /// `bucket`: the value is also in the bucket under that put id (a put for every node,
    /// crate::runtime::store_nodes): a get here then asks the bucket whether it is still there.
    pub fn put(
        &self,
        tenant: &str,
        key: &str,
        fd: OwnedFd,
        meta: Value,
        ttl_s: f64,
        bucket: Option<String>,
    ) -> Result<(), StoreError> {
        check_key_ttl(key, ttl_s)?;
        let bytes = sealed_size(&fd)?;
        let now = Instant::now();
        let mut inner = self.inner();
        inner.sweep(now);
        inner.check_tenant(tenant, key, bytes)?;
        inner.seq += 1;
        let seq = inner.seq;
        inner.insert_entry(
            (tenant.to_string(), key.to_string()),
            Entry {
                held: Held::Host(fd),
                meta,
                bytes,
                gpu: false,
                expires: now + Duration::from_secs_f64(ttl_s),
                seq,
                host_bytes: bytes,
                bucket,
            },
        );
        Ok(())
    }

    /// Begins a GPU put (`ticket`: the worker's and its put id): allocates `bytes` (padded to
    /// the granularity) of `device`, the node's GPU `ordinal`, moving the oldest GPU values there
    /// to host memory while the store's GPU budget or the GPU's memory is short, and returns an
    /// fd of it for the worker to fill. Nothing under `key` changes until [`Store::seal_gpu`].
    #[allow(clippy::too_many_arguments)]
    pub fn reserve_gpu(
        &self,
        ticket: &str,
        tenant: &str,
        key: &str,
        meta: Value,
        ttl_s: f64,
        bytes: u64,
        ordinal: i32,
        device: Arc<dyn SegmentDevice>,
        for_nodes: bool,
    ) -> Result<Reserved, StoreError> {
        let r = self.reserve_gpu_with(
            ticket, tenant, key, meta, ttl_s, bytes, ordinal, device, for_nodes, false,
        )?;
        Ok(r.expect("a reservation that may block always ends"))
    }

    /// [`Store::reserve_gpu`]; with `spare_only`, only when that takes no driver call and
    /// copies nothing, so the caller may run it on the runtime's thread: GPU `ordinal` has a
    /// spare of the size and no value has to move for it (`Ok(None)`, nothing changed,
    /// otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn reserve_gpu_with(
        &self,
        ticket: &str,
        tenant: &str,
        key: &str,
        meta: Value,
        ttl_s: f64,
        bytes: u64,
        ordinal: i32,
        device: Arc<dyn SegmentDevice>,
        for_nodes: bool,
        spare_only: bool,
    ) -> Result<Option<Reserved>, StoreError> {
        check_key_ttl(key, ttl_s)?;
        if bytes == 0 {
            return Err(StoreError::EmptyGpu);
        }
        let granule = device.granularity().max(1) as u64;
        let padded = bytes.div_ceil(granule) * granule;
        let mut inner = self.inner();
        inner.sweep(Instant::now());
        inner.check_tenant(tenant, key, padded)?;
        inner.gpus.insert(ordinal);
        // A block of the tenant's kept for this size, else the GPU's spare of it.
        let fits = inner.free.iter().any(|f| f.fits(tenant, ordinal, padded))
            || inner
                .spares
                .get(&ordinal)
                .is_some_and(|s| s.gpu.padded == padded);
        let on_gpu = inner.on_gpu(ordinal);
        let sizes: Vec<(u64, u64)> = on_gpu.iter().map(|(_, s, b)| (*s, *b)).collect();
        // The spare and the kept blocks go first (taken, or let go for room), so they are not
        // counted here.
        let used = inner.gpu_used(ordinal) - inner.spare_bytes(ordinal);
        let victims =
            spill_victims(&sizes, used, padded, self.gpu_budget).ok_or(StoreError::GpuBudget {
                padded,
                budget: self.gpu_budget,
            })?;
        if spare_only && !(fits && victims.is_empty()) {
            return Ok(None);
        }
        let ready = match inner.take_free(tenant, ordinal, padded) {
            Some(gpu) => Some(gpu),
            None => inner.take_spare(ordinal, padded),
        };
        let mut spilled = 0;
        for &i in &victims {
            inner.spill(&on_gpu[i].0)?;
            spilled += 1;
        }
        let gpu = match ready {
            Some(gpu) => gpu,
            None => {
                inner.free_for_room(ordinal, padded, self.gpu_budget);
                // Out of GPU memory: free what was let go, else let go of a kept block, else
                // move out the next oldest value, and try again, until none is left.
                let mut left = on_gpu
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !victims.contains(i))
                    .map(|(_, v)| v.0.clone());
                let len = usize::try_from(padded).unwrap_or(usize::MAX);
                let memory = loop {
                    match device.create(len) {
                        Ok(m) => break m,
                        Err(e) if is_out_of_memory(&e) => {
                            // What was let go for room (spilled values, kept blocks, the
                            // spare) is dropped after the lock, as always; this try needs
                            // its memory back now, so it is dropped here, under the lock.
                            if !inner.dead.is_empty() {
                                drop(std::mem::take(&mut inner.dead));
                                continue;
                            }
                            if let Some(i) =
                                inner.free.iter().position(|f| f.gpu.ordinal == ordinal)
                            {
                                drop(inner.free.remove(i));
                                continue;
                            }
                            match left.next() {
                                Some(id) => {
                                    inner.spill(&id)?;
                                    spilled += 1;
                                }
                                None => {
                                    return Err(StoreError::GpuMemory {
                                        ordinal,
                                        padded,
                                        source: e,
                                    })
                                }
                            }
                        }
                        Err(source) => {
                            return Err(StoreError::Device {
                                what: "allocating GPU memory for the value",
                                source,
                            })
                        }
                    }
                };
                let fd = device
                    .export(&memory)
                    .map_err(|source| StoreError::Device {
                        what: "exporting the value's GPU memory",
                        source,
                    })?;
                self.held(ordinal, device, memory, padded, fd)
            }
        };
        let fd = gpu.fd()?;
        let (gpu_block, gpu_recycles) = (gpu.block.id, self.recycles(&gpu));
        self.spills
            .fetch_add(spilled as u64, std::sync::atomic::Ordering::Relaxed);
        inner.pending.insert(
            ticket.to_string(),
            Pending {
                tenant: tenant.to_string(),
                key: key.to_string(),
                meta,
                bytes,
                ttl: Duration::from_secs_f64(ttl_s),
                gpu,
                since: Instant::now(),
                for_nodes,
            },
        );
        Ok(Some(Reserved {
            fd,
            padded,
            block: gpu_block,
            recycled: gpu_recycles,
            spilled,
        }))
    }

    /// Whether GPU `ordinal` has a spare now.
    pub fn has_spare(&self, ordinal: i32) -> bool {
        self.inner().spares.contains_key(&ordinal)
    }

    /// After a put of `padded` bytes on GPU `ordinal` (`device`): memory of that size made and
    /// exported for the next one, unless the GPU has a spare already or the store's budget
    /// there has no room for it (or `[store] gpu_spare` is off). Made outside the store's lock;
    /// a spare that lost a race (a put took the room meanwhile) is let go.
    pub fn make_spare(&self, spare: SpareFor) {
        let SpareFor {
            tenant,
            ordinal,
            padded,
            device,
        } = spare;
        if !self.spares_on {
            return;
        }
        // Not when the tenant keeps a block of that size there: its next put takes that.
        let room = |inner: &Inner| {
            !inner.spares.contains_key(&ordinal)
                && !inner.free.iter().any(|f| f.fits(&tenant, ordinal, padded))
                && inner.gpu_used(ordinal).saturating_add(padded) <= self.gpu_budget
        };
        if !room(&self.inner()) {
            return;
        }
        let Ok(len) = usize::try_from(padded) else {
            return;
        };
        let made = device.create(len).and_then(|m| {
            let fd = device.export(&m)?;
            Ok((m, fd))
        });
        let (memory, fd) = match made {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(ordinal, padded, error = %e, "store: no spare GPU memory made");
                return;
            }
        };
        let gpu = self.held(ordinal, device, memory, padded, fd);
        let mut inner = self.inner();
        if room(&inner) {
            let made = Instant::now();
            inner.gpus.insert(ordinal);
            inner.spares.insert(ordinal, Spare { gpu, made });
        } else {
            // Let go outside the lock: a driver release.
            drop(inner);
            drop(gpu);
        }
    }

    /// Ends the GPU put `ticket`: when `filled`, its memory is sealed read-only and stored under
    /// its key (replacing what the key held), or, for a put for every node, handed back sealed
    /// for the upload; otherwise it is dropped and the key keeps its value.
    pub fn seal_gpu(&self, ticket: &str, filled: bool) -> Result<SealedPut, StoreError> {
        let mut inner = self.inner();
        let now = Instant::now();
        inner.sweep(now);
        let p = inner
            .pending
            .remove(ticket)
            .ok_or_else(|| StoreError::NotPending(ticket.to_string()))?;
        if !filled {
            inner.bury(p);
            return Ok(SealedPut::Dropped);
        }
        p.gpu
            .device
            .seal(&p.gpu.memory)
            .map_err(|source| StoreError::Device {
                what: "sealing the value's GPU memory read-only (is the worker's mapping gone?)",
                source,
            })?;
        let sealed = SealedGpu {
            tenant: p.tenant,
            key: p.key,
            meta: p.meta,
            bytes: p.bytes,
            ttl: p.ttl,
            gpu: p.gpu,
        };
        if p.for_nodes {
            return Ok(SealedPut::ForNodes(sealed));
        }
        let spare = sealed.gpu.spare_for(&sealed.tenant);
        inner.insert_gpu(sealed, now, None);
        Ok(SealedPut::Stored(spare))
    }

    /// Stores a GPU put for every node once the bucket has it (`bucket`: its put id there),
    /// replacing what the key held; refused, as a put is, past the tenant's bounds.
    pub fn insert_gpu(&self, sealed: SealedGpu, bucket: String) -> Result<(), StoreError> {
        let mut inner = self.inner();
        let now = Instant::now();
        inner.sweep(now);
        inner.check_tenant(&sealed.tenant, &sealed.key, sealed.gpu.padded)?;
        inner.insert_gpu(sealed, now, Some(bucket));
        Ok(())
    }

    /// The value under `key` of `tenant`, taken out unless `keep` (then a second handle of it).
    /// A GPU value for a getter without a GPU (`!gpu_ok`) is refused and stays.
    pub fn get(
        &self,
        tenant: &str,
        key: &str,
        keep: bool,
        gpu_ok: bool,
    ) -> Result<Option<Taken>, StoreError> {
        let mut inner = self.inner();
        inner.sweep(Instant::now());
        let id = (tenant.to_string(), key.to_string());
        if !gpu_ok && inner.entries.get(&id).is_some_and(|e| e.gpu) {
            return Err(StoreError::NeedsGpu(key.to_string()));
        }
        if keep {
            let Some(e) = inner.entries.get(&id) else {
                return Ok(None);
            };
            let held = match &e.held {
                Held::Host(fd) => TakenHeld::Host(fd.try_clone().map_err(StoreError::Fd)?),
                Held::Gpu(g) => TakenHeld::Gpu(g.clone()),
            };
            return Ok(Some(Taken {
                held,
                meta: e.meta.clone(),
                bytes: e.bytes,
                gpu: e.gpu,
                held_bytes: e.held_bytes(),
                bucket: e.bucket.clone(),
                expires: e.expires,
                seq: e.seq,
            }));
        }
        Ok(inner.entries.remove(&id).map(|e| {
            let held_bytes = e.held_bytes();
            Taken {
                held: match e.held {
                    Held::Host(fd) => TakenHeld::Host(fd),
                    Held::Gpu(g) => TakenHeld::Gpu(g),
                },
                meta: e.meta,
                bytes: e.bytes,
                gpu: e.gpu,
                held_bytes,
                bucket: e.bucket,
                expires: e.expires,
                seq: e.seq,
            }
        }))
    }

    /// Records that `holder` was handed `block` in place (its worker maps the very memory)
    /// and will release it ([`Store::release`]); [`NO_RELEASE`] for a worker that never does.
    pub fn hold(&self, block: u64, holder: u64) {
        *self
            .inner()
            .holds
            .entry(block)
            .or_default()
            .entry(holder)
            .or_default() += 1;
    }

    /// A value of `tenant` that a get consumed, after its answer: while a holder still maps
    /// its block, parked until the last releases it; then kept for the tenant's next put of its
    /// size ([`Store::recycles`]), or let go.
    pub fn consumed(&self, tenant: &str, taken: Taken) {
        let mut inner = self.inner();
        let TakenHeld::Gpu(gpu) = taken.held else {
            inner.bury(taken);
            return;
        };
        let block = gpu.block.id;
        if inner.never_released(block) {
            inner.bury(gpu);
        } else if inner.holds.get(&block).is_some_and(|h| !h.is_empty()) {
            inner.parked.insert(block, (tenant.to_string(), gpu));
        } else {
            self.recycle(&mut inner, tenant.to_string(), gpu);
        }
    }

    /// `holder`'s worker let go of one get of each of `blocks` (its tensors are gone and their
    /// work done; it keeps the mappings): a parked block nobody holds any more goes to its
    /// tenant's next puts. A block the holder was not handed is ignored (a worker cannot
    /// release another's).
    pub fn release(&self, holder: u64, blocks: &[u64]) {
        if holder == NO_RELEASE {
            return;
        }
        let mut inner = self.inner();
        for &block in blocks {
            let Some(h) = inner.holds.get_mut(&block) else {
                continue;
            };
            if let Some(n) = h.get_mut(&holder) {
                *n -= 1;
                if *n == 0 {
                    h.remove(&holder);
                }
            }
            if h.is_empty() {
                inner.holds.remove(&block);
                if let Some((tenant, gpu)) = inner.parked.remove(&block) {
                    self.recycle(&mut inner, tenant, gpu);
                }
            }
        }
    }

    /// After `holder`'s put of `padded` bytes on GPU `ordinal`: a block of the tenant's kept
    /// blocks, else the GPU's spare, of that size, set aside for its next put, with an fd of it
    /// (None when it holds a lease already, has none to take, or the memory does not recycle).
    pub fn lease(
        &self,
        holder: u64,
        tenant: &str,
        ordinal: i32,
        padded: u64,
    ) -> Option<(u64, OwnedFd)> {
        if holder == NO_RELEASE {
            return None;
        }
        let mut inner = self.inner();
        if inner.leases.contains_key(&holder) {
            return None;
        }
        let gpu = match inner.take_free(tenant, ordinal, padded) {
            Some(gpu) => gpu,
            None => {
                let fits = inner
                    .spares
                    .get(&ordinal)
                    .is_some_and(|s| s.gpu.padded == padded && self.recycles(&s.gpu));
                if !fits {
                    return None;
                }
                inner.take_spare(ordinal, padded)?
            }
        };
        let fd = gpu.fd().ok()?;
        let block = gpu.block.id;
        inner.leases.insert(
            holder,
            Lease {
                tenant: tenant.to_string(),
                gpu,
            },
        );
        Some((block, fd))
    }

    /// `holder`'s put into its lease `block`, which it filled with `bytes` (protocol 4): sealed
    /// and stored under `key` of `tenant`, replacing what the key held. The next put like it
    /// wants the spare returned. Refused, the lease gone back, when `block` is not the
    /// holder's lease on GPU `ordinal` or the tenant's bounds are passed.
    #[allow(clippy::too_many_arguments)]
    pub fn put_leased(
        &self,
        holder: u64,
        tenant: &str,
        key: &str,
        meta: Value,
        ttl_s: f64,
        bytes: u64,
        block: u64,
        ordinal: i32,
    ) -> Result<SpareFor, StoreError> {
        check_key_ttl(key, ttl_s)?;
        let mut inner = self.inner();
        let now = Instant::now();
        inner.sweep(now);
        let lease = match inner.leases.remove(&holder) {
            Some(l)
                if l.gpu.block.id == block && l.tenant == tenant && l.gpu.ordinal == ordinal =>
            {
                l
            }
            other => {
                // Not this one: the holder's lease, if any, stays its own (another of its
                // threads may be filling it).
                if let Some(l) = other {
                    inner.leases.insert(holder, l);
                }
                return Err(StoreError::NoLease(block));
            }
        };
        let padded = lease.gpu.padded;
        let refused = if bytes == 0 || bytes > padded {
            Some(StoreError::LeaseTooSmall { bytes, padded })
        } else {
            inner.check_tenant(tenant, key, padded).err()
        };
        if let Some(e) = refused {
            self.recycle(&mut inner, lease.tenant, lease.gpu);
            return Err(e);
        }
        lease
            .gpu
            .device
            .seal(&lease.gpu.memory)
            .map_err(|source| StoreError::Device {
                what: "sealing the value's GPU memory read-only",
                source,
            })?;
        let spare = lease.gpu.spare_for(tenant);
        let sealed = SealedGpu {
            tenant: tenant.to_string(),
            key: key.to_string(),
            meta,
            bytes,
            ttl: Duration::from_secs_f64(ttl_s),
            gpu: lease.gpu,
        };
        inner.insert_gpu(sealed, now, None);
        Ok(spare)
    }

    /// `holder` gave its lease `block` back unused (`store_release`'s `leases`): kept for the
    /// tenant's next puts, or let go. Only on the worker's word: a lease the daemon took back
    /// by itself could be one a thread of the worker is filling.
    pub fn return_lease(&self, holder: u64, block: u64) {
        let mut inner = self.inner();
        if inner
            .leases
            .get(&holder)
            .is_some_and(|l| l.gpu.block.id == block)
        {
            let l = inner
                .leases
                .remove(&holder)
                .expect("present: checked above");
            self.recycle(&mut inner, l.tenant, l.gpu);
        }
    }

    /// `holder`'s worker is gone (exited, or hibernated: a snapshot does not carry its
    /// mappings of the store's memory): its gets are released.
    pub fn forget_holder(&self, holder: u64) {
        let blocks: Vec<u64> = {
            let inner = self.inner();
            inner
                .holds
                .iter()
                .filter_map(|(b, h)| h.get(&holder).map(|n| vec![*b; *n as usize]))
                .flatten()
                .collect()
        };
        self.release(holder, &blocks);
        let mut inner = self.inner();
        if let Some(l) = inner.leases.remove(&holder) {
            self.recycle(&mut inner, l.tenant, l.gpu);
        }
    }

    /// Puts a value taken by a get back under `key`, as it was (its expiry, its place in the
    /// spill order), when its delivery failed: a get that cannot hand a value over must not
    /// consume it. A value put under the key meanwhile is newer and stays; `taken` is then
    /// dropped, as a put would have replaced it. Returns whether it went back.
    pub fn put_back(&self, tenant: &str, key: &str, taken: Taken) -> bool {
        let mut inner = self.inner();
        let id = (tenant.to_string(), key.to_string());
        if inner.entries.contains_key(&id) || taken.expires <= Instant::now() {
            inner.bury(taken);
            return false;
        }
        let host_bytes = match &taken.held {
            TakenHeld::Host(_) => taken.held_bytes,
            TakenHeld::Gpu(_) => 0,
        };
        let held = match taken.held {
            TakenHeld::Host(fd) => Held::Host(fd),
            TakenHeld::Gpu(g) => Held::Gpu(g),
        };
        inner.insert_entry(
            id,
            Entry {
                held,
                meta: taken.meta,
                bytes: taken.bytes,
                gpu: taken.gpu,
                expires: taken.expires,
                seq: taken.seq,
                host_bytes,
                bucket: taken.bucket,
            },
        );
        true
    }

    /// Drops the value under `key` if it is still the one `taken` (a kept copy of) came from: a
    /// value for every node that another node consumed.
    pub fn forget(&self, tenant: &str, key: &str, taken: &Taken) {
        let mut inner = self.inner();
        let id = (tenant.to_string(), key.to_string());
        if inner.entries.get(&id).is_some_and(|e| e.seq == taken.seq) {
            if let Some(e) = inner.entries.remove(&id) {
                inner.bury(e);
            }
        }
    }

    /// Drops expired values and GPU puts left unfinished (the keep-alive tick).
    pub fn sweep(&self) {
        self.inner().sweep(Instant::now());
    }

    /// Keys held and their bytes, all tenants.
    pub fn usage(&self) -> (usize, u64) {
        let mut inner = self.inner();
        inner.sweep(Instant::now());
        (
            inner.entries.len(),
            inner.entries.values().map(Entry::held_bytes).sum(),
        )
    }

    /// Bytes the store takes on each GPU a value was ever put on (values and puts in progress;
    /// its spare apart), and in host memory for GPU values moved there.
    pub fn gpu_usage(&self) -> (Vec<GpuUsage>, u64) {
        let inner = self.inner();
        let per = inner
            .gpus
            .iter()
            .map(|&ordinal| {
                let spare = inner.spare_bytes(ordinal);
                GpuUsage {
                    ordinal,
                    held: inner.gpu_used(ordinal) - spare,
                    spare,
                }
            })
            .collect();
        let spilled = inner
            .entries
            .values()
            .filter(|e| e.gpu && matches!(e.held, Held::Host(_)))
            .map(Entry::held_bytes)
            .sum();
        (per, spilled)
    }

    /// GPU values moved to host memory since the daemon started.
    pub fn spills(&self) -> u64 {
        self.spills.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Whether the driver (or the host backend) ran out of memory.
fn is_out_of_memory(e: &DeviceError) -> bool {
    match e {
        DeviceError::Cuda(c) => c.is_out_of_memory(),
        DeviceError::Os { source, .. } => {
            matches!(
                source.raw_os_error(),
                Some(libc::ENOMEM) | Some(libc::ENOSPC)
            )
        }
        _ => false,
    }
}

impl crate::runtime::Runtime {
    /// Whether function `name`'s spec gives it a GPU (`gpus` ≥ 1).
    pub(crate) fn pool_gpus(&self, name: &str) -> bool {
        let Some(pool) = lock(&self.pools).get(name).cloned() else {
            return false;
        };
        let st = lock(&pool.state);
        st.info
            .spec
            .get("gpus")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            > 0
    }

    /// The tenant whose store a worker of `inst` uses: its pool's spec's.
    pub(crate) fn store_tenant(&self, inst: &crate::runtime::Instance) -> Option<String> {
        self.pool_tenant(&inst.function)
    }

    /// A worker's `store_put` with its memfd: stored, and answered `store_stored`.
    pub(crate) fn store_put(
        self: &std::sync::Arc<Self>,
        inst: &std::sync::Arc<crate::runtime::Instance>,
        put: crate::protocol::StorePut,
        fd: OwnedFd,
    ) {
        if put.nodes.is_some() {
            // For every node: through the bucket (crate::runtime::store_nodes).
            self.store_put_nodes(inst, put, fd);
            return;
        }
        let stored = match self.store_tenant(inst) {
            Some(tenant) => self
                .store
                .put(&tenant, &put.key, fd, put.meta, put.ttl_s, None),
            None => Err(StoreError::Fd(std::io::Error::other(
                "the instance has no pool any more",
            ))),
        };
        self.store_metrics();
        reply_stored(inst, put.id, &put.key, stored);
    }

    /// A worker's `store_get`: answered `store_value`, with the memfd (or, for a GPU value,
    /// GPU memory on the worker's GPU: crate::runtime::store_gpu) when found.
    pub(crate) fn store_get(
        self: &std::sync::Arc<Self>,
        inst: &std::sync::Arc<crate::runtime::Instance>,
        get: crate::protocol::StoreGet,
    ) {
        let found = match self.store_tenant(inst) {
            Some(tenant) => {
                let gpu_ok = self.pool_gpus(&inst.function);
                self.store.get(&tenant, &get.key, get.keep, gpu_ok)
            }
            None => Ok(None),
        };
        // With [objstore], a miss and a value put for every node are the bucket's to decide
        // (crate::runtime::store_nodes).
        let found = match (found, self.objstore.clone(), self.store_tenant(inst)) {
            (Ok(None), Some(tier), Some(tenant)) => {
                return self.store_get_nodes(inst, get, tier, tenant, None);
            }
            (Ok(Some(t)), Some(tier), Some(tenant)) if t.bucket.is_some() => {
                return self.store_get_nodes(inst, get, tier, tenant, Some(t));
            }
            (found, _, _) => found,
        };
        let id = get.id;
        match found {
            Ok(Some(t)) if t.gpu => {
                if let Some(Ok(mut d)) = Self::store_deliver_in_place(inst, &t) {
                    // On the worker's GPU already: a dup of its export, answered from here,
                    // held for the worker until it releases it. A consumed value's memory then
                    // waits for its tenant's next put, or goes after the answer (a driver
                    // release, on the blocking pool: crate::runtime::store's InnerGuard).
                    self.store_lend(inst, &t, &mut d);
                    let (value, fd) = value_frame(id, Ok(Some(d)));
                    reply_to(inst, crate::protocol::ToWorker::StoreValue(value), fd);
                    match self.store_tenant(inst) {
                        Some(tenant) if !get.keep => self.store.consumed(&tenant, t),
                        _ => drop(tokio::task::spawn_blocking(move || drop(t))),
                    }
                    self.store_metrics();
                    return;
                }
                // Exported, or copied onto the worker's GPU first: on the blocking pool. A
                // delivery that fails (a copy, an export) puts a consumed value back: the get
                // fails, the value stays for the next one.
                let rt = std::sync::Arc::clone(self);
                let inst = std::sync::Arc::clone(inst);
                let back = (!get.keep).then(|| (self.store_tenant(&inst), get.key.clone()));
                tokio::spawn(async move {
                    let (rt2, inst2) = (std::sync::Arc::clone(&rt), std::sync::Arc::clone(&inst));
                    let (delivered, taken) = tokio::task::spawn_blocking(move || {
                        let delivered = rt2.store_deliver(&inst2, &t);
                        if let (Err(e), Some((Some(tenant), key))) = (&delivered, back) {
                            let kept = rt2.store.put_back(&tenant, &key, t);
                            tracing::warn!(
                                key = %key,
                                kept,
                                "a store value could not be handed to the worker: {e}"
                            );
                            return (delivered, None);
                        }
                        (delivered, Some(t))
                    })
                    .await
                    .unwrap_or_else(|e| (Err(StoreError::Task(e.to_string())), None));
                    rt.store_metrics();
                    let (value, fd) = value_frame(id, delivered.map(Some));
                    reply_to(&inst, crate::protocol::ToWorker::StoreValue(value), fd);
                    // The daemon's handle of a consumed value goes after the answer: a driver
                    // release, off the get's path.
                    if let Some(t) = taken {
                        let _ = tokio::task::spawn_blocking(move || drop(t)).await;
                    }
                });
            }
            found => {
                let found = found.map(|o| {
                    o.and_then(|t| match t.held {
                        TakenHeld::Host(fd) => Some(Delivered {
                            meta: t.meta,
                            bytes: t.bytes,
                            fd,
                            gpu: None,
                        }),
                        TakenHeld::Gpu(_) => None,
                    })
                });
                self.store_metrics();
                let (value, fd) = value_frame(id, found);
                reply_to(inst, crate::protocol::ToWorker::StoreValue(value), fd);
            }
        }
    }
}

/// A value on its way to a worker: the fd to attach and what the `store_value` frame says.
#[derive(Debug)]
pub struct Delivered {
    pub meta: Value,
    pub bytes: u64,
    pub fd: OwnedFd,
    pub gpu: Option<crate::protocol::StoreValueGpu>,
}

/// The `store_value` frame of get `id` and the fd to attach.
pub(crate) fn value_frame(
    id: u64,
    found: Result<Option<Delivered>, StoreError>,
) -> (crate::protocol::StoreValue, Option<OwnedFd>) {
    let none = crate::protocol::StoreValue {
        id,
        found: false,
        meta: None,
        bytes: None,
        fd: None,
        gpu: None,
        error: None,
    };
    match found {
        Ok(Some(d)) => (
            crate::protocol::StoreValue {
                found: true,
                meta: Some(d.meta),
                bytes: Some(d.bytes),
                fd: Some(true),
                gpu: d.gpu,
                ..none
            },
            Some(d.fd),
        ),
        Ok(None) => (none, None),
        Err(e) => (
            crate::protocol::StoreValue {
                error: Some(e.to_string()),
                ..none
            },
            None,
        ),
    }
}

/// Answers put `id` of `key` with `store_stored`; a refusal is logged.
pub(crate) fn reply_stored(
    inst: &std::sync::Arc<crate::runtime::Instance>,
    id: u64,
    key: &str,
    stored: Result<(), StoreError>,
) {
    reply_stored_leasing(inst, id, key, stored, None);
}

/// [`reply_stored`], with a lease for the worker's next put and its fd.
pub(crate) fn reply_stored_leasing(
    inst: &std::sync::Arc<crate::runtime::Instance>,
    id: u64,
    key: &str,
    stored: Result<(), StoreError>,
    lease: Option<(crate::protocol::StoreLease, OwnedFd)>,
) {
    if let Err(e) = &stored {
        tracing::info!(instance = %inst.id, key, error = %e, "store: value refused");
    }
    let (lease, fd) = match lease {
        Some((l, fd)) => (Some(l), Some(fd)),
        None => (None, None),
    };
    let reply = crate::protocol::ToWorker::StoreStored(crate::protocol::StoreStored {
        id,
        ok: stored.is_ok(),
        error: stored.err().map(|e| e.to_string()),
        lease,
    });
    reply_to(inst, reply, fd);
}

/// Sends `frame` (with `fd` attached) to `inst`'s worker, in a task of its own: the reader that
/// calls this must not wait for the writer, which a request's send may hold.
pub(crate) fn reply_to(
    inst: &std::sync::Arc<crate::runtime::Instance>,
    frame: crate::protocol::ToWorker,
    fd: Option<OwnedFd>,
) {
    let inst = std::sync::Arc::clone(inst);
    tokio::spawn(async move {
        let mut wr = inst.writer.lock().await;
        let sent = match &fd {
            Some(fd) => {
                use std::os::fd::AsFd;
                crate::split::fds::send_with_fd(&mut wr, &frame, fd.as_fd()).await
            }
            None => crate::workers::send(&mut wr, &frame).await,
        };
        if let Err(e) = sent {
            tracing::debug!(instance = %inst.id, error = %e, "store: the answer was not sent");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn memfd(data: &[u8], seal: bool) -> OwnedFd {
        let name = std::ffi::CString::new("torpor-store-test").unwrap();
        // SAFETY: memfd_create with a valid NUL-terminated name; the fd returned is owned here.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(raw >= 0);
        // SAFETY: raw is a fresh fd this test owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let mut f = std::fs::File::from(fd.try_clone().unwrap());
        f.write_all(data).unwrap();
        if seal {
            let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            // SAFETY: adds seals to the fd this test owns.
            let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(r, 0);
        }
        fd
    }

    #[test]
    fn a_value_whose_delivery_failed_goes_back_unless_a_newer_one_took_its_key() {
        let s = Store::default();
        let meta = serde_json::json!({"kind": "bytes"});
        s.put("a", "k", memfd(b"first", true), meta.clone(), 60.0, None)
            .unwrap();
        let taken = s.get("a", "k", false, true).unwrap().unwrap();
        assert!(s.get("a", "k", true, true).unwrap().is_none(), "taken out");
        assert!(s.put_back("a", "k", taken));
        let again = s.get("a", "k", false, true).unwrap().unwrap();
        assert_eq!(again.bytes, 5, "the same value, back under its key");
        // A value put while the delivery was failing is newer: it stays, the old one goes.
        s.put("a", "k", memfd(b"second!", true), meta, 60.0, None)
            .unwrap();
        assert!(!s.put_back("a", "k", again));
        assert_eq!(s.get("a", "k", false, true).unwrap().unwrap().bytes, 7);
        assert_eq!(s.usage(), (0, 0));
    }

    #[test]
    fn a_value_for_every_node_keeps_its_put_id_and_is_forgotten_only_while_it_is_the_keys() {
        let s = Store::default();
        let meta = serde_json::json!({"kind": "bytes"});
        let id = Some("ab".repeat(16));
        s.put(
            "a",
            "k",
            memfd(b"one", true),
            meta.clone(),
            60.0,
            id.clone(),
        )
        .unwrap();
        let kept = s.get("a", "k", true, true).unwrap().unwrap();
        assert_eq!(kept.bucket, id);
        // A newer put of the key: forgetting the old copy leaves it.
        s.put("a", "k", memfd(b"two", true), meta, 60.0, None)
            .unwrap();
        s.forget("a", "k", &kept);
        let newer = s.get("a", "k", true, true).unwrap().unwrap();
        assert_eq!((newer.bytes, newer.bucket.clone()), (3, None));
        s.forget("a", "k", &newer);
        assert!(s.get("a", "k", true, true).unwrap().is_none());
    }

    #[test]
    fn a_value_is_taken_once_and_is_its_tenants_only() {
        let s = Store::default();
        s.put(
            "a",
            "k",
            memfd(b"hello", true),
            serde_json::json!({"kind": "bytes"}),
            60.0,
            None,
        )
        .unwrap();
        assert!(s.get("b", "k", false, true).unwrap().is_none());
        let kept = s.get("a", "k", true, true).unwrap().unwrap();
        assert_eq!(kept.bytes, 5);
        let taken = s.get("a", "k", false, true).unwrap().unwrap();
        assert_eq!(taken.meta["kind"], "bytes");
        assert!(s.get("a", "k", false, true).unwrap().is_none());
        assert_eq!(s.usage(), (0, 0));
    }

    #[test]
    fn an_unsealed_fd_a_bad_key_or_ttl_are_refused_and_a_value_expires() {
        let s = Store::default();
        let e = s
            .put("a", "k", memfd(b"x", false), Value::Null, 60.0, None)
            .unwrap_err();
        assert!(matches!(e, StoreError::NotSealed), "{e}");
        let e = s
            .put("a", "", memfd(b"x", true), Value::Null, 60.0, None)
            .unwrap_err();
        assert!(matches!(e, StoreError::Key(0)));
        let e = s
            .put("a", "k", memfd(b"x", true), Value::Null, 0.0, None)
            .unwrap_err();
        assert!(matches!(e, StoreError::Ttl(_)));
        s.put("a", "k", memfd(b"x", true), Value::Null, 0.05, None)
            .unwrap();
        std::thread::sleep(Duration::from_millis(80));
        assert!(s.get("a", "k", false, true).unwrap().is_none());
    }
}

#[cfg(test)]
mod gpu_tests {
    use super::*;
    use crate::split::device::Backend;
    use crate::split::device::HostBuffer;
    use crate::split::pcie::Pcie;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;
    use torpor_device::host::HostDevice;

    fn device() -> Arc<dyn SegmentDevice> {
        Arc::new(Backend::new(
            HostDevice::new(),
            Pcie::new("host", Default::default(), None),
        ))
    }

    /// A GPU put of `data` under `key`, filled through the fd as a worker would, then sealed.
    fn put_gpu(s: &Store, dev: &Arc<dyn SegmentDevice>, key: &str, data: &[u8]) -> Reserved {
        let r = s
            .reserve_gpu(
                key,
                "team-a",
                key,
                serde_json::json!({"kind": "cuda"}),
                60.0,
                data.len() as u64,
                0,
                Arc::clone(dev),
                false,
            )
            .unwrap();
        let f = std::fs::File::from(r.fd.try_clone().unwrap());
        f.write_all_at(data, 0).unwrap();
        s.seal_gpu(key, true).unwrap();
        r
    }

    fn contents(t: &Taken) -> Vec<u8> {
        let mut out = vec![0u8; t.held_bytes as usize];
        match &t.held {
            TakenHeld::Host(fd) => {
                let f = std::fs::File::from(fd.try_clone().unwrap());
                f.read_exact_at(&mut out, 0).unwrap();
            }
            TakenHeld::Gpu(g) => g.device.read_memory(&g.memory, &mut out).unwrap(),
        }
        out
    }

    #[test]
    fn the_oldest_values_are_spilled_and_only_as_many_as_make_room() {
        // (put order, bytes): the oldest is 1.
        let held = [(3, 10), (1, 10), (2, 10)];
        assert_eq!(spill_victims(&held, 30, 10, 40), Some(vec![]));
        assert_eq!(spill_victims(&held, 30, 10, 30), Some(vec![1]));
        assert_eq!(spill_victims(&held, 30, 25, 30), Some(vec![1, 2, 0]));
        // Puts in progress count in `used` but cannot be spilled: all values go, still short;
        // the allocation then decides.
        assert_eq!(spill_victims(&held, 40, 20, 30), Some(vec![1, 2, 0]));
        assert_eq!(spill_victims(&held, 30, 31, 30), None);
        assert_eq!(spill_victims(&[], 0, 0, 0), Some(vec![]));
    }

    #[test]
    fn a_gpu_put_for_every_node_is_stored_only_once_inserted_with_its_put_id() {
        let s = Store::new(1 << 30);
        let dev = device();
        put_gpu(&s, &dev, "k", b"old");
        let r = s
            .reserve_gpu(
                "t",
                "team-a",
                "k",
                serde_json::json!({"kind": "cuda"}),
                60.0,
                3,
                0,
                Arc::clone(&dev),
                true,
            )
            .unwrap();
        std::fs::File::from(r.fd.try_clone().unwrap())
            .write_all_at(b"new", 0)
            .unwrap();
        drop(r);
        // Sealed and handed back for the upload: the key still holds the old value.
        let SealedPut::ForNodes(sealed) = s.seal_gpu("t", true).unwrap() else {
            panic!("a put for every node is not stored by the seal");
        };
        assert_eq!((sealed.key.as_str(), sealed.bytes), ("k", 3));
        let old = s.get("team-a", "k", true, true).unwrap().unwrap();
        assert_eq!(&contents(&old)[..3], b"old");
        assert!(old.bucket.is_none());
        // Inserted once uploaded: the new bytes, in GPU memory, with the bucket's put id.
        s.insert_gpu(sealed, "00ff".into()).unwrap();
        let new = s.get("team-a", "k", false, true).unwrap().unwrap();
        assert!(new.gpu && matches!(new.held, TakenHeld::Gpu(_)));
        assert_eq!(new.bucket.as_deref(), Some("00ff"));
        assert_eq!(&contents(&new)[..3], b"new");
        // A duplicate is another handle of the same memory: what a failed get puts back.
        let again = new.duplicate().unwrap();
        assert!(s.put_back("team-a", "k", again));
        assert_eq!(
            &contents(&s.get("team-a", "k", false, true).unwrap().unwrap())[..3],
            b"new"
        );
        // Not filled: dropped, as any GPU put.
        s.reserve_gpu(
            "u",
            "team-a",
            "k",
            Value::Null,
            60.0,
            3,
            0,
            Arc::clone(&dev),
            true,
        )
        .unwrap();
        assert!(matches!(
            s.seal_gpu("u", false).unwrap(),
            SealedPut::Dropped
        ));
        assert!(s.get("team-a", "k", false, true).unwrap().is_none());
    }

    #[test]
    fn a_gpu_value_is_stored_only_once_filled_and_a_failed_put_keeps_the_old_one() {
        let s = Store::new(1 << 30);
        let dev = device();
        let page = dev.granularity();
        let r = put_gpu(&s, &dev, "k", b"first");
        assert_eq!(r.padded, page as u64);
        // A second put of the key in progress: the first value is still what a get sees.
        let pending = s
            .reserve_gpu(
                "t2",
                "team-a",
                "k",
                Value::Null,
                60.0,
                3,
                0,
                Arc::clone(&dev),
                false,
            )
            .unwrap();
        drop(pending);
        assert_eq!(held(&s), vec![(0, 2 * page as u64)]);
        // A getter without a GPU is refused, and the value stays.
        let e = s.get("team-a", "k", false, false).unwrap_err();
        assert!(e.to_string().contains("gpus = 1"), "{e}");
        let kept = s.get("team-a", "k", true, true).unwrap().unwrap();
        assert!(kept.gpu && matches!(kept.held, TakenHeld::Gpu(_)));
        assert_eq!(&contents(&kept)[..5], b"first");
        // The worker gave up: nothing changes but the reservation's return.
        s.seal_gpu("t2", false).unwrap();
        assert_eq!(held(&s), vec![(0, page as u64)]);
        let e = s.seal_gpu("t2", true).unwrap_err();
        assert!(matches!(e, StoreError::NotPending(_)), "{e}");
        // Another tenant never sees it; consumed, it is gone and its GPU bytes with it.
        assert!(s.get("team-b", "k", false, true).unwrap().is_none());
        let taken = s.get("team-a", "k", false, true).unwrap().unwrap();
        assert_eq!(taken.bytes, 5);
        assert!(s.get("team-a", "k", false, true).unwrap().is_none());
        assert_eq!((held(&s), s.gpu_usage().1), (vec![(0, 0)], 0));
    }

    #[test]
    fn past_the_gpu_budget_the_oldest_value_moves_to_a_sealed_memfd_with_its_bytes() {
        let dev = device();
        let page = dev.granularity() as u64;
        let s = Store::new(2 * page);
        put_gpu(&s, &dev, "a", b"value a");
        put_gpu(&s, &dev, "b", b"value b");
        let r = put_gpu(&s, &dev, "c", b"value c");
        assert_eq!(r.spilled, 1);
        assert_eq!(s.spills(), 1);
        assert_eq!((held(&s), s.gpu_usage().1), (vec![(0, 2 * page)], page));
        let a = s.get("team-a", "a", false, true).unwrap().unwrap();
        let TakenHeld::Host(fd) = &a.held else {
            panic!("a was not spilled: {a:?}");
        };
        // Sealed against writes like every memfd of the store.
        assert_eq!(sealed_size(fd).unwrap(), page);
        assert!(a.gpu);
        assert_eq!(&contents(&a)[..7], b"value a");
        let b = s.get("team-a", "b", true, true).unwrap().unwrap();
        assert!(matches!(b.held, TakenHeld::Gpu(_)), "{b:?}");
        // One value larger than the budget is refused with the fix; nothing else moves.
        let e = s
            .reserve_gpu(
                "big",
                "team-a",
                "big",
                Value::Null,
                60.0,
                3 * page,
                0,
                Arc::clone(&dev),
                false,
            )
            .unwrap_err();
        assert!(e.to_string().contains("[store] gpu_bytes"), "{e}");
        assert_eq!(s.spills(), 1);
    }

    #[test]
    fn gpu_values_count_in_the_tenants_bytes_and_expire() {
        let dev = device();
        let s = Store::new(u64::MAX);
        let reserve = |bytes: u64, ttl_s: f64| {
            s.reserve_gpu(
                "x",
                "team-a",
                "x",
                Value::Null,
                ttl_s,
                bytes,
                0,
                Arc::clone(&dev),
                false,
            )
        };
        let e = reserve(MAX_BYTES + 1, 60.0).unwrap_err();
        assert!(matches!(e, StoreError::Full { .. }), "{e}");
        let e = reserve(0, 60.0).unwrap_err();
        assert!(matches!(e, StoreError::EmptyGpu), "{e}");
        reserve(10, 0.05).unwrap();
        s.seal_gpu("x", true).unwrap();
        assert_ne!(held(&s), vec![(0, 0)]);
        std::thread::sleep(Duration::from_millis(80));
        s.sweep();
        assert_eq!(held(&s), vec![(0, 0)]);
        assert!(s.get("team-a", "x", false, true).unwrap().is_none());
    }

    /// Each GPU's (ordinal, bytes of values and puts in progress).
    fn held(s: &Store) -> Vec<(i32, u64)> {
        s.gpu_usage()
            .0
            .iter()
            .map(|u| (u.ordinal, u.held))
            .collect()
    }

    fn spare_of(page: u64, dev: &Arc<dyn SegmentDevice>) -> SpareFor {
        SpareFor {
            tenant: "team-a".into(),
            ordinal: 0,
            padded: page,
            device: Arc::clone(dev),
        }
    }

    fn spare(s: &Store) -> u64 {
        s.gpu_usage().0.iter().map(|u| u.spare).sum()
    }

    fn memory_of(t: &Taken) -> Arc<Memory> {
        match &t.held {
            TakenHeld::Gpu(g) => Arc::clone(&g.memory),
            TakenHeld::Host(_) => panic!("not on the GPU: {t:?}"),
        }
    }

    /// A GPU put of `len` bytes by `tenant` under `key`, not written (recycled host memory is
    /// sealed for good): the block it got.
    fn reserve(s: &Store, dev: &Arc<dyn SegmentDevice>, tenant: &str, key: &str, len: u64) -> u64 {
        let r = s
            .reserve_gpu(
                key,
                tenant,
                key,
                Value::Null,
                60.0,
                len,
                0,
                Arc::clone(dev),
                false,
            )
            .unwrap();
        s.seal_gpu(key, true).unwrap();
        r.block
    }

    fn block_of(t: &Taken) -> u64 {
        match &t.held {
            TakenHeld::Gpu(g) => g.block.id,
            TakenHeld::Host(_) => panic!("not on the GPU: {t:?}"),
        }
    }

    #[test]
    fn a_consumed_value_s_block_comes_back_to_its_tenant_only_once_every_holder_released_it() {
        let dev = device();
        let page = dev.granularity() as u64;
        let mut s = Store::new(4 * page);
        s.recycle_host = true;
        let first = put_gpu(&s, &dev, "a", b"value a").block;
        // Two gets of it in place: one kept (holder 7), one consuming (holder 9).
        let kept = s.get("team-a", "a", true, true).unwrap().unwrap();
        s.hold(block_of(&kept), 7);
        drop(kept);
        let taken = s.get("team-a", "a", false, true).unwrap().unwrap();
        s.hold(block_of(&taken), 9);
        s.consumed("team-a", taken);
        // Parked while mapped: not the store's to count, not yet anyone's to reuse.
        assert_eq!((held(&s), spare(&s)), (vec![(0, 0)], 0));
        // A holder cannot release what it was not handed; each releases its own get.
        s.release(8, &[first]);
        s.release(9, &[first]);
        assert_eq!(spare(&s), 0, "holder 7 still maps it");
        s.release(7, &[first]);
        assert_eq!(spare(&s), page, "kept for team-a's next put");
        // Another tenant's put of the size gets other memory; the tenant's own gets the block.
        assert_ne!(reserve(&s, &dev, "team-b", "b", 100), first);
        assert_eq!(reserve(&s, &dev, "team-a", "c", 100), first);
        assert_eq!(spare(&s), 0);
        assert!(s.take_gone().is_empty(), "nothing was let go");
    }

    #[test]
    fn a_block_a_worker_never_releases_goes_and_its_mappers_are_named() {
        let dev = device();
        let page = dev.granularity() as u64;
        let mut s = Store::new(4 * page);
        s.recycle_host = true;
        // An older worker's get: held for good, so the consumed block is let go, not kept.
        let old = put_gpu(&s, &dev, "a", b"a").block;
        let t = s.get("team-a", "a", false, true).unwrap().unwrap();
        s.hold(old, NO_RELEASE);
        s.consumed("team-a", t);
        assert_eq!(spare(&s), 0);
        assert_eq!(s.take_gone(), vec![old]);
        // A worker that is gone releases what it held: the parked block comes back.
        let b = put_gpu(&s, &dev, "b", b"b").block;
        let t = s.get("team-a", "b", false, true).unwrap().unwrap();
        s.hold(b, 5);
        s.hold(b, 5);
        s.consumed("team-a", t);
        s.forget_holder(5);
        assert_eq!(spare(&s), page);
        // Unused past the idle time, a kept block goes, and its id is named for its mappers.
        lock(&s.inner).spare_idle = Duration::ZERO;
        s.sweep();
        assert_eq!((spare(&s), s.take_gone()), (0, vec![b]));
    }

    #[test]
    fn a_lease_takes_its_holder_s_next_put_and_goes_back_only_from_the_holder() {
        let dev = device();
        let page = dev.granularity() as u64;
        let mut s = Store::new(4 * page);
        s.recycle_host = true;
        // Nothing to set aside yet; then the spare is.
        assert!(s.lease(7, "team-a", 0, page).is_none());
        s.make_spare(spare_of(page, &dev));
        let (block, _fd) = s.lease(7, "team-a", 0, page).unwrap();
        assert!(
            s.lease(7, "team-a", 0, page).is_none(),
            "one lease a holder"
        );
        assert_eq!(
            (held(&s), spare(&s)),
            (vec![(0, page)], 0),
            "counted as held"
        );
        // Only the holder's put into it, of its tenant and GPU and no bigger, is taken.
        let put = |holder: u64, tenant: &str, bytes: u64, block: u64, ordinal: i32| {
            s.put_leased(
                holder,
                tenant,
                "k",
                Value::Null,
                60.0,
                bytes,
                block,
                ordinal,
            )
        };
        assert!(matches!(
            put(8, "team-a", 10, block, 0),
            Err(StoreError::NoLease(_))
        ));
        assert!(matches!(
            put(7, "team-a", 10, block + 1, 0),
            Err(StoreError::NoLease(_))
        ));
        // A put naming another block leaves the holder's lease as it is.
        assert_eq!(spare(&s), 0);
        assert!(s.lease(7, "team-a", 0, page).is_none(), "it still holds it");
        assert!(matches!(
            put(7, "team-a", page + 1, block, 0),
            Err(StoreError::LeaseTooSmall { .. })
        ));
        let (block, _fd) = s.lease(7, "team-a", 0, page).unwrap();
        let spare_for = put(7, "team-a", 10, block, 0).unwrap();
        assert_eq!(
            (spare_for.tenant.as_str(), spare_for.padded),
            ("team-a", page)
        );
        let v = s.get("team-a", "k", true, true).unwrap().unwrap();
        assert_eq!((block_of(&v), v.bytes), (block, 10));
        // Given back by a put without it, or by the holder's end: kept for the tenant.
        let other = reserve(&s, &dev, "team-a", "o", 10);
        let t = s.get("team-a", "o", false, true).unwrap().unwrap();
        s.consumed("team-a", t);
        let (leased, _fd) = s.lease(9, "team-a", 0, page).unwrap();
        assert_eq!(leased, other);
        s.forget_holder(9);
        assert_eq!(
            s.lease(3, "team-b", 0, page).map(|l| l.0),
            None,
            "not another tenant's"
        );
        assert_eq!(s.lease(3, "team-a", 0, page).map(|l| l.0), Some(other));
        s.return_lease(3, other + 1);
        assert_eq!(spare(&s), 0, "not its lease: nothing given back");
        s.return_lease(3, other);
        assert_eq!(spare(&s), page);
    }

    #[test]
    fn kept_blocks_make_room_before_any_value_moves_and_only_cuda_memory_is_kept() {
        let dev = device();
        let page = dev.granularity() as u64;
        let mut s = Store::new(2 * page);
        s.recycle_host = true;
        // Two values got at once, then both released: two blocks kept.
        let blocks = [
            reserve(&s, &dev, "team-a", "a", 1),
            reserve(&s, &dev, "team-a", "b", 1),
        ];
        for (key, blk) in ["a", "b"].into_iter().zip(blocks) {
            let t = s.get("team-a", key, false, true).unwrap().unwrap();
            s.hold(blk, 3);
            s.consumed("team-a", t);
        }
        s.release(3, &blocks);
        assert_eq!((held(&s), spare(&s)), (vec![(0, 0)], 2 * page));
        // Another tenant's put of two pages: both kept blocks go for it, no value moves.
        reserve(&s, &dev, "team-b", "big", 2 * page);
        assert_eq!((spare(&s), s.spills()), (0, 0));
        // Without the test switch, host memory (sealed for good) is never kept.
        s.recycle_host = false;
        let t = s.get("team-b", "big", false, true).unwrap().unwrap();
        let big = block_of(&t);
        s.hold(big, 3);
        s.consumed("team-b", t);
        s.release(3, &[big]);
        assert_eq!(spare(&s), 0);
    }

    #[test]
    fn the_next_put_of_a_size_takes_the_spare_made_for_it_within_the_budget() {
        let dev = device();
        let page = dev.granularity() as u64;
        let s = Store::new(2 * page);
        put_gpu(&s, &dev, "a", b"value a");
        s.make_spare(spare_of(page, &dev));
        assert_eq!((held(&s), spare(&s)), (vec![(0, page)], page));
        let made = Arc::clone(&lock(&s.inner).spares[&0].gpu.memory);
        // One spare a GPU: another is not made while it waits.
        s.make_spare(spare_of(page, &dev));
        assert!(Arc::ptr_eq(&lock(&s.inner).spares[&0].gpu.memory, &made));
        // The next put of that size fills the spare's memory; nothing had to move.
        put_gpu(&s, &dev, "b", b"value b");
        let b = s.get("team-a", "b", true, true).unwrap().unwrap();
        assert!(
            Arc::ptr_eq(&memory_of(&b), &made),
            "the put made new memory"
        );
        assert_eq!(&contents(&b)[..7], b"value b");
        assert_eq!(
            (held(&s), spare(&s), s.spills()),
            (vec![(0, 2 * page)], 0, 0)
        );
        // The budget is full: no spare is made past it.
        s.make_spare(spare_of(page, &dev));
        assert_eq!(spare(&s), 0);
        // Room again: a spare; a put of another size lets it go rather than move a value.
        s.get("team-a", "a", false, true).unwrap().unwrap();
        s.make_spare(spare_of(page, &dev));
        assert_eq!(spare(&s), page);
        s.get("team-a", "b", false, true).unwrap().unwrap();
        let r = s
            .reserve_gpu(
                "big",
                "team-a",
                "big",
                Value::Null,
                60.0,
                2 * page,
                0,
                Arc::clone(&dev),
                false,
            )
            .unwrap();
        assert_eq!(
            (r.spilled, spare(&s), held(&s)),
            (0, 0, vec![(0, 2 * page)])
        );
    }

    #[test]
    fn a_put_is_reserved_from_the_spare_alone_only_when_it_has_one_of_its_size() {
        let dev = device();
        let page = dev.granularity() as u64;
        let s = Store::new(2 * page);
        let from_spare = |ticket: &str, key: &str, bytes: u64| {
            s.reserve_gpu_with(
                ticket,
                "team-a",
                key,
                Value::Null,
                60.0,
                bytes,
                0,
                Arc::clone(&dev),
                false,
                true,
            )
        };
        // No spare: nothing is made and nothing changes.
        assert!(from_spare("t0", "x", 10).unwrap().is_none());
        assert!(lock(&s.inner).pending.is_empty());
        put_gpu(&s, &dev, "a", b"value a");
        s.make_spare(spare_of(page, &dev));
        // A spare of another size: left as it is.
        assert!(from_spare("t1", "x", page + 1).unwrap().is_none());
        assert_eq!(spare(&s), page);
        // Of its size: taken, no value moved.
        let r = from_spare("t2", "x", 10).unwrap().expect("the spare");
        assert_eq!((r.padded, r.spilled, spare(&s)), (page, 0, 0));
        s.seal_gpu("t2", true).unwrap();
        assert_eq!((held(&s), s.spills()), (vec![(0, 2 * page)], 0));
    }

    /// A device whose memory runs out (ENOMEM at `create`) while `short`, until one of the
    /// store's blocks has been let go: as the driver is, until memory is really freed.
    struct ShortOfMemory {
        inner: Arc<dyn SegmentDevice>,
        gone: Arc<Mutex<Vec<u64>>>,
        short: std::sync::atomic::AtomicBool,
    }

    impl SegmentDevice for ShortOfMemory {
        fn backend(&self) -> &'static str {
            self.inner.backend()
        }
        fn granularity(&self) -> usize {
            self.inner.granularity()
        }
        fn host_buffer(&self, len: usize) -> Result<HostBuffer, DeviceError> {
            self.inner.host_buffer(len)
        }
        fn make_host_pool(&self, bytes: usize) -> Result<usize, DeviceError> {
            self.inner.make_host_pool(bytes)
        }
        fn host_pool(&self) -> Option<(usize, usize)> {
            self.inner.host_pool()
        }
        fn read_fd(&self, fd: OwnedFd, out: &mut [u8]) -> Result<(), DeviceError> {
            self.inner.read_fd(fd, out)
        }
        fn fill_from_bytes(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError> {
            self.inner.fill_from_bytes(src, seal)
        }
        fn fill_from_pageable(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError> {
            self.inner.fill_from_pageable(src, seal)
        }
        fn pcie(&self) -> &Pcie {
            self.inner.pcie()
        }
        fn create(&self, len: usize) -> Result<Memory, DeviceError> {
            if self.short.load(Ordering::SeqCst) && lock(&self.gone).is_empty() {
                return Err(DeviceError::Os {
                    call: "create",
                    hint: "the test's device is full until a block goes",
                    source: std::io::Error::from_raw_os_error(libc::ENOMEM),
                });
            }
            self.inner.create(len)
        }
        fn seal(&self, memory: &Memory) -> Result<(), DeviceError> {
            self.inner.seal(memory)
        }
        fn fill_from_memory(
            &self,
            src: &Memory,
            size: usize,
            seal: bool,
        ) -> Result<Memory, DeviceError> {
            self.inner.fill_from_memory(src, size, seal)
        }
        fn fill_from_peer(
            &self,
            from: &dyn SegmentDevice,
            src: &Memory,
            size: usize,
            seal: bool,
        ) -> Result<Option<Memory>, DeviceError> {
            self.inner.fill_from_peer(from, src, size, seal)
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn export(&self, memory: &Memory) -> Result<OwnedFd, DeviceError> {
            self.inner.export(memory)
        }
        fn read_memory(&self, memory: &Memory, out: &mut [u8]) -> Result<(), DeviceError> {
            self.inner.read_memory(memory, out)
        }
        fn refresh_fd(
            &self,
            fd: OwnedFd,
            block: usize,
            hashes: &[[u8; 32]],
            out: &mut [u8],
        ) -> Result<Vec<usize>, DeviceError> {
            self.inner.refresh_fd(fd, block, hashes, out)
        }
        fn refresh_memory(
            &self,
            memory: &Memory,
            block: usize,
            hashes: &[[u8; 32]],
            out: &mut [u8],
        ) -> Result<Vec<usize>, DeviceError> {
            self.inner.refresh_memory(memory, block, hashes, out)
        }
        fn write_blocks(
            &self,
            memory: &Memory,
            src: &[u8],
            block: usize,
            blocks: &[usize],
        ) -> Result<(), DeviceError> {
            self.inner.write_blocks(memory, src, block, blocks)
        }
    }

    #[test]
    fn out_of_gpu_memory_a_value_moved_out_frees_its_memory_for_the_put_that_needed_it() {
        // Far within the budget: only the driver's memory is short.
        let s = Store::new(1 << 30);
        let short = Arc::new(ShortOfMemory {
            inner: device(),
            gone: Arc::clone(&s.gone),
            short: std::sync::atomic::AtomicBool::new(false),
        });
        let dev: Arc<dyn SegmentDevice> = short.clone();
        drop(put_gpu(&s, &dev, "a", b"value a"));
        short.short.store(true, Ordering::SeqCst);
        // The put moves "a" to host memory and takes the room it frees. Before, "a"'s memory
        // was freed only after the store's lock, so every try within it ran out again and
        // the put failed with nothing left to move.
        let r = put_gpu(&s, &dev, "b", b"value b");
        assert_eq!((r.spilled, s.spills()), (1, 1));
        drop(r);
        let a = s.get("team-a", "a", false, true).unwrap().unwrap();
        assert!(matches!(a.held, TakenHeld::Host(_)), "{a:?}");
        assert_eq!(&contents(&a)[..7], b"value a");
        let b = s.get("team-a", "b", false, true).unwrap().unwrap();
        assert!(matches!(b.held, TakenHeld::Gpu(_)), "{b:?}");
        assert_eq!(&contents(&b)[..7], b"value b");
    }

    #[test]
    fn an_unused_spare_goes_after_its_idle_time() {
        let dev = device();
        let page = dev.granularity() as u64;
        let s = Store::new(4 * page);
        lock(&s.inner).spare_idle = Duration::from_millis(50);
        s.make_spare(spare_of(page, &dev));
        assert_eq!(spare(&s), page);
        std::thread::sleep(Duration::from_millis(80));
        s.sweep();
        assert_eq!(spare(&s), 0);
    }

    /// Dropped once buried: whether the store's lock was free then, and on which thread.
    struct Probe(
        Arc<Store>,
        Arc<Mutex<Option<(bool, std::thread::ThreadId)>>>,
    );

    impl Drop for Probe {
        fn drop(&mut self) {
            let free = self.0.inner.try_lock().is_ok();
            *lock(&self.1) = Some((free, std::thread::current().id()));
        }
    }

    fn bury_probe(s: &Arc<Store>) -> Arc<Mutex<Option<(bool, std::thread::ThreadId)>>> {
        let seen = Arc::new(Mutex::new(None));
        s.inner().bury(Probe(Arc::clone(s), Arc::clone(&seen)));
        seen
    }

    #[test]
    fn what_the_store_lets_go_is_dropped_after_its_lock_on_the_blocking_pool() {
        let s = Arc::new(Store::new(1 << 30));
        // Outside a runtime: on the caller's thread, once the lock is released.
        let seen = bury_probe(&s);
        assert_eq!(*lock(&seen), Some((true, std::thread::current().id())));
        // Within the runtime: not on the runtime's thread either (a driver release takes ms).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let (seen, caller) = rt.block_on(async {
            let seen = bury_probe(&s);
            let caller = std::thread::current().id();
            for _ in 0..500 {
                if lock(&seen).is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (seen, caller)
        });
        let (free, thread) = lock(&seen).expect("the buried value was dropped");
        assert!(free, "dropped while the store's lock was held");
        assert_ne!(thread, caller, "dropped on the runtime's thread");
    }
}
