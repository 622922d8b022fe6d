//! The worker protocol's frames, typed: [`ToWorker`] (what torpord sends) and [`FromWorker`]
//! (what a worker sends), each frame a JSON object whose `type` names its variant
//! (docs/torpord.md, "Worker protocol"; the codec is crate::frames).
//!
//! One definition for both sides: the JSON schema of these types,
//! `python/torpor/protocol.schema.json`, is generated from them (schemars, the maintained
//! JSON-schema derive for serde types) and checked to be current by this module's tests
//! (`TORPOR_WRITE_SCHEMA=1 cargo test -p torpord protocol::` rewrites it); the Python SDK's tests
//! validate every frame a real worker sends, and every frame type it accepts, against it
//! (tests/sdk/sdkd.py, tests/sdk/test_sdk_protocol.py). The schema is strict (no fields it does
//! not list); the daemon reads frames leniently (fields it does not know are ignored), so a
//! worker that adds a field fails the tests, not a deployment.
//!
//! Parsing reads `type` first and then the variant's fields from the same bytes: serde's
//! internally tagged enums buffer the content, which would re-encode a result's `value` (it
//! must reach the client as the bytes the worker sent, RawValue).
//!
//! Versions: a worker says its [`PROTOCOL`] in `hello`; 1 (no `started`, no `attached`) and 2
//! are understood, a newer one is refused with the fix (upgrade torpord).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// The newest protocol version this daemon speaks (sent by workers in `hello`): 2 sends
/// `started` and reattaches; 3 takes `release_gpu`; 4 keeps its mappings of the store's GPU
/// memory (`block`), sends `store_release` and takes `store_unmap`; 5 takes `quiesce`
/// {released: true}. A worker restored from an older snapshot speaks its own version, which the
/// daemon reads from its hello.
pub const PROTOCOL: u64 = 5;

/// A frame that is not a frame of the protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The payload is not an object with a string `type`.
    #[error("a frame without a string type ({0})")]
    NoType(String),
    /// A `type` this side does not take.
    #[error("an unknown frame type {0:?} (known: {1})")]
    UnknownType(String, &'static str),
    /// A known `type` whose fields do not fit.
    #[error("a malformed {kind} frame ({cause})")]
    Malformed { kind: &'static str, cause: String },
}

/// Who a worker is: a base (preloaded imports, no function) or a function worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Base,
    Function,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Base => "base",
            Role::Function => "function",
        }
    }
}

/// A Python exception as the worker reports it.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ErrorDoc {
    /// The exception's class name.
    pub r#type: String,
    pub message: String,
    pub traceback: String,
}

/// One device-memory segment, as a split `quiet` lists it (docs/split.md).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SegmentInfo {
    pub va: u64,
    pub size: u64,
    pub backend: String,
    pub ordinal: Option<i64>,
    pub order: Option<i64>,
    pub first_use: Option<i64>,
    pub readonly: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shareable: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deferrable: Option<bool>,
}

fn one() -> u64 {
    1
}

/// The first frame of every connection.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Hello {
    /// The worker's pid in its own namespace (informational).
    pub pid: i64,
    pub role: Role,
    pub function: Option<String>,
    /// It was restored from a snapshot (and woken by SIGUSR2).
    pub resumed: bool,
    /// Its protocol version (1 when absent).
    #[serde(default = "one")]
    pub protocol: u64,
    /// It lost its daemon and asks to be re-adopted.
    #[serde(default)]
    pub reattach: bool,
    /// With `reattach`: the requests with an idempotency key it ran or runs for the lost
    /// daemon, whose answers it keeps (crate::idempotency). Their `settled` frames follow
    /// `attached` (or the end of each one still running).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<HeldKey>,
}

/// A keyed request a reattaching worker holds the outcome of (or is still running).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct HeldKey {
    /// In a sandbox: the function of the request; absent for a worker of one function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    pub key: String,
    /// The invoke's `fingerprint` (the request's bytes' hash).
    pub fingerprint: String,
}

