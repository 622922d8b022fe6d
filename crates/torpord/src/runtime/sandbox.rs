//! Sandboxes (docs/sandboxes.md): one worker process hosting every sandboxed function
//! (`scaling.sandbox = true`) of one tenant and workflow, each request on a thread (and CUDA
//! stream) of its own. A sandbox is an ordinary instance: its pool, starts, keep-alive steps,
//! hibernation and crash handling are the runtime's, unchanged. What makes it a sandbox:
//!
//! - its group, `tenant/workflow` ([`group_of`]): functions of different tenants never share
//!   one (the tenant is part of the group, and the harness refuses a load of another tenant);
//! - its host: the group's member with the newest function snapshot, its most recently
//!   deployed ([`Runtime::sandbox_host`]). A
//!   sandboxed function's deploy loads every other ready member of its group into the worker
//!   after the function itself ([`load_members`]), so the host's function snapshot holds the
//!   whole group; every member's requests go to the host's pool, with the member's name in the
//!   `invoke` frame (the harness routes it);
//! - after such a deploy, the other members' pools are retired ([`Runtime::sandbox_deployed`]):
//!   their instances lack the new function.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::Value;

use crate::registry::{Function, FunctionState};
use crate::runtime::invoke::InvokeError;
use crate::runtime::start::boot::{load_frame, ready, NotReady};
use crate::runtime::Runtime;
use crate::sync::lock;
use crate::workers::{ConnError, WorkerConn};

/// The sandbox group of a spec, `tenant/workflow` (`-` for no workflow), when it asks for a
/// sandbox.
pub fn group_of(spec: &Value) -> Option<String> {
    if spec.pointer("/scaling/sandbox").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let tenant = crate::tenant::of_spec(spec);
    let workflow = spec.get("workflow").and_then(Value::as_str).unwrap_or("-");
    Some(format!("{tenant}/{workflow}"))
}

/// The ready members of `group` in the registry, but `except`.
fn members(
    s: &crate::registry::Store<'_>,
    group: &str,
    except: &str,
) -> Result<Vec<Function>, crate::registry::RegistryError> {
    Ok(s.functions()?
        .into_iter()
        .filter(|f| {
            f.name != except
                && f.state == FunctionState::Ready
                && f.snapshot.is_some()
                && group_of(&f.spec).as_deref() == Some(group)
        })
        .collect())
}

/// Why the other members of a sandbox could not be loaded at a deploy.
#[derive(Debug, thiserror::Error)]
pub enum LoadMembersError {
    /// The registry could not be read.
    #[error("cannot list the sandbox's functions: {0}")]
    Registry(String),
    /// A member's directory could not be bound into the worker.
    #[error("cannot bind the directory of {function} into the sandbox: {source}")]
    Bind {
        function: String,
        #[source]
        source: crate::function_mounts::BindError,
    },
    /// The `load` frame could not be sent.
    #[error("cannot send load of {function} to the sandbox: {source}")]
    Send {
        function: String,
        #[source]
        source: ConnError,
    },
    /// A member's platform-loaded data could not be loaded (crate::s3data).
    #[error("cannot load the data of {function} for the sandbox: {source}")]
    Data {
        function: String,
        #[source]
        source: crate::s3data::DataError,
    },
    /// A member's platform-managed GPU data could not be filled (crate::gpudata).
    #[error("cannot fill the GPU data of {function} for the sandbox: {source}")]
    GpuData {
        function: String,
        #[source]
        source: crate::gpudata::GpuDataError,
    },
    /// A member did not load.
    #[error(
        "function {function} of the same sandbox did not load next to this one: {source}; \
         deploy {function} again, or delete it"
    )]
    Load {
        function: String,
        #[source]
        source: NotReady,
    },
}

impl LoadMembersError {
    /// The worker's error document, when a member's load failed in the harness.
    pub fn worker_error(&self) -> Option<Value> {
        match self {
            Self::Load {
                source: NotReady::Failed { error, .. },
                ..
            } => Some(error.clone()),
            _ => None,
        }
    }
}

