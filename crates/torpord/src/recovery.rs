//! What a daemon does at start-up about an earlier daemon that died (kill -9, a crash, a power
//! cut) in the middle of its work, so that nothing it started is left running, nothing it was
//! writing is left on disk, and nothing that served stops serving:
//!
//! 1. [`replay_journal`]: each operation of the step journal (crate::journal) is finished or
//!    undone. An interrupted redeploy puts its function back on the deploy that served before
//!    it (ready); an interrupted first deploy ends `failed`, saying so. An interrupted
//!    hibernation is undone while its tree is alive (thawed, its CUDA state resumed, its worker
//!    woken from its quiet point, re-adopted warm or gpu_released), finished when the tree is
//!    gone and the snapshot is complete, sealed and verifies (the instance sleeps), and only
//!    otherwise is the instance removed, with the reason logged. An instance whose migration
//!    was in its stop is removed (its segments' memory died with the daemon). Before the replay, every
//!    process of the earlier daemon outside the trees of live instances is killed (the early
//!    sweep), so that no CRIU of its holds a tree being undone.
//! 2. [`sweep_processes`]: every process the daemon starts carries [`OWNER_ENV`] naming its
//!    state directory in its environment (set by [`mark_children`] and inherited by the
//!    launcher, the workers, CRIU and everything they start; CRIU restores a snapshot's
//!    environment with it). Each such process that is not in the tree of an instance about to
//!    be re-adopted is killed: deploy workers, a worker caught in a dump, CRIU itself.
//! 3. [`sweep_snapshots`]: half-written snapshot directories (`.<id>.partial-<pid>`) and
//!    snapshot directories no registry row names are removed.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::registry::{
    now_ms, FunctionState, JournalEntry, JournalOp, Registry, RegistryError, Snapshot,
    SnapshotKind, Stage,
};

/// The environment variable that marks a process as started by the daemon of a state
/// directory (defined beside the launcher, which keeps it in every worker's environment).
pub use crate::launcher::OWNER_ENV;

/// How long the killed processes get to disappear before their directories are removed.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// The whole environment entry `OWNER_ENV=<owner_value(root)>` that marks the processes of the
/// daemon of `root` (crate::workers::Hub::expect looks for it).
pub fn owner_entry(root: &Path) -> Vec<u8> {
    let mut entry = format!("{OWNER_ENV}=").into_bytes();
    entry.extend_from_slice(owner_value(root).as_bytes());
    entry
}

/// The value of [`OWNER_ENV`] for the state directory `root`.
pub fn owner_value(root: &Path) -> OsString {
    std::fs::canonicalize(root)
        .unwrap_or_else(|_| root.to_path_buf())
        .into_os_string()
}

/// Marks every process this daemon starts from now on as its own (see the module docs). Must
/// be called while the daemon has one thread: the environment is not safe to change while
/// another thread may read it.
pub fn mark_children(root: &Path) {
    std::env::set_var(OWNER_ENV, owner_value(root));
}

/// Whether `environ` (`/proc/PID/environ`: NUL-separated `KEY=VALUE`) holds `OWNER_ENV=owner`.
fn marked(environ: &[u8], owner: &[u8]) -> bool {
    let key = OWNER_ENV.as_bytes();
    environ.split(|b| *b == 0).any(|entry| {
        entry.len() == key.len() + 1 + owner.len()
            && entry.starts_with(key)
            && entry[key.len()] == b'='
            && &entry[key.len() + 1..] == owner
    })
}

