//! `manifest.json`: what a snapshot is, where it came from, and the hash of every file in it.
//!
//! Compatibility: fields added in a later minor format version are optional here (`serde(default)`)
//! and unknown fields are ignored, so a reader of format 1.N reads every 1.M with M <= N, and a
//! manifest carrying fields this version does not know still parses. Which versions may be
//! *loaded* is decided by [`FormatVersion::check_loadable`] before the rest is parsed.

use std::collections::{BTreeMap, HashSet};
use std::ffi::CStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ImageError, Result};
use crate::reopened::ReopenedFile;
use crate::time::now_rfc3339_utc;
use crate::version::FormatVersion;

/// Name of the manifest inside a snapshot directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Reads of `manifest.json` stop here: a real manifest is a few kilobytes.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// Length of a BLAKE3 hash in lowercase hex.
const HASH_HEX_LEN: usize = 64;

/// The description of one snapshot, stored as pretty JSON in `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Layout version of the snapshot; see [`FormatVersion`].
    pub format_version: FormatVersion,
    /// Version of the torpor that took the snapshot.
    pub torpor_version: String,
    /// When the snapshot was taken, RFC 3339 UTC.
    pub created: String,
    pub kind: SnapshotKind,
    pub source: Source,
    pub host: Host,
    /// GPU state; `None` for a CPU-only snapshot.
    #[serde(default)]
    pub gpu: Option<GpuSection>,
    /// Mounts CRIU dumped as external (`--external mnt[PATH]:KEY`); restore must bind them again.
    #[serde(default)]
    pub external_mounts: Vec<ExternalMount>,
    /// The filesystems whose files CRIU archived into the image: the process's own tmpfs
    /// mounts (`/dev/shm`, a worker's `/tmp`), never the host's. Empty for snapshots taken
    /// before it was recorded.
    #[serde(default)]
    pub archived_mounts: Vec<ArchivedMount>,
    /// The regular files the tree's stdout and stderr (descriptors 1 and 2 of each process) were
    /// open on: what a restore can point at a new file. Empty for snapshots taken before it was
    /// recorded, and when stdio was no regular file.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stdio_files: Vec<StdioFile>,
    /// The executables and mapped files the tree reopens by path at restore (the init binary,
    /// Python, its libraries), with their sizes and hashes: a restore refuses a node whose files
    /// differ ([`crate::check_reopened`]). Empty for snapshots taken before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reopened_files: Vec<ReopenedFile>,
    /// Every file of the snapshot except `manifest.json`, sorted by path.
    #[serde(default)]
    pub files: Vec<FileEntry>,
    /// Seconds spent in each phase of taking the snapshot (`cuda_lock`, `criu_dump`, `hash`, …).
    #[serde(default)]
    pub timings: BTreeMap<String, f64>,
    /// Seconds the source process was stopped.
    #[serde(default)]
    pub stop_time_s: f64,
}

/// How the snapshot was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    /// CRIU image of an unmodified process, GPU state inside it (driver checkpoint API).
    Transparent,
}

/// The process tree that was snapshotted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// The command the root process was started with.
    pub command: Vec<String>,
    /// PID of the root of the tree, as seen from torpor.
    pub root_pid: i32,
    #[serde(default)]
    pub tree: Vec<ProcessEntry>,
    /// Whether the source kept running after the snapshot.
    #[serde(default)]
    pub leave_running: bool,
}

/// One process of the snapshotted tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    pub pid: i32,
    pub ppid: i32,
    /// The `NSpid` chain from `/proc/PID/status`: outermost namespace first.
    #[serde(default)]
    pub ns_pid: Vec<i32>,
    #[serde(default)]
    pub comm: String,
    #[serde(default)]
    pub cmdline: Vec<String>,
    /// Whether the process had a CUDA context when it was snapshotted.
    #[serde(default)]
    pub cuda: bool,
}

/// The machine the snapshot was taken on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// Kernel release (`uname -r`).
    pub kernel: String,
    pub hostname: String,
    #[serde(default)]
    pub criu_version: String,
}

