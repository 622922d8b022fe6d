//! Platform-managed GPU data (issue 11 item 3, EDAS §5–6; docs/sandboxes.md): a function's
//! `[[data]]` entries with `device = "cuda"` arrive in its worker as GPU memory the platform
//! filled, which `torpor.load(name, device="cuda")` hands to the function as a tensor view (no
//! copy of its own).
//!
//! A start that loads the function (a deploy, a `cold_start = "boot"` start) begins filling
//! before the worker is booted or restored, on the blocking pool, so the fills overlap the
//! worker's start (as crate::s3data's fetches do). Each entry's memory comes from the first of:
//! 1. read-only: the **shared copy** of its contents, if one is resident (the restore server's,
//!    keyed as its segments are: tenant, device and BLAKE3 of the contents padded to the GPU's
//!    granularity; so a function's instances and its platform data can share one copy);
//! 2. the **GPU cache** (read-only: the entry itself, mapped; writable: a device-to-device copy);
//! 3. **the file**, copied host→device through the device's fair PCIe scheduler
//!    (crate::split::pcie) by way of its shared staging buffer; a read-only entry's memory is
//!    sealed and also goes into the GPU cache.
//!
//! After the `load` frame (and its `data_fd` frames) torpord sends one `gpu_data` frame per
//! entry, the memory's fd attached; the worker maps it (read-only when the data is) into a
//! segment of the device-memory hook before setup() runs, so the function snapshot holds it as
//! a segment like any other and restored instances get it back through the restore server.
//! The daemon holds its handle on each piece of memory until the worker is ready.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;

use crate::split::server::{gpu_key_of, Lease, OwnMemory};
use crate::split::{lock, DeviceOpenError, Split};
use torpor_device::DeviceError;

/// One entry's memory, ready for its `gpu_data` frame.
pub struct Filled {
    pub name: String,
    /// Bytes of data.
    pub size: u64,
    /// Bytes of memory (a multiple of the GPU's granularity).
    pub padded: u64,
    pub readonly: bool,
    pub fd: OwnedFd,
    /// Where it came from: `shared`, `gpu` or `file`.
    pub source: &'static str,
    /// The daemon's handle, held until the worker mapped it.
    pub lease: Lease,
}

impl std::fmt::Debug for Filled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filled")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// Fills in progress ([`start`]).
pub type Filling = tokio::task::JoinHandle<Result<Vec<Filled>, GpuDataError>>;

/// Why platform-managed GPU data could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum GpuDataError {
    /// The daemon does not run GPU workers on the split path (the hook's segments carry the
    /// memory into the worker).
    #[error(
        "declared data {name:?} has device = \"cuda\", which needs torpord's split GPU path (split = true and split_gpu = true in torpord.toml, and the hook library found: `torpor status`); turn it on, or drop device to read the data as a file"
    )]
    NoSplitGpu { name: String },
    /// The spec's entry is not what spec.py writes.
    #[error("declared data {name:?}: the spec has no {what}; deploy it with this torpor's SDK")]
    BadEntry { name: String, what: &'static str },
    /// The file cannot be read.
    #[error("declared data {name:?}: cannot read {}: {source}; restore the file or redeploy", path.display())]
    Read {
        name: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file's size is not the declared one.
    #[error("declared data {name:?}: {} has {actual} bytes, the spec says {declared}; redeploy the function", path.display())]
    Size {
        name: String,
        path: PathBuf,
        declared: u64,
        actual: u64,
    },
    /// The GPU cannot be opened.
    #[error("declared data {name:?}: {source}")]
    Device {
        name: String,
        #[source]
        source: DeviceOpenError,
    },
    /// Making, filling or exporting the memory failed (the driver's code is inside).
    #[error("declared data {name:?}: {what}: {source}")]
    Copy {
        name: String,
        what: &'static str,
        #[source]
        source: DeviceError,
    },
    /// The fill task went away (it panicked).
    #[error("the GPU data fill task ended early: {0}")]
    Task(String),
}

impl GpuDataError {
    /// Whether the GPU ran out of memory for it (not the function's fault).
    pub fn is_out_of_gpu_memory(&self) -> bool {
        matches!(self, GpuDataError::Copy { source: DeviceError::Cuda(e), .. } if e.is_out_of_memory())
    }
}

/// One `device = "cuda"` entry of a spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub readonly: bool,
}