/// The processes marked as started by the daemon of `root` (see [`OWNER_ENV`]), other than
/// this one. Zombies have no environment and are not listed.
pub fn marked_processes(root: &Path) -> Vec<i32> {
    let owner = owner_value(root);
    let own = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != own)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| marked(&env, owner.as_bytes()))
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// The parent of `pid` (`/proc/PID/stat` field 4).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is one of `roots` or below one of them.
fn in_trees(pid: i32, roots: &HashSet<i32>) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if roots.contains(&p) {
            return true;
        }
        match parent_of(p) {
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// Kills every process of the daemon of `root` that is not in the tree of one of `keep` (the
/// inits of instances to re-adopt), and waits for them to go. Returns how many it killed.
pub fn sweep_processes(root: &Path, keep: &[i32]) -> usize {
    let keep: HashSet<i32> = keep.iter().copied().collect();
    let doomed: Vec<i32> = marked_processes(root)
        .into_iter()
        .filter(|pid| !in_trees(*pid, &keep))
        .collect();
    for &pid in &doomed {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| {
                String::from_utf8_lossy(&c)
                    .replace('\0', " ")
                    .trim()
                    .to_string()
            })
            .unwrap_or_default();
        // SAFETY: kill(2) only sends a signal, to a process whose environment names this
        // daemon's state directory: one an earlier daemon of it started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        tracing::warn!(pid, command = %cmd, "killed a process an earlier torpord started and left behind");
    }
    let deadline = Instant::now() + KILL_WAIT;
    while doomed.iter().any(|p| crate::workers::alive(*p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(p) = doomed.iter().find(|p| crate::workers::alive(**p)) {
        tracing::error!(pid = *p, "a process an earlier torpord left is still alive {} s after SIGKILL (stuck in the kernel?)", KILL_WAIT.as_secs());
    }
    doomed.len()
}

/// At start-up, before the early sweep: an instance whose pages its page server was still
/// serving when the earlier daemon died is killed and its row removed, never re-adopted. The
/// sweep kills that server (a process of the earlier daemon outside every instance tree), and
/// once the last holder of a uffd closes it the kernel fills the pages it never served with
/// zeros: the instance would run on with zeros where its memory was. Returns how many.
pub fn drop_pages_pending(registry: &Registry, root: &Path) -> Result<usize, RegistryError> {
    let dir = root.join(crate::runtime::pages_pending::DIR);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(0);
    };
    let mut dropped = 0;
    for e in entries.flatten() {
        let id = e.file_name().to_string_lossy().into_owned();
        if let Some(i) = registry.with(|s| s.instance(&id))? {
            if let Some((pid, start)) = registry.with(|s| s.instance_process(&id))? {
                if crate::workers::process_start(pid) == Some(start) {
                    torpor_snapshot::restore::kill_every_task(pid);
                }
            }
            // Woken from a hibernation whose row was kept until its pages were in: it sleeps
            // again, from that snapshot, as it did before the wake.
            let slept = match crate::runtime::pages_pending::hibernation_of(&e.path()) {
                Some(hib) => registry
                    .with(|s| s.snapshot(&hib))?
                    .filter(|snap| snap.path.is_dir())
                    .map(|snap| snap.id),
                None => None,
            };
            if let Some(hib) = slept {
                registry
                    .critical(|s| s.set_instance_stage(&id, Stage::Hibernated, None, Some(&hib)))?;
                tracing::warn!(instance = %id, function = %i.function, snapshot = %hib, "killed a woken instance whose page server was still serving its memory when torpord stopped; it sleeps again from the hibernation it woke from");
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            registry.critical(|s| s.delete_instance(&id).map(|_| ()))?;
            dropped += 1;
            tracing::warn!(instance = %id, function = %i.function, "killed an instance whose page server was still serving its memory when torpord stopped: without it, the pages it had not served would read as zeros");
        }
        let _ = std::fs::remove_file(e.path());
    }
    Ok(dropped)
}

/// Removes, under `<root>/snapshots`, the directories of snapshots half-written by a daemon
/// that died, and the base, function and hibernation snapshots no registry row names.
pub fn sweep_snapshots(registry: &Registry, root: &Path) -> Result<(), RegistryError> {
    let dir = root.join("snapshots");
    match torpor_image::remove_stale_partials(&dir) {
        Ok(removed) => {
            for p in removed {
                tracing::info!(path = %p.display(), "removed a snapshot an earlier torpord was writing when it stopped");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot remove half-written snapshots"),
    }
    let known: HashSet<PathBuf> = registry
        .with(|s| s.snapshots())?
        .into_iter()
        .map(|s| s.path)
        .collect();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        let ours = ["base-", "fn-", "hib-"]
            .iter()
            .any(|p| name.as_bytes().starts_with(p.as_bytes()));
        if ours && e.file_type().is_ok_and(|t| t.is_dir()) && !known.contains(&path) {
            crate::runtime::remove_snapshot_dir(&path);
            tracing::info!(path = %path.display(), "removed a snapshot no registry row names (left by an interrupted deploy or hibernation)");
        }
    }
    Ok(())
}

/// Finishes or undoes each operation the journal says was in progress (see the module docs).
/// `key` checks the snapshot of an interrupted hibernation before it is taken as finished.
pub fn replay_journal(
    registry: &Registry,
    key: &torpor_image::SnapshotKey,
) -> Result<Replayed, RegistryError> {
    let mut replayed = Replayed::default();
    for entry in registry.with(|s| s.journal())? {
        match entry.op {
            JournalOp::Deploy => replay_deploy(registry, &entry)?,
            JournalOp::Hibernate => replay_hibernation(registry, key, &entry, &mut replayed)?,
            JournalOp::Migrate => replay_migration(registry, &entry)?,
        }
        registry.critical(|s| s.journal_end(entry.op, &entry.subject))?;
    }
    Ok(replayed)
}

fn replay_deploy(registry: &Registry, e: &JournalEntry) -> Result<(), RegistryError> {
    let name = e.subject.as_str();
    registry.critical(|s| {
        let Some(mut f) = s.function(name)? else {
            return Ok(());
        };
        let target_id = e
            .target
            .as_deref()
            .and_then(|t| Path::new(t).file_name())
            .map(|n| n.to_string_lossy().into_owned());
        if f.state == FunctionState::Ready
            && f.snapshot.is_some()
            && f.snapshot.as_deref() == target_id.as_deref()
        {
            // Its snapshot was recorded: what was left is what the deploy does once it took
            // effect. Staging is redone at start; the older deploy's instances go here.
            retire_older_instances(s, &f)?;
            tracing::info!(function = name, step = %e.step, "a deploy interrupted by a torpord stop had finished");
            return Ok(());
        }
        let previous = match e.previous.as_deref() {
            Some(id) if f.snapshot.as_deref() == Some(id) => s.snapshot(id)?,
            _ => None,
        };
        f.updated = now_ms();
        match previous {
            Some(p) if p.path.is_dir() => {
                f.state = FunctionState::Ready;
                s.update_function(&f)?;
                tracing::warn!(function = name, step = %e.step, snapshot = %p.id, "a redeploy was interrupted by a torpord stop in its {} step: the previous deploy stays in service; deploy again", e.step);
            }
            _ => {
                f.state = FunctionState::Failed;
                s.update_function(&f)?;
                let message = format!(
                    "its deploy was interrupted in the {} step because torpord stopped: deploy it again",
                    e.step
                );
                s.set_function_failure(name, &message, now_ms())?;
                tracing::warn!(function = name, step = %e.step, "a deploy was interrupted by a torpord stop: the function is failed until deployed again");
            }
        }
        Ok(())
    })
}

/// What a finished deploy does to the instances of the deploy before it (crate::runtime::
/// Runtime::deployed, discard_sleepers_of): live ones restored from an older snapshot are killed
/// and their rows removed, so that none is re-adopted to serve the old code; hibernated ones
/// that began before the deploy took effect are removed (their snapshots go with the sweep of
/// unregistered snapshots).
fn retire_older_instances(
    s: &crate::registry::Store<'_>,
    f: &crate::registry::Function,
) -> Result<(), RegistryError> {
    for i in s.instances_of(&f.name)? {
        let older = if i.stage.has_process() {
            i.snapshot != f.snapshot
        } else {
            i.started <= f.updated
        };
        if !older {
            continue;
        }
        if let Some((pid, start)) = s.instance_process(&i.id)? {
            if crate::workers::process_start(pid) == Some(start) {
                crate::runtime::kill_tree(pid);
            }
        }
        s.delete_instance(&i.id)?;
        if let Some(hib) = i.snapshot.as_deref().filter(|_| !i.stage.has_process()) {
            s.delete_snapshot(hib)?;
        }
        tracing::info!(function = %f.name, instance = %i.id, stage = %i.stage, "removed an instance of the deploy before one that finished as torpord stopped");
    }
    Ok(())
}

/// An interrupted migration's stop (crate::runtime::migrate): from its first step the worker
/// may have released its segments, and their memory (the daemon's, old and new) went with the
/// daemon, so the instance cannot serve again; its tree is killed (a CUDA state the driver held
/// locked or checkpointed goes with it) and its row removed, and the function's next request
/// starts another instance. Nothing of a request is lost: the stop begins once the instance has
/// none in flight.
fn replay_migration(registry: &Registry, e: &JournalEntry) -> Result<(), RegistryError> {
    let id = e.subject.as_str();
    let Some(inst) = registry.with(|s| s.instance(id))? else {
        return Ok(());
    };
    if let Some((pid, start)) = registry.with(|s| s.instance_process(id))? {
        if crate::workers::process_start(pid) == Some(start) {
            crate::runtime::kill_tree(pid);
        }
    }
    registry.critical(|s| s.delete_instance(id).map(|_| ()))?;
    tracing::warn!(instance = id, function = %inst.function, step = %e.step, "a migration was interrupted by a torpord stop in its {} step and its instance removed: its worker had handed its segments over, and their memory went with the earlier torpord (the next request starts another instance)", e.step);
    Ok(())
}

/// What [`replay_journal`] left for the runtime to do once it serves.
#[derive(Debug, Default)]
pub struct Replayed {
    /// Instances whose interrupted hibernation was undone: their worker may wait at its quiet
    /// point (closed, in sigwait), so [`crate::runtime::Runtime::readopt`] wakes each with
    /// SIGUSR2 and takes its `hello` (resumed, not reattach) as the instance reconnecting.
    pub woken: Vec<String>,
}

/// The init pids of the live instances whose recorded process is still there (same pid, same
/// start time): what the early sweep of a restart keeps, before the journal is replayed.
pub fn live_instance_inits(registry: &Registry) -> Result<Vec<i32>, RegistryError> {
    let mut out = Vec::new();
    for i in registry.with(|s| s.instances())? {
        if !i.stage.has_process() {
            continue;
        }
        if let Some((pid, start)) = registry.with(|s| s.instance_process(&i.id))? {
            if crate::workers::process_start(pid) == Some(start) {
                out.push(pid);
            }
        }
    }
    Ok(out)
}

/// Why a snapshot directory an interrupted hibernation wrote cannot be taken as its instance's
/// hibernation, or `None` when it is complete, sealed with this daemon's key and every file
/// matches its manifest.
fn snapshot_refused(dir: &Path, key: &torpor_image::SnapshotKey) -> Option<String> {
    if !dir.join(torpor_image::MANIFEST_FILE).is_file() {
        return Some(format!(
            "{} has no manifest (the dump never finished)",
            dir.display()
        ));
    }
    torpor_image::Snapshot::open(dir)
        .and_then(|s| {
            s.authenticate(torpor_image::Trust::Key(key))?;
            s.verify().map(|_| ())
        })
        .err()
        .map(|e| e.to_string())
}

/// Whether `pid` is a zombie (`/proc/PID/stat` state `Z`): dead, not yet reaped.
fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().next().map(|st| st == "Z")
        })
        .unwrap_or(true)
}

