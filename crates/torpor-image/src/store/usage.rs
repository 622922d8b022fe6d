//! How much a snapshot takes in the store, and what it shares with which other snapshot.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;

use crate::store::error::StoreError;
use crate::store::records::read_all;
use crate::store::{check_snapshot_id, ChunkId, ChunkStore};

/// The space one snapshot takes in the store.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub snapshot: String,
    /// Files and segments.
    pub recipes: usize,
    /// Bytes of its files and segments, as they are materialised.
    pub logical: u64,
    /// Raw bytes of its distinct chunks (after dedup within the snapshot).
    pub unique: u64,
    /// Bytes on disk of its distinct chunks (after compression), shared ones included.
    pub stored: u64,
    /// Bytes on disk of the chunks no other snapshot holds: what releasing it would free.
    pub exclusive: u64,
    /// For every other snapshot sharing chunks with this one: the raw bytes of those chunks.
    pub shared_with: BTreeMap<String, u64>,
    /// Chunks it references that are not in the store (0 in a healthy store).
    pub missing_chunks: u64,
}

impl ChunkStore {
    /// The space `snapshot_id` takes and shares. Reads every record: meant for `inspect`.
    pub fn usage(&self, snapshot_id: &str) -> Result<Usage, StoreError> {
        check_snapshot_id(snapshot_id)?;
        let records = read_all(self)?;
        let Some(record) = records.get(snapshot_id) else {
            return Err(StoreError::UnknownSnapshot {
                id: snapshot_id.to_owned(),
                root: self.root.clone(),
            });
        };
        let mut mine: HashMap<ChunkId, u64> = HashMap::new();
        for c in record.recipes.iter().flat_map(|r| &r.chunks) {
            mine.insert(c.id, c.len);
        }
        let mut usage = Usage {
            snapshot: snapshot_id.to_owned(),
            recipes: record.recipes.len(),
            logical: record.recipes.iter().map(|r| r.size).sum(),
            unique: mine.values().sum(),
            stored: 0,
            exclusive: 0,
            shared_with: BTreeMap::new(),
            missing_chunks: 0,
        };
        let mut shared_any: HashSet<ChunkId> = HashSet::new();
        for (other, other_record) in &records {
            if other == snapshot_id {
                continue;
            }
            let theirs: HashSet<ChunkId> = other_record
                .recipes
                .iter()
                .flat_map(|r| r.chunks.iter().map(|c| c.id))
                .collect();
            let shared: u64 = mine
                .iter()
                .filter(|(id, _)| theirs.contains(id))
                .map(|(id, len)| {
                    shared_any.insert(*id);
                    len
                })
                .sum();
            if shared > 0 {
                usage.shared_with.insert(other.clone(), shared);
            }
        }
        for id in mine.keys() {
            match fs::metadata(self.chunk_path(id)) {
                Ok(meta) => {
                    usage.stored += meta.len();
                    if !shared_any.contains(id) {
                        usage.exclusive += meta.len();
                    }
                }
                Err(_) => usage.missing_chunks += 1,
            }
        }
        Ok(usage)
    }
}
