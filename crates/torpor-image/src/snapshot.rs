//! Opening a snapshot directory and checking that its files are the ones its manifest lists.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::auth::{read_seal_bytes, Seal, Trust, MAC_FILE};
use crate::error::{ImageError, Result};
use crate::hash::{hash_files, Flush};
use crate::manifest::{FileEntry, Manifest, MANIFEST_FILE};
use crate::summary::{human_seconds, human_size};
use crate::walk::walk;

/// A snapshot directory whose manifest has been read and validated.
#[derive(Debug, Clone)]
pub struct Snapshot {
    dir: PathBuf,
    manifest: Manifest,
    /// `manifest.json` exactly as read: what the MAC covers, and what a copy writes.
    manifest_bytes: Vec<u8>,
    sealing: Sealing,
}

/// What `manifest.mac` said when the snapshot was opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sealing {
    /// There is none: the snapshot is unkeyed (or its MAC was removed).
    Unsealed,
    /// There is one, but it is not a torpor MAC.
    Malformed,
    Sealed(Seal),
}

/// What a successful check covered.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyReport {
    /// Listed files checked.
    pub files: usize,
    /// Their total size in bytes.
    pub bytes: u64,
    /// Whether contents were hashed (`verify`) or only sizes compared (`size_check_only`).
    pub hashed: bool,
    /// Unlisted files that were accepted because CRIU writes them at restore time.
    pub ignored: Vec<String>,
    pub elapsed: Duration,
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.hashed { "hashes" } else { "sizes" };
        write!(
            f,
            "{} files, {} ok ({what} checked in {})",
            self.files,
            human_size(self.bytes),
            human_seconds(self.elapsed.as_secs_f64())
        )
    }
}

impl Snapshot {
    /// Reads and validates `dir/manifest.json`: format version rule, safe unique paths, hashes.
    pub fn open(dir: &Path) -> Result<Snapshot> {
        match fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(ImageError::SnapshotNotADirectory {
                    dir: dir.to_path_buf(),
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ImageError::SnapshotNotFound {
                    dir: dir.to_path_buf(),
                })
            }
            Err(source) => {
                return Err(ImageError::ReadDir {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
        let path = dir.join(MANIFEST_FILE);
        if fs::symlink_metadata(&path).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
            return Err(ImageError::NotASnapshot {
                dir: dir.to_path_buf(),
            });
        }
        let bytes = crate::manifest::read_capped(&path)?;
        let manifest = Manifest::from_json(&bytes, &path, dir)?;
        let sealing = match read_seal_bytes(dir) {
            Ok(None) => Sealing::Unsealed,
            Ok(Some(seal)) => Seal::from_json(&seal).map_or(Sealing::Malformed, Sealing::Sealed),
            Err(source) => {
                return Err(ImageError::ReadFile {
                    path: dir.join(MAC_FILE),
                    source,
                })
            }
        };
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            manifest,
            manifest_bytes: bytes,
            sealing,
        })
    }

    /// Whether the manifest read by [`open`](Self::open) is the one the key's holder sealed.
    /// With [`Trust::Unkeyed`] nothing is checked. Cheap (one keyed hash of the manifest); the
    /// files are covered through their listed hashes, which [`verify`](Self::verify) checks.
    pub fn authenticate(&self, trust: Trust) -> Result<()> {
        let Trust::Key(key) = trust else {
            return Ok(());
        };
        let dir = self.dir.clone();
        match &self.sealing {
            Sealing::Unsealed => Err(ImageError::Unsealed {
                dir,
                key: key.path().to_path_buf(),
            }),
            Sealing::Malformed => Err(ImageError::SealMalformed { dir }),
            Sealing::Sealed(seal) if seal.key_id != key.id() => Err(ImageError::SealOtherKey {
                dir,
                found: seal.key_id.clone(),
                key: key.path().to_path_buf(),
                expected: key.id().to_owned(),
            }),
            Sealing::Sealed(seal) if !seal.matches(key, &self.manifest_bytes) => {
                Err(ImageError::SealMismatch { dir })
            }
            Sealing::Sealed(_) => Ok(()),
        }
    }

    /// What `manifest.mac` said (not checked: see [`authenticate`](Self::authenticate)).
    pub fn sealing(&self) -> &Sealing {
        &self.sealing
    }