/// SIGCONT to every process of the tree of `init`: a dump freezes the tree with SIGSTOP until
/// its snapshot is committed, and a daemon killed meanwhile leaves it stopped.
fn thaw_tree(init: i32) {
    for pid in torpor_snapshot::proctree::tree(init) {
        // SAFETY: kill(2) only sends a signal, to a process of an instance tree this daemon's
        // registry records (same pid, same start time).
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
}

/// Why an interrupted hibernation could not be undone on the GPU side ([`undo_gpu`]); the
/// driver's own error is kept.
#[derive(Debug, thiserror::Error)]
pub enum UndoGpuError {
    #[error("cannot load the CUDA driver to resume its GPU state: {0}")]
    Load(#[source] torpor_cuda::CudaError),
    #[error("cannot read its CUDA state: {0}")]
    State(#[source] torpor_cuda::CudaError),
    #[error("cannot restore its CUDA state: {0}")]
    Restore(#[source] torpor_cuda::CudaError),
    #[error("cannot unlock its CUDA state: {0}")]
    Unlock(#[source] torpor_cuda::CudaError),
    /// The driver reports the process's checkpoint as failed: nothing can bring it back.
    #[error("the driver failed its CUDA state")]
    Failed,
    /// A split hibernation past `segments`: the worker released its segments to the earlier
    /// daemon, whose copy of them is gone.
    #[error("its worker had handed its segments over, and what the earlier torpord saved of them went with it")]
    SegmentsHandedOver,
}

/// The GPU side of undoing a hibernation: a dump checkpoints the worker's CUDA state in the
/// driver (lock, checkpoint) before CRIU runs; a daemon killed meanwhile leaves it so. Returns
/// the stage the instance is in afterwards (`warm`, or `gpu_released` when it was released on
/// purpose before the hibernation began), or why its GPU state cannot be put back.
fn undo_gpu(worker: i32, stage: Stage) -> Result<Stage, UndoGpuError> {
    // A CPU-only tree never maps libcuda: nothing to undo, and no driver to load.
    if !torpor_snapshot::proctree::maps_libcuda(worker).unwrap_or(false) {
        return Ok(stage);
    }
    let cuda = torpor_cuda::CudaDriver::load().map_err(UndoGpuError::Load)?;
    let state = cuda.process_state(worker).map_err(UndoGpuError::State)?;
    use torpor_cuda::ProcessState as P;
    match state {
        None | Some(P::Running) => Ok(if stage == Stage::GpuReleased {
            Stage::Warm
        } else {
            stage
        }),
        Some(P::Locked) => {
            cuda.unlock(worker).map_err(UndoGpuError::Unlock)?;
            Ok(Stage::Warm)
        }
        Some(P::Checkpointed) if stage == Stage::GpuReleased => Ok(stage),
        Some(P::Checkpointed) => {
            cuda.restore(worker, &[]).map_err(UndoGpuError::Restore)?;
            cuda.unlock(worker).map_err(UndoGpuError::Unlock)?;
            Ok(Stage::Warm)
        }
        Some(P::Failed) => Err(UndoGpuError::Failed),
    }
}

/// An interrupted hibernation (see the module docs): undone while the tree is alive (thawed,
/// its GPU state resumed, re-adopted as it was), finished when the tree is gone and its
/// snapshot complete and verified (the instance sleeps), otherwise dropped with the reason
/// logged. Runs after the early sweep, so that no CRIU of the earlier daemon holds the tree.
fn replay_hibernation(
    registry: &Registry,
    key: &torpor_image::SnapshotKey,
    e: &JournalEntry,
    replayed: &mut Replayed,
) -> Result<(), RegistryError> {
    use crate::journal::hibernation_step as step;
    let id = e.subject.as_str();
    let Some(inst) = registry.with(|s| s.instance(id))? else {
        return Ok(());
    };
    let target = e.target.as_deref().map(PathBuf::from);
    if !inst.stage.has_process() {
        // Its hibernation was recorded.
        return Ok(());
    }
    let remove_target = || {
        if let Some(t) = &target {
            crate::runtime::remove_snapshot_dir(t);
        }
    };
    let process = registry
        .with(|s| s.instance_process(id))?
        .filter(|(pid, start)| crate::workers::process_start(*pid) == Some(*start));
    // The tree lives when its init does (not a zombie: a dump that committed killed it, and
    // nobody reaped it yet) and still has its worker.
    let live = process.and_then(|(init, _)| {
        let worker = crate::launcher::worker_pid(init)
            .ok()
            .filter(|w| !zombie(init) && !zombie(*w));
        if worker.is_none() {
            crate::runtime::kill_tree(init);
        }
        Some(init).zip(worker)
    });
    if let Some((init, worker)) = live {
        thaw_tree(init);
        let undone = if e.step == step::SEGMENTS {
            Err(UndoGpuError::SegmentsHandedOver)
        } else {
            undo_gpu(worker, inst.stage)
        };
        match undone {
            Ok(stage) => {
                if stage != inst.stage {
                    registry.critical(|s| {
                        s.set_instance_stage(id, stage, Some(init), inst.snapshot.as_deref())
                    })?;
                }
                remove_target();
                // It may wait at its quiet point (even at `quiesce`: it may have answered just
                // before the daemon died, before `quiet` was recorded); woken, it reconnects. One
                // that lost its connection earlier reconnects on its own, the SIGUSR2 pending and
                // harmless (blocked, drained at its next quiet).
                replayed.woken.push(id.to_string());
                tracing::warn!(instance = id, function = %inst.function, step = %e.step, pid = init, stage = %stage, "a hibernation interrupted by a torpord stop was undone: the instance is taken back {stage}");
                return Ok(());
            }
            Err(why) => {
                crate::runtime::kill_tree(init);
                registry.critical(|s| s.delete_instance(id).map(|_| ()))?;
                remove_target();
                tracing::warn!(instance = id, function = %inst.function, step = %e.step, "a hibernation was interrupted by a torpord stop and its instance removed: it cannot serve again ({why})");
                return Ok(());
            }
        }
    }
    let refused = match target.as_deref() {
        Some(dir) => snapshot_refused(dir, key),
        None => Some("no snapshot directory was recorded".to_string()),
    };
    match (target.as_deref(), refused) {
        (Some(dir), None) => {
            let hib_id = dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            registry.critical(|s| {
                let base_key = s.function(&inst.function)?.map(|f| f.base_key);
                if s.snapshot(&hib_id)?.is_none() {
                    s.insert_snapshot(&Snapshot {
                        id: hib_id.clone(),
                        kind: SnapshotKind::Hibernation,
                        path: dir.to_path_buf(),
                        function: Some(inst.function.clone()),
                        base_key: base_key.clone(),
                        bytes: crate::runtime::process::dir_bytes(dir),
                        created: now_ms(),
                    })?;
                }
                s.set_instance_stage(id, Stage::Hibernated, None, Some(&hib_id))?;
                Ok(())
            })?;
            tracing::warn!(instance = id, function = %inst.function, snapshot = %dir.display(), "a hibernation interrupted by a torpord stop had written and sealed its snapshot: finished, the instance sleeps");
        }
        (_, why) => {
            registry.critical(|s| s.delete_instance(id).map(|_| ()))?;
            remove_target();
            let why = why.unwrap_or_default();
            tracing::warn!(instance = id, function = %inst.function, step = %e.step, "a hibernation was interrupted by a torpord stop after its process was gone, and its snapshot cannot be used ({why}): the idle instance was removed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_matches_one_whole_entry() {
        let env = b"A=1\0TORPORD_STATE_DIR=/var/lib/torpor\0B=2\0";
        assert!(marked(env, b"/var/lib/torpor"));
        assert!(!marked(env, b"/var/lib/torpo"));
        assert!(!marked(env, b"/var/lib/torpor/x"));
        assert!(!marked(
            b"XTORPORD_STATE_DIR=/var/lib/torpor\0",
            b"/var/lib/torpor"
        ));
        assert!(!marked(b"", b"/var/lib/torpor"));
    }

    #[test]
    fn marked_children_are_found_and_swept() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(OWNER_ENV, owner_value(root))
            .spawn()
            .unwrap();
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .env(OWNER_ENV, "/elsewhere")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Its environment (and so the mark) is /proc's only once it has exec'd: on a loaded
        // machine that is not at once after spawn returns.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while marked_processes(root).is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(marked_processes(root), vec![pid]);
        // Kept when it is the tree of an instance to re-adopt.
        assert_eq!(sweep_processes(root, &[pid]), 0);
        assert!(crate::workers::alive(pid));
        let killed = std::thread::spawn({
            let root = root.to_path_buf();
            move || sweep_processes(&root, &[])
        });
        // Reaped here, so that the sweep sees it go.
        let status = child.wait().unwrap();
        assert_eq!(killed.join().unwrap(), 1);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(
            other.try_wait().unwrap().is_none(),
            "another state directory's process was killed"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
