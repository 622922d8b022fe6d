//! Storing files and segments as chunks, and committing a snapshot's references.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rayon::prelude::*;

use crate::auth::SnapshotKey;
use crate::store::chunk::{self, HEADER_LEN};
use crate::store::error::{io_error, StoreError};
use crate::store::lock::{self, Mode, StoreLock};
use crate::store::pending::Pending;
use crate::store::records;
use crate::store::shelf;
use crate::store::{check_snapshot_id, ChunkId, ChunkRef, ChunkStore, Chunking, Recipe};

/// Makes the names of temporary chunk files unique within this process.
pub(crate) static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// What a writer stored so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PutStats {
    /// Chunks in the recipes made.
    pub chunks: u64,
    /// Bytes in the recipes made.
    pub logical_bytes: u64,
    /// Chunks that were not in the store yet and were written.
    pub new_chunks: u64,
    /// Raw bytes of those chunks.
    pub new_raw_bytes: u64,
    /// Bytes they take on disk (headers included, after compression).
    pub new_stored_bytes: u64,
}

/// Stores chunks for one snapshot, then commits its references. Holds the store's lock shared
/// from creation to commit or drop, so GC cannot delete its not-yet-referenced chunks (see the
/// module documentation).
#[derive(Debug)]
pub struct StoreWriter<'a> {
    store: &'a ChunkStore,
    /// Taken by a deferred commit, whose [`Pending`] holds it until the chunks this writer
    /// holds in memory are written.
    lock: Option<StoreLock>,
    stats: PutStats,
    /// Start each chunk file's write-out to the disk as soon as it is written
    /// ([`StoreWriter::write_back_early`]).
    write_back: bool,
    /// Chunk files this writer may hold in memory instead of writing them, in bytes
    /// ([`StoreWriter::hold_up_to`]); 0: none.
    hold_limit: u64,
    /// Bytes of chunk files it holds.
    held_bytes: AtomicU64,
    /// The chunks it put on the store's shelf, to be written by its commit or its drop.
    held: Mutex<Vec<ChunkId>>,
}

/// One record of [`StoreWriter::commit_many`]: snapshot `id` made of `recipes`, sealed with
/// `key` when given.
#[derive(Debug, Clone, Copy)]
pub struct Commit<'a> {
    pub id: &'a str,
    pub recipes: &'a [Recipe],
    pub key: Option<&'a SnapshotKey>,
}

/// The outcome of storing one chunk.
struct Stored {
    chunk: ChunkRef,
    /// Bytes written to disk, when the chunk was new.
    written: Option<u64>,
}

impl ChunkStore {
    /// Starts writing a snapshot; waits while a GC runs.
    pub fn writer(&self) -> Result<StoreWriter<'_>, StoreError> {
        let lock = lock::lock(&self.lock_path(), Mode::Shared, true)?
            .expect("a waiting lock is always taken");
        Ok(StoreWriter {
            store: self,
            lock: Some(lock),
            stats: PutStats::default(),
            write_back: false,
            hold_limit: 0,
            held_bytes: AtomicU64::new(0),
            held: Mutex::new(Vec::new()),
        })
    }
}

