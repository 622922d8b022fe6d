//! The JSON bodies of the HTTP API, shared by the server and its clients (the `torpor` CLI).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::config::{Keepalive, QueueLimits};
use crate::registry::{Function, FunctionState, Instance, Snapshot, SnapshotCounts, StageCounts};

/// Every error response: `{"error": "…"}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: String,
}

/// The body of a 500 from `POST /v1/functions/{name}/invoke` when the function raised: the
/// exception as the worker reported it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RaisedBody {
    pub error: Raised,
}

/// An exception the function raised.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Raised {
    /// The exception's class name.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
    /// Python's formatted traceback.
    pub traceback: String,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Status {
    /// torpord's version.
    pub version: String,
    pub pid: u32,
    /// When it started, Unix ms.
    pub started: i64,
    pub uptime_s: f64,
    #[schema(value_type = String)]
    pub state_dir: PathBuf,
    #[schema(value_type = String)]
    pub socket: PathBuf,
    /// The TCP address actually bound, if TCP is on.
    #[schema(value_type = Option<String>)]
    pub tcp: Option<SocketAddr>,
    /// The config file read, if any.
    #[schema(value_type = Option<String>)]
    pub config_file: Option<PathBuf>,
    pub registry_schema: u32,
    pub functions: u64,
    pub snapshots: SnapshotCounts,
    pub instances: StageCounts,
    /// Default keep-alive delays.
    pub keepalive: KeepaliveSecs,
    /// Per-function queue limits.
    pub queue: QueueSecs,
    /// The device-memory hook (`libtorpor_hook.so`) and what this daemon does with it.
    pub hook: HookStatus,
}

/// The device-memory hook as the daemon found and uses it (docs/split.md, docs/compat.md).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HookStatus {
    /// The library workers get (`$TORPOR_HOOK_LIB`, else beside the binary, else in the
    /// installed torpor package); none when it was not found.
    #[schema(value_type = Option<String>)]
    pub library: Option<PathBuf>,
    /// The copy of it in the state directory that workers load (their mount namespace reaches
    /// the state directory, not necessarily where the library was found).
    #[schema(value_type = Option<String>)]
    pub worker_copy: Option<PathBuf>,
    /// Why it was not found, and what to do.
    pub missing: Option<String>,
    /// Split snapshots for functions deployed from now on (config `split`, and the hook found).
    pub split: bool,
    /// GPU memory on the split path too (config `split_gpu`).
    pub split_gpu: bool,
    /// How GPU workers have it preloaded: `segments` (split GPU path), `watch` (records CUDA
    /// IPC, managed memory and multi-rank NCCL so that their snapshots are refused before the
    /// driver is touched), `none` (no hook found).
    pub gpu_workers: String,
}

/// [`Keepalive`] in seconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
pub struct KeepaliveSecs {
    pub gpu_release_s: f64,
    pub hibernate_s: f64,
    pub evict_s: f64,
}

impl From<Keepalive> for KeepaliveSecs {
    fn from(k: Keepalive) -> Self {
        Self {
            gpu_release_s: k.gpu_release.as_secs_f64(),
            hibernate_s: k.hibernate.as_secs_f64(),
            evict_s: k.evict.as_secs_f64(),
        }
    }
}

/// [`QueueLimits`] in seconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema)]
pub struct QueueSecs {
    pub length: usize,
    pub timeout_s: f64,
}

impl From<QueueLimits> for QueueSecs {
    fn from(q: QueueLimits) -> Self {
        Self {
            length: q.length,
            timeout_s: q.timeout.as_secs_f64(),
        }
    }
}

/// One row of `GET /v1/functions`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionSummary {
    pub name: String,
    pub state: FunctionState,
    #[schema(value_type = String)]
    pub dir: PathBuf,
    pub base_key: String,
    pub snapshot: Option<String>,
    pub created: i64,
    pub updated: i64,
    /// Its instances, per stage.
    pub instances: StageCounts,
    /// A sandbox's member served by another function's instances (the group's host, whose
    /// snapshot holds the whole group: docs/sandboxes.md): that function's name. Its own
    /// `instances` are then none; the host's row counts the sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_host: Option<String>,
}

/// `GET /v1/functions`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionList {
    pub functions: Vec<FunctionSummary>,
}

/// `GET /v1/functions/{name}`: the function with its snapshots and instances.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionDetail {
    #[serde(flatten)]
    pub function: Function,
    pub snapshots: Vec<Snapshot>,
    pub instances: Vec<InstanceView>,
}

/// An instance as `GET /v1/functions/{name}` lists it: its registry row, and where it is.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct InstanceView {
    #[serde(flatten)]
    pub instance: Instance,
    /// The node's device it is on (a GPU function's: the daemon's CUDA ordinal, as
    /// `torpor_device_instances{device}` and `torpor migrate --gpu` name it); hibernated, the
    /// one its wake restores onto. docs/torpord.md, "Several GPUs".
    pub device: u32,
}

/// `DELETE /v1/functions/{name}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Deleted {
    pub deleted: String,
    /// Ids of the snapshots removed with it.
    pub snapshots: Vec<String>,
    /// Directories removed from disk.
    #[schema(value_type = Vec<String>)]
    pub removed: Vec<PathBuf>,
    /// Directories that could not be removed (path → reason); the registry no longer knows them.
    #[schema(value_type = BTreeMap<String, String>)]
    pub left_behind: BTreeMap<PathBuf, String>,
}

/// The body of `POST /v1/functions/{name}/stop` (optional: an empty body is the default).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    /// Leave the hibernated (and evicted) instances on disk, to be woken by later requests.
    #[serde(default)]
    pub keep_hibernated: bool,
}

/// `POST /v1/functions/{name}/stop`: the instances taken out of service.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Stopped {
    pub function: String,
    /// Idle instances, stopped now.
    pub stopped: Vec<String>,
    /// Busy instances, stopped as soon as their requests end.
    pub retiring: Vec<String>,
    /// Hibernated and evicted instances discarded (rows and snapshots).
    pub discarded: Vec<String>,
}
