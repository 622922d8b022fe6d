//! Staging a snapshot in memory: copy its files into a tmpfs directory (e.g. under
//! `/dev/shm/torpor`) so that restores read the CRIU images from RAM, never from disk.
//!
//! Integrity: every file is hashed *while* it is copied (or, when a hard link was possible
//! because source and target share a filesystem, hashed from the link) and compared with the
//! manifest, and the manifest is written last; a staged copy that does not match is removed.
//! The staged directory is itself a snapshot, so a later restore from it verifies it again.
//! The source's MAC is checked first (`trust`), and the copy gets the manifest and MAC exactly
//! as they were read and checked, so a staged copy is sealed by the same key as its source.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use torpor_image::{ImageError, Snapshot, Trust};

/// The default base directory for staged snapshots (a tmpfs on every Linux with glibc).
pub const DEFAULT_STAGE_BASE: &str = "/dev/shm/torpor";

/// Why staging failed. Nothing half-staged is left behind.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The source snapshot could not be opened, or a file did not match its manifest.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The target exists already.
    #[error("staging target {path} exists already: remove it or pick another path")]
    TargetExists { path: PathBuf },
    /// Reading, writing or linking a file failed.
    #[error("cannot stage {path}: {source}; check free space in the target filesystem (df) and its permissions")]
    Io { path: PathBuf, source: io::Error },
}

/// A snapshot copied into memory.
#[derive(Debug, Clone)]
pub struct Staged {
    /// The staged snapshot directory.
    pub dir: PathBuf,
    /// Files staged and their total size.
    pub files: usize,
    pub bytes: u64,
    /// Files hard-linked instead of copied (source on the same filesystem).
    pub linked: usize,
    pub elapsed_s: f64,
}

/// Copies (or hard-links) the snapshot at `src` into `target`, which must not exist, checking
/// every file against the manifest on the way, after the manifest's MAC against `trust`. On any
/// failure `target` is removed.
pub fn stage(src: &Path, target: &Path, trust: Trust) -> Result<Staged, StageError> {
    let start = Instant::now();
    let snapshot = Snapshot::open(src)?;
    snapshot.authenticate(trust)?;
    if fs::symlink_metadata(target).is_ok() {
        return Err(StageError::TargetExists {
            path: target.to_path_buf(),
        });
    }
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StageError::Io { path, source }
    };
    if let Some(parent) = target.parent() {
        fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    fs::create_dir(target).map_err(io_err(target))?;
    match stage_files(&snapshot, target) {
        Ok(linked) => Ok(Staged {
            dir: target.to_path_buf(),
            files: snapshot.manifest().files.len(),
            bytes: snapshot.manifest().total_size(),
            linked,
            elapsed_s: start.elapsed().as_secs_f64(),
        }),
        Err(e) => {
            let _ = fs::remove_dir_all(target);
            Err(e)
        }
    }
}

/// Stages every listed file, then the manifest; returns how many files were hard-linked.
fn stage_files(snapshot: &Snapshot, target: &Path) -> Result<usize, StageError> {
    let src = snapshot.dir();
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StageError::Io { path, source }
    };
    let target_dev = fs::metadata(target).map_err(io_err(target))?.dev();
    let mut linked = 0;
    for entry in &snapshot.manifest().files {
        let from = src.join(&entry.path);
        let to = target.join(&entry.path);
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let meta = fs::metadata(&from).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => StageError::Image(ImageError::MissingFile {
                dir: src.to_path_buf(),
                file: entry.path.clone(),
            }),
            _ => StageError::Io {
                path: from.clone(),
                source: e,
            },
        })?;
        let (len, hash) = if meta.dev() == target_dev && fs::hard_link(&from, &to).is_ok() {
            linked += 1;
            copy_hashing(&from, None)?
        } else {
            copy_hashing(&from, Some(&to))?
        };
        if len != entry.size {
            return Err(ImageError::SizeMismatch {
                dir: src.to_path_buf(),
                file: entry.path.clone(),
                expected: entry.size,
                actual: len,
            }
            .into());
        }
        let actual = hash.to_hex();
        if actual.as_str() != entry.blake3 {
            return Err(ImageError::HashMismatch {
                dir: src.to_path_buf(),
                file: entry.path.clone(),
                expected: entry.blake3.clone(),
                actual: actual.to_string(),
            }
            .into());
        }
    }
    // The manifest last: a staged directory without one is never taken for a snapshot.
    snapshot
        .write_manifest_into(target)
        .map_err(io_err(target))?;
    Ok(linked)
}