impl Host {
    /// The kernel release and host name of this machine (`uname(2)`), with the given CRIU version.
    pub fn current(criu_version: impl Into<String>) -> Result<Host> {
        // SAFETY: `utsname` is a struct of C character arrays, for which all-zero bytes are valid.
        let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
        // SAFETY: `uts` is a valid, writable `utsname` that outlives the call; uname(2) only
        // writes NUL-terminated strings into its fixed-size fields.
        let rc = unsafe { libc::uname(&mut uts) };
        if rc != 0 {
            return Err(ImageError::Uname {
                source: io::Error::last_os_error(),
            });
        }
        Ok(Host {
            kernel: c_field(&uts.release),
            hostname: c_field(&uts.nodename),
            criu_version: criu_version.into(),
        })
    }
}

/// A NUL-terminated `utsname` field as text.
fn c_field(field: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = field.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// The GPUs the snapshot's processes used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSection {
    /// Kernel driver version, e.g. `580.159.04`.
    pub driver_version: String,
    /// `cuDriverGetVersion`, e.g. `13000` for CUDA 13.0.
    pub cuda_driver_version: i32,
    #[serde(default)]
    pub gpus: Vec<GpuEntry>,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEntry {
    pub ordinal: u32,
    pub name: String,
    pub uuid: String,
    /// Bytes of device memory.
    pub total_memory: u64,
    /// Bytes of device memory the snapshotted processes held, when known.
    #[serde(default)]
    pub used_by_snapshot: Option<u64>,
}

/// A file the tree's stdout or stderr was open on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdioFile {
    /// Absolute path, as the tree saw it.
    pub path: String,
    /// How CRIU's image names it, the key of `--inherit-fd`: the path without its leading `/`
    /// for a file on a mount of the tree's own mount namespace; `file[MNT_ID:INODE]` (hex) for
    /// one on a mount outside it (the tree was itself restored with new stdio), which was dumped
    /// as external and must be handed to every restore.
    pub key: String,
}

impl StdioFile {
    /// Whether the file was dumped as external (CRIU cannot reopen it by itself).
    pub fn is_external(&self) -> bool {
        self.key.starts_with("file[")
    }
}

/// A mount left out of the image: CRIU recorded only `key`, restore maps `key` back to `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalMount {
    /// The key CRIU stored in the image for this mount.
    pub key: String,
    /// Mount point inside the snapshotted mount namespace.
    pub path: String,
}

/// A filesystem whose files are inside the image: restore re-creates it with them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchivedMount {
    /// Mount point inside the snapshotted mount namespace.
    pub path: String,
    pub fstype: String,
}

/// One file of the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path relative to the snapshot directory, `/`-separated, without `.` or `..`.
    pub path: String,
    pub size: u64,
    /// BLAKE3 of the contents, lowercase hex.
    pub blake3: String,
}

/// Only the version, read first so that a manifest of another major version is refused with a
/// version error rather than whatever parse error its changed layout would cause.
#[derive(Deserialize)]
struct VersionProbe {
    format_version: FormatVersion,
}

impl Manifest {
    /// A manifest of the current format, created now, with no GPU section, files or timings.
    pub fn new(torpor_version: impl Into<String>, source: Source, host: Host) -> Manifest {
        Manifest {
            format_version: FormatVersion::CURRENT,
            torpor_version: torpor_version.into(),
            created: now_rfc3339_utc(),
            kind: SnapshotKind::Transparent,
            source,
            host,
            gpu: None,
            external_mounts: Vec::new(),
            archived_mounts: Vec::new(),
            stdio_files: Vec::new(),
            reopened_files: Vec::new(),
            files: Vec::new(),
            timings: BTreeMap::new(),
            stop_time_s: 0.0,
        }
    }

