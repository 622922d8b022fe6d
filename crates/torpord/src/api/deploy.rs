//! `POST /v1/functions`: deploy. The answer is NDJSON: one line per phase as it ends, then
//! `{"result": …}` or `{"error": …, "phase": …}` (with `"cause": "gpu_memory"` when the node's
//! GPU had no room for it, not the function at fault). A spec that does not validate is a 400 with
//! the spec checker's line, before anything is streamed.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::{ApiError, AppState};
use crate::deploy;
use crate::tenant::Scope;

/// The body of `POST /v1/functions`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeployBody {
    /// The function's directory (absolute), holding torpor.toml.
    pub dir: String,
}

/// The body as sent: an object `{"dir": "/abs/path"}` and nothing else. (serde would also take
/// a struct from an array, `["/abs/path"]`.)
pub(super) fn parse_body(
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Result<DeployBody, ApiError> {
    let bad = |why: String| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the body must be {{\"dir\": \"/abs/path\"}}: {why}"),
        )
    };
    let Json(value) = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            e.status(),
            format!(
                "the body is over {} KiB: send only {{\"dir\": \"/abs/path\"}}",
                super::MAX_CONTROL_BODY >> 10
            ),
        ),
        _ => bad(e.body_text()),
    })?;
    if !value.is_object() {
        return Err(bad(format!(
            "got {}, not an object",
            match value {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                _ => "null",
            }
        )));
    }
    let body: DeployBody = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    if body.dir.contains('\0') {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the body's \"dir\" contains a NUL byte, which no path can hold: send the function \
             directory's absolute path",
        ));
    }
    Ok(body)
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
        (status = 403, description = "A tenant's token, and the spec names another tenant", body = super::types::ErrorBody),
        (status = 408, description = "The body did not arrive within http.body_timeout_s of the headers", body = super::types::ErrorBody),
        (status = 409, description = "A tenant's token, and another tenant's function has the name", body = super::types::ErrorBody),
        (status = 500, description = "The daemon cannot deploy (e.g. the SDK is not found)", body = super::types::ErrorBody),
    ))]
pub async fn deploy(
    State(state): State<Arc<AppState>>,
    scope: Scope,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let body = parse_body(body)?;
    let rt = Arc::clone(&state.runtime);
    let t = std::time::Instant::now();
    let mut spec = deploy::validate(&rt, &body.dir).await.map_err(|e| {
        if e.is_users_mistake() {
            ApiError::new(StatusCode::BAD_REQUEST, e.to_string())
        } else {
            ApiError::internal(e.to_string())
        }
    })?;
    let tenant = crate::tenant::of_spec(&spec.json).to_string();
    if let Scope::Tenant(caller) = &scope {
        if *caller != tenant {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "the spec names tenant {tenant:?}, and this token is tenant {caller:?}'s: \
                     set tenant = {caller:?} in torpor.toml, or deploy with that tenant's token"
                ),
            ));
        }
        // Answered before the stream starts when it is plain; the deploy's own transaction
        // checks again (crate::deploy::RegisterError::NameTaken), for two deploys at once.
        let n = spec.name.clone();
        let owner = super::with_registry(&state, move |r| {
            Ok(r.with(|s| s.function(&n))?
                .map(|f| crate::tenant::of_spec(&f.spec).to_string()))
        })
        .await?;
        if owner.is_some_and(|o| o != *caller) {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                deploy::RegisterError::NameTaken { name: spec.name }.to_string(),
            ));
        }
    }
    spec.caller = scope;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<DeployBody, String> {
        parse_body(Ok(Json(v))).map_err(|e| format!("{} {}", e.status.as_u16(), e.message))
    }

    #[test]
    fn only_an_object_with_a_dir_is_a_deploy_body() {
        assert_eq!(parse(serde_json::json!({"dir": "/f"})).unwrap().dir, "/f");
        let e = parse(serde_json::json!(["/f"])).unwrap_err();
        assert!(
            e.starts_with("400 ") && e.contains("got an array, not an object"),
            "{e}"
        );
        let e = parse(serde_json::json!({"dir": "/f", "x": 1})).unwrap_err();
        assert!(e.starts_with("400 ") && e.contains("unknown field"), "{e}");
        let e = parse(serde_json::json!({"dir": "/f\u{0}x"})).unwrap_err();
        assert!(e.starts_with("400 ") && e.contains("NUL"), "{e}");
        let e = parse(serde_json::json!("dir")).unwrap_err();
        assert!(e.contains("a string"), "{e}");
    }
}
