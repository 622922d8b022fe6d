//! Periodic checkpoints of a long-running job (`torpor run --checkpoint-every SECS --keep N
//! --checkpoints DIR`): every SECS the job is snapshotted with leave-running ([`snapshot`]),
//! the snapshot's files go into a chunk store of the checkpoint directory (content-defined
//! chunks, so a checkpoint stores only the chunks that changed since the ones before it), the
//! snapshot directory is removed, and checkpoints older than the newest N are released and
//! their chunks collected. `torpor restore DIR` materialises the newest one and restores it.
//!
//! # Layout
//!
//! ```text
//! DIR/lock           flock(2): one checkpointer per directory
//! DIR/store/         the chunk store (crate torpor_image::store)
//! DIR/.taking/       the snapshot being taken (removed once it is in the store)
//! DIR/.restore-PID/  a checkpoint materialised for a restore (removed afterwards)
//! ```
//!
//! A checkpoint is the store's snapshot `ckpt-NNNNNNNN` (numbered from 1, never reused): its
//! recipes are every file of the snapshot *and* its `manifest.json` (and `manifest.mac` when
//! sealed), so the store alone gives the snapshot back. A checkpoint is committed whole or not
//! at all (the store's record is written last), so a job killed during a checkpoint leaves the
//! previous one as the newest.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use torpor_image::store::{ChunkStore, PutStats, Recipe, StoreError};
use torpor_image::{SnapshotKey, MAC_FILE, MANIFEST_FILE};

use crate::snapshot::{snapshot, SnapshotError, SnapshotOptions};

/// The prefix of a checkpoint's id in the store.
pub const ID_PREFIX: &str = "ckpt-";
const STORE_DIR: &str = "store";
const LOCK_FILE: &str = "lock";
const TAKING_DIR: &str = ".taking";
/// Where a checkpoint's recipes keep its manifest and seal (a recipe may not be named like the
/// manifest itself): moved back beside the images when it is materialised.
const META_DIR: &str = "torpor-checkpoint";

/// Why a checkpoint directory could not be used, or a checkpoint taken or read back.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The directory could not be created or written.
    #[error("cannot use the checkpoint directory {path}: {source}; pass --checkpoints with a writable directory")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Another checkpointer holds the directory.
    #[error("the checkpoint directory {path} is in use by another `torpor run --checkpoint-every`; give each job a directory of its own")]
    Busy { path: PathBuf },
    /// The path holds no checkpoints.
    #[error("{path} holds no checkpoint (no {STORE_DIR}/ with a committed {ID_PREFIX}* in it); pass the --checkpoints directory of a `torpor run --checkpoint-every` that took one")]
    NoCheckpoint { path: PathBuf },
    /// The checkpoint asked for is not (or no longer) there.
    #[error("{path} has no checkpoint {id} (it holds: {have}); pass one of those, or leave --checkpoint out for the newest")]
    UnknownCheckpoint {
        path: PathBuf,
        id: String,
        have: String,
    },
    /// The chunk store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A snapshot directory could not be read or cleaned.
    #[error(transparent)]
    Image(#[from] torpor_image::ImageError),
    /// The snapshot failed; the job keeps running (the snapshot's own guarantee).
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
}

/// A checkpoint directory, locked for the one job that writes it.
pub struct Checkpoints {
    dir: PathBuf,
    store: ChunkStore,
    _lock: fs::File,
    next: u64,
}

/// One checkpoint that was taken.
#[derive(Debug)]
pub struct Taken {
    /// Its id in the store (`ckpt-NNNNNNNN`).
    pub id: String,
    /// How long the job was stopped.
    pub stop_s: f64,
    /// How long the whole checkpoint took (snapshot, store, prune).
    pub total_s: f64,
    /// The snapshot's size, and what of it was new to the store.
    pub stats: PutStats,
    /// Checkpoints released to keep the newest N.
    pub pruned: Vec<String>,
    /// The snapshot's warnings.
    pub warnings: Vec<String>,
}

fn dir_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Dir {
        path: path.to_path_buf(),
        source,
    }
}

/// The number of a checkpoint id, if it is one.
fn number(id: &str) -> Option<u64> {
    id.strip_prefix(ID_PREFIX)?.parse().ok()
}

/// The committed checkpoints of `store`, oldest first.
fn list(store: &ChunkStore) -> Result<Vec<(u64, String)>, StoreError> {
    let mut ids: Vec<(u64, String)> = store
        .snapshots()?
        .into_iter()
        .filter_map(|id| number(&id).map(|n| (n, id)))
        .collect();
    ids.sort();
    Ok(ids)
}

