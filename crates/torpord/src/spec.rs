//! The function spec as torpord reads it: the JSON that `python3 -m torpor.spec` prints for a
//! function's `torpor.toml` (python/torpor/spec.py parses and checks the TOML, with its error
//! messages; docs/torpord.md). [`FunctionSpec`] is the one definition of that JSON: deploys
//! refuse a spec it does not describe (a field it does not know included), and its JSON
//! schema, `python/torpor/spec.schema.json`, generated from it and kept current by this module's
//! tests, is what the SDK's tests check spec.py's output against (tests/sdk/test_sdk_spec_schema.py).
//! So the parser stays in one place (Python, where users' tools read the same file) and the
//! shape both sides rely on is defined once, here.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A function's spec, as validated at deploy.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionSpec {
    /// The function's directory, absolute.
    pub dir: String,
    pub name: String,
    /// Who owns the function (crate::tenant): a name like `name`, `"default"` when torpor.toml
    /// names none.
    pub tenant: String,
    /// The workflow the function belongs to; with `scaling.sandbox`, its sandbox group
    /// (crate::sandbox). Absent in specs of before.
    #[serde(default)]
    pub workflow: Option<String>,
    /// `module:Class`.
    pub entry: String,
    pub module: String,
    pub class: String,
    /// The interpreter (`python3`, or a path).
    pub python: String,
    /// Modules the base imports before the function loads.
    pub preload: Vec<String>,
    /// 0 or 1.
    pub gpus: u32,
    /// The GPU memory estimate, in bytes.
    pub gpu_memory: u64,
    pub timeout_s: f64,
    /// Import, setup() and warm-up's bound at deploy; `None`: the config's
    /// `workers.load_timeout_s` (crate::limits::load_timeout).
    pub load_timeout_s: Option<f64>,
    /// The instance's cgroup memory limit, in bytes; `None`: the config's
    /// `workers.memory_limit` (crate::limits::instance_limits).
    pub memory_limit: Option<u64>,
    /// CPU cores; `None`: `workers.cpu_limit`.
    pub cpu_limit: Option<f64>,
    /// Processes and threads; `None`: `workers.pids_limit`.
    pub pids_limit: Option<u64>,
    pub data: Vec<DataFile>,
    pub warmup: Option<Warmup>,
    pub scaling: Scaling,
    pub keepalive: KeepaliveSpec,
    pub gpu: GpuSpec,
}

/// A declared data file.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DataFile {
    pub name: String,
    /// As written in torpor.toml (relative to the function's directory).
    pub path: String,
    pub abs_path: String,
    pub size: u64,
    /// `read-only` or `writable`.
    pub access: String,
    /// `s3://BUCKET/KEY`: torpord loads the object from its object store (crate::s3data);
    /// `path` and `abs_path` are then empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// `cuda`: torpord fills GPU memory with the file while the instance starts (crate::gpudata)
    /// and the worker maps it; absent: `host`, a file the worker reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// The request sent once at deploy, before the snapshot.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Warmup {
    pub request: Value,
}

/// `[scaling]`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Scaling {
    pub max_instances: u32,
    pub requests_per_instance: u32,
    pub standby: u32,
    /// What a GPU function's standby keeps on its GPU; absent in specs of before (released).
    #[serde(default)]
    pub standby_gpu: StandbyGpu,
    /// Runs in a sandbox shared with the sandboxed functions of its tenant and workflow
    /// (crate::sandbox, docs/sandboxes.md); absent in specs of before (false).
    #[serde(default)]
    pub sandbox: bool,
    /// With `sandbox`: the memory a sandbox of the group may give its functions, in bytes
    /// (crate::runtime::memory); `None`: a GPU's memory for `gpus = 1`, else no bound. Absent
    /// in specs of before.
    #[serde(default)]
    pub sandbox_memory: Option<u64>,
    /// With `sandbox`: whether its cold starts may load it into a ready sandbox of the
    /// live-context pool, running setup() again (crate::runtime::start::pooled); `false` for a
    /// function whose setup() does not always make the same state. Absent in specs of before
    /// (true).
    #[serde(default = "yes")]
    pub pooled: bool,
}

fn yes() -> bool {
    true
}

/// `scaling.standby_gpu` (docs/split.md, "Standby instances"): the cost and the speed of a GPU
/// function's standby. `Live` is the default: on the H100 it answers in 0.031 s against 0.29 s
/// for `Released` (bench/results/split-bench-h100.json, GPT-2-Large, session 26), and a function
/// that asks for standbys asks for speed; `Released` is for nodes short of GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StandbyGpu {
    /// Its CUDA state checkpointed into host memory: no GPU memory while it waits; a request
    /// pays the driver's restore (~0.25–0.3 s on the H100) and the segments.
    Released,
    /// The driver's restore done ahead: it holds its CUDA context's GPU memory while it waits
    /// (~0.35–0.7 GB on the H100, not its segments); a request pays only the segments.
    #[default]
    Live,
}

