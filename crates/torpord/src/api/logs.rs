//! `GET /v1/functions/{name}/logs[?lines=N][&instance=ID]`: the tail of each instance's log.
//!
//! Every instance writes its own file, `logs/<function>/<instance id>.log`: a restore hands the
//! restored tree a new stdout and stderr (`torpor restore --log`), a woken instance appends to
//! the file it had, a booted one (`cold_start = "boot"`) is launched with it. A deploy's load
//! phase writes `logs/<function>/_deploy-<unix ms>.log`. See [`crate::instance_logs`] for the
//! layout and the bound on old files. The answer lists the files most recently written first.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{with_registry, ApiError, AppState};
use crate::instance_logs;

/// Lines per file when the query does not say.
pub const DEFAULT_LINES: usize = 200;
/// The most lines per file one request may ask for.
pub const MAX_LINES: usize = 10_000;
/// The most bytes read from the end of each file.
const MAX_TAIL_BYTES: u64 = 4 << 20;

/// One log file's tail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LogFile {
    #[schema(value_type = String)]
    pub path: PathBuf,
    /// The instance that writes it; `None` for the log of a deploy's load phase.
    pub instance: Option<String>,
    /// Its size.
    pub bytes: u64,
    /// When it was last written, Unix milliseconds.
    pub modified_ms: i64,
    /// Its last lines.
    pub tail: String,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FunctionLogs {
    pub function: String,
    /// Most recently written first.
    pub files: Vec<LogFile>,
}

/// The tail of each of the function's log files, most recently written first.
#[utoipa::path(get, path = "/v1/functions/{name}/logs", tag = "functions",
    params(
        ("name" = String, Path, description = "The function's name (its torpor.toml's `name`)."),
        ("lines" = Option<usize>, Query, description = "Lines per file, 1 to 10000 (default 200)"),
        ("instance" = Option<String>, Query, description = "Only this instance's log"),
    ),
    responses(
        (status = 200, description = "The log tails", body = FunctionLogs),
        (status = 400, description = "A query parameter is invalid or unknown", body = super::types::ErrorBody),
        (status = 404, description = "No such function, or no log of that instance", body = super::types::ErrorBody),
    ))]
pub async fn get(
    State(state): State<Arc<AppState>>,
    scope: crate::tenant::Scope,
    super::FunctionName(name): super::FunctionName,
    RawQuery(query): RawQuery,
) -> Result<Json<FunctionLogs>, ApiError> {
    super::visible(&state, &scope, &name).await?;
    let mut lines = DEFAULT_LINES;
    let mut instance: Option<String> = None;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        match pair.split_once('=') {
            Some(("lines", v)) => {
                lines = v.parse().map_err(|_| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        format!("lines must be a number of lines, got {v:?}"),
                    )
                })?;
            }
            Some(("instance", v)) => instance = Some(v.to_string()),
            _ => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                    "unknown query parameter {pair:?}: the only ones are lines=N and instance=ID"
                ),
                ))
            }
        }
    }
    if lines == 0 || lines > MAX_LINES {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("lines must be 1 to {MAX_LINES}, got {lines}"),
        ));
    }
    let logs = state.runtime.logs_dir();
    let n = name.clone();
    with_registry(&state, move |r| {
        r.with(|s| {
            s.function(&n)?.ok_or_else(|| {
                ApiError::not_found(format!("no function named {n:?} (see `torpor ls`)"))
            })
        })
    })
    .await?;
    let function = name.clone();
    let files = tokio::task::spawn_blocking(move || {
        let entries = instance_logs::list(&logs, &function).map_err(|e| {
            ApiError::internal(format!(
                "cannot list {}: {e}",
                instance_logs::function_dir(&logs, &function).display()
            ))
        })?;
        let entries: Vec<_> = match &instance {
            Some(id) => entries
                .into_iter()
                .filter(|e| e.instance.as_deref() == Some(id.as_str()))
                .collect(),
            None => entries,
        };
        if let (Some(id), true) = (&instance, entries.is_empty()) {
            return Err(ApiError::not_found(format!(
                "function {function:?} has no log of an instance {id:?}: see `torpor logs {function}` for its instances"
            )));
        }
        let mut out = Vec::new();
        for e in entries {
            // A file pruned between the listing and the read is skipped.
            if let Some((bytes, tail)) = tail(&e.path, lines).map_err(|e| ApiError::internal(e.to_string()))? {
                let modified_ms = e
                    .modified
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64);
                out.push(LogFile {
                    path: e.path,
                    instance: e.instance,
                    bytes,
                    modified_ms,
                    tail,
                });
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| ApiError::internal(format!("log task failed: {e}")))??;
    Ok(Json(FunctionLogs {
        function: name,
        files,
    }))
}

/// The size and last `lines` lines of `path`, or `None` if it does not exist.
fn tail(path: &FsPath, lines: usize) -> Result<Option<(u64, String)>, TailError> {
    let io = |step: &'static str| {
        move |source| TailError {
            step,
            path: path.to_path_buf(),
            source,
        }
    };
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("open")(e)),
    };
    let bytes = f.metadata().map_err(io("stat"))?.len();
    let start = bytes.saturating_sub(MAX_TAIL_BYTES);
    f.seek(SeekFrom::Start(start)).map_err(io("seek in"))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).map_err(io("read"))?;
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    // A partial first line (the read started mid-file) is dropped.
    let from = all.len().saturating_sub(lines).max(usize::from(start > 0));
    let mut tail = all.get(from..).unwrap_or_default().join("\n");
    if !tail.is_empty() {
        tail.push('\n');
    }
    Ok(Some((bytes, tail)))
}

/// A log file that exists but cannot be read (the answer is a 500 naming it).
#[derive(Debug, thiserror::Error)]
#[error("cannot {step} {}: {source}", path.display())]
struct TailError {
    /// `open`, `stat`, `seek in`, `read`.
    step: &'static str,
    path: std::path::PathBuf,
    #[source]
    source: std::io::Error,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.log");
        assert_eq!(tail(&p, 3).unwrap(), None);
        std::fs::write(&p, "1\n2\n3\n4\n").unwrap();
        assert_eq!(tail(&p, 2).unwrap(), Some((8, "3\n4\n".to_string())));
        assert_eq!(tail(&p, 10).unwrap(), Some((8, "1\n2\n3\n4\n".to_string())));
    }
}
