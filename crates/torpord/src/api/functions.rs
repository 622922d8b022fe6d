//! `GET /v1/functions`, `GET /v1/functions/{name}`, `DELETE /v1/functions/{name}`,
//! `POST /v1/functions/{name}/stop`.

use std::collections::BTreeMap;
use std::path::{Component, Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use super::types::{
    Deleted, FunctionDetail, FunctionList, FunctionSummary, InstanceView, StopRequest, Stopped,
};
use super::{unknown_function as unknown, visible, with_registry, ApiError, AppState};
use crate::registry::FunctionState;
use crate::tenant::Scope;

/// Every function the registry knows that the caller's tenant may see, with its instances per
/// stage.
#[utoipa::path(get, path = "/v1/functions", tag = "functions",
    responses(
        (status = 200, description = "The functions", body = FunctionList),
        (status = 500, description = "The registry cannot be read", body = super::types::ErrorBody),
    ))]
pub async fn list(
    State(state): State<Arc<AppState>>,
    scope: Scope,
) -> Result<Json<FunctionList>, ApiError> {
    let (functions, stages) = with_registry(&state, |r| {
        r.with(|s| Ok::<_, ApiError>((s.functions()?, s.stage_counts_by_function()?)))
    })
    .await?;
    let mut out = Vec::new();
    for f in functions.into_iter().filter(|f| scope.sees_spec(&f.spec)) {
        // Requests of a sandbox's member go to its group's host (cached by the runtime): the
        // member's row says so, or `torpor ls` shows it without instances while it is warm.
        let sandbox_host = match state.runtime.sandbox_host(&f.name).await {
            Ok(Some(host)) if host != f.name => Some(host),
            _ => None,
        };
        out.push(FunctionSummary {
            instances: stages.get(&f.name).copied().unwrap_or_default(),
            name: f.name,
            state: f.state,
            dir: f.dir,
            base_key: f.base_key,
            snapshot: f.snapshot,
            created: f.created,
            updated: f.updated,
            sandbox_host,
        });
    }
    Ok(Json(FunctionList { functions: out }))
}

/// One function with its snapshots and instances.
#[utoipa::path(get, path = "/v1/functions/{name}", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    responses(
        (status = 200, description = "The function", body = FunctionDetail),
        (status = 404, description = "No such function", body = super::types::ErrorBody),
    ))]
pub async fn get(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<FunctionDetail>, ApiError> {
    let runtime = Arc::clone(&state.runtime);
    let detail = with_registry(&state, move |r| {
        r.with(|s| {
            let Some(function) = s.function(&name)?.filter(|f| scope.sees_spec(&f.spec)) else {
                return Err(unknown(&name));
            };
            let instances = s
                .instances_of(&name)?
                .into_iter()
                .map(|instance| InstanceView {
                    device: runtime.device_of(&instance.id),
                    instance,
                })
                .collect();
            Ok(FunctionDetail {
                snapshots: s.snapshots_of(&name)?,
                instances,
                function,
            })
        })
    })
    .await?;
    Ok(Json(detail))
}

/// Stops the function's live instances (their in-flight requests fail), then removes the
/// function, its snapshots (rows and directories) and its hibernated instances. Refused while
/// it deploys, or while it has running instances this daemon did not start (e.g. left by an
/// earlier daemon). Base snapshots are shared and stay.
#[utoipa::path(delete, path = "/v1/functions/{name}", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    responses(
        (status = 200, description = "Deleted: what was removed", body = Deleted),
        (status = 404, description = "No such function", body = super::types::ErrorBody),
        (status = 409, description = "It is being deployed, or has instances this daemon did not start", body = super::types::ErrorBody),
    ))]
pub async fn delete(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Deleted>, ApiError> {
    // No deploy of it runs meanwhile (so its tenant cannot change before it is gone).
    let _deploys = state.runtime.deploy_locks.function(&name).await;
    visible(&state, &scope, &name).await?;
    let stopped = state.runtime.stop_function(&name);
    state.runtime.forget_sandbox_routes();
    state.runtime.sandbox_pool_forget(&name, None);
    let n = name.clone();
    let (function, snapshots) = with_registry(&state, move |r| {
        r.transaction(|s| {
            let Some(f) = s.function(&n)? else {
                return Err(unknown(&n));
            };
            if f.state == FunctionState::Deploying {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!("function {n:?} is being deployed: delete it once the deploy ends"),
                ));
            }
            let pids: Vec<String> = s
                .instances_of(&n)?
                .iter()
                .filter(|i| i.stage.has_process() && !stopped.contains(&i.id))
                .filter_map(|i| i.pid.map(|p| p.to_string()))
                .collect();
            if !pids.is_empty() {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    format!(
                        "function {n:?} has {} running instance(s) that this torpord did not \
                         start (pid {}): stop them (kill the pids) and delete again",
                        pids.len(),
                        pids.join(", ")
                    ),
                ));
            }
            let snapshots = s.delete_function(&n)?.unwrap_or_default();
            Ok((f, snapshots))
        })
    })
    .await?;
    tracing::info!(function = %name, snapshots = snapshots.len(), "function deleted");
    // What the function's rows took goes back to the file system (a big spec, many instances).
    match with_registry(&state, |r| Ok(r.shrink()?)).await {
        Ok(0) => {}
        Ok(bytes) => tracing::info!(bytes, "registry shrunk"),
        Err(e) => tracing::warn!(error = %e.message, "cannot shrink the registry"),
    }
    for s in &snapshots {
        state.runtime.staging.remove(&s.path);
    }

    let snapshots_root = state.state_dir.join("snapshots");
    let functions_root = state.state_dir.join("functions");
    let mut dirs: Vec<(PathBuf, bool)> = snapshots
        .iter()
        .map(|s| {
            let inside = is_inside(&s.path, &snapshots_root);
            (s.path.clone(), inside)
        })
        .collect();
    // The function's directory is removed only if it is the daemon's copy; a directory
    // elsewhere is the user's source and is none of the registry's business.
    if is_inside(&function.dir, &functions_root) {
        dirs.push((function.dir.clone(), true));
    }
    // Its instances' and deploys' logs (the base's log stays with the base).
    dirs.push((
        crate::instance_logs::function_dir(&state.runtime.logs_dir(), &name),
        true,
    ));
    let (removed, left_behind) = tokio::task::spawn_blocking(move || remove_dirs(dirs))
        .await
        .map_err(|e| ApiError::internal(format!("removing directories failed: {e}")))?;
    Ok(Json(Deleted {
        deleted: name,
        snapshots: snapshots.into_iter().map(|s| s.id).collect(),
        removed,
        left_behind,
    }))
}

