//! The live-context pool (issue 11 item 3, docs/sandboxes.md, "The live-context pool"): ready
//! sandboxes per tenant and base, each a launched `--role function` worker whose interpreter
//! imported its preloads and, for a GPU base, created and warmed its CUDA context, waiting for
//! a `load` (PhOS's pool of ready contexts, seed 001, built out of the boot path's first half,
//! [`launch_function_worker`]). `sandbox_pool.size` of them are kept per key.
//!
//! - **Ready** means warm: a sandbox is launched with `--announce-warm` and counted (in
//!   `torpor_sandbox_pool_ready`, and for a take) only once its worker sent `warmed`, after
//!   its preloads' import and the CUDA warm-up, not at its hello, which comes before them (a
//!   `load` sent then waited behind torch's import: the ~4 s first pooled start of
//!   bench/results/sandbox-h100.json). One that fails there or passes the load timeout is
//!   killed and counts as a failed launch ([`RETRY`]).
//! - **The key** is the tenant and the base key (interpreter, preloads, GPU, hook, the
//!   tenant's user): a ready sandbox is only ever given to a function of its tenant, and runs
//!   as that tenant's user from its launch.
//! - **Use.** A sandboxed function's first start on this daemon ([`Runtime::pooled_start`])
//!   takes a ready one instead of restoring its function snapshot (never one still warming:
//!   with none ready it restores): its directory is bound in, `load`
//!   runs the function's setup and warm-up as at deploy, then the other members of its group
//!   load ([`load_into`], the boot path's second half), and the worker becomes its instance
//!   (start label `pooled`, timing `pooled_load`). A function whose spec sets its own cgroup
//!   limits is not given one (a ready sandbox's cgroup has the daemon's defaults).
//! - **Later cold starts** (`sandbox_pool.starts`, [`wants_pooled`]): with `"faster"` (the
//!   default) a later one loads into a ready sandbox again when the function's last start there
//!   took less time than its snapshot's last restore, measured the same way (from the decision
//!   to an instance ready), and restores otherwise; each path runs once before they are compared.
//!   After `sandbox_pool.remeasure_every` cold starts the same way (16), the next takes the
//!   other way once and its figure is replaced: a restore first timed from cold caches, or a
//!   load first timed while the node was busy, does not decide for ever. Before a way was
//!   measured, its estimate stands in: for the load, the deploy's (its worker phases); for the
//!   restore, the node's last restore of a sandboxed function of the same kind (CPU, GPU). A
//!   first start goes to the pool unless that load took over [`ESTIMATE_MARGIN`] times that
//!   restore (a setup() of seconds would otherwise be paid at the first start after each
//!   deploy).
//!   Why not always restore: a function whose weights are platform-managed GPU data has little
//!   left for setup() to do, and its load into a warm context (GPT-2-Large 0.18-0.21 s on the
//!   H200) beats the driver's context restore alone (0.28-0.31 s;
//!   bench/results/split-bench-s44-pooled-nopack-h200.json). Why not always load: a function
//!   whose setup() is slow (compiles, reads its weights itself) restores faster. With
//!   `"first"` later cold starts always restore. A start in a ready sandbox that fails is logged
//!   and restores; so do the function's later cold starts, until it is deployed again.
//! - **Refill.** Every take starts a replacement in the background; the keep-alive ticker drops
//!   ready sandboxes whose process died (counted in `torpor_sandbox_pool_replaced_total`) and
//!   refills every key to its size (after a failed launch, not sooner than [`RETRY`]). Keys come
//!   from the sandboxed functions deployed (at a deploy, and at the daemon's start).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::PoolStarts;
use crate::metrics::start;
use crate::runtime::lifecycle::{Adopted, WorkerTree};
use crate::runtime::pool::FnInfo;
use crate::runtime::start::boot::{launch_function_worker, load_into, Announce, Launched, Loaded};
use crate::runtime::start::{NewInstance, StartError, Started};
use crate::runtime::Runtime;
use crate::sync::lock;

/// After a launch for a key failed: no new one before this.
pub const RETRY: Duration = Duration::from_secs(10);

