//! The BLAKE3 of each file of a pulled snapshot directory, taken as its bytes land
//! ([`LandedHash`]), instead of every file read and hashed again once all of it is written.
//!
//! The pull's directory is checked against its authenticated manifest before it is used: each
//! file's BLAKE3 compared with the manifest's. Hashed after the last chunk, that took 0.33 s of
//! a GPT-2-Large pull on the H100 (1.5 GB, `files_verify_s` in `cluster-pull-h100.json`, session
//! 31), on the files' path after the fetch. Now each file is cut into aligned blocks of
//! [`BLOCK`] bytes, each counting the bytes still to be written into it; the write that brings a
//! block to zero hands it to a hashing thread, which reads the block back from the file (from
//! the page cache: it was just written) and takes its chaining value as a subtree at its offset.
//! At the end the values are merged along BLAKE3's tree into the file's hash, which
//! `Snapshot::verify_hashed` compares with the manifest's.
//!
//! What is compared is still what the files hold: a block is read after its last byte was
//! written, and nothing writes into it again (each chunk's places are written once). A count
//! that goes wrong (more bytes landing in a block than it has) has that file hashed whole again
//! at the end; a block never counted full is hashed at the end.
//!
//! `blake3::hazmat` is BLAKE3's own API for subtrees (the crate the store already uses; Bao is
//! built on it): `set_input_offset` + `finalize_non_root` for a block, `left_subtree_len` and
//! `merge_subtrees_*` for the tree. The merge is checked against `blake3::hash` in the tests for
//! sizes around every edge of a block.

use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use blake3::hazmat::{
    left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};
use rayon::prelude::*;

use crate::chunks::lock;

/// Bytes of a block: a power of two of BLAKE3's 1 KiB chunks, large enough for its SIMD paths
/// and few reads, small enough that the last blocks of a file to land are hashed quickly.
pub(crate) const BLOCK: u64 = 4 << 20;

/// Threads hashing the blocks that landed, at most: a pull's directory is ~1.5 GB at most
/// ~1 GB/s, and BLAKE3 hashes a few GB/s on a core.
const THREADS: usize = 4;

/// One file: where to read it, its size, and per block the bytes still to land and, once
/// hashed, its value (a chaining value, or the root hash of a file of one block).
struct FileBlocks {
    path: PathBuf,
    reader: fs::File,
    size: u64,
    left: Vec<AtomicU64>,
    value: Vec<OnceLock<[u8; 32]>>,
    /// More bytes landed in a block than it holds: hash the file whole at the end.
    miscounted: AtomicBool,
}

impl FileBlocks {
    fn blocks(size: u64) -> usize {
        size.div_ceil(BLOCK) as usize
    }

    /// Block `b`'s value, read from the file.
    fn hash_block(&self, b: usize, buf: &mut Vec<u8>) -> std::io::Result<[u8; 32]> {
        let start = b as u64 * BLOCK;
        let len = BLOCK.min(self.size - start) as usize;
        buf.resize(len, 0);
        self.reader.read_exact_at(buf, start)?;
        Ok(if self.size <= BLOCK {
            *blake3::hash(buf).as_bytes()
        } else {
            blake3::Hasher::new()
                .set_input_offset(start)
                .update(buf)
                .finalize_non_root()
        })
    }

    /// The file's hash from its blocks' values (all of them set).
    fn merged(&self, values: &[[u8; 32]]) -> blake3::Hash {
        if self.size == 0 {
            return blake3::hash(&[]);
        }
        if self.size <= BLOCK {
            return blake3::Hash::from_bytes(values[0]);
        }
        let left = left_subtree_len(self.size);
        merge_subtrees_root(
            &subtree(values, 0, left),
            &subtree(values, left, self.size - left),
            Mode::Hash,
        )
    }
}

/// The chaining value of the subtree of `len` bytes at `start` (BLAKE3's tree: the left part
/// is the largest power of two of chunks shorter than the whole, so a multiple of [`BLOCK`]).
fn subtree(values: &[[u8; 32]], start: u64, len: u64) -> ChainingValue {
    if len <= BLOCK {
        return values[(start / BLOCK) as usize];
    }
    let left = left_subtree_len(len);
    merge_subtrees_non_root(
        &subtree(values, start, left),
        &subtree(values, start + left, len - left),
        Mode::Hash,
    )
}

