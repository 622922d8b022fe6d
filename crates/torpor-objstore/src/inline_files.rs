//! The snapshot directory a pull writes as the files' chunks arrive ([`InlineFiles`]).
//!
//! Each writer of the pull's pipeline puts a chunk's raw bytes at every offset where the files
//! use it, instead of the directory being read back out of the store once every chunk is in
//! (1.5 GB of a GPT-2-Large snapshot's CRIU pages read, decoded and written again: 1.7-3.5 s
//! beside the fetch on the H100, up to 2.9 s of it waited for). What it ends with is checked as
//! before: every file's hash compared with the authenticated manifest's (the hashes taken as
//! the files' blocks land, landed_hash.rs).
//!
//! What keeps the pipeline's writers off the files' path:
//!
//! - **Each writer copies into the file's pages itself, beside the others.** A file is mapped
//!   shared and writable, and a chunk is copied into the mapping at its offsets: the page cache
//!   is filled as by `write`, but without the inode's lock that lets one buffered write into an
//!   ext4 file at a time, so the pull's writers fill CRIU's pages side by side. The file gets
//!   all its blocks when it is made (`fallocate`: unwritten extents, which read as zeros): a
//!   page dirtied through a mapping with no block behind it would need one at writeback, and a
//!   full disk would then kill the daemon with SIGBUS; `fallocate` answers ENOSPC instead, and
//!   the pull fails before it fetches, naming the file. (A block for each chunk as it came, the
//!   first try, put 25 000 `fallocate` calls one after another on the inode's lock: a GPT-2-Large
//!   pull on the H200 went 1.64 → 1.51 s only, `cluster-pull-s51-mapped-*-h200.json`.) The
//!   zeros of such a file hold blocks, as in the snapshot the deploy wrote. Where the file
//!   system cannot allocate so (`EOPNOTSUPP`) or the file cannot be mapped, its writes go the
//!   way below.
//! - **Otherwise a busy file is handed over, not waited for.** ext4 lets one buffered write into a file
//!   at a time (the inode's lock), and a snapshot's files are mostly one: CRIU's pages. With a
//!   lock a writer waited for, the sixteen writers of a pull queued on it while the segments'
//!   chunks waited behind them (session 30 on the H100, `bench/cluster/pull.py --perf
//!   --perf-call-graph dwarf`: 28 thread-s of placing of which 4 on a CPU). Now a writer that
//!   finds the file busy copies the chunk into a queue of that file and goes on; whoever holds
//!   the file writes the queue before letting go (flat combining). The files are written one
//!   write at a time as before, beside the segments instead of in front of them. The queue is
//!   bounded ([`QUEUE_BYTES`]): past it a writer waits as before.
//! - **Zeros are not written.** The files are made at their size as holes (or unwritten blocks,
//!   mapped), which read as zeros: a chunk that is all zeros (CRIU's pages hold many) is left
//!   as it is.
//!
//! Every write (and every hole left) is told to [`LandedHash`], which hashes each block of a
//! file once all of its bytes are in: the directory's verification compares those hashes with
//! the manifest's instead of reading every file again at the end.

use std::collections::HashMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};
use std::time::Instant;

use torpor_image::store::{ChunkId, ChunkRef, ChunkStore, Recipe};
use torpor_image::{Manifest, Snapshot, Trust, MAC_FILE, MANIFEST_FILE};

use crate::chunks::lock;
use crate::error::TransferError;
use crate::landed_hash::LandedHash;
use crate::pull::io;

/// Bytes of chunks a file's queue may hold before a writer waits for the file instead (each
/// queued chunk is a copy).
pub(crate) const QUEUE_BYTES: u64 = 256 << 20;

/// What the directory takes from the bucket besides the chunks.
pub(crate) struct Fetched<'a> {
    pub(crate) manifest_bytes: &'a [u8],
    pub(crate) mac: Option<&'a [u8]>,
}

/// A snapshot directory written beside its final place, authenticated and verified.
pub(crate) struct Aside {
    pub(crate) path: PathBuf,
    pub(crate) materialise_s: f64,
    pub(crate) verify_s: f64,
}

