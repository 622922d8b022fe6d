//! Hot snapshots in memory (docs/torpord.md, "Staged snapshots"; the measurements behind it are
//! in docs/split.md, "CPU side"). The daemon mounts a tmpfs of its own at `<state>/stage`
//! (mode 0700, huge pages for every full 2 MiB of a file, holding `restore_server.stage_bytes`)
//! and copies each function snapshot into it at deploy, hashing every file on the way
//! (`torpor_snapshot::stage`). Restores of the function read the staged copy and check only its
//! listing and sizes: it was hashed as it was copied and nobody but root can write there since.
//! When the area is full, the least recently restored copy goes; its restores read the disk copy
//! (fully verified) again.
//!
//! - Under the state directory, not /run/torpor: one area per daemon, guarded by the state
//!   directory's lock (the tests run several daemons on one machine), and the state directory is
//!   root-only already.
//! - Trust: the tmpfs is mounted afresh at every start, whatever was mounted there before is
//!   detached first, so a copy a previous daemon left is never read; the function snapshots are
//!   staged again in the background (`Runtime::restage`).
//! - Mount namespaces: workers' namespaces start as copies of the daemon's, and CRIU would dump
//!   a tmpfs it finds there, contents included, into the worker's snapshot. The tmpfs is mounted
//!   with the source name `torpor_snapshot::mounts::STAGE_MOUNT_SOURCE`, which
//!   `torpor_snapshot::launch` detaches from every namespace it creates; it sits on a private
//!   bind mount of its directory so that its mount propagates to no other namespace either.
//! - `huge=within_size`, not `always`: both give the big page images huge pages (the measured
//!   gain), but `always` spends a 2 MiB page on every small file (a CRIU image has dozens).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::IntGauge;
use torpor_snapshot::mounts::STAGE_MOUNT_SOURCE;

use crate::split::cache::Lru;
use crate::sync::lock;

/// The stage area's directory under the state directory.
pub const STAGE_DIR: &str = "stage";

/// A function snapshot staged in memory. Its directory is removed when the last holder lets go
/// (the area, and each restore reading it, hold one).
#[derive(Debug)]
pub struct StagedCopy {
    dir: PathBuf,
    /// Every file is in and was checked (restores take only ready copies).
    ready: AtomicBool,
}

impl StagedCopy {
    /// The staged snapshot directory, to restore from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for StagedCopy {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.dir.display(), error = %e, "cannot remove a staged snapshot copy");
            }
        }
    }
}

/// The daemon's stage area: the tmpfs and the LRU of staged copies, keyed by the disk copy's
/// path.
pub struct StageArea {
    /// Where copies are staged; `None`: staging is off.
    root: Option<PathBuf>,
    /// Mounts to undo at shutdown (the tmpfs, then the bind under it).
    mounted: bool,
    copies: Mutex<Lru<StagedCopy>>,
    next: AtomicU64,
    /// `torpor_stage_bytes`.
    gauge: IntGauge,
    /// Only snapshots it sealed are staged (and their copies keep the seal).
    key: Arc<torpor_image::SnapshotKey>,
}

impl std::fmt::Debug for StageArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageArea")
            .field("root", &self.root)
            .field("used", &self.used())
            .finish()
    }
}