/// One ready sandbox.
struct Ready {
    launched: Launched,
    /// Its log until it serves a function (then it becomes the instance's).
    log: PathBuf,
}

/// One key's ready sandboxes, launches under way and the spec to launch with.
struct Key {
    tenant: String,
    spec: Arc<Value>,
    ready: Vec<Ready>,
    launching: usize,
    failed_at: Option<Instant>,
}

/// The runtime's live-context pool.
#[derive(Default)]
pub struct SandboxPool {
    keys: Mutex<HashMap<String, Key>>,
    /// How long each function's last start took each way on this daemon.
    served: Mutex<HashMap<String, StartTimes>>,
    /// The node's last restore of a sandboxed function, CPU (`[0]`) and GPU (`[1]`): what a
    /// function not yet restored here is compared with.
    last_restore_s: Mutex<[Option<f64>; 2]>,
}

/// The deploy's load overstates a start in a ready sandbox (its caches were cold, its warm-up
/// loaded kernels a ready sandbox has warm): only a load this many times a restore keeps a
/// function's first start off the pool. Measured figures are compared as they are.
pub const ESTIMATE_MARGIN: f64 = 2.0;

/// How long a function's last start in a ready sandbox and last restore took, from the decision
/// to an instance ready (`None`: not yet on this daemon since its deploy), what its deploy's
/// load took, and how its cold starts went lately.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct StartTimes {
    pub pooled_s: Option<f64>,
    pub restored_s: Option<f64>,
    /// The deploy's load in the worker (import, setup, packing, warm-up, and the group's other
    /// members): what a start in a ready sandbox is expected to take before one was measured.
    /// An overestimate if anything (the deploy's warm-up loads kernels a ready sandbox has).
    pub deploy_load_s: Option<f64>,
    /// The way its last cold start took (`true`: a ready sandbox) and how many cold starts in a
    /// row took it.
    pub last_pooled: bool,
    pub streak: u32,
}

impl StartTimes {
    /// Counts a cold start that took the way `pooled` says.
    fn count(&mut self, pooled: bool) {
        if self.streak > 0 && self.last_pooled == pooled {
            self.streak = self.streak.saturating_add(1);
        } else {
            (self.last_pooled, self.streak) = (pooled, 1);
        }
    }

    /// Whether a start in a ready sandbox is faster, by the figures: this function's own where
    /// measured, else its deploy's load against [`ESTIMATE_MARGIN`] times the node's last
    /// restore of a sandboxed function of its kind (`node_restore_s`); `None` when one side is
    /// unknown.
    pub fn pooled_faster(&self, node_restore_s: Option<f64>) -> Option<bool> {
        let restored = self.restored_s.or(node_restore_s)?;
        match (self.pooled_s, self.deploy_load_s) {
            (Some(pooled), _) => Some(pooled < restored),
            (None, Some(load)) => Some(load < ESTIMATE_MARGIN * restored),
            (None, None) => None,
        }
    }
}

/// Whether a cold start of a function whose starts so far took `times` loads into a ready
/// sandbox (when one is ready) rather than restoring its snapshot, under `starts`; under
/// `"faster"`, the faster way by [`StartTimes::pooled_faster`], and after `remeasure_every`
/// (> 0) cold starts in a row that way, the other once.
pub fn wants_pooled(
    times: StartTimes,
    starts: PoolStarts,
    remeasure_every: u32,
    node_restore_s: Option<f64>,
) -> bool {
    if starts == PoolStarts::First {
        // Only its first start on the node, or the first since it was deployed again.
        return times.pooled_s.is_none();
    }
    match times.pooled_faster(node_restore_s) {
        Some(faster) => {
            // A failed load (infinite) is not tried again before a deploy.
            let failed = times.pooled_s.is_some_and(f64::is_infinite);
            let due = remeasure_every > 0
                && times.streak >= remeasure_every
                && times.last_pooled == faster
                && !failed;
            faster != due
        }
        // Nothing known of a start here (a function deployed before this daemon started): try
        // one. Measured here, but nothing restored on the node yet: restore once, to compare.
        None => times.pooled_s.is_none(),
    }
}

