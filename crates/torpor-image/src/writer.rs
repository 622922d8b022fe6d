//! Writing a snapshot so that a half-written one never looks valid.
//!
//! CRIU dumps into a hidden directory next to the output (`.<name>.partial-<pid>`, same
//! filesystem, mode 0700 because it holds process memory). [`SnapshotWriter::finish`] hashes and
//! flushes every file, writes `manifest.json` last, checks the directory once more and renames it
//! to the output in one step. The output therefore either does not exist or is complete with its
//! manifest. If the writer is dropped unfinished the hidden directory is removed; if the process
//! dies before that, [`remove_stale_partials`] removes it later.
//!
//! [`Durability::Deferred`] seals the same way without waiting for the disk: the files are
//! hashed from the page cache and renamed into place, and [`flush_snapshot`] puts them on disk
//! later. Only for a snapshot whose loss after a machine crash costs nothing but time (a
//! hibernated instance, whose wake hashes every file and falls back to the function snapshot):
//! the stop of its source then no longer waits for a write of its whole image.

use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::fs::{self, DirBuilder, File};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::auth::{SnapshotKey, MAC_FILE};
use crate::error::{ImageError, Result};
use crate::hash::{hash_files, Flush};
use crate::manifest::{FileEntry, Manifest, MANIFEST_FILE};
use crate::walk::walk;

/// Name of the manifest while it is being written.
const MANIFEST_TMP_FILE: &str = "manifest.json.tmp";
/// Name of the MAC while it is being written.
const MAC_TMP_FILE: &str = "manifest.mac.tmp";

/// The timing [`SnapshotWriter::finish`] records: hashing the files and flushing them to disk.
pub const HASH_TIMING: &str = "hash_and_write";

/// When a sealed snapshot's bytes must be on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Before [`SnapshotWriter::finish_with`] returns: every file, the manifest and the
    /// directories flushed (a deploy's snapshot, `torpor snapshot`).
    #[default]
    Synced,
    /// Later, by [`flush_snapshot`]: after a machine crash in between, files may be short or
    /// stale, which the manifest's hashes catch on the next restore that verifies them.
    Deferred,
}

/// Marker between the output name and the pid in a partial directory's name.
const PARTIAL_MARKER: &str = ".partial-";

/// A snapshot being written. See the module documentation.
#[derive(Debug)]
pub struct SnapshotWriter {
    /// The final path (absolute).
    out: PathBuf,
    /// The directory holding `out` (absolute).
    parent: PathBuf,
    /// The hidden directory being filled.
    temp: PathBuf,
    /// Set once `temp` has become `out` or has been removed: `Drop` then leaves it alone.
    settled: bool,
}

