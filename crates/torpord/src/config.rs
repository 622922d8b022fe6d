//! The daemon's configuration: a TOML file and flags; a flag overrides the file's key.
//!
//! ```toml
//! state_dir = "/var/lib/torpor"
//! socket = "/run/torpor/torpord.sock"
//! tcp = "127.0.0.1:7070"          # off unless set; needs token_file or tenant_tokens_file
//! token_file = "/etc/torpor/token" # the admin token: every tenant's functions (mode 0600)
//! tenant_tokens_file = "/etc/torpor/tenant-tokens"  # lines `tenant = token` (mode 0600): each
//!                                 # token sees its tenant's functions only (docs/security.md)
//! log_format = "human"            # or "json"
//! log_level = "info"              # error, warn, info, debug, trace
//! cold_start = "restore"          # or "boot": no snapshots at invoke (the benchmark's baseline)
//! split = true                    # split snapshots (docs/split.md) where the worker has the hook
//! split_gpu = true                # also for GPU memory (GPU workers preload the hook); see docs/split.md
//!
//! [keepalive]                     # default idle seconds before each stage (a function's spec
//! gpu_release_s = 30              # may set its own); cumulative, so each is ≥ the one before;
//! hibernate_s = 120               # each from 0 to 31536000 (a year)
//! evict_s = 600
//!
//! [queue]                         # per function
//! length = 64                     # requests that may wait for an instance: 0 to 65536
//! timeout_s = 30                  # how long one may wait before 503: > 0, ≤ 86400
//!
//! [workers]
//! reattach_s = 60                 # how long a worker outlives a lost daemon, to be re-adopted: 0 to 86400
//! load_timeout_s = 30             # a deploy's import, setup() and warm-up (and a base's preload),
//!                                 # unless the spec sets load_timeout_s: > 0, ≤ 3600
//! memory_limit = 8589934592       # each instance's cgroup (docs/security.md), unless its spec sets
//!                                 # its own: bytes, 0 (no limit) or 32 MiB to 1 TiB: 8 GiB
//! cpu_limit = 0                   # CPU cores: 0 (no limit) or 0.01 to 1024
//! pids_limit = 4096               # processes and threads: 0 (no limit) or 16 to 65536
//! allow_unconfined = true         # false: refuse to start where cgroups cannot confine workers
//!                                 # (the packaged config's choice); true: warn and run them unlimited
//! unprivileged = true             # workers run as a user of their tenant's, not root, seeing the
//!                                 # host read-only (docs/security.md); false: as root
//! uid_base = 2000000000           # tenant N's workers (N: its number in the registry, from 0)
//! uid_count = 65536               # run as uid and gid uid_base + N; at most uid_count tenants;
//!                                 # uid_base from 1000, uid_base + uid_count - 1 ≤ 4294967294
//!
//! [http]                          # each API listener (the Unix socket, TCP) on its own
//! max_connections = 1024          # open connections: 1 to 65536; past it the oldest TCP connection
//!                                 # that has not sent the token yet is closed, else the new one
//! header_timeout_s = 10           # a request's headers must arrive within this of the connection's
//!                                 # opening or its previous answer (so also the idle timeout): > 0, ≤ 3600
//! body_timeout_s = 60             # a request's body must arrive whole within this of its headers,
//!                                 # else 408: > 0, ≤ 3600
//!
//! [restore_server]                # caches of segments for restores (LRU), in bytes, each ≤ 2^50
//! host_cache_bytes = 4294967296   # host memory (pinned on cuda): 4 GiB
//! pin_host_cache_at_start = true  # on a GPU node, pin the host cache's bytes once when torpord
//!                                 # starts (a pool its buffers come from) and open the GPUs, so
//!                                 # no pull or fill pins memory on its path; false: pinned as used
//! gpu_cache_bytes = 2147483648    # device memory: 2 GiB (memfd memory on the host backend)
//! pages = "auto"                  # "lazy": instances' memory on first touch (Torpor's page
//!                                 # server, docs/lazy-pages.md); "criu-lazy": the same with CRIU's
//!                                 # lazy-pages daemon (to compare); "copy": all before they run;
//!                                 # "auto": lazy for CPU functions, copy for GPU ones
//! stage_bytes = 8589934592        # function snapshots staged in a huge-page tmpfs: 8 GiB; 0: off
//! background_threads = 8          # threads of the page server's background copy (what lazy
//!                                 # restores' processes did not fault): 1 (serial) to 64
//! transparent_hugepage = "leave"  # or "always": set the node's THP mode to always while torpord
//!                                 # runs (restores fill memory with 2 MiB pages; docs/split.md)
//! concurrent_snapshot = true      # hibernations pre-copy segments while the instance serves and
//!                                 # stop only for what changed (docs/checkpoints.md); false: all
//!                                 # in the stop
//! hibernate_released = true       # a gpu_released instance hibernates without its GPU resumed
//!                                 # (docs/checkpoints.md); false: resumed first, as before
//! host_devices = 1                # devices of the host backend, which instances without a GPU
//!                                 # migrate between (docs/migration.md): 1 to 16
//! host_device_bytes = 0           # segment bytes each host device may hold; 0: no bound
//! gpu_restores = 2                # GPU restores in flight at once, CRIU's start to the driver's
//!                                 # end (a burst's first instance is up as if alone, the next
//!                                 # one's CRIU overlaps its driver; docs/split.md "Bursts");
//!                                 # 0: no bound; at most 64; per lane (driver_lanes)
//! driver_lanes = "node"           # what gpu_restores and the driver's one-at-a-time turn count:
//!                                 # "node", all of the node's restores together (a burst's first
//!                                 # answer sooner); "gpu", each GPU's apart (all its instances up
//!                                 # sooner; docs/split.md "Bursts")
//! placement = "spread"            # cold starts and standbys onto the node's GPU of the deploy's
//!                                 # model with the fewest instances and starts (docs/torpord.md,
//!                                 # "Several GPUs"); "first": every one onto the deploy's GPU
//! fill_segments = 4               # segment fills of a restore in flight at once: 1 to 64
//! fill_bytes = 2147483648         # bytes of segments they hold at once (host buffers): 2 GiB
//!
//! [pcie]                          # the fair PCIe scheduler of host→device copies (docs/sandboxes.md)
//! fair = true                     # false: each copy whole, one after another (the benchmark's
//!                                 # "without it" side)
//! block_bytes = 2097152           # the turn of one transfer: 2 MiB; 4 KiB to 1 GiB
//! solo_bytes = 67108864           # the turn of a transfer alone on the device: 64 MiB; from
//!                                 # block_bytes to 1 GiB
//!
//! [objstore]                      # absent: a single node. Present: deploys push to this bucket,
//!                                 # unknown functions are pulled from it (docs/objstore.md)
//! endpoint = "http://127.0.0.1:8333"  # any S3-compatible endpoint, http(s)
//! bucket = "torpor"
//! region = "us-east-1"            # default
//! credentials_file = "/etc/torpor/objstore.credentials"  # as `torpor push`'s: 0600, TOML keys
//!                                 # access_key_id, secret_access_key (relative: to this file)
//! prefix = ""                     # every key starts with it ("" or ending in '/')
//! path_style = true               # false: virtual-host addressing
//! cache_bytes = 17179869184       # chunks kept in <state>/chunks beyond what registered snapshots
//!                                 # need, least recently used dropped first: 16 GiB, ≤ 2^50
//! parallel = 8                    # requests in flight per push or pull, 1 to 256
//! early_write_back = false        # true: a pull starts each chunk's disk write as it stores
//!                                 # it; false: the page cache holds them until the background
//!                                 # syncfs after the answer (faster on the H100; docs/objstore.md)
//! hold_bytes = 4294967296         # a pull holds up to this many bytes of fetched chunk files in
//!                                 # memory and writes them into the store after it answers
//!                                 # (4 GiB; 0: all written before the answer; docs/objstore.md)
//! range_bytes = 33554432          # a pull's ranged GETs of packs, at most this long: 1 to 256 MiB
//!
//! [sandbox_pool]                  # the live-context pool (docs/sandboxes.md, "The live-context pool")
//! size = 0                        # ready sandboxes kept per tenant and base (interpreter, preloads,
//!                                 # GPU): launched, preloaded, CUDA warm, waiting for a function;
//!                                 # a sandboxed function's first start on the node loads into one
//!                                 # instead of restoring its snapshot. 0 (off) to 64
//! starts = "faster"               # which later cold starts load into one too: "faster" (when the
//!                                 # function's last start there took less time than its last
//!                                 # restore) or "first" (none: they restore)
//! remeasure_every = 16            # "faster": after this many cold starts of a function one way,
//!                                 # the next takes the other once, to measure it again; 0: never
//!
//! [store]                         # the communication store (docs/sandboxes.md)
//! gpu_bytes = 4294967296          # GPU memory its GPU values may take on each GPU (all tenants):
//!                                 # 4 GiB; past it (or when the GPU is out of memory) the oldest
//!                                 # move to host memory. 0 to 2^50
//! gpu_spare = true                # after a GPU put, make memory of its size ready for the next
//!                                 # one on that GPU (within gpu_bytes; let go after 30 s unused):
//!                                 # the next put skips the driver's allocation and export
//! ```