/// The outcome of a keyed request a lost daemon sent: sent after `attached` to the daemon
/// that re-adopted the worker, in place of its `result` (whose id was the lost daemon's).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Settled {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    pub key: String,
    pub fingerprint: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Value>")]
    pub value: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ErrorDoc>")]
    pub error: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_s: Option<f64>,
}

/// After `preload` (a base) or `load`: whether the worker is ready, or where it failed.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Ready {
    pub ok: bool,
    /// After a `load`: binding the declared data and mapping the platform's GPU data, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_s: Option<f64>,
    /// After a `load`: importing the function's module, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import_s: Option<f64>,
    /// After a `load`: the function's setup(); after a base's `preload`, the preloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup_s: Option<f64>,
    /// After a `load`: weight packing (torpor.pack), in seconds; 0 when nothing was packed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preload_s: Option<f64>,
    /// The weight packing's report (docs/split.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed: Option<BTreeMap<String, Value>>,
    /// After a `load`: the function's memory model, measured by its pool (torpor.mempool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryModel>,
    /// With `ok: false`: the worker's step that failed, and its error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ErrorDoc>")]
    pub error: Option<Value>,
}

/// `warmed`: only from a `--role function` worker launched with `--announce-warm` (a ready
/// sandbox of the live-context pool, crate::runtime::start::pooled): it imported its preloads
/// and, with `--gpu`, warmed CUDA, and waits for `load`. A failure there is `ready` {ok: false,
/// phase} as without the flag.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Warmed {
    /// Importing the preloads, in seconds.
    pub preload_s: f64,
    /// Warming CUDA (0 without `--gpu`), in seconds, the kernels of requests included.
    pub warmup_s: f64,
    /// Op runs made to load the kernels common requests use (torpor.gpu.warm_requests), so
    /// that a function loaded into this sandbox does not load them on its first request; 0
    /// without `--gpu` or under another framework than PyTorch.
    #[serde(default)]
    pub warm_requests: u64,
}

/// A request's handler started (protocol 2): its timeout counts from here.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Started {
    pub id: u64,
}

/// A request's outcome: its value (as the worker encoded it) or the handler's exception.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct ResultFrame {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Value>")]
    pub value: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ErrorDoc>")]
    pub error: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handler_s: Option<f64>,
    /// A sandbox's request: its function's memory after it (crate::runtime::memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryReport>,
}

/// A function's memory model (`ready`'s `memory`), in bytes: what it holds after setup() and
/// the most one request needed above that (its warm-up's, at a deploy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct MemoryModel {
    pub backend: MemoryBackend,
    pub resident: u64,
    pub request_peak: u64,
}

/// Which memory a function's pool accounts (torpor.mempool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MemoryBackend {
    /// PyTorch's CUDA memory, a `torch.cuda.MemPool` per function.
    Cuda,
    /// Host memory from `torpor.scratch`.
    Host,
}

impl MemoryBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cuda => "cuda",
            Self::Host => "host",
        }
    }
}

/// One function's memory in a sandbox, in bytes: a `result`'s `memory` (with `peak`, the
/// request's above `resident`) and the `memory` frame a sandbox sends when a function's idle
/// pool gave its memory back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct MemoryReport {
    pub function: String,
    pub resident: u64,
    /// What its request pool holds now (in use and cached).
    pub pool: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak: Option<u64>,
}

/// The worker is at a quiet point after `quiesce` (a split one lists its segments).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Quiet {
    pub cuda_synced: bool,
    /// After `quiesce` {released: true}.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<Vec<SegmentInfo>>")]
    pub segments: Option<Vec<Value>>,
}

/// A segment's memfd, attached to this frame (SCM_RIGHTS).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct SegmentFd {
    pub va: u64,
    pub fd: bool,
}

/// After `release`: the device memory the worker gave back.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Released {
    pub bytes: u64,
}