impl StageArea {
    /// Mounts the stage area under `state_root` (detaching whatever an earlier daemon left
    /// there), bounded by `capacity` bytes; `capacity` 0 turns staging off. A kernel that
    /// refuses huge pages on tmpfs gets a plain tmpfs; one that refuses the mount, no staging:
    /// each with one warning line.
    pub fn open(
        state_root: &Path,
        capacity: u64,
        metrics: &crate::metrics::Metrics,
        key: Arc<torpor_image::SnapshotKey>,
    ) -> Self {
        let dir = state_root.join(STAGE_DIR);
        let gauge = stage_gauge(metrics);
        detach_all(&dir);
        if capacity == 0 {
            let _ = std::fs::remove_dir(&dir);
            tracing::info!(
                "staging is off (restore_server.stage_bytes = 0): restores read the disk copies"
            );
            return Self::new(None, false, capacity, gauge, key);
        }
        match mount(&dir, capacity) {
            Ok(huge) => {
                if !huge {
                    tracing::warn!(path = %dir.display(), "this kernel refuses huge pages on tmpfs (huge=within_size): staged snapshots use 4 KiB pages, which makes their restores slower");
                }
                tracing::info!(path = %dir.display(), stage_bytes = capacity, "stage area mounted");
                Self::new(Some(dir), true, capacity, gauge, key)
            }
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "cannot mount the stage area (a tmpfs): restores read the disk copies; set restore_server.stage_bytes = 0 to silence this");
                Self::new(None, false, capacity, gauge, key)
            }
        }
    }

    /// A stage area in an existing directory, not mounted (unit tests).
    #[cfg(test)]
    pub(crate) fn in_dir(dir: &Path, capacity: u64) -> Self {
        let gauge = IntGauge::new("torpor_stage_bytes", "test").expect("valid metric");
        Self::new(
            Some(dir.to_path_buf()),
            false,
            capacity,
            gauge,
            Arc::new(test_key()),
        )
    }

    fn new(
        root: Option<PathBuf>,
        mounted: bool,
        capacity: u64,
        gauge: IntGauge,
        key: Arc<torpor_image::SnapshotKey>,
    ) -> Self {
        gauge.set(0);
        Self {
            root,
            mounted,
            copies: Mutex::new(Lru::new(capacity)),
            next: AtomicU64::new(1),
            gauge,
            key,
        }
    }

    /// The stage area's directory, when staging is on.
    pub fn dir(&self) -> Option<&Path> {
        self.root.as_deref()
    }

    /// Bytes of staged copies (as accounted: each file rounded up to 4 KiB).
    pub fn used(&self) -> u64 {
        lock(&self.copies).used()
    }

    /// Stages the snapshot at `snapshot` (blocking: it copies and hashes every file), dropping
    /// the least recently used copies to make room. `Ok(None)`: not staged (staging off, or
    /// the snapshot is larger than the whole area; logged). On an error nothing is staged and
    /// restores read the disk copy.
    pub fn stage(&self, snapshot: &Path) -> Result<Option<Arc<StagedCopy>>, StageCopyError> {
        let Some(root) = &self.root else {
            return Ok(None);
        };
        let bytes = staged_bytes(snapshot)?;
        let key = key_of(snapshot);
        let name = snapshot
            .file_name()
            .map_or_else(|| "snapshot".into(), |n| n.to_string_lossy().into_owned());
        let copy = Arc::new(StagedCopy {
            dir: root.join(format!(
                "{name}.{}",
                self.next.fetch_add(1, Ordering::Relaxed)
            )),
            ready: AtomicBool::new(false),
        });
        {
            let mut copies = lock(&self.copies);
            let capacity = copies.capacity();
            match copies.insert(&key, Arc::clone(&copy), bytes) {
                None => {
                    tracing::warn!(snapshot = %snapshot.display(), bytes, stage_bytes = capacity, "the snapshot is larger than the stage area: its restores read the disk copy (raise restore_server.stage_bytes to stage it)");
                    return Ok(None);
                }
                Some(evicted) => {
                    for old in evicted {
                        tracing::info!(snapshot = %old, "stage area full: dropped the least recently used staged copy; its restores read the disk copy");
                    }
                }
            }
            self.gauge.set(copies.used() as i64);
        }
        let trust = torpor_image::Trust::Key(&self.key);
        match torpor_snapshot::stage::stage(snapshot, &copy.dir, trust) {
            Ok(staged) => {
                copy.ready.store(true, Ordering::Release);
                tracing::info!(snapshot = %snapshot.display(), path = %copy.dir.display(), bytes = staged.bytes, stage_s = staged.elapsed_s, "snapshot staged");
                Ok(Some(copy))
            }
            Err(e) => {
                self.forget(&key, &copy);
                Err(StageCopyError::Copy {
                    snapshot: snapshot.to_path_buf(),
                    source: Box::new(e),
                })
            }
        }
    }

    /// [`StageArea::stage`], but only into free room: nothing staged is dropped for it (a
    /// daemon's start stages every function again, newest first). Whether it was staged.
    pub fn stage_if_room(&self, snapshot: &Path) -> Result<bool, StageCopyError> {
        let Some(_) = &self.root else {
            return Ok(false);
        };
        let bytes = staged_bytes(snapshot)?;
        {
            let copies = lock(&self.copies);
            if copies.used() + bytes > copies.capacity() {
                tracing::info!(snapshot = %snapshot.display(), bytes, "no room left in the stage area: its restores read the disk copy");
                return Ok(false);
            }
        }
        Ok(self.stage(snapshot)?.is_some())
    }

    /// The staged copy of the snapshot at `snapshot`, if there is a ready one (now the most
    /// recently used). Hold it while restoring from it: a copy dropped meanwhile stays until then.
    pub fn get(&self, snapshot: &Path) -> Option<Arc<StagedCopy>> {
        lock(&self.copies)
            .get(&key_of(snapshot))
            .filter(|c| c.ready.load(Ordering::Acquire))
    }

    /// Whether `snapshot` has a staged copy (ready or being made), without making it the most
    /// recently used: for placement answers, which must not change what gets dropped.
    pub fn contains(&self, snapshot: &Path) -> bool {
        lock(&self.copies).contains(&key_of(snapshot))
    }

    /// Drops the staged copy of `snapshot`, if any (its disk copy is being removed or replaced).
    pub fn remove(&self, snapshot: &Path) {
        let mut copies = lock(&self.copies);
        if copies.remove(&key_of(snapshot)) {
            self.gauge.set(copies.used() as i64);
        }
    }

    /// Drops `copy` from the area if it is still the entry for `key`.
    fn forget(&self, key: &str, copy: &Arc<StagedCopy>) {
        let mut copies = lock(&self.copies);
        if copies.get(key).is_some_and(|c| Arc::ptr_eq(&c, copy)) {
            copies.remove(key);
        }
        self.gauge.set(copies.used() as i64);
    }

    /// At daemon stop: drops every copy and unmounts the area (its memory goes back).
    pub fn shut_down(&self) {
        let Some(root) = &self.root else {
            return;
        };
        {
            let mut copies = lock(&self.copies);
            let capacity = copies.capacity();
            *copies = Lru::new(capacity);
        }
        self.gauge.set(0);
        if self.mounted {
            detach_all(root);
            let _ = std::fs::remove_dir(root);
        }
    }
}