use std::net::SocketAddr;

/// Default of `store.gpu_bytes`: 4 GiB of each GPU.
pub const DEFAULT_STORE_GPU_BYTES: u64 = 4 << 30;

/// The most ready sandboxes `sandbox_pool.size` may ask for, per tenant and base.
const MAX_SANDBOX_POOL: i64 = 64;

/// Default of `sandbox_pool.remeasure_every`: one cold start in 16 takes the way the function's
/// figures do not favour, so a stale figure costs at most that one start in 16.
pub const DEFAULT_REMEASURE_EVERY: u32 = 16;
/// The most `sandbox_pool.remeasure_every` may be.
const MAX_REMEASURE_EVERY: i64 = 1 << 20;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::limits;
use crate::toml_table::{KeyError, Table};

/// The config file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG: &str = "/etc/torpor/torpord.toml";
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/torpor";
/// Default API socket; also where `torpor ls`/`status` look.
pub const DEFAULT_SOCKET: &str = "/run/torpor/torpord.sock";
/// Environment variable naming the API socket, for the daemon and its clients alike.
pub const SOCKET_ENV: &str = "TORPOR_SOCKET";

/// Flags of `torpor serve` (and of the `torpord` binary). Each overrides the config file.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// Config file (TOML) [default: /etc/torpor/torpord.toml if it exists]
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// State directory: registry, snapshots, functions, logs [default: /var/lib/torpor]
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// API socket, mode 0600 [default: /run/torpor/torpord.sock]
    #[arg(long, value_name = "PATH", env = SOCKET_ENV)]
    pub socket: Option<PathBuf>,
    /// Also serve the API on TCP at IP:PORT (requires --token-file)
    #[arg(long, value_name = "ADDR")]
    pub tcp: Option<SocketAddr>,
    /// File holding the admin bearer token for TCP clients: every tenant's functions (mode 0600)
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// File of `tenant = token` lines: TCP tokens that each see one tenant's functions (mode 0600)
    #[arg(long, value_name = "FILE")]
    pub tenant_tokens_file: Option<PathBuf>,
    /// Log format on stderr [default: human]
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Least severe log level shown [default: info]
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub log_level: Option<LogLevel>,
    /// How a cold start gets an instance: restore the function snapshot, or boot a fresh
    /// worker (snapshots off at invoke, for comparison) [default: restore]
    #[arg(long, value_enum, value_name = "HOW")]
    pub cold_start: Option<ColdStart>,
    /// Check the configuration (file and flags), print it resolved as JSON and exit without
    /// starting: what an edited /etc/torpor/torpord.toml would do
    #[arg(long)]
    pub check: bool,
}

/// How a cold start gets an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ColdStart {
    /// Restore the function snapshot (`X-Torpor-Start: restored`).
    #[default]
    Restore,
    /// Launch a worker, import, set up and warm up the function (`booted`); an instance idle
    /// past hibernate_s is stopped instead of hibernated.
    Boot,
}

impl ColdStart {
    fn parse(s: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(s, false).ok()
    }
}

/// `sandbox_pool.starts`: which cold starts of a sandboxed function load into a ready sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolStarts {
    /// Its first start on the node, and every later one whose function started faster there
    /// last time than its snapshot restored last time (each path measured once at least).
    #[default]
    Faster,
    /// Only its first start on the node; later ones restore the function snapshot.
    First,
}

impl PoolStarts {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "faster" => Some(Self::Faster),
            "first" => Some(Self::First),
            _ => None,
        }
    }
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One readable line per event.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
}

/// The least severe level logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    fn parse(s: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(s, false).ok()
    }
}

impl LogFormat {
    fn parse(s: &str) -> Option<Self> {
        <Self as clap::ValueEnum>::from_str(s, false).ok()
    }
}

/// Default keep-alive delays: idle time after which an instance enters each stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Keepalive {
    /// warm → gpu_released.
    #[serde(rename = "gpu_release_s", serialize_with = "secs")]
    pub gpu_release: Duration,
    /// → hibernated.
    #[serde(rename = "hibernate_s", serialize_with = "secs")]
    pub hibernate: Duration,
    /// → evicted.
    #[serde(rename = "evict_s", serialize_with = "secs")]
    pub evict: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Self {
            gpu_release: Duration::from_secs(30),
            hibernate: Duration::from_secs(120),
            evict: Duration::from_secs(600),
        }
    }
}

/// The bounded queue of requests waiting for an instance, per function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct QueueLimits {
    /// Requests that may wait; one more is answered 429.
    pub length: usize,
    /// How long a request may wait before it is answered 503.
    #[serde(rename = "timeout_s", serialize_with = "secs")]
    pub timeout: Duration,
}

impl Default for QueueLimits {
    fn default() -> Self {
        Self {
            length: 64,
            timeout: Duration::from_secs(30),
        }
    }
}

/// The restore server's caches (docs/split.md) and where restores' CPU pages come from
/// (docs/split.md, "CPU side").
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RestoreServer {
    /// Bytes of segments kept in host memory.
    pub host_cache_bytes: u64,
    /// Bytes of segments kept in device memory.
    pub gpu_cache_bytes: u64,
    /// On a GPU node with split on: the GPUs opened and `host_cache_bytes` pinned as one pool
    /// when the daemon starts (crate::split::pool); false: pinned buffer by buffer as used.
    pub pin_host_cache_at_start: bool,
    /// How an instance's memory comes back when it is restored.
    pub pages: Pages,
    /// Bytes of function snapshots staged in the daemon's tmpfs (`crate::staging`); 0: none.
    pub stage_bytes: u64,
    /// Threads of Torpor's page server's background copy, batch by batch
    /// (`torpor_criu::page_server`, docs/lazy-pages.md); 1: serial, 4 MiB at a time. 1 to 64.
    pub background_threads: u32,
    /// The node's transparent-huge-page mode while the daemon runs (`crate::hugepages`).
    pub transparent_hugepage: crate::hugepages::ThpPolicy,
    /// Hibernations of split instances pre-copy their segments while the instance still serves
    /// and stop only for what changed (`crate::split::precopy`, docs/checkpoints.md); false: the
    /// whole capture happens in the stop, as before.
    pub concurrent_snapshot: bool,
    /// A gpu_released instance hibernates as it is, its GPU not resumed (a worker of protocol
    /// 5; crate::runtime::keepalive, docs/checkpoints.md, "Hibernating a released instance");
    /// false: it is resumed first, as before session 42 (the benchmark's A/B).
    pub hibernate_released: bool,
    /// Devices of the host backend (crate::runtime::migrate): where CPU functions' segments
    /// live, and what an instance without a GPU migrates between. 1 to 16.
    pub host_devices: u32,
    /// Bytes of segments each host device may hold (0: no bound); a migration that would pass
    /// it is refused.
    pub host_device_bytes: u64,
    /// GPU restores that may be in flight at once, from CRIU's start to the end of the CUDA
    /// driver's restore (Runtime::gpu_restore_slots); 0: no bound.
    pub gpu_restores: u32,
    /// What `gpu_restores` and the driver's turn count (crate::runtime::device_choice).
    pub driver_lanes: DriverLanes,
    /// Which device a cold start or a standby restores onto (crate::runtime::device_choice).
    pub placement: Placement,
    /// Read ahead, beside the image's verification, the pages of mapped files that CRIU's
    /// restore reads one fault at a time (`torpor_snapshot::file_prefetch`); false: CRIU reads
    /// them itself, as before.
    pub prefetch_file_pages: bool,
    /// A migration's pre-copy moves read-only segments device to device where the two GPUs
    /// reach each other (`crate::split::migrate`); false: every segment through host memory,
    /// as before.
    pub peer_copy: bool,
    /// Segment fills from the chunk store (or any source) in flight at once on a restore, one
    /// thread each (`crate::split::fill::FillBounds`). 1 to 64.
    pub fill_segments: u32,
    /// Bytes of segments those fills hold at once (their host buffers); a larger segment goes
    /// alone.
    pub fill_bytes: u64,
}

/// The fair PCIe scheduler (`crate::split::pcie`, docs/sandboxes.md "Fair PCIe").
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PcieConfig {
    /// Round-robin in blocks across transfers; false: whole transfers one after another.
    pub fair: bool,
    /// Bytes one transfer copies per turn.
    pub block_bytes: usize,
    /// Bytes a transfer copies per turn while no other is on the device (pinned sources).
    pub solo_bytes: usize,
}

/// Bounds of `pcie.block_bytes`: 4 KiB (a page) to 1 GiB.
pub const PCIE_BLOCK_BYTES: (i64, i64) = (4 << 10, 1 << 30);

impl Default for PcieConfig {
    fn default() -> Self {
        Self {
            fair: true,
            block_bytes: 2 << 20,
            solo_bytes: 64 << 20,
        }
    }
}

/// `restore_server.placement`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Each cold start and standby onto the least loaded device of the deploy's model.
    #[default]
    Spread,
    /// Every cold start and standby onto the deploy's device.
    First,
}

impl Placement {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "spread" => Some(Placement::Spread),
            "first" => Some(Placement::First),
            _ => None,
        }
    }
}