impl std::fmt::Debug for SandboxPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SandboxPool { .. }")
    }
}

impl SandboxPool {
    /// Kills every ready sandbox (daemon stop).
    pub fn clear(&self) {
        lock(&self.keys).clear();
    }
}

/// Whether the function of `spec` may start in a ready sandbox: sandboxed, not opted out
/// (`scaling.pooled = false`), and without cgroup limits of its own.
pub fn eligible(spec: &Value) -> bool {
    crate::runtime::sandbox::group_of(spec).is_some()
        && spec["scaling"]["pooled"].as_bool() != Some(false)
        && ["memory_limit", "cpu_limit", "pids_limit"]
            .iter()
            .all(|k| spec.get(*k).is_none_or(Value::is_null))
}

/// Whether the function of `spec` runs on a GPU (`gpus` ≥ 1).
fn gpu_of(spec: &Value) -> bool {
    spec["gpus"].as_u64().unwrap_or(0) > 0
}

/// Whether a process is alive (not gone, not a zombie).
fn alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command's closing parenthesis.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, None | Some('Z' | 'X'))
}

impl Runtime {
    /// The pool key of `spec`, or `None` when its base cannot be named (its interpreter is
    /// missing, its tenant has no user: a boot would say why).
    fn pool_key(&self, spec: &Value) -> Option<String> {
        let user = self.worker_user(spec).ok()?;
        let (key, ..) = crate::runtime::start::boot::base_key(spec, &self.split, user).ok()?;
        Some(format!("{}\u{1f}{key}", crate::tenant::of_spec(spec)))
    }

    /// A sandboxed function was deployed (or found at the daemon's start): its key gets its
    /// ready sandboxes.
    pub fn sandbox_pool_wanted(self: &Arc<Self>, spec: &Value) {
        if self.config.sandbox_pool == 0 || !eligible(spec) {
            return;
        }
        let Some(key) = self.pool_key(spec) else {
            return;
        };
        {
            let mut keys = lock(&self.sandbox_pool.keys);
            let k = keys.entry(key.clone()).or_insert_with(|| Key {
                tenant: crate::tenant::of_spec(spec).to_string(),
                spec: Arc::new(spec.clone()),
                ready: Vec::new(),
                launching: 0,
                failed_at: None,
            });
            k.spec = Arc::new(spec.clone());
        }
        self.refill(&key);
    }

