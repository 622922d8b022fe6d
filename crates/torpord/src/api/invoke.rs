//! `POST /v1/functions/{name}/invoke`: the body is the request JSON, the answer's body the
//! function's value, with `X-Torpor-Start` (warm, restored, booted, standby, pooled) and `X-Torpor-Timings` (the
//! phases in seconds, as a JSON object).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::{ApiError, AppState};
use crate::runtime::{InvokeError, Timings};

pub(super) fn timings_header(t: &Timings) -> HeaderValue {
    let m: Map<String, Value> = t.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    HeaderValue::from_str(&Value::Object(m).to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("{}"))
}

/// Runs one request of the function: on a warm instance, or on one restored, woken or booted
/// for it; waits in the function's queue when every instance is busy.
#[utoipa::path(post, path = "/v1/functions/{name}/invoke", tag = "invoke",
    params(
        ("name" = String, Path, description = "The function's name (its torpor.toml's `name`)."),
        ("idempotency-key" = Option<String>, Header, description = "1 to 255 visible ASCII characters (e.g. a UUID): the request runs once for the key; a retry with the key joins the run under way or gets its answer (the function's value or exception) for 10 min, across a restart of the daemon too (docs/torpord.md, \"Retries\")"),
    ),
    request_body(content = serde_json::Value, description = "The function's request: any JSON (empty: null)"),
    responses(
        (status = 200, description = "The function's value", body = serde_json::Value,
            headers(
                ("x-torpor-start" = String, description = "How the instance was obtained: warm, restored, booted, standby or pooled"),
                ("x-torpor-timings" = String, description = "The phases in seconds, as a JSON object (queue, start, restore, handler, overhead, total, …)"),
                ("idempotent-replayed" = String, description = "`true` on an answer to a retry: the run it reports was another request's of the same Idempotency-Key"),
            )),
        (status = 400, description = "The body is not JSON, or the Idempotency-Key is malformed", body = super::types::ErrorBody),
        (status = 408, description = "The body did not arrive within http.body_timeout_s of the headers", body = super::types::ErrorBody),
        (status = 404, description = "No such function, or an object a `{\"$ref\": \"s3://…\"}` of the request names is not in the bucket (docs/data.md)", body = super::types::ErrorBody),
        (status = 409, description = "The function is not ready (deploying or failed)", body = super::types::ErrorBody),
        (status = 422, description = "A `$ref` of the request is malformed, names another bucket, or the references hold more than 32 MiB; or the Idempotency-Key was used with another request body", body = super::types::ErrorBody),
        (status = 429, description = "The function's queue is full", body = super::types::ErrorBody),
        (status = 500, description = "The function raised (or the daemon failed: then the body is an ErrorBody)", body = super::types::RaisedBody,
            headers(("x-torpor-timings" = String, description = "The phases in seconds"))),
        (status = 502, description = "The worker crashed or misbehaved, or the object store failed while loading a `$ref`", body = super::types::ErrorBody),
        (status = 503, description = "No instance became free within the queue's timeout (or a `$ref` came to a node without [objstore])", body = super::types::ErrorBody,
            headers(("retry-after" = u64, description = "Seconds to wait before retrying"))),
        (status = 504, description = "The request ran past the function's timeout_s", body = super::types::ErrorBody),
    ))]
