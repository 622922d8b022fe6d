//! `POST /v1/functions/{name}/pull`, `POST /v1/functions/{name}/push` and `GET
//! /v1/functions/{name}/placement`: the object tier (crate::objstore) and the local facts a
//! router of a cluster places requests by.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;

use super::{unknown_function, visible, ApiError, AppState};
use crate::bucket::{PullError, Pulled, Pushed};
use crate::registry::FunctionState;
use crate::sync::lock;
use crate::tenant::Scope;

impl From<PullError> for ApiError {
    fn from(e: PullError) -> Self {
        let status = e.status();
        if status.is_server_error() {
            tracing::warn!(error = %e, "pull failed");
        }
        ApiError::new(status, e.to_string())
    }
}

/// Pulls a function this node does not know from the object store (`[objstore]`): its record
/// and only the chunks this node lacks, each verified by hash; then registers it as if it had
/// been deployed here. A function known here already is not pulled (`pulled_bytes` 0).
#[utoipa::path(post, path = "/v1/functions/{name}/pull", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    responses(
        (status = 200, description = "Pulled (or known here already)", body = Pulled),
        (status = 404, description = "Not in the bucket for this caller's tenant, or no [objstore]", body = super::types::ErrorBody),
        (status = 409, description = "The snapshot cannot run on this node: a file it reopens differs, or its directory is missing", body = super::types::ErrorBody),
        (status = 502, description = "The object store failed, or holds a corrupt object", body = super::types::ErrorBody),
    ))]
pub async fn pull(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Pulled>, ApiError> {
    Ok(Json(state.runtime.pull_function(&scope, &name).await?))
}

/// Pushes the function's current snapshot and record to the object store now (a deploy does
/// this itself; this retries one that failed).
#[utoipa::path(post, path = "/v1/functions/{name}/push", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    responses(
        (status = 200, description = "Pushed", body = Pushed),
        (status = 404, description = "No such function", body = super::types::ErrorBody),
        (status = 409, description = "The function is not ready, or torpord has no [objstore]", body = super::types::ErrorBody),
        (status = 502, description = "The push failed (it is tried again later)", body = super::types::ErrorBody),
    ))]
pub async fn push(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Pushed>, ApiError> {
    visible(&state, &scope, &name).await?;
    if state.runtime.objstore.is_none() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "torpord.toml has no [objstore]: nothing to push to (docs/objstore.md)",
        ));
    }
    let n = name.clone();
    let f = super::with_registry(&state, move |r| Ok(r.with(|s| s.function(&n))?)).await?;
    match f {
        None => return Err(unknown_function(&name)),
        Some(f) if f.state != FunctionState::Ready => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "function {name:?} is {}: push it once its deploy has succeeded",
                    f.state
                ),
            ))
        }
        Some(_) => {}
    }
    let _deploy = state.runtime.deploy_locks.function(&name).await;
    state
        .runtime
        .push_function(&name)
        .await
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, e))
}

/// The local facts a router places a request of the function by.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Placement {
    pub function: String,
    /// The function is deployed (or pulled) and ready on this node.
    pub known: bool,
    /// Live instances (warm, gpu_released, standby, busy or not).
    pub instances: usize,
    /// Live instances with no request in flight.
    pub warm_idle: usize,
    /// Instances starting now: restores and boots in flight (standbys included), whose
    /// processes exist before they are listed as instances.
    pub starting: usize,
    /// Requests waiting in this node's queue of the function.
    pub queue_depth: usize,
    /// The function's `scaling.max_instances`: no new instance starts here while its instances
    /// (every stage, starting ones too) reach it; a request then waits in the queue. `null`
    /// when this node does not know the function.
    pub max_instances: Option<usize>,
    /// The function snapshot is staged in memory (the fastest restore).
    pub staged: bool,
    /// The function snapshot is on this node's disk (a restore needs no pull).
    pub local_snapshot: bool,
    /// The bucket holds the function for this caller's tenant; `null` without `[objstore]` or
    /// when the object store did not answer.
    pub in_bucket: Option<bool>,
    /// Free GPU memory (the most free of this node's GPUs, from NVML); `null` without NVML.
    pub gpu_free_bytes: Option<u64>,
}

/// Where this node stands for the function: whether it knows it, its instances and queue,
/// whether its snapshot is staged, on disk or only in the bucket, and the free GPU memory.
/// Answered for any name (a function this node does not know is `known: false`); another
/// tenant's function is answered as an unknown one.
#[utoipa::path(get, path = "/v1/functions/{name}/placement", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    responses(
        (status = 200, description = "The local facts", body = Placement),
    ))]
pub async fn placement(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Placement>, ApiError> {
    let rt = Arc::clone(&state.runtime);
    let n = name.clone();
    let caller = scope.clone();
    let local = super::with_registry(&state, move |r| {
        Ok(r.with(|s| {
            let Some(f) = s.function(&n)?.filter(|f| scope.sees_spec(&f.spec)) else {
                return Ok::<_, crate::registry::RegistryError>(None);
            };
            let snap = match &f.snapshot {
                Some(id) => s.snapshot(id)?,
                None => None,
            };
            Ok(Some((f, snap)))
        })?)
    })
    .await?;
    let (mut instances, mut warm_idle, mut starting, mut queue_depth) = (0, 0, 0, 0);
    if local.is_some() {
        if let Some(pool) = lock(&rt.pools).get(&name).cloned() {
            let st = lock(&pool.state);
            instances = st.instances.len();
            warm_idle = st.instances.iter().filter(|(_, n)| *n == 0).count();
            starting = st.starting;
            queue_depth = st.queued;
        }
    }
    let snapshot_dir = local
        .as_ref()
        .and_then(|(_, s)| s.as_ref())
        .map(|s| s.path.clone());
    let staged = snapshot_dir
        .as_deref()
        .is_some_and(|p| rt.staging.contains(p));
    let local_snapshot = snapshot_dir.as_deref().is_some_and(std::path::Path::is_dir);
    let known = local
        .as_ref()
        .is_some_and(|(f, _)| f.state == FunctionState::Ready);
    let max_instances = local
        .as_ref()
        .map(|(f, _)| crate::runtime::pool::max_instances_of(&f.spec));
    let tenant = local
        .as_ref()
        .map(|(f, _)| crate::tenant::of_spec(&f.spec).to_string());
    let in_bucket = match rt.objstore.clone() {
        Some(tier) => {
            let n = name.clone();
            tokio::task::spawn_blocking(move || tier.in_bucket(&caller, tenant.as_deref(), &n))
                .await
                .ok()
                .flatten()
        }
        None => None,
    };
    let rt2 = Arc::clone(&rt);
    let gpu_free_bytes = tokio::task::spawn_blocking(move || rt2.gpu_free_bytes())
        .await
        .ok()
        .flatten();
    Ok(Json(Placement {
        function: name,
        known,
        instances,
        warm_idle,
        starting,
        queue_depth,
        max_instances,
        staged,
        local_snapshot,
        in_bucket,
        gpu_free_bytes,
    }))
}
