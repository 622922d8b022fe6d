//! The hot set of a function snapshot (docs/lazy-pages.md, "Hot set"): at deploy, once the
//! function snapshot is recorded and staged, a *profiling restore* brings it back through
//! Torpor's page server recording every range the tree faults in, in order (GPU state the
//! driver's restore reads, then what waking the worker and the spec's warm-up request touch),
//! serving faults only. The tree is then killed, and the server writes the profile to
//! `<state>/profiles/<snapshot id>.pages`. Later restores of that snapshot by Torpor's page
//! server copy those ranges first, in that order, as soon as CRIU's restore finished (before
//! the driver's restore, which waits for them), as gCROP profiles the order GPU data is first
//! used at deploy.
//!
//! A profile that cannot be recorded only costs speed: the deploy goes on and restores serve
//! no hot set. Done only where restores use Torpor's page server (`restore_server.pages`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::protocol::{Invoke, ToWorker};
use crate::runtime::process::{restore_with, wake, HowToRestore, TreeGuard, RECONNECT_TIMEOUT};
use crate::runtime::Runtime;

use crate::profiles::{path, PROFILES_DIR};

/// Why a profile was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the profiling restore failed: {0}")]
    Restore(#[from] crate::runtime::process::RestoreTreeError),
    #[error("the profiling restore's worker did not reconnect: {0}")]
    Wake(#[from] crate::runtime::process::WakeError),
    #[error("the profiling restore's cgroup: {0}")]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error("the profiling restore's warm-up request: {0}")]
    Warmup(String),
    #[error("Torpor's page server did not serve the profiling restore: {0}")]
    Pages(String),
    #[error("cannot keep the profile at {path}: {source}")]
    Keep {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What was recorded.
#[derive(Debug)]
pub struct Recorded {
    /// Ranges in the profile.
    pub ranges: usize,
    /// Bytes they cover.
    pub bytes: u64,
    pub path: PathBuf,
}

/// Records the profile of function snapshot `id` in `dir` (see the module doc), the restored
/// tree writing to `log` (the deploy's). `segments`: the snapshot is split with segments, whose
/// worker would wait for them before a request, so no warm-up request is sent.
pub async fn record(
    rt: &Arc<Runtime>,
    name: &str,
    spec: &Value,
    (dir, id): (&Path, &str),
    segments: bool,
    log: &Path,
) -> Result<Recorded, ProfileError> {
    let out = path(&rt.state_root, id);
    let profiles = rt.state_root.join(PROFILES_DIR);
    std::fs::create_dir_all(&profiles).map_err(|source| ProfileError::Dir {
        path: profiles.clone(),
        source,
    })?;
    let partial = out.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    let cgroup = rt.worker_cgroup(&format!("profile-{name}"), spec)?;
    let how = HowToRestore {
        pages: torpor_snapshot::restore::PageSource::Lazy,
        staged: rt.staging.get(dir),
        cgroup: cgroup
            .as_ref()
            .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files),
        state_dir: Some(rt.state_root.clone()),
        profile_out: Some(partial.clone()),
        ..HowToRestore::default()
    };
    let tree = restore_with(dir, &rt.logs_dir(), log, how, &rt.snapshot_key).await?;
    let guard = TreeGuard(Some(tree.init));
    let Some(pages) = tree.pages else {
        return Err(ProfileError::Pages("the restore was not lazy".into()));
    };
    let warmed = async {
        let mut conn = wake(&rt.hub, tree.worker, RECONNECT_TIMEOUT).await?;
        let request = spec.pointer("/warmup/request").filter(|_| !segments);
        if let Some(request) = request {
            let bound = crate::limits::load_timeout(spec, rt.config.load_timeout);
            let request = serde_json::value::to_raw_value(request)
                .map_err(|e| ProfileError::Warmup(e.to_string()))?;
            conn.send(&ToWorker::Invoke(Invoke {
                id: 0,
                request,
                timeout_s: bound.as_secs_f64(),
                function: None,
                key: None,
                fingerprint: None,
            }))
            .await
            .map_err(|e| ProfileError::Warmup(e.to_string()))?;
            conn.expect("result", bound)
                .await
                .map_err(|e| ProfileError::Warmup(e.to_string()))?;
        }
        Ok::<_, ProfileError>(())
    };
    // A server that dies meanwhile leaves the worker waiting on a fault: stop at once.
    let warmed = tokio::select! {
        w = warmed => w,
        e = pages.failure() => Err(ProfileError::Pages(e.to_string())),
    };
    // The tree is thrown away: the server sees its tasks go, writes the profile and ends.
    torpor_snapshot::restore::kill_every_task(tree.init);
    drop(guard);
    let served = match pages.finish_in_background(|_| {}).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ProfileError::Pages(e.to_string())),
        Err(_) => Err(ProfileError::Pages("the task reaping it ended".into())),
    };
    drop(cgroup);
    warmed?;
    served?;
    let text = std::fs::read_to_string(&partial).unwrap_or_default();
    std::fs::rename(&partial, &out).map_err(|source| ProfileError::Keep {
        path: out.clone(),
        source,
    })?;
    let (mut ranges, mut bytes) = (0, 0u64);
    for line in text.lines() {
        let mut parts = line
            .split_whitespace()
            .map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).unwrap_or(0));
        if let (Some(s), Some(e)) = (parts.next(), parts.next()) {
            ranges += 1;
            bytes += e.saturating_sub(s);
        }
    }
    Ok(Recorded {
        ranges,
        bytes,
        path: out,
    })
}

/// Runs [`record`] as a deploy step, timing it; a failure is logged and otherwise ignored.
pub async fn record_at_deploy(
    rt: &Arc<Runtime>,
    name: &str,
    spec: &Value,
    (dir, id): (&Path, &str),
    segments: bool,
    log: &Path,
) -> Option<(f64, Recorded)> {
    let t = Instant::now();
    match record(rt, name, spec, (dir, id), segments, log).await {
        Ok(r) => {
            tracing::info!(
                function = name,
                snapshot = id,
                ranges = r.ranges,
                bytes = r.bytes,
                "recorded the page profile: restores serve it first"
            );
            Some((t.elapsed().as_secs_f64(), r))
        }
        Err(e) => {
            tracing::warn!(function = name, snapshot = id, error = %e, "recording the page profile failed: restores serve no hot set");
            let _ = std::fs::remove_file(path(&rt.state_root, id).with_extension("partial"));
            None
        }
    }
}