/// The spec's `device = "cuda"` entries, in declared order.
pub fn entries(spec: &Value) -> Result<Vec<Entry>, GpuDataError> {
    let mut out = Vec::new();
    for d in spec
        .get("data")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
    {
        if d.get("device").and_then(Value::as_str) != Some("cuda") {
            continue;
        }
        let name = d
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let bad = |what| GpuDataError::BadEntry {
            name: name.clone(),
            what,
        };
        let path = d
            .get("abs_path")
            .and_then(Value::as_str)
            .filter(|p| !p.is_empty())
            .ok_or_else(|| bad("abs_path"))?;
        let size = d
            .get("size")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("size"))?;
        let readonly = d.get("access").and_then(Value::as_str) != Some("writable");
        out.push(Entry {
            name,
            path: PathBuf::from(path),
            size,
            readonly,
        });
    }
    Ok(out)
}

/// Starts filling the `device = "cuda"` entries of `spec`, a function of `tenant`, on GPU
/// `ordinal`; `None` when it has none. An error at once when the daemon cannot fill GPU memory.
pub fn start(
    split: &Arc<Split>,
    spec: &Value,
    tenant: &str,
    ordinal: i32,
) -> Result<Option<Filling>, GpuDataError> {
    let entries = entries(spec)?;
    let Some(first) = entries.first() else {
        return Ok(None);
    };
    if !split.gpu_enabled {
        return Err(GpuDataError::NoSplitGpu {
            name: first.name.clone(),
        });
    }
    let split = Arc::clone(split);
    let tenant = tenant.to_string();
    Ok(Some(tokio::task::spawn_blocking(move || {
        entries
            .iter()
            .map(|e| fill(&split, "cuda", ordinal, &tenant, e))
            .collect()
    })))
}

/// Awaits the fills [`start`] began (nothing for `None`).
pub async fn finish(filling: Option<Filling>) -> Result<Vec<Filled>, GpuDataError> {
    match filling {
        None => Ok(Vec::new()),
        Some(h) => h.await.map_err(|e| GpuDataError::Task(e.to_string()))?,
    }
}

/// Sends one `gpu_data` frame per filled entry, its fd attached (after `load` and `data_fd`).
pub async fn send(
    conn: &mut crate::workers::WorkerConn,
    filled: &[Filled],
) -> Result<(), crate::workers::ConnError> {
    for f in filled {
        let frame = crate::protocol::ToWorker::GpuData(crate::protocol::GpuData {
            name: f.name.clone(),
            size: f.size,
            padded: f.padded,
            readonly: f.readonly,
            fd: true,
        });
        crate::split::fds::send_with_fd(&mut conn.wr, &frame, f.fd.as_fd()).await?;
    }
    Ok(())
}

