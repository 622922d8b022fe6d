//! Prometheus metrics of the daemon, served as text at `GET /metrics`.
//!
//! Everything is registered at startup so the names are stable; the invoke, deploy and
//! keep-alive code feeds the counters and histograms through the public fields. Gauges that
//! mirror the registry (instances per stage) are refreshed from it at each scrape, and every
//! registered function gets its per-function series at zero, so a function that has not been
//! invoked yet shows `0` rather than nothing.

use std::collections::BTreeSet;
use std::sync::Mutex;

use prometheus::{
    CounterVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

use crate::registry::{Stage, StageCounts};

/// Values of the `outcome` label of [`Metrics::invocations`].
pub mod outcome {
    /// The handler returned a value.
    pub const OK: &str = "ok";
    /// The handler raised; the instance lives on.
    pub const ERROR: &str = "error";
    /// The worker crashed, timed out or misbehaved.
    pub const FAILED: &str = "failed";
    /// Over capacity: 429, or 503 after waiting in the queue.
    pub const REJECTED: &str = "rejected";
    /// Every value.
    pub const ALL: &[&str] = &[OK, ERROR, FAILED, REJECTED];
}

/// Values of the `kind` label of [`Metrics::starts`] (the `X-Torpor-Start` header).
pub mod start {
    /// Routed to an idle warm instance.
    pub const WARM: &str = "warm";
    /// An instance restored from a snapshot.
    pub const RESTORED: &str = "restored";
    /// An instance booted from scratch.
    pub const BOOTED: &str = "booted";
    /// A standby instance, restored ahead of time (crate::runtime::start::standby), resumed for the request.
    pub const STANDBY: &str = "standby";
    /// A function loaded into a ready sandbox of the live-context pool (crate::runtime::start::pooled).
    pub const POOLED: &str = "pooled";
    /// Every value.
    pub const ALL: &[&str] = &[WARM, RESTORED, BOOTED, STANDBY, POOLED];
}

/// The `stage` label of an instance from the moment its boot or restore begins until it is live
/// (or its start failed), in the accounting series.
pub const STARTING: &str = "starting";
/// The `stage` label of an instance while it is quiesced and snapshotted for hibernation.
pub const HIBERNATING: &str = "hibernating";

/// Every value of the `stage` label of [`Metrics::stage_seconds`] and
/// [`Metrics::gpu_memory_byte_seconds`]: starting, each keep-alive stage, hibernating.
pub fn accounted_stages() -> impl Iterator<Item = &'static str> {
    std::iter::once(STARTING)
        .chain(Stage::ALL.iter().map(|s| s.as_str()))
        .chain(std::iter::once(HIBERNATING))
}

/// The outcomes of `torpor_dumps_total`.
pub const DUMP_OUTCOMES: &[&str] = &["written", "failed", "refused"];

/// The invoke phases whose series exist from the start for every function; other phases
/// (deploy's, for instance) appear when first observed.
pub const INVOKE_PHASES: &[&str] = &["queue", "start", "handler", "total"];

