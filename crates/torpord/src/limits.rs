//! The ranges of the numbers torpord takes from a function's spec and from its own config
//! (docs/torpord.md, "Ranges"), and conversions that cannot panic whatever the number.
//!
//! `python3 -m torpor.spec` refuses a spec outside these ranges (python/torpor/spec.py holds the
//! same figures) and [`crate::config`] a config file; the daemon still clamps every value it
//! reads from a spec's JSON, since the registry may hold specs an older daemon accepted.

use std::time::Duration;

use serde_json::Value;

/// `timeout_s`: a day.
pub const MAX_TIMEOUT_S: f64 = 86_400.0;
/// `load_timeout_s` (spec) and `workers.load_timeout_s` (config): an hour.
pub const MAX_LOAD_TIMEOUT_S: f64 = 3_600.0;
/// A function's timeout_s when its spec has none (python/torpor/spec.py's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of `workers.load_timeout_s`: import, `setup()` and warm-up of a deploy (and a base's
/// preload) that take longer are killed. Well under a minute, so that a hung import is found
/// quickly; a function with a big model sets `load_timeout_s` in its spec.
pub const DEFAULT_LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Every keep-alive delay: a year.
pub const MAX_KEEPALIVE_S: f64 = 31_536_000.0;
/// `scaling.max_instances` and `scaling.standby`.
pub const MAX_INSTANCES: u64 = 1024;
/// `scaling.requests_per_instance`.
pub const MAX_REQUESTS_PER_INSTANCE: u64 = 1024;
/// `gpu_memory`: 1 TiB.
pub const MAX_GPU_MEMORY: u64 = 1 << 40;
/// `queue.length` (config).
pub const MAX_QUEUE_LENGTH: u64 = 65_536;
/// `queue.timeout_s` and `workers.reattach_s` (config): a day.
pub const MAX_WAIT_S: f64 = 86_400.0;
/// Byte sizes of the config (caches, the stage area): 1 PiB, far from any overflow in the sums
/// and the tmpfs size computed from them.
pub const MAX_BYTES: u64 = 1 << 50;

/// `memory_limit` (spec) and `workers.memory_limit` (config, where 0 is also accepted: no
/// limit): less does not run the Python harness.
pub const MIN_MEMORY_LIMIT: u64 = 32 << 20;
/// The largest memory limit: 1 TiB.
pub const MAX_MEMORY_LIMIT: u64 = 1 << 40;
/// `cpu_limit`, in cores (config: also 0, no limit).
pub const MIN_CPU_LIMIT: f64 = 0.01;
pub const MAX_CPU_LIMIT: f64 = 1024.0;
/// `pids_limit`: processes and threads (config: also 0, no limit).
pub const MIN_PIDS_LIMIT: u64 = 16;
pub const MAX_PIDS_LIMIT: u64 = 65_536;

/// An instance's cgroup limits (crate::cgroup): the spec's `memory_limit`, `cpu_limit` and
/// `pids_limit`, each clamped to its range, else the config's `workers.*` default (0 there: no
/// limit). A GPU function's memory limit is raised by its `gpu_memory`: the driver's checkpoint
/// (a GPU release, a hibernation) moves the GPU memory into the process's host memory.
pub fn instance_limits(spec: &Value, defaults: &WorkerLimits) -> crate::cgroup::Limits {
    let memory = match spec.get("memory_limit").and_then(Value::as_f64) {
        Some(m) if !m.is_nan() => Some((m as u64).clamp(MIN_MEMORY_LIMIT, MAX_MEMORY_LIMIT)),
        _ => (defaults.memory > 0).then_some(defaults.memory),
    };
    let gpu = if spec.get("gpus").and_then(Value::as_u64).unwrap_or(0) > 0 {
        spec.get("gpu_memory")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(MAX_GPU_MEMORY)
    } else {
        0
    };
    let cpu = match spec.get("cpu_limit").and_then(Value::as_f64) {
        Some(c) if !c.is_nan() => Some(c.clamp(MIN_CPU_LIMIT, MAX_CPU_LIMIT)),
        _ => (defaults.cpu > 0.0).then_some(defaults.cpu),
    };
    let pids = match spec.get("pids_limit") {
        Some(v) if !v.is_null() => {
            Some(spec_count(Some(v), 0, MIN_PIDS_LIMIT, MAX_PIDS_LIMIT) as u64)
        }
        _ => (defaults.pids > 0).then_some(defaults.pids),
    };
    crate::cgroup::Limits {
        memory: memory.map(|m| m + gpu),
        cpu,
        pids,
    }
}