    /// Reads and validates `path` (a `manifest.json`); refuses files over [`MAX_MANIFEST_BYTES`].
    ///
    /// Error messages name the directory that holds `path`.
    pub fn read(path: &Path) -> Result<Manifest> {
        let bytes = read_capped(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Manifest::from_json(&bytes, path, dir)
    }

    /// Parses and validates manifest JSON. `origin` (the file it came from) and `dir` (the snapshot
    /// it describes) only serve error messages.
    pub fn from_json(bytes: &[u8], origin: &Path, dir: &Path) -> Result<Manifest> {
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(ImageError::ManifestTooLarge {
                path: origin.to_path_buf(),
                size: bytes.len() as u64,
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let parse_error = |source| ImageError::ManifestParse {
            path: origin.to_path_buf(),
            source,
        };
        let probe: VersionProbe = serde_json::from_slice(bytes).map_err(parse_error)?;
        probe.format_version.check_loadable()?;
        let manifest: Manifest = serde_json::from_slice(bytes).map_err(parse_error)?;
        manifest.validate(dir)?;
        Ok(manifest)
    }

    /// Pretty JSON with a trailing newline. Refuses NaN and infinite timings, which JSON cannot
    /// store (serde_json would write `null` and then fail to read it back).
    pub fn to_json(&self) -> Result<String> {
        self.check_timings()?;
        let mut json = serde_json::to_string_pretty(self)
            .map_err(|source| ImageError::ManifestEncode { source })?;
        json.push('\n');
        Ok(json)
    }

    /// Checks everything a loader relies on: the version rule, safe and unique file paths, well-
    /// formed hashes and finite timings. `dir` only serves error messages.
    pub fn validate(&self, dir: &Path) -> Result<()> {
        self.format_version.check_loadable()?;
        self.check_timings()?;
        let mut seen = HashSet::with_capacity(self.files.len());
        for entry in &self.files {
            if let Err(reason) = check_relative_path(&entry.path) {
                return Err(ImageError::UnsafePath {
                    dir: dir.to_path_buf(),
                    file: entry.path.clone(),
                    reason,
                });
            }
            if !seen.insert(entry.path.as_str()) {
                return Err(ImageError::DuplicatePath {
                    dir: dir.to_path_buf(),
                    file: entry.path.clone(),
                });
            }
            if !is_hash_hex(&entry.blake3) {
                return Err(ImageError::InvalidHash {
                    dir: dir.to_path_buf(),
                    file: entry.path.clone(),
                    hash: entry.blake3.clone(),
                });
            }
        }
        Ok(())
    }

    /// Sum of the sizes of the listed files.
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    fn check_timings(&self) -> Result<()> {
        let stop = ("stop_time_s", &self.stop_time_s);
        for (phase, &value) in self
            .timings
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .chain([stop])
        {
            if !value.is_finite() {
                return Err(ImageError::NonFiniteTiming {
                    phase: phase.to_owned(),
                    value,
                });
            }
        }
        Ok(())
    }
}

/// Why `path` is not a safe relative path inside a snapshot, if it is not.
///
/// Safe: non-empty, relative, `/`-separated components that are neither empty, `.` nor `..`, no
/// NUL, and not the manifest itself (which is never listed).
pub fn check_relative_path(path: &str) -> std::result::Result<(), &'static str> {
    if path.is_empty() {
        return Err("empty path");
    }
    if path.len() > 4096 {
        return Err("longer than PATH_MAX");
    }
    if path.contains('\0') {
        return Err("contains a NUL byte");
    }
    if path.starts_with('/') {
        return Err("absolute path");
    }
    for component in path.split('/') {
        match component {
            "" => return Err("empty path component"),
            "." => return Err("'.' component"),
            ".." => return Err("'..' component"),
            _ => {}
        }
    }
    if path == MANIFEST_FILE {
        return Err("the manifest cannot list itself");
    }
    if path == crate::auth::MAC_FILE {
        return Err("the manifest cannot list its MAC");
    }
    Ok(())
}

fn is_hash_hex(text: &str) -> bool {
    text.len() == HASH_HEX_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The contents of a regular file of at most [`MAX_MANIFEST_BYTES`], without following a symlink.
pub(crate) fn read_capped(path: &Path) -> Result<Vec<u8>> {
    let read_error = |source| ImageError::ManifestRead {
        path: path.to_path_buf(),
        source,
    };
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    if !meta.is_file() {
        return Err(read_error(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    let too_large = |size| ImageError::ManifestTooLarge {
        path: path.to_path_buf(),
        size,
        limit: MAX_MANIFEST_BYTES,
    };
    if meta.len() > MAX_MANIFEST_BYTES {
        return Err(too_large(meta.len()));
    }
    // The size can change after the check: read at most one byte past the limit to detect it.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        let mut m = Manifest::new(
            "0.1.0",
            Source {
                command: vec![
                    "python".into(),
                    "serve.py".into(),
                    "--port".into(),
                    "80".into(),
                ],
                root_pid: 4242,
                tree: vec![
                    ProcessEntry {
                        pid: 4242,
                        ppid: 1,
                        ns_pid: vec![4242, 1],
                        comm: "python".into(),
                        cmdline: vec!["python".into(), "serve.py".into()],
                        cuda: true,
                    },
                    ProcessEntry {
                        pid: 4250,
                        ppid: 4242,
                        ns_pid: vec![4250, 2],
                        comm: "worker".into(),
                        cmdline: vec!["worker".into()],
                        cuda: false,
                    },
                ],
                leave_running: true,
            },
            Host {
                kernel: "6.18.0".into(),
                hostname: "gpu-1".into(),
                criu_version: "4.1.1".into(),
            },
        );
        m.gpu = Some(GpuSection {
            driver_version: "580.159.04".into(),
            cuda_driver_version: 13000,
            gpus: vec![GpuEntry {
                ordinal: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                uuid: "GPU-0123".into(),
                total_memory: 85_520_809_984,
                used_by_snapshot: Some(1_900_000_000),
            }],
        });
        m.external_mounts = vec![ExternalMount {
            key: "nv".into(),
            path: "/usr/local/nvidia".into(),
        }];
        m.files = vec![
            FileEntry {
                path: "core-1.img".into(),
                size: 12,
                blake3: "ab".repeat(32),
            },
            FileEntry {
                path: "pages-1.img".into(),
                size: 2_500_000_000,
                blake3: "0f".repeat(32),
            },
        ];
        m.timings.insert("criu_dump".into(), 1.34);
        m.timings.insert("cuda_lock".into(), 0.0006);
        m.stop_time_s = 2.5;
        m.created = "2026-05-01T12:34:56Z".into();
        m
    }

    fn parse(json: &str) -> Result<Manifest> {
        Manifest::from_json(json.as_bytes(), Path::new("m.json"), Path::new("snap"))
    }

    fn edit(f: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut value = serde_json::to_value(sample()).expect("to_value");
        f(&mut value);
        serde_json::to_string(&value).expect("to_string")
    }

    #[test]
    fn round_trip_with_gpu() {
        let m = sample();
        let json = m.to_json().expect("to_json");
        assert!(json.ends_with("}\n"));
        assert!(json.contains("\n  \"format_version\": \"1.1\""), "{json}");
        assert!(json.contains("\"kind\": \"transparent\""), "{json}");
        assert_eq!(parse(&json).expect("parse"), m);
    }

    #[test]
    fn round_trip_cpu_only() {
        let mut m = sample();
        m.gpu = None;
        let json = m.to_json().expect("to_json");
        assert!(json.contains("\"gpu\": null"), "{json}");
        assert_eq!(parse(&json).expect("parse"), m);
    }

    #[test]
    fn optional_fields_default_and_unknown_fields_are_accepted() {
        let json = edit(|v| {
            let o = v.as_object_mut().expect("object");
            for key in ["gpu", "external_mounts", "files", "timings", "stop_time_s"] {
                o.remove(key);
            }
            o.insert(
                "added_in_a_later_minor".into(),
                serde_json::json!({"x": [1, 2]}),
            );
            let proc0 = &mut o["source"]["tree"][0];
            proc0.as_object_mut().expect("process").remove("ns_pid");
            proc0["future_field"] = serde_json::json!(true);
            o["host"]
                .as_object_mut()
                .expect("host")
                .remove("criu_version");
        });
        let m = parse(&json).expect("parse");
        assert_eq!(m.gpu, None);
        assert!(m.external_mounts.is_empty());
        assert!(m.files.is_empty() && m.timings.is_empty());
        assert_eq!(m.stop_time_s, 0.0);
        assert!(m.source.tree[0].ns_pid.is_empty());
        assert_eq!(m.host.criu_version, "");
    }

    #[test]
    fn version_rule_applies_before_the_layout_is_parsed() {
        // A newer minor version is refused with the version message, not a parse error.
        let newer = edit(|v| v["format_version"] = "1.2".into());
        let err = parse(&newer).expect_err("newer minor");
        assert_eq!(
            err.to_string(),
            "snapshot format 1.2 is newer than this torpor supports (1.1): upgrade torpor"
        );
        // Another major version with an incompatible layout: still a version error.
        let other_major = r#"{"format_version": "2.0", "files": "chunked"}"#;
        let err = parse(other_major).expect_err("major");
        assert!(matches!(err, ImageError::FormatMajor { .. }), "{err}");
        let err = parse(r#"{"format_version": "0.9"}"#).expect_err("major");
        assert!(matches!(err, ImageError::FormatMajor { .. }), "{err}");
        // No version at all.
        let err = parse(r#"{"torpor_version": "0.1.0"}"#).expect_err("missing");
        assert!(matches!(err, ImageError::ManifestParse { .. }), "{err}");
        let err = parse("not json").expect_err("garbage");
        assert!(err.to_string().contains("re-take the snapshot"), "{err}");
    }

    #[test]
    fn unsafe_paths_are_refused() {
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "",
            "a//b",
            "a/",
            "./a",
            "a/.",
            "..",
            "a\0b",
            "manifest.json",
        ] {
            let json = edit(|v| v["files"][0]["path"] = bad.into());
            match parse(&json) {
                Err(ImageError::UnsafePath { file, .. }) => assert_eq!(file, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        for good in ["a", "a/b.img", "..a", "a..", ".hidden", "sub/manifest.json"] {
            assert_eq!(check_relative_path(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn duplicate_paths_and_bad_hashes_are_refused() {
        let dup = edit(|v| v["files"][1]["path"] = "core-1.img".into());
        assert!(matches!(parse(&dup), Err(ImageError::DuplicatePath { .. })));
        for hash in [
            "",
            "ab",
            &"AB".repeat(32),
            &"zz".repeat(32),
            &"a".repeat(65),
        ] {
            let json = edit(|v| v["files"][0]["blake3"] = hash.into());
            assert!(
                matches!(parse(&json), Err(ImageError::InvalidHash { .. })),
                "{hash}"
            );
        }
    }

    #[test]
    fn non_finite_timings_are_refused_on_write() {
        for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let mut m = sample();
            m.timings.insert("hash".into(), value);
            let err = m.to_json().expect_err("nan");
            assert!(
                matches!(err, ImageError::NonFiniteTiming { ref phase, .. } if phase == "hash")
            );
            let mut m = sample();
            m.stop_time_s = value;
            assert!(m.to_json().is_err());
        }
    }

    #[test]
    fn oversized_input_is_refused() {
        let big = vec![b' '; MAX_MANIFEST_BYTES as usize + 1];
        let err = Manifest::from_json(&big, Path::new("m"), Path::new("d")).expect_err("big");
        assert!(matches!(err, ImageError::ManifestTooLarge { .. }), "{err}");
    }

    #[test]
    fn read_caps_the_file_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(MANIFEST_FILE);
        let file = File::create(&path).expect("create");
        file.set_len(MAX_MANIFEST_BYTES + 1).expect("set_len");
        let err = Manifest::read(&path).expect_err("too large");
        assert!(matches!(err, ImageError::ManifestTooLarge { .. }), "{err}");
        drop(file);
        let m = sample();
        std::fs::write(&path, m.to_json().expect("json")).expect("write");
        assert_eq!(Manifest::read(&path).expect("read"), m);
    }

    #[test]
    fn host_current_reads_uname() {
        let host = Host::current("4.1.1").expect("uname");
        assert!(!host.kernel.is_empty());
        assert!(host
            .kernel
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit()));
        assert_eq!(host.criu_version, "4.1.1");
        let proc_release = std::fs::read_to_string("/proc/sys/kernel/osrelease");
        if let Ok(release) = proc_release {
            assert_eq!(host.kernel, release.trim());
        }
    }
}