impl Aside {
    /// Puts it in its place.
    pub(crate) fn rename_to(self, out: &Path) -> Result<(), TransferError> {
        fs::rename(&self.path, out).map_err(|source| {
            let _ = fs::remove_dir_all(&self.path);
            TransferError::Io {
                op: "rename",
                path: out.to_path_buf(),
                source,
            }
        })
    }

    /// Removes it (the pull failed after it was written).
    pub(crate) fn remove(self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// How the files' bytes went in: what a pull reports beside its timings.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct InlineStats {
    /// Bytes written into the files.
    pub written_bytes: u64,
    /// Bytes of chunks that were all zeros, left as holes.
    pub zero_bytes: u64,
    /// Writes a writer handed to whoever held the file (copied into its queue).
    pub handed_over: u64,
    /// Seconds writers waited for a file (its queue full).
    pub waited_s: f64,
    /// Blocks of the files hashed as they landed (landed_hash.rs), before the verification.
    pub hashed_early_blocks: u64,
    /// Files written through a shared mapping, each writer beside the others (the others one
    /// writer at a time).
    pub mapped_files: u64,
}

/// One file of the directory: the file, held by whoever writes into it, and the writes other
/// writers left for the holder.
struct FileSlot {
    file: Mutex<fs::File>,
    /// The file mapped shared and writable, where its file system allocates blocks ahead
    /// (`fallocate`): writers copy into it side by side. `None`: written through `file`.
    map: Option<memmap2::MmapRaw>,
    /// Its place in `files` (and in `landed`).
    index: usize,
    /// Its path in the snapshot (the manifest's name for it).
    name: String,
    path: PathBuf,
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    writes: Vec<(u64, Vec<u8>)>,
    bytes: u64,
}

pub(crate) struct InlineFiles {
    dir: PathBuf,
    files: Vec<FileSlot>,
    /// Where each chunk of the files lies: (file, offset), and whether it was written (or
    /// queued: [`finish`](Self::finish) writes the queues first).
    at: HashMap<ChunkId, (Vec<(usize, u64)>, AtomicBool)>,
    /// Each distinct chunk once, with a file that holds it (for errors): the order to write
    /// the ones that never came through the pipeline (the store had them).
    chunks: Vec<(ChunkRef, String)>,
    /// The first error of a write made for another writer (a queued one).
    failed: Mutex<Option<TransferError>>,
    /// Buffers of written queued chunks, used again for the next (fresh memory costs the
    /// kernel's zeroing of it).
    spare: Mutex<Vec<Vec<u8>>>,
    /// The files' hashes, taken as their bytes land.
    landed: LandedHash,
    written_bytes: AtomicU64,
    zero_bytes: AtomicU64,
    handed_over: AtomicU64,
    waited_ns: AtomicU64,
}

impl InlineFiles {
    /// Creates the directory aside and the manifest's files in it, each at its size (holes
    /// until written). Nothing is left on failure.
    pub(crate) fn create(
        out: &Path,
        recipes: &[Recipe],
        manifest: &Manifest,
    ) -> Result<Self, TransferError> {
        let files: Vec<&Recipe> = recipes
            .iter()
            .filter(|r| manifest.files.iter().any(|f| f.path == r.name))
            .collect();
        Self::create_with(out, &files, true)
    }

    /// [`create`](Self::create) with the files' recipes; `map`: write through shared mappings
    /// where the file system allows (tests take the other way with `false`).
    fn create_with(out: &Path, files: &[&Recipe], map: bool) -> Result<Self, TransferError> {
        let name = out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "snapshot".to_owned());
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let dir = parent.join(format!(".{name}.pull-{}", std::process::id()));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(io("create", &dir))?;
        let made = Made::create(&dir, files, map).and_then(|made| {
            let sized: Vec<(PathBuf, u64)> = files
                .iter()
                .zip(&made.files)
                .map(|(r, slot)| (slot.path.clone(), r.size))
                .collect();
            let landed = LandedHash::new(&sized).map_err(|source| TransferError::Io {
                op: "open",
                path: dir.clone(),
                source,
            })?;
            Ok((made, landed))
        });
        let (made, landed) = match made {
            Ok(made) => made,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(InlineFiles {
            dir,
            files: made.files,
            at: made.at,
            chunks: made.chunks,
            failed: Mutex::new(None),
            spare: Mutex::new(Vec::new()),
            landed,
            written_bytes: AtomicU64::new(0),
            zero_bytes: AtomicU64::new(0),
            handed_over: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
        })
    }

