//! Where workers' stdout and stderr go, one file per instance:
//!
//! - `logs/<function>/<instance id>.log`: an instance restored from the function snapshot, woken
//!   from hibernation (it appends to the file it had) or booted (`cold_start = "boot"`);
//! - `logs/<function>/_deploy-<unix ms>.log`: the restored base while a deploy loads the function
//!   into it (the function's import, `setup()` and warm-up);
//! - `logs/base-<hash>.log`: a base worker's boot (preloading), shared by the functions on it.
//!
//! A restore hands the restored tree its new file (`torpor restore --log`), so instances of one
//! snapshot never share a file. Instance ids start with the function's name, whose first
//! character is a letter or digit, so they never collide with `_deploy-`.
//!
//! Bound: each time an instance of a function starts, the logs of its instances that no longer
//! exist (no registry row) are cut to the newest [`KEEP_ENDED`], and its deploy logs to the
//! newest [`KEEP_DEPLOYS`]. A live instance's file is never deleted and is not size-capped.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use crate::registry::Registry;

/// Logs of ended instances kept per function.
pub const KEEP_ENDED: usize = 16;
/// Deploy logs kept per function.
pub const KEEP_DEPLOYS: usize = 3;

const DEPLOY_PREFIX: &str = "_deploy-";

/// `logs/<function>`.
pub fn function_dir(logs: &Path, function: &str) -> PathBuf {
    logs.join(function)
}

/// `logs/<function>/<instance>.log`.
pub fn instance_log(logs: &Path, function: &str, instance: &str) -> PathBuf {
    function_dir(logs, function).join(format!("{instance}.log"))
}

/// `logs/<function>/_deploy-<unix ms>.log`.
pub fn deploy_log(logs: &Path, function: &str, unix_ms: i64) -> PathBuf {
    function_dir(logs, function).join(format!("{DEPLOY_PREFIX}{unix_ms}.log"))
}

/// One log file of a function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub path: PathBuf,
    /// The instance that writes it; `None` for a deploy's log.
    pub instance: Option<String>,
    pub modified: SystemTime,
}

/// The function's log files, most recently written first.
pub fn list(logs: &Path, function: &str) -> io::Result<Vec<LogEntry>> {
    let dir = function_dir(logs, function);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".log")) else {
            continue;
        };
        let meta = match entry.metadata() {
            Ok(m) if m.is_file() => m,
            Ok(_) => continue,
            // Pruned or removed meanwhile.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        out.push(LogEntry {
            path: entry.path(),
            instance: (!stem.starts_with(DEPLOY_PREFIX)).then(|| stem.to_string()),
            modified: meta.modified()?,
        });
    }
    out.sort_by(|a, b| b.modified.cmp(&a.modified).then(b.path.cmp(&a.path)));
    Ok(out)
}

/// Deletes the logs of the function's ended instances beyond the newest [`KEEP_ENDED`] and its
/// deploy logs beyond the newest [`KEEP_DEPLOYS`]; `live` are the instances that still exist.
/// Returns how many files went.
pub fn prune(logs: &Path, function: &str, live: &[String]) -> io::Result<usize> {
    let mut ended = 0;
    let mut deploys = 0;
    let mut removed = 0;
    for entry in list(logs, function)? {
        let keep = match &entry.instance {
            Some(id) if live.contains(id) => true,
            Some(_) => {
                ended += 1;
                ended <= KEEP_ENDED
            }
            None => {
                deploys += 1;
                deploys <= KEEP_DEPLOYS
            }
        };
        if keep {
            continue;
        }
        match std::fs::remove_file(&entry.path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// [`prune`] off the async runtime, with the live instances from the registry; a failure is
/// logged, never fatal (it only leaves files behind).
pub fn prune_in_background(registry: Arc<Registry>, logs: PathBuf, function: String) {
    tokio::task::spawn_blocking(move || {
        let live = registry.with(|s| s.instances_of(&function));
        let result = live.map_err(|e| e.to_string()).and_then(|rows| {
            let ids: Vec<String> = rows.into_iter().map(|r| r.id).collect();
            prune(&logs, &function, &ids).map_err(|e| e.to_string())
        });
        if let Err(e) = result {
            tracing::warn!(function = %function, error = %e, "cannot prune old instance logs");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn touch(path: &Path, age_s: u64) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let f = std::fs::File::create(path).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(age_s))
            .unwrap();
    }

    #[test]
    fn lists_newest_first_and_tells_deploys_from_instances() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        assert_eq!(list(logs, "f").unwrap(), Vec::new());
        touch(&instance_log(logs, "f", "f-1-1"), 30);
        touch(&instance_log(logs, "f", "f-2-2"), 10);
        touch(&deploy_log(logs, "f", 5), 20);
        touch(&instance_log(logs, "g", "g-1-1"), 0);
        let got: Vec<Option<String>> = list(logs, "f")
            .unwrap()
            .into_iter()
            .map(|e| e.instance)
            .collect();
        assert_eq!(got, vec![Some("f-2-2".into()), None, Some("f-1-1".into())]);
    }

    #[test]
    fn prune_keeps_live_instances_and_the_newest_ended_ones() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path();
        let n = KEEP_ENDED as u64 + 3;
        // Instance i is i seconds old: f-0 is the newest.
        for i in 0..n {
            touch(&instance_log(logs, "f", &format!("f-{i}")), 100 + i);
        }
        for i in 0..KEEP_DEPLOYS as i64 + 2 {
            touch(&deploy_log(logs, "f", i), 100 + i as u64);
        }
        // The oldest instance still runs.
        let live = vec![format!("f-{}", n - 1)];
        assert_eq!(prune(logs, "f", &live).unwrap(), 2 + 2);
        let left: Vec<Option<String>> = list(logs, "f")
            .unwrap()
            .into_iter()
            .map(|e| e.instance)
            .collect();
        let mut want: Vec<Option<String>> = Vec::new();
        for i in 0..KEEP_ENDED {
            want.push(Some(format!("f-{i}")));
        }
        want.extend(std::iter::repeat_n(None, KEEP_DEPLOYS));
        want.push(Some(format!("f-{}", n - 1)));
        let mut got_sorted = left.clone();
        got_sorted.sort();
        want.sort();
        assert_eq!(got_sorted, want);
        assert!(!deploy_log(logs, "f", KEEP_DEPLOYS as i64 + 1).exists());
        assert!(deploy_log(logs, "f", 0).exists());
    }
}
