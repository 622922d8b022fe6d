//! Routes of the API that the next steps of issue 3 implement. They answer 501 with a JSON
//! error, so no client mistakes them for a success.

use axum::extract::Path;
use axum::http::StatusCode;

use super::ApiError;

fn not_implemented(what: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        format!("{what} is not implemented yet (issue 3 in progress)"),
    )
}

/// `GET /v1/functions/{name}/logs`.
pub async fn logs(Path(name): Path<String>) -> ApiError {
    not_implemented(&format!("logs (GET /v1/functions/{name}/logs)"))
}