    /// Writes chunk `c`'s raw bytes wherever the files use it (a chunk they do not use is
    /// ignored), or leaves them to whoever is writing into that file.
    pub(crate) fn write(&self, c: &ChunkRef, bytes: &[u8]) -> Result<(), TransferError> {
        let Some((places, written)) = self.at.get(&c.id) else {
            return Ok(());
        };
        if is_zero(bytes) {
            self.zero_bytes
                .fetch_add((bytes.len() * places.len()) as u64, Ordering::Relaxed);
            for &(file, offset) in places {
                self.landed(file, offset, bytes.len());
            }
        } else {
            for &(file, offset) in places {
                self.write_at(&self.files[file], offset, bytes)?;
            }
        }
        written.store(true, Ordering::Release);
        Ok(())
    }

    /// `bytes` at `offset` of `slot`: copied into its mapping, or written now if the file is
    /// free, else into its queue for the holder (waiting for the file only when its queue is
    /// full).
    fn write_at(&self, slot: &FileSlot, offset: u64, bytes: &[u8]) -> Result<(), TransferError> {
        if let Some(map) = &slot.map {
            copy_into(map, slot, offset, bytes)?;
            self.written_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.landed(slot.index, offset, bytes.len());
            return Ok(());
        }
        let held = match try_hold(slot) {
            Some(held) => held,
            None => {
                // Room is taken first and the copy made outside the queue's lock: with the
                // copy under it, every writer handing a chunk over waited for the others'
                // copies (one file, sixteen writers: the lock was the pull's files' path).
                let len = bytes.len() as u64;
                let room = {
                    let mut queue = lock(&slot.queue);
                    let room = queue.bytes + len <= QUEUE_BYTES;
                    if room {
                        queue.bytes += len;
                    }
                    room
                };
                if room {
                    let mut copy = lock(&self.spare).pop().unwrap_or_default();
                    copy.clear();
                    copy.extend_from_slice(bytes);
                    lock(&slot.queue).writes.push((offset, copy));
                    self.handed_over.fetch_add(1, Ordering::Relaxed);
                    // The holder may have looked at the queue for the last time before this
                    // write was in it: then the file is free now, and this writer writes it.
                    if let Some(held) = try_hold(slot) {
                        self.drain(slot, held);
                    }
                    return Ok(());
                }
                let waiting = Instant::now();
                let held = lock(&slot.file);
                self.waited_ns
                    .fetch_add(waiting.elapsed().as_nanos() as u64, Ordering::Relaxed);
                held
            }
        };
        let wrote = held
            .write_all_at(bytes, offset)
            .map_err(io("write", &slot.path));
        if wrote.is_ok() {
            self.written_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.landed(slot.index, offset, bytes.len());
        }
        self.drain(slot, held);
        wrote
    }

    /// Writes `slot`'s queue with the file held, lets go of it, and takes it again if writes
    /// came meanwhile and nobody else took it: no queued write is left behind by all. A failed
    /// write is another writer's: it goes to `failed`, which [`finish`](Self::finish) returns.
    fn drain<'s>(&self, slot: &'s FileSlot, mut held: MutexGuard<'s, fs::File>) {
        loop {
            loop {
                let writes = {
                    let mut queue = lock(&slot.queue);
                    let writes = std::mem::take(&mut queue.writes);
                    // Only what it takes: room taken by a copy not yet pushed stays taken.
                    let taken: u64 = writes.iter().map(|(_, b)| b.len() as u64).sum();
                    queue.bytes = queue.bytes.saturating_sub(taken);
                    writes
                };
                if writes.is_empty() {
                    break;
                }
                for (offset, bytes) in writes {
                    match held
                        .write_all_at(&bytes, offset)
                        .map_err(io("write", &slot.path))
                    {
                        Ok(()) => {
                            self.written_bytes
                                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                            self.landed(slot.index, offset, bytes.len());
                        }
                        Err(e) => {
                            lock(&self.failed).get_or_insert(e);
                        }
                    }
                    lock(&self.spare).push(bytes);
                }
            }
            drop(held);
            if lock(&slot.queue).writes.is_empty() {
                return;
            }
            // Else its holder writes them.
            let Some(again) = try_hold(slot) else { return };
            held = again;
        }
    }