    /// At the daemon's start: the keys of every ready sandboxed function.
    pub async fn fill_sandbox_pools(self: &Arc<Self>) {
        if self.config.sandbox_pool == 0 {
            return;
        }
        let registry = Arc::clone(&self.registry);
        let specs = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                Ok::<_, crate::registry::RegistryError>(
                    s.functions()?
                        .into_iter()
                        .filter(|f| f.state == crate::registry::FunctionState::Ready)
                        .map(|f| f.spec)
                        .collect::<Vec<_>>(),
                )
            })
        })
        .await;
        match specs {
            Ok(Ok(specs)) => {
                for spec in specs {
                    self.sandbox_pool_wanted(&spec);
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot list the functions to fill the sandbox pool")
            }
            Err(e) => tracing::warn!(error = %e, "sandbox pool task failed"),
        }
    }

    /// Launches ready sandboxes for `key` until it has its size (with those under way).
    fn refill(self: &Arc<Self>, key: &str) {
        let size = self.config.sandbox_pool;
        let spec = {
            let mut keys = lock(&self.sandbox_pool.keys);
            let Some(k) = keys.get_mut(key) else {
                return;
            };
            if k.failed_at.is_some_and(|at| at.elapsed() < RETRY)
                || k.ready.len() + k.launching >= size
            {
                return;
            }
            let missing = size - k.ready.len() - k.launching;
            k.launching += missing;
            (0..missing)
                .map(|_| Arc::clone(&k.spec))
                .collect::<Vec<_>>()
        };
        for spec in spec {
            let rt = Arc::clone(self);
            let key = key.to_string();
            tokio::spawn(async move { rt.launch_ready(&key, &spec).await });
        }
    }

    async fn launch_ready(self: &Arc<Self>, key: &str, spec: &Value) {
        let tenant = crate::tenant::of_spec(spec).to_string();
        let n = self.next();
        let dir = self.logs_dir().join("sandbox-pool");
        let log = dir.join(format!("{tenant}-{n}.log"));
        let launched = match std::fs::create_dir_all(&dir) {
            // Counted ready only once warm: a `load` sent at its hello would wait behind the
            // preloads' import and the CUDA warm-up (seconds with torch), slower than a restore.
            Ok(()) => launch_function_worker(
                self,
                spec,
                &log,
                &format!("pool-{n}"),
                None,
                Announce::Warmed,
            )
            .await
            .map_err(|e| e.to_string()),
            Err(e) => Err(format!("cannot make {}: {e}", dir.display())),
        };
        let mut keys = lock(&self.sandbox_pool.keys);
        let Some(k) = keys.get_mut(key) else {
            return; // Dropped (the daemon stops): the tree dies with `launched`.
        };
        k.launching = k.launching.saturating_sub(1);
        match launched {
            Ok(launched) => {
                k.failed_at = None;
                let (preload_s, warmup_s, warm_requests) =
                    launched.warmed.as_ref().map_or((0.0, 0.0, 0), |w| {
                        (w.preload_s, w.warmup_s, w.warm_requests)
                    });
                tracing::info!(tenant = %tenant, ready = k.ready.len() + 1, hello_s = launched.boot_s, preload_s, warmup_s, warm_requests, "sandbox pool: a ready sandbox launched and warmed");
                k.ready.push(Ready { launched, log });
            }
            Err(e) => {
                k.failed_at = Some(Instant::now());
                tracing::warn!(tenant = %tenant, error = %e, "sandbox pool: launching a ready sandbox failed; retrying in {} s", RETRY.as_secs());
            }
        }
        self.show_ready(&keys, &tenant);
    }

    /// Sets `torpor_sandbox_pool_ready{tenant}` to the ready sandboxes of all the tenant's keys
    /// (a tenant has one key per base: its CPU and its GPU functions, say).
    fn show_ready(&self, keys: &HashMap<String, Key>, tenant: &str) {
        let ready: usize = keys
            .values()
            .filter(|k| k.tenant == tenant)
            .map(|k| k.ready.len())
            .sum();
        self.metrics
            .sandbox_pool_ready
            .with_label_values(&[tenant])
            .set(ready as i64);
    }

    /// At each keep-alive tick: ready sandboxes whose process died are dropped and replaced,
    /// and every key is refilled.
    pub(crate) fn sandbox_pool_tick(self: &Arc<Self>) {
        if self.config.sandbox_pool == 0 {
            return;
        }
        let keys: Vec<String> = {
            let mut keys = lock(&self.sandbox_pool.keys);
            let mut changed = Vec::new();
            for k in keys.values_mut() {
                let before = k.ready.len();
                k.ready
                    .retain(|r| alive(r.launched.init) && alive(r.launched.worker));
                let died = before - k.ready.len();
                if died > 0 {
                    tracing::warn!(tenant = %k.tenant, died, "sandbox pool: ready sandboxes died; replacing them");
                    self.metrics
                        .sandbox_pool_replaced
                        .with_label_values(&[&k.tenant])
                        .inc_by(died as u64);
                    changed.push(k.tenant.clone());
                }
            }
            for tenant in changed {
                self.show_ready(&keys, &tenant);
            }
            keys.keys().cloned().collect()
        };
        for key in keys {
            self.refill(&key);
        }
    }

    /// A live ready sandbox of `key`, taken (the dead ones met on the way are dropped).
    fn take_ready(&self, key: &str) -> Option<Ready> {
        let mut keys = lock(&self.sandbox_pool.keys);
        let k = keys.get_mut(key)?;
        let mut taken = None;
        while let Some(r) = k.ready.pop() {
            if alive(r.launched.init) && alive(r.launched.worker) {
                taken = Some(r);
                break;
            }
            self.metrics
                .sandbox_pool_replaced
                .with_label_values(&[&k.tenant])
                .inc();
        }
        let tenant = k.tenant.clone();
        self.show_ready(&keys, &tenant);
        taken
    }

    /// A sandboxed function's first start on this daemon, in a ready sandbox of its key;
    /// `Ok(None)` when it does not apply or none is ready (the caller restores as before).
    pub(crate) async fn pooled_start(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        new: &NewInstance<'_, '_>,
    ) -> Result<Option<Started>, StartError> {
        let times = lock(&self.sandbox_pool.served)
            .get(name)
            .copied()
            .unwrap_or_default();
        if self.config.sandbox_pool == 0 || !eligible(&info.spec) {
            return Ok(None);
        }
        let starts = self.config.sandbox_pool_starts;
        let node_restore_s = self.node_restore_s(&info.spec);
        let faster = times.pooled_faster(node_restore_s);
        if !wants_pooled(
            times,
            starts,
            self.config.sandbox_pool_remeasure_every,
            node_restore_s,
        ) {
            if faster == Some(true) && starts == PoolStarts::Faster {
                tracing::info!(
                    function = name,
                    "sandbox pool: this cold start restores, to measure the restore again"
                );
            }
            return Ok(None);
        }
        // Taken although the figures favour the restore: measured again.
        let remeasured = starts == PoolStarts::Faster && faster == Some(false);
        let Some(key) = self.pool_key(&info.spec) else {
            return Ok(None);
        };
        let taken = self.take_ready(&key);
        // Whether one was there or not, the key is refilled (and known from now on).
        self.sandbox_pool_wanted(&info.spec);
        let Some(ready) = taken else {
            return Ok(None);
        };
        let t = Instant::now();
        new.charge.process_started(ready.launched.init);
        // Its log becomes the instance's (the worker keeps writing to the same file).
        if let Err(e) = std::fs::rename(&ready.log, new.log) {
            tracing::warn!(log = %ready.log.display(), error = %e, "sandbox pool: cannot move the ready sandbox's log to the instance's");
        }
        let fdir = PathBuf::from(info.spec["dir"].as_str().unwrap_or_default());
        let boot = |source| StartError::Boot {
            function: name.to_string(),
            source,
        };
        let data_loading = crate::s3data::start_loading(self.objstore.clone(), &info.spec)
            .map_err(|e| boot(e.into()))?;
        // Platform-managed GPU data (EDAS): filled while the sandbox binds the function in,
        // from the tenant's shared copy or the GPU cache when there is one.
        let gpu_filling = crate::gpudata::start(
            &self.split,
            &info.spec,
            crate::tenant::of_spec(&info.spec),
            0,
        )
        .map_err(|e| boot(e.into()))?;
        let loaded = load_into(
            self,
            ready.launched,
            &info.spec,
            &fdir,
            log_of(new.log, &ready.log),
            data_loading,
            gpu_filling,
        )
        .await
        .map_err(boot)?;
        let load_phases = loaded.phases("pooled_load");
        let Loaded {
            init,
            worker,
            conn,
            cgroup,
            load_s,
            ..
        } = loaded;
        let tree = WorkerTree::new(init, worker, conn, cgroup);
        let adopted = Adopted::new(name, info, generation, None, tree);
        let inst = self.adopt(new.id, adopted).await?;
        let start_s = t.elapsed().as_secs_f64();
        {
            let mut served = lock(&self.sandbox_pool.served);
            let t = served.entry(name.to_string()).or_default();
            t.pooled_s = Some(start_s);
            t.count(true);
        }
        tracing::info!(function = name, instance = %inst.id, pid = init, ms = start_s * 1e3, remeasured, "instance started in a ready sandbox");
        Ok(Some((
            inst,
            [
                ("pooled_load".to_string(), load_s),
                ("start".to_string(), start_s),
            ]
            .into_iter()
            .chain(load_phases)
            .collect(),
            start::POOLED,
        )))
    }

    /// A function was deleted or deployed again: its next first start may use the pool; when
    /// deployed, `deploy_load_s` is what its load took (the first start's estimate).
    pub(crate) fn sandbox_pool_forget(&self, name: &str, deploy_load_s: Option<f64>) {
        let mut served = lock(&self.sandbox_pool.served);
        served.remove(name);
        if let Some(s) = deploy_load_s {
            served.insert(
                name.to_string(),
                StartTimes {
                    deploy_load_s: Some(s),
                    ..StartTimes::default()
                },
            );
        }
    }

    /// The node's last restore of a sandboxed function of `spec`'s kind (CPU or GPU).
    fn node_restore_s(&self, spec: &Value) -> Option<f64> {
        lock(&self.sandbox_pool.last_restore_s)[usize::from(gpu_of(spec))]
    }

    /// A start of `name` in a ready sandbox failed: its later cold starts restore (as if that
    /// way took for ever) until it is deployed again, rather than each paying a failed load
    /// before the restore.
    pub(crate) fn sandbox_pool_failed(&self, name: &str) {
        lock(&self.sandbox_pool.served)
            .entry(name.to_string())
            .or_default()
            .pooled_s = Some(f64::INFINITY);
    }

    /// A cold start of `name` restored its snapshot in `seconds` (from the decision to an
    /// instance ready): what its next cold start compares a start in a ready sandbox with.
    pub(crate) fn sandbox_pool_restored(&self, name: &str, spec: &Value, seconds: f64) {
        if self.config.sandbox_pool == 0 || !eligible(spec) {
            return;
        }
        lock(&self.sandbox_pool.last_restore_s)[usize::from(gpu_of(spec))] = Some(seconds);
        let mut served = lock(&self.sandbox_pool.served);
        let t = served.entry(name.to_string()).or_default();
        t.restored_s = Some(seconds);
        t.count(false);
    }
}

