//! Deferred commits: records that readers use before their chunks are known to be on the disk
//! (a pull's first start does not wait for the disk; docs/objstore.md, "Durability after the
//! answer").
//!
//! [`StoreWriter::commit_many_deferred`](crate::store::StoreWriter::commit_many_deferred)
//! creates `pending/<id>` (an empty file: its name is all it says), then writes the record
//! without fsync. [`Pending::finish`] runs one syncfs (every chunk and record written so far
//! reaches the disk), then removes the markers. A process killed in between leaves its chunks
//! in the page cache and they are whole; a power loss may leave chunks or records torn. Either
//! way the marker is there (created before the record, and a journalling filesystem keeps
//! namespace changes in order), and [`ChunkStore::settle`] reads every chunk of the record
//! against its id: all whole, the record stands (after a syncfs); one not, the record is
//! released, so nothing ever reads a half-written snapshot from the store as committed.

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::path::PathBuf;

use crate::store::error::{io_error, StoreError};
use crate::store::lock::StoreLock;
use crate::store::records::{read_record, record_path};
use crate::store::write::{place_held, syncfs};
use crate::store::{check_snapshot_id, sync_dir, ChunkId, ChunkStore, PENDING_DIR};

/// Records committed before their durability: [`finish`](Self::finish) it (in the
/// background); dropped unfinished, the markers stay for [`ChunkStore::settle`].
#[derive(Debug)]
#[must_use = "finish() makes the records durable; dropped, they wait for the next start's settle"]
pub struct Pending {
    store: ChunkStore,
    ids: Vec<String>,
    /// Chunks the records use that are held in memory, not yet written (shelf.rs): written by
    /// `finish` (or the drop) under `lock`, the committing writer's, so that no GC runs first.
    held: Vec<ChunkId>,
    lock: Option<StoreLock>,
    write_back: bool,
}

/// What [`ChunkStore::settle`] did with a record left pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Every chunk it references is whole: it stands, now durable.
    Committed,
    /// Released (or never written): why, in one line.
    Released(String),
}

impl Pending {
    pub(crate) fn new(
        store: &ChunkStore,
        lock: Option<StoreLock>,
        held: Vec<ChunkId>,
        write_back: bool,
    ) -> Pending {
        Pending {
            store: store.clone(),
            ids: Vec::new(),
            held,
            lock,
            write_back,
        }
    }

    /// Creates the marker of `id` (before its record is written).
    pub(crate) fn mark(&mut self, id: &str) -> Result<(), StoreError> {
        let path = marker_path(&self.store, id);
        File::create(&path).map_err(|e| io_error("write", &path, e))?;
        self.ids.push(id.to_owned());
        Ok(())
    }

    /// The snapshot ids whose records wait for their durability.
    pub fn ids(&self) -> &[String] {
        &self.ids
    }

    /// Chunks held in memory that [`finish`](Self::finish) writes first.
    pub fn held_chunks(&self) -> usize {
        self.held.len()
    }

    /// Writes the chunks held in memory into the store, then one syncfs of the store's
    /// filesystem, then the markers removed. On an error the markers stay (the next start
    /// settles the records), and chunks not written stay held (this process still reads them).
    pub fn finish(mut self) -> Result<(), StoreError> {
        let held = std::mem::take(&mut self.held);
        place_held(&self.store, &held, self.write_back)?;
        if self.ids.is_empty() {
            return Ok(());
        }
        syncfs(self.store.root())?;
        for id in &self.ids {
            remove_marker(&self.store, id)?;
        }
        // Not waiting for the removals to be durable: a marker back after a crash only costs
        // one settle of whole chunks.
        Ok(())
    }
}

impl Drop for Pending {
    /// Dropped unfinished, it still writes the held chunks (without a syncfs: the markers
    /// stay for the next start's settle), so that readers here keep finding them.
    fn drop(&mut self) {
        let held = std::mem::take(&mut self.held);
        let _ = place_held(&self.store, &held, self.write_back);
        // The lock goes after: no GC before the chunks are in.
        self.lock.take();
    }
}

fn marker_path(store: &ChunkStore, id: &str) -> PathBuf {
    store.root().join(PENDING_DIR).join(id)
}

fn remove_marker(store: &ChunkStore, id: &str) -> Result<(), StoreError> {
    let path = marker_path(store, id);
    match fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("remove", &path, e)),
    }
}

impl ChunkStore {
    /// The snapshot ids whose deferred commit never finished (a process died before
    /// [`Pending::finish`]): [`settle`](Self::settle) each before trusting its record.
    pub fn pending(&self) -> Result<Vec<String>, StoreError> {
        let dir = self.root().join(PENDING_DIR);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            // A store made before deferred commits, opened without creating anything.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("list", &dir, e)),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error("list", &dir, e))?;
            if let Some(id) = entry.file_name().to_str() {
                if check_snapshot_id(id).is_ok() {
                    ids.push(id.to_owned());
                }
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Decides a record left pending by a process that died before its syncfs: every chunk
    /// it references read and checked against its id (a damaged one is moved aside, as any
    /// read does). All whole: a syncfs, and the record stands. A chunk missing or damaged, or
    /// the record itself unreadable: the record is released, to be pulled again.
    pub fn settle(&self, id: &str) -> Result<Settled, StoreError> {
        check_snapshot_id(id)?;
        let path = record_path(self, id);
        let verdict = match read_record(&path, id) {
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Settled::Released("its record was never written".to_owned())
            }
            Err(e) => Settled::Released(format!("its record is unreadable: {e}")),
            Ok(record) => {
                let mut seen = HashSet::new();
                let mut buf = Vec::new();
                let mut bad = None;
                'all: for recipe in &record.recipes {
                    for c in &recipe.chunks {
                        if !seen.insert(c.id) {
                            continue;
                        }
                        buf.resize(c.len as usize, 0);
                        if let Err(e) = self.read_chunk_into(c, &recipe.name, &mut buf) {
                            bad = Some(e.to_string());
                            break 'all;
                        }
                    }
                }
                match bad {
                    None => Settled::Committed,
                    Some(why) => Settled::Released(format!("a chunk is not whole: {why}")),
                }
            }
        };
        match &verdict {
            Settled::Committed => syncfs(self.root())?,
            Settled::Released(_) => match fs::remove_file(&path) {
                Ok(()) => sync_dir(&self.refs_dir())?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error("remove", &path, e)),
            },
        }
        remove_marker(self, id)?;
        Ok(verdict)
    }
}