/// The memory of entry `e` of a function of `tenant` on device `backend`/`ordinal` (the host
/// backend in tests), from the first source that has it.
pub fn fill(
    split: &Split,
    backend: &str,
    ordinal: i32,
    tenant: &str,
    e: &Entry,
) -> Result<Filled, GpuDataError> {
    let name = || e.name.clone();
    let dev = split
        .device(backend, ordinal)
        .map_err(|source| GpuDataError::Device {
            name: name(),
            source,
        })?;
    let copy_err = |what| {
        move |source| GpuDataError::Copy {
            name: e.name.clone(),
            what,
            source,
        }
    };
    let granule = dev.granularity().max(1) as u64;
    let padded = e.size.div_ceil(granule).max(1) * granule;
    // The key is the hash of the contents; a file this daemon hashed before and that has not
    // changed since (same inode, size, mtime and ctime) keeps its hash, so a start whose data
    // is resident or cached reads nothing (GPT-2-Large's 3.1 GB took 2.4 s to read and hash
    // on the H200 in every pooled start, session 43).
    let identity = FileIdentity::of(e)?;
    let mut bytes = None;
    let hash = match known_hash(&identity, padded) {
        Some(h) => h,
        None => {
            let b = read(e, padded)?;
            let h = blake3::Hasher::new()
                .update_rayon(&b)
                .finalize()
                .to_hex()
                .to_string();
            // Settled files only: a write within the same clock tick as the hash may leave
            // ctime as it was ("racy git"), so a file changed in the last seconds is hashed
            // again next time.
            if identity.settled() {
                remember_hash(identity, padded, &h);
            }
            bytes = Some(b);
            h
        }
    };
    // The bytes, read now if the memo spared the read and a copy needs them after all.
    let padded_bytes = |bytes: &mut Option<Vec<u8>>| -> Result<Vec<u8>, GpuDataError> {
        match bytes.take() {
            Some(b) => Ok(b),
            None => read(e, padded),
        }
    };
    let key = crate::tenant::scoped_key(tenant, &gpu_key_of(backend, ordinal, &hash));
    let (lease, source) = if e.readonly {
        if let Some(copy) = split.resident_copy(&key) {
            (Lease::Shared(copy), "shared")
        } else {
            let cached = lock(&split.gpu_cache).get(&key);
            let (memory, source) = match cached {
                Some(m) => (m, "gpu"),
                None => {
                    let padded_bytes = padded_bytes(&mut bytes)?;
                    let m = Arc::new(
                        dev.fill_from_pageable(&padded_bytes, true)
                            .map_err(copy_err("filling it from the file"))?,
                    );
                    if lock(&split.gpu_cache).capacity() >= padded {
                        lock(&split.gpu_cache).insert(&key, Arc::clone(&m), padded);
                    }
                    (m, "file")
                }
            };
            (Lease::Shared(split.share(key, memory, padded)), source)
        }
    } else {
        let cached = lock(&split.gpu_cache).get(&key);
        let (memory, source) = match cached {
            Some(src) => (
                dev.fill_from_memory(&src, usize::try_from(padded).unwrap_or(usize::MAX), false)
                    .map_err(copy_err("copying it from the GPU cache"))?,
                "gpu",
            ),
            None => (
                dev.fill_from_pageable(&padded_bytes(&mut bytes)?, false)
                    .map_err(copy_err("filling it from the file"))?,
                "file",
            ),
        };
        (
            Lease::Own(OwnMemory {
                memory: Arc::new(memory),
            }),
            source,
        )
    };
    let fd = Split::export_lease(&*dev, &lease).map_err(copy_err("exporting it"))?;
    Ok(Filled {
        name: name(),
        size: e.size,
        padded,
        readonly: e.readonly,
        fd,
        source,
        lease,
    })
}

/// What says a data file is unchanged since its contents were hashed: a rewrite changes its
/// ctime (which no one can set back), a replacement its inode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileIdentity {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

/// How long a file's ctime must lie in the past for its hash to be remembered: far above any
/// file system's timestamp granularity.
const SETTLED: std::time::Duration = std::time::Duration::from_secs(2);

impl FileIdentity {
    fn settled(&self) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        now - self.ctime_ns > SETTLED.as_nanos() as i128
    }

    fn of(e: &Entry) -> Result<Self, GpuDataError> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&e.path).map_err(|source| GpuDataError::Read {
            name: e.name.clone(),
            path: e.path.clone(),
            source,
        })?;
        if m.len() != e.size {
            return Err(GpuDataError::Size {
                name: e.name.clone(),
                path: e.path.clone(),
                declared: e.size,
                actual: m.len(),
            });
        }
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Ok(FileIdentity {
            path: e.path.clone(),
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
        })
    }
}

/// Hashes of data files' padded contents, by file identity and padded size (the daemon's
/// lifetime; a few entries per deployed function).
static HASHES: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<(FileIdentity, u64), String>>,
> = std::sync::LazyLock::new(Default::default);

fn known_hash(identity: &FileIdentity, padded: u64) -> Option<String> {
    lock(&HASHES).get(&(identity.clone(), padded)).cloned()
}

fn remember_hash(identity: FileIdentity, padded: u64, hash: &str) {
    let mut hashes = lock(&HASHES);
    // A file replaced or rewritten leaves its old identity behind: drop it.
    hashes.retain(|(known, _), _| known.path != identity.path || *known == identity);
    hashes.insert((identity, padded), hash.to_string());
}