/// The answer to one `map`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Mapped {
    pub va: u64,
    pub ok: bool,
    /// Seconds the worker spent in the hook's map call (import, map, access), when ok; summed
    /// into the start's `segments.map` timing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ErrorDoc>")]
    pub error: Option<Value>,
}

/// The answer to `unmap`: the bytes given back, or the segments still unmapped and the error.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Unmapped {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ErrorDoc>")]
    pub error: Option<Value>,
}

/// The answer to `release_gpu`: the bytes of idle pool memory given back; the worker's CUDA
/// work is done and it starts none of its own until torpord serves it again.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct GpuQuiet {
    pub bytes: u64,
}

/// `store_put` (a sandbox's torpor.put(..., shared=True); crate::runtime::store): hand the
/// sealed memfd that holds a value to the daemon's communication store under `key` of the
/// worker's tenant. A `store_fd` frame with the same `id` and the memfd attached follows at
/// once; the daemon answers `store_stored`.
///
/// With `gpu` (a CUDA tensor; crate::runtime::store_gpu) no `store_fd` follows: the daemon
/// answers `store_memory` with GPU memory of its own attached, the worker copies the tensor into
/// it and sends `store_written`, and the daemon answers that with `store_stored`.
///
/// With `nodes: "all"` (torpor.put(..., nodes="all"); crate::runtime::store_nodes) the daemon
/// also uploads the value to the bucket of `[objstore]` before it answers, for the tenant's
/// sandboxes on every node; refused for a GPU value and without `[objstore]`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StorePut {
    pub id: u64,
    pub key: String,
    pub ttl_s: f64,
    /// What the bytes are, for the reader (e.g. {kind: "ndarray", dtype, shape}); kept as sent.
    pub meta: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<StorePutGpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<StoreNodes>,
}

/// Which nodes a `store_put`'s value is for (absent: this node's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StoreNodes {
    /// Every node whose torpord shares this one's `[objstore]` bucket.
    All,
}

/// A GPU value's size and where it is.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StorePutGpu {
    /// Bytes of the tensor.
    pub bytes: u64,
    /// The worker's CUDA ordinal of the GPU the tensor is on.
    pub ordinal: i32,
    /// Protocol 4: the block of the worker's lease (a `store_stored`'s `lease`), which it has
    /// filled already: the put is this one frame, answered `store_stored`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<u64>,
}

/// Memory the daemon set aside for the worker's next put of `padded` bytes on its GPU
/// `ordinal` (protocol 4): the fd is attached to the `store_stored` that carries it. The worker
/// fills it before it asks (`store_put` with `gpu.lease`); a put of another size gives it back.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreLease {
    pub block: u64,
    pub padded: u64,
    /// The fewest bytes a put must have to take it (those of its size class: one byte more
    /// than the next smaller padded size).
    pub min_bytes: u64,
    /// The worker's CUDA ordinal (as its puts name it).
    pub ordinal: i32,
}

/// The answer to a `store_put` with `gpu`: when `ok`, an fd of `padded` bytes of GPU memory the
/// daemon allocated on the tensor's GPU is attached (SCM_RIGHTS), for the worker to map
/// writable, fill and unmap; `ordinal` is the node's (the daemon's) GPU it is on.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreMemory {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padded: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ordinal: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd: Option<bool>,
    /// The memory's block, when it may come back to this tenant's puts and gets: the worker
    /// may keep its mapping of it (protocol 4) until a `store_unmap` names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<u64>,
    /// Why not (one line: cause and fix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A protocol-4 worker let go of one get of each of `blocks` (the values' objects are gone and
/// the work that read them done; it may keep the mappings), and of the `leases` it will not
/// fill. No answer.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreRelease {
    pub blocks: Vec<u64>,
    /// Leases the worker let go of unused (a put of another size came, or a quiet point).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub leases: Vec<u64>,
}

/// The daemon let go of `blocks` of the store's GPU memory: a worker that kept a mapping of
/// one unmaps it (at once, or when the object using it goes). No answer.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreUnmap {
    pub blocks: Vec<u64>,
}

