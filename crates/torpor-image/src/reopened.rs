//! Snapshot portability: the files a restore reopens by path must be the ones the snapshot was
//! taken with.
//!
//! CRIU does not save the executables and libraries a process maps (the init binary, Python, its
//! shared libraries): it records their paths and maps them again at restore. On another node, or
//! after an upgrade, the same path can hold another build, and the restored process would run
//! with code that does not match its saved memory (a crash at best). So a snapshot records each
//! such file's path, size and SHA-256 ([`ReopenedFile`]), and a restore compares them with the
//! node's files first ([`check_reopened`]), refusing the first difference in one line.
//!
//! # The per-node hash cache
//!
//! Hashing every reopened file at every restore costs what reading them costs: tens of MB for
//! CPython, a few GB of CUDA and PyTorch libraries for a GPU worker, seconds on a cold start
//! (which is why a first version, BLAKE3 at each restore, was held back: commit 484c8ed). The
//! files almost never change, so a [`HashCache`] keeps, per node, the SHA-256 of each file by
//! its identity on this node: (device, inode, size, mtime in ns, ctime in ns). A restore stats
//! each file and hashes only those whose identity it has not seen. The key holds the ctime
//! because no unprivileged call can set it: rewriting a file in place and putting its mtime
//! back (`touch -d`) still changes its ctime, so a rewritten file is always hashed again.
//!
//! A file changed within the same timestamp tick as its hashing would keep its identity (the
//! kernel's file timestamps are coarse, a few ms). As git does for its index ("racy git"), an
//! identity whose mtime or ctime is less than [`SETTLE`] old is hashed but not cached: it is
//! hashed again at the next restore, until it has settled.
//!
//! The cache is a JSON file (root's, mode 0600), read whole and replaced whole (written aside,
//! renamed): a restore that cannot read or write it hashes everything and says nothing more
//! (it is a speed-up, never the check). Two restores saving at once may lose each other's new
//! entries; those files are hashed again next time.
//!
//! SHA-256 rather than the chunk store's BLAKE3: these hashes name files of the node (a
//! library, an interpreter) that operators compare with `sha256sum` and package manifests.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ImageError, Result};

/// How old a file's mtime and ctime must be for its hash to be cached (see the module doc).
pub const SETTLE: Duration = Duration::from_secs(2);

/// A cache file larger than this is not a cache torpor wrote: it is ignored (and replaced).
const MAX_CACHE_BYTES: u64 = 64 << 20;

/// Where this node's hash cache is: `$TORPOR_HASH_CACHE` when set (tests, a node whose /var is
/// read-only), else [`DEFAULT_HASH_CACHE`]. One file per node: `torpor snapshot`, `torpor
/// restore` and every torpord on the node share it (they run as root).
pub fn hash_cache_path() -> PathBuf {
    std::env::var_os("TORPOR_HASH_CACHE")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_HASH_CACHE), PathBuf::from)
}

/// The node's hash cache unless `$TORPOR_HASH_CACHE` names another.
pub const DEFAULT_HASH_CACHE: &str = "/var/cache/torpor/file-hashes.json";

/// A file the restored processes reopen by path, as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReopenedFile {
    /// Absolute path, as the processes see it.
    pub path: String,
    pub size: u64,
    /// SHA-256 of the contents, lowercase hex (the identity of the contents, whatever the inode).
    pub sha256: String,
}

impl ReopenedFile {
    /// The identity of the file at `path` (named `name` in the record), read through `path`
    /// (e.g. `/proc/<pid>/root/<name>` to see the process's mount namespace), its hash taken
    /// from `cache` when the file is unchanged since it was hashed on this node.
    pub fn identify(
        name: &str,
        path: &Path,
        cache: Option<&mut HashCache>,
    ) -> std::io::Result<ReopenedFile> {
        let meta = fs::metadata(path)?;
        if !meta.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        let sha256 = match cache {
            Some(cache) => cache.hash(path, &meta)?,
            None => sha256_file(path)?,
        };
        Ok(ReopenedFile {
            path: name.to_owned(),
            size: meta.len(),
            sha256,
        })
    }
}

/// SHA-256 of a file's contents, lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A file's identity on this node: the cache's key.
fn identity(meta: &fs::Metadata) -> String {
    let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
    format!(
        "{}:{}:{}:{}:{}",
        meta.dev(),
        meta.ino(),
        meta.len(),
        ns(meta.mtime(), meta.mtime_nsec()),
        ns(meta.ctime(), meta.ctime_nsec())
    )
}

