//! The sandboxes' memory pool (issue 11 item 2, docs/sandboxes.md, "The memory pool"): each
//! function's memory in each sandbox, a memory model per function, and admission by it.
//!
//! - **The model.** A function's deploy measures, through its pool in the worker
//!   (torpor.mempool), what it holds after setup() (`resident`) and the most its warm-up
//!   request needed above that (`request_peak`); the registry keeps it with the function. A
//!   request's own peak, reported with its result, raises the model when larger (in memory:
//!   the next deploy measures afresh).
//! - **The accounting.** Per sandbox (instance) and function: `resident`, `pool` (what the
//!   function's request pool holds, as the worker last reported: after each request, and when
//!   an idle function's pool gave its memory back) and `reserved` (the model's peak for each of
//!   its requests running). Exported as `torpor_sandbox_memory_bytes{sandbox, function, kind}`.
//! - **Admission.** A sandbox's budget is its host spec's `scaling.sandbox_memory`, else for
//!   `gpus = 1` the GPU's memory (NVML), else none (no admission: threads only, as before). A
//!   request of function `f` runs in a sandbox only when
//!   `resident of its group + Σ_g max(pool_g, reserved_g) + peak_f ≤ budget`, where `f`'s own
//!   term is `max(pool_f, reserved_f + peak_f)` (its cached pool serves its next request, so a
//!   function's idle cache counts once, not on top). A request that fits no live sandbox takes
//!   a new one while the group is below `max_instances`, else waits in the queue until a
//!   request ends or a pool gives memory back (the sandboxes whose idle functions hold cached
//!   pools are asked to give them back at once: `release_memory`); one that cannot fit even an empty sandbox is
//!   refused at once with the figures and the fix. The check and the reservation happen under
//!   the pool's lock, with the choice of the instance, so two requests never take the same
//!   room.
//!
//! The pure rules ([`Account`], [`Demand`]) are unit-tested below; the daemon tests drive them
//! with real workers (tests/daemon/test_daemon_sandbox_memory.py).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::protocol::{MemoryModel, MemoryReport};
use crate::runtime::invoke::InvokeError;
use crate::runtime::Runtime;
use crate::sync::lock;

/// One function's memory in one sandbox, in bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Use {
    pub resident: u64,
    pub pool: u64,
    pub reserved: u64,
}

/// A sandbox's memory, by function.
#[derive(Debug, Default, Clone)]
pub struct Account {
    pub functions: BTreeMap<String, Use>,
}

/// What one request of `function` asks of a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    pub function: String,
    /// The function's modelled peak per request.
    pub peak: u64,
    /// The resident memory of every function the sandbox hosts (its group's models).
    pub resident: u64,
    /// The sandbox's budget.
    pub budget: u64,
}

impl Demand {
    /// Whether an empty sandbox holds the request: if not, no sandbox ever will.
    pub fn fits_empty(&self) -> bool {
        self.resident.saturating_add(self.peak) <= self.budget
    }
}

impl Account {
    /// The sandbox's memory, with one more request of `extra` when given.
    pub fn used(&self, resident: u64, extra: Option<(&str, u64)>) -> u64 {
        let mut total = resident;
        let mut counted = false;
        for (name, u) in &self.functions {
            let mut reserved = u.reserved;
            if let Some((f, peak)) = extra {
                if f == name {
                    reserved = reserved.saturating_add(peak);
                    counted = true;
                }
            }
            total = total.saturating_add(u.pool.max(reserved));
        }
        match extra {
            Some((_, peak)) if !counted => total.saturating_add(peak),
            _ => total,
        }
    }

    /// Whether the request of `d` fits in this sandbox now.
    pub fn fits(&self, d: &Demand) -> bool {
        self.used(d.resident, Some((&d.function, d.peak))) <= d.budget
    }

    fn entry(&mut self, function: &str) -> &mut Use {
        self.functions.entry(function.to_string()).or_default()
    }
}

/// The runtime's part: models, per-group resident sums and each sandbox's account.
#[derive(Debug, Default)]
pub struct Memory {
    /// Function → its model (the registry's, raised by larger peaks seen since).
    models: Mutex<HashMap<String, Option<MemoryModel>>>,
    /// Sandbox group → the sum of its members' resident memory.
    groups: Mutex<HashMap<String, u64>>,
    /// Instance id → its account.
    pub(crate) accounts: Mutex<HashMap<String, Account>>,
}

const KINDS: [&str; 3] = ["resident", "pool", "reserved"];