/// Reads `from` once, hashing it, and writes the bytes to `to` when given.
fn copy_hashing(from: &Path, to: Option<&Path>) -> Result<(u64, blake3::Hash), StageError> {
    let read_err = |source| StageError::Io {
        path: from.to_path_buf(),
        source,
    };
    let mut input = File::open(from).map_err(read_err)?;
    let mut output = match to {
        Some(to) => Some(File::create_new(to).map_err(|source| StageError::Io {
            path: to.to_path_buf(),
            source,
        })?),
        None => None,
    };
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut len = 0u64;
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_err(e)),
        };
        hasher.update(&buf[..n]);
        if let (Some(out), Some(to)) = (output.as_mut(), to) {
            out.write_all(&buf[..n]).map_err(|source| StageError::Io {
                path: to.to_path_buf(),
                source,
            })?;
        }
        len += n as u64;
    }
    Ok((len, hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_image::{Host, Manifest, SnapshotKey, SnapshotWriter, Source};

    fn key() -> SnapshotKey {
        SnapshotKey::from_bytes([3; 32], Path::new("test.key"))
    }

    fn snapshot_with(dir: &Path, files: &[(&str, &[u8])]) -> PathBuf {
        let out = dir.join("snap");
        let writer = SnapshotWriter::create(&out).unwrap();
        for (name, bytes) in files {
            fs::write(writer.dir().join(name), bytes).unwrap();
        }
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
        writer.finish(manifest, Some(&key())).unwrap();
        out
    }

    #[test]
    fn staged_copy_is_a_verified_snapshot() {
        let tmp = tempfile::tempdir().unwrap();
        let src = snapshot_with(
            tmp.path(),
            &[("pages-1.img", &[7u8; 100_000]), ("core-1.img", b"c")],
        );
        let target = tmp.path().join("mem").join("snap");
        let staged = stage(&src, &target, Trust::Key(&key())).unwrap();
        assert_eq!(staged.files, 2);
        assert_eq!(staged.bytes, 100_001);
        // Same filesystem here: linked, and still hashed.
        assert_eq!(staged.linked, 2);
        let copy = Snapshot::open(&target).unwrap();
        copy.verify().unwrap();
        // Sealed as its source was.
        copy.authenticate(Trust::Key(&key())).unwrap();
        let again = stage(&src, &target, Trust::Key(&key())).unwrap_err();
        assert!(matches!(again, StageError::TargetExists { .. }), "{again}");
    }

    #[test]
    fn a_corrupt_source_is_refused_and_nothing_is_left() {
        let tmp = tempfile::tempdir().unwrap();
        let src = snapshot_with(tmp.path(), &[("pages-1.img", &[7u8; 4096])]);
        let mut bytes = fs::read(src.join("pages-1.img")).unwrap();
        bytes[10] ^= 1;
        fs::write(src.join("pages-1.img"), bytes).unwrap();
        let target = tmp.path().join("staged");
        let err = stage(&src, &target, Trust::Key(&key())).unwrap_err();
        assert!(err.to_string().contains("hash mismatch"), "{err}");
        assert!(!target.exists());
        fs::remove_file(src.join("pages-1.img")).unwrap();
        let err = stage(&src, &target, Trust::Key(&key())).unwrap_err();
        assert!(err.to_string().contains("is missing"), "{err}");
        assert!(!target.exists());
    }

    #[test]
    fn a_source_rewritten_with_its_hash_recomputed_is_not_staged() {
        let tmp = tempfile::tempdir().unwrap();
        let src = snapshot_with(tmp.path(), &[("pages-1.img", &[7u8; 4096])]);
        let mut bytes = fs::read(src.join("pages-1.img")).unwrap();
        bytes[10] ^= 1;
        fs::write(src.join("pages-1.img"), &bytes).unwrap();
        let manifest = src.join(torpor_image::MANIFEST_FILE);
        let text = fs::read_to_string(&manifest).unwrap();
        let old = blake3::hash(&[7u8; 4096]).to_hex().to_string();
        let new = blake3::hash(&bytes).to_hex().to_string();
        fs::write(&manifest, text.replace(&old, &new)).unwrap();
        // Unkeyed, the forgery passes; keyed, it is refused before anything is copied.
        let target = tmp.path().join("staged");
        stage(&src, &target, Trust::Unkeyed).unwrap();
        fs::remove_dir_all(&target).unwrap();
        let err = stage(&src, &target, Trust::Key(&key())).unwrap_err();
        assert!(
            matches!(err, StageError::Image(ImageError::SealMismatch { .. })),
            "{err}"
        );
        assert!(!target.exists());
    }
}