/// Whether `meta`'s mtime and ctime are both at least [`SETTLE`] in the past.
fn settled(meta: &fs::Metadata) -> bool {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let limit = now - SETTLE.as_secs() as i64;
    meta.mtime() < limit && meta.ctime() < limit
}

/// What the cache file holds.
#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    format: u32,
    /// identity → SHA-256 (hex).
    hashes: BTreeMap<String, String>,
}

const CACHE_FORMAT: u32 = 1;

/// The per-node cache of file hashes by identity (see the module doc).
#[derive(Debug)]
pub struct HashCache {
    path: Option<PathBuf>,
    file: CacheFile,
    /// Identities looked up this time: only these are saved, so that entries of replaced
    /// files do not pile up forever.
    used: BTreeMap<String, String>,
    changed: bool,
    /// Files hashed (not found in the cache) since it was opened.
    pub hashed: u64,
    /// Bytes read to hash them.
    pub hashed_bytes: u64,
}

impl HashCache {
    /// The cache kept in `path`; a missing, unreadable or malformed file is an empty cache.
    pub fn open(path: &Path) -> HashCache {
        let file = fs::File::open(path)
            .ok()
            .filter(|f| f.metadata().is_ok_and(|m| m.len() <= MAX_CACHE_BYTES))
            .and_then(|f| serde_json::from_reader::<_, CacheFile>(std::io::BufReader::new(f)).ok())
            .filter(|c| c.format == CACHE_FORMAT)
            .unwrap_or_default();
        HashCache {
            path: Some(path.to_path_buf()),
            file,
            used: BTreeMap::new(),
            changed: false,
            hashed: 0,
            hashed_bytes: 0,
        }
    }

    /// A cache that remembers nothing: every file is hashed.
    pub fn none() -> HashCache {
        HashCache {
            path: None,
            file: CacheFile::default(),
            used: BTreeMap::new(),
            changed: false,
            hashed: 0,
            hashed_bytes: 0,
        }
    }

    /// The SHA-256 of the file at `path` whose metadata is `meta`: from the cache when its
    /// identity is there, else read and hashed (and cached once it has settled).
    pub fn hash(&mut self, path: &Path, meta: &fs::Metadata) -> std::io::Result<String> {
        if let Some(h) = self.cached(meta) {
            return Ok(h);
        }
        let h = sha256_file(path)?;
        self.hashed_now(path, meta, &h)?;
        Ok(h)
    }

    /// The cached hash of a file whose metadata is `meta`, if its identity is known.
    fn cached(&mut self, meta: &fs::Metadata) -> Option<String> {
        let key = identity(meta);
        let h = self.file.hashes.get(&key)?.clone();
        self.used.insert(key, h.clone());
        Some(h)
    }

    /// Records `h`, the hash just read of the file at `path` whose metadata was `meta` before
    /// the read; cached only if the file kept its identity through the read and has settled.
    fn hashed_now(&mut self, path: &Path, meta: &fs::Metadata, h: &str) -> std::io::Result<()> {
        self.hashed += 1;
        self.hashed_bytes += meta.len();
        self.learned(path, meta, h)
    }

    /// Records `h`, the hash of the file at `path` whose metadata was `meta` when `h` was
    /// found (read, or taken from its installer's record), under the same rule.
    fn learned(&mut self, path: &Path, meta: &fs::Metadata, h: &str) -> std::io::Result<()> {
        let after = fs::metadata(path)?;
        let key = identity(meta);
        if self.path.is_some() && identity(&after) == key && settled(&after) {
            self.file.hashes.insert(key.clone(), h.to_string());
            self.used.insert(key, h.to_string());
            self.changed = true;
        }
        Ok(())
    }