/// A member loaded beside the deployed function.
pub(crate) struct LoadedMember {
    pub name: String,
    /// What the harness packed of its weights (the `ready` frame's `packed`; docs/split.md,
    /// "Weight packing"), when it did.
    pub packed: Option<Value>,
}

/// At the deploy of `name` (group `group`), after its own load: loads every other ready member
/// of the group into the worker of `init` behind `conn`.
pub(crate) async fn load_members(
    rt: &Runtime,
    conn: &mut WorkerConn,
    init: i32,
    name: &str,
    group: &str,
    unprivileged: bool,
    bound: std::time::Duration,
) -> Result<Vec<LoadedMember>, LoadMembersError> {
    let registry = Arc::clone(&rt.registry);
    let (g, n) = (group.to_string(), name.to_string());
    let others = tokio::task::spawn_blocking(move || registry.with(|s| members(s, &g, &n)))
        .await
        .map_err(|e| LoadMembersError::Registry(e.to_string()))?
        .map_err(|e| LoadMembersError::Registry(e.to_string()))?;
    let mut loaded = Vec::new();
    for m in others {
        let dir = m.dir.clone();
        let data = |source| LoadMembersError::Data {
            function: m.name.clone(),
            source,
        };
        // Its platform-loaded data, as its own start would have it (a member whose setup()
        // reads `torpor.load` would otherwise fail here, failing the newcomer's deploy).
        let loading = crate::s3data::start_loading(rt.objstore.clone(), &m.spec).map_err(data)?;
        // And its platform-managed GPU data (device = "cuda"), filled meanwhile: the same
        // tenant's keys, so a copy the sandbox's other functions hold is shared.
        let gpu_data = |source| LoadMembersError::GpuData {
            function: m.name.clone(),
            source,
        };
        let filling = crate::gpudata::start(&rt.split, &m.spec, crate::tenant::of_spec(&m.spec), 0)
            .map_err(gpu_data)?;
        crate::function_mounts::bind_function_dir(init, &dir, unprivileged)
            .await
            .map_err(|source| LoadMembersError::Bind {
                function: m.name.clone(),
                source,
            })?;
        let (fds, _) = crate::s3data::finish_loading(loading).await.map_err(data)?;
        let filled = crate::gpudata::finish(filling).await.map_err(gpu_data)?;
        let send = |source| LoadMembersError::Send {
            function: m.name.clone(),
            source,
        };
        conn.send(&load_frame(&m.spec, &dir)).await.map_err(send)?;
        crate::s3data::send_fds(conn, &fds).await.map_err(send)?;
        drop(fds);
        crate::gpudata::send(conn, &filled).await.map_err(send)?;
        let answer = ready(conn, bound)
            .await
            .map_err(|source| LoadMembersError::Load {
                function: m.name.clone(),
                source,
            })?;
        // The worker mapped it before the member's setup(): the daemon's handles may go.
        drop(filled);
        loaded.push(LoadedMember {
            name: m.name,
            packed: answer.get("packed").filter(|p| !p.is_null()).cloned(),
        });
    }
    Ok(loaded)
}

