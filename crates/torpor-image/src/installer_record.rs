//! The SHA-256 that Python's installer recorded for a file, read instead of the file.
//!
//! A node that pulls a function it has never run (docs/cluster.md) must know the SHA-256 of
//! every file the snapshot reopens before the restore may start ([`crate::check_reopened`]):
//! for a GPU worker, PyTorch's and CUDA's libraries, ~4.2 GB. Read from a cold disk that is
//! the first start's critical path: 5.5-6.9 s of a 6-7 s pull on the H100, where the transfer
//! itself took 2 s (`bench/cluster/pull.py`, `reopened_warm_s` against `fetch_s`).
//!
//! Almost all of those bytes were installed from wheels, and a wheel's installer writes a
//! `RECORD` into the package's `*.dist-info`: one line per installed file with its SHA-256
//! (`path,sha256=<urlsafe base64>,size`, PEP 376 and PEP 627). So the hash is there already,
//! in a few MB of text. It is taken only when nothing can have changed the file since:
//! - the line's size is the file's size;
//! - the file's mtime and ctime are not later than the `RECORD`'s (the installer writes
//!   `RECORD` after the files; rewriting a file afterwards moves its ctime past it, and no
//!   unprivileged call can set a ctime back, the same rule the hash cache keys on);
//! - the `RECORD` is a regular file under 64 MiB, and the algorithm is `sha256`.
//!
//! Anything else (a file no `RECORD` lists, a quoted path, another algorithm, a file changed
//! after its install) is read and hashed as before. What a `RECORD` vouches for is what the
//! hash cache vouches for: a file that kept its identity since it was hashed, here since it was
//! installed. Both are speed-ups of the portability check, which guards against a library of
//! another build at the same path, not against root rewriting files and their records alike.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use base64::Engine as _;

/// A `RECORD` larger than this is not one (PyTorch's is ~1 MB).
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// One `RECORD` line: the hash (lowercase hex), the size, and the `RECORD` it came from.
#[derive(Debug, Clone)]
struct Line {
    sha256: String,
    size: u64,
    record: usize,
}

/// The `RECORD`s of the site directories met so far, by the absolute paths they list.
#[derive(Debug, Default)]
pub struct InstallerRecords {
    /// Site directories already read (with or without `*.dist-info` in them).
    read: HashMap<PathBuf, bool>,
    lines: HashMap<PathBuf, Line>,
    /// Each `RECORD` read, with its metadata at the time.
    records: Vec<fs::Metadata>,
}

impl InstallerRecords {
    pub fn new() -> InstallerRecords {
        InstallerRecords::default()
    }

    /// The SHA-256 (hex) that an installer recorded for the file at `path` (absolute, as the
    /// snapshot names it), whose metadata is `meta`, when the rules of the module doc hold.
    pub fn sha256(&mut self, path: &Path, meta: &fs::Metadata) -> Option<String> {
        for dir in path.ancestors().skip(1) {
            if self.site(dir) {
                break;
            }
        }
        let line = self.lines.get(path)?;
        let record = &self.records[line.record];
        let after = |a: (i64, i64), b: (i64, i64)| a > b;
        let newer = after(
            (meta.mtime(), meta.mtime_nsec()),
            (record.mtime(), record.mtime_nsec()),
        ) || after(
            (meta.ctime(), meta.ctime_nsec()),
            (record.ctime(), record.ctime_nsec()),
        );
        (line.size == meta.len() && !newer).then(|| line.sha256.clone())
    }

    /// Reads the `RECORD`s of `dir` if it is a site directory not read yet; whether it is one
    /// (has a `*.dist-info` with a `RECORD`).
    fn site(&mut self, dir: &Path) -> bool {
        if let Some(&is) = self.read.get(dir) {
            return is;
        }
        let mut is = false;
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                if !name.to_string_lossy().ends_with(".dist-info") {
                    continue;
                }
                let record = entry.path().join("RECORD");
                let Ok(meta) = fs::metadata(&record) else {
                    continue;
                };
                if !meta.is_file() || meta.len() > MAX_RECORD_BYTES {
                    continue;
                }
                let Ok(text) = fs::read_to_string(&record) else {
                    continue;
                };
                is = true;
                let index = self.records.len();
                self.records.push(meta);
                for (rel, sha256, size) in text.lines().filter_map(parse_line) {
                    let Some(abs) = normalise(&dir.join(rel)) else {
                        continue;
                    };
                    self.lines.insert(
                        abs,
                        Line {
                            sha256,
                            size,
                            record: index,
                        },
                    );
                }
            }
        }
        self.read.insert(dir.to_path_buf(), is);
        is
    }
}