pub async fn invoke(
    State(state): State<Arc<AppState>>,
    scope: crate::tenant::Scope,
    super::FunctionName(name): super::FunctionName,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    // Any node serves any function: one this node does not know is pulled from the object
    // store first (crate::objstore), then cold-started as usual.
    if state.runtime.objstore.is_some() && state.runtime.pool_tenant(&name).is_none() {
        let n = name.clone();
        let known = super::with_registry(&state, move |r| Ok(r.with(|s| s.function(&n))?))
            .await?
            .is_some();
        if !known {
            match state.runtime.pull_function(&scope, &name).await {
                Ok(_) => {}
                Err(crate::bucket::PullError::NotInBucket { .. }) => {
                    return Err(super::unknown_function(&name))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    super::visible(&state, &scope, &name).await?;
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is over the {} MiB limit: send less data (e.g. a path the \
                 function reads)",
                super::MAX_INVOKE_BODY >> 20
            ),
        ),
        status => ApiError::new(status, e.body_text()),
    })?;
    // Its fingerprint is the hash of the bytes sent (before any `$ref` is loaded).
    let keyed = match headers.get(crate::idempotency::HEADER) {
        Some(v) => Some(crate::idempotency::Keyed::new(v.as_bytes(), &body).map_err(key_refused)?),
        None => None,
    };
    // Checked as JSON but kept as the bytes sent: the daemon never re-encodes a request.
    let request: Box<RawValue> = if body.is_empty() {
        RawValue::from_string("null".into()).expect("null is JSON")
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("the request body is not JSON ({e}): send the function's request as JSON"),
            )
        })?
    };
    // Inputs by reference (crate::s3data): `{"$ref": "s3://…"}` objects loaded from the
    // function's tenant's space in the bucket before the request is queued.
    let request = if crate::s3data::may_hold_refs(request.get().as_bytes()) {
        let n = name.clone();
        let tenant = match state.runtime.pool_tenant(&name) {
            Some(t) => t,
            None => super::with_registry(&state, move |r| Ok(r.with(|s| s.function(&n))?))
                .await?
                .map(|f| crate::tenant::of_spec(&f.spec).to_string())
                .ok_or_else(|| super::unknown_function(&name))?,
        };
        let tier = state.runtime.objstore.clone();
        let raw = request.get().as_bytes().to_vec();
        let resolved = tokio::task::spawn_blocking(move || {
            crate::s3data::resolve_refs(tier.as_deref(), &tenant, &raw)
        })
        .await
        .map_err(|e| ApiError::internal(format!("the $ref loading task failed: {e}")))?
        .map_err(|e| ApiError::new(e.status(), e.to_string()))?;
        match resolved {
            Some(bytes) => RawValue::from_string(String::from_utf8(bytes).map_err(|e| {
                ApiError::internal(format!("a resolved request is not UTF-8: {e}"))
            })?)
            .map_err(|e| ApiError::internal(format!("a resolved request is not JSON: {e}")))?,
            None => request,
        }
    } else {
        request
    };
    match keyed {
        None => Ok(render(state.runtime.invoke(&name, request).await)),
        Some(keyed) => invoke_once(&state, &name, request, keyed).await,
    }
}

/// An invocation's response.
fn render(result: Result<crate::runtime::Invoked, InvokeError>) -> Response {
    match result {
        Ok(done) => {
            let mut headers = HeaderMap::new();
            headers.insert("x-torpor-start", HeaderValue::from_static(done.start));
            headers.insert("x-torpor-timings", timings_header(&done.timings));
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            (headers, String::from(Box::<str>::from(done.value))).into_response()
        }
        Err(e) => error_response(e),
    }
}