/// Why a snapshot was not staged (its restores read the disk copy).
#[derive(Debug, thiserror::Error)]
pub enum StageCopyError {
    /// The snapshot's manifest cannot be read, so its size is unknown.
    #[error("cannot stage {}: {source}", snapshot.display())]
    Open {
        snapshot: PathBuf,
        #[source]
        source: Box<torpor_image::ImageError>,
    },
    /// Copying (and checking) its files into the stage area failed; nothing of it is staged.
    #[error("cannot stage {}: {source}", snapshot.display())]
    Copy {
        snapshot: PathBuf,
        #[source]
        source: Box<torpor_snapshot::stage::StageError>,
    },
}

/// The key of a snapshot's disk copy.
fn key_of(snapshot: &Path) -> String {
    snapshot.to_string_lossy().into_owned()
}

/// What staging `snapshot` takes on a tmpfs: each file of its manifest, and the manifest,
/// rounded up to 4 KiB pages.
fn staged_bytes(snapshot: &Path) -> Result<u64, StageCopyError> {
    const PAGE: u64 = 4096;
    let opened = torpor_image::Snapshot::open(snapshot).map_err(|e| StageCopyError::Open {
        snapshot: snapshot.to_path_buf(),
        source: Box::new(e),
    })?;
    let size = |name| std::fs::metadata(snapshot.join(name)).map_or(0, |m| m.len());
    let (manifest, mac) = (
        size(torpor_image::MANIFEST_FILE),
        size(torpor_image::MAC_FILE),
    );
    Ok(opened
        .manifest()
        .files
        .iter()
        .map(|f| f.size)
        .chain([manifest, mac])
        .map(|b| b.div_ceil(PAGE) * PAGE)
        .sum())
}

