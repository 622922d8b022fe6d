//! `POST /v1/functions`: deploy. The answer is NDJSON: one line per phase as it ends, then
//! `{"result": …}` or `{"error": …, "phase": …}`. A spec that does not validate is a 400 with
//! the spec checker's line, before anything is streamed.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::ToSchema;

use super::{ApiError, AppState};
use crate::deploy;

/// The body of `POST /v1/functions`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeployBody {
    /// The function's directory (absolute), holding torpor.toml.
    pub dir: String,
}

/// Deploys the function in `dir`: validates its spec, then makes (or reuses) its base snapshot
/// and makes its function snapshot, reporting each phase as it ends.
#[utoipa::path(post, path = "/v1/functions", tag = "functions",
    request_body = DeployBody,
    responses(
        (status = 200, content_type = "application/x-ndjson", body = String,
            description = "One JSON object per line: `{\"phase\": NAME, \"s\": SECONDS, …}` as each \
                phase ends, then `{\"result\": {…}}`, or `{\"error\": MESSAGE, \"phase\": NAME}` if it failed"),
        (status = 400, description = "The body or the spec is invalid: the spec checker's line", body = super::types::ErrorBody),
        (status = 500, description = "The daemon cannot deploy (e.g. the SDK is not found)", body = super::types::ErrorBody),
    ))]
pub async fn deploy(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DeployBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body.map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "the body must be {{\"dir\": \"/abs/path\"}}: {}",
                e.body_text()
            ),
        )
    })?;
    let rt = Arc::clone(&state.runtime);
    let t = std::time::Instant::now();
    let spec = deploy::validate(&rt, &body.dir)
        .await
        .map_err(|(user, msg)| {
            if user {
                ApiError::new(StatusCode::BAD_REQUEST, msg)
            } else {
                ApiError::internal(msg)
            }
        })?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let first = serde_json::json!({
        "phase": "validate",
        "s": t.elapsed().as_secs_f64(),
        "function": spec.name,
    });
    let _ = tx.send(first);
    // The deploy runs to its end even if the client goes away.
    tokio::spawn(deploy::run(rt, spec, tx));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        Some((Ok::<_, Infallible>(Bytes::from(bytes)), rx))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}