/// Bucket bounds of the latency histograms, in seconds: 100 µs to 2 min.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Every metric of the daemon.
pub struct Metrics {
    registry: prometheus::Registry,
    /// `torpor_invocations_total{function, outcome}`.
    pub invocations: IntCounterVec,
    /// `torpor_starts_total{function, kind}`: how each invoke got its instance.
    pub starts: IntCounterVec,
    /// `torpor_restore_fallbacks_total{function}`: instances booted because restoring the
    /// function snapshot failed (or restores were paused after failing).
    pub restore_fallbacks: IntCounterVec,
    /// `torpor_hibernations_refused_total{function}`: hibernations not started because the
    /// snapshot would not fit (torpor_snapshot::space); the instance stayed warm.
    pub hibernations_refused: IntCounterVec,
    /// `torpor_dumps_total{function, outcome}`: `torpor.dump` writes to the object store,
    /// `written`, `failed` (crate::s3data; the cause is in the log) or `refused` (the worker
    /// named a function outside its sandbox).
    pub dumps: IntCounterVec,
    /// `torpor_phase_duration_seconds{function, phase}`; fed by [`Metrics::observe_phase`].
    phase_seconds: HistogramVec,
    /// `torpor_instances{stage}`, from the registry.
    pub instances: IntGaugeVec,
    /// `torpor_gpu_memory_bytes`: GPU memory held by instances on this node.
    pub gpu_memory_bytes: IntGauge,
    /// `torpor_queue_length{function}`: requests waiting for an instance.
    pub queue_length: IntGaugeVec,
    /// `torpor_standby_instances{function}`: unused standby instances (crate::runtime::start::standby).
    pub standby_instances: IntGaugeVec,
    /// `torpor_standby_gpu_memory_bytes{function}`, `torpor_standby_host_memory_bytes{function}`:
    /// what the unused standbys hold (GPU: NVML, or the spec's estimate for a live one).
    pub standby_gpu_memory_bytes: IntGaugeVec,
    pub standby_host_memory_bytes: IntGaugeVec,
    /// `torpor_node_transparent_hugepage{enabled}`: 1 for the node's THP mode at start
    /// (crate::hugepages).
    pub node_transparent_hugepage: IntGaugeVec,
    /// `torpor_instance_stage_seconds_total{function, stage}`: time instances spent per stage
    /// ([`accounted_stages`]).
    pub stage_seconds: CounterVec,
    /// `torpor_gpu_memory_byte_seconds_total{function, stage}`: GPU memory held over time, per
    /// stage ([`accounted_stages`]); the sum over stages is the function's total.
    pub gpu_memory_byte_seconds: CounterVec,
    /// `torpor_sandbox_memory_bytes{sandbox, function, kind}`: each function's memory in each
    /// sandbox (crate::runtime::memory): `resident` (after setup), `pool` (its request pool, as
    /// the worker reported it), `reserved` (the memory model's peaks of its requests running).
    pub sandbox_memory_bytes: IntGaugeVec,
    /// `torpor_sandbox_memory_waits_total{function}`: requests that found no sandbox with room
    /// for their function's peak and waited.
    pub sandbox_memory_waits: IntCounterVec,
    /// `torpor_sandbox_pool_ready{tenant}`: ready sandboxes of the live-context pool.
    pub sandbox_pool_ready: IntGaugeVec,
    /// `torpor_sandbox_pool_replaced_total{tenant}`: ready sandboxes found dead and replaced.
    pub sandbox_pool_replaced: IntCounterVec,
    /// `torpor_device_instances{device}`, `torpor_device_segment_bytes{device}`: live instances
    /// on each GPU (a host-backend device for CPU functions) and the segment bytes they map
    /// there; a live migration moves an instance's count and bytes (crate::runtime::migrate).
    pub device_instances: IntGaugeVec,
    pub device_segment_bytes: IntGaugeVec,
    /// `torpor_store_gpu_bytes{device}`: GPU memory the communication store's GPU values (and
    /// GPU puts in progress) take on each GPU (crate::runtime::store_gpu).
    pub store_gpu_bytes: IntGaugeVec,
    /// `torpor_store_gpu_spare_bytes{device}`: GPU memory the store made ahead for the next put
    /// of the last put's size on each GPU (crate::runtime::store, `Spare`).
    pub store_gpu_spare_bytes: IntGaugeVec,
    /// `torpor_store_spilled_bytes`: host memory of the store's GPU values moved there.
    pub store_spilled_bytes: IntGauge,
    /// `torpor_store_spills_total`: GPU values the store moved to host memory under pressure.
    pub store_spills: IntCounter,
    /// Devices whose placement series exist (set to 0 when they empty).
    devices: Mutex<BTreeSet<u32>>,
    /// Functions whose series exist, to drop them when the function goes.
    functions: Mutex<BTreeSet<String>>,
    /// Every phase name seen, to drop a function's phase series.
    phases: Mutex<BTreeSet<String>>,
}

impl Metrics {
    /// Registers a collector of another module (the restore server's).
    pub fn register(
        &self,
        c: Box<dyn prometheus::core::Collector>,
    ) -> Result<(), prometheus::Error> {
        self.registry.register(c)
    }

