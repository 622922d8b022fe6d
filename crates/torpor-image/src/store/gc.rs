//! Garbage collection: delete the chunks no committed snapshot references.

use std::collections::HashSet;
use std::fs;
use std::io;

use crate::store::error::{io_error, StoreError};
use crate::store::lock::{self, Mode};
use crate::store::records::read_all;
use crate::store::{ChunkId, ChunkStore, CHUNKS_DIR};

/// What a GC did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    /// Committed snapshots whose references were kept.
    pub snapshots: usize,
    pub kept_chunks: u64,
    /// Bytes on disk of the kept chunks.
    pub kept_bytes: u64,
    pub deleted_chunks: u64,
    /// Bytes on disk of the deleted chunks.
    pub freed_bytes: u64,
    /// Leftovers of writers that died before committing.
    pub temp_files_removed: u64,
}

impl ChunkStore {
    /// Deletes every chunk that no committed snapshot references, waiting until no writer is
    /// between its first chunk and its commit (see the module documentation).
    pub fn gc(&self) -> Result<GcReport, StoreError> {
        let _lock = lock::lock(&self.lock_path(), Mode::Exclusive, true)?;
        self.collect()
    }

    /// Like [`gc`](Self::gc), but returns `None` at once when a writer is active.
    pub fn try_gc(&self) -> Result<Option<GcReport>, StoreError> {
        match lock::lock(&self.lock_path(), Mode::Exclusive, false)? {
            Some(_lock) => self.collect().map(Some),
            None => Ok(None),
        }
    }

    /// Runs with the lock held exclusively.
    fn collect(&self) -> Result<GcReport, StoreError> {
        // An unreadable record aborts here, before anything is deleted.
        let records = read_all(self)?;
        let live: HashSet<ChunkId> = records
            .values()
            .flat_map(|r| r.recipes.iter())
            .flat_map(|r| r.chunks.iter().map(|c| c.id))
            .collect();
        let mut report = GcReport {
            snapshots: records.len(),
            ..GcReport::default()
        };
        let chunks = self.root.join(CHUNKS_DIR);
        let list_error = |dir: &std::path::Path, e| io_error("list", dir, e);
        for fan in fs::read_dir(&chunks).map_err(|e| list_error(&chunks, e))? {
            let fan = fan.map_err(|e| list_error(&chunks, e))?;
            if !fan
                .file_type()
                .map_err(|e| list_error(&chunks, e))?
                .is_dir()
            {
                continue;
            }
            let fan_dir = fan.path();
            for entry in fs::read_dir(&fan_dir).map_err(|e| list_error(&fan_dir, e))? {
                let entry = entry.map_err(|e| list_error(&fan_dir, e))?;
                // Only files named like chunks are ours to delete.
                let Some(id) = entry.file_name().to_str().and_then(ChunkId::from_hex) else {
                    continue;
                };
                let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                if live.contains(&id) {
                    report.kept_chunks += 1;
                    report.kept_bytes += size;
                    continue;
                }
                match fs::remove_file(entry.path()) {
                    Ok(()) => {
                        report.deleted_chunks += 1;
                        report.freed_bytes += size;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_error("remove", &entry.path(), e)),
                }
            }
        }
        // No writer holds the lock, so whatever is in tmp/ belongs to one that died.
        let tmp = self.tmp_dir();
        for entry in fs::read_dir(&tmp).map_err(|e| list_error(&tmp, e))? {
            let entry = entry.map_err(|e| list_error(&tmp, e))?;
            match fs::remove_file(entry.path()) {
                Ok(()) => report.temp_files_removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error("remove", &entry.path(), e)),
            }
        }
        Ok(report)
    }
}