/// The hashes of a directory's files, taken as their blocks land.
pub(crate) struct LandedHash {
    files: Arc<Vec<FileBlocks>>,
    tx: Mutex<Option<Sender<(usize, usize)>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Blocks hashed by the threads (before the end).
    early: Arc<AtomicU64>,
}

impl LandedHash {
    /// For `files` (path, size), each opened for reading now; threads start hashing as blocks
    /// land.
    pub(crate) fn new(files: &[(PathBuf, u64)]) -> std::io::Result<Self> {
        let files: Vec<FileBlocks> = files
            .iter()
            .map(|(path, size)| {
                // O_NOFOLLOW: the files were just made by this pull; never follow a swapped link.
                let reader = fs::File::options()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(path)?;
                let blocks = FileBlocks::blocks(*size);
                Ok(FileBlocks {
                    path: path.clone(),
                    reader,
                    size: *size,
                    left: (0..blocks)
                        .map(|b| AtomicU64::new(BLOCK.min(size - b as u64 * BLOCK)))
                        .collect(),
                    value: (0..blocks).map(|_| OnceLock::new()).collect(),
                    miscounted: AtomicBool::new(false),
                })
            })
            .collect::<std::io::Result<_>>()?;
        let files = Arc::new(files);
        let (tx, rx) = channel::<(usize, usize)>();
        let rx = Arc::new(Mutex::new(rx));
        let early = Arc::new(AtomicU64::new(0));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut threads = Vec::new();
        for _ in 0..(cores / 4).clamp(1, THREADS) {
            let (files, rx, early) = (Arc::clone(&files), Arc::clone(&rx), Arc::clone(&early));
            // Without one, every block is hashed at the end, as before.
            if let Ok(handle) = std::thread::Builder::new()
                .name("pull-hash".into())
                .spawn(move || hash_landed(&files, &rx, &early))
            {
                threads.push(handle);
            }
        }
        Ok(LandedHash {
            files,
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
            early,
        })
    }

    /// `len` bytes at `offset` of file `file` are in place (written, or a hole of zeros).
    pub(crate) fn landed(&self, file: usize, offset: u64, len: u64) {
        let Some(f) = self.files.get(file) else {
            return;
        };
        if len == 0 {
            return;
        }
        let end = offset.saturating_add(len);
        if end > f.size {
            f.miscounted.store(true, Ordering::Relaxed);
            return;
        }
        for b in (offset / BLOCK)..=((end - 1) / BLOCK) {
            let start = b * BLOCK;
            let n = end.min(start + BLOCK) - offset.max(start);
            let counted =
                f.left[b as usize]
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| l.checked_sub(n));
            match counted {
                Ok(before) if before == n => {
                    if let Some(tx) = lock(&self.tx).as_ref() {
                        let _ = tx.send((file, b as usize));
                    }
                }
                Ok(_) => {}
                Err(_) => f.miscounted.store(true, Ordering::Relaxed),
            }
        }
    }

    /// Waits for the threads, hashes what they did not (blocks never counted full, files
    /// miscounted: whole), and returns each file's hash in the order given to `new`.
    pub(crate) fn finish(&self) -> Result<Vec<blake3::Hash>, (PathBuf, std::io::Error)> {
        self.stop();
        self.files
            .iter()
            .map(|f| {
                let again = f.miscounted.load(Ordering::Relaxed);
                let values: Vec<[u8; 32]> = (0..f.value.len())
                    .into_par_iter()
                    .map_init(Vec::new, |buf, b| match f.value[b].get() {
                        Some(v) if !again => Ok(*v),
                        _ => f.hash_block(b, buf),
                    })
                    .collect::<std::io::Result<_>>()
                    .map_err(|e| (f.path.clone(), e))?;
                Ok(f.merged(&values))
            })
            .collect()
    }

    /// Blocks hashed as they landed, before [`finish`](Self::finish).
    pub(crate) fn hashed_early(&self) -> u64 {
        self.early.load(Ordering::Relaxed)
    }

    /// Closes the threads' channel and waits for them (they hash what is queued first).
    fn stop(&self) {
        drop(lock(&self.tx).take());
        for handle in std::mem::take(&mut *lock(&self.threads)) {
            let _ = handle.join();
        }
    }
}