    /// Creates and registers every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = prometheus::Registry::new();
        let invocations = IntCounterVec::new(
            Opts::new(
                "torpor_invocations_total",
                "Invocations, by function and outcome.",
            ),
            &["function", "outcome"],
        )?;
        let starts = IntCounterVec::new(
            Opts::new(
                "torpor_starts_total",
                "How invocations got their instance: warm, restored, booted, standby or pooled.",
            ),
            &["function", "kind"],
        )?;
        let restore_fallbacks = IntCounterVec::new(
            Opts::new(
                "torpor_restore_fallbacks_total",
                "Instances booted because restoring the function snapshot failed.",
            ),
            &["function"],
        )?;
        let hibernations_refused = IntCounterVec::new(
            Opts::new(
                "torpor_hibernations_refused_total",
                "Hibernations refused before they began because the snapshot would not fit; the instance stayed warm.",
            ),
            &["function"],
        )?;
        let dumps = IntCounterVec::new(
            Opts::new(
                "torpor_dumps_total",
                "torpor.dump writes to the object store, by function and outcome (written, failed).",
            ),
            &["function", "outcome"],
        )?;
        let phase_seconds = HistogramVec::new(
            HistogramOpts::new(
                "torpor_phase_duration_seconds",
                "Latency of each phase of invocations and deploys.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["function", "phase"],
        )?;
        let instances = IntGaugeVec::new(
            Opts::new("torpor_instances", "Instances in each keep-alive stage."),
            &["stage"],
        )?;
        let gpu_memory_bytes = IntGauge::new(
            "torpor_gpu_memory_bytes",
            "GPU memory held by instances on this node.",
        )?;
        let queue_length = IntGaugeVec::new(
            Opts::new(
                "torpor_queue_length",
                "Requests waiting for an instance, by function.",
            ),
            &["function"],
        )?;
        let standby_instances = IntGaugeVec::new(
            Opts::new(
                "torpor_standby_instances",
                "Standby instances restored ahead of requests and not used yet, by function.",
            ),
            &["function"],
        )?;
        let standby_gpu_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_standby_gpu_memory_bytes",
                "GPU memory the unused standby instances hold, by function (0 for standby_gpu = released).",
            ),
            &["function"],
        )?;
        let standby_host_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_standby_host_memory_bytes",
                "Resident host memory of the unused standby instances' workers, by function.",
            ),
            &["function"],
        )?;
        let node_transparent_hugepage = IntGaugeVec::new(
            Opts::new(
                "torpor_node_transparent_hugepage",
                "The node's transparent-huge-page mode when the daemon started (always, madvise or never): \
                 restores fill memory with huge pages only with always.",
            ),
            &["enabled"],
        )?;
        let stage_seconds = CounterVec::new(
            Opts::new(
                "torpor_instance_stage_seconds_total",
                "Time instances spent starting, in each keep-alive stage, and hibernating.",
            ),
            &["function", "stage"],
        )?;
        let gpu_memory_byte_seconds = CounterVec::new(
            Opts::new(
                "torpor_gpu_memory_byte_seconds_total",
                "GPU memory held by instances, integrated over time, by stage (sum them for the total).",
            ),
            &["function", "stage"],
        )?;
        let device_instances = IntGaugeVec::new(
            Opts::new(
                "torpor_device_instances",
                "Live instances on each device (the daemon's GPU ordinal; a host-backend device for CPU functions).",
            ),
            &["device"],
        )?;
        let device_segment_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_device_segment_bytes",
                "Bytes of segments the live instances on each device map from the daemon.",
            ),
            &["device"],
        )?;
        registry.register(Box::new(device_instances.clone()))?;
        registry.register(Box::new(device_segment_bytes.clone()))?;
        registry.register(Box::new(invocations.clone()))?;
        registry.register(Box::new(starts.clone()))?;
        registry.register(Box::new(restore_fallbacks.clone()))?;
        registry.register(Box::new(hibernations_refused.clone()))?;
        registry.register(Box::new(dumps.clone()))?;
        registry.register(Box::new(phase_seconds.clone()))?;
        registry.register(Box::new(instances.clone()))?;
        registry.register(Box::new(gpu_memory_bytes.clone()))?;
        registry.register(Box::new(queue_length.clone()))?;
        registry.register(Box::new(standby_instances.clone()))?;
        registry.register(Box::new(node_transparent_hugepage.clone()))?;
        registry.register(Box::new(standby_gpu_memory_bytes.clone()))?;
        registry.register(Box::new(standby_host_memory_bytes.clone()))?;
        if let Some(mode) =
            crate::hugepages::node_mode(std::path::Path::new(crate::hugepages::SYSFS_ENABLED))
        {
            node_transparent_hugepage.with_label_values(&[&mode]).set(1);
        }
        registry.register(Box::new(stage_seconds.clone()))?;
        let sandbox_memory_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_sandbox_memory_bytes",
                "Memory of each function in each sandbox, by kind: resident (after setup), pool (its request pool now), reserved (its running requests' modelled peaks).",
            ),
            &["sandbox", "function", "kind"],
        )?;
        let sandbox_memory_waits = IntCounterVec::new(
            Opts::new(
                "torpor_sandbox_memory_waits_total",
                "Requests that found no sandbox with room for their function's memory peak and waited, by function.",
            ),
            &["function"],
        )?;
        registry.register(Box::new(sandbox_memory_bytes.clone()))?;
        registry.register(Box::new(sandbox_memory_waits.clone()))?;
        let sandbox_pool_ready = IntGaugeVec::new(
            Opts::new(
                "torpor_sandbox_pool_ready",
                "Ready sandboxes of the live-context pool (launched, preloaded, waiting for a function), by tenant.",
            ),
            &["tenant"],
        )?;
        let sandbox_pool_replaced = IntCounterVec::new(
            Opts::new(
                "torpor_sandbox_pool_replaced_total",
                "Ready sandboxes of the live-context pool found dead and replaced, by tenant.",
            ),
            &["tenant"],
        )?;
        registry.register(Box::new(sandbox_pool_ready.clone()))?;
        registry.register(Box::new(sandbox_pool_replaced.clone()))?;
        let store_gpu_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_store_gpu_bytes",
                "GPU memory the communication store's GPU values take, by device.",
            ),
            &["device"],
        )?;
        let store_gpu_spare_bytes = IntGaugeVec::new(
            Opts::new(
                "torpor_store_gpu_spare_bytes",
                "GPU memory the communication store made ahead for the next put, by device.",
            ),
            &["device"],
        )?;
        let store_spilled_bytes = IntGauge::new(
            "torpor_store_spilled_bytes",
            "Host memory of the communication store's GPU values moved there under pressure.",
        )?;
        let store_spills = IntCounter::new(
            "torpor_store_spills_total",
            "GPU values the communication store moved to host memory under pressure.",
        )?;
        registry.register(Box::new(store_gpu_bytes.clone()))?;
        registry.register(Box::new(store_gpu_spare_bytes.clone()))?;
        registry.register(Box::new(store_spilled_bytes.clone()))?;
        registry.register(Box::new(store_spills.clone()))?;
        registry.register(Box::new(gpu_memory_byte_seconds.clone()))?;
        for stage in Stage::ALL {
            instances.with_label_values(&[stage.as_str()]).set(0);
        }
        Ok(Self {
            registry,
            invocations,
            starts,
            restore_fallbacks,
            hibernations_refused,
            dumps,
            phase_seconds,
            instances,
            gpu_memory_bytes,
            queue_length,
            standby_instances,
            node_transparent_hugepage,
            standby_gpu_memory_bytes,
            standby_host_memory_bytes,
            stage_seconds,
            gpu_memory_byte_seconds,
            sandbox_memory_bytes,
            sandbox_memory_waits,
            sandbox_pool_ready,
            sandbox_pool_replaced,
            device_instances,
            device_segment_bytes,
            store_gpu_bytes,
            store_gpu_spare_bytes,
            store_spilled_bytes,
            store_spills,
            devices: Mutex::new(BTreeSet::new()),
            functions: Mutex::new(BTreeSet::new()),
            phases: Mutex::new(INVOKE_PHASES.iter().map(|p| p.to_string()).collect()),
        })
    }

    /// Every device with placement series, `now` (those with instances) added.
    pub fn devices_seen(&self, now: impl Iterator<Item = u32>) -> Vec<u32> {
        let mut d = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        d.extend(now);
        d.iter().copied().collect()
    }

    /// Records that `phase` of an invoke or deploy of `function` took `seconds`.
    pub fn observe_phase(&self, function: &str, phase: &str, seconds: f64) {
        let mut phases = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        if !phases.contains(phase) {
            phases.insert(phase.to_string());
        }
        drop(phases);
        self.phase_seconds
            .with_label_values(&[function, phase])
            .observe(seconds);
    }

    /// Creates the per-function series of `function` (at zero, where new).
    fn add_function(&self, function: &str) {
        for o in outcome::ALL {
            self.invocations.with_label_values(&[function, o]);
        }
        for k in start::ALL {
            self.starts.with_label_values(&[function, k]);
        }
        self.restore_fallbacks.with_label_values(&[function]);
        self.hibernations_refused.with_label_values(&[function]);
        for o in DUMP_OUTCOMES {
            self.dumps.with_label_values(&[function, o]);
        }
        for p in INVOKE_PHASES {
            self.phase_seconds.with_label_values(&[function, p]);
        }
        self.queue_length.with_label_values(&[function]);
        self.standby_instances.with_label_values(&[function]);
        self.standby_gpu_memory_bytes.with_label_values(&[function]);
        self.standby_host_memory_bytes
            .with_label_values(&[function]);
        for s in accounted_stages() {
            self.stage_seconds.with_label_values(&[function, s]);
            self.gpu_memory_byte_seconds
                .with_label_values(&[function, s]);
        }
    }

    /// Drops every series of `function`.
    fn remove_function(&self, function: &str) {
        // Removal fails only for a series that does not exist, which is the goal anyway.
        for o in outcome::ALL {
            let _ = self.invocations.remove_label_values(&[function, o]);
        }
        for k in start::ALL {
            let _ = self.starts.remove_label_values(&[function, k]);
        }
        let _ = self.restore_fallbacks.remove_label_values(&[function]);
        let _ = self.hibernations_refused.remove_label_values(&[function]);
        for o in DUMP_OUTCOMES {
            let _ = self.dumps.remove_label_values(&[function, o]);
        }
        let _ = self.queue_length.remove_label_values(&[function]);
        let _ = self.standby_instances.remove_label_values(&[function]);
        let _ = self
            .standby_gpu_memory_bytes
            .remove_label_values(&[function]);
        let _ = self
            .standby_host_memory_bytes
            .remove_label_values(&[function]);
        for s in accounted_stages() {
            let _ = self.stage_seconds.remove_label_values(&[function, s]);
            let _ = self
                .gpu_memory_byte_seconds
                .remove_label_values(&[function, s]);
        }
        let phases = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        for p in phases.iter() {
            let _ = self
                .phase_seconds
                .remove_label_values(&[function, p.as_str()]);
        }
    }

    /// Brings the registry-derived series up to date: instances per stage, and the set of
    /// functions that have series.
    pub fn refresh(&self, stages: &StageCounts, functions: &[String]) {
        for stage in Stage::ALL {
            let n = i64::try_from(stages.get(*stage)).unwrap_or(i64::MAX);
            self.instances.with_label_values(&[stage.as_str()]).set(n);
        }
        let mut known = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        let now: BTreeSet<String> = functions.iter().cloned().collect();
        for gone in known.difference(&now) {
            self.remove_function(gone);
        }
        for name in &now {
            self.add_function(name);
        }
        *known = now;
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        prometheus::TextEncoder::new().encode_to_string(&self.registry.gather())
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics { .. }")
    }
}