impl Runtime {
    /// What a request of sandboxed function `name`, served by the sandbox of `host_spec`,
    /// asks of its sandbox; `None` when the sandbox has no budget (no admission).
    pub(crate) async fn sandbox_demand(
        self: &Arc<Self>,
        name: &str,
        host_spec: &Value,
    ) -> Result<Option<Demand>, InvokeError> {
        let Some(budget) = self.sandbox_budget(host_spec) else {
            return Ok(None);
        };
        let Some(group) = crate::runtime::sandbox::group_of(host_spec) else {
            return Ok(None);
        };
        let cached_model = lock(&self.memory.models).get(name).copied();
        let cached_group = lock(&self.memory.groups).get(&group).copied();
        let (model, resident) = match (cached_model, cached_group) {
            (Some(m), Some(r)) => (m, r),
            _ => {
                let registry = Arc::clone(&self.registry);
                let (n, g) = (name.to_string(), group.clone());
                let (model, resident) = tokio::task::spawn_blocking(move || {
                    registry.with(|s| {
                        let model = s.function_memory(&n)?;
                        let mut resident = 0u64;
                        for f in s.functions()? {
                            if f.state == crate::registry::FunctionState::Ready
                                && crate::runtime::sandbox::group_of(&f.spec).as_deref()
                                    == Some(g.as_str())
                            {
                                if let Some(m) = s.function_memory(&f.name)? {
                                    resident = resident.saturating_add(m.resident);
                                }
                            }
                        }
                        Ok::<_, crate::registry::RegistryError>((model, resident))
                    })
                })
                .await
                .map_err(|e| InvokeError::Internal(format!("registry task failed: {e}")))?
                .map_err(|e| InvokeError::Internal(e.to_string()))?;
                // A model raised by a request meanwhile is kept.
                let model = *lock(&self.memory.models)
                    .entry(name.to_string())
                    .or_insert(model);
                lock(&self.memory.groups).insert(group.clone(), resident);
                (model, resident)
            }
        };
        let demand = Demand {
            function: name.to_string(),
            peak: model.map_or(0, |m| m.request_peak),
            resident,
            budget,
        };
        if !demand.fits_empty() {
            return Err(InvokeError::NotReady(format!(
                "a request of {name:?} needs {} bytes at its peak, and its sandbox (group \
                 {group}) holds {} bytes of its functions' resident memory: more than the \
                 sandbox's {} bytes, so no sandbox can run it; raise scaling.sandbox_memory in \
                 the torpor.toml of the group's functions, or move {name:?} to another workflow",
                demand.peak, demand.resident, demand.budget
            )));
        }
        Ok(Some(demand))
    }

    /// A sandbox's budget: `scaling.sandbox_memory`, else a GPU's memory for `gpus = 1`.
    fn sandbox_budget(&self, spec: &Value) -> Option<u64> {
        if let Some(b) = spec
            .pointer("/scaling/sandbox_memory")
            .and_then(Value::as_u64)
        {
            return Some(b);
        }
        if spec.get("gpus").and_then(Value::as_u64).unwrap_or(0) == 0 {
            return None;
        }
        let nvml = self
            .nvml
            .get_or_init(|| torpor_cuda::Nvml::load().ok())
            .as_ref()?;
        nvml.gpus().ok()?.iter().map(|g| g.total_memory).min()
    }

    /// Whether the request of `d` fits in sandbox `instance` now (caller holds its pool's lock).
    pub(crate) fn memory_fits(&self, instance: &str, d: &Demand) -> bool {
        lock(&self.memory.accounts)
            .get(instance)
            .is_none_or(|a| a.fits(d))
    }

    /// Reserves the peak of `d` in sandbox `instance` (caller holds its pool's lock).
    pub(crate) fn memory_reserve(&self, instance: &str, d: &Demand) {
        let mut accounts = lock(&self.memory.accounts);
        let u = accounts
            .entry(instance.to_string())
            .or_default()
            .entry(&d.function);
        u.reserved = u.reserved.saturating_add(d.peak);
        self.memory_gauge(instance, &d.function, u);
    }

    /// Gives back a reservation of `peak` for `function` in sandbox `instance`.
    pub(crate) fn memory_unreserve(&self, instance: &str, function: &str, peak: u64) {
        let mut accounts = lock(&self.memory.accounts);
        if let Some(a) = accounts.get_mut(instance) {
            let u = a.entry(function);
            u.reserved = u.reserved.saturating_sub(peak);
            self.memory_gauge(instance, function, u);
        }
    }

