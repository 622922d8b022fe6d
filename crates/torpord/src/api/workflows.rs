//! Workflows (crate::runtime::workflow, docs/sandboxes.md): `POST /v1/workflows` records one
//! (body `{"dir": "/abs/path"}` of a directory holding workflow.toml), `GET` and `DELETE
//! /v1/workflows/{name}` show and forget it, `POST /v1/workflows/{name}/invoke` runs it as one
//! request (answered like a function's invoke; a stage's error names the stage).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::{ApiError, AppState};
use crate::registry::FunctionState;
use crate::runtime::workflow::{self, Workflow, WorkflowFileError};
use crate::tenant::Scope;

fn file_error(e: WorkflowFileError) -> ApiError {
    match e {
        WorkflowFileError::NotFound(_) => ApiError::not_found(e.to_string()),
        e => ApiError::internal(e.to_string()),
    }
}

/// The workflow `name`, when the caller's scope sees its tenant (else 404, as if none).
async fn visible_workflow(
    state: &AppState,
    scope: &Scope,
    name: &str,
) -> Result<Workflow, ApiError> {
    let (root, n) = (state.runtime.state_root.clone(), name.to_string());
    let wf = tokio::task::spawn_blocking(move || workflow::load(&root, &n))
        .await
        .map_err(|e| ApiError::internal(format!("workflow task failed: {e}")))?
        .map_err(file_error)?;
    if !scope.sees(&wf.tenant) {
        return Err(file_error(WorkflowFileError::NotFound(name.to_string())));
    }
    Ok(wf)
}

/// Records the workflow in `dir`/workflow.toml: every stage must be a ready function of the
/// workflow's tenant.
#[utoipa::path(post, path = "/v1/workflows", tag = "workflows",
    request_body = super::deploy::DeployBody,
    responses(
        (status = 200, description = "The workflow as recorded, and whether its stages share one sandbox", body = serde_json::Value),
        (status = 400, description = "workflow.toml is wrong, or a stage is no ready function of the tenant", body = super::types::ErrorBody),
        (status = 403, description = "The workflow names another tenant than the token's", body = super::types::ErrorBody),
    ))]
pub async fn deploy(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = super::deploy::parse_body(body)?;
    let python_dir = state
        .runtime
        .python_dir
        .clone()
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let dir = std::path::PathBuf::from(&body.dir);
    if !dir.is_absolute() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the workflow directory {} is relative: send an absolute path (`torpor deploy` does)",
                dir.display()
            ),
        ));
    }
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-m", "torpor.workflow"])
            .arg(&dir)
            .env("PYTHONPATH", crate::launcher::pythonpath(&python_dir))
            .stdin(std::process::Stdio::null())
            .output()
    })
    .await
    .map_err(|e| ApiError::internal(format!("workflow task failed: {e}")))?
    .map_err(|e| {
        ApiError::internal(format!(
            "cannot run python3 -m torpor.workflow: {e}; install python3"
        ))
    })?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let line = msg
            .trim()
            .lines()
            .last()
            .unwrap_or("workflow check failed")
            .to_string();
        return Err(if out.status.code() == Some(1) {
            ApiError::new(StatusCode::BAD_REQUEST, line)
        } else {
            ApiError::internal(line)
        });
    }
    let wf: Workflow = serde_json::from_slice(&out.stdout).map_err(|e| {
        ApiError::internal(format!(
            "python3 -m torpor.workflow printed a workflow this torpord does not read ({e}): \
             install the torpor Python package and torpord together"
        ))
    })?;
    wf.check()
        .map_err(|why| ApiError::internal(format!("torpor.workflow printed {why}")))?;
    if let Scope::Tenant(caller) = &scope {
        if *caller != wf.tenant {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "the workflow names tenant {:?}, and this token is tenant {caller:?}'s: set \
                     tenant = {caller:?} in workflow.toml, or deploy with that tenant's token",
                    wf.tenant
                ),
            ));
        }
    }
    // Every stage a ready function of the workflow's tenant (another tenant's answers as if
    // it did not exist).
    let names: Vec<String> = wf.stages.iter().map(|s| s.function.clone()).collect();
    let rows = super::with_registry(&state, move |r| {
        let mut rows = Vec::new();
        for n in names {
            rows.push((n.clone(), r.with(|s| s.function(&n))?));
        }
        Ok(rows)
    })
    .await?;
    for (name, row) in rows {
        let problem = match row {
            Some(f) if crate::tenant::of_spec(&f.spec) != wf.tenant => Some("no function"),
            Some(f) if f.state != FunctionState::Ready => Some("not ready"),
            Some(_) => None,
            None => Some("no function"),
        };
        if let Some(p) = problem {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "workflow.toml: stage {name} is {p} of tenant {:?}: deploy function {name} \
                     (with tenant = {:?}) first",
                    wf.tenant, wf.tenant
                ),
            ));
        }
    }
    let mut hosts = Vec::new();
    for s in &wf.stages {
        hosts.push(
            state
                .runtime
                .sandbox_host(&s.function)
                .await
                .map_err(|e| ApiError::internal(format!("{e:?}")))?,
        );
    }
    let one_sandbox =
        hosts.first().is_some_and(Option::is_some) && hosts.windows(2).all(|w| w[0] == w[1]);
    let (root, w2) = (state.runtime.state_root.clone(), wf.clone());
    tokio::task::spawn_blocking(move || workflow::save(&root, &w2))
        .await
        .map_err(|e| ApiError::internal(format!("workflow task failed: {e}")))?
        .map_err(file_error)?;
    tracing::info!(workflow = %wf.name, stages = wf.stages.len(), one_sandbox, "workflow deployed");
    Ok(Json(json!({
        "workflow": wf.name,
        "tenant": wf.tenant,
        "stages": wf.stages,
        "one_sandbox": one_sandbox,
    })))
}

