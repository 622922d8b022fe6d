//! The HTTP/JSON API (docs/torpord.md, "HTTP API"): one module per resource.
//!
//! Every route is declared once, in [`routes`], from handlers annotated with `#[utoipa::path]`:
//! the router and the OpenAPI document (`GET /v1/openapi.json`, [`openapi`]) are the two halves
//! of that one list (utoipa-axum), so the document cannot miss a route. utoipa is the maintained
//! code-first OpenAPI generator for axum; the schemas come from the same serde types the
//! handlers answer with.

mod body_deadline;
mod deploy;
mod functions;
mod instances;
mod invoke;
pub mod logs;
mod metrics;
mod objstore;
mod status;
pub mod types;
mod workflows;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::Tokens;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::registry::{Registry, RegistryError};
use crate::tenant::Scope;
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

/// A function's name from a route's path (`/v1/functions/{name}…`), checked before anything
/// looks it up: a name is what spec.py accepts for torpor.toml's `name`
/// (`[a-z0-9][a-z0-9_.-]{0,62}`), so `..`, `/`, NUL or bytes that are no UTF-8 are refused with
/// 400 and one JSON error line, never reach the registry or a file path, and a path axum cannot
/// decode is answered in JSON too (axum's own rejection is plain text).
#[derive(Debug, Clone)]
pub struct FunctionName(pub String);

/// Whether `name` is a function name (python/torpor/spec.py's `NAME_RE`): the rule tenant
/// names follow too, kept in one place ([`crate::tenant::is_tenant_name`]).
pub fn is_function_name(name: &str) -> bool {
    crate::tenant::is_tenant_name(name)
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for FunctionName {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        let bad = |got: String| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "{got} is not a function name: a name is 1 to 63 of a-z, 0-9, '_', '.', '-', \
                     starting with a letter or digit (torpor.toml's name; see `torpor ls`)"
                ),
            )
        };
        let axum::extract::Path(name) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|e| bad(format!("the path's name ({})", e.body_text())))?;
        if !is_function_name(&name) {
            let mut shown: String = name.escape_debug().take(80).collect();
            if name.len() > 80 {
                shown.push('…');
            }
            return Err(bad(format!("\"{shown}\"")));
        }
        Ok(Self(name))
    }
}

/// The caller's [`Scope`], put in the request's extensions by the listener's layer (the Unix
/// socket's: every tenant; TCP's: the token's). A request without one is refused (500), never
/// served as if it could see everything.
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Scope {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, ApiError> {
        parts.extensions.get::<Scope>().cloned().ok_or_else(|| {
            ApiError::internal("the request reached a handler without a tenant scope (a bug)")
        })
    }
}

/// The answer for a function that does not exist, or that the caller's tenant cannot see:
/// the same, so that a tenant cannot learn of another's functions.
pub(crate) fn unknown_function(name: &str) -> ApiError {
    ApiError::not_found(format!("no function named {name:?} (see `torpor ls`)"))
}

/// `Ok` when the caller may see function `name`: every caller of the Unix socket or with the
/// admin token, at once; a tenant's token when the function is its tenant's. A function this
/// daemon serves to that tenant is judged by its pool's spec (no registry read on the way to
/// its invoke); every other answer reads the registry row, the other tenant's served function
/// too, so that its 404 takes the time a missing function's takes. Otherwise
/// [`unknown_function`], as if it did not exist.
pub(crate) async fn visible(state: &AppState, scope: &Scope, name: &str) -> Result<(), ApiError> {
    let Scope::Tenant(tenant) = scope else {
        return Ok(());
    };
    if state.runtime.pool_tenant(name).as_deref() == Some(tenant.as_str()) {
        return Ok(());
    }
    let n = name.to_string();
    let owner = with_registry(state, move |r| {
        Ok(r.with(|s| s.function(&n))?
            .map(|f| crate::tenant::of_spec(&f.spec).to_string()))
    })
    .await?;
    if owner.as_deref() == Some(tenant.as_str()) {
        Ok(())
    } else {
        Err(unknown_function(name))
    }
}