impl Checkpoints {
    /// Opens (creating) `dir` and takes its lock: one job per directory.
    pub fn open(dir: &Path) -> Result<Checkpoints, CheckpointError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(dir_error(dir))?;
        let dir = std::path::absolute(dir).map_err(dir_error(dir))?;
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))
            .map_err(dir_error(&dir))?;
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(CheckpointError::Busy { path: dir });
        }
        // What a checkpointer that died left half-taken.
        let taking = dir.join(TAKING_DIR);
        if taking.exists() {
            fs::remove_dir_all(&taking).map_err(dir_error(&taking))?;
        }
        torpor_image::remove_stale_partials(&dir)?;
        let store = ChunkStore::open(&dir.join(STORE_DIR))?;
        let next = list(&store)?.last().map_or(1, |(n, _)| n + 1);
        Ok(Checkpoints {
            dir,
            store,
            _lock: lock,
            next,
        })
    }

    /// The directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Snapshots the tree rooted at `pid` (leave-running), stores it as the next checkpoint and
    /// releases all but the newest `keep`. A failure leaves the job running and the checkpoints
    /// that were there.
    pub fn take(
        &mut self,
        pid: i32,
        keep: usize,
        pre_dump_rounds: u32,
        lock_timeout: Duration,
        log_dir: &Path,
        key: Option<&SnapshotKey>,
    ) -> Result<Taken, CheckpointError> {
        let start = Instant::now();
        let id = format!("{ID_PREFIX}{:08}", self.next);
        let out = self.dir.join(TAKING_DIR);
        let report = snapshot(&SnapshotOptions {
            pid,
            out: &out,
            leave_running: true,
            lock_timeout,
            log_dir,
            key,
            state_dir: None,
            pre_dump_rounds,
            durability: torpor_image::Durability::Synced,
            gpu_released: None,
        })?;
        let stored = self.store_dir(&out, &id);
        let _ = fs::remove_dir_all(&out);
        let stats = stored?;
        self.next += 1;
        let pruned = self.prune(keep)?;
        Ok(Taken {
            id,
            stop_s: report.manifest.stop_time_s,
            total_s: start.elapsed().as_secs_f64(),
            stats,
            pruned,
            warnings: report.warnings,
        })
    }

    /// Puts every file of the snapshot in `dir` into the store and commits it as `id`.
    fn store_dir(&self, dir: &Path, id: &str) -> Result<PutStats, CheckpointError> {
        let snap = torpor_image::Snapshot::open(dir)?;
        let mut writer = self.store.writer()?;
        let mut recipes: Vec<Recipe> = Vec::new();
        for f in &snap.manifest().files {
            recipes.push(writer.put_file(&dir.join(&f.path), &f.path)?);
        }
        for name in [MANIFEST_FILE, MAC_FILE] {
            let path = dir.join(name);
            if path.exists() {
                recipes.push(writer.put_file(&path, &format!("{META_DIR}/{name}"))?);
            }
        }
        let stats = writer.stats();
        writer.commit(id, &recipes)?;
        Ok(stats)
    }

    /// Releases every checkpoint but the newest `keep` and collects the chunks none holds.
    fn prune(&self, keep: usize) -> Result<Vec<String>, CheckpointError> {
        let all = list(&self.store)?;
        let old = all.len().saturating_sub(keep.max(1));
        let mut pruned = Vec::new();
        for (_, id) in all.into_iter().take(old) {
            self.store.release(&id)?;
            pruned.push(id);
        }
        if !pruned.is_empty() {
            self.store.try_gc()?;
        }
        Ok(pruned)
    }
}

/// Whether `dir` is a checkpoint directory (rather than a snapshot).
pub fn is_checkpoint_dir(dir: &Path) -> bool {
    dir.join(STORE_DIR).is_dir() && !dir.join(MANIFEST_FILE).exists()
}

/// The ids of the committed checkpoints in `dir`, oldest first.
pub fn ids(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let store = ChunkStore::open_existing(&dir.join(STORE_DIR)).map_err(|_| {
        CheckpointError::NoCheckpoint {
            path: dir.to_path_buf(),
        }
    })?;
    Ok(list(&store)?.into_iter().map(|(_, id)| id).collect())
}

/// The space each committed checkpoint in `dir` takes in its store, oldest first.
pub fn usage(dir: &Path) -> Result<Vec<torpor_image::store::Usage>, CheckpointError> {
    let store = ChunkStore::open_existing(&dir.join(STORE_DIR)).map_err(|_| {
        CheckpointError::NoCheckpoint {
            path: dir.to_path_buf(),
        }
    })?;
    list(&store)?
        .into_iter()
        .map(|(_, id)| store.usage(&id).map_err(CheckpointError::from))
        .collect()
}

/// A checkpoint written back out as a snapshot directory; removed on drop.
pub struct Materialised {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// The checkpoint's id.
    pub id: String,
}