/// The workflow as recorded.
#[utoipa::path(get, path = "/v1/workflows/{name}", tag = "workflows",
    params(("name" = String, Path, description = "The workflow's name")),
    responses(
        (status = 200, description = "The workflow", body = crate::runtime::workflow::Workflow),
        (status = 404, description = "No such workflow", body = super::types::ErrorBody),
    ))]
pub async fn get(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Workflow>, ApiError> {
    Ok(Json(visible_workflow(&state, &scope, &name).await?))
}

/// Forgets the workflow (its functions stay deployed).
#[utoipa::path(delete, path = "/v1/workflows/{name}", tag = "workflows",
    params(("name" = String, Path, description = "The workflow's name")),
    responses(
        (status = 200, description = "Forgotten", body = serde_json::Value),
        (status = 404, description = "No such workflow", body = super::types::ErrorBody),
    ))]
pub async fn delete(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
) -> Result<Json<Value>, ApiError> {
    visible_workflow(&state, &scope, &name).await?;
    let (root, n) = (state.runtime.state_root.clone(), name.clone());
    tokio::task::spawn_blocking(move || workflow::remove(&root, &n))
        .await
        .map_err(|e| ApiError::internal(format!("workflow task failed: {e}")))?
        .map_err(file_error)?;
    Ok(Json(json!({ "deleted": name })))
}

/// Runs the workflow as one request: its stages in order, in one sandbox when they share one.
#[utoipa::path(post, path = "/v1/workflows/{name}/invoke", tag = "workflows",
    params(("name" = String, Path, description = "The workflow's name")),
    request_body(content = serde_json::Value, description = "The request of its root stages: any JSON (empty: null)"),
    responses(
        (status = 200, description = "The value of its last stage (several: an object by stage)", body = serde_json::Value),
        (status = 404, description = "No such workflow, or a stage's function is gone", body = super::types::ErrorBody),
        (status = 500, description = "A stage raised: its error document, with `stage`", body = super::types::RaisedBody),
        (status = 502, description = "A stage's worker crashed", body = super::types::ErrorBody),
    ))]
pub async fn invoke(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    super::FunctionName(name): super::FunctionName,
    body: Bytes,
) -> Result<Response, ApiError> {
    let wf = visible_workflow(&state, &scope, &name).await?;
    let request: Box<RawValue> = if body.is_empty() {
        RawValue::from_string("null".into()).expect("null is JSON")
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the request body is not JSON ({e}): send the workflow's request as JSON"),
            )
        })?
    };
    match state.runtime.invoke_workflow(&wf, request).await {
        Ok(done) => {
            let mut headers = HeaderMap::new();
            headers.insert("x-torpor-start", HeaderValue::from_static(done.start));
            headers.insert(
                "x-torpor-timings",
                super::invoke::timings_header(&done.timings),
            );
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok((headers, String::from(Box::<str>::from(done.value))).into_response())
        }
        Err(e) => Ok(super::invoke::error_response(e)),
    }
}