impl SnapshotWriter {
    /// Starts a snapshot to be stored at `out`, which must not exist yet.
    pub fn create(out: &Path) -> Result<SnapshotWriter> {
        let out = std::path::absolute(out).map_err(|source| ImageError::OutParent {
            parent: out.to_path_buf(),
            source,
        })?;
        let (Some(parent), Some(name)) = (out.parent(), out.file_name()) else {
            return Err(ImageError::OutNoName { out });
        };
        if name == ".." || name == "." {
            return Err(ImageError::OutNoName { out });
        }
        let parent = parent.to_path_buf();
        match fs::metadata(&parent) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(ImageError::OutParent {
                    parent,
                    source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
                })
            }
            Err(source) => return Err(ImageError::OutParent { parent, source }),
        }
        if exists_no_follow(&out) {
            return Err(ImageError::OutExists { out });
        }

        let mut temp_name = OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!("{PARTIAL_MARKER}{}", std::process::id()));
        let temp = parent.join(temp_name);
        match DirBuilder::new().mode(0o700).create(&temp) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(ImageError::PartialInProgress { temp })
            }
            Err(source) => return Err(ImageError::CreateTempDir { temp, source }),
        }
        Ok(SnapshotWriter {
            out,
            parent,
            temp,
            settled: false,
        })
    }

    /// The directory to dump into (hidden, next to the output).
    pub fn dir(&self) -> &Path {
        &self.temp
    }

    /// Where the snapshot will be once finished (absolute).
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// Seals the snapshot and moves it to its output path; returns the manifest as written.
    /// With `key`, `manifest.mac` (the key's MAC of `manifest.json`) is written after the
    /// manifest; without, the snapshot is unkeyed (hashes only).
    ///
    /// `manifest.files` is replaced by the hashed contents of [`dir`](Self::dir), and the timing
    /// [`HASH_TIMING`] is set to the seconds spent hashing and flushing them to disk. On error
    /// nothing is left behind: neither the output nor the hidden directory.
    pub fn finish(self, manifest: Manifest, key: Option<&SnapshotKey>) -> Result<Manifest> {
        self.finish_with(manifest, key, Durability::Synced)
    }

    /// [`finish`](Self::finish), flushing to disk as `durability` says (with
    /// [`Durability::Deferred`], [`HASH_TIMING`] is the hashing alone).
    pub fn finish_with(
        mut self,
        mut manifest: Manifest,
        key: Option<&SnapshotKey>,
        durability: Durability,
    ) -> Result<Manifest> {
        let synced = durability == Durability::Synced;
        // Fail fast on what the caller supplied, before the expensive part.
        manifest.files.clear();
        manifest.validate(&self.temp)?;
        let start = Instant::now();

        let tree = walk(&self.temp)?;
        let listed: Vec<(String, u64)> = tree
            .files
            .into_iter()
            .filter(|f| {
                ![MANIFEST_FILE, MANIFEST_TMP_FILE, MAC_FILE, MAC_TMP_FILE]
                    .contains(&f.rel.as_str())
            })
            .map(|f| (f.rel, f.size))
            .collect();
        let flush = if synced { Flush::Yes } else { Flush::No };
        let hashed = hash_files(&self.temp, &listed, flush);
        let mut files = Vec::with_capacity(listed.len());
        for ((rel, size), result) in listed.into_iter().zip(hashed) {
            let hashed = result?;
            if hashed.len != size {
                return Err(self.changed(
                    &rel,
                    format!("{size} bytes when listed, {} when hashed", hashed.len),
                ));
            }
            files.push(FileEntry {
                path: rel,
                size,
                blake3: hashed.hash.to_hex().to_string(),
            });
        }
        manifest.files = files;
        // Directory entries of the dumped files, then the manifest, written last.
        if synced {
            for dir in tree.dirs.iter().rev() {
                sync_dir(dir)?;
            }
        }
        manifest
            .timings
            .insert(HASH_TIMING.to_owned(), start.elapsed().as_secs_f64());
        manifest.validate(&self.temp)?;
        let json = manifest.to_json()?;
        self.write_manifest(MANIFEST_TMP_FILE, MANIFEST_FILE, &json, synced)?;
        if let Some(key) = key {
            let seal = key.seal(json.as_bytes()).to_json();
            self.write_manifest(MAC_TMP_FILE, MAC_FILE, &seal, synced)?;
        }
        if synced {
            sync_dir(&self.temp)?;
        }

        self.recheck(&manifest)?;

        rename_noreplace(&self.temp, &self.out).map_err(|source| {
            if matches!(source.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) {
                ImageError::OutExists {
                    out: self.out.clone(),
                }
            } else {
                ImageError::Rename {
                    from: self.temp.clone(),
                    to: self.out.clone(),
                    source,
                }
            }
        })?;
        self.settled = true;
        if synced {
            sync_dir(&self.parent)?;
        }
        Ok(manifest)
    }

    /// Abandons the snapshot and removes the hidden directory.
    pub fn abort(mut self) -> Result<()> {
        self.settled = true;
        remove_partial(&self.temp)
    }

    /// Writes `text` to `name` through `tmp_name` (flushed if `sync`, then renamed).
    fn write_manifest(&self, tmp_name: &str, name: &str, text: &str, sync: bool) -> Result<()> {
        let tmp = self.temp.join(tmp_name);
        let write_error = |source| ImageError::WriteManifest {
            path: tmp.clone(),
            source,
        };
        let mut file = File::create(&tmp).map_err(write_error)?;
        file.write_all(text.as_bytes()).map_err(write_error)?;
        if sync {
            file.sync_all().map_err(|source| ImageError::Sync {
                path: tmp.clone(),
                source,
            })?;
        }
        drop(file);
        let path = self.temp.join(name);
        fs::rename(&tmp, &path).map_err(|source| ImageError::Rename {
            from: tmp.clone(),
            to: path,
            source,
        })
    }

    /// The directory must now hold exactly the listed files, with the listed sizes, and the manifest.
    fn recheck(&self, manifest: &Manifest) -> Result<()> {
        let mut expected: BTreeMap<&str, u64> = manifest
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.size))
            .collect();
        for found in walk(&self.temp)?.files {
            if found.rel == MANIFEST_FILE || found.rel == MAC_FILE {
                continue;
            }
            match expected.remove(found.rel.as_str()) {
                Some(size) if size == found.size => {}
                Some(size) => {
                    return Err(self.changed(
                        &found.rel,
                        format!("{size} bytes when hashed, {} now", found.size),
                    ))
                }
                None => return Err(self.changed(&found.rel, "appeared after hashing".into())),
            }
        }
        match expected.into_keys().next() {
            Some(gone) => Err(self.changed(gone, "disappeared after hashing".into())),
            None => Ok(()),
        }
    }

    fn changed(&self, file: &str, detail: String) -> ImageError {
        ImageError::ChangedWhileSealing {
            dir: self.temp.clone(),
            file: file.to_owned(),
            detail,
        }
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.settled {
            // Best effort: an error here has nowhere to go; remove_stale_partials retries later.
            let _ = fs::remove_dir_all(&self.temp);
        }
    }
}