/// `[keepalive]`: idle delays of the stages, in seconds (cumulative).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KeepaliveSpec {
    pub gpu_release_s: f64,
    pub hibernate_s: f64,
    pub evict_s: f64,
    /// Idle this long, a function's request pool gives its memory back (torpor.mempool; the
    /// harness reads it). Absent in specs of before: 2 s.
    #[serde(default = "memory_release_default")]
    pub memory_release_s: f64,
}

fn memory_release_default() -> f64 {
    2.0
}

/// `[gpu]`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    pub pack_weights: bool,
    /// The context's stack limit to 0 at the quiet point (the harness reads it; specs stored
    /// before the key have none and get the default).
    #[serde(default = "shrink_context_default")]
    pub shrink_context: bool,
}

fn shrink_context_default() -> bool {
    true
}

/// A spec that this daemon does not read as `python3 -m torpor.spec` printed it.
#[derive(Debug, thiserror::Error)]
#[error(
    "python3 -m torpor.spec printed a spec this torpord does not read ({cause}): the torpor \
     Python package and torpord are of different versions; install them together"
)]
pub struct SpecMismatch {
    pub cause: String,
}

impl FunctionSpec {
    /// The spec in `json` (spec.py's output).
    pub fn from_json(json: &Value) -> Result<Self, SpecMismatch> {
        Self::deserialize(json).map_err(|e| SpecMismatch {
            cause: e.to_string(),
        })
    }
}

/// The JSON schema of [`FunctionSpec`].
pub fn schema() -> Value {
    let mut schema =
        serde_json::to_value(schemars::schema_for!(FunctionSpec)).expect("a schema is JSON");
    schema["$comment"] = Value::from(
        "Generated from crates/torpord/src/spec.rs by its tests \
         (TORPOR_WRITE_SCHEMA=1 cargo test -p torpord spec::); do not edit.",
    );
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Value {
        serde_json::json!({
            "dir": "/f", "name": "f", "tenant": "default", "entry": "m:C", "module": "m", "class": "C",
            "python": "python3", "preload": [], "gpus": 0, "gpu_memory": 0, "timeout_s": 10,
            "data": [{"name": "w", "path": "w.bin", "abs_path": "/f/w.bin", "size": 3,
                      "access": "read-only"}],
            "warmup": null,
            "scaling": {"max_instances": 4, "requests_per_instance": 1, "standby": 0},
            "keepalive": {"gpu_release_s": 30, "hibernate_s": 120, "evict_s": 600},
            "gpu": {"pack_weights": true}
        })
    }

    #[test]
    fn a_spec_reads_and_one_with_a_field_it_does_not_know_is_refused() {
        let spec = FunctionSpec::from_json(&sample()).unwrap();
        assert_eq!((spec.name.as_str(), spec.scaling.max_instances), ("f", 4));
        let mut extra = sample();
        extra["scaling"]["burst"] = Value::from(2);
        let e = FunctionSpec::from_json(&extra).unwrap_err().to_string();
        assert!(
            e.contains("unknown field `burst`") && e.contains("install them together"),
            "{e}"
        );
        let mut missing = sample();
        missing.as_object_mut().unwrap().remove("timeout_s");
        assert!(FunctionSpec::from_json(&missing).is_err());
    }

    #[test]
    fn limits_are_optional_and_typed() {
        let spec = FunctionSpec::from_json(&sample()).unwrap();
        assert_eq!(
            (spec.memory_limit, spec.cpu_limit, spec.pids_limit),
            (None, None, None)
        );
        let mut with = sample();
        with["memory_limit"] = Value::from(64u64 << 20);
        with["cpu_limit"] = Value::from(0.5);
        with["pids_limit"] = Value::from(32);
        let spec = FunctionSpec::from_json(&with).unwrap();
        assert_eq!(spec.memory_limit, Some(64 << 20));
        with["memory_limit"] = Value::from("64MiB");
        assert!(FunctionSpec::from_json(&with).is_err());
    }

    #[test]
    fn the_tenant_is_required() {
        let spec = FunctionSpec::from_json(&sample()).unwrap();
        assert_eq!(spec.tenant, "default");
        let mut missing = sample();
        missing.as_object_mut().unwrap().remove("tenant");
        assert!(FunctionSpec::from_json(&missing).is_err());
    }

    /// The schema file the Python side checks against is the one this type makes.
    #[test]
    fn schema_file_is_current() {
        crate::schema_file::assert_current("spec.schema.json", &schema(), "spec");
    }
}