fn stage_gauge(metrics: &crate::metrics::Metrics) -> IntGauge {
    let gauge = IntGauge::new(
        "torpor_stage_bytes",
        "Bytes of function snapshots staged in the daemon's tmpfs (restore_server.stage_bytes bounds it).",
    )
    .expect("the metric's name is valid");
    if let Err(e) = metrics.register(Box::new(gauge.clone())) {
        tracing::warn!(error = %e, "cannot register torpor_stage_bytes");
    }
    gauge
}

fn cstring(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("the path contains a NUL byte"))
}

/// Mounts the stage tmpfs at `dir` on a private bind mount of `dir`. Returns whether it has
/// huge pages.
fn mount(dir: &Path, capacity: u64) -> std::io::Result<bool> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let target = cstring(dir)?;
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    // SAFETY: bind-mounts a directory onto itself; the strings outlive the call.
    check(unsafe {
        libc::mount(
            target.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    })?;
    // SAFETY: changes the propagation of the bind mount just made.
    let private = check(unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_PRIVATE,
            std::ptr::null(),
        )
    });
    if let Err(e) = private {
        detach_all(dir);
        return Err(e);
    }
    // The LRU keeps the copies within `capacity`; the tmpfs has room beyond it for copies
    // dropped while a restore still reads them (they go when it ends).
    let size = capacity.saturating_add((capacity / 8).max(64 << 20));
    let source = CString::new(STAGE_MOUNT_SOURCE).expect("no NUL");
    let tmpfs = c"tmpfs";
    let mut huge = true;
    let mut result = Err(std::io::Error::other("not tried"));
    for options in [
        format!("mode=0700,size={size},huge=within_size"),
        format!("mode=0700,size={size}"),
    ] {
        let data = CString::new(options).expect("no NUL");
        // SAFETY: mounts a new tmpfs at `dir`; every string outlives the call.
        result = check(unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                tmpfs.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                data.as_ptr().cast(),
            )
        });
        match &result {
            Err(e) if huge && e.raw_os_error() == Some(libc::EINVAL) => huge = false,
            _ => break,
        }
    }
    if let Err(e) = result {
        detach_all(dir);
        return Err(e);
    }
    Ok(huge)
}

/// Detaches every mount stacked at `dir` (the stage tmpfs and its bind, of this daemon or an
/// earlier one).
fn detach_all(dir: &Path) {
    let Ok(target) = cstring(dir) else {
        return;
    };
    // A bound number of layers: a detach that keeps succeeding would be a bug, not a loop.
    for _ in 0..16 {
        // SAFETY: detaches a mount at a path of the daemon's own state directory.
        if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
            break;
        }
    }
}