impl Drop for Materialised {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Writes the newest checkpoint in `dir` (or `id`) out as a snapshot directory inside `dir`,
/// ready for [`crate::restore`] (which authenticates and verifies it as any snapshot).
pub fn materialise(dir: &Path, id: Option<&str>) -> Result<Materialised, CheckpointError> {
    let no_checkpoint = || CheckpointError::NoCheckpoint {
        path: dir.to_path_buf(),
    };
    let store = ChunkStore::open_existing(&dir.join(STORE_DIR)).map_err(|_| no_checkpoint())?;
    let all = list(&store)?;
    let id = match id {
        Some(id) => {
            let have: Vec<String> = all.into_iter().map(|(_, i)| i).collect();
            if !have.iter().any(|i| i == id) {
                return Err(CheckpointError::UnknownCheckpoint {
                    path: dir.to_path_buf(),
                    id: id.to_owned(),
                    have: if have.is_empty() {
                        "none".to_owned()
                    } else {
                        have.join(", ")
                    },
                });
            }
            id.to_owned()
        }
        None => all.into_iter().last().ok_or_else(no_checkpoint)?.1,
    };
    let recipes = store.recipes(&id)?;
    let out = dir.join(format!(".restore-{}-{id}", std::process::id()));
    if out.exists() {
        fs::remove_dir_all(&out).map_err(dir_error(&out))?;
    }
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&out)
        .map_err(dir_error(&out))?;
    let materialised = Materialised { dir: out, id };
    store.materialise_all(&recipes, &materialised.dir)?;
    let meta = materialised.dir.join(META_DIR);
    for name in [MANIFEST_FILE, MAC_FILE] {
        let from = meta.join(name);
        if from.exists() {
            fs::rename(&from, materialised.dir.join(name)).map_err(dir_error(&from))?;
        }
    }
    if meta.exists() {
        fs::remove_dir(&meta).map_err(dir_error(&meta))?;
    }
    Ok(materialised)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `dir`, waiting out a lock held only by a child another test of this process forked
    /// in the instant before its exec (the child shares the descriptor until the exec closes it).
    fn reopen(dir: &Path) -> Result<Checkpoints, CheckpointError> {
        for _ in 0..50 {
            match Checkpoints::open(dir) {
                Err(CheckpointError::Busy { .. }) => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                other => return other,
            }
        }
        Checkpoints::open(dir)
    }

    #[test]
    fn numbers_only_checkpoint_ids() {
        assert_eq!(number("ckpt-00000012"), Some(12));
        assert_eq!(number("ckpt-x"), None);
        assert_eq!(number("base"), None);
    }

    #[test]
    fn one_checkpointer_per_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = Checkpoints::open(dir.path()).expect("open");
        assert!(matches!(
            Checkpoints::open(dir.path()),
            Err(CheckpointError::Busy { .. })
        ));
        drop(first);
        reopen(dir.path()).expect("open again once the first is gone");
    }

    #[test]
    fn prune_keeps_the_newest_and_materialise_gives_the_newest_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cps = Checkpoints::open(dir.path()).expect("open");
        for n in 1..=4u8 {
            let mut w = cps.store.writer().expect("writer");
            let r = w.put_bytes("a.img", &[n; 100]).expect("put");
            w.commit(&format!("{ID_PREFIX}{n:08}"), &[r])
                .expect("commit");
        }
        let pruned = cps.prune(2).expect("prune");
        let used = usage(dir.path()).expect("usage");
        assert_eq!(used.len(), 2);
        assert_eq!(
            (used[1].snapshot.as_str(), used[1].logical),
            ("ckpt-00000004", 100)
        );
        assert_eq!(pruned, ["ckpt-00000001", "ckpt-00000002"]);
        assert_eq!(
            ids(dir.path()).expect("ids"),
            ["ckpt-00000003", "ckpt-00000004"]
        );
        let m = materialise(dir.path(), None).expect("materialise");
        assert_eq!(m.id, "ckpt-00000004");
        assert_eq!(fs::read(m.dir.join("a.img")).expect("read"), [4u8; 100]);
        let kept = m.dir.clone();
        drop(m);
        assert!(!kept.exists());
        match materialise(dir.path(), Some("ckpt-00000001")) {
            Err(CheckpointError::UnknownCheckpoint { have, .. }) => {
                assert_eq!(have, "ckpt-00000003, ckpt-00000004")
            }
            other => panic!("{:?}", other.map(|m| m.id.clone())),
        }
        let older = materialise(dir.path(), Some("ckpt-00000003")).expect("an older one");
        assert_eq!(fs::read(older.dir.join("a.img")).expect("read"), [3u8; 100]);
        drop(cps);
        // Reopened, numbering goes on after the newest.
        let reopened = reopen(dir.path());
        assert_eq!(reopened.map(|c| c.next).map_err(|e| e.to_string()), Ok(5));
    }
}
