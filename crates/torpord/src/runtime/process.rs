//! A worker's process tree: restore it from a snapshot (CRIU, off the async runtime), wake its
//! worker (SIGUSR2 and its `hello`), snapshot it in kill mode, kill it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::runtime::instance::kill_tree;
use crate::runtime::Runtime;
use crate::workers::{ConnError, Hub, WorkerConn};

/// How long a restored worker has to reconnect after SIGUSR2.
pub const RECONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How [`restore_with`] restores: where the pages come from, and the staged copy of the
/// snapshot to read instead of its disk copy.
pub struct HowToRestore {
    pub pages: torpor_snapshot::restore::PageSource,
    /// Restored from with sizes checked only (hashed when staged, on the daemon's root-only
    /// tmpfs since); held until CRIU's lazy-pages daemon has read every page.
    pub staged: Option<Arc<crate::staging::StagedCopy>>,
    /// Skip the driver's restore and unlock: the tree's CUDA state stays locked and
    /// checkpointed, as an in-place GPU release leaves it (a standby instance, crate::runtime::start::standby).
    /// Only the worker may use CUDA then: the GPU resume restores that one process.
    pub leave_gpu_checkpointed: bool,
    /// The tree's cgroup (its `cgroup.procs` files, crate::cgroup::Cgroup::procs_files): CRIU
    /// restores the tree into it. Empty: unconfined.
    pub cgroup: Vec<std::path::PathBuf>,
    /// The daemon's state directory, bound where the snapshot's worker had its daemon's
    /// (`torpor_snapshot::mounts::STATE_DIR_KEY`): a snapshot taken by a daemon with another
    /// state_dir (pulled from the object store) reaches this one. `None`: as recorded.
    pub state_dir: Option<std::path::PathBuf>,
    /// Torpor's page server: the hot set to serve first (a profile recorded at deploy,
    /// crate::runtime::page_profile).
    pub profile_in: Option<std::path::PathBuf>,
    /// Torpor's page server: record the faults' order here, serving faults only (a deploy's
    /// profiling restore, whose tree is thrown away after its warm-up).
    pub profile_out: Option<std::path::PathBuf>,
    /// The daemon's bound on concurrent driver restores (Runtime::gpu_restore_slots).
    pub gpu_restore_slots: Option<Arc<torpor_snapshot::gpu_restore_slots::GpuRestoreSlots>>,
    /// The lane of `gpu_restore_slots` the restore waits in (the GPU it restores onto with
    /// per-GPU lanes; crate::runtime::device_choice).
    pub gpu_lane: u32,
    /// Its driver restore alone on the node (the first start of a function with nothing live).
    pub gpu_alone: bool,
    /// Which of the node's GPUs take over the snapshot's (a cold start placed on another GPU
    /// than the deploy's, crate::runtime::device_choice); empty: the snapshot's own.
    pub gpu_map: Vec<torpor_snapshot::gpu_map::GpuMapping>,
    /// Torpor's page server: threads of its background copy (`restore_server.background_threads`);
    /// `None`: the server's default.
    pub background_threads: Option<usize>,
    /// Read ahead the file pages CRIU's restore reads (`restore_server.prefetch_file_pages`;
    /// on by default).
    pub prefetch_file_pages: bool,
}

impl Default for HowToRestore {
    fn default() -> Self {
        Self {
            pages: torpor_snapshot::restore::PageSource::default(),
            staged: None,
            leave_gpu_checkpointed: false,
            cgroup: Vec::new(),
            state_dir: None,
            profile_in: None,
            profile_out: None,
            gpu_restore_slots: None,
            gpu_lane: 0,
            gpu_alone: false,
            gpu_map: Vec::new(),
            background_threads: None,
            prefetch_file_pages: true,
        }
    }
}

/// A restored tree.
pub struct RestoredTree {
    pub init: i32,
    pub worker: i32,
    /// With lazy pages: the daemon still serving them.
    pub pages: Option<PendingPages>,
    /// The restore's own phases (open, criu_restore, cuda_restore, ...), for the request's
    /// timings: "restore" alone cannot say where a cold start's time went.
    pub phases: torpor_snapshot::phases::Phases,
    /// With `leave_gpu_checkpointed`: the GPU pairs its driver restore must pass (empty: none).
    pub gpu_pairs: Vec<(torpor_cuda::GpuUuid, torpor_cuda::GpuUuid)>,
}