/// (relative path, SHA-256 in hex, size) of a `RECORD` line, or None for a line without a
/// SHA-256 (the `RECORD` itself, `.pyc` files written later) or with a quoted path (CSV
/// quoting: a path with a comma or a quote; rare enough to be hashed instead).
fn parse_line(line: &str) -> Option<(&str, String, u64)> {
    if line.starts_with('"') {
        return None;
    }
    let mut fields = line.rsplitn(3, ',');
    let size = fields.next()?.trim().parse().ok()?;
    let digest = fields.next()?.strip_prefix("sha256=")?;
    let path = fields.next()?;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(digest.trim_end_matches('='))
        .ok()?;
    (raw.len() == 32).then(|| (path, crate::reopened::hex(&raw), size))
}

/// `path` with `.` and `..` resolved lexically (a `RECORD` lists scripts as `../../bin/x`);
/// None if it climbs above the root.
fn normalise(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn b64(hex: &str) -> String {
        let raw: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
    }

    /// A site directory with `pkg/lib.so` (and a script in `../bin`) installed by a wheel whose
    /// RECORD is written after them, as an installer does.
    fn site(root: &Path, lib: &[u8], recorded_size: Option<u64>) -> (PathBuf, PathBuf) {
        let site = root.join("lib/python3/site-packages");
        fs::create_dir_all(site.join("pkg")).unwrap();
        fs::create_dir_all(site.join("pkg-1.0.dist-info")).unwrap();
        fs::create_dir_all(root.join("bin")).unwrap();
        let so = site.join("pkg/lib.so");
        fs::write(&so, lib).unwrap();
        fs::write(root.join("bin/tool"), b"#!/bin/sh\n").unwrap();
        let h = crate::sha256_file(&so).unwrap();
        let tool = crate::sha256_file(&root.join("bin/tool")).unwrap();
        let size = recorded_size.unwrap_or(lib.len() as u64);
        let mut rec = fs::File::create(site.join("pkg-1.0.dist-info/RECORD")).unwrap();
        writeln!(rec, "pkg/lib.so,sha256={},{size}", b64(&h)).unwrap();
        writeln!(rec, "../../../bin/tool,sha256={},10", b64(&tool)).unwrap();
        writeln!(rec, "pkg/__pycache__/x.pyc,,").unwrap();
        writeln!(rec, "pkg-1.0.dist-info/RECORD,,").unwrap();
        (so, root.join("bin/tool"))
    }

    #[test]
    fn an_installed_file_is_known_by_its_record_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let (so, tool) = site(dir.path(), b"library bytes", None);
        let mut records = InstallerRecords::new();
        let meta = fs::metadata(&so).unwrap();
        assert_eq!(
            records.sha256(&so, &meta),
            Some(crate::sha256_file(&so).unwrap())
        );
        // A path that climbs out of the site directory, resolved.
        let meta = fs::metadata(&tool).unwrap();
        assert_eq!(
            records.sha256(&tool, &meta),
            Some(crate::sha256_file(&tool).unwrap())
        );
        // A file no RECORD lists.
        let other = dir.path().join("lib/python3/site-packages/pkg/other.so");
        fs::write(&other, b"x").unwrap();
        assert_eq!(records.sha256(&other, &fs::metadata(&other).unwrap()), None);
    }

    #[test]
    fn a_file_changed_after_its_install_or_of_another_size_is_not_vouched_for() {
        let dir = tempfile::tempdir().unwrap();
        let (so, _) = site(dir.path(), b"library bytes", None);
        // Rewritten after the RECORD (same size): its ctime is now later than the RECORD's.
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&so, b"LIBRARY BYTES").unwrap();
        let mut records = InstallerRecords::new();
        assert_eq!(records.sha256(&so, &fs::metadata(&so).unwrap()), None);

        let dir = tempfile::tempdir().unwrap();
        let (so, _) = site(dir.path(), b"library bytes", Some(99));
        let mut records = InstallerRecords::new();
        assert_eq!(records.sha256(&so, &fs::metadata(&so).unwrap()), None);
    }

    #[test]
    fn odd_lines_are_skipped() {
        assert!(parse_line("\"a,b.so\",sha256=AAAA,4").is_none());
        assert!(parse_line("a.so,md5=AAAA,4").is_none());
        assert!(parse_line("a.so,sha256=AAAA,4").is_none(), "not 32 bytes");
        assert!(parse_line("a.so,sha256=x,notasize").is_none());
        assert!(parse_line("").is_none());
        assert_eq!(normalise(Path::new("/a/../../b")), None);
        assert_eq!(
            normalise(Path::new("/a/b/./../c")),
            Some(PathBuf::from("/a/c"))
        );
    }
}