/// The worker filled (`ok`) the GPU memory of its `store_put` of the same `id` and unmapped it,
/// or gave up (`error`); the daemon answers `store_stored`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreWritten {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The memfd of the `store_put` of the same `id`, attached to this frame (SCM_RIGHTS).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreFd {
    pub id: u64,
    pub fd: bool,
}

/// `store_get`: the value under `key` of the worker's tenant, consumed unless `keep`; the
/// daemon answers `store_value`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreGet {
    pub id: u64,
    pub key: String,
    #[serde(default)]
    pub keep: bool,
}

/// The answer to `store_put`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreStored {
    pub id: u64,
    pub ok: bool,
    /// Why not (one line: cause and fix).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// After a GPU put of a protocol-4 worker: memory for its next put of that size, its fd
    /// attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<StoreLease>,
}

/// The answer to `store_get`: when `found`, the value's sealed memfd is attached (SCM_RIGHTS)
/// with its `meta` and size.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreValue {
    pub id: u64,
    pub found: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd: Option<bool>,
    /// A GPU value: the attached fd is GPU memory on the worker's GPU, to be mapped read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<StoreValueGpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Where a GPU value a `store_value` carries is, and how it got there.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct StoreValueGpu {
    /// Bytes of the memory (the value's bytes padded to the GPU's granularity).
    pub padded: u64,
    /// The node's (the daemon's) GPU the memory is on: the worker's GPU 0.
    pub ordinal: i32,
    /// `stored`: the very memory the put filled (no copy); `peer`: copied GPU to GPU from
    /// another GPU; `host`: copied from another GPU through host memory (no peer access);
    /// `spilled`: copied up from host memory, where the store had moved it under pressure.
    pub source: String,
    /// `stored` memory that may come back to the tenant's puts: its block, which the worker
    /// releases (`store_release`) once the value's object is gone, and whose mapping it may
    /// keep (protocol 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<u64>,
}

/// A frame a worker sends.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    Hello(Hello),
    Warmed(Warmed),
    Ready(Ready),
    Started(Started),
    Result(ResultFrame),
    Quiet(Quiet),
    SegmentFd(SegmentFd),
    Released(Released),
    Mapped(Mapped),
    Unmapped(Unmapped),
    GpuQuiet(GpuQuiet),
    Dump(Dump),
    StorePut(StorePut),
    StoreFd(StoreFd),
    StoreGet(StoreGet),
    StoreWritten(StoreWritten),
    StoreRelease(StoreRelease),
    /// A sandbox's function idled and its pool gave its memory back.
    Memory(MemoryReport),
    Settled(Settled),
}

/// `load`: the function to import, set up and warm up (role function).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Load {
    /// The function's spec, as `python3 -m torpor.spec` printed it.
    pub spec: Value,
    /// The function's directory.
    pub dir: String,
    /// Its declared data: name → absolute path, or `{"fd": true}` for a `source` entry,
    /// whose object follows in a `data_fd` frame.
    pub data: BTreeMap<String, Value>,
}

/// `invoke`: one request; `request` is the client's bytes.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Invoke {
    pub id: u64,
    #[schemars(with = "Value")]
    pub request: Box<RawValue>,
    pub timeout_s: f64,
    /// In a sandbox (crate::runtime::sandbox): which of the functions it hosts serves the
    /// request; absent for a worker of one function.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    /// The client's idempotency key (crate::idempotency): the worker keeps the outcome, so a
    /// daemon that re-adopts it after losing this one can answer the client's retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// With `key`: the hash of the request's bytes (a retry must send the same request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

/// `attached`: the worker is in service; it outlives a lost daemon by `reattach_s`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Attached {
    pub reattach_s: f64,
}

/// `quiesce`: go to a quiet point for a snapshot (`split`: list and hand over the segments;
/// `released`: the worker's GPU is released and stays so, the quiet point makes no CUDA call
/// and lists no segment; protocol 5).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Quiesce {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<bool>,
}