    /// Tells the files' hashes that `len` bytes at `offset` of file `file` are in place.
    fn landed(&self, file: usize, offset: u64, len: usize) {
        self.landed.landed(file, offset, len as u64);
    }

    /// What went in so far.
    pub(crate) fn stats(&self) -> InlineStats {
        InlineStats {
            written_bytes: self.written_bytes.load(Ordering::Relaxed),
            zero_bytes: self.zero_bytes.load(Ordering::Relaxed),
            handed_over: self.handed_over.load(Ordering::Relaxed),
            waited_s: self.waited_ns.load(Ordering::Relaxed) as f64 / 1e9,
            hashed_early_blocks: self.landed.hashed_early(),
            mapped_files: self.files.iter().filter(|f| f.map.is_some()).count() as u64,
        }
    }

    /// Once the pipeline has stored every chunk of the files: writes what is still queued,
    /// then the chunks that did not come through it (the store had them) from the store, then
    /// the MAC and the manifest; authenticates and verifies the directory. Nothing is left on
    /// failure.
    pub(crate) fn finish(
        &self,
        store: &ChunkStore,
        fetched: &Fetched<'_>,
        trust: Trust<'_>,
    ) -> Result<Aside, TransferError> {
        let start = Instant::now();
        let result = (|| {
            // A writer may still be writing a queue (the last chunk's writer handed it over
            // and went on): each file taken once, its queue written.
            for slot in &self.files {
                self.drain(slot, lock(&slot.file));
            }
            if let Some(e) = lock(&self.failed).take() {
                return Err(e);
            }
            let mut raw = Vec::new();
            for (c, file) in &self.chunks {
                if let Some((_, written)) = self.at.get(&c.id) {
                    if !written.load(Ordering::Acquire) {
                        raw.resize(c.len as usize, 0);
                        store.read_chunk(c, file, &mut raw)?;
                        self.write(c, &raw)?;
                    }
                }
            }
            if let Some(e) = lock(&self.failed).take() {
                return Err(e);
            }
            if let Some(mac) = fetched.mac {
                let path = self.dir.join(MAC_FILE);
                fs::write(&path, mac).map_err(io("write", &path))?;
            }
            let manifest_path = self.dir.join(MANIFEST_FILE);
            fs::write(&manifest_path, fetched.manifest_bytes)
                .map_err(io("write", &manifest_path))?;
            let written = Instant::now();
            let snapshot = Snapshot::open(&self.dir)?;
            snapshot.authenticate(trust)?;
            // Each file's hash, taken as its blocks landed (or at the end, those that did not).
            let hashes = self
                .landed
                .finish()
                .map_err(|(path, source)| TransferError::Io {
                    op: "read",
                    path,
                    source,
                })?;
            let hashed = |name: &str| {
                let slot = self.files.iter().find(|s| s.name == name)?;
                hashes.get(slot.index).copied()
            };
            snapshot.verify_hashed(&hashed)?;
            Ok::<_, TransferError>((
                written.duration_since(start).as_secs_f64(),
                written.elapsed().as_secs_f64(),
            ))
        })();
        match result {
            Ok((materialise_s, verify_s)) => Ok(Aside {
                path: self.dir.clone(),
                materialise_s,
                verify_s,
            }),
            Err(e) => {
                self.remove();
                Err(e)
            }
        }
    }