/// CRIU's lazy-pages daemon serving a restored tree, and the staged copy it reads from. Dropped
/// unfinished (the start of the instance failed and its tree was killed), the daemon is stopped
/// and reaped on a blocking thread.
pub struct PendingPages {
    lazy: Option<torpor_snapshot::restore::LazyRestore>,
    staged: Option<Arc<crate::staging::StagedCopy>>,
}

impl PendingPages {
    /// Reaps the daemon on a blocking thread once it has served every page; the answer says
    /// whether it did (if not, the tree was killed). A failure is first handed to `failed`, on
    /// that thread, before the tree is killed: the instance's removal names the cause rather
    /// than a worker that died.
    pub fn finish_in_background(
        mut self,
        failed: impl FnOnce(&torpor_snapshot::restore::RestoreError) + Send + 'static,
    ) -> oneshot::Receiver<Result<(), torpor_snapshot::restore::RestoreError>> {
        let (tx, rx) = oneshot::channel();
        let (lazy, staged) = (self.lazy.take(), self.staged.take());
        tokio::task::spawn_blocking(move || {
            let served = lazy.map_or(Ok(()), |l| l.finish_or(failed));
            let _ = tx.send(served);
            // The staged copy may go now: every page was read.
            drop(staged);
        });
        rx
    }
}