    /// Writes the cache back when something was added: the entries of this run and the ones
    /// it found, bounded to the ones this run used plus the newest others up to 100 000.
    /// Failures are ignored (the cache is a speed-up); returns whether it was written.
    pub fn save(&mut self) -> bool {
        let Some(path) = self.path.clone() else {
            return false;
        };
        if !self.changed {
            return false;
        }
        let mut hashes = std::mem::take(&mut self.used);
        for (k, v) in &self.file.hashes {
            if hashes.len() >= 100_000 {
                break;
            }
            hashes.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let doc = CacheFile {
            format: CACHE_FORMAT,
            hashes,
        };
        let Ok(json) = serde_json::to_vec(&doc) else {
            return false;
        };
        if let Some(parent) = path.parent() {
            let _ = fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent);
        }
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let tmp = path.with_extension(format!(
            "tmp-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let written = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(&json))
            .and_then(|()| fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
            return false;
        }
        self.file = doc;
        self.changed = false;
        true
    }
}

/// Compares `files` (recorded in the snapshot at `dir`) with the files under `root` (`/` for
/// this node), in order; the first that is missing or differs is refused, naming it. Hashes
/// come from `cache` for files unchanged since they were hashed on this node.
pub fn check_reopened(
    files: &[ReopenedFile],
    root: &Path,
    dir: &Path,
    cache: &mut HashCache,
) -> Result<()> {
    let paths: Vec<PathBuf> = files
        .iter()
        .map(|f| root.join(f.path.trim_start_matches('/')))
        .collect();
    let metas = metadata_of_all(&paths);
    for ((f, here), meta) in files.iter().zip(&paths).zip(metas) {
        let differs = |found: String| ImageError::NotPortable {
            dir: dir.to_path_buf(),
            file: f.path.clone(),
            expected: format!("{} bytes, sha256 {}", f.size, short(&f.sha256)),
            found,
        };
        let meta = match meta {
            Ok(m) if m.is_file() => m,
            Ok(_) => return Err(differs("not a regular file".into())),
            Err(e) => return Err(differs(format!("cannot be read: {e}"))),
        };
        if meta.len() != f.size {
            return Err(differs(format!("{} bytes", meta.len())));
        }
        let hash = cache
            .hash(here, &meta)
            .map_err(|e| differs(format!("cannot be read: {e}")))?;
        if hash != f.sha256 {
            return Err(differs(format!(
                "{} bytes, sha256 {}",
                meta.len(),
                short(&hash)
            )));
        }
    }
    cache.save();
    Ok(())
}

/// Threads [`metadata_of_all`] asks on.
const STAT_THREADS: usize = 16;

/// `fs::metadata` of each path, in order, asked on several threads: each is a wait for the disk
/// when the inodes are not cached (a node whose page cache was dropped), and a few hundred of
/// them one after another took 1.2-1.4 s beside the image's hash on the H200 machine
/// (`bench/results/split-bench-s23-colddisk-c-h200.json`, phase `check_reopened`).
fn metadata_of_all(paths: &[PathBuf]) -> Vec<std::io::Result<fs::Metadata>> {
    let per = paths.len().div_ceil(STAT_THREADS).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = paths
            .chunks(per)
            .map(|part| scope.spawn(move || part.iter().map(fs::metadata).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .zip(paths.chunks(per))
            .flat_map(|(h, part)| {
                h.join().unwrap_or_else(|_| {
                    part.iter()
                        .map(|_| Err(std::io::Error::other("a stat thread panicked")))
                        .collect()
                })
            })
            .collect()
    })
}

/// What [`warm_reopened`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Warmed {
    /// Regular files of the list found on this node, and their bytes.
    pub files: u64,
    pub bytes: u64,
    /// Of those, the ones hashed now (the cache did not know them), and their bytes.
    pub hashed: u64,
    pub hashed_bytes: u64,
    /// Of those the cache did not know, the ones whose hash their installer had recorded
    /// (crate::installer_record: not read), and their bytes.
    pub recorded: u64,
    pub recorded_bytes: u64,
}

/// At most this many bytes are read ahead by [`warm_reopened`]: a record that lists more is
/// not a Python process's libraries (a GPU worker's are a few GB).
pub const MAX_WARM_BYTES: u64 = 64 << 30;

/// Ahead of a restore on a node that may never have run the snapshot's processes (a pull from
/// the object store): the files the restore will reopen (`files`, under `root`) are hashed into
/// `cache` where it does not know them yet, on up to `threads` threads, and the ones it knows
/// are handed to the kernel's readahead. So the portability check that follows finds every hash
/// in the cache instead of reading a few GB of libraries after the pull, and CRIU, which reads
/// each library page it writes a saved private page over, finds them in the page cache (after
/// a dropped page cache CRIU's restore of a GPU worker took 2.0-2.6 s instead of 0.2 s).
/// Never an error: a missing or odd file is left for [`check_reopened`] to refuse.
pub fn warm_reopened(
    files: &[ReopenedFile],
    root: &Path,
    cache: &mut HashCache,
    threads: usize,
) -> Warmed {
    use rayon::prelude::*;
    let mut out = Warmed::default();
    let mut unknown = Vec::new();
    let mut known = Vec::new();
    let mut records = crate::installer_record::InstallerRecords::new();
    for f in files {
        let here = root.join(f.path.trim_start_matches('/'));
        let Ok(meta) = fs::metadata(&here) else {
            continue;
        };
        if !meta.is_file() || meta.len() != f.size || out.bytes + meta.len() > MAX_WARM_BYTES {
            continue;
        }
        out.files += 1;
        out.bytes += meta.len();
        if cache.cached(&meta).is_some() {
            known.push(here);
        } else if let Some(h) = records.sha256(&here, &meta) {
            if cache.learned(&here, &meta, &h).is_ok() {
                out.recorded += 1;
                out.recorded_bytes += meta.len();
            }
            known.push(here);
        } else {
            unknown.push((here, meta));
        }
    }
    // The files whose hashes are known are still what CRIU and the first request read: asked
    // for in the background, never waited for (on a compressed file system the kernel's
    // readahead decompresses in the calling thread).
    if !known.is_empty() {
        let _ = std::thread::Builder::new()
            .name("torpor-readahead".into())
            .spawn(move || known.iter().for_each(|p| readahead(p)));
    }
    // Reading is what warms the page cache, hashing is the CPU's share: several files at once,
    // the largest first (one file is one thread's: the largest bounds the time, so it must not
    // start last).
    unknown.sort_by_key(|(_, m)| std::cmp::Reverse(m.len()));
    let hashed: Vec<(PathBuf, fs::Metadata, String)> = match rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
    {
        Ok(pool) => pool.install(|| {
            unknown
                .into_par_iter()
                .filter_map(|(p, m)| sha256_file(&p).ok().map(|h| (p, m, h)))
                .collect()
        }),
        Err(_) => Vec::new(),
    };
    for (path, meta, h) in hashed {
        if cache.hashed_now(&path, &meta, &h).is_ok() {
            out.hashed += 1;
            out.hashed_bytes += meta.len();
        }
    }
    cache.save();
    out
}

/// Asks the kernel to read the whole file at `path` into the page cache, in the background.
fn readahead(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = fs::File::open(path) {
        // SAFETY: a valid fd for the call's duration; the advice changes no memory of ours.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED);
        }
    }
}