impl Runtime {
    /// Where requests of `name` go: `Some(host)` when `name` runs in a sandbox (the group's
    /// ready member with the newest function snapshot, which holds the whole group), `None` when
    /// it has instances of its own (or is unknown: the pool says so).
    pub(crate) async fn sandbox_host(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<Option<String>, InvokeError> {
        if let Some(host) = lock(&self.sandbox_routes.hosts).get(name) {
            return Ok(host.clone());
        }
        let epoch = self.sandbox_routes.epoch.load(Ordering::Acquire);
        let registry = Arc::clone(&self.registry);
        let n = name.to_string();
        let host = tokio::task::spawn_blocking(move || {
            registry.with(|s| {
                let Some(f) = s.function(&n)? else {
                    return Ok(None);
                };
                let Some(group) = group_of(&f.spec) else {
                    return Ok(None);
                };
                if f.state != FunctionState::Ready {
                    return Ok(None);
                }
                // The member whose function snapshot is the newest: it was taken with every
                // member then ready loaded (a row's `updated` moves for other reasons).
                let taken = |f: &Function| -> Result<i64, crate::registry::RegistryError> {
                    Ok(match f.snapshot.as_deref() {
                        Some(id) => s.snapshot(id)?.map_or(i64::MIN, |snap| snap.created),
                        None => i64::MIN,
                    })
                };
                let mut host = (taken(&f)?, f.name.clone());
                for m in members(s, &group, &n)? {
                    let candidate = (taken(&m)?, m.name);
                    if candidate > host {
                        host = candidate;
                    }
                }
                Ok::<_, crate::registry::RegistryError>(Some(host.1))
            })
        })
        .await
        .map_err(|e| InvokeError::Internal(format!("registry task failed: {e}")))?
        .map_err(|e| InvokeError::Internal(e.to_string()))?;
        let mut hosts = lock(&self.sandbox_routes.hosts);
        // A deploy or delete meanwhile may have changed the answer: only a current one is kept.
        if self.sandbox_routes.epoch.load(Ordering::Acquire) == epoch {
            hosts.insert(name.to_string(), host.clone());
        }
        Ok(host)
    }

    /// Forgets every sandbox route (a function was deployed or deleted).
    pub fn forget_sandbox_routes(&self) {
        let mut hosts = lock(&self.sandbox_routes.hosts);
        self.sandbox_routes.epoch.fetch_add(1, Ordering::AcqRel);
        hosts.clear();
        self.forget_memory_models();
    }

    /// After the deploy of `name`, whose load took `load_s` in the worker: routes are computed
    /// again and, when it is sandboxed, the instances of the other members of its group are
    /// retired (they lack `name`'s new code), their hibernated ones discarded.
    pub async fn sandbox_deployed(self: &Arc<Self>, name: &str, spec: &Value, load_s: Option<f64>) {
        self.forget_sandbox_routes();
        // Its first start after this deploy may take a ready sandbox, when its load looks
        // faster than a restore (start::pooled).
        self.sandbox_pool_forget(name, load_s);
        self.sandbox_pool_wanted(spec);
        let Some(group) = group_of(spec) else {
            return;
        };
        let others: Vec<String> = {
            let pools = lock(&self.pools);
            pools
                .iter()
                .filter(|(n, p)| {
                    n.as_str() != name
                        && group_of(&lock(&p.state).info.spec).as_deref() == Some(group.as_str())
                })
                .map(|(n, _)| n.clone())
                .collect()
        };
        for other in others {
            if let Some(stopped) = self.stop_instances(&other, false) {
                for s in stopped.sleepers {
                    self.discard_sleeper(s.id, s.snapshot_id, s.snapshot_dir)
                        .await;
                }
                tracing::info!(function = %other, host = %name, "sandbox: retired the instances of the older host");
            }
        }
    }
}

/// The cache of [`Runtime::sandbox_host`]'s answers.
#[derive(Debug, Default)]
pub struct Routes {
    pub(crate) hosts: std::sync::Mutex<std::collections::HashMap<String, Option<String>>>,
    pub(crate) epoch: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_group_is_the_tenant_and_the_workflow_and_only_when_asked() {
        let s = |sandbox: bool, workflow: Value| json!({"tenant": "team-a", "workflow": workflow, "scaling": {"sandbox": sandbox}});
        assert_eq!(
            group_of(&s(true, json!("vision"))).as_deref(),
            Some("team-a/vision")
        );
        assert_eq!(group_of(&s(true, Value::Null)).as_deref(), Some("team-a/-"));
        assert_eq!(group_of(&s(false, json!("vision"))), None);
        // Specs of before have no key.
        assert_eq!(group_of(&json!({"tenant": "t", "scaling": {}})), None);
        // Two tenants with one workflow name: two groups.
        let other = json!({"tenant": "team-b", "workflow": "vision", "scaling": {"sandbox": true}});
        assert_ne!(group_of(&other), group_of(&s(true, json!("vision"))));
    }
}
