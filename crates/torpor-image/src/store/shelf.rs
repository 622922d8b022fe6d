//! Chunk files checked against their ids and held in memory until they are written into the
//! store: what lets a pull answer before it has written its chunk files (docs/objstore.md,
//! "Chunk files placed after the answer").
//!
//! A writer made with [`StoreWriter::hold_up_to`](crate::store::StoreWriter::hold_up_to) puts
//! a chunk it fetched on the shelf of its store instead of writing it
//! ([`StoreWriter::hold_chunk_file`](crate::store::StoreWriter::hold_chunk_file)); its commit
//! hands the shelved chunks to the [`Pending`](crate::store::Pending) it returns, whose
//! `finish` writes them into the store, then syncs. Until then every [`ChunkStore`] of that
//! root in this process sees them as stored: `contains` says so, and reads (`read_into`,
//! `read_chunk`, `chunk_file`) take them from the shelf when their file is not there yet. No
//! other process sees them; a process that dies before placing them leaves its records
//! pending, and [`ChunkStore::settle`] releases a record whose chunk is missing (it is pulled
//! again).
//!
//! One shelf per store root and process ([`for_root`]), so that every `ChunkStore` opened on
//! the same directory (the restore server's, the pull's) shares it.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, Weak};

use crate::store::ChunkId;

/// One held chunk file: a range of a buffer that may hold others (a fetched range of a pack).
#[derive(Clone)]
pub(crate) struct Held {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl Held {
    /// `range` of `buf`; `None` if it lies outside it.
    pub(crate) fn new(buf: &Arc<Vec<u8>>, range: Range<usize>) -> Option<Held> {
        buf.get(range.clone())?;
        Some(Held {
            buf: Arc::clone(buf),
            range,
        })
    }

    /// The chunk file's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

/// The chunks of one store root held in memory (see the module documentation).
#[derive(Default)]
pub(crate) struct Shelf {
    held: RwLock<HashMap<ChunkId, Held>>,
}

impl std::fmt::Debug for Shelf {
    // What it holds is bytes: its count says enough.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shelf")
            .field("chunks", &self.len())
            .finish()
    }
}

impl Shelf {
    pub(crate) fn get(&self, id: &ChunkId) -> Option<Held> {
        self.held
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    pub(crate) fn contains(&self, id: &ChunkId) -> bool {
        self.held
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(id)
    }

    /// Holds `held` as chunk `id`; false if the shelf holds it already (from another writer).
    pub(crate) fn put(&self, id: ChunkId, held: Held) -> bool {
        let mut map = self.held.write().unwrap_or_else(PoisonError::into_inner);
        if map.contains_key(&id) {
            return false;
        }
        map.insert(id, held);
        true
    }

    /// Lets go of chunk `id` (its file is written, or it is given up).
    pub(crate) fn remove(&self, id: &ChunkId) {
        self.held
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// How many chunks it holds.
    pub(crate) fn len(&self) -> usize {
        self.held
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// The shelf of the store at `root` (absolute) in this process: the same for every
/// `ChunkStore` opened there while any of them lives, whichever path (symlinks) named it.
pub(crate) fn for_root(root: &Path) -> Arc<Shelf> {
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let root = root.as_path();
    static SHELVES: OnceLock<Mutex<HashMap<PathBuf, Weak<Shelf>>>> = OnceLock::new();
    let mut shelves = SHELVES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(shelf) = shelves.get(root).and_then(Weak::upgrade) {
        return shelf;
    }
    // Stores opened and dropped leave dead entries: sweep them as new ones come.
    shelves.retain(|_, w| w.strong_count() > 0);
    let shelf = Arc::new(Shelf::default());
    shelves.insert(root.to_path_buf(), Arc::downgrade(&shelf));
    shelf
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ChunkStore, Chunking, Commit, Settled};

    /// A process that dies between its deferred commit and `finish` takes its held chunks
    /// with it: the next start's settle finds the record's chunk missing and releases it (it is
    /// pulled again), never leaving a record that names a chunk no file holds.
    #[test]
    fn a_record_whose_held_chunks_died_with_the_process_is_released_by_settle() {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = ChunkStore::open(&dir.path().join("src")).expect("src");
        let dst = ChunkStore::open(&dir.path().join("dst")).expect("dst");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut w = src.writer().expect("writer");
        let recipe = w
            .put_bytes_with("seg", &data, Chunking::Fixed { bytes: 64 << 10 })
            .expect("put");
        w.commit("s", std::slice::from_ref(&recipe))
            .expect("commit");

        let writer = dst.writer().expect("writer").hold_up_to(u64::MAX);
        let mut scratch = Vec::new();
        for c in &recipe.chunks {
            let file = Arc::new(src.chunk_file(c, "seg").expect("file"));
            let len = file.len();
            writer
                .hold_chunk_file(c, &file, 0..len, "test", &mut scratch)
                .expect("hold");
        }
        let pending = writer
            .commit_many_deferred(&[Commit {
                id: "s",
                recipes: std::slice::from_ref(&recipe),
                key: None,
            }])
            .expect("commit");
        assert_eq!(pending.held_chunks(), recipe.chunks.len());
        // The process dies: nothing written, its memory gone (the lock with it).
        std::mem::forget(pending);
        for c in &recipe.chunks {
            dst.shelf.remove(&c.id);
        }
        let Settled::Released(why) = dst.settle("s").expect("settle") else {
            panic!("a record whose chunks were never written stood");
        };
        assert!(why.contains("not whole"), "{why}");
        assert!(dst.recipes("s").is_err());
    }

    #[test]
    fn one_shelf_per_root_while_it_is_used() {
        let a = for_root(Path::new("/shelf-test/a"));
        let again = for_root(Path::new("/shelf-test/a"));
        assert!(Arc::ptr_eq(&a, &again));
        let b = for_root(Path::new("/shelf-test/b"));
        assert!(!Arc::ptr_eq(&a, &b));
        let buf = Arc::new(b"xxhello".to_vec());
        let id = ChunkId::of(b"hello");
        assert!(a.put(id, Held::new(&buf, 2..7).expect("in range")));
        assert!(!again.put(id, Held::new(&buf, 0..1).expect("in range")));
        assert_eq!(again.get(&id).expect("held").bytes(), b"hello");
        assert!(!b.contains(&id));
        a.remove(&id);
        assert_eq!(a.len(), 0);
        assert!(Held::new(&buf, 5..9).is_none());
    }
}