/// `restore_server.driver_lanes`: what the bound on GPU restores in flight
/// (`restore_server.gpu_restores`) and the driver's one-at-a-time turn apply to.
///
/// `Node` is the default: on two H200s a burst of eight was answered sooner with one lane
/// (GPT-2-Large 0.74-0.75 s against 0.88-0.96 s, ResNet-152 0.58-0.62 against 0.65-0.70 s),
/// while a lane per GPU had all eight up sooner (2.5-3.1 against 2.9-3.0 s; 2.2-2.3 against
/// 2.6-2.7 s): two GPUs' driver restores at once each take longer than one alone
/// (`bench/results/split-bench-s51-alone2-h200x2.json`; docs/split.md, "Bursts").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DriverLanes {
    /// Each GPU's restores on their own: two GPUs restore side by side.
    Gpu,
    /// The node's restores together, whatever their GPU.
    #[default]
    Node,
}

impl DriverLanes {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "gpu" => Some(DriverLanes::Gpu),
            "node" => Some(DriverLanes::Node),
            _ => None,
        }
    }
}

/// Default of `restore_server.gpu_restores`: two, so that one restore's CRIU part overlaps
/// the other's driver restore (docs/split.md "Bursts").
pub const DEFAULT_GPU_RESTORES: u32 = 2;

/// Default of `restore_server.fill_segments`: on the H100 the store's reads came near the
/// disk's bandwidth with 4 segments of ~240 MB in flight (docs/split.md, "Fill order and
/// bounds"); 8 and 16 were faster by 7 and 10 % in one short series (session 24).
pub const DEFAULT_FILL_SEGMENTS: u32 = 4;
/// Default of `restore_server.fill_bytes`: 2 GiB of pinned buffers at a time is a small part of
/// a GPU host's memory.
pub const DEFAULT_FILL_BYTES: u64 = 2 << 30;

/// Default of `restore_server.stage_bytes`: 8 GiB (tmpfs memory is used only as snapshots are
/// staged).
pub const DEFAULT_STAGE_BYTES: u64 = 8 << 30;

impl Default for RestoreServer {
    fn default() -> Self {
        Self {
            host_cache_bytes: 4 << 30,
            gpu_cache_bytes: 2 << 30,
            pin_host_cache_at_start: true,
            pages: Pages::default(),
            stage_bytes: DEFAULT_STAGE_BYTES,
            background_threads: torpor_snapshot::restore::DEFAULT_BACKGROUND_THREADS as u32,
            transparent_hugepage: crate::hugepages::ThpPolicy::default(),
            concurrent_snapshot: true,
            hibernate_released: true,
            host_devices: 1,
            host_device_bytes: 0,
            gpu_restores: DEFAULT_GPU_RESTORES,
            driver_lanes: DriverLanes::default(),
            placement: Placement::default(),
            prefetch_file_pages: true,
            peer_copy: true,
            fill_segments: DEFAULT_FILL_SEGMENTS,
            fill_bytes: DEFAULT_FILL_BYTES,
        }
    }
}

/// How a restored instance gets its memory (`torpor_snapshot::restore::PageSource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pages {
    /// Lazy (Torpor's page server) for CPU functions; for GPU ones lazy once the deploy recorded
    /// the snapshot's hot set, copy otherwise. CPU: on this project's CPU VM a worker holding
    /// 1 GiB answered its first request after 0.28 s with Torpor's page server, 0.30 s with
    /// CRIU's daemon and 0.79 s copying (bench/results/criu-restore-pages-cpu.json). GPU: the
    /// driver's restore reads the ~0.5 GB of context it saved into the process, in ~60 000
    /// one-page runs of its image. On the H100 (3 runs each, bench/results/split-bench-pages-h100.json and
    /// split-bench-pages-noprofile-h100.json) GPT-2-Large's cold start took 0.80 s served lazily
    /// with that hot set copied first, 1.03 s lazily without one, 1.14 s copying (ResNet-152:
    /// 0.73, 0.85, 1.00 s). Without a hot set every one of those pages is a fault, and the gain
    /// is within the noise, so a GPU snapshot with no recorded profile (a hibernated instance, a
    /// deploy whose profiling restore failed) copies.
    #[default]
    Auto,
    /// Each page on first touch, the rest in the background, by Torpor's page server
    /// (`torpor_criu::page_server`, docs/lazy-pages.md): the instance runs after CRIU restored
    /// its layout only, and the hot set recorded at deploy is copied first.
    Lazy,
    /// As `Lazy`, with CRIU's own `criu lazy-pages` daemon (one page per fault; kept to compare).
    CriuLazy,
    /// Every page before the instance runs.
    Copy,
}

impl Pages {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Pages::Auto),
            "lazy" => Some(Pages::Lazy),
            "criu-lazy" => Some(Pages::CriuLazy),
            "copy" => Some(Pages::Copy),
            _ => None,
        }
    }

    /// The page source of a restore of a function that uses a GPU (`gpu`) or not, whose
    /// snapshot has a recorded hot set (`profiled`) or not.
    pub fn source(self, gpu: bool, profiled: bool) -> torpor_snapshot::restore::PageSource {
        use torpor_snapshot::restore::PageSource;
        match self {
            Pages::Auto if gpu && !profiled => PageSource::Copy,
            Pages::Auto | Pages::Lazy => PageSource::Lazy,
            Pages::CriuLazy => PageSource::CriuLazy,
            Pages::Copy => PageSource::Copy,
        }
    }

    /// Whether a deploy records the function snapshot's hot set (a lazy restore may serve it).
    pub fn records_profile(self) -> bool {
        matches!(self, Pages::Auto | Pages::Lazy)
    }
}

/// The API listeners' bounds on connections (crate::connections), each listener on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Http {
    /// Connections open at once on one listener.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers, counted from its opening or
    /// from its previous answer: an idle connection closes after this too.
    #[serde(rename = "header_timeout_s", serialize_with = "secs")]
    pub header_timeout: Duration,
    /// How long a request's body may take to arrive, counted from its headers (crate::api's
    /// body deadline): past it, 408.
    #[serde(rename = "body_timeout_s", serialize_with = "secs")]
    pub body_timeout: Duration,
}

/// The largest `http.max_connections`.
pub const MAX_CONNECTIONS: i64 = 65_536;
/// The largest `http.header_timeout_s`: an hour.
pub const MAX_HEADER_TIMEOUT_S: f64 = 3_600.0;
/// The largest `http.body_timeout_s`: an hour.
pub const MAX_BODY_TIMEOUT_S: f64 = 3_600.0;

impl Default for Http {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
        }
    }
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Config {
    /// The config file that was read, if any.
    pub file: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    /// The admin token: every tenant (crate::auth::Tokens).
    pub token_file: Option<PathBuf>,
    /// `tenant = token` lines: each token one tenant's (crate::auth::Tokens).
    pub tenant_tokens_file: Option<PathBuf>,
    pub log_format: LogFormat,
    pub log_level: LogLevel,
    pub keepalive: Keepalive,
    pub queue: QueueLimits,
    pub cold_start: ColdStart,
    /// How long a worker that lost its daemon waits for the next one to re-adopt it
    /// (`workers.reattach_s`).
    #[serde(rename = "reattach_s", serialize_with = "secs")]
    pub reattach: Duration,
    /// The bound on a deploy's import, setup() and warm-up when the spec sets none
    /// (`workers.load_timeout_s`).
    pub load_timeout: Duration,
    /// Each instance's cgroup limits unless its spec sets its own (`workers.memory_limit`,
    /// `cpu_limit`, `pids_limit`).
    pub worker_limits: WorkerLimits,
    /// Start even where no cgroup file system can confine workers (`workers.allow_unconfined`).
    /// On by default: a container or a node without delegated controllers (the H100 machine:
    /// cgroup v2 with no cpu or pids controller for the daemon's cgroup) still serves, with a
    /// warning; a node whose daemon runs under systemd with `Delegate=` can turn it off.
    pub allow_unconfined: bool,
    /// Workers as an unprivileged user per tenant (`workers.unprivileged`, `uid_base`,
    /// `uid_count`; crate::users).
    pub worker_users: WorkerUsers,
    pub http: Http,
    /// Split snapshots for functions whose workers have the hook; `false`: transparent only.
    pub split: bool,
    /// The split path for GPU memory too (the hook preloaded into GPU workers); with `split`.
    /// `false`: GPU functions take the transparent path (their GPU memory goes through the
    /// driver's checkpoint).
    pub split_gpu: bool,
    pub restore_server: RestoreServer,
    /// The fair PCIe scheduler.
    pub pcie: PcieConfig,
    /// `[objstore]`: the bucket deploys push to and unknown functions are pulled from; `None`:
    /// a single node (crate::objstore).
    pub objstore: Option<Objstore>,
    /// `sandbox_pool.size`: ready sandboxes per tenant and base (crate::runtime::start::pooled).
    pub sandbox_pool: usize,
    /// `sandbox_pool.starts`: which later cold starts use the pool too.
    pub sandbox_pool_starts: PoolStarts,
    /// `sandbox_pool.remeasure_every`: under `starts = "faster"`, after this many cold starts
    /// of a function the same way the next takes the other once, so that neither way's figure
    /// is kept for ever (one taken from cold caches, say); 0: never.
    pub sandbox_pool_remeasure_every: u32,
    /// `store.gpu_bytes`: GPU memory the communication store's GPU values may take on each GPU
    /// (crate::runtime::store_gpu).
    pub store_gpu_bytes: u64,
    /// `store.gpu_spare`: memory made ahead for the next GPU put of the last one's size
    /// (crate::runtime::store, `Spare`).
    pub store_gpu_spare: bool,
}