impl StoreWriter<'_> {
    /// The same writer, starting the disk write of every chunk file it places as soon as the
    /// file is written (sync_file_range(2), `SYNC_FILE_RANGE_WRITE`: asynchronous, it waits for
    /// nothing but a full device queue). The commit's syncfs still makes them durable; what
    /// changes is when the disk works: while the writer's caller fetches the next chunks rather
    /// than all at once in the commit. For a writer fed faster than the disk writes (a pull
    /// from a fast link), it turns "fetch, then flush" into both at once.
    pub fn write_back_early(mut self) -> Self {
        self.write_back = true;
        self
    }

    /// Whether chunk files are written back early.
    pub(crate) fn writes_back(&self) -> bool {
        self.write_back
    }

    /// The same writer, letting [`hold_chunk_file`](Self::hold_chunk_file) keep up to `bytes`
    /// of chunk files in memory instead of writing them (shelf.rs): readers of the store in
    /// this process find them at once, and a deferred commit's [`Pending::finish`] writes them
    /// after the caller has answered. For a pull whose first start should not wait for its
    /// chunk files' writes (docs/objstore.md, "Chunk files placed after the answer").
    pub fn hold_up_to(mut self, bytes: u64) -> Self {
        self.hold_limit = bytes;
        self
    }

    /// Stores `buf[range]`, a chunk file that came from elsewhere (`origin` names it), after
    /// checking that it decodes to exactly `c`, as
    /// [`put_chunk_file`](Self::put_chunk_file) does; but within the writer's
    /// [`hold_up_to`](Self::hold_up_to) it holds the bytes in memory (sharing `buf`) instead of
    /// writing them. Safe to call from several threads.
    pub fn hold_chunk_file<'a>(
        &self,
        c: &ChunkRef,
        buf: &'a Arc<Vec<u8>>,
        range: Range<usize>,
        origin: &str,
        scratch: &'a mut Vec<u8>,
    ) -> Result<crate::store::PutChunkFile<'a>, StoreError> {
        let bytes = buf.get(range.clone()).unwrap_or_default();
        let checking = Instant::now();
        let raw = check_foreign(c, bytes, origin, scratch)?;
        let checked = checking.elapsed();
        let store = self.store;
        let path = store.chunk_path(&c.id);
        if already_stored(&path, c.len) || store.shelf.contains(&c.id) {
            return Ok(crate::store::PutChunkFile {
                new: false,
                checked,
                raw,
            });
        }
        let len = bytes.len() as u64;
        let room = self
            .held_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                (held + len <= self.hold_limit).then_some(held + len)
            })
            .is_ok();
        let held = room
            && shelf::Held::new(buf, range).is_some_and(|h| {
                let put = store.shelf.put(c.id, h);
                if put {
                    lock_vec(&self.held).push(c.id);
                }
                put
            });
        if !held {
            if room {
                self.held_bytes.fetch_sub(len, Ordering::Relaxed);
            }
            if !store.shelf.contains(&c.id) {
                place_chunk_file(store, &c.id, &path, bytes, self.write_back)?;
            }
        }
        Ok(crate::store::PutChunkFile {
            new: true,
            checked,
            raw,
        })
    }

    /// Stores a device segment, cut into [`Chunking::SEGMENT`] chunks.
    pub fn put_bytes(&mut self, name: &str, data: &[u8]) -> Result<Recipe, StoreError> {
        self.put_bytes_with(name, data, Chunking::SEGMENT)
    }

    /// Stores `data` cut as `chunking` says; `name` is what the recipe (and errors) call it.
    pub fn put_bytes_with(
        &mut self,
        name: &str,
        data: &[u8],
        chunking: Chunking,
    ) -> Result<Recipe, StoreError> {
        let ranges = chunking.cut(data);
        let stored: Vec<Stored> = ranges
            .into_par_iter()
            .map(|range| self.store_chunk(&data[range]))
            .collect::<Result<_, _>>()?;
        let mut whole = blake3::Hasher::new();
        whole.update_rayon(data);
        let mut chunks = Vec::with_capacity(stored.len());
        for s in stored {
            self.stats.chunks += 1;
            if let Some(bytes) = s.written {
                self.stats.new_chunks += 1;
                self.stats.new_raw_bytes += s.chunk.len;
                self.stats.new_stored_bytes += bytes;
            }
            chunks.push(s.chunk);
        }
        self.stats.logical_bytes += data.len() as u64;
        Ok(Recipe {
            name: name.to_owned(),
            size: data.len() as u64,
            blake3: whole.finalize().to_hex().to_string(),
            chunks,
        })
    }

    /// Stores the file at `path` as `name` (its path inside the snapshot), cut as
    /// [`Chunking::for_image_file`] says for that name.
    pub fn put_file(&mut self, path: &Path, name: &str) -> Result<Recipe, StoreError> {
        self.put_file_with(path, name, Chunking::for_image_file(name))
    }

    /// Stores the file at `path` as `name`, cut as `chunking` says.
    pub fn put_file_with(
        &mut self,
        path: &Path,
        name: &str,
        chunking: Chunking,
    ) -> Result<Recipe, StoreError> {
        // O_NOFOLLOW: a symlink swapped into a dump directory is never followed.
        let file = File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| io_error("read", path, e))?;
        let meta = file.metadata().map_err(|e| io_error("read", path, e))?;
        if !meta.is_file() {
            return Err(io_error(
                "read",
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"),
            ));
        }
        if meta.len() == 0 {
            return self.put_bytes_with(name, &[], chunking);
        }
        // SAFETY: the map is read-only and private to this call. The file is a finished image or
        // segment that nothing writes any more; were it changed anyway, the chunk ids and the
        // whole hash would describe what was read, and materialising would verify against them.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_error("map", path, e))?;
        self.put_bytes_with(name, &map, chunking)
    }

    /// The store this writer writes to.
    pub(crate) fn store(&self) -> &ChunkStore {
        self.store
    }

    /// What this writer stored so far.
    pub fn stats(&self) -> PutStats {
        self.stats
    }

    /// Records `recipes` as the contents of snapshot `snapshot_id`, atomically: afterwards every
    /// chunk they list has one more reference, or, on error, none. Ends the writer.
    pub fn commit(self, snapshot_id: &str, recipes: &[Recipe]) -> Result<(), StoreError> {
        self.commit_with(snapshot_id, recipes, None)
    }

    /// [`commit`](Self::commit), the record sealed with `key`, for snapshots restored from it
    /// ([`ChunkStore::sealed_recipes`]).
    pub fn commit_sealed(
        self,
        snapshot_id: &str,
        recipes: &[Recipe],
        key: &SnapshotKey,
    ) -> Result<(), StoreError> {
        self.commit_with(snapshot_id, recipes, Some(key))
    }

    /// Commits several snapshots' records at once: each as [`commit`](Self::commit) (or
    /// [`commit_sealed`](Self::commit_sealed) with a key) would, after one syncfs for all of
    /// them instead of one each. Every record is checked before anything is written; the
    /// records are then written in order, so on an error the ones before it are committed and
    /// the others are not (each record is whole or absent, as always). Ends the writer.
    pub fn commit_many(mut self, records: &[Commit<'_>]) -> Result<(), StoreError> {
        let mut used = Vec::new();
        for c in records {
            used.extend(self.check_commit(c.id, c.recipes)?);
        }
        let held = self.take_held(used);
        place_held(self.store, &held, self.write_back)?;
        syncfs(self.store.root())?;
        for c in records {
            records::write_record(self.store, c.id, c.recipes, c.key, true)?;
        }
        Ok(())
    }

    /// [`commit_many`](Self::commit_many) without waiting for the disk: each record's pending
    /// marker is created, then the records are written (not fsync'd), so that readers find
    /// them at once; the returned [`Pending`] makes chunks and records durable
    /// ([`Pending::finish`]: one syncfs) and removes the markers. A process that dies before
    /// that leaves the markers, and [`ChunkStore::settle`] decides then, from the chunks
    /// themselves, whether each record stands. Ends the writer.
    ///
    /// The chunks held in memory (this writer's, [`hold_chunk_file`](Self::hold_chunk_file),
    /// and any other writer's that the records use) are written by [`Pending::finish`], which
    /// keeps the store's lock until then (no GC meanwhile).
    pub fn commit_many_deferred(mut self, records: &[Commit<'_>]) -> Result<Pending, StoreError> {
        let mut used = Vec::new();
        for c in records {
            used.extend(self.check_commit(c.id, c.recipes)?);
        }
        let held = self.take_held(used);
        let mut pending = Pending::new(self.store, self.lock.take(), held, self.write_back);
        for c in records {
            // The marker's name before the record's: a journalling filesystem commits
            // namespace changes in order, so a record that survives a crash has its marker.
            pending.mark(c.id)?;
            records::write_record(self.store, c.id, c.recipes, c.key, false)?;
        }
        Ok(pending)
    }

    fn commit_with(
        mut self,
        snapshot_id: &str,
        recipes: &[Recipe],
        key: Option<&SnapshotKey>,
    ) -> Result<(), StoreError> {
        let used = self.check_commit(snapshot_id, recipes)?;
        let held = self.take_held(used);
        place_held(self.store, &held, self.write_back)?;
        // Every chunk written since the last sync reaches the disk before the record that
        // references them: one syncfs instead of an fsync per chunk.
        syncfs(self.store.root())?;
        records::write_record(self.store, snapshot_id, recipes, key, true)
    }

    /// The chunks this writer holds in memory, no longer its to write, with `used` (the ones
    /// a commit's records use, which other writers may hold), each once.
    fn take_held(&mut self, mut used: Vec<ChunkId>) -> Vec<ChunkId> {
        self.held_bytes.store(0, Ordering::Relaxed);
        used.append(&mut lock_vec(&self.held));
        used.sort_unstable();
        used.dedup();
        used
    }

    /// Why `recipes` cannot be committed as snapshot `snapshot_id`, if they cannot; else the
    /// chunks they use that are held in memory, not yet written (by any writer).
    fn check_commit(
        &self,
        snapshot_id: &str,
        recipes: &[Recipe],
    ) -> Result<Vec<ChunkId>, StoreError> {
        check_snapshot_id(snapshot_id)?;
        let mut names = HashSet::new();
        for recipe in recipes {
            recipe.validate()?;
            if !names.insert(recipe.name.as_str()) {
                return Err(StoreError::InvalidRecipe {
                    file: recipe.name.clone(),
                    reason: format!("listed twice in snapshot {snapshot_id}"),
                });
            }
        }
        let store = self.store;
        if records::record_path(store, snapshot_id).exists() {
            return Err(StoreError::SnapshotExists {
                id: snapshot_id.to_owned(),
            });
        }
        // A recipe made before a GC may name chunks that GC since deleted: never commit those.
        let mut seen = HashSet::new();
        let mut held = Vec::new();
        for recipe in recipes {
            for c in &recipe.chunks {
                if !seen.insert(c.id) {
                    continue;
                }
                let on_disk =
                    fs::symlink_metadata(store.chunk_path(&c.id)).is_ok_and(|m| m.is_file());
                if on_disk {
                    continue;
                }
                if store.shelf.contains(&c.id) {
                    held.push(c.id);
                    continue;
                }
                return Err(StoreError::MissingChunk {
                    chunk: c.id,
                    file: recipe.name.clone(),
                    snapshots: format!("none yet ({snapshot_id} is being committed)"),
                });
            }
        }
        Ok(held)
    }

    fn store_chunk(&self, data: &[u8]) -> Result<Stored, StoreError> {
        let id = ChunkId::of(data);
        let chunk = ChunkRef {
            id,
            len: data.len() as u64,
        };
        let path = self.store.chunk_path(&id);
        if already_stored(&path, chunk.len) {
            return Ok(Stored {
                chunk,
                written: None,
            });
        }
        let bytes = chunk::encode(data, self.store.compression);
        place_chunk_file(self.store, &id, &path, &bytes, self.write_back)?;
        Ok(Stored {
            chunk,
            written: Some(bytes.len() as u64),
        })
    }
}

impl Drop for StoreWriter<'_> {
    /// A writer ended without a commit (an error) still writes the chunks it held: they are
    /// checked, and the next pull or snapshot needs them, as it needs the ones it wrote.
    fn drop(&mut self) {
        let held = self.take_held(Vec::new());
        if !held.is_empty() {
            let _ = place_held(self.store, &held, self.write_back);
        }
    }
}

