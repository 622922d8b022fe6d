//! `POST /v1/instances/{id}/migrate`: live migration of an instance to another GPU of this node
//! (crate::runtime::migrate; docs/migration.md).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;

use super::{visible, ApiError, AppState};
use crate::runtime::migrate::{MigrateRequest, Migrated};
use crate::tenant::Scope;

/// Whether `id` looks like an instance id (letters, digits, `.`, `_`, `-`; at most 128).
fn is_instance_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Moves a warm split instance to another GPU of this node while it serves: its segments are
/// pre-copied, then it stops taking requests (they wait) for the copy of what changed, the
/// move of its CUDA state and the mapping of its segments at their old addresses; it keeps its
/// id, process and state. On any failure it serves on, on its old GPU.
#[utoipa::path(post, path = "/v1/instances/{id}/migrate", tag = "functions",
    params(("id" = String, Path, description = "The instance's id (GET /v1/functions/{name} lists them).")),
    request_body(content = MigrateRequest, description = "The target GPU"),
    responses(
        (status = 200, description = "Migrated", body = Migrated),
        (status = 400, description = "The body is not a MigrateRequest, or no such GPU", body = super::types::ErrorBody),
        (status = 404, description = "No such live instance", body = super::types::ErrorBody),
        (status = 409, description = "Refused: not a split worker, not warm, busy, the same GPU, another model, no room", body = super::types::ErrorBody),
        (status = 500, description = "A step failed: the instance serves on its old GPU (or, said so, was removed)", body = super::types::ErrorBody),
    ))]
pub async fn migrate(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Json<Migrated>, ApiError> {
    if !is_instance_id(&id) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "an instance id is letters, digits, '.', '_' and '-' (at most 128): take it from GET /v1/functions/NAME",
        ));
    }
    let req: MigrateRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the migrate body is not {{\"gpu\": N}} ({e}): send the target GPU's ordinal"),
        )
    })?;
    // A tenant sees only its own functions' instances: another's answers as one that does not
    // exist (the function's name is not told).
    if let Some(function) = state.runtime.instance_function(&id) {
        if visible(&state, &scope, &function).await.is_err() {
            let e = crate::runtime::migrate::MigrateError::NoInstance { id };
            return Err(ApiError::new(e.status(), e.to_string()));
        }
    }
    state
        .runtime
        .migrate_instance(&id, req.gpu)
        .await
        .map(Json)
        .map_err(|e| {
            let status = e.status();
            if status == StatusCode::INTERNAL_SERVER_ERROR {
                ApiError::internal(e.to_string())
            } else {
                ApiError::new(status, e.to_string())
            }
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn instance_ids_are_checked_before_any_lookup() {
        for ok in ["splitbuf-1a2b", "a", "x_y.z-1"] {
            assert!(super::is_instance_id(ok), "{ok}");
        }
        for bad in ["", "../x", "a/b", "a b", &"x".repeat(129)] {
            assert!(!super::is_instance_id(bad), "{bad}");
        }
    }
}