/// The file's bytes, exactly the declared size, followed by zeros up to `padded`.
fn read(e: &Entry, padded: u64) -> Result<Vec<u8>, GpuDataError> {
    let read_err = |source| GpuDataError::Read {
        name: e.name.clone(),
        path: e.path.clone(),
        source,
    };
    #[cfg(test)]
    {
        *lock(&tests::READS).entry(e.path.clone()).or_default() += 1;
    }
    let f = std::fs::File::open(&e.path).map_err(read_err)?;
    let actual = f.metadata().map_err(read_err)?.len();
    if actual != e.size {
        return Err(GpuDataError::Size {
            name: e.name.clone(),
            path: e.path.clone(),
            declared: e.size,
            actual,
        });
    }
    // Room for the padding from the start: growing the Vec would copy every byte once more.
    let mut bytes = Vec::with_capacity(usize::try_from(padded.max(e.size)).unwrap_or(0));
    f.take(e.size).read_to_end(&mut bytes).map_err(read_err)?;
    if bytes.len() as u64 != e.size {
        return Err(GpuDataError::Size {
            name: e.name.clone(),
            path: e.path.clone(),
            declared: e.size,
            actual: bytes.len() as u64,
        });
    }
    bytes.resize(usize::try_from(padded.max(e.size)).unwrap_or(usize::MAX), 0);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Reads of each data file by [`read`], for the tests.
    pub(super) static READS: std::sync::LazyLock<
        std::sync::Mutex<std::collections::HashMap<PathBuf, usize>>,
    > = std::sync::LazyLock::new(Default::default);

    fn reads(path: &std::path::Path) -> usize {
        lock(&READS).get(path).copied().unwrap_or(0)
    }

    #[test]
    fn a_settled_file_is_hashed_once_and_a_rewritten_one_gives_its_new_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let s = split(dir.path());
        let path = dir.path().join("w.bin");
        std::fs::write(&path, [1u8; 6000]).unwrap();
        let e = Entry {
            name: "w".into(),
            path: path.clone(),
            size: 6000,
            readonly: true,
        };
        // Just written: hashed, filled, but not remembered (its ctime may not have moved yet).
        drop(fill(&s, "host", -1, "default", &e).unwrap());
        drop(fill(&s, "host", -1, "default", &e).unwrap());
        assert_eq!(
            reads(&path),
            2,
            "a file written just now is read every time"
        );
        std::thread::sleep(SETTLED + std::time::Duration::from_millis(100));
        drop(fill(&s, "host", -1, "default", &e).unwrap());
        assert_eq!(reads(&path), 3);
        // Settled and hashed: served from the GPU cache without reading the file.
        let cached = fill(&s, "host", -1, "default", &e).unwrap();
        assert_eq!((cached.source, reads(&path)), ("gpu", 3));
        assert_eq!(&contents(&s, &cached)[..6000], &[1u8; 6000][..]);
        drop(cached);
        // Rewritten in place, same size: its identity changed, so it is read and hashed again
        // and the function gets the new bytes, never the cached old ones.
        std::fs::write(&path, [2u8; 6000]).unwrap();
        let fresh = fill(&s, "host", -1, "default", &e).unwrap();
        assert_eq!((fresh.source, reads(&path)), ("file", 4));
        assert_eq!(&contents(&s, &fresh)[..6000], &[2u8; 6000][..]);
    }

    fn split(dir: &std::path::Path) -> Split {
        let metrics = crate::metrics::Metrics::new().unwrap();
        let limits = crate::config::RestoreServer::default();
        let key = Arc::new(crate::staging::test_key());
        Split::new(dir, true, true, &limits, &metrics, key)
    }

    fn pcie_bytes(s: &Split) -> u64 {
        s.metrics.pcie_bytes.with_label_values(&["host"]).get()
    }

    fn contents(s: &Split, f: &Filled) -> Vec<u8> {
        let dev = s.device("host", -1).unwrap();
        let mut out = vec![0u8; f.padded as usize];
        let fd = Split::export_lease(&*dev, &f.lease).unwrap();
        dev.read_fd(fd, &mut out).unwrap();
        out
    }

    #[test]
    fn the_spec_names_the_cuda_entries_in_order() {
        let spec = json!({"data": [
            {"name": "a", "path": "a.bin", "abs_path": "/f/a.bin", "size": 3, "access": "read-only", "device": "cuda"},
            {"name": "b", "path": "b.bin", "abs_path": "/f/b.bin", "size": 4, "access": "read-only"},
            {"name": "c", "path": "c.bin", "abs_path": "/f/c.bin", "size": 5, "access": "writable", "device": "cuda"},
        ]});
        let e = entries(&spec).unwrap();
        assert_eq!(
            e.iter()
                .map(|e| (e.name.as_str(), e.size, e.readonly))
                .collect::<Vec<_>>(),
            [("a", 3, true), ("c", 5, false)]
        );
        assert!(entries(&json!({})).unwrap().is_empty());
        let bad = json!({"data": [{"name": "a", "size": 3, "device": "cuda"}]});
        let e = entries(&bad).unwrap_err().to_string();
        assert!(e.contains("\"a\"") && e.contains("abs_path"), "{e}");
    }

    #[test]
    fn read_only_data_is_filled_through_the_scheduler_once_then_shared() {
        let dir = tempfile::tempdir().unwrap();
        let s = split(dir.path());
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let path = dir.path().join("w.bin");
        std::fs::write(&path, &data).unwrap();
        let e = Entry {
            name: "w".into(),
            path,
            size: data.len() as u64,
            readonly: true,
        };
        let first = fill(&s, "host", -1, "team-a", &e).unwrap();
        assert_eq!(first.source, "file");
        assert_eq!(first.size, 10_000);
        assert_eq!(first.padded % 4096, 0);
        assert!(first.padded >= 10_000);
        let moved = pcie_bytes(&s);
        assert_eq!(
            moved, first.padded,
            "the fill went through the PCIe scheduler"
        );
        let got = contents(&s, &first);
        assert_eq!(&got[..data.len()], &data[..]);
        assert!(got[data.len()..].iter().all(|&b| b == 0));
        // While the first is held: the same shared copy, nothing copied.
        let second = fill(&s, "host", -1, "team-a", &e).unwrap();
        assert_eq!(second.source, "shared");
        assert_eq!(pcie_bytes(&s), moved);
        drop((first, second));
        // Nothing holds it now: the GPU cache's entry serves, still without a copy.
        let third = fill(&s, "host", -1, "team-a", &e).unwrap();
        assert_eq!(third.source, "gpu");
        assert_eq!(pcie_bytes(&s), moved);
        // Another tenant never gets this tenant's copy.
        let other = fill(&s, "host", -1, "team-b", &e).unwrap();
        assert_eq!(other.source, "file");
        assert_eq!(pcie_bytes(&s), 2 * moved);
    }

    #[test]
    fn writable_data_is_a_copy_of_its_own_and_a_changed_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = split(dir.path());
        let path = dir.path().join("w.bin");
        std::fs::write(&path, [7u8; 5000]).unwrap();
        let e = Entry {
            name: "w".into(),
            path: path.clone(),
            size: 5000,
            readonly: false,
        };
        let a = fill(&s, "host", -1, "default", &e).unwrap();
        let b = fill(&s, "host", -1, "default", &e).unwrap();
        assert!(matches!(a.lease, Lease::Own(_)) && matches!(b.lease, Lease::Own(_)));
        assert_eq!(&contents(&s, &b)[..5000], &[7u8; 5000][..]);
        std::fs::write(&path, [7u8; 4000]).unwrap();
        let err = fill(&s, "host", -1, "default", &e).unwrap_err().to_string();
        assert!(
            err.contains("has 4000 bytes, the spec says 5000; redeploy"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn without_the_split_gpu_path_a_cuda_entry_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = crate::metrics::Metrics::new().unwrap();
        let limits = crate::config::RestoreServer::default();
        let key = Arc::new(crate::staging::test_key());
        let s = Arc::new(Split::new(dir.path(), true, false, &limits, &metrics, key));
        let spec = json!({"data": [{"name": "w", "path": "w.bin", "abs_path": "/f/w.bin",
            "size": 3, "access": "read-only", "device": "cuda"}]});
        let e = start(&s, &spec, "default", 0).err().unwrap().to_string();
        assert!(e.contains("split_gpu = true"), "{e}");
        assert!(start(&s, &json!({"data": []}), "default", 0)
            .unwrap()
            .is_none());
    }
}
