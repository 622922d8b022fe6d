//! The chunk store: content-addressed chunks shared by all snapshots.
//!
//! Device segments and the files of CRIU images are cut into chunks ([`Chunking`]), each stored
//! once under its BLAKE3 id however many snapshots hold it: a base snapshot and the function
//! snapshots restored from it share their common pages and buffers (gCROP's multi-checkpoint
//! dedup), and so do functions. A [`Recipe`] per file or segment lists its chunks, so it can be
//! materialised back into a file (e.g. a tmpfs directory for CRIU) or read into a buffer.
//!
//! # Layout
//!
//! ```text
//! <root>/lock                 flock(2) lock file (see Concurrency)
//! <root>/chunks/ab/abcd…      one file per chunk: header + raw or zstd body (chunk.rs)
//! <root>/refs/<snapshot>.json the committed recipes of one snapshot: its references
//! <root>/tmp/                 chunks and records being written
//! <root>/corrupt/             chunks that failed verification, moved aside
//! ```
//!
//! # Reference counts
//!
//! A chunk's reference count is the number of committed snapshots whose record lists it
//! ([`ChunkStore::refcount`]). The counts are derived from the records, never stored as
//! counters: a record is written whole (temporary file, fsync, rename) or not at all, so a crash
//! cannot leave a count that disagrees with the references. [`StoreWriter::commit`] adds a
//! snapshot's references atomically, [`ChunkStore::release`] removes them (one unlink), and
//! [`ChunkStore::gc`] deletes the chunks no record lists.
//!
//! # Concurrency
//!
//! A writer stores chunks first and commits the record that references them last; in between,
//! its chunks are referenced by nobody, and a GC that ran then would delete them. So every
//! [`StoreWriter`] holds a **shared** flock on `<root>/lock` from its creation until its commit
//! (or drop), and [`ChunkStore::gc`] holds it **exclusively**: GC never runs while any chunk is
//! stored but not yet committed, and no writer starts while GC decides what is unreferenced.
//! Writers do not exclude each other (two writers storing the same chunk write the same bytes,
//! and the rename of the second replaces the first atomically). The kernel drops the lock of a
//! process that dies, so a crashed writer leaves only unreferenced chunks and temporary files,
//! which the next GC removes. `commit` also checks that every chunk it references exists, so a
//! recipe kept across a GC can never be committed dangling. GC stops with an error on a record
//! it cannot parse rather than treat that snapshot's chunks as garbage.
//!
//! Readers take no lock: the chunks of a committed snapshot stay until it is released, so a
//! caller must not release a snapshot that is being restored.
//!
//! # Durability and permissions
//!
//! Chunks are written to `tmp/` and renamed into place; `commit` flushes the filesystem once
//! (syncfs(2)) before it writes the record, so a committed record never references data that a
//! power loss can take back. A writer fed from a fast link ([`StoreWriter::write_back_early`])
//! starts each chunk's write-out as it places it, so the disk writes while the next chunks
//! arrive and the commit's syncfs waits only for the tail; [`StoreWriter::commit_many`] commits
//! several records (a pull's files and segments) after one syncfs. A chunk file that a crash left empty or truncated under its final
//! name is detected by its header and written again rather than referenced. The store is 0700
//! and chunks are 0600: they hold process memory.
//!
//! # Integrity
//!
//! Every chunk read is checked against its id; a corrupt chunk is moved to `corrupt/` and refused
//! with an error naming the chunk, the file it belongs to and the snapshots that hold it
//! (re-taking them stores the chunk again). A whole file or segment is also checked against the
//! recipe's hash before it is handed out.

mod chunk;
mod chunking;
mod compress;
mod error;
mod gc;
mod lock;
mod pending;
mod read;
mod recipe;
mod records;
mod shelf;
mod transfer;
mod usage;
mod write;

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

pub use chunk::ChunkId;
pub use chunking::{Chunking, PageCdc, PAGE_SIZE, SEGMENT_CHUNK_BYTES};
pub use compress::{Compression, DEFAULT_ZSTD_LEVEL, MIN_SAVING_DIVISOR};
pub use error::StoreError;
pub use gc::GcReport;
pub use pending::{Pending, Settled};
pub use recipe::{ChunkRef, Recipe};
pub use records::open_sealed_record;
pub use transfer::PutChunkFile;
pub use usage::Usage;
pub use write::{Commit, PutStats, StoreWriter};

use error::io_error;

const LOCK_FILE: &str = "lock";
const CHUNKS_DIR: &str = "chunks";
const REFS_DIR: &str = "refs";
const TMP_DIR: &str = "tmp";
const CORRUPT_DIR: &str = "corrupt";
const PENDING_DIR: &str = "pending";

/// An opened chunk store. Cheap to clone; every operation works on the directory, so several
/// `ChunkStore`s (threads, processes) may use one store at once.
#[derive(Debug, Clone)]
pub struct ChunkStore {
    root: PathBuf,
    compression: Compression,
    /// Chunks checked and held in memory, not yet written (shelf.rs): this root's, shared by
    /// every `ChunkStore` of it in this process.
    shelf: std::sync::Arc<shelf::Shelf>,
}