/// Refuses a route that shows every tenant's functions (the metrics) to a tenant's token.
pub(crate) fn admin_only(scope: &Scope, what: &str) -> Result<(), ApiError> {
    match scope {
        Scope::All => Ok(()),
        Scope::Tenant(t) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "{what} covers every tenant's functions, and this token is tenant {t:?}'s: use \
                 the admin token (token_file) or the Unix socket"
            ),
        )),
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

/// What the OpenAPI document says beside the routes (title, version and licence come from
/// the crate).
#[derive(OpenApi)]
#[openapi(
    info(
        title = "torpord",
        description = "Torpor's node daemon: deploy functions, invoke them, watch their instances. \
            Served on a Unix socket (mode 0600) and, when configured, on TCP behind \
            `Authorization: Bearer <token>`. Errors are `{\"error\": \"…\"}` with one line \
            naming the cause and the fix. See docs/torpord.md."
    ),
    tags(
        (name = "functions", description = "Deploy, list, inspect, stop and delete functions; their logs"),
        (name = "invoke", description = "Run a function's request"),
        (name = "daemon", description = "The daemon itself: status, metrics, this document"),
    )
)]
struct ApiDoc;

/// Every route of the API with its OpenAPI operation: one list, from which both the router and
/// the document are made.
pub fn routes() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(status::get))
        .routes(routes!(functions::list, deploy::deploy))
        .routes(routes!(functions::get, functions::delete))
        .routes(invoke_route())
        .routes(routes!(functions::stop))
        .routes(routes!(instances::migrate))
        .routes(routes!(workflows::deploy))
        .routes(routes!(workflows::get, workflows::delete))
        .routes(workflow_invoke_route())
        .routes(routes!(objstore::pull))
        .routes(routes!(objstore::push))
        .routes(routes!(objstore::placement))
        .routes(routes!(logs::get))
        .routes(routes!(metrics::get))
        .routes(routes!(openapi_json))
}

/// The invoke route, with its own body limit ([`MAX_INVOKE_BODY`]; every other route has
/// [`MAX_CONTROL_BODY`]). The inner limit is the one the handler's extractor sees.
fn invoke_route() -> utoipa_axum::router::UtoipaMethodRouter<Arc<AppState>> {
    let (schemas, paths, method) = routes!(invoke::invoke);
    (
        schemas,
        paths,
        method.layer(DefaultBodyLimit::max(MAX_INVOKE_BODY)),
    )
}

/// A workflow's invoke route, with the invoke body limit.
fn workflow_invoke_route() -> utoipa_axum::router::UtoipaMethodRouter<Arc<AppState>> {
    let (schemas, paths, method) = routes!(workflows::invoke);
    (
        schemas,
        paths,
        method.layer(DefaultBodyLimit::max(MAX_INVOKE_BODY)),
    )
}

/// The OpenAPI 3.1 document of the API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().into_openapi()
}

/// This document: the OpenAPI 3.1 description of every route of the API.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "daemon",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json",
        body = Object)))]
pub async fn openapi_json() -> Response {
    static DOC: std::sync::OnceLock<utoipa::openapi::OpenApi> = std::sync::OnceLock::new();
    Json(DOC.get_or_init(openapi)).into_response()
}

/// The API's routes, without authentication (the Unix socket's, root-only by its mode): every
/// tenant's functions.
pub fn router(state: Arc<AppState>) -> Router {
    routes_with_state(state).layer(axum::Extension(Scope::All))
}

/// The routes with their state and body deadline, before a scope is given.
fn routes_with_state(state: Arc<AppState>) -> Router {
    let body_timeout = state.config.http.body_timeout;
    service_routes()
        .with_state(state)
        .layer(middleware::from_fn_with_state(
            body_timeout,
            body_deadline::limit,
        ))
}

/// The routes with the fallbacks and the request log, before the state is given.
fn service_routes() -> Router<Arc<AppState>> {
    let (router, _) = routes().split_for_parts();
    router
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(MAX_CONTROL_BODY))
        .layer(middleware::from_fn(log_request))
}