/// `[objstore]` (docs/objstore.md, "torpord").
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Objstore {
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    /// The credentials file (`torpor push`'s format); absolute once loaded.
    pub credentials_file: PathBuf,
    pub prefix: String,
    pub path_style: bool,
    /// Bytes of chunks the local store keeps beyond those of registered snapshots.
    pub cache_bytes: u64,
    /// Requests in flight per push or pull (`parallel`, default [`objstore_parallel`]: two per core, 8 to 32).
    pub parallel: usize,
    /// A pull starts each chunk's disk write as it stores it (`early_write_back`, default
    /// false: measured slower on the H100, docs/cluster.md); false leaves them to the syncfs
    /// after the answer.
    pub early_write_back: bool,
    /// Bytes of fetched chunk files a pull holds in memory and writes into the store after it
    /// answers (`hold_bytes`, default [`DEFAULT_OBJSTORE_HOLD_BYTES`]; 0: none).
    pub hold_bytes: u64,
    /// The longest ranged GET of a pull (`range_bytes`, default
    /// [`torpor_objstore::DEFAULT_RANGE_BYTES`]).
    pub range_bytes: u64,
}

/// Default of `objstore.hold_bytes`: 4 GiB, a GPT-2-Large pull's 3.1 GB whole; a larger
/// function's first 4 GiB (docs/objstore.md, "Chunk files placed after the answer").
pub const DEFAULT_OBJSTORE_HOLD_BYTES: u64 = 4 << 30;

/// The most requests in flight `objstore.parallel` allows.
pub const MAX_OBJSTORE_PARALLEL: usize = 256;
/// Requests in flight per push or pull, unless `objstore.parallel` says otherwise: two per
/// core, 8 to 32. A pull's writers decode, hash and write what the requests fetch, as many as
/// the requests or the cores. On the H100 (16 cores) 16 requests pulled GPT-2-Large in 5.2 s
/// against 6.8 s for 8 (bench/results/cluster-pull-s19-p{8,16}-h100.json); on the H200 (16
/// cores) over a store link held to 25 Gbit/s, 32 pulled at 0.871 of the link's raw GET against
/// 0.738 for 16 in one call (cluster-pull-s46-ab-p{16,32}-h200.json), and at least as fast at
/// 10 Gbit/s and unshaped (cluster-pull-s46-links-p32-h200.json against
/// cluster-pull-s46-links-h200.json).
pub fn objstore_parallel() -> usize {
    std::thread::available_parallelism().map_or(8, |n| (2 * n.get()).clamp(8, 32))
}

/// Default of `objstore.cache_bytes`: 16 GiB.
pub const DEFAULT_OBJSTORE_CACHE_BYTES: u64 = 16 << 30;

impl Objstore {
    /// The object store client's configuration.
    pub fn remote(&self) -> torpor_objstore::RemoteConfig {
        torpor_objstore::RemoteConfig {
            endpoint: self.endpoint.clone(),
            bucket: self.bucket.clone(),
            region: self.region.clone(),
            credentials_file: self.credentials_file.clone(),
            path_style: self.path_style,
            prefix: self.prefix.clone(),
            range_bytes: self.range_bytes,
        }
    }
}

pub use crate::limits::WorkerLimits;

/// `[workers]`'s `unprivileged`, `uid_base`, `uid_count` (docs/security.md): tenant N's workers
/// (N: the tenant's number in the registry, crate::registry::Registry::tenant_number) run as
/// uid and gid `uid_base + N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WorkerUsers {
    pub unprivileged: bool,
    pub uid_base: u32,
    pub uid_count: u32,
}

/// The lowest `workers.uid_base`: below are the node's system and login users.
pub const MIN_UID_BASE: i64 = 1000;
/// The highest uid a worker may get: 4294967295 is `(uid_t) -1`, "no change" to setresuid.
pub const MAX_WORKER_UID: i64 = 4_294_967_294;
/// The most tenants `workers.uid_count` may allow.
pub const MAX_UID_COUNT: i64 = 1 << 24;

impl Default for WorkerUsers {
    fn default() -> Self {
        Self {
            unprivileged: true,
            uid_base: 2_000_000_000,
            uid_count: 65_536,
        }
    }
}

/// Default of `workers.reattach_s`.
pub const DEFAULT_REATTACH: Duration = Duration::from_secs(60);

impl Default for Config {
    fn default() -> Self {
        Self {
            file: None,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            socket: PathBuf::from(DEFAULT_SOCKET),
            tcp: None,
            token_file: None,
            tenant_tokens_file: None,
            log_format: LogFormat::default(),
            log_level: LogLevel::default(),
            keepalive: Keepalive::default(),
            queue: QueueLimits::default(),
            cold_start: ColdStart::default(),
            reattach: DEFAULT_REATTACH,
            load_timeout: limits::DEFAULT_LOAD_TIMEOUT,
            worker_limits: WorkerLimits::default(),
            allow_unconfined: true,
            worker_users: WorkerUsers::default(),
            http: Http::default(),
            split: true,
            split_gpu: true,
            restore_server: RestoreServer::default(),
            pcie: PcieConfig::default(),
            objstore: None,
            sandbox_pool: 0,
            sandbox_pool_starts: PoolStarts::default(),
            sandbox_pool_remeasure_every: DEFAULT_REMEASURE_EVERY,
            store_gpu_bytes: DEFAULT_STORE_GPU_BYTES,
            store_gpu_spare: true,
        }
    }
}

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The config file is not valid TOML.
    #[error("{path}: not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    /// A key has the wrong type or value, or is unknown.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The keep-alive delays are not in stage order.
    #[error(
        "keepalive delays must not decrease (gpu_release_s ≤ hibernate_s ≤ evict_s), \
         got {gpu_release}, {hibernate}, {evict}"
    )]
    KeepaliveOrder {
        gpu_release: f64,
        hibernate: f64,
        evict: f64,
    },
    /// A relative path cannot be made absolute (no working directory).
    #[error("cannot make {path} absolute: {source}")]
    Path {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `workers.uid_base + uid_count` goes past the highest uid.
    #[error(
        "torpord.toml: workers.uid_base + workers.uid_count - 1 must be ≤ {MAX_WORKER_UID} \
         (the highest uid), got {base} + {count} - 1: lower uid_base or uid_count"
    )]
    UidRange { base: u32, count: u32 },
    /// TCP was asked for without a token.
    #[error("--tcp needs a token: pass --token-file (the admin token) or --tenant-tokens-file")]
    TcpWithoutToken,
    /// A token file was given, but there is no TCP listener for it to guard.
    #[error(
        "--token-file and --tenant-tokens-file are only used with --tcp (the Unix socket is \
         guarded by its file mode): pass --tcp ADDR or drop the token files"
    )]
    TokenWithoutTcp,
}