/// The `Content-Type` of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_get_and_lose_their_series() {
        let m = Metrics::new().unwrap();
        let text = m.render().unwrap();
        assert!(
            text.contains("torpor_instances{stage=\"warm\"} 0"),
            "{text}"
        );
        assert!(text.contains("torpor_gpu_memory_bytes 0"), "{text}");
        assert!(!text.contains("torpor_invocations_total"), "{text}");

        let stages = StageCounts {
            hibernated: 2,
            ..StageCounts::default()
        };
        m.refresh(&stages, &["f".to_string()]);
        m.observe_phase("f", "restore", 0.01);
        let text = m.render().unwrap();
        assert!(
            text.contains("torpor_instances{stage=\"hibernated\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("torpor_invocations_total{function=\"f\",outcome=\"ok\"} 0"),
            "{text}"
        );
        assert!(text.contains("phase=\"restore\""), "{text}");
        assert!(
            text.contains("torpor_standby_instances{function=\"f\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("torpor_starts_total{function=\"f\",kind=\"standby\"} 0"),
            "{text}"
        );
        for stage in [
            "starting",
            "warm",
            "gpu_released",
            "hibernating",
            "hibernated",
            "evicted",
        ] {
            let labels = format!("{{function=\"f\",stage=\"{stage}\"}} 0");
            for name in [
                "torpor_instance_stage_seconds_total",
                "torpor_gpu_memory_byte_seconds_total",
            ] {
                assert!(
                    text.contains(&format!("{name}{labels}")),
                    "{name}{labels}\n{text}"
                );
            }
        }

        m.refresh(&StageCounts::default(), &[]);
        let text = m.render().unwrap();
        assert!(!text.contains("function=\"f\""), "{text}");
    }
}