/// Takes every live instance of the function out of service, the deploy untouched: idle ones
/// are stopped now, busy ones when their requests end (as a redeploy retires them), and its
/// hibernated instances are discarded unless the body says `{"keep_hibernated": true}`. The
/// next request restores a fresh instance from the function snapshot.
#[utoipa::path(post, path = "/v1/functions/{name}/stop", tag = "functions",
    params(("name" = String, Path, description = "The function's name (its torpor.toml's `name`).")),
    request_body(content = Option<StopRequest>, description = "Optional: an empty body is `{\"keep_hibernated\": false}`"),
    responses(
        (status = 200, description = "The instances taken out of service", body = Stopped),
        (status = 400, description = "The body is not a StopRequest", body = super::types::ErrorBody),
        (status = 404, description = "No such function", body = super::types::ErrorBody),
    ))]
pub async fn stop(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
    body: Bytes,
) -> Result<Json<Stopped>, ApiError> {
    visible(&state, &scope, &name).await?;
    let req: StopRequest = if body.iter().all(u8::is_ascii_whitespace) {
        StopRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the stop body is not {{\"keep_hibernated\": bool}} ({e}): send that, or nothing"),
            )
        })?
    };
    let n = name.clone();
    with_registry(&state, move |r| match r.with(|s| s.function(&n))? {
        Some(_) => Ok(()),
        None => Err(unknown(&n)),
    })
    .await?;
    let rt = Arc::clone(&state.runtime);
    let (stopped, retiring, discarded) = match rt.stop_instances(&name, req.keep_hibernated) {
        Some(s) => {
            let mut discarded = Vec::new();
            for sleeper in s.sleepers {
                rt.discard_sleeper(
                    sleeper.id.clone(),
                    sleeper.snapshot_id,
                    sleeper.snapshot_dir,
                )
                .await;
                discarded.push(sleeper.id);
            }
            (s.stopped, s.retiring, discarded)
        }
        // No pool: nothing of it is live in this daemon; only hibernated rows may exist.
        None if req.keep_hibernated => (Vec::new(), Vec::new(), Vec::new()),
        None => {
            let n = name.clone();
            let discarded = tokio::task::spawn_blocking(move || rt.discard_sleepers_of(&n))
                .await
                .map_err(|e| ApiError::internal(format!("discarding task failed: {e}")))?;
            (Vec::new(), Vec::new(), discarded)
        }
    };
    tracing::info!(function = %name, stopped = stopped.len(), retiring = retiring.len(), discarded = discarded.len(), "function stopped");
    Ok(Json(Stopped {
        function: name,
        stopped,
        retiring,
        discarded,
    }))
}

/// Whether `path` lies strictly below `root`, judged on the text (no `..`, absolute).
fn is_inside(path: &FsPath, root: &FsPath) -> bool {
    path.is_absolute()
        && path != root
        && path.starts_with(root)
        && path
            .components()
            .all(|c| !matches!(c, Component::ParentDir | Component::CurDir))
}

fn remove_dirs(dirs: Vec<(PathBuf, bool)>) -> (Vec<PathBuf>, BTreeMap<PathBuf, String>) {
    let mut removed = Vec::new();
    let mut left = BTreeMap::new();
    for (dir, allowed) in dirs {
        if !allowed {
            tracing::warn!(path = %dir.display(), "snapshot outside the state directory; not removed");
            left.insert(dir, "outside the state directory; not removed".to_string());
            continue;
        }
        let removed_now = std::fs::remove_dir_all(&dir);
        // A split snapshot's segments: released in the chunk store, then GC; its page profile.
        crate::split::release_snapshot_of_dir(&dir);
        crate::profiles::remove_of_dir(&dir);
        match removed_now {
            Ok(()) => removed.push(dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "cannot remove directory");
                left.insert(dir, e.to_string());
            }
        }
    }
    (removed, left)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_below_the_root_are_inside() {
        let root = FsPath::new("/var/lib/torpor/snapshots");
        assert!(is_inside(
            FsPath::new("/var/lib/torpor/snapshots/fn-1"),
            root
        ));
        assert!(!is_inside(root, root));
        assert!(!is_inside(
            FsPath::new("/var/lib/torpor/snapshots/../x"),
            root
        ));
        assert!(!is_inside(FsPath::new("/home/u/fn"), root));
        assert!(!is_inside(
            FsPath::new("snapshots/fn-1"),
            FsPath::new("snapshots")
        ));
    }
}