    /// Removes the directory (the pull failed).
    pub(crate) fn remove(&self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The directory's files made, at their sizes, and where each chunk goes in them.
struct Made {
    files: Vec<FileSlot>,
    at: HashMap<ChunkId, (Vec<(usize, u64)>, AtomicBool)>,
    chunks: Vec<(ChunkRef, String)>,
}

impl Made {
    /// The files of `files` in `dir` (which the caller removes on failure), mapped where
    /// `map` and their file system allow.
    fn create(dir: &Path, files: &[&Recipe], map: bool) -> Result<Self, TransferError> {
        let mut made = Made {
            files: Vec::new(),
            at: HashMap::new(),
            chunks: Vec::new(),
        };
        for recipe in files {
            torpor_image::check_relative_path(&recipe.name).map_err(|reason| {
                TransferError::from(torpor_image::store::StoreError::InvalidRecipe {
                    file: recipe.name.clone(),
                    reason: format!("not a safe relative path: {reason}"),
                })
            })?;
            let path = dir.join(&recipe.name);
            if let Some(parent) = path.parent() {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(io("create", parent))?;
            }
            // create_new: a new file, so every byte not written is a hole and reads as zero.
            // Read too: a shared writable mapping needs the file open for both.
            let file = fs::File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(io("create", &path))?;
            file.set_len(recipe.size).map_err(io("write", &path))?;
            let mapped = if map {
                mapped(&file, recipe.size).map_err(io("write", &path))?
            } else {
                None
            };
            let index = made.files.len();
            let mut offset = 0;
            for c in &recipe.chunks {
                let (places, _) = made.at.entry(c.id).or_insert_with(|| {
                    made.chunks.push((*c, recipe.name.clone()));
                    (Vec::new(), AtomicBool::new(false))
                });
                places.push((index, offset));
                offset += c.len;
            }
            made.files.push(FileSlot {
                map: mapped,
                file: Mutex::new(file),
                index,
                name: recipe.name.clone(),
                path,
                queue: Mutex::new(Queue::default()),
            });
        }
        Ok(made)
    }
}

/// `file` (of `size` bytes) given all its blocks (`fallocate`: unwritten, reading as zeros)
/// and mapped shared and writable; `Ok(None)` where the file system cannot allocate ahead or
/// the mapping is refused (then it is written through the file); `Err` when the disk lacks the
/// room (ENOSPC: the pull fails before it fetches, naming the file).
fn mapped(file: &fs::File, size: u64) -> std::io::Result<Option<memmap2::MmapRaw>> {
    let (Ok(len), Ok(_)) = (libc::off_t::try_from(size), usize::try_from(size)) else {
        return Ok(None);
    };
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: fallocate on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Err(e),
            _ => Ok(None),
        };
    }
    Ok(memmap2::MmapOptions::new().map_raw(file).ok())
}

/// Copies `bytes` through `map` to `offset` of `slot`'s file (whose blocks were all given when
/// it was made, so no page faults for one).
fn copy_into(
    map: &memmap2::MmapRaw,
    slot: &FileSlot,
    offset: u64,
    bytes: &[u8],
) -> Result<(), TransferError> {
    let in_file = offset
        .checked_add(bytes.len() as u64)
        .is_some_and(|end| end <= map.len() as u64);
    if !in_file {
        return Err(TransferError::Io {
            op: "write",
            path: slot.path.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes at {offset} pass the end of the file ({} bytes)",
                    bytes.len(),
                    map.len()
                ),
            ),
        });
    }
    // SAFETY: the range lies inside the mapping (checked above), which lives as long as `slot`;
    // nobody else writes it (each chunk's places are written once, and chunks do not overlap),
    // and the file is this pull's own (created new in a 0700 directory), so it is not shortened
    // under the mapping; its blocks were all allocated when it was made.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            map.as_mut_ptr().add(offset as usize),
            bytes.len(),
        );
    }
    Ok(())
}

