//! `GET /v1/functions/{name}/logs[?lines=N]`: the tail of the log files its workers write.
//!
//! A worker's stdout and stderr go to the file it was launched with, and a restored copy keeps
//! writing to the file of the process it was snapshotted from. So every instance restored from
//! a function snapshot, or woken from hibernation, writes to its base's log
//! (`logs/base-<hash>.log`, shared with the other functions on that base, marked `shared`);
//! instances booted with `cold_start = "boot"` write to `logs/boot-<name>.log`.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};

use super::{with_registry, ApiError, AppState};

/// Lines per file when the query does not say.
pub const DEFAULT_LINES: usize = 200;
/// The most lines per file one request may ask for.
pub const MAX_LINES: usize = 10_000;
/// The most bytes read from the end of each file.
const MAX_TAIL_BYTES: u64 = 4 << 20;

/// One log file's tail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogFile {
    pub path: PathBuf,
    /// Other functions' workers write to it too (the base's log).
    pub shared: bool,
    /// Its size.
    pub bytes: u64,
    /// Its last lines.
    pub tail: String,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionLogs {
    pub function: String,
    pub files: Vec<LogFile>,
}

pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<FunctionLogs>, ApiError> {
    let mut lines = DEFAULT_LINES;
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
            _ => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter {pair:?}: the only one is lines=N"),
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
    let function = with_registry(&state, move |r| {
        r.with(|s| {
            s.function(&n)?.ok_or_else(|| {
                ApiError::not_found(format!("no function named {n:?} (see `torpor ls`)"))
            })
        })
    })
    .await?;
    let candidates = vec![
        (
            logs.join(format!(
                "base-{}.log",
                crate::deploy::fnv(&function.base_key)
            )),
            true,
        ),
        (logs.join(format!("boot-{name}.log")), false),
    ];
    let files = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for (path, shared) in candidates {
            match tail(&path, lines) {
                Ok(Some((bytes, tail))) => out.push(LogFile {
                    path,
                    shared,
                    bytes,
                    tail,
                }),
                Ok(None) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    })
    .await
    .map_err(|e| ApiError::internal(format!("log task failed: {e}")))?
    .map_err(ApiError::internal)?;
    Ok(Json(FunctionLogs {
        function: name,
        files,
    }))
}

/// The size and last `lines` lines of `path`, or `None` if it does not exist.
fn tail(path: &FsPath, lines: usize) -> Result<Option<(u64, String)>, String> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot open {}: {e}", path.display())),
    };
    let bytes = f
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .len();
    let start = bytes.saturating_sub(MAX_TAIL_BYTES);
    f.seek(SeekFrom::Start(start))
        .map_err(|e| format!("cannot seek in {}: {e}", path.display()))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
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
