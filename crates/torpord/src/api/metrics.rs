//! `GET /metrics`: Prometheus text, with the registry-derived gauges refreshed first.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::{with_registry, ApiError, AppState};
use crate::metrics::CONTENT_TYPE;

/// Prometheus text exposition of every metric (docs/torpord.md, "Metrics").
#[utoipa::path(get, path = "/metrics", tag = "daemon",
    responses(
        (status = 200, description = "Prometheus text format 0.0.4", body = String,
            content_type = "text/plain; version=0.0.4"),
        (status = 403, description = "A tenant's token: the metrics name every tenant's functions", body = super::types::ErrorBody),
        (status = 500, description = "The registry cannot be read", body = super::types::ErrorBody),
    ))]
pub async fn get(
    State(state): State<Arc<AppState>>,
    scope: crate::tenant::Scope,
) -> Result<impl IntoResponse, ApiError> {
    super::admin_only(&scope, "GET /metrics")?;
    let (stages, names) = with_registry(&state, |r| {
        r.with(|s| {
            let names = s
                .functions()?
                .into_iter()
                .map(|f| f.name)
                .collect::<Vec<_>>();
            Ok::<_, ApiError>((s.counts()?.instances, names))
        })
    })
    .await?;
    state.metrics.refresh(&stages, &names);
    let text = state
        .metrics
        .render()
        .map_err(|e| ApiError::internal(format!("cannot encode metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, CONTENT_TYPE)], text))
}