impl Config {
    /// Reads the config file (`--config`, else [`DEFAULT_CONFIG`] if it exists) and applies the flags.
    pub fn load(args: &ServeArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => Some(path.clone()),
            None => Some(PathBuf::from(DEFAULT_CONFIG)).filter(|p| p.exists()),
        };
        let mut config = match &file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                Self::from_toml(path, &text)?
            }
            None => Self::default(),
        };
        config.file = file;
        config.apply(args);
        config.make_absolute()?;
        config.validate()?;
        Ok(config)
    }

    /// Makes every path absolute (relative ones are taken from the working directory), so the
    /// registry and the status report never hold paths that depend on where torpord started.
    fn make_absolute(&mut self) -> Result<(), ConfigError> {
        let abs = |p: &mut PathBuf| -> Result<(), ConfigError> {
            if p.is_relative() {
                *p = std::path::absolute(&*p).map_err(|source| ConfigError::Path {
                    path: p.clone(),
                    source,
                })?;
            }
            Ok(())
        };
        abs(&mut self.state_dir)?;
        abs(&mut self.socket)?;
        if let Some(p) = &mut self.token_file {
            abs(p)?;
        }
        if let Some(p) = &mut self.tenant_tokens_file {
            abs(p)?;
        }
        if let Some(p) = &mut self.file {
            abs(p)?;
        }
        if let Some(o) = &mut self.objstore {
            abs(&mut o.credentials_file)?;
        }
        Ok(())
    }

    /// Parses a config file's text (`path` only names it in errors). Flags are not applied.
    pub fn from_toml(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let entries: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigError::Syntax {
                    path: path.to_path_buf(),
                    message: e.message().to_string(),
                })?;
        let mut root = Table::root(path.display().to_string(), entries);
        let mut config = Self::default();
        // Relative paths in the file are relative to the file's directory.
        let base = path.parent().unwrap_or(Path::new(""));
        if let Some(s) = root.nonempty_string("state_dir")? {
            config.state_dir = base.join(s);
        }
        if let Some(s) = root.nonempty_string("socket")? {
            config.socket = base.join(s);
        }
        config.tcp = root.parsed("tcp", "an address IP:PORT", |s| s.parse().ok())?;
        config.token_file = root.nonempty_string("token_file")?.map(|s| base.join(s));
        config.tenant_tokens_file = root
            .nonempty_string("tenant_tokens_file")?
            .map(|s| base.join(s));
        if let Some(f) = root.parsed("log_format", "\"human\" or \"json\"", LogFormat::parse)? {
            config.log_format = f;
        }
        let levels = "one of \"error\", \"warn\", \"info\", \"debug\", \"trace\"";
        if let Some(l) = root.parsed("log_level", levels, LogLevel::parse)? {
            config.log_level = l;
        }
        if let Some(c) = root.parsed("cold_start", "\"restore\" or \"boot\"", ColdStart::parse)? {
            config.cold_start = c;
        }
        if let Some(mut t) = root.table("keepalive")? {
            let k = &mut config.keepalive;
            let max = limits::MAX_KEEPALIVE_S;
            k.gpu_release = t
                .seconds("gpu_release_s", false, max)?
                .unwrap_or(k.gpu_release);
            k.hibernate = t.seconds("hibernate_s", false, max)?.unwrap_or(k.hibernate);
            k.evict = t.seconds("evict_s", false, max)?.unwrap_or(k.evict);
            t.finish()?;
        }
        if let Some(mut t) = root.table("queue")? {
            let q = &mut config.queue;
            if let Some(n) = t.integer("length", 0, limits::MAX_QUEUE_LENGTH as i64)? {
                q.length = usize::try_from(n).unwrap_or(usize::MAX);
            }
            q.timeout = t
                .seconds("timeout_s", true, limits::MAX_WAIT_S)?
                .unwrap_or(q.timeout);
            t.finish()?;
        }
        if let Some(b) = root.boolean("split")? {
            config.split = b;
        }
        if let Some(b) = root.boolean("split_gpu")? {
            config.split_gpu = b;
        }
        if let Some(mut t) = root.table("restore_server")? {
            let r = &mut config.restore_server;
            let max = limits::MAX_BYTES as i64;
            if let Some(n) = t.integer("host_cache_bytes", 0, max)? {
                r.host_cache_bytes = u64::try_from(n).unwrap_or(0);
            }
            if let Some(n) = t.integer("gpu_cache_bytes", 0, max)? {
                r.gpu_cache_bytes = u64::try_from(n).unwrap_or(0);
            }
            if let Some(b) = t.boolean("pin_host_cache_at_start")? {
                r.pin_host_cache_at_start = b;
            }
            if let Some(p) = t.parsed(
                "pages",
                "\"auto\", \"lazy\", \"criu-lazy\" or \"copy\"",
                Pages::parse,
            )? {
                r.pages = p;
            }
            if let Some(n) = t.integer("stage_bytes", 0, max)? {
                r.stage_bytes = u64::try_from(n).unwrap_or(0);
            }
            let most = torpor_snapshot::restore::MAX_BACKGROUND_THREADS as i64;
            if let Some(n) = t.integer("background_threads", 1, most)? {
                r.background_threads = u32::try_from(n).unwrap_or(1);
            }
            if let Some(p) = t.parsed(
                "transparent_hugepage",
                "\"leave\" or \"always\"",
                crate::hugepages::ThpPolicy::parse,
            )? {
                r.transparent_hugepage = p;
            }
            if let Some(b) = t.boolean("concurrent_snapshot")? {
                r.concurrent_snapshot = b;
            }
            if let Some(b) = t.boolean("hibernate_released")? {
                r.hibernate_released = b;
            }
            if let Some(b) = t.boolean("prefetch_file_pages")? {
                r.prefetch_file_pages = b;
            }
            if let Some(b) = t.boolean("peer_copy")? {
                r.peer_copy = b;
            }
            if let Some(n) = t.integer("host_devices", 1, 16)? {
                r.host_devices = u32::try_from(n).unwrap_or(1);
            }
            if let Some(n) = t.integer("host_device_bytes", 0, max)? {
                r.host_device_bytes = u64::try_from(n).unwrap_or(0);
            }
            if let Some(n) = t.integer("gpu_restores", 0, 64)? {
                r.gpu_restores = u32::try_from(n).unwrap_or(0);
            }
            if let Some(l) = t.parsed("driver_lanes", "\"gpu\" or \"node\"", DriverLanes::parse)? {
                r.driver_lanes = l;
            }
            if let Some(p) = t.parsed("placement", "\"spread\" or \"first\"", Placement::parse)? {
                r.placement = p;
            }
            if let Some(n) = t.integer("fill_segments", 1, 64)? {
                r.fill_segments = u32::try_from(n).unwrap_or(1);
            }
            if let Some(n) = t.integer("fill_bytes", 64 << 20, max)? {
                r.fill_bytes = u64::try_from(n).unwrap_or(DEFAULT_FILL_BYTES);
            }
            t.finish()?;
        }
        if let Some(mut t) = root.table("pcie")? {
            if let Some(b) = t.boolean("fair")? {
                config.pcie.fair = b;
            }
            let (lo, hi) = PCIE_BLOCK_BYTES;
            if let Some(n) = t.integer("block_bytes", lo, hi)? {
                config.pcie.block_bytes = usize::try_from(n).unwrap_or(2 << 20);
            }
            let block = config.pcie.block_bytes as i64;
            if let Some(n) = t.integer("solo_bytes", block, hi)? {
                config.pcie.solo_bytes = usize::try_from(n).unwrap_or(64 << 20);
            } else if config.pcie.solo_bytes < config.pcie.block_bytes {
                config.pcie.solo_bytes = config.pcie.block_bytes;
            }
            t.finish()?;
        }
        if let Some(mut t) = root.table("workers")? {
            config.reattach = t
                .seconds("reattach_s", false, limits::MAX_WAIT_S)?
                .unwrap_or(config.reattach);
            config.load_timeout = t
                .seconds("load_timeout_s", true, limits::MAX_LOAD_TIMEOUT_S)?
                .unwrap_or(config.load_timeout);
            let w = &mut config.worker_limits;
            let (lo, hi) = (limits::MIN_MEMORY_LIMIT, limits::MAX_MEMORY_LIMIT);
            let words = format!("a number of bytes: 0 (no limit) or from {lo} to {hi}");
            if let Some(n) = t.integer_where("memory_limit", &words, |n| {
                n == 0 || (lo as i64..=hi as i64).contains(&n)
            })? {
                w.memory = u64::try_from(n).unwrap_or(0);
            }
            let (lo, hi) = (limits::MIN_CPU_LIMIT, limits::MAX_CPU_LIMIT);
            let words = format!("a number of CPU cores: 0 (no limit) or from {lo} to {hi}");
            if let Some(c) =
                t.number_where("cpu_limit", &words, |c| c == 0.0 || (lo..=hi).contains(&c))?
            {
                w.cpu = c;
            }
            let (lo, hi) = (limits::MIN_PIDS_LIMIT, limits::MAX_PIDS_LIMIT);
            let words = format!("an integer: 0 (no limit) or from {lo} to {hi}");
            if let Some(n) = t.integer_where("pids_limit", &words, |n| {
                n == 0 || (lo as i64..=hi as i64).contains(&n)
            })? {
                w.pids = u64::try_from(n).unwrap_or(0);
            }
            if let Some(b) = t.boolean("allow_unconfined")? {
                config.allow_unconfined = b;
            }
            let u = &mut config.worker_users;
            if let Some(b) = t.boolean("unprivileged")? {
                u.unprivileged = b;
            }
            if let Some(n) = t.integer("uid_base", MIN_UID_BASE, MAX_WORKER_UID)? {
                u.uid_base = u32::try_from(n).unwrap_or(u32::MAX);
            }
            if let Some(n) = t.integer("uid_count", 1, MAX_UID_COUNT)? {
                u.uid_count = u32::try_from(n).unwrap_or(1);
            }
            t.finish()?;
        }
        if let Some(mut t) = root.table("objstore")? {
            config.objstore = Some(objstore_section(&mut t, base)?);
            t.finish()?;
        }
        if let Some(mut t) = root.table("sandbox_pool")? {
            if let Some(n) = t.integer("size", 0, MAX_SANDBOX_POOL)? {
                config.sandbox_pool = usize::try_from(n).unwrap_or(0);
            }
            if let Some(w) = t.parsed("starts", "\"faster\" or \"first\"", PoolStarts::parse)? {
                config.sandbox_pool_starts = w;
            }
            if let Some(n) = t.integer("remeasure_every", 0, MAX_REMEASURE_EVERY)? {
                config.sandbox_pool_remeasure_every = u32::try_from(n).unwrap_or(0);
            }
            t.finish()?;
        }
        if let Some(mut t) = root.table("store")? {
            if let Some(n) = t.integer("gpu_bytes", 0, limits::MAX_BYTES as i64)? {
                config.store_gpu_bytes = u64::try_from(n).unwrap_or(0);
            }
            if let Some(b) = t.boolean("gpu_spare")? {
                config.store_gpu_spare = b;
            }
            t.finish()?;
        }
        if let Some(mut t) = root.table("http")? {
            let h = &mut config.http;
            if let Some(n) = t.integer("max_connections", 1, MAX_CONNECTIONS)? {
                h.max_connections = usize::try_from(n).unwrap_or(usize::MAX);
            }
            h.header_timeout = t
                .seconds("header_timeout_s", true, MAX_HEADER_TIMEOUT_S)?
                .unwrap_or(h.header_timeout);
            h.body_timeout = t
                .seconds("body_timeout_s", true, MAX_BODY_TIMEOUT_S)?
                .unwrap_or(h.body_timeout);
            t.finish()?;
        }
        root.finish()?;
        Ok(config)
    }

    fn apply(&mut self, args: &ServeArgs) {
        if let Some(p) = &args.state_dir {
            self.state_dir.clone_from(p);
        }
        if let Some(p) = &args.socket {
            self.socket.clone_from(p);
        }
        if let Some(a) = args.tcp {
            self.tcp = Some(a);
        }
        if let Some(p) = &args.token_file {
            self.token_file = Some(p.clone());
        }
        if let Some(p) = &args.tenant_tokens_file {
            self.tenant_tokens_file = Some(p.clone());
        }
        if let Some(f) = args.log_format {
            self.log_format = f;
        }
        if let Some(l) = args.log_level {
            self.log_level = l;
        }
        if let Some(c) = args.cold_start {
            self.cold_start = c;
        }
    }

    /// Checks what no single key can: the keep-alive order and the TCP/token pairing.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let k = &self.keepalive;
        if !(k.gpu_release <= k.hibernate && k.hibernate <= k.evict) {
            return Err(ConfigError::KeepaliveOrder {
                gpu_release: k.gpu_release.as_secs_f64(),
                hibernate: k.hibernate.as_secs_f64(),
                evict: k.evict.as_secs_f64(),
            });
        }
        let u = &self.worker_users;
        if i64::from(u.uid_base) + i64::from(u.uid_count) - 1 > MAX_WORKER_UID {
            return Err(ConfigError::UidRange {
                base: u.uid_base,
                count: u.uid_count,
            });
        }
        let tokens = self.token_file.is_some() || self.tenant_tokens_file.is_some();
        match (self.tcp.is_some(), tokens) {
            (true, false) => Err(ConfigError::TcpWithoutToken),
            (false, true) => Err(ConfigError::TokenWithoutTcp),
            _ => Ok(()),
        }
    }
}