/// `slot`'s file if nobody holds it (a writer that panicked holding it left it whole: each
/// write is at its own offset).
fn try_hold(slot: &FileSlot) -> Option<MutexGuard<'_, fs::File>> {
    match slot.file.try_lock() {
        Ok(held) => Some(held),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// Whether `bytes` are all zeros: a page at a time (most chunks end at their first page),
/// 16 bytes at a compare, which the compiler vectorises.
fn is_zero(bytes: &[u8]) -> bool {
    bytes.chunks(4096).all(|page| {
        let words = page.chunks_exact(16);
        let tail = words.remainder();
        tail.iter().all(|&b| b == 0)
            && words.fold(0u128, |acc, w| {
                acc | u128::from_ne_bytes(w.try_into().expect("chunks of 16 bytes"))
            }) == 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A file of `parts` (each chunk's bytes in order) as a recipe, and its contents.
    fn recipe(name: &str, parts: &[Vec<u8>]) -> (Recipe, Vec<u8>) {
        let whole: Vec<u8> = parts.concat();
        let chunks = parts
            .iter()
            .map(|p| ChunkRef {
                id: ChunkId::of(p),
                len: p.len() as u64,
            })
            .collect();
        let recipe = Recipe {
            name: name.to_owned(),
            size: whole.len() as u64,
            blake3: blake3::hash(&whole).to_hex().to_string(),
            chunks,
        };
        (recipe, whole)
    }

    /// `len` bytes, none of them zero, different for every seed.
    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 31 + seed as usize * 7) % 251 + 1) as u8)
            .collect()
    }

    #[test]
    fn a_write_into_a_busy_file_is_handed_to_its_holder_and_written_by_it() {
        let dir = tempfile::tempdir().unwrap();
        let parts = vec![bytes(1, 8192), bytes(2, 8192), bytes(3, 8192)];
        let (r, whole) = recipe("pages-1.img", &parts);
        let inline = InlineFiles::create_with(&dir.path().join("snap"), &[&r], false).unwrap();
        let slot = &inline.files[0];
        let held = lock(&slot.file);
        std::thread::scope(|s| {
            // Returns while the file is held elsewhere: its write is left in the file's queue.
            s.spawn(|| inline.write(&r.chunks[1], &parts[1]).unwrap())
                .join()
                .unwrap();
        });
        assert_eq!(inline.stats().handed_over, 1);
        assert_eq!(lock(&slot.queue).writes.len(), 1);
        // The holder writes the queue before it lets go.
        inline.drain(slot, held);
        assert!(lock(&slot.queue).writes.is_empty());
        inline.write(&r.chunks[0], &parts[0]).unwrap();
        inline.write(&r.chunks[2], &parts[2]).unwrap();
        assert_eq!(fs::read(&slot.path).unwrap(), whole);
        assert_eq!(inline.stats().written_bytes, whole.len() as u64);
    }

    #[test]
    fn chunks_of_zeros_stay_holes_and_read_as_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let parts = vec![vec![0u8; 1 << 20], bytes(7, 4096), vec![0u8; 1 << 20]];
        let (r, whole) = recipe("pages-1.img", &parts);
        let inline = InlineFiles::create_with(&dir.path().join("snap"), &[&r], true).unwrap();
        // Each distinct chunk once, as the pipeline gives them: the two runs of zeros are one.
        inline.write(&r.chunks[0], &parts[0]).unwrap();
        inline.write(&r.chunks[1], &parts[1]).unwrap();
        let path = &inline.files[0].path;
        assert_eq!(fs::read(path).unwrap(), whole);
        let stats = inline.stats();
        assert_eq!(stats.zero_bytes, 2 << 20);
        assert_eq!(stats.written_bytes, 4096);
        assert_eq!(
            stats.mapped_files, 1,
            "this file system allocates ahead: mapped"
        );
        // Written through the file instead, the zeros take no blocks (holes: ext4, tmpfs, xfs...).
        let locked = InlineFiles::create_with(&dir.path().join("snap2"), &[&r], false).unwrap();
        locked.write(&r.chunks[0], &parts[0]).unwrap();
        locked.write(&r.chunks[1], &parts[1]).unwrap();
        let path = &locked.files[0].path;
        assert_eq!(fs::read(path).unwrap(), whole);
        assert!(fs::metadata(path).unwrap().blocks() * 512 < 1 << 20);
        assert!(
            is_zero(&[])
                && is_zero(&[0; 17])
                && !is_zero(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
        );
    }

    #[test]
    fn writers_racing_on_two_mapped_files_leave_every_chunk_in_place() {
        writers_racing_on_two_files(true);
    }

    #[test]
    fn writers_racing_on_two_locked_files_leave_every_chunk_in_place() {
        writers_racing_on_two_files(false);
    }

    fn writers_racing_on_two_files(map: bool) {
        let dir = tempfile::tempdir().unwrap();
        // Two files of many small chunks, some of them zeros, some used twice.
        let files: Vec<(Recipe, Vec<u8>)> = (0..2u8)
            .map(|f| {
                let parts: Vec<Vec<u8>> = (0..400u32)
                    .map(|i| match i % 7 {
                        0 => vec![0u8; 3000],
                        3 => bytes(f, 5000),
                        _ => bytes((i % 251) as u8 ^ (f << 7), 2000 + (i as usize % 13) * 100),
                    })
                    .collect();
                recipe(&format!("pages-{f}.img"), &parts)
            })
            .collect();
        let recipes: Vec<&Recipe> = files.iter().map(|(r, _)| r).collect();
        let inline = InlineFiles::create_with(&dir.path().join("snap"), &recipes, map).unwrap();
        assert_eq!(inline.stats().mapped_files, if map { 2 } else { 0 });
        // Each distinct chunk with its bytes, cut again from the files' contents.
        let mut distinct: Vec<(ChunkRef, Vec<u8>)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (r, whole) in &files {
            let mut at = 0usize;
            for c in &r.chunks {
                let part = whole[at..at + c.len as usize].to_vec();
                at += c.len as usize;
                if seen.insert(c.id) {
                    distinct.push((*c, part));
                }
            }
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..16 {
                s.spawn(|| {
                    while let Some((c, part)) = distinct.get(next.fetch_add(1, Ordering::Relaxed)) {
                        inline.write(c, part).unwrap();
                    }
                });
            }
        });
        // Every write handed over was written by a holder before the writers returned.
        for slot in &inline.files {
            assert!(lock(&slot.queue).writes.is_empty());
        }
        for (i, (_, whole)) in files.iter().enumerate() {
            assert_eq!(&fs::read(&inline.files[i].path).unwrap(), whole, "file {i}");
        }
        let stats = inline.stats();
        let total: u64 = files.iter().map(|(_, w)| w.len() as u64).sum();
        assert_eq!(stats.written_bytes + stats.zero_bytes, total);
        // The hashes taken as the writes (handed over or not) and the holes landed are the
        // files' own.
        let hashes = inline.landed.finish().unwrap();
        for (i, (r, whole)) in files.iter().enumerate() {
            assert_eq!(hashes[i], blake3::hash(whole), "file {i}");
            assert_eq!(hashes[i].to_hex().as_str(), r.blake3);
        }
        assert!(inline.stats().hashed_early_blocks >= 1);
    }

    #[test]
    fn bytes_written_wrong_give_a_hash_that_is_not_the_manifests() {
        let dir = tempfile::tempdir().unwrap();
        let parts = vec![bytes(1, 3 << 20), bytes(2, 3 << 20)];
        let (r, _) = recipe("pages-1.img", &parts);
        let inline = InlineFiles::create_with(&dir.path().join("snap"), &[&r], true).unwrap();
        let mut wrong = parts[1].clone();
        wrong[12345] ^= 0x40;
        inline.write(&r.chunks[0], &parts[0]).unwrap();
        inline.write(&r.chunks[1], &wrong).unwrap();
        let hashes = inline.landed.finish().unwrap();
        assert_ne!(hashes[0].to_hex().as_str(), r.blake3);
        assert_eq!(hashes[0], blake3::hash(&[parts[0].clone(), wrong].concat()));
    }

    #[test]
    fn a_full_disk_fails_the_pull_naming_the_file_before_anything_is_fetched() {
        // SAFETY: geteuid takes nothing and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a small tmpfs needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("small");
        fs::create_dir(&mnt).unwrap();
        let mounted = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                "size=1m",
                "torpor-test",
                mnt.to_str().unwrap(),
            ])
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("skipped: cannot mount a tmpfs here");
            return;
        }
        let result = std::panic::catch_unwind(|| {
            let parts = vec![bytes(1, 3 << 20), bytes(2, 4096)];
            let (r, _) = recipe("pages-1.img", &parts);
            let snap = mnt.join("snap");
            let e = match InlineFiles::create_with(&snap, &[&r], true) {
                Ok(_) => panic!("a 3 MiB file was made on a 1 MiB disk"),
                Err(e) => e.to_string(),
            };
            assert!(
                e.contains("pages-1.img") && e.contains("No space left"),
                "{e}"
            );
            // Nothing is left behind.
            assert_eq!(fs::read_dir(&mnt).unwrap().count(), 0);
            // A file that fits is mapped.
            let small = vec![bytes(3, 4096)];
            let (r, whole) = recipe("pages-2.img", &small);
            let inline = InlineFiles::create_with(&snap, &[&r], true).unwrap();
            assert_eq!(inline.stats().mapped_files, 1);
            inline.write(&r.chunks[0], &small[0]).unwrap();
            assert_eq!(fs::read(&inline.files[0].path).unwrap(), whole);
            inline.remove();
        });
        let _ = std::process::Command::new("umount").arg(&mnt).status();
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    }
}