/// The log a load error names: the instance's when the rename worked.
fn log_of<'a>(instance: &'a Path, pooled: &'a Path) -> &'a Path {
    if instance.exists() {
        instance
    } else {
        pooled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_later_cold_start_loads_into_a_ready_sandbox_only_when_that_was_faster() {
        let t = |pooled_s, restored_s| StartTimes {
            pooled_s,
            restored_s,
            ..StartTimes::default()
        };
        let (faster, first) = (PoolStarts::Faster, PoolStarts::First);
        for starts in [faster, first] {
            // The first start on the node (or since a deploy), whatever came before it.
            assert!(wants_pooled(t(None, None), starts, 16, None));
            assert!(wants_pooled(t(None, Some(0.5)), starts, 16, None));
        }
        // Restored never yet: once, so that the two can be compared.
        assert!(!wants_pooled(t(Some(0.2), None), faster, 16, None));
        assert!(wants_pooled(t(Some(0.2), Some(0.5)), faster, 16, None));
        assert!(!wants_pooled(t(Some(0.6), Some(0.5)), faster, 16, None));
        assert!(!wants_pooled(t(Some(0.5), Some(0.5)), faster, 16, None));
        assert!(!wants_pooled(t(Some(0.2), Some(0.5)), first, 16, None));
        // A start there that failed counts as one that never ends (sandbox_pool_failed).
        for restored in [None, Some(30.0)] {
            let mut times = t(Some(f64::INFINITY), restored);
            assert!(!wants_pooled(times, faster, 16, None));
            // ... and is not measured again before a deploy.
            for _ in 0..40 {
                times.count(false);
            }
            assert!(!wants_pooled(times, faster, 16, None));
        }
    }

    #[test]
    fn after_so_many_cold_starts_one_way_the_next_takes_the_other_once() {
        // Simulates the daemon: each start counted the way it went; the figures kept.
        fn run(mut times: StartTimes, every: u32, n: usize) -> String {
            (0..n)
                .map(|_| {
                    let pooled = wants_pooled(times, PoolStarts::Faster, every, None);
                    times.count(pooled);
                    if pooled {
                        'P'
                    } else {
                        'R'
                    }
                })
                .collect()
        }
        let t = |pooled_s, restored_s| StartTimes {
            pooled_s: Some(pooled_s),
            restored_s: Some(restored_s),
            ..StartTimes::default()
        };
        // Loading is faster: every third start restores once.
        assert_eq!(run(t(0.2, 0.5), 2, 9), "PPRPPRPPR");
        // Restoring is faster: likewise the other way.
        assert_eq!(run(t(3.0, 0.5), 2, 9), "RRPRRPRRP");
        assert_eq!(run(t(3.0, 0.5), 16, 17), "RRRRRRRRRRRRRRRRP");
        // 0: never again (as before).
        assert_eq!(run(t(3.0, 0.5), 0, 40), "R".repeat(40));
        // Under "first" nothing changes.
        let mut times = t(0.2, 0.5);
        for _ in 0..40 {
            assert!(!wants_pooled(times, PoolStarts::First, 2, None));
            times.count(false);
        }
        // A start the other way resets the count.
        let mut times = t(3.0, 0.5);
        times.count(false);
        times.count(true);
        assert_eq!((times.last_pooled, times.streak), (true, 1));
        assert!(!wants_pooled(times, PoolStarts::Faster, 2, None));
    }

    #[test]
    fn a_first_start_goes_by_its_deploy_s_load_against_the_node_s_last_restore() {
        let est = |deploy_load_s| StartTimes {
            deploy_load_s,
            ..StartTimes::default()
        };
        let f = PoolStarts::Faster;
        // Nothing restored on the node yet: a ready sandbox, as before.
        assert!(wants_pooled(est(Some(3.0)), f, 16, None));
        // A load (setup) of 3 s at deploy against restores of 0.5 s: it restores.
        assert!(!wants_pooled(est(Some(3.0)), f, 16, Some(0.5)));
        // A load of 0.1 s: a ready sandbox; of 0.8 s too (the estimate's margin: a deploy's
        // load overstates a start in a ready sandbox).
        assert!(wants_pooled(est(Some(0.1)), f, 16, Some(0.5)));
        assert!(wants_pooled(est(Some(0.8)), f, 16, Some(0.5)));
        // No estimate (deployed before this daemon started): a ready sandbox.
        assert!(wants_pooled(est(None), f, 16, Some(0.5)));
        // "first" keeps its meaning: the first start takes one.
        assert!(wants_pooled(
            est(Some(3.0)),
            PoolStarts::First,
            16,
            Some(0.5)
        ));
        // Its own figures, once measured, go before the estimates.
        let mut t = StartTimes {
            deploy_load_s: Some(3.0),
            pooled_s: Some(0.1),
            ..StartTimes::default()
        };
        assert!(wants_pooled(t, f, 16, Some(0.5)));
        t.restored_s = Some(0.05);
        assert!(!wants_pooled(t, f, 16, Some(0.5)));
        // A slow function restored 16 times in a row is measured in a ready sandbox once.
        let mut slow = est(Some(3.0));
        let ways: String = (0..17)
            .map(|_| {
                let pooled = wants_pooled(slow, f, 16, Some(0.5));
                slow.count(pooled);
                if pooled {
                    'P'
                } else {
                    slow.restored_s = Some(0.5);
                    'R'
                }
            })
            .collect();
        assert_eq!(ways, format!("{}P", "R".repeat(16)));
    }

    #[test]
    fn only_sandboxed_functions_not_opted_out_without_limits_of_their_own_take_a_ready_sandbox() {
        let spec = |sandbox: bool, limit: Value| json!({"tenant": "t", "scaling": {"sandbox": sandbox}, "memory_limit": limit, "cpu_limit": null});
        assert!(eligible(&spec(true, Value::Null)));
        assert!(!eligible(&spec(false, Value::Null)));
        assert!(!eligible(&spec(true, json!(1 << 30))));
        // Opted out (scaling.pooled = false); a spec of before has no key: in.
        let opted_out = json!({"tenant": "t", "scaling": {"sandbox": true, "pooled": false}});
        assert!(!eligible(&opted_out));
        let opted_in = json!({"tenant": "t", "scaling": {"sandbox": true, "pooled": true}});
        assert!(eligible(&opted_in));
    }

    #[test]
    fn a_zombie_or_a_missing_process_is_not_alive() {
        assert!(alive(std::process::id() as i32));
        assert!(!alive(i32::MAX));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        // Exited and not reaped yet: a zombie.
        std::thread::sleep(Duration::from_millis(300));
        assert!(!alive(child.id() as i32));
        child.wait().unwrap();
    }
}
