//! Snapshot portability: the files a restore reopens by path must be the ones the snapshot was
//! taken with.
//!
//! CRIU does not save the executables and libraries a process maps (the init binary, Python, its
//! shared libraries): it records their paths and maps them again at restore. On another node, or
//! after an upgrade, the same path can hold another build, and the restored process would run
//! with code that does not match its saved memory (a crash at best). So a snapshot records each
//! such file's size and BLAKE3 hash ([`ReopenedFile`]), and a restore compares them with the
//! node's files first ([`check_reopened`]), refusing the first difference in one line.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ImageError, Result};

/// A file the restored processes reopen by path, as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReopenedFile {
    /// Absolute path, as the processes see it.
    pub path: String,
    pub size: u64,
    /// BLAKE3 of the contents, lowercase hex (the identity of the contents, whatever the inode).
    pub blake3: String,
}

/// How closely a restore compares the reopened files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReopenedCheck {
    /// Size and hash (reads every file).
    Hashes,
    /// Size only (a restore that trusts what it hashed before, like a staged copy).
    Sizes,
}

impl ReopenedFile {
    /// The identity of the file at `path` (named `name` in the record), read through `path`
    /// (e.g. `/proc/<pid>/root/<name>` to see the process's mount namespace).
    pub fn identify(name: &str, path: &Path) -> std::io::Result<ReopenedFile> {
        let meta = fs::metadata(path)?;
        if !meta.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update_mmap_rayon(path)?;
        Ok(ReopenedFile {
            path: name.to_owned(),
            size: meta.len(),
            blake3: hasher.finalize().to_hex().to_string(),
        })
    }
}

/// Compares `files` (recorded in the snapshot at `dir`) with the files under `root` (`/` for
/// this node), in order; the first that is missing or differs is refused, naming it.
pub fn check_reopened(
    files: &[ReopenedFile],
    root: &Path,
    dir: &Path,
    depth: ReopenedCheck,
) -> Result<()> {
    for f in files {
        let here = root.join(f.path.trim_start_matches('/'));
        let differs = |found: String| ImageError::NotPortable {
            dir: dir.to_path_buf(),
            file: f.path.clone(),
            expected: format!("{} bytes, blake3 {}", f.size, short(&f.blake3)),
            found,
        };
        let meta = match fs::metadata(&here) {
            Ok(m) if m.is_file() => m,
            Ok(_) => return Err(differs("not a regular file".into())),
            Err(e) => return Err(differs(format!("cannot be read: {e}"))),
        };
        if meta.len() != f.size {
            return Err(differs(format!("{} bytes", meta.len())));
        }
        if depth == ReopenedCheck::Hashes {
            let mut hasher = blake3::Hasher::new();
            hasher
                .update_mmap_rayon(&here)
                .map_err(|e| differs(format!("cannot be read: {e}")))?;
            let hash = hasher.finalize().to_hex().to_string();
            if hash != f.blake3 {
                return Err(differs(format!(
                    "{} bytes, blake3 {}",
                    meta.len(),
                    short(&hash)
                )));
            }
        }
    }
    Ok(())
}

/// The first 16 hex digits: enough to tell two hashes apart in a message.
fn short(hash: &str) -> &str {
    &hash[..hash.len().min(16)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_files_pass_and_the_first_difference_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        fs::create_dir_all(root.join("usr/lib")).expect("mkdir");
        fs::write(root.join("usr/lib/liba.so"), b"library a").expect("write");
        fs::write(root.join("usr/lib/libb.so"), b"library b").expect("write");
        let files: Vec<ReopenedFile> = ["/usr/lib/liba.so", "/usr/lib/libb.so"]
            .iter()
            .map(|p| ReopenedFile::identify(p, &root.join(&p[1..])).expect("identify"))
            .collect();
        assert_eq!(files[0].size, 9);
        let snap = Path::new("/snaps/x");
        check_reopened(&files, root, snap, ReopenedCheck::Hashes).expect("same");

        // Same size, other contents: only the hash tells.
        fs::write(root.join("usr/lib/libb.so"), b"library B").expect("write");
        check_reopened(&files, root, snap, ReopenedCheck::Sizes).expect("sizes only");
        let err = check_reopened(&files, root, snap, ReopenedCheck::Hashes).expect_err("hash");
        let line = err.to_string();
        assert!(
            line.contains("/usr/lib/libb.so") && !line.contains('\n'),
            "{line}"
        );
        assert!(!line.contains("liba"), "{line}");

        // Another size, and a missing file: the first in the list is named.
        fs::write(root.join("usr/lib/liba.so"), b"library a, v2").expect("write");
        fs::remove_file(root.join("usr/lib/libb.so")).expect("rm");
        let err = check_reopened(&files, root, snap, ReopenedCheck::Sizes).expect_err("size");
        assert!(err.to_string().contains("/usr/lib/liba.so"), "{err}");
        assert!(err.to_string().contains("13 bytes"), "{err}");
        fs::write(root.join("usr/lib/liba.so"), b"library a").expect("write");
        let err = check_reopened(&files, root, snap, ReopenedCheck::Sizes).expect_err("missing");
        assert!(err.to_string().contains("libb.so"), "{err}");
        assert!(err.to_string().contains("cannot be read"), "{err}");
    }
}