/// Reads `[objstore]`: every key but `region`, `prefix`, `path_style`, `cache_bytes` and
/// `parallel` is
/// required; the values are checked as `torpor push` checks its configuration, and a secret in
/// the section is refused (it belongs in the credentials file).
fn objstore_section(t: &mut Table, base: &Path) -> Result<Objstore, KeyError> {
    for secret in ["access_key_id", "secret_access_key", "session_token"] {
        if t.has(secret) {
            return Err(t.invalid(
                secret,
                "must not be in the configuration: credentials go in the file named by \
                 objstore.credentials_file (mode 0600)"
                    .into(),
            ));
        }
    }
    let required = |t: &mut Table, key: &str, what: &str| -> Result<String, KeyError> {
        t.nonempty_string(key)?
            .ok_or_else(|| t.invalid(key, format!("is missing: set it to {what}")))
    };
    let endpoint = required(
        t,
        "endpoint",
        "the S3 endpoint's URL, e.g. \"http://127.0.0.1:8333\"",
    )?;
    let bucket = required(t, "bucket", "the bucket's name")?;
    let credentials = required(
        t,
        "credentials_file",
        "the path of a 0600 file with access_key_id and secret_access_key",
    )?;
    let region = t
        .nonempty_string("region")?
        .unwrap_or_else(|| "us-east-1".into());
    let prefix = t.string("prefix")?.unwrap_or_default();
    let path_style = t.boolean("path_style")?.unwrap_or(true);
    let cache_bytes = match t.integer("cache_bytes", 0, limits::MAX_BYTES as i64)? {
        Some(n) => u64::try_from(n).unwrap_or(0),
        None => DEFAULT_OBJSTORE_CACHE_BYTES,
    };
    let parallel = match t.integer("parallel", 1, MAX_OBJSTORE_PARALLEL as i64)? {
        Some(n) => usize::try_from(n).unwrap_or_else(|_| objstore_parallel()),
        None => objstore_parallel(),
    };
    // Off by default: with durability after the answer the early writes only compete with the
    // fetch (H100: fetch 4.30 s off against 5.98 s on, cluster-pull-s17-writeback-*-h100.json).
    let early_write_back = t.boolean("early_write_back")?.unwrap_or(false);
    let hold_bytes = match t.integer("hold_bytes", 0, limits::MAX_BYTES as i64)? {
        Some(n) => u64::try_from(n).unwrap_or(0),
        None => DEFAULT_OBJSTORE_HOLD_BYTES,
    };
    let range_bytes = match t.integer(
        "range_bytes",
        *torpor_objstore::RANGE_BYTES.start() as i64,
        *torpor_objstore::RANGE_BYTES.end() as i64,
    )? {
        Some(n) => u64::try_from(n).unwrap_or(torpor_objstore::DEFAULT_RANGE_BYTES),
        None => torpor_objstore::DEFAULT_RANGE_BYTES,
    };
    let o = Objstore {
        endpoint,
        bucket,
        region,
        credentials_file: base.join(credentials),
        prefix,
        path_style,
        cache_bytes,
        parallel,
        early_write_back,
        hold_bytes,
        range_bytes,
    };
    o.remote()
        .check()
        .map_err(|(key, reason)| t.invalid(key, format!("is not usable ({reason}): fix it")))?;
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml(Path::new("torpord.toml"), text)
    }

    #[test]
    fn empty_file_gives_the_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.keepalive.gpu_release, Duration::from_secs(30));
        assert_eq!(c.keepalive.hibernate, Duration::from_secs(120));
        assert_eq!(c.keepalive.evict, Duration::from_secs(600));
        assert_eq!(c.queue.length, 64);
        assert_eq!(c.queue.timeout, Duration::from_secs(30));
        assert_eq!(c.reattach, Duration::from_secs(60));
        assert_eq!(c.socket, Path::new(DEFAULT_SOCKET));
        assert_eq!(c.state_dir, Path::new(DEFAULT_STATE_DIR));
    }

    #[test]
    fn split_and_the_restore_server_caches_are_read() {
        let c = parse("").unwrap();
        assert!(c.split);
        assert!(c.split_gpu);
        assert!(!parse("split_gpu = false").unwrap().split_gpu);
        assert_eq!(c.restore_server.host_cache_bytes, 4 << 30);
        assert_eq!(c.restore_server.gpu_cache_bytes, 2 << 30);
        let c = parse(
            "split = false\n[restore_server]\nhost_cache_bytes = 1048576\ngpu_cache_bytes = 0\n",
        )
        .unwrap();
        assert!(!c.split);
        assert_eq!(c.restore_server.host_cache_bytes, 1 << 20);
        assert_eq!(c.restore_server.gpu_cache_bytes, 0);
        let err = parse("split = \"no\"").unwrap_err().to_string();
        assert!(
            err.contains("split") && err.contains("true or false"),
            "{err}"
        );
        let err = parse("[restore_server]\nhost_cache_bytes = -1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("host_cache_bytes"), "{err}");
        let err = parse("[restore_server]\nhost_cache = 1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("host_cache"), "{err}");
    }

    #[test]
    fn the_pcie_scheduler_is_read_strictly() {
        let c = parse("").unwrap();
        assert_eq!(
            c.pcie,
            PcieConfig {
                fair: true,
                block_bytes: 2 << 20,
                solo_bytes: 64 << 20,
            }
        );
        let c = parse("[pcie]\nfair = false\nblock_bytes = 65536\nsolo_bytes = 65536\n").unwrap();
        assert_eq!(
            c.pcie,
            PcieConfig {
                fair: false,
                block_bytes: 65536,
                solo_bytes: 65536,
            }
        );
        // A block larger than the default solo piece makes the solo piece that large.
        let c = parse("[pcie]\nblock_bytes = 134217728\n").unwrap();
        assert_eq!(c.pcie.solo_bytes, 128 << 20);
        for (bad, names) in [
            ("[pcie]\nfair = 1\n", "pcie.fair"),
            ("[pcie]\nblock_bytes = 1024\n", "pcie.block_bytes"),
            ("[pcie]\nblock_bytes = 2147483648\n", "pcie.block_bytes"),
            ("[pcie]\nblock = 2097152\n", "block"),
            ("[pcie]\nsolo_bytes = 1048576\n", "pcie.solo_bytes"),
        ] {
            let e = parse(bad).unwrap_err().to_string();
            assert!(e.contains(names), "{bad:?}: {e}");
        }
    }

    #[test]
    fn pages_and_the_stage_area_are_read() {
        let c = parse("").unwrap();
        assert_eq!(c.restore_server.pages, Pages::Auto);
        assert_eq!(c.restore_server.stage_bytes, 8 << 30);
        assert_eq!(c.restore_server.background_threads, 8);
        let one = parse("[restore_server]\nbackground_threads = 1\n").unwrap();
        assert_eq!(
            one.restore_server.background_threads, 1,
            "1: the serial copy"
        );
        use torpor_snapshot::restore::PageSource;
        assert_eq!(Pages::Auto.source(true, false), PageSource::Copy);
        assert_eq!(Pages::Auto.source(true, true), PageSource::Lazy);
        assert_eq!(Pages::Auto.source(false, false), PageSource::Lazy);
        assert_eq!(Pages::Lazy.source(true, false), PageSource::Lazy);
        assert_eq!(Pages::CriuLazy.source(false, true), PageSource::CriuLazy);
        assert_eq!(Pages::Copy.source(false, true), PageSource::Copy);
        assert!(Pages::Auto.records_profile() && Pages::Lazy.records_profile());
        assert!(!Pages::Copy.records_profile() && !Pages::CriuLazy.records_profile());
        let c = parse("[restore_server]\npages = \"criu-lazy\"\n").unwrap();
        assert_eq!(c.restore_server.pages, Pages::CriuLazy);
        let c = parse("[restore_server]\npages = \"copy\"\nstage_bytes = 0\n").unwrap();
        assert_eq!(c.restore_server.pages, Pages::Copy);
        assert_eq!(c.restore_server.stage_bytes, 0);
        let c = parse("[restore_server]\npages = \"lazy\"\nstage_bytes = 1048576\n").unwrap();
        assert_eq!(c.restore_server.pages, Pages::Lazy);
        assert_eq!(c.restore_server.stage_bytes, 1 << 20);
        let e = parse("[restore_server]\npages = \"eager\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "torpord.toml: restore_server.pages must be \"auto\", \"lazy\", \"criu-lazy\" or \"copy\", got \"eager\""
        );
        let e = parse("[restore_server]\nstage_bytes = -1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("restore_server.stage_bytes"), "{e}");
        let e = parse("[restore_server]\nstage_bytes = \"8G\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("restore_server.stage_bytes"), "{e}");
    }

    #[test]
    fn the_shipped_config_file_states_the_defaults() {
        // packaging/torpord.toml is what /etc/torpor/torpord.toml starts as: it must parse, and
        // change nothing until edited.
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../packaging/torpord.toml"
        ));
        let text = std::fs::read_to_string(path).unwrap();
        let c = Config::from_toml(path, &text).unwrap();
        c.validate().unwrap();
        assert_eq!(c, Config::default());
        // Every key the parser knows is in it (commented out where its default is "off").
        for key in ["tcp", "token_file", "tenant_tokens_file"] {
            assert!(text.contains(&format!("# {key} = ")), "{key}");
        }
    }

    #[test]
    fn every_key_is_read() {
        let c = parse(
            r#"
            state_dir = "/s"
            socket = "/s.sock"
            tcp = "127.0.0.1:7070"
            token_file = "/t"
            tenant_tokens_file = "tt"
            log_format = "json"
            log_level = "debug"
            [keepalive]
            gpu_release_s = 0.5
            hibernate_s = 1
            evict_s = 2
            [queue]
            length = 0
            timeout_s = 0.1
            [workers]
            reattach_s = 0
            memory_limit = 0
            cpu_limit = 1.5
            pids_limit = 64
            allow_unconfined = false
            unprivileged = false
            uid_base = 100000
            uid_count = 10
            "#,
        )
        .unwrap();
        assert_eq!(c.state_dir, Path::new("/s"));
        assert_eq!(c.socket, Path::new("/s.sock"));
        assert_eq!(c.tcp, Some("127.0.0.1:7070".parse().unwrap()));
        assert_eq!(c.token_file.as_deref(), Some(Path::new("/t")));
        assert_eq!(c.tenant_tokens_file.as_deref(), Some(Path::new("tt")));
        assert_eq!(c.log_format, LogFormat::Json);
        assert_eq!(c.log_level, LogLevel::Debug);
        assert_eq!(c.keepalive.gpu_release, Duration::from_millis(500));
        assert_eq!(c.keepalive.evict, Duration::from_secs(2));
        assert_eq!(c.queue.length, 0);
        assert_eq!(c.queue.timeout, Duration::from_millis(100));
        assert_eq!(c.reattach, Duration::ZERO);
        assert_eq!(
            c.worker_limits,
            WorkerLimits {
                memory: 0,
                cpu: 1.5,
                pids: 64
            }
        );
        assert!(!c.allow_unconfined);
        assert_eq!(
            c.worker_users,
            WorkerUsers {
                unprivileged: false,
                uid_base: 100000,
                uid_count: 10
            }
        );
        c.validate().unwrap();
    }

    #[test]
    fn the_pools_later_starts_are_faster_first_or_refused_by_name() {
        assert_eq!(parse("").unwrap().sandbox_pool_starts, PoolStarts::Faster);
        let c = parse("[sandbox_pool]\nsize = 1\nstarts = \"first\"\n").unwrap();
        assert_eq!(
            (c.sandbox_pool, c.sandbox_pool_starts),
            (1, PoolStarts::First)
        );
        let c = parse("[sandbox_pool]\nstarts = \"faster\"\n").unwrap();
        assert_eq!(c.sandbox_pool_starts, PoolStarts::Faster);
        assert_eq!(c.sandbox_pool_remeasure_every, DEFAULT_REMEASURE_EVERY);
        let c = parse("[sandbox_pool]\nremeasure_every = 0\n").unwrap();
        assert_eq!(c.sandbox_pool_remeasure_every, 0);
        let e = parse("[sandbox_pool]\nremeasure_every = -1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sandbox_pool.remeasure_every"), "{e}");
        let e = parse("[sandbox_pool]\nstarts = \"always\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "torpord.toml: sandbox_pool.starts must be \"faster\" or \"first\", got \"always\""
        );
    }

    #[test]
    fn unknown_and_mistyped_keys_are_named() {
        let e = parse("[queue]\nlenght = 3\n").unwrap_err().to_string();
        assert_eq!(e, "torpord.toml: queue.lenght is not a known key");
        let e = parse("socket = 3\n").unwrap_err().to_string();
        assert_eq!(e, "torpord.toml: socket must be a string, got 3");
        let e = parse("tcp = \"localhost\"\n").unwrap_err().to_string();
        assert_eq!(
            e,
            "torpord.toml: tcp must be an address IP:PORT, got \"localhost\""
        );
        let e = parse("[keepalive]\nevict_s = \"10m\"\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "torpord.toml: keepalive.evict_s must be a number of seconds from 0 to 31536000, got \"10m\""
        );
        let e = parse("[workers]\nreattach_s = -1\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "torpord.toml: workers.reattach_s must be a number of seconds from 0 to 86400, got -1"
        );
        let e = parse("keepalive = 3\n").unwrap_err().to_string();
        assert_eq!(e, "torpord.toml: keepalive must be a table, got 3");
        let e = parse("log_level = \"loud\"\n").unwrap_err().to_string();
        assert!(
            e.starts_with("torpord.toml: log_level must be one of"),
            "{e}"
        );
        let e = parse("x = [").unwrap_err().to_string();
        assert!(e.starts_with("torpord.toml: not valid TOML"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("torpord.toml");
        std::fs::write(&file, "socket = \"/from-file.sock\"\nstate_dir = \"/f\"\n").unwrap();
        let args = ServeArgs {
            config: Some(file.clone()),
            socket: Some(PathBuf::from("/from-flag.sock")),
            ..ServeArgs::default()
        };
        let c = Config::load(&args).unwrap();
        assert_eq!(c.file.as_deref(), Some(file.as_path()));
        assert_eq!(c.socket, Path::new("/from-flag.sock"));
        assert_eq!(c.state_dir, Path::new("/f"));
    }

    #[test]
    fn relative_paths_are_made_absolute() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("torpord.toml");
        std::fs::write(&file, "state_dir = \"state\"\n").unwrap();
        let args = ServeArgs {
            config: Some(file),
            socket: Some(PathBuf::from("rel.sock")),
            ..ServeArgs::default()
        };
        let c = Config::load(&args).unwrap();
        assert_eq!(
            c.state_dir,
            dir.path().join("state"),
            "relative to the file"
        );
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            c.socket,
            cwd.join("rel.sock"),
            "relative to the working directory"
        );
    }

    #[test]
    fn a_missing_explicit_config_file_is_an_error() {
        let args = ServeArgs {
            config: Some(PathBuf::from("/nonexistent/torpord.toml")),
            ..ServeArgs::default()
        };
        let e = Config::load(&args).unwrap_err().to_string();
        assert!(e.starts_with("cannot read config file /nonexistent/torpord.toml"));
    }

    #[test]
    fn tcp_and_token_go_together() {
        let mut c = Config {
            tcp: Some("127.0.0.1:0".parse().unwrap()),
            ..Config::default()
        };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "--tcp needs a token: pass --token-file (the admin token) or --tenant-tokens-file"
        );
        c.token_file = Some(PathBuf::from("/t"));
        c.validate().unwrap();
        c.token_file = None;
        c.tenant_tokens_file = Some(PathBuf::from("/tt"));
        c.validate().unwrap();
        c.tcp = None;
        assert!(matches!(c.validate(), Err(ConfigError::TokenWithoutTcp)));
    }

    /// Every number of the config at its limits and beyond (issue 20): (table, key, the largest
    /// value accepted, values refused, the range as the error names it).
    #[rustfmt::skip]
    const LIMITS: &[(&str, &str, &str, &[&str], &str)] = &[
        ("keepalive", "gpu_release_s", "31536000", &["31536001", "1e300", "-1", "nan", "inf"], "from 0 to 31536000"),
        ("keepalive", "hibernate_s", "31536000", &["31536000.5", "1e300", "-1"], "from 0 to 31536000"),
        ("keepalive", "evict_s", "31536000", &["31536001", "1e300", "-1"], "from 0 to 31536000"),
        ("queue", "length", "65536", &["65537", "9223372036854775807", "-1"], "from 0 to 65536"),
        ("queue", "timeout_s", "86400", &["86401", "1e308", "0", "-1"], "> 0 and ≤ 86400"),
        ("workers", "reattach_s", "86400", &["86401", "1e300", "-1"], "from 0 to 86400"),
        ("workers", "load_timeout_s", "3600", &["3601", "1e300", "0"], "> 0 and ≤ 3600"),
        ("workers", "memory_limit", "1099511627776", &["1099511627777", "33554431", "1", "-1", "\"8GiB\"", "1.5"], "0 (no limit) or from 33554432 to 1099511627776"),
        ("workers", "cpu_limit", "1024", &["1025", "0.001", "-1", "nan", "inf", "1e300", "\"2\""], "0 (no limit) or from 0.01 to 1024"),
        ("workers", "pids_limit", "65536", &["65537", "15", "-1", "9223372036854775807"], "0 (no limit) or from 16 to 65536"),
        ("workers", "uid_base", "4294967294", &["4294967295", "999", "0", "-1", "\"2000000000\""], "from 1000 to 4294967294"),
        ("workers", "uid_count", "16777216", &["16777217", "0", "-1"], "from 1 to 16777216"),
        ("sandbox_pool", "size", "64", &["65", "-1", "1.5", "\"2\""], "from 0 to 64"),
        ("store", "gpu_bytes", "1125899906842624", &["1125899906842625", "-1"], "from 0 to 1125899906842624"),
        ("http", "max_connections", "65536", &["65537", "9223372036854775807", "0"], "from 1 to 65536"),
        ("http", "header_timeout_s", "3600", &["3601", "1e300", "0"], "> 0 and ≤ 3600"),
        ("http", "body_timeout_s", "3600", &["3601", "1e300", "0"], "> 0 and ≤ 3600"),
        ("restore_server", "host_cache_bytes", "1125899906842624", &["1125899906842625", "9223372036854775807", "-1"], "from 0 to 1125899906842624"),
        ("restore_server", "gpu_cache_bytes", "1125899906842624", &["1125899906842625", "-1"], "from 0 to 1125899906842624"),
        ("restore_server", "stage_bytes", "1125899906842624", &["1125899906842625", "9223372036854775807"], "from 0 to 1125899906842624"),
        ("restore_server", "gpu_restores", "64", &["65", "-1", "1.5", "\"2\""], "from 0 to 64"),
        ("restore_server", "background_threads", "64", &["0", "65", "-1", "1.5", "\"8\""], "from 1 to 64"),
        ("restore_server", "fill_segments", "64", &["0", "65", "-1", "1.5", "\"4\""], "from 1 to 64"),
        ("restore_server", "fill_bytes", "1125899906842624", &["67108863", "0", "1125899906842625"], "from 67108864 to 1125899906842624"),
    ];

    #[test]
    fn objstore_parallel_defaults_to_twice_the_cores_from_8_to_32_and_is_bounded() {
        let base = "[objstore]\nendpoint = \"http://127.0.0.1:8333\"\nbucket = \"b\"\ncredentials_file = \"c\"\n";
        let c = parse(base).unwrap();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(c.objstore.unwrap().parallel, (2 * cores).clamp(8, 32));
        let c = parse(&format!("{base}parallel = 256\n")).unwrap();
        assert_eq!(c.objstore.unwrap().parallel, 256);
        for bad in ["0", "257", "-1", "\"8\""] {
            let e = parse(&format!("{base}parallel = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("torpord.toml: objstore.parallel must be ")
                    && e.contains("from 1 to 256"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn objstore_hold_bytes_defaults_to_4_gib_and_is_bounded() {
        let base = "[objstore]\nendpoint = \"http://127.0.0.1:8333\"\nbucket = \"b\"\ncredentials_file = \"c\"\n";
        assert_eq!(parse(base).unwrap().objstore.unwrap().hold_bytes, 4 << 30);
        let c = parse(&format!("{base}hold_bytes = 0\n")).unwrap();
        assert_eq!(c.objstore.unwrap().hold_bytes, 0);
        for bad in ["-1", "\"4G\""] {
            let e = parse(&format!("{base}hold_bytes = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("torpord.toml: objstore.hold_bytes "),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn objstore_range_bytes_defaults_to_32_mib_and_is_bounded() {
        let base = "[objstore]\nendpoint = \"http://127.0.0.1:8333\"\nbucket = \"b\"\ncredentials_file = \"c\"\n";
        let c = parse(base).unwrap().objstore.unwrap();
        assert_eq!(
            (c.range_bytes, c.remote().range_bytes),
            (32 << 20, 32 << 20)
        );
        let c = parse(&format!("{base}range_bytes = 8388608\n")).unwrap();
        assert_eq!(c.objstore.unwrap().remote().range_bytes, 8 << 20);
        for bad in ["4096", "1073741824", "\"8M\""] {
            let e = parse(&format!("{base}range_bytes = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("torpord.toml: objstore.range_bytes "),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn objstore_early_write_back_defaults_to_off_and_is_a_boolean() {
        let base = "[objstore]\nendpoint = \"http://127.0.0.1:8333\"\nbucket = \"b\"\ncredentials_file = \"c\"\n";
        assert!(!parse(base).unwrap().objstore.unwrap().early_write_back);
        let c = parse(&format!("{base}early_write_back = true\n")).unwrap();
        assert!(c.objstore.unwrap().early_write_back);
        let e = parse(&format!("{base}early_write_back = \"no\"\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("torpord.toml: objstore.early_write_back "),
            "{e}"
        );
    }

    #[test]
    fn store_gpu_spare_defaults_to_on_and_is_a_boolean() {
        assert!(parse("").unwrap().store_gpu_spare);
        assert!(
            !parse("[store]\ngpu_spare = false\n")
                .unwrap()
                .store_gpu_spare
        );
        let e = parse("[store]\ngpu_spare = 1\n").unwrap_err().to_string();
        assert!(e.starts_with("torpord.toml: store.gpu_spare "), "{e}");
    }

    #[test]
    fn every_number_is_bounded() {
        for (table, key, largest, refused, range) in LIMITS {
            let text = |v: &str| format!("[{table}]\n{key} = {v}\n");
            parse(&text(largest)).unwrap_or_else(|e| panic!("{table}.{key} = {largest}: {e}"));
            for v in *refused {
                let e = parse(&text(v)).unwrap_err().to_string();
                let want = format!("torpord.toml: {table}.{key} must be ");
                assert!(
                    e.starts_with(&want) && e.contains(range),
                    "{table}.{key} = {v}: {e}"
                );
                assert!(!e.contains('\n') && e.len() < 200, "one short line: {e}");
            }
        }
        let c = parse("[workers]\nload_timeout_s = 3600\n[http]\nmax_connections = 1\nheader_timeout_s = 0.5\n").unwrap();
        assert_eq!(c.load_timeout, Duration::from_secs(3600));
        assert_eq!(c.http.max_connections, 1);
        assert_eq!(c.http.header_timeout, Duration::from_millis(500));
        let d = Config::default();
        assert_eq!(d.load_timeout, Duration::from_secs(30));
        assert_eq!(
            (
                d.http.max_connections,
                d.http.header_timeout,
                d.http.body_timeout
            ),
            (1024, Duration::from_secs(10), Duration::from_secs(60))
        );
    }

    #[test]
    fn a_uid_range_past_the_highest_uid_is_refused_in_one_line() {
        let c = parse("[workers]\nuid_base = 4294967000\nuid_count = 1000\n").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("workers.uid_base + workers.uid_count") && !e.contains('\n'),
            "{e}"
        );
        let c = parse("[workers]\nuid_base = 4294966295\nuid_count = 1000\nunprivileged = false\n")
            .unwrap();
        assert!(c.validate().is_ok() && !c.worker_users.unprivileged);
        assert!(Config::default().worker_users.unprivileged);
    }

    #[test]
    fn keepalive_delays_must_not_decrease() {
        let e = parse("[keepalive]\ngpu_release_s = 200\n").unwrap();
        assert!(matches!(
            e.validate(),
            Err(ConfigError::KeepaliveOrder { .. })
        ));
    }
}