    /// A worker's report of one function's memory (after a request, or its idle release):
    /// the account takes it, the model learns a larger peak, and the sandbox's waiting
    /// requests look again.
    pub(crate) fn memory_report(&self, instance: &str, host: &str, report: &MemoryReport) {
        {
            let mut accounts = lock(&self.memory.accounts);
            let u = accounts
                .entry(instance.to_string())
                .or_default()
                .entry(&report.function);
            u.resident = report.resident;
            u.pool = report.pool;
            self.memory_gauge(instance, &report.function, u);
        }
        if let Some(peak) = report.peak {
            let mut models = lock(&self.memory.models);
            if let Some(Some(m)) = models.get_mut(&report.function) {
                if peak > m.request_peak {
                    tracing::info!(function = %report.function, was = m.request_peak, now = peak, "a request needed more memory than the model said: the model follows");
                    m.request_peak = peak;
                }
            }
        }
        if let Some(pool) = lock(&self.pools).get(host).cloned() {
            pool.changed.notify_waiters();
        }
    }

    /// A request waits for room in `inst`'s group: the sandbox is asked to give its idle
    /// functions' pools back now (`release_memory`), rather than after their
    /// `memory_release_s`; each pool released comes back as a `memory` frame.
    pub(crate) fn reclaim_memory(self: &Arc<Self>, inst: Arc<crate::runtime::Instance>) {
        let held = lock(&self.memory.accounts)
            .get(&inst.id)
            .is_some_and(|a| a.functions.values().any(|u| u.pool > u.reserved));
        if !held {
            return;
        }
        let frame = match crate::frames::encode(&crate::protocol::ToWorker::ReleaseMemory(
            crate::protocol::Empty {},
        )) {
            Ok(frame) => frame,
            Err(e) => {
                tracing::error!(error = %e, "cannot encode release_memory");
                return;
            }
        };
        // In a task of its own, as every frame to a serving worker (crate::runtime::invoke).
        tokio::spawn(async move {
            let mut wr = inst.writer.lock().await;
            if let Err(e) = crate::workers::send_frame(&mut wr, &frame).await {
                tracing::debug!(instance = %inst.id, error = %e, "release_memory not sent");
            }
        });
    }

    /// A sandbox went: its account and series with it.
    pub(crate) fn memory_forget(&self, instance: &str) {
        let Some(a) = lock(&self.memory.accounts).remove(instance) else {
            return;
        };
        for f in a.functions.keys() {
            for k in KINDS {
                let _ = self
                    .metrics
                    .sandbox_memory_bytes
                    .remove_label_values(&[instance, f, k]);
            }
        }
    }

    /// After a deploy or delete: models and group sums are read again.
    pub(crate) fn forget_memory_models(&self) {
        lock(&self.memory.models).clear();
        lock(&self.memory.groups).clear();
    }

    fn memory_gauge(&self, instance: &str, function: &str, u: &Use) {
        let g = &self.metrics.sandbox_memory_bytes;
        for (k, v) in KINDS.iter().zip([u.resident, u.pool, u.reserved]) {
            g.with_label_values(&[instance, function, k])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn demand(f: &str, peak: u64) -> Demand {
        Demand {
            function: f.into(),
            peak: peak * MIB,
            resident: 10 * MIB,
            budget: 100 * MIB,
        }
    }

    fn account(uses: &[(&str, u64, u64)]) -> Account {
        Account {
            functions: uses
                .iter()
                .map(|(f, pool, reserved)| {
                    (
                        f.to_string(),
                        Use {
                            resident: 0,
                            pool: pool * MIB,
                            reserved: reserved * MIB,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_request_fits_while_the_budget_holds_the_running_peaks_and_its_own() {
        let empty = Account::default();
        assert!(empty.fits(&demand("a", 60)));
        // a's first request runs: a second of the same size does not fit (10 + 120 > 100).
        let one = account(&[("a", 0, 60)]);
        assert!(!one.fits(&demand("a", 60)));
        assert!(!one.fits(&demand("b", 60)));
        // A small one of another function does (10 + 60 + 30 = 100).
        assert!(one.fits(&demand("b", 30)));
        assert!(!one.fits(&demand("b", 31)));
    }

    #[test]
    fn a_function_s_cached_pool_serves_its_next_request_but_holds_room_from_the_others() {
        // a ran and idles with 60 MiB cached in its pool: its next request reuses it...
        let cached = account(&[("a", 60, 0)]);
        assert!(cached.fits(&demand("a", 60)));
        assert_eq!(cached.used(10 * MIB, Some(("a", 60 * MIB))), 70 * MIB);
        // ...but another function's request finds the cache in its way until it is given back.
        assert!(!cached.fits(&demand("b", 60)));
        let released = account(&[("a", 0, 0)]);
        assert!(released.fits(&demand("b", 60)));
    }

    #[test]
    fn a_request_larger_than_an_empty_sandbox_never_fits() {
        assert!(demand("a", 90).fits_empty());
        assert!(!demand("a", 91).fits_empty());
        let huge = Demand {
            peak: u64::MAX,
            ..demand("a", 0)
        };
        assert!(!huge.fits_empty());
        assert!(!Account::default().fits(&huge));
    }
}