impl PendingPages {
    /// Resolves once the page server has exited failing, with its error (the restored tree may
    /// then miss pages: its faults wait, the uffds being held, until the caller kills it); never
    /// while it serves, nor once it has served every page. For a wait on the restored worker
    /// (its wake), which would otherwise time out on a fault nobody serves.
    pub async fn failure(&self) -> torpor_snapshot::restore::RestoreError {
        loop {
            match self.lazy.as_ref().map(|l| l.server_exited()) {
                Some(Err(source)) => {
                    return torpor_snapshot::restore::RestoreError::LazyPages { source }
                }
                Some(Ok(false)) => {}
                Some(Ok(true)) | None => std::future::pending::<()>().await,
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PendingPages {
    fn drop(&mut self) {
        if let Some(lazy) = self.lazy.take() {
            let staged = self.staged.take();
            tokio::task::spawn_blocking(move || {
                lazy.abandon();
                drop(staged);
            });
        }
    }
}

/// Why a worker tree could not be restored from a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum RestoreTreeError {
    /// CRIU, or a check of the snapshot, failed (names CRIU's log where it has one).
    #[error(transparent)]
    Restore(#[from] torpor_snapshot::restore::RestoreError),
    /// A standby restore leaves CUDA checkpointed, and only one process can be resumed.
    #[error(
        "the snapshot has {cuda} CUDA processes; a standby instance resumes only the worker's: \
         set scaling.standby = 0"
    )]
    CudaProcesses { cuda: usize },
    /// The restored tree has no worker under its init (it was killed).
    #[error(transparent)]
    NoWorker(#[from] crate::launcher::LaunchError),
    /// The blocking task running the restore panicked or was cancelled.
    #[error("restore task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The marker of an instance whose lazy pages are pending could not be written (the
    /// restored tree was killed: a crash of the daemon would otherwise re-adopt it).
    #[error("cannot mark the instance's lazy pages pending in the state directory: {0}; free space on its filesystem")]
    PagesPending(std::io::Error),
}

impl RestoreTreeError {
    /// Whether the restore found too little free GPU memory: its own check before any process
    /// was restored, or the driver's restore answering out of memory (the node's GPU, not the
    /// snapshot, at fault).
    pub fn short_of_gpu_memory(&self) -> bool {
        use torpor_snapshot::restore::RestoreError;
        match self {
            RestoreTreeError::Restore(RestoreError::NoRoom { .. }) => true,
            RestoreTreeError::Restore(RestoreError::Gpu { source }) => {
                source.source.is_out_of_memory()
            }
            _ => false,
        }
    }
}

/// Why a restored worker did not come back.
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// SIGUSR2 could not be sent; `errno` is kill(2)'s.
    #[error("cannot signal worker {worker}: {}", std::io::Error::from_raw_os_error(*errno))]
    Signal { worker: i32, errno: i32 },
    /// It did not say hello in time, or its connection broke.
    #[error(transparent)]
    Hello(#[from] ConnError),
    /// It said hello as a fresh worker, not a restored one.
    #[error("its hello says resumed: false")]
    NotResumed,
}

/// Why a worker tree could not be snapshotted.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotTreeError {
    /// CRIU, or the CUDA checkpoint, failed (names CRIU's log where it has one). Every caller
    /// stops the source then, so the message says so (the library's "pid N keeps running"
    /// would be untrue here).
    #[error("{}; no snapshot was written and its process (pid {pid}) was stopped", cause_of(.source))]
    Snapshot {
        pid: i32,
        source: torpor_snapshot::snapshot::SnapshotError,
    },
    /// The blocking task running the snapshot panicked or was cancelled.
    #[error("snapshot task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Restores a snapshot detached into `cgroup` (its `cgroup.procs` files; empty: unconfined),
/// every page copied and every file hashed first; returns (init, worker). See [`restore_with`].
pub async fn restore(
    dir: &Path,
    log_dir: &Path,
    stdio: &Path,
    key: &Arc<torpor_image::SnapshotKey>,
    cgroup: Vec<std::path::PathBuf>,
    state_dir: &Path,
) -> Result<(i32, i32), RestoreTreeError> {
    let how = HowToRestore {
        cgroup,
        state_dir: Some(state_dir.to_path_buf()),
        ..HowToRestore::default()
    };
    let tree = restore_with(dir, log_dir, stdio, how, key).await?;
    Ok((tree.init, tree.worker))
}

/// Restores a snapshot (or its staged copy) detached (blocking work on the blocking pool), its
/// stdout and stderr going to `stdio`; one that `key` did not seal is refused. A snapshot that
/// does not record its stdio files (taken
/// by an older torpord) is restored onto the files it had, with a warning. With lazy pages, a
/// blocking thread reaps CRIU's lazy-pages daemon once it has served every page.
pub async fn restore_with(
    dir: &Path,
    log_dir: &Path,
    stdio: &Path,
    how: HowToRestore,
    key: &Arc<torpor_image::SnapshotKey>,
) -> Result<RestoredTree, RestoreTreeError> {
    use torpor_snapshot::restore::{PageOptions, RestoreError, RestoreOptions, Verify};
    let (dir, verify) = match &how.staged {
        Some(copy) => (copy.dir().to_path_buf(), Verify::SizesOnly),
        None => (dir.to_path_buf(), Verify::Hashes),
    };
    let log_dir = log_dir.to_path_buf();
    let stdio = stdio.to_path_buf();
    let key = Arc::clone(key);
    tokio::task::spawn_blocking(move || {
        let pages = PageOptions {
            source: how.pages,
            profile_in: how.profile_in.clone(),
            faults_only: how.profile_out.is_some(),
            profile_out: how.profile_out.clone(),
            background_threads: how.background_threads,
            prefetch_file_pages: how.prefetch_file_pages,
        };
        // The state directory, and each of its directories an unprivileged worker has bound in.
        let owned: Vec<(String, std::path::PathBuf)> = how
            .state_dir
            .as_deref()
            .map(|d| {
                let pieces = crate::launcher::WORKER_STATE_DIRS.iter().map(|name| {
                    (
                        torpor_snapshot::mounts::state_dir_piece_key(name),
                        d.join(name),
                    )
                });
                std::iter::once((torpor_snapshot::mounts::STATE_DIR_KEY.to_owned(), d.to_path_buf()))
                    .chain(pieces)
                    .collect()
            })
            .unwrap_or_default();
        let sources: Vec<(&str, &Path)> = owned
            .iter()
            .map(|(k, p)| (k.as_str(), p.as_path()))
            .collect();
        let restore_onto = |stdio: Option<&Path>| {
            torpor_snapshot::restore::restore_with(
                &RestoreOptions {
                    dir: &dir,
                    detach: true,
                    gpu_map: &how.gpu_map,
                    log_dir: &log_dir,
                    stdio,
                    verify,
                    trust: torpor_image::Trust::Key(&key),
                    resume_gpu: !how.leave_gpu_checkpointed,
                    cgroup: &how.cgroup,
                    external_sources: &sources,
                    gpu_restore_slots: how.gpu_restore_slots.as_deref(),
                    gpu_lane: how.gpu_lane,
                    gpu_alone: how.gpu_alone,
                },
                &pages,
            )
        };
        let restored = match restore_onto(Some(&stdio)) {
            Err(RestoreError::StdioUnknown) => {
                tracing::warn!(snapshot = %dir.display(), "the snapshot records no stdout/stderr file: its instance keeps writing to the old log");
                restore_onto(None)
            }
            other => other,
        }?;
        let init = restored.pid;
        let phases = restored.phases;
        let gpu_pairs = restored.gpu_pairs;
        let cuda = restored.manifest.source.tree.iter().filter(|p| p.cuda).count();
        if how.leave_gpu_checkpointed && cuda > 1 {
            kill_tree(init);
            return Err(RestoreTreeError::CudaProcesses { cuda });
        }
        let pages = restored.lazy_pages.map(|lazy| PendingPages {
            lazy: Some(lazy),
            staged: how.staged,
        });
        match crate::launcher::worker_pid(init) {
            Ok(worker) => Ok(RestoredTree {
                init,
                worker,
                pages,
                phases,
                gpu_pairs,
            }),
            Err(e) => {
                kill_tree(init);
                Err(e.into())
            }
        }
    })
    .await?
}

impl Runtime {
    /// Wakes a restored worker (`what` names it in errors) and checks that it is an instance of
    /// `name`; its tree is killed otherwise.
    pub(crate) async fn wake_function(
        &self,
        name: &str,
        init: i32,
        worker: i32,
        what: &str,
    ) -> Result<WorkerConn, WakeFunctionError> {
        let conn = match wake(&self.hub, worker, RECONNECT_TIMEOUT).await {
            Ok(c) => c,
            Err(source) => {
                kill_tree(init);
                return Err(WakeFunctionError::Reconnect {
                    what: what.to_string(),
                    source,
                });
            }
        };
        if conn.hello.role != "function" || conn.hello.function.as_deref() != Some(name) {
            kill_tree(init);
            return Err(WakeFunctionError::NotThisFunction {
                what: what.to_string(),
                serves: conn.hello.function.clone(),
                role: conn.hello.role.clone(),
                function: name.to_string(),
            });
        }
        Ok(conn)
    }
}

/// Why a restored instance's worker did not come back as an instance of its function (its tree
/// was killed).
#[derive(Debug, thiserror::Error)]
pub enum WakeFunctionError {
    /// It did not come back (`what` names the instance and its snapshot).
    #[error("{what} did not reconnect: {source}")]
    Reconnect {
        what: String,
        #[source]
        source: WakeError,
    },
    /// It came back as something else: the snapshot is another function's.
    #[error(
        "{what} says it serves {serves:?} (role {role}), not {function:?}: the snapshot is not \
         this function's; deploy it again"
    )]
    NotThisFunction {
        what: String,
        serves: Option<String>,
        role: String,
        function: String,
    },
}

/// SIGUSR2 to a restored (or just snapshotted) worker, and its connection once it says hello
/// with `resumed: true`.
pub async fn wake(hub: &Arc<Hub>, worker: i32, timeout: Duration) -> Result<WorkerConn, WakeError> {
    let claim = hub.claim(worker);
    // SAFETY: kill(2) only sends a signal to the worker this daemon restored.
    if unsafe { libc::kill(worker, libc::SIGUSR2) } != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        return Err(WakeError::Signal { worker, errno });
    }
    let conn = claim.wait(timeout).await?;
    if !conn.hello.resumed {
        return Err(WakeError::NotResumed);
    }
    Ok(conn)
}

