//! `GET /v1/status`: what the daemon is and what its registry holds.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;

use super::types::Status;
use super::{with_registry, ApiError, AppState};

/// What the daemon is and what its registry holds (for a tenant's token: the numbers of its
/// own functions, snapshots and instances).
#[utoipa::path(get, path = "/v1/status", tag = "daemon",
    responses(
        (status = 200, description = "The daemon's state", body = Status),
        (status = 500, description = "The registry cannot be read", body = super::types::ErrorBody),
    ))]
pub async fn get(
    State(state): State<Arc<AppState>>,
    scope: crate::tenant::Scope,
) -> Result<Json<Status>, ApiError> {
    let (counts, schema) = with_registry(&state, move |r| {
        let counts = match &scope {
            crate::tenant::Scope::All => r.with(|s| s.counts())?,
            crate::tenant::Scope::Tenant(_) => r.with(|s| tenant_counts(s, &scope))?,
        };
        Ok((counts, r.schema_version()?))
    })
    .await?;
    let c = &state.config;
    Ok(Json(Status {
        version: env!("CARGO_PKG_VERSION").to_string(),
        pid: std::process::id(),
        started: state.started_ms,
        uptime_s: state.started.elapsed().as_secs_f64(),
        state_dir: c.state_dir.clone(),
        socket: c.socket.clone(),
        tcp: state.tcp,
        config_file: c.file.clone(),
        registry_schema: schema,
        functions: counts.functions,
        snapshots: counts.snapshots,
        instances: counts.instances,
        keepalive: c.keepalive.into(),
        queue: c.queue.into(),
        hook: hook_status(&state.runtime.split),
    }))
}

/// What the registry holds of the functions `scope` sees.
fn tenant_counts(
    s: &crate::registry::Store<'_>,
    scope: &crate::tenant::Scope,
) -> Result<crate::registry::Counts, crate::registry::RegistryError> {
    use crate::registry::SnapshotKind;
    let mut counts = crate::registry::Counts::default();
    let stages = s.stage_counts_by_function()?;
    for f in s.functions()?.iter().filter(|f| scope.sees_spec(&f.spec)) {
        counts.functions += 1;
        for stage in crate::registry::Stage::ALL {
            let n = stages.get(&f.name).map_or(0, |c| c.get(*stage));
            counts.instances.add(*stage, n);
        }
        for snap in s.snapshots_of(&f.name)? {
            match snap.kind {
                SnapshotKind::Base => counts.snapshots.base += 1,
                SnapshotKind::Function => counts.snapshots.function += 1,
                SnapshotKind::Hibernation => counts.snapshots.hibernation += 1,
            }
        }
    }
    Ok(counts)
}

fn hook_status(split: &crate::split::Split) -> super::types::HookStatus {
    use crate::split::HookPreload;
    let (lib, using) = split.worker_hook(true);
    super::types::HookStatus {
        library: split.hook_found.clone(),
        worker_copy: split.hook_lib.clone(),
        missing: split.hook_missing.clone(),
        split: split.enabled,
        split_gpu: split.gpu_enabled,
        gpu_workers: match (lib, using.preload) {
            (None, _) | (_, HookPreload::No) => "none",
            (Some(_), HookPreload::Watch) => "watch",
            (Some(_), HookPreload::Segments) => "segments",
        }
        .to_string(),
    }
}