impl Drop for LandedHash {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A hashing thread: each block that landed, until the channel closes. A block it cannot read
/// is left for `finish`, which reports the error.
fn hash_landed(files: &[FileBlocks], rx: &Mutex<Receiver<(usize, usize)>>, early: &AtomicU64) {
    let mut buf = Vec::new();
    loop {
        let got = lock(rx).recv();
        let Ok((file, b)) = got else { return };
        let f = &files[file];
        if let Ok(v) = f.hash_block(b, &mut buf) {
            if f.value[b].set(v).is_ok() {
                early.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(len: u64, seed: u64) -> Vec<u8> {
        (0..len)
            .map(|i| ((i * 131 + seed * 17) % 251) as u8)
            .collect()
    }

    /// Files of `sizes`, written in pieces of `piece` bytes in a shuffled order, each piece
    /// reported as landed; returns the hashes and the contents.
    fn land(sizes: &[u64], piece: u64) -> (Vec<blake3::Hash>, Vec<Vec<u8>>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        let mut datas = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let path = dir.path().join(format!("f{i}"));
            let f = fs::File::create(&path).unwrap();
            f.set_len(size).unwrap();
            files.push((path, size));
            datas.push(contents(size, i as u64));
        }
        let landed = LandedHash::new(&files).unwrap();
        let mut pieces: Vec<(usize, u64)> = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let mut at = 0;
            while at < size {
                pieces.push((i, at));
                at += piece;
            }
        }
        // A fixed shuffle: every piece's place depends on the others'.
        let n = pieces.len();
        for k in 0..n {
            pieces.swap(k, (k * 7919 + 13) % n);
        }
        for (i, at) in pieces {
            let end = (at + piece).min(sizes[i]);
            let w = fs::OpenOptions::new()
                .write(true)
                .open(&files[i].0)
                .unwrap();
            w.write_all_at(&datas[i][at as usize..end as usize], at)
                .unwrap();
            landed.landed(i, at, end - at);
        }
        let hashes = landed.finish().unwrap();
        let early = landed.hashed_early();
        (hashes, datas, early)
    }

    #[test]
    fn hashes_taken_block_by_block_are_blake3_of_the_whole_file() {
        let k = 1024;
        let sizes = [
            0,
            1,
            k,
            k + 1,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            2 * BLOCK,
            3 * BLOCK - 5,
            5 * BLOCK + 3 * k + 7,
            8 * BLOCK,
        ];
        let (hashes, datas, early) = land(&sizes, 300 * k + 11);
        for (i, (h, d)) in hashes.iter().zip(&datas).enumerate() {
            assert_eq!(*h, blake3::hash(d), "file {i} of {} bytes", sizes[i]);
        }
        // Every block of a file with bytes was full before the end, and hashed by the threads.
        let blocks: usize = sizes.iter().map(|&s| FileBlocks::blocks(s)).sum();
        assert_eq!(early, blocks as u64);
    }

    #[test]
    fn a_block_never_full_is_hashed_at_the_end_and_a_miscount_hashes_the_file_again() {
        let dir = tempfile::tempdir().unwrap();
        let data = contents(3 * BLOCK + 100, 3);
        let path = dir.path().join("pages-1.img");
        fs::write(&path, &data).unwrap();
        let landed = LandedHash::new(&[(path.clone(), data.len() as u64)]).unwrap();
        // Only the first block is said to have landed: the rest are read at the end.
        landed.landed(0, 0, BLOCK);
        assert_eq!(landed.finish().unwrap()[0], blake3::hash(&data));

        // A block said full twice: the second count is more than it holds.
        let landed = LandedHash::new(&[(path.clone(), data.len() as u64)]).unwrap();
        landed.landed(0, 0, BLOCK);
        landed.landed(0, 0, BLOCK);
        assert!(landed.files[0].miscounted.load(Ordering::Relaxed));
        // What the file holds when it ends is what is hashed: changed after its block was.
        let mut changed = data.clone();
        changed[10] ^= 1;
        fs::write(&path, &changed).unwrap();
        assert_eq!(landed.finish().unwrap()[0], blake3::hash(&changed));
    }

    #[test]
    fn a_file_that_cannot_be_read_at_the_end_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pages-1.img");
        fs::write(&path, contents(BLOCK + 1, 1)).unwrap();
        // Says it is longer than it is: its last block cannot be read.
        let landed = LandedHash::new(&[(path.clone(), 2 * BLOCK)]).unwrap();
        let (named, e) = landed.finish().unwrap_err();
        assert_eq!(named, path);
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