/// How long a worker has to answer `quiesce` and close its connection.
pub(crate) const QUIET_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the snapshot waits for in-flight CUDA work when locking.
pub(crate) const CUDA_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// What failed in a snapshot, without the library's word on the source's fate.
fn cause_of(e: &torpor_snapshot::snapshot::SnapshotError) -> String {
    use torpor_snapshot::snapshot::SnapshotError as E;
    match e {
        E::Gpu { source, .. } => source.to_string(),
        E::Dump { source, .. } => source.to_string(),
        E::Write { source, .. } => source.to_string(),
        E::Interrupted { .. } => "interrupted".to_string(),
        E::DiskFull { space, .. } => space.to_string(),
        other => other.to_string(),
    }
}

impl Runtime {
    /// Snapshots the quiet worker tree rooted at `pid` into `out` in kill mode (the source is
    /// gone afterwards), off the async runtime: `torpor_snapshot::snapshot` blocks for seconds.
    /// CRIU's logs go to the daemon's log directory; the snapshot is sealed with the daemon's
    /// key, so that restores can tell it from a snapshot the daemon did not write. `durability`:
    /// whether the snapshot is on disk when this returns (torpor_image::Durability).
    /// Returns the snapshot's phases (torpor_snapshot::phases), in the order they ran.
    pub async fn snapshot_and_kill(
        &self,
        pid: i32,
        out: &Path,
        durability: torpor_image::Durability,
    ) -> Result<Vec<(String, f64)>, SnapshotTreeError> {
        self.snapshot_released_and_kill(pid, out, durability, None)
            .await
    }