/// The default cgroup limits of an instance (`[workers]`); 0: no limit. A spec's own
/// `memory_limit`, `cpu_limit`, `pids_limit` replace them (crate::limits::instance_limits).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct WorkerLimits {
    /// Bytes.
    #[serde(rename = "memory_limit")]
    pub memory: u64,
    /// Cores.
    #[serde(rename = "cpu_limit")]
    pub cpu: f64,
    #[serde(rename = "pids_limit")]
    pub pids: u64,
}

// The CPU limit is never NaN (the parser refuses it): equality is total.
impl Eq for WorkerLimits {}

/// Default of `workers.memory_limit`: 8 GiB.
pub const DEFAULT_MEMORY_LIMIT: u64 = 8 << 30;
/// Default of `workers.pids_limit`.
pub const DEFAULT_PIDS_LIMIT: u64 = 4096;

impl Default for WorkerLimits {
    fn default() -> Self {
        Self {
            memory: DEFAULT_MEMORY_LIMIT,
            cpu: 0.0,
            pids: DEFAULT_PIDS_LIMIT,
        }
    }
}

/// Seconds as a [`Duration`], never panicking: NaN and negatives give zero, a value past
/// `Duration`'s range gives [`Duration::MAX`] (`Duration::from_secs_f64` panics on both).
pub fn secs(s: f64) -> Duration {
    match Duration::try_from_secs_f64(s) {
        Ok(d) => d,
        Err(_) if s > 0.0 => Duration::MAX,
        Err(_) => Duration::ZERO,
    }
}

/// A number of seconds from a spec's JSON, clamped to `[min, max]`; `default` when it is missing
/// or not a number.
pub fn spec_secs(value: Option<&Value>, default: Duration, min: f64, max: f64) -> Duration {
    match value.and_then(Value::as_f64) {
        Some(s) if !s.is_nan() => secs(s.clamp(min, max)),
        _ => default,
    }
}

/// A count from a spec's JSON, clamped to `[min, max]`; `default` when it is missing or not a
/// number.
pub fn spec_count(value: Option<&Value>, default: u64, min: u64, max: u64) -> usize {
    let n = match value {
        Some(v) => v.as_u64().or_else(|| v.as_i64().map(|_| 0)).or_else(|| {
            v.as_f64()
                .filter(|f| !f.is_nan())
                .map(|f| f.max(0.0) as u64)
        }),
        None => None,
    };
    let n = n.unwrap_or(default).clamp(min, max);
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The bound on a deploy's import, `setup()` and warm-up (and its base's preload): the spec's
/// `load_timeout_s`, else `default` (the config's `workers.load_timeout_s`).
pub fn load_timeout(spec: &Value, default: Duration) -> Duration {
    spec_secs(
        spec.get("load_timeout_s"),
        default,
        0.001,
        MAX_LOAD_TIMEOUT_S,
    )
}