/// The key of the unit tests' stage areas, snapshots and chunk store records.
#[cfg(test)]
pub(crate) fn test_key() -> torpor_image::SnapshotKey {
    torpor_image::SnapshotKey::from_bytes([5; 32], Path::new("test.key"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_image::{Host, Manifest, SnapshotWriter, Source};

    fn snapshot(dir: &Path, name: &str, bytes: usize) -> PathBuf {
        let out = dir.join(name);
        std::fs::create_dir_all(dir).unwrap();
        let writer = SnapshotWriter::create(&out).unwrap();
        std::fs::write(writer.dir().join("pages-1.img"), vec![7u8; bytes]).unwrap();
        std::fs::write(writer.dir().join("core-1.img"), b"c").unwrap();
        let manifest = Manifest::new(
            "test",
            Source {
                command: vec!["test".into()],
                root_pid: 1,
                tree: Vec::new(),
                leave_running: false,
            },
            Host::current("4.2.1").unwrap(),
        );
        writer.finish(manifest, Some(&test_key())).unwrap();
        out
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn copies_are_accounted_in_pages_and_the_least_recently_used_goes() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk");
        let area_dir = tmp.path().join("area");
        std::fs::create_dir_all(&area_dir).unwrap();
        let (a, b, c) = (
            snapshot(&disk, "fn-a", 20_000),
            snapshot(&disk, "fn-b", 20_000),
            snapshot(&disk, "fn-c", 20_000),
        );
        let one = staged_bytes(&a).unwrap();
        // 20 000 bytes → 5 pages, core → 1, manifest → 1, its MAC → 1.
        assert_eq!(one, 8 * 4096);
        let area = StageArea::in_dir(&area_dir, 2 * one);
        let staged_a = area.stage(&a).unwrap().unwrap();
        torpor_image::Snapshot::open(staged_a.dir())
            .unwrap()
            .verify()
            .unwrap();
        drop(staged_a);
        area.stage(&b).unwrap().unwrap();
        assert_eq!(area.used(), 2 * one);
        assert_eq!(area.gauge.get(), (2 * one) as i64);
        // A restore of a makes b the least recently used: c takes b's place.
        let held_a = area.get(&a).unwrap();
        area.stage(&c).unwrap().unwrap();
        assert!(area.get(&b).is_none());
        assert!(area.get(&c).is_some());
        assert_eq!(area.used(), 2 * one);
        assert_eq!(files(&area_dir), vec!["fn-a.1", "fn-c.3"]);
        // A copy dropped while a restore holds it stays until the restore lets go.
        area.remove(&a);
        assert!(area.get(&a).is_none());
        assert_eq!(area.used(), one);
        assert_eq!(files(&area_dir), vec!["fn-a.1", "fn-c.3"]);
        drop(held_a);
        assert_eq!(files(&area_dir), vec!["fn-c.3"]);
    }

    #[test]
    fn a_snapshot_larger_than_the_area_and_a_corrupt_one_are_not_staged() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk");
        let area_dir = tmp.path().join("area");
        std::fs::create_dir_all(&area_dir).unwrap();
        let small = snapshot(&disk, "fn-small", 100);
        let big = snapshot(&disk, "fn-big", 100_000);
        let area = StageArea::in_dir(&area_dir, staged_bytes(&small).unwrap() + 4096);
        area.stage(&small).unwrap().unwrap();
        assert!(area.stage(&big).unwrap().is_none());
        assert!(area.get(&small).is_some(), "the big one evicted nothing");
        let mut bytes = std::fs::read(small.join("pages-1.img")).unwrap();
        bytes[3] ^= 1;
        std::fs::write(small.join("pages-1.img"), bytes).unwrap();
        let err = area.stage(&small).unwrap_err().to_string();
        assert!(err.contains("hash mismatch"), "{err}");
        assert!(area.get(&small).is_none());
        assert_eq!(area.used(), 0);
        assert!(files(&area_dir).is_empty());
    }

    #[test]
    fn a_snapshot_this_key_did_not_seal_is_not_staged() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = snapshot(&tmp.path().join("disk"), "fn-a", 100);
        let area_dir = tmp.path().join("area");
        std::fs::create_dir_all(&area_dir).unwrap();
        let area = StageArea::in_dir(&area_dir, 1 << 20);
        // Rewritten by someone without the key: the manifest no longer matches its MAC.
        let manifest = snap.join(torpor_image::MANIFEST_FILE);
        let text = std::fs::read_to_string(&manifest).unwrap();
        std::fs::write(&manifest, text.replace("\"4.2.1\"", "\"9.9.9\"")).unwrap();
        let err = area.stage(&snap).unwrap_err().to_string();
        assert!(err.contains("changed after its writer sealed it"), "{err}");
        // Without a MAC at all.
        std::fs::write(&manifest, text).unwrap();
        std::fs::remove_file(snap.join(torpor_image::MAC_FILE)).unwrap();
        let err = area.stage(&snap).unwrap_err().to_string();
        assert!(err.contains("carries no MAC"), "{err}");
        assert!(files(&area_dir).is_empty());
    }

    #[test]
    fn staging_off_stages_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = snapshot(tmp.path(), "fn-a", 100);
        let gauge = IntGauge::new("torpor_stage_bytes", "test").unwrap();
        let area = StageArea::new(None, false, 0, gauge, Arc::new(test_key()));
        assert!(area.stage(&snap).unwrap().is_none());
        assert!(area.get(&snap).is_none());
        assert!(area.dir().is_none());
    }
}