    /// Writes the manifest and its MAC, exactly as [`open`](Self::open) read them, into `target`
    /// (a copy of this snapshot whose files are in place): the copy is sealed as the original
    /// was, and a manifest swapped in the original since it was read is never copied.
    pub fn write_manifest_into(&self, target: &Path) -> io::Result<()> {
        if let Sealing::Sealed(seal) = &self.sealing {
            fs::write(target.join(MAC_FILE), seal.to_json())?;
        }
        fs::write(target.join(MANIFEST_FILE), &self.manifest_bytes)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn into_manifest(self) -> Manifest {
        self.manifest
    }

    /// Checks that every listed file exists with its size and BLAKE3 hash (files in parallel, large
    /// files on several threads), and that no unlisted file is present except `manifest.json`
    /// and what CRIU writes at restore time (see [`is_restore_artifact`]).
    pub fn verify(&self) -> Result<VerifyReport> {
        let start = Instant::now();
        let ignored = self.check_listing()?;
        let files: Vec<(String, u64)> = self
            .manifest
            .files
            .iter()
            .map(|f| (f.path.clone(), f.size))
            .collect();
        let results = hash_files(&self.dir, &files, Flush::No);
        // Report the first problem in manifest order, whichever thread found it first.
        for (entry, result) in self.manifest.files.iter().zip(results) {
            let hashed = result?;
            if hashed.len != entry.size {
                return Err(ImageError::SizeMismatch {
                    dir: self.dir.clone(),
                    file: entry.path.clone(),
                    expected: entry.size,
                    actual: hashed.len,
                });
            }
            self.check_hash(entry, hashed.hash)?;
        }
        Ok(self.report(true, ignored, start))
    }

    /// [`verify`](Self::verify) with the files' hashes already taken by whoever wrote them
    /// (`hashed(path)`: a pull hashes each file's blocks as they land): the listing and the
    /// sizes are checked here, and each hash compared with the manifest's. A file `hashed` has
    /// no hash for is hashed here. Errors are `verify`'s, the first in manifest order.
    pub fn verify_hashed(
        &self,
        hashed: &dyn Fn(&str) -> Option<blake3::Hash>,
    ) -> Result<VerifyReport> {
        let start = Instant::now();
        let ignored = self.check_listing()?;
        for entry in &self.manifest.files {
            let actual = match hashed(&entry.path) {
                Some(hash) => hash,
                None => {
                    let files = [(entry.path.clone(), entry.size)];
                    let mut results = hash_files(&self.dir, &files, Flush::No);
                    results.pop().expect("one file in, one result out")?.hash
                }
            };
            self.check_hash(entry, actual)?;
        }
        Ok(self.report(true, ignored, start))
    }

    /// `actual` against the manifest's hash of `entry`'s file.
    fn check_hash(&self, entry: &FileEntry, actual: blake3::Hash) -> Result<()> {
        // Validated as 64 lowercase hex digits when the manifest was read.
        let actual = actual.to_hex();
        if actual.as_str() != entry.blake3 {
            return Err(ImageError::HashMismatch {
                dir: self.dir.clone(),
                file: entry.path.clone(),
                expected: entry.blake3.clone(),
                actual: actual.to_string(),
            });
        }
        Ok(())
    }

    /// The cheap check: the listed files exist with their sizes and nothing else is there.
    /// Catches truncation and missing or extra files, not corrupted contents.
    pub fn size_check_only(&self) -> Result<VerifyReport> {
        let start = Instant::now();
        let ignored = self.check_listing()?;
        Ok(self.report(false, ignored, start))
    }

    /// Compares the directory listing with the manifest; returns the accepted unlisted files.
    fn check_listing(&self) -> Result<Vec<String>> {
        let mut found: BTreeMap<String, u64> = walk(&self.dir)?
            .files
            .into_iter()
            .map(|f| (f.rel, f.size))
            .collect();
        for entry in &self.manifest.files {
            match found.remove(&entry.path) {
                None => {
                    return Err(ImageError::MissingFile {
                        dir: self.dir.clone(),
                        file: entry.path.clone(),
                    })
                }
                Some(actual) if actual != entry.size => {
                    return Err(ImageError::SizeMismatch {
                        dir: self.dir.clone(),
                        file: entry.path.clone(),
                        expected: entry.size,
                        actual,
                    })
                }
                Some(_) => {}
            }
        }
        found.remove(MANIFEST_FILE);
        found.remove(MAC_FILE);
        let mut ignored = Vec::new();
        for rel in found.into_keys() {
            if is_restore_artifact(&rel) {
                ignored.push(rel);
            } else {
                return Err(ImageError::ExtraFile {
                    dir: self.dir.clone(),
                    file: rel,
                });
            }
        }
        Ok(ignored)
    }

    fn report(&self, hashed: bool, ignored: Vec<String>, start: Instant) -> VerifyReport {
        VerifyReport {
            files: self.manifest.files.len(),
            bytes: self.manifest.total_size(),
            hashed,
            ignored,
            elapsed: start.elapsed(),
        }
    }
}

/// Whether an unlisted file at `rel` is one CRIU writes into the images directory when it
/// restores from it: its logs (`*.log`, e.g. `restore.log`) and `stats-restore`. Only at the top
/// level, which is where CRIU's work directory defaults to.
pub fn is_restore_artifact(rel: &str) -> bool {
    !rel.contains('/') && (rel == "stats-restore" || (rel.ends_with(".log") && rel.len() > 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_artifacts() {
        for yes in ["restore.log", "criu.log", "stats-restore"] {
            assert!(is_restore_artifact(yes), "{yes}");
        }
        for no in [
            ".log",
            "sub/restore.log",
            "stats-dump",
            "pages-1.img",
            "log",
            "x.log.img",
        ] {
            assert!(!is_restore_artifact(no), "{no}");
        }
    }
}
