//! The HTTP/JSON API (docs/torpord.md, "HTTP API"): one module per resource.

mod deploy;
mod functions;
mod invoke;
pub mod logs;
mod metrics;
mod status;
pub mod types;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::auth::Token;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::registry::{Registry, RegistryError};
use types::ErrorBody;

/// What every handler can reach.
#[derive(Debug)]
pub struct AppState {
    pub config: Config,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// Where deleted functions' snapshot and function directories may be removed from.
    pub state_dir: std::path::PathBuf,
    /// The TCP address actually bound, if any.
    pub tcp: Option<SocketAddr>,
    pub started: Instant,
    /// `started` as Unix ms.
    pub started_ms: i64,
    /// Deploy and invoke: instances, pools, the workers' socket.
    pub runtime: Arc<crate::runtime::Runtime>,
}

/// An error answer: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// A failure of the daemon itself; logged here, since the client may not report it.
    pub fn internal(message: impl Into<String>) -> Self {
        let message = message.into();
        tracing::error!(error = %message, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound { .. } => Self::not_found(e.to_string()),
            RegistryError::Exists { .. } | RegistryError::Conflict { .. } => {
                Self::new(StatusCode::CONFLICT, e.to_string())
            }
            _ => Self::internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(ErrorBody {
                error: self.message,
            }),
        )
            .into_response()
    }
}

/// Runs registry work on the blocking pool (SQLite calls block).
pub(crate) async fn with_registry<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Registry) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let registry = Arc::clone(&state.registry);
    tokio::task::spawn_blocking(move || f(&registry))
        .await
        .map_err(|e| ApiError::internal(format!("registry task failed: {e}")))?
}

/// The largest invoke body (docs/torpord.md): the request goes to the worker in one frame of at
/// most 64 MiB ([`crate::frames::MAX_FRAME`]), inside an envelope of a few dozen bytes. Larger:
/// 413.
pub const MAX_INVOKE_BODY: usize = 63 << 20;
/// The largest body of every other route (a deploy's or a stop's few bytes of JSON).
pub const MAX_CONTROL_BODY: usize = 64 << 10;

/// The API's routes, without authentication (the Unix socket's).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/status", get(status::get))
        .route("/v1/functions", get(functions::list).post(deploy::deploy))
        .route(
            "/v1/functions/{name}",
            get(functions::get).delete(functions::delete),
        )
        .route(
            "/v1/functions/{name}/invoke",
            axum::routing::post(invoke::invoke).layer(DefaultBodyLimit::max(MAX_INVOKE_BODY)),
        )
        .route(
            "/v1/functions/{name}/stop",
            axum::routing::post(functions::stop),
        )
        .route("/v1/functions/{name}/logs", get(logs::get))
        .route("/metrics", get(metrics::get))
        .layer(DefaultBodyLimit::max(MAX_CONTROL_BODY))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}

/// The API's routes behind the bearer token (the TCP listener's).
pub fn router_with_token(state: Arc<AppState>, token: Arc<Token>) -> Router {
    router(state).layer(middleware::from_fn_with_state(token, require_token))
}

async fn require_token(State(token): State<Arc<Token>>, req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get(header::AUTHORIZATION)
        .is_some_and(|v| token.accepts(v.as_bytes()));
    if ok {
        // Closed last when the listener is full (crate::connections).
        if let Some(conn) = req.extensions().get::<Arc<crate::connections::ConnAuth>>() {
            conn.authenticated();
        }
        return next.run(req).await;
    }
    tracing::warn!(method = %req.method(), path = %req.uri().path(), "refused a TCP request without the right bearer token");
    let mut res = ApiError::new(
        StatusCode::UNAUTHORIZED,
        "missing or wrong bearer token: send `Authorization: Bearer <token>` with the token \
         from torpord's --token-file",
    )
    .into_response();
    res.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    res
}

async fn log_request(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let start = Instant::now();
    let res = next.run(req).await;
    tracing::debug!(
        %method,
        %path,
        status = res.status().as_u16(),
        ms = (start.elapsed().as_secs_f64() * 1e6).round() / 1e3,
        "request"
    );
    res
}

async fn no_route(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn wrong_method(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}