/// The API's routes behind the bearer tokens (the TCP listener's): each token's scope.
pub fn router_with_token(state: Arc<AppState>, tokens: Arc<Tokens>) -> Router {
    routes_with_state(state).layer(middleware::from_fn_with_state(tokens, require_token))
}

async fn require_token(
    State(tokens): State<Arc<Tokens>>,
    mut req: Request,
    next: Next,
) -> Response {
    let scope = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| tokens.scope(v.as_bytes()));
    if let Some(scope) = scope {
        req.extensions_mut().insert(scope);
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
         from torpord's --token-file (admin) or your tenant's from --tenant-tokens-file",
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// (method, path) of every route `router` serves, read from its `Debug` output, the only
    /// listing axum gives: `RouteId(N): MethodRouter(… allow_header: Bytes(b"GET,HEAD") })` per
    /// route and `RouteId(N): "/path"` in its node. HEAD is left out (axum adds it to GET).
    fn served(router: &Router<Arc<AppState>>) -> BTreeSet<(String, String)> {
        let text = format!("{router:?}");
        let main = text.split(", fallback_router:").next().unwrap_or_default();
        let (routes, node) = main
            .split_once("node: Node")
            .expect("axum's Router Debug changed");
        let id = |chunk: &str| chunk.split(')').next().unwrap_or_default().to_string();
        let between = |s: &str, a: &str, b: &str| {
            let rest = s.split_once(a)?.1;
            Some(rest.split_once(b)?.0.to_string())
        };
        let mut methods = std::collections::BTreeMap::new();
        for chunk in routes.split("RouteId(").skip(1) {
            if let Some(allow) = between(chunk, "allow_header: Bytes(b\"", "\"") {
                methods.insert(id(chunk), allow);
            }
        }
        let mut out = BTreeSet::new();
        for chunk in node.split("RouteId(").skip(1) {
            let path = between(chunk, ": \"", "\"").expect("a route id without its path");
            let allow = methods
                .get(&id(chunk))
                .expect("a path without its method router");
            for m in allow.split(',').filter(|m| *m != "HEAD") {
                out.insert((m.to_string(), path.clone()));
            }
        }
        out
    }

    /// (method, path) of every operation in the document.
    fn documented() -> BTreeSet<(String, String)> {
        let doc = serde_json::to_value(openapi()).unwrap();
        let mut out = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in [
                "get", "put", "post", "delete", "options", "head", "patch", "trace",
            ] {
                if item.get(method).is_some() {
                    out.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        out
    }

    #[test]
    fn function_names_are_spec_names_and_nothing_that_walks_a_path() {
        for ok in ["resnet", "a", "gpt2-large", "x.y_z", &"a".repeat(63)] {
            assert!(is_function_name(ok), "{ok}");
        }
        for bad in [
            "",
            "..",
            ".",
            "../etc",
            "a/b",
            "a\0b",
            "A",
            "-a",
            ".a",
            "é",
            &"a".repeat(64),
        ] {
            assert!(!is_function_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn every_route_of_the_router_is_in_the_openapi_document_and_back() {
        let served = served(&service_routes());
        let documented = documented();
        assert!(served.len() >= 10, "{served:?}");
        assert_eq!(served, documented);
        assert!(served.contains(&("GET".to_string(), "/v1/openapi.json".to_string())));
    }

    #[test]
    fn every_operation_documents_its_answers_with_schemas() {
        let doc = serde_json::to_value(openapi()).unwrap();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let responses = op["responses"].as_object().unwrap();
                assert!(responses.contains_key("200"), "{method} {path}");
                assert!(
                    op["tags"].as_array().is_some_and(|t| !t.is_empty()),
                    "{method} {path}"
                );
                for (status, r) in responses {
                    assert!(
                        r["content"].as_object().is_some_and(|c| !c.is_empty()),
                        "{method} {path} {status} has no body"
                    );
                }
            }
        }
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        for name in [
            "Status",
            "FunctionList",
            "FunctionDetail",
            "Stopped",
            "FunctionLogs",
            "ErrorBody",
        ] {
            assert!(schemas.contains_key(name), "{name}");
        }
    }
}