/// The first 16 hex digits: enough to tell two hashes apart in a message.
fn short(hash: &str) -> &str {
    &hash[..hash.len().min(16)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sets a file's mtime `secs` into the past (its ctime becomes now).
    fn age(path: &Path, secs: i64) {
        let t = SystemTime::now() - Duration::from_secs(secs as u64);
        fs::File::options()
            .write(true)
            .open(path)
            .and_then(|f| f.set_modified(t))
            .expect("set mtime");
    }

    #[test]
    fn warming_hashes_what_the_cache_lacks_so_the_check_after_reads_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        fs::create_dir_all(root.join("usr/lib/python")).expect("mkdir");
        for (name, body) in [
            ("liba.so", &b"library a"[..]),
            ("libb.so", &[7u8; 300_000][..]),
        ] {
            fs::write(root.join("usr/lib").join(name), body).expect("write");
        }
        let mut files: Vec<ReopenedFile> = ["/usr/lib/liba.so", "/usr/lib/libb.so"]
            .iter()
            .map(|p| ReopenedFile::identify(p, &root.join(&p[1..]), None).expect("identify"))
            .collect();
        // Entries the check refuses are left to it: a directory, a missing file, another size.
        let odd = |path: &str, size| ReopenedFile {
            path: path.into(),
            size,
            sha256: "0".repeat(64),
        };
        files.push(odd("/usr/lib/python", 4096));
        files.push(odd("/usr/lib/gone.so", 1));
        files.push(odd("/usr/lib/liba.so", 10));
        // Only a file whose ctime has settled is cached.
        std::thread::sleep(SETTLE + Duration::from_millis(1200)); // whole seconds
        let cache_path = root.join("cache/file-hashes.json");
        let mut cache = HashCache::open(&cache_path);
        let warmed = warm_reopened(&files, root, &mut cache, 4);
        assert_eq!(
            warmed,
            Warmed {
                files: 2,
                bytes: 300_009,
                hashed: 2,
                hashed_bytes: 300_009,
                recorded: 0,
                recorded_bytes: 0,
            }
        );
        // The check that follows, in another process or later: every hash from the cache.
        let mut again = HashCache::open(&cache_path);
        check_reopened(&files[..2], root, Path::new("/snaps/x"), &mut again).expect("same");
        assert_eq!(again.hashed, 0);
        // A second warm-up hashes nothing (the known files go to the kernel's readahead).
        let mut third = HashCache::open(&cache_path);
        let warmed = warm_reopened(&files, root, &mut third, 4);
        assert_eq!((warmed.files, warmed.hashed), (2, 0));
    }

    #[test]
    fn a_file_its_installer_recorded_is_not_read_and_the_check_finds_its_hash() {
        use base64::Engine as _;
        use std::io::Write as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let site = root.join("usr/lib/python3/site-packages");
        fs::create_dir_all(site.join("torch/lib")).expect("mkdir");
        fs::create_dir_all(site.join("torch-2.0.dist-info")).expect("mkdir");
        fs::write(site.join("torch/lib/libtorch.so"), [3u8; 200_000]).expect("write");
        fs::write(
            root.join("usr/lib/python3/libpython.so"),
            b"not from a wheel",
        )
        .expect("write");
        let files: Vec<ReopenedFile> = [
            "/usr/lib/python3/site-packages/torch/lib/libtorch.so",
            "/usr/lib/python3/libpython.so",
        ]
        .iter()
        .map(|p| ReopenedFile::identify(p, &root.join(&p[1..]), None).expect("identify"))
        .collect();
        let raw: Vec<u8> = (0..64)
            .step_by(2)
            .map(|i| u8::from_str_radix(&files[0].sha256[i..i + 2], 16).expect("hex"))
            .collect();
        let digest = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        let mut record = fs::File::create(site.join("torch-2.0.dist-info/RECORD")).expect("RECORD");
        writeln!(record, "torch/lib/libtorch.so,sha256={digest},200000").expect("write");
        drop(record);
        std::thread::sleep(SETTLE + Duration::from_millis(1200));
        let cache_path = root.join("cache/file-hashes.json");
        let warmed = warm_reopened(&files, root, &mut HashCache::open(&cache_path), 4);
        assert_eq!(
            (warmed.files, warmed.recorded, warmed.recorded_bytes),
            (2, 1, 200_000)
        );
        assert_eq!(
            (warmed.hashed, warmed.hashed_bytes),
            (1, 16),
            "only libpython read"
        );
        let mut again = HashCache::open(&cache_path);
        check_reopened(&files, root, Path::new("/snaps/x"), &mut again).expect("same");
        assert_eq!(again.hashed, 0);
    }

    #[test]
    fn identical_files_pass_and_the_first_difference_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        fs::create_dir_all(root.join("usr/lib")).expect("mkdir");
        fs::write(root.join("usr/lib/liba.so"), b"library a").expect("write");
        fs::write(root.join("usr/lib/libb.so"), b"library b").expect("write");
        let files: Vec<ReopenedFile> = ["/usr/lib/liba.so", "/usr/lib/libb.so"]
            .iter()
            .map(|p| ReopenedFile::identify(p, &root.join(&p[1..]), None).expect("identify"))
            .collect();
        assert_eq!(files[0].size, 9);
        // sha256("library a"), as `sha256sum` prints it.
        assert_eq!(files[0].sha256.len(), 64);
        let snap = Path::new("/snaps/x");
        check_reopened(&files, root, snap, &mut HashCache::none()).expect("same");

        // Same size, other contents: only the hash tells.
        fs::write(root.join("usr/lib/libb.so"), b"library B").expect("write");
        let err = check_reopened(&files, root, snap, &mut HashCache::none()).expect_err("hash");
        let line = err.to_string();
        assert!(
            line.contains("/usr/lib/libb.so") && !line.contains('\n'),
            "{line}"
        );
        assert!(!line.contains("liba"), "{line}");

        // Another size, and a missing file: the first in the list is named.
        fs::write(root.join("usr/lib/liba.so"), b"library a, v2").expect("write");
        fs::remove_file(root.join("usr/lib/libb.so")).expect("rm");
        let err = check_reopened(&files, root, snap, &mut HashCache::none()).expect_err("size");
        assert!(err.to_string().contains("/usr/lib/liba.so"), "{err}");
        assert!(err.to_string().contains("13 bytes"), "{err}");
        fs::write(root.join("usr/lib/liba.so"), b"library a").expect("write");
        let err = check_reopened(&files, root, snap, &mut HashCache::none()).expect_err("missing");
        assert!(err.to_string().contains("libb.so"), "{err}");
        assert!(err.to_string().contains("cannot be read"), "{err}");
    }

    #[test]
    fn with_more_files_than_stat_threads_the_first_difference_in_order_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let names: Vec<String> = (0..3 * STAT_THREADS + 5)
            .map(|i| format!("/lib{i:03}.so"))
            .collect();
        for n in &names {
            fs::write(root.join(&n[1..]), n.as_bytes()).expect("write");
        }
        let files: Vec<ReopenedFile> = names
            .iter()
            .map(|p| ReopenedFile::identify(p, &root.join(&p[1..]), None).expect("identify"))
            .collect();
        let snap = Path::new("/snaps/x");
        check_reopened(&files, root, snap, &mut HashCache::none()).expect("same");
        // Two missing, in different threads' shares: the earlier one in the list is named.
        fs::remove_file(root.join("lib040.so")).expect("rm");
        fs::remove_file(root.join("lib020.so")).expect("rm");
        let err = check_reopened(&files, root, snap, &mut HashCache::none()).expect_err("missing");
        assert!(err.to_string().contains("/lib020.so"), "{err}");
    }

    #[test]
    fn the_cache_hashes_a_settled_file_once_and_a_rewritten_one_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lib = dir.path().join("lib.so");
        let cache_path = dir.path().join("cache/file-hashes.json");
        fs::write(&lib, b"version 1").expect("write");
        age(&lib, 60);
        let files = vec![ReopenedFile::identify("/lib.so", &lib, None).expect("identify")];
        let snap = Path::new("/snaps/x");

        // A ctime of now: hashed, not cached (it has not settled).
        let mut cache = HashCache::open(&cache_path);
        check_reopened(&files, dir.path(), snap, &mut cache).expect("same");
        assert_eq!(cache.hashed, 1);
        assert!(!cache_path.exists(), "an unsettled file was cached");

        // Settled (ctime too: the test's tempdir is made now, so backdate by waiting is
        // too slow; take the identity as the cache would once SETTLE has passed).
        let meta = fs::metadata(&lib).expect("stat");
        let key = identity(&meta);
        let mut cache = HashCache::open(&cache_path);
        cache
            .file
            .hashes
            .insert(key.clone(), files[0].sha256.clone());
        cache.used.insert(key, files[0].sha256.clone());
        cache.changed = true;
        assert!(cache.save());
        let mut cache = HashCache::open(&cache_path);
        check_reopened(&files, dir.path(), snap, &mut cache).expect("same");
        assert_eq!(cache.hashed, 0, "a cached identity was hashed again");

        // Rewritten in place with the same size and its mtime put back: the ctime changed,
        // so it is hashed again and the change is seen.
        let mtime = meta.modified().expect("mtime");
        fs::write(&lib, b"version 2").expect("write");
        fs::File::options()
            .write(true)
            .open(&lib)
            .and_then(|f| f.set_modified(mtime))
            .expect("set mtime");
        let mut cache = HashCache::open(&cache_path);
        let err = check_reopened(&files, dir.path(), snap, &mut cache).expect_err("changed");
        assert_eq!(cache.hashed, 1);
        assert!(err.to_string().contains("/lib.so"), "{err}");

        // A cache file that is not one: an empty cache, and the check still runs.
        fs::write(&cache_path, b"not json").expect("write");
        let mut cache = HashCache::open(&cache_path);
        assert!(check_reopened(&files, dir.path(), snap, &mut cache).is_err());
    }

    #[test]
    fn sha256_is_the_standard_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("abc");
        fs::write(&f, b"abc").expect("write");
        assert_eq!(
            sha256_file(&f).expect("hash"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