/// A poisoned lock's list is still whole: its holders only push and take.
fn lock_vec<T>(m: &Mutex<Vec<T>>) -> std::sync::MutexGuard<'_, Vec<T>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Checks a chunk file from elsewhere against `c`; its raw bytes.
pub(crate) fn check_foreign<'a>(
    c: &ChunkRef,
    bytes: &'a [u8],
    origin: &str,
    scratch: &'a mut Vec<u8>,
) -> Result<&'a [u8], StoreError> {
    chunk::check_raw(bytes, &c.id, c.len, scratch).map_err(|damage| {
        StoreError::ForeignChunkCorrupt {
            chunk: c.id,
            origin: origin.to_owned(),
            damage: damage.to_string(),
        }
    })
}

/// Threads that write held chunks into the store: a few, since each write mostly copies into
/// the page cache (the CPU) and this runs beside the restore that the pull answered for.
fn placing_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 8))
}

/// Writes the held chunks `ids` into the store (any that another writer wrote meanwhile, or
/// that are no longer held, are skipped), each let go of once its file is in place. The first
/// error is returned; the chunks not written stay held, so this process still reads them.
pub(crate) fn place_held(
    store: &ChunkStore,
    ids: &[ChunkId],
    write_back: bool,
) -> Result<(), StoreError> {
    if ids.is_empty() {
        return Ok(());
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let first: Mutex<Option<StoreError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..placing_threads().min(ids.len()) {
            scope.spawn(|| {
                while let Some(id) = ids.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let Some(held) = store.shelf.get(id) else {
                        continue;
                    };
                    let bytes = held.bytes();
                    let path = store.chunk_path(id);
                    let stored = bytes
                        .get(..HEADER_LEN)
                        .and_then(chunk::raw_len)
                        .is_some_and(|len| already_stored(&path, len));
                    let placed = if stored {
                        Ok(())
                    } else {
                        place_chunk_file(store, id, &path, bytes, write_back)
                    };
                    match placed {
                        Ok(()) => store.shelf.remove(id),
                        Err(e) => {
                            first
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    match first
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Whether a chunk file for `raw_len` bytes is at `path` already. Its header is read, not just
/// its name trusted: a crash before the writer's commit (before syncfs) can leave an empty or
/// truncated file under the final name, which must be written again rather than referenced.
pub(crate) fn already_stored(path: &Path, raw_len: u64) -> bool {
    let mut header = [0u8; HEADER_LEN];
    File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .is_ok_and(|()| chunk::raw_len(&header) == Some(raw_len))
}

/// Writes a new file readable by its owner only (chunks hold process memory); with
/// `write_back`, starts writing it to the disk at once (see [`StoreWriter::write_back_early`]).
pub(crate) fn write_private(path: &Path, bytes: &[u8], write_back: bool) -> std::io::Result<()> {
    let mut file = File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    if write_back {
        // SAFETY: sync_file_range only reads the descriptor, which `file` keeps open for the
        // call; offset 0 and length 0 mean the whole file. Its result is ignored: it only
        // starts the write-out early, and the commit's syncfs is what makes the file durable
        // (and reports a failed write).
        let _ =
            unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
    Ok(())
}

/// Flushes the filesystem holding `dir` (syncfs(2)).
pub(crate) fn syncfs(dir: &Path) -> Result<(), StoreError> {
    let handle = File::open(dir).map_err(|e| io_error("open", dir, e))?;
    // SAFETY: syncfs only reads the descriptor, which `handle` keeps open for the call.
    let rc = unsafe { libc::syncfs(handle.as_raw_fd()) };
    if rc != 0 {
        return Err(io_error("flush", dir, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Puts the encoded chunk file `bytes` of `id` at `path`, its place in `store`, so that no
/// reader ever sees half a chunk. Where the file system can (`O_TMPFILE`: ext4, xfs, btrfs,
/// tmpfs), the file is made without a name in its own fan-out directory and linked into place
/// once written ([`place_nameless`]); elsewhere it is written privately into the store's tmp
/// dir, then renamed into its fan-out directory. Nothing is left in the tmp dir on failure.
pub(super) fn place_chunk_file(
    store: &ChunkStore,
    id: &ChunkId,
    path: &Path,
    bytes: &[u8],
    write_back: bool,
) -> Result<(), StoreError> {
    let dir = path.parent().expect("chunk paths have a fan-out directory");
    match place_nameless(dir, path, bytes, write_back) {
        Ok(true) => return Ok(()),
        Ok(false) => {}
        Err(e) => return Err(e),
    }
    let tmp = store.tmp_dir().join(format!(
        "{}.{}.{}",
        id.to_hex(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    write_private(&tmp, bytes, write_back).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        io_error("write", &tmp, e)
    })?;
    let placed = fs::create_dir_all(dir)
        .map_err(|e| io_error("create", dir, e))
        .and_then(|()| fs::rename(&tmp, path).map_err(|e| io_error("write", path, e)));
    if placed.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    placed
}

/// Writes `bytes` into a file without a name in `dir` (`O_TMPFILE`, mode 0600) and links it
/// at `path`. Why not the tmp dir and a rename: a rename locks both directories, so writers
/// storing many chunks at once (a pull's, one per core) all queue on the one tmp dir; on the
/// H100 a pull's 16 writers spent most of their time there (`do_renameat2`,
/// docs/objstore.md). Here each locks only its chunk's fan-out directory, and a crash leaves
/// no file behind. `Ok(false)`: this file system or process cannot (no `O_TMPFILE`, no
/// `/proc`, or a damaged chunk file is in the way): the caller takes the rename path, which
/// also replaces such a file.
fn place_nameless(
    dir: &Path,
    path: &Path,
    bytes: &[u8],
    write_back: bool,
) -> Result<bool, StoreError> {
    let open = || {
        File::options()
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(dir)
    };
    let mut file = match open() {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(|e| io_error("create", dir, e))?;
            match open() {
                Ok(f) => f,
                Err(e) if unsupported(&e) => return Ok(false),
                Err(e) => return Err(io_error("write", dir, e)),
            }
        }
        Err(e) if unsupported(&e) => return Ok(false),
        Err(e) => return Err(io_error("write", dir, e)),
    };
    file.write_all(bytes)
        .map_err(|e| io_error("write", path, e))?;
    if write_back {
        // SAFETY: as in write_private: only reads the descriptor `file` keeps open.
        let _ =
            unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
    // linkat through /proc/self/fd works without CAP_DAC_READ_SEARCH (open(2), O_TMPFILE).
    let from =
        CString::new(format!("/proc/self/fd/{}", file.as_raw_fd())).expect("no NUL in a number");
    let Ok(to) = CString::new(path.as_os_str().as_bytes()) else {
        return Ok(false);
    };
    // SAFETY: both paths are NUL-terminated strings that live for the call; `file` keeps the
    // descriptor the first names open.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // Another writer linked the same chunk first: content-addressed, so the same bytes,
        // unless what is there is damaged (then the rename path replaces it).
        Some(libc::EEXIST) => Ok(bytes
            .get(..HEADER_LEN)
            .and_then(chunk::raw_len)
            .is_some_and(|len| already_stored(path, len))),
        Some(libc::ENOENT | libc::EPERM | libc::EXDEV | libc::EOPNOTSUPP) => Ok(false),
        _ => Err(io_error("write", path, e)),
    }
}

/// Whether an `O_TMPFILE` open failed for want of support (old kernel: `EISDIR`; a file
/// system without it: `EOPNOTSUPP`), not for a reason the rename path would meet too.
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
    )
}