/// The error of a worker that passed its [`load_timeout`] (it is killed).
pub fn load_timed_out(bound: Duration) -> String {
    format!(
        "the worker did not finish import, setup() and warm-up within {} s (load_timeout_s) and \
         was killed: make them faster, or raise load_timeout_s in torpor.toml (or \
         workers.load_timeout_s in torpord's config)",
        bound.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn instance_limits_come_from_the_spec_clamped_else_the_config() {
        let d = WorkerLimits {
            memory: 1 << 30,
            cpu: 0.0,
            pids: 4096,
        };
        let l = instance_limits(&json!({}), &d);
        assert_eq!((l.memory, l.cpu, l.pids), (Some(1 << 30), None, Some(4096)));
        let l = instance_limits(
            &json!({"memory_limit": 64 << 20, "cpu_limit": 0.5, "pids_limit": 32}),
            &d,
        );
        assert_eq!(
            (l.memory, l.cpu, l.pids),
            (Some(64 << 20), Some(0.5), Some(32))
        );
        let l = instance_limits(
            &json!({"memory_limit": 1e300, "cpu_limit": -1, "pids_limit": u64::MAX}),
            &d,
        );
        assert_eq!(
            (l.memory, l.cpu, l.pids),
            (
                Some(MAX_MEMORY_LIMIT),
                Some(MIN_CPU_LIMIT),
                Some(MAX_PIDS_LIMIT)
            )
        );
        let l = instance_limits(&json!({"memory_limit": 1, "pids_limit": 0}), &d);
        assert_eq!(
            (l.memory, l.pids),
            (Some(MIN_MEMORY_LIMIT), Some(MIN_PIDS_LIMIT))
        );
        // A GPU function's limit leaves room for its checkpointed GPU memory.
        let l = instance_limits(&json!({"gpus": 1, "gpu_memory": 2u64 << 30}), &d);
        assert_eq!(l.memory, Some(3 << 30));
        let none = WorkerLimits {
            memory: 0,
            cpu: 0.0,
            pids: 0,
        };
        let l = instance_limits(&json!({"memory_limit": null}), &none);
        assert_eq!(l, crate::cgroup::Limits::default());
    }

    #[test]
    fn seconds_never_panic() {
        assert_eq!(secs(1.5), Duration::from_millis(1500));
        assert_eq!(secs(1e300), Duration::MAX);
        assert_eq!(secs(f64::INFINITY), Duration::MAX);
        assert_eq!(secs(f64::NAN), Duration::ZERO);
        assert_eq!(secs(-1.0), Duration::ZERO);
        assert_eq!(secs(f64::NEG_INFINITY), Duration::ZERO);
    }

    #[test]
    fn spec_values_are_clamped_to_their_ranges() {
        let d = Duration::from_secs(30);
        let t = |v: Value| spec_secs(Some(&v), d, 0.001, MAX_TIMEOUT_S);
        assert_eq!(t(json!(1e308)), Duration::from_secs(86_400));
        assert_eq!(
            t(json!(99_999_999_999_999_999_999.0)),
            Duration::from_secs(86_400)
        );
        assert_eq!(t(json!(0)), Duration::from_millis(1));
        assert_eq!(t(json!(-5)), Duration::from_millis(1));
        assert_eq!(t(json!("30")), d);
        assert_eq!(spec_secs(None, d, 0.0, 1.0), d);
        let c = |v: Value| spec_count(Some(&v), 4, 1, MAX_INSTANCES);
        assert_eq!(c(json!(i64::MAX)), 1024);
        assert_eq!(c(json!(u64::MAX)), 1024);
        assert_eq!(c(json!(1e300)), 1024);
        assert_eq!(c(json!(-3)), 1);
        assert_eq!(c(json!(0)), 1);
        assert_eq!(c(json!(7)), 7);
        assert_eq!(c(json!(null)), 4);
        assert_eq!(spec_count(None, 0, 0, MAX_INSTANCES), 0);
        let d = DEFAULT_LOAD_TIMEOUT;
        assert_eq!(load_timeout(&json!({}), d), d);
        assert_eq!(load_timeout(&json!({"load_timeout_s": null}), d), d);
        assert_eq!(
            load_timeout(&json!({"load_timeout_s": 2.5}), d),
            Duration::from_millis(2500)
        );
        assert_eq!(
            load_timeout(&json!({"load_timeout_s": 1e300}), d),
            Duration::from_secs(3600)
        );
    }
}