impl ChunkStore {
    /// Opens the store at `root`, creating it (and its subdirectories) if needed. Chunks are
    /// compressed with [`Compression::default`].
    pub fn open(root: &Path) -> Result<ChunkStore, StoreError> {
        let unusable = |source| StoreError::Unusable {
            root: root.to_path_buf(),
            source,
        };
        let root = std::path::absolute(root).map_err(unusable)?;
        // 0700: chunks hold process memory (keys, tokens), as readable as the snapshots are.
        let private = || {
            let mut builder = fs::DirBuilder::new();
            builder.recursive(true).mode(0o700);
            builder
        };
        for dir in [CHUNKS_DIR, REFS_DIR, TMP_DIR, CORRUPT_DIR, PENDING_DIR] {
            private().create(root.join(dir)).map_err(unusable)?;
        }
        // A store we cannot write to fails here, not halfway through a snapshot.
        let probe = root
            .join(TMP_DIR)
            .join(format!(".probe-{}", std::process::id()));
        fs::write(&probe, b"").map_err(unusable)?;
        fs::remove_file(&probe).map_err(unusable)?;
        Ok(ChunkStore {
            shelf: shelf::for_root(&root),
            root,
            compression: Compression::default(),
        })
    }

    /// Opens an existing store without creating anything: for readers such as `torpor inspect`.
    pub fn open_existing(root: &Path) -> Result<ChunkStore, StoreError> {
        let is_store = [CHUNKS_DIR, REFS_DIR]
            .iter()
            .all(|d| fs::metadata(root.join(d)).is_ok_and(|m| m.is_dir()));
        if !is_store {
            return Err(StoreError::NotAStore {
                root: root.to_path_buf(),
            });
        }
        let root = std::path::absolute(root).map_err(|source| StoreError::Unusable {
            root: root.to_path_buf(),
            source,
        })?;
        Ok(ChunkStore {
            shelf: shelf::for_root(&root),
            root,
            compression: Compression::default(),
        })
    }

    /// The same store, compressing new chunks as `compression` says.
    pub fn with_compression(mut self, compression: Compression) -> ChunkStore {
        self.compression = compression;
        self
    }

    /// The store's directory (absolute).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where chunk `id` lives (whether or not it is stored).
    pub fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        id.path_in(&self.root.join(CHUNKS_DIR))
    }

    /// Whether chunk `id` is stored (or held, checked, to be written: shelf.rs).
    pub fn contains(&self, id: &ChunkId) -> bool {
        fs::symlink_metadata(self.chunk_path(id)).is_ok_and(|m| m.is_file())
            || self.shelf.contains(id)
    }

    /// Chunks held in memory in this process, checked and not yet written (shelf.rs).
    pub fn held_chunks(&self) -> usize {
        self.shelf.len()
    }

    fn lock_path(&self) -> PathBuf {
        self.root.join(LOCK_FILE)
    }

    fn tmp_dir(&self) -> PathBuf {
        self.root.join(TMP_DIR)
    }

    fn refs_dir(&self) -> PathBuf {
        self.root.join(REFS_DIR)
    }
}

/// Why `id` cannot name a snapshot in the store, if it cannot (letters, digits, `.`, `_`, `-`;
/// not starting with `.`; at most 200 characters).
pub fn check_snapshot_id(id: &str) -> Result<(), StoreError> {
    let reason = if id.is_empty() {
        Some("empty")
    } else if id.len() > 200 {
        Some("longer than 200 characters")
    } else if id.starts_with('.') {
        Some("starts with '.'")
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("contains a character other than letters, digits, '.', '_' and '-'")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(StoreError::InvalidSnapshotId {
            id: id.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// fsync of a directory, so the names in it survive a crash.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("flush", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids() {
        for ok in ["base-py3.12", "fn_resnet.2", "a"] {
            check_snapshot_id(ok).expect(ok);
        }
        let long = "x".repeat(201);
        for bad in ["", ".hidden", "a/b", "..", "a b", long.as_str(), "é"] {
            assert!(check_snapshot_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn open_creates_the_layout_and_refuses_a_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ChunkStore::open(&dir.path().join("store")).expect("open");
        for sub in [CHUNKS_DIR, REFS_DIR, TMP_DIR, CORRUPT_DIR] {
            assert!(store.root().join(sub).is_dir(), "{sub}");
        }
        let reopened = ChunkStore::open_existing(store.root()).expect("existing");
        assert_eq!(reopened.root(), store.root());
        let err = ChunkStore::open_existing(dir.path()).expect_err("not a store");
        assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
        fs::write(dir.path().join("file"), b"").expect("write");
        let err = ChunkStore::open(&dir.path().join("file")).expect_err("file");
        assert!(matches!(err, StoreError::Unusable { .. }), "{err}");
    }
}