    /// [`Runtime::snapshot_and_kill`] of a tree whose CUDA process may be checkpointed in place
    /// already (a gpu_released instance; `gpu_released`: what it held on each GPU before,
    /// torpor_snapshot's `SnapshotOptions::gpu_released`).
    pub async fn snapshot_released_and_kill(
        &self,
        pid: i32,
        out: &Path,
        durability: torpor_image::Durability,
        gpu_released: Option<Vec<(torpor_cuda::GpuUuid, u64)>>,
    ) -> Result<Vec<(String, f64)>, SnapshotTreeError> {
        snapshot_and_kill(
            pid,
            out,
            &self.logs_dir(),
            &self.snapshot_key,
            &self.state_root,
            durability,
            gpu_released,
        )
        .await
    }
}

/// [`Runtime::snapshot_and_kill`], with the log directory and key given.
async fn snapshot_and_kill(
    pid: i32,
    out: &Path,
    log_dir: &Path,
    key: &Arc<torpor_image::SnapshotKey>,
    state_dir: &Path,
    durability: torpor_image::Durability,
    gpu_released: Option<Vec<(torpor_cuda::GpuUuid, u64)>>,
) -> Result<Vec<(String, f64)>, SnapshotTreeError> {
    let (out, log_dir, key) = (out.to_path_buf(), log_dir.to_path_buf(), Arc::clone(key));
    let state_dir = state_dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        torpor_snapshot::snapshot::snapshot(&torpor_snapshot::snapshot::SnapshotOptions {
            pid,
            out: &out,
            leave_running: false,
            lock_timeout: CUDA_LOCK_TIMEOUT,
            log_dir: &log_dir,
            key: Some(&key),
            state_dir: Some(&state_dir),
            pre_dump_rounds: 0,
            durability,
            gpu_released: gpu_released.as_deref(),
        })
        .map(|report| report.phases.0)
        .map_err(|source| SnapshotTreeError::Snapshot { pid, source })
    })
    .await?
}

/// The bytes of the files under `dir`, recursively.
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Kills a worker tree unless defused.
pub struct TreeGuard(pub Option<i32>);

impl Drop for TreeGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            kill_tree(pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_snapshot_says_its_source_was_stopped() {
        let source = torpor_snapshot::snapshot::SnapshotError::Interrupted { root: 4242 };
        assert!(source.to_string().contains("keeps running"));
        let msg = SnapshotTreeError::Snapshot { pid: 4242, source }.to_string();
        assert!(!msg.contains("keeps running"), "{msg}");
        assert!(msg.contains("(pid 4242) was stopped"), "{msg}");
    }
}