/// `map`: map one segment back from the memfd attached to the frame.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Map {
    pub va: u64,
    pub size: u64,
    pub readonly: bool,
    pub fd: bool,
}

/// `unmap`: give back these segments' device memory (a GPU release on the split path).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Unmap {
    pub vas: Vec<u64>,
}

/// `data_fd`: after `load`, one per declared data entry with a `source`, in declared order:
/// the object torpord loaded, as a memfd attached to the frame (crate::s3data).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct DataFd {
    pub name: String,
    pub fd: bool,
}

/// `gpu_data`: after `load` (and its `data_fd` frames), one per declared data entry with
/// `device = "cuda"`, in declared order: GPU memory torpord filled with the file
/// (crate::gpudata), `padded` bytes (a multiple of the GPU's granularity) of which the first
/// `size` are the data, exported as an fd attached to the frame; the worker maps it (read-only
/// when `readonly`) before setup() runs.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct GpuData {
    pub name: String,
    pub size: u64,
    pub padded: u64,
    pub readonly: bool,
    pub fd: bool,
}

/// `dump` (while serving a request): `torpor.dump(name, obj)`; torpord writes `data` (base64)
/// to the object of the writable declared entry `name` without answering (crate::s3data).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Dump {
    pub name: String,
    pub data: String,
    /// The sandboxed function whose request dumped, when it is not the instance's own
    /// function (a sandbox's other members declare data of their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
}

/// A frame without fields.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Empty {}

/// A frame torpord sends.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    Load(Load),
    Invoke(Invoke),
    Attached(Attached),
    Quiesce(Quiesce),
    /// After a split quiesce: serve on, nothing released.
    Resume(Empty),
    /// After a split quiesce: release the segments.
    Release(Empty),
    Map(Map),
    Unmap(Unmap),
    DataFd(DataFd),
    GpuData(GpuData),
    /// Exit.
    Shutdown(Empty),
    /// A sandbox: give back the pools of its idle functions now (a request waits for room;
    /// crate::runtime::memory); each one released is answered by a `memory` frame.
    ReleaseMemory(Empty),
    /// The driver checkpoints the worker's GPU in place next: give idle pools back, finish
    /// CUDA work, start none until served again (answered by `gpu_quiet`; protocol 3).
    ReleaseGpu(Empty),
    StoreStored(StoreStored),
    StoreValue(StoreValue),
    StoreMemory(StoreMemory),
    StoreUnmap(StoreUnmap),
}