/// Puts a snapshot sealed with [`Durability::Deferred`] on disk: every file, then each
/// directory, then the directory holding it. A file removed meanwhile (the snapshot was
/// restored and discarded) is skipped; a snapshot already gone is not an error. Returns the
/// seconds it took.
///
/// One file after the other, on the caller's thread: a CRIU image is one large pages file and a
/// few small ones, so fsyncs side by side would gain little, and on rayon's shared pool they
/// would hold the threads a restore's hash check needs for as long as the disk takes.
pub fn flush_snapshot(dir: &Path) -> Result<f64> {
    let start = Instant::now();
    let tree = match walk(dir) {
        Ok(tree) => tree,
        Err(_) if !exists_no_follow(dir) => return Ok(start.elapsed().as_secs_f64()),
        Err(e) => return Err(e),
    };
    for f in &tree.files {
        let path = dir.join(&f.rel);
        match File::open(&path) {
            Ok(file) => file
                .sync_all()
                .map_err(|source| ImageError::Sync { path, source })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(ImageError::ReadFile { path, source }),
        }
    }
    for d in tree.dirs.iter().rev() {
        match sync_dir(d) {
            Err(ImageError::Sync { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            other => other?,
        }
    }
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Removes the `.<name>.partial-<pid>` directories in `parent` whose process is gone (left by a
/// torpor that was killed mid-snapshot). Returns what it removed.
///
/// A directory whose pid is alive is kept, even if the pid was reused by another program: keeping
/// garbage is better than deleting a snapshot in progress. Pids are as seen from this process's
/// PID namespace.
pub fn remove_stale_partials(parent: &Path) -> Result<Vec<PathBuf>> {
    let read_dir_error = |source| ImageError::ReadDir {
        path: parent.to_path_buf(),
        source,
    };
    let own_pid = std::process::id();
    let mut removed = Vec::new();
    for entry in fs::read_dir(parent).map_err(read_dir_error)? {
        let entry = entry.map_err(read_dir_error)?;
        let Some(pid) = entry.file_name().to_str().and_then(partial_pid) else {
            continue;
        };
        // file_type does not follow symlinks: a symlink named like a partial is not ours.
        let is_dir = entry.file_type().map_err(read_dir_error)?.is_dir();
        if !is_dir || pid as u32 == own_pid || process_alive(pid) {
            continue;
        }
        let path = entry.path();
        remove_partial(&path)?;
        removed.push(path);
    }
    removed.sort();
    Ok(removed)
}

/// The pid in a `.<name>.partial-<pid>` directory name.
fn partial_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix('.')?;
    let (out_name, pid) = rest.rsplit_once(PARTIAL_MARKER)?;
    if out_name.is_empty() || pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok().filter(|&pid| pid > 0)
}

fn process_alive(pid: i32) -> bool {
    debug_assert!(pid > 0);
    // SAFETY: signal 0 delivers nothing, it only checks that `pid` exists; `pid` > 0 addresses
    // one process, never a process group.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn remove_partial(path: &Path) -> Result<()> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ImageError::RemovePartial {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn exists_no_follow(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| ImageError::Sync {
            path: dir.to_path_buf(),
            source,
        })
}

/// Renames `from` to `to`, failing with `EEXIST` instead of replacing an existing `to` (plain
/// rename(2) silently replaces an empty directory).
fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c_path = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    };
    let (c_from, c_to) = (c_path(from)?, c_path(to)?);
    // SAFETY: both pointers are NUL-terminated strings that live until the call returns;
    // renameat2 does not keep them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            c_from.as_ptr(),
            libc::AT_FDCWD,
            c_to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // Filesystem or kernel without RENAME_NOREPLACE: check, then rename (a small race only
        // with another writer choosing the same output at the same moment).
        Some(libc::EINVAL | libc::ENOSYS) => {
            if exists_no_follow(to) {
                Err(io::Error::from_raw_os_error(libc::EEXIST))
            } else {
                fs::rename(from, to)
            }
        }
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_names() {
        assert_eq!(partial_pid(".snap.partial-123"), Some(123));
        assert_eq!(partial_pid(".a.partial-b.partial-7"), Some(7));
        assert_eq!(partial_pid(".snap.partial-"), None);
        assert_eq!(partial_pid(".snap.partial-0"), None);
        assert_eq!(partial_pid(".snap.partial--1"), None);
        assert_eq!(partial_pid(".snap.partial-1x"), None);
        assert_eq!(partial_pid(".snap.partial-99999999999"), None);
        assert_eq!(partial_pid("snap.partial-12"), None);
        assert_eq!(partial_pid("..partial-12"), None);
    }

    #[test]
    fn create_names_the_hidden_dir_after_the_output() {
        let root = tempfile::tempdir().expect("tempdir");
        let writer = SnapshotWriter::create(&root.path().join("snap")).expect("create");
        let expected = format!(".snap.partial-{}", std::process::id());
        assert_eq!(writer.dir(), root.path().join(&expected));
        assert_eq!(partial_pid(&expected), Some(std::process::id() as i32));
        // A second writer to the same output from this process is refused.
        let err = SnapshotWriter::create(&root.path().join("snap")).expect_err("busy");
        assert!(matches!(err, ImageError::PartialInProgress { .. }), "{err}");
    }

    #[test]
    fn bad_outputs_are_refused() {
        let root = tempfile::tempdir().expect("tempdir");
        let err = SnapshotWriter::create(Path::new("/")).expect_err("root");
        assert!(matches!(err, ImageError::OutNoName { .. }), "{err}");
        let err = SnapshotWriter::create(&root.path().join("x/..")).expect_err("dotdot");
        assert!(matches!(err, ImageError::OutNoName { .. }), "{err}");
        let err = SnapshotWriter::create(&root.path().join("missing/snap")).expect_err("parent");
        assert!(matches!(err, ImageError::OutParent { .. }), "{err}");
        fs::write(root.path().join("file"), b"").expect("write");
        let err = SnapshotWriter::create(&root.path().join("file/snap")).expect_err("file");
        assert!(matches!(err, ImageError::OutParent { .. }), "{err}");
        // A dangling symlink counts as existing.
        std::os::unix::fs::symlink("/nonexistent", root.path().join("link")).expect("symlink");
        let err = SnapshotWriter::create(&root.path().join("link")).expect_err("link");
        assert!(matches!(err, ImageError::OutExists { .. }), "{err}");
    }

    #[test]
    fn rename_noreplace_never_replaces() {
        let root = tempfile::tempdir().expect("tempdir");
        let (a, b) = (root.path().join("a"), root.path().join("b"));
        fs::create_dir(&a).expect("mkdir");
        fs::create_dir(&b).expect("mkdir");
        let err = rename_noreplace(&a, &b).expect_err("exists");
        assert_eq!(err.raw_os_error(), Some(libc::EEXIST));
        assert!(a.is_dir() && b.is_dir());
        fs::remove_dir(&b).expect("rmdir");
        rename_noreplace(&a, &b).expect("rename");
        assert!(!a.exists() && b.is_dir());
    }

    #[test]
    fn own_pid_is_alive() {
        assert!(process_alive(std::process::id() as i32));
    }
}