/// A request with an Idempotency-Key (crate::idempotency): it runs once, in a task of its own
/// (a client that goes away does not cancel it: its retry joins it); every request of the key
/// gets that run's answer.
async fn invoke_once(
    state: &Arc<AppState>,
    name: &str,
    request: Box<RawValue>,
    keyed: crate::idempotency::Keyed,
) -> Result<Response, ApiError> {
    use crate::idempotency::Claim;
    // A worker of an earlier daemon may hold this key's answer: it must be back first.
    state.runtime.readoption_settled(name).await;
    let mut request = Some(request);
    loop {
        let claim = state
            .runtime
            .keys
            .claim(name, &keyed)
            .map_err(key_refused)?;
        let (mut answers, replayed, bound) = match claim {
            Claim::Replay(answer) => return Ok(answer_response(&answer, true)),
            // A re-adopted worker's run: bounded here by the function's timeout.
            Claim::Join { answers, held } => {
                let bound = match held {
                    true => Some(
                        state.runtime.function_timeout(name).await
                            + state.runtime.config.queue.timeout,
                    ),
                    false => None,
                };
                (answers, true, bound)
            }
            Claim::Run(ticket) => {
                let Some(request) = request.take() else {
                    return Err(ApiError::internal(
                        "an idempotency key was claimed twice by one request",
                    ));
                };
                let Some(rx) = ticket.subscribe() else {
                    return Err(ApiError::internal(
                        "an idempotency key's run lost its entry",
                    ));
                };
                let rt = Arc::clone(&state.runtime);
                let (name, keyed) = (name.to_string(), keyed.clone());
                tokio::spawn(async move {
                    let result = rt.invoke_keyed(&name, request, Some(keyed)).await;
                    // The function's own answer is kept; anything else the next retry runs.
                    let keep = matches!(result, Ok(_) | Err(InvokeError::User(..)));
                    ticket.finish(to_answer(render(result), keep).await);
                });
                (rx, false, None)
            }
        };
        // Closed without an answer: that run was given up; claim again.
        let waited = answers.wait_for(Option::is_some);
        let answer = match bound {
            None => waited.await.ok().and_then(|a| a.clone()),
            Some(bound) => match tokio::time::timeout(bound, waited).await {
                Ok(got) => got.ok().and_then(|a| a.clone()),
                Err(_) => {
                    let retry = bound.as_secs().clamp(1, 60);
                    let mut r = ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "the request of Idempotency-Key {:?} still runs on an instance that a \
                             restarted torpord took back ({:.0} s waited): retry after {retry} s",
                            keyed.key,
                            bound.as_secs_f64()
                        ),
                    )
                    .into_response();
                    r.headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(retry));
                    return Ok(r);
                }
            },
        };
        if let Some(answer) = answer {
            return Ok(answer_response(&answer, replayed));
        }
    }
}

fn key_refused(e: crate::idempotency::KeyError) -> ApiError {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    ApiError::new(status, e.to_string())
}

/// A response, as kept for the retries of its key.
async fn to_answer(response: Response, keep: bool) -> crate::idempotency::Answer {
    let (parts, body) = response.into_parts();
    let headers = parts
        .headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    // The daemon made this body in full (a function's value is limited by the frame size).
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    crate::idempotency::Answer {
        status: parts.status.as_u16(),
        headers,
        body,
        keep,
    }
}

fn answer_response(answer: &crate::idempotency::Answer, replayed: bool) -> Response {
    let mut r = Response::new(axum::body::Body::from(answer.body.clone()));
    *r.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (k, v) in &answer.headers {
        if let (Ok(k), Ok(v)) = (
            header::HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(v),
        ) {
            r.headers_mut().append(k, v);
        }
    }
    if replayed {
        r.headers_mut().insert(
            crate::idempotency::REPLAYED_HEADER,
            HeaderValue::from_static("true"),
        );
    }
    r
}

pub(super) fn error_response(e: InvokeError) -> Response {
    let plain = |status: StatusCode, msg: String| ApiError::new(status, msg).into_response();
    match e {
        InvokeError::BadRequest(m) => plain(StatusCode::BAD_REQUEST, m),
        InvokeError::NotFound(m) => plain(StatusCode::NOT_FOUND, m),
        InvokeError::NotReady(m) => plain(StatusCode::CONFLICT, m),
        InvokeError::QueueFull(m) => plain(StatusCode::TOO_MANY_REQUESTS, m),
        InvokeError::QueueTimeout {
            message,
            retry_after_s,
        }
        | InvokeError::NoGpuMemory {
            message,
            retry_after_s,
        } => {
            let mut r = plain(StatusCode::SERVICE_UNAVAILABLE, message);
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
            r
        }
        InvokeError::User(err, timings) => {
            let mut r = (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({ "error": err })),
            )
                .into_response();
            r.headers_mut()
                .insert("x-torpor-timings", timings_header(&timings));
            r
        }
        InvokeError::Crashed(m) => plain(StatusCode::BAD_GATEWAY, m),
        InvokeError::Timeout(m) => plain(StatusCode::GATEWAY_TIMEOUT, m),
        InvokeError::Internal(m) => ApiError::internal(m).into_response(),
    }
}