/// The `type` of a frame, read before its fields.
fn type_of(payload: &[u8]) -> Result<String, ProtocolError> {
    #[derive(Deserialize)]
    struct Tag {
        r#type: String,
    }
    serde_json::from_slice::<Tag>(payload)
        .map(|t| t.r#type)
        .map_err(|e| ProtocolError::NoType(e.to_string()))
}

fn fields<'a, T: Deserialize<'a>>(
    kind: &'static str,
    payload: &'a [u8],
) -> Result<T, ProtocolError> {
    serde_json::from_slice(payload).map_err(|e| ProtocolError::Malformed {
        kind,
        cause: e.to_string(),
    })
}

impl FromWorker {
    /// The frame types a worker sends.
    pub const TYPES: &'static str =
        "hello, warmed, ready, started, result, quiet, segment_fd, released, mapped, unmapped, gpu_quiet, dump, store_put, store_fd, store_get, store_written, store_release, memory, settled";

    /// A frame's payload, parsed (`type` first, then the variant from the same bytes).
    pub fn parse(payload: &[u8]) -> Result<Self, ProtocolError> {
        let kind = type_of(payload)?;
        Ok(match kind.as_str() {
            "hello" => Self::Hello(fields("hello", payload)?),
            "warmed" => Self::Warmed(fields("warmed", payload)?),
            "ready" => Self::Ready(fields("ready", payload)?),
            "started" => Self::Started(fields("started", payload)?),
            "result" => Self::Result(fields("result", payload)?),
            "quiet" => Self::Quiet(fields("quiet", payload)?),
            "segment_fd" => Self::SegmentFd(fields("segment_fd", payload)?),
            "released" => Self::Released(fields("released", payload)?),
            "mapped" => Self::Mapped(fields("mapped", payload)?),
            "unmapped" => Self::Unmapped(fields("unmapped", payload)?),
            "gpu_quiet" => Self::GpuQuiet(fields("gpu_quiet", payload)?),
            "dump" => Self::Dump(fields("dump", payload)?),
            "store_put" => Self::StorePut(fields("store_put", payload)?),
            "store_fd" => Self::StoreFd(fields("store_fd", payload)?),
            "store_get" => Self::StoreGet(fields("store_get", payload)?),
            "store_written" => Self::StoreWritten(fields("store_written", payload)?),
            "store_release" => Self::StoreRelease(fields("store_release", payload)?),
            "memory" => Self::Memory(fields("memory", payload)?),
            "settled" => Self::Settled(fields("settled", payload)?),
            _ => return Err(ProtocolError::UnknownType(kind, Self::TYPES)),
        })
    }

    /// Its `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Hello(_) => "hello",
            Self::Warmed(_) => "warmed",
            Self::Ready(_) => "ready",
            Self::Started(_) => "started",
            Self::Result(_) => "result",
            Self::Quiet(_) => "quiet",
            Self::SegmentFd(_) => "segment_fd",
            Self::Released(_) => "released",
            Self::Mapped(_) => "mapped",
            Self::Unmapped(_) => "unmapped",
            Self::GpuQuiet(_) => "gpu_quiet",
            Self::Dump(_) => "dump",
            Self::StorePut(_) => "store_put",
            Self::StoreFd(_) => "store_fd",
            Self::StoreGet(_) => "store_get",
            Self::StoreWritten(_) => "store_written",
            Self::StoreRelease(_) => "store_release",
            Self::Memory(_) => "memory",
            Self::Settled(_) => "settled",
        }
    }
}

impl ToWorker {
    /// The frame types torpord sends.
    pub const TYPES: &'static str =
        "load, invoke, attached, quiesce, resume, release, map, unmap, data_fd, gpu_data, shutdown, release_memory, release_gpu, store_stored, store_value, store_memory, store_unmap";

    /// A frame's payload, parsed as [`FromWorker::parse`] does (for tests and tools).
    pub fn parse(payload: &[u8]) -> Result<Self, ProtocolError> {
        let kind = type_of(payload)?;
        Ok(match kind.as_str() {
            "load" => Self::Load(fields("load", payload)?),
            "invoke" => Self::Invoke(fields("invoke", payload)?),
            "attached" => Self::Attached(fields("attached", payload)?),
            "quiesce" => Self::Quiesce(fields("quiesce", payload)?),
            "resume" => Self::Resume(Empty {}),
            "release" => Self::Release(Empty {}),
            "map" => Self::Map(fields("map", payload)?),
            "unmap" => Self::Unmap(fields("unmap", payload)?),
            "data_fd" => Self::DataFd(fields("data_fd", payload)?),
            "gpu_data" => Self::GpuData(fields("gpu_data", payload)?),
            "shutdown" => Self::Shutdown(Empty {}),
            "release_memory" => Self::ReleaseMemory(Empty {}),
            "release_gpu" => Self::ReleaseGpu(Empty {}),
            "store_stored" => Self::StoreStored(fields("store_stored", payload)?),
            "store_value" => Self::StoreValue(fields("store_value", payload)?),
            "store_memory" => Self::StoreMemory(fields("store_memory", payload)?),
            "store_unmap" => Self::StoreUnmap(fields("store_unmap", payload)?),
            _ => return Err(ProtocolError::UnknownType(kind, Self::TYPES)),
        })
    }
}

/// The JSON schema of both directions: `{"to_worker": ..., "from_worker": ..., "protocol": N}`.
pub fn schema() -> Value {
    let to = schemars::schema_for!(ToWorker);
    let from = schemars::schema_for!(FromWorker);
    serde_json::json!({
        "$comment": "Generated from crates/torpord/src/protocol.rs by its tests \
                     (TORPOR_WRITE_SCHEMA=1 cargo test -p torpord protocol::); do not edit.",
        "protocol": PROTOCOL,
        "to_worker": to,
        "from_worker": from,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_keeps_its_value_as_sent_and_unknown_types_are_refused() {
        let payload = br#"{"type":"result","id":7,"ok":true,"value":1.0000000000000002e-300,"handler_s":0.5}"#;
        match FromWorker::parse(payload).unwrap() {
            FromWorker::Result(r) => {
                assert_eq!(r.id, 7);
                assert_eq!(r.value.unwrap().get(), "1.0000000000000002e-300");
            }
            other => panic!("{other:?}"),
        }
        let e = FromWorker::parse(br#"{"type":"hullo"}"#).unwrap_err();
        assert!(
            e.to_string().contains("unknown frame type \"hullo\""),
            "{e}"
        );
        let e = FromWorker::parse(br#"{"id":1}"#).unwrap_err();
        assert!(matches!(e, ProtocolError::NoType(_)), "{e}");
        let e = FromWorker::parse(br#"{"type":"started","id":"x"}"#).unwrap_err();
        assert!(
            e.to_string().starts_with("a malformed started frame"),
            "{e}"
        );
        let e = ToWorker::parse(br#"{"type":"result"}"#).unwrap_err();
        assert!(matches!(e, ProtocolError::UnknownType(..)), "{e}");
    }

    #[test]
    fn sent_frames_parse_back_as_themselves() {
        let frames = [
            ToWorker::Attached(Attached { reattach_s: 30.0 }),
            ToWorker::Quiesce(Quiesce {
                split: Some(true),
                released: None,
            }),
            ToWorker::Unmap(Unmap { vas: vec![4096] }),
            ToWorker::Release(Empty {}),
            ToWorker::Invoke(Invoke {
                id: 3,
                request: RawValue::from_string("[1e400, 18446744073709551616]".into()).unwrap(),
                timeout_s: 1.5,
                function: None,
                key: None,
                fingerprint: None,
            }),
            ToWorker::Invoke(Invoke {
                id: 4,
                request: RawValue::from_string("{}".into()).unwrap(),
                timeout_s: 1.5,
                function: Some("detect".into()),
                key: Some("order-17".into()),
                fingerprint: Some("ab".repeat(32)),
            }),
        ];
        for f in frames {
            let bytes = serde_json::to_vec(&f).unwrap();
            let back = ToWorker::parse(&bytes).unwrap();
            assert_eq!(serde_json::to_vec(&back).unwrap(), bytes);
        }
    }

    #[test]
    fn hello_defaults_to_protocol_1_and_names_its_role() {
        let h = match FromWorker::parse(
            br#"{"type":"hello","pid":1,"role":"base","function":null,"resumed":false}"#,
        )
        .unwrap()
        {
            FromWorker::Hello(h) => h,
            other => panic!("{other:?}"),
        };
        assert_eq!((h.protocol, h.reattach, h.role), (1, false, Role::Base));
    }

    #[test]
    fn warmed_names_both_times() {
        match FromWorker::parse(br#"{"type":"warmed","preload_s":1.5,"warmup_s":0.25}"#).unwrap() {
            FromWorker::Warmed(w) => assert_eq!((w.preload_s, w.warmup_s), (1.5, 0.25)),
            other => panic!("{other:?}"),
        }
        let e = FromWorker::parse(br#"{"type":"warmed","preload_s":1.5}"#).unwrap_err();
        assert!(e.to_string().starts_with("a malformed warmed frame"), "{e}");
    }

    /// The schema file the Python side checks against is the one these types make.
    #[test]
    fn schema_file_is_current() {
        crate::schema_file::assert_current("protocol.schema.json", &schema(), "protocol");
    }
}
