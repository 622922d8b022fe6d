//! The committed references: one record file per snapshot, listing its recipes.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::auth::SnapshotKey;
use crate::store::error::{io_error, StoreError};
use crate::store::{check_snapshot_id, sync_dir, ChunkId, ChunkStore, Recipe};

/// Layout version of a record.
const RECORD_FORMAT: u32 = 1;

const RECORD_SUFFIX: &str = ".json";

/// `refs/<snapshot>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Record {
    pub format: u32,
    pub snapshot: String,
    pub recipes: Vec<Recipe>,
    /// [`SnapshotKey::record_mac`] of this record encoded without it (lowercase hex), when it
    /// was committed sealed. Strings and integers only: the encoding is the same every time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl Record {
    /// The bytes the MAC covers: the record encoded without its MAC.
    fn unsealed_bytes(&self, id: &str) -> Result<Vec<u8>, StoreError> {
        let bare = Record {
            mac: None,
            ..self.clone()
        };
        serde_json::to_vec(&bare).map_err(|source| StoreError::RecordEncode {
            id: id.to_owned(),
            source,
        })
    }
}

pub(crate) fn record_path(store: &ChunkStore, id: &str) -> PathBuf {
    store.refs_dir().join(format!("{id}{RECORD_SUFFIX}"))
}

/// Writes the record of `id` whole or not at all, never replacing an existing one; sealed with
/// `key` when given.
pub(crate) fn write_record(
    store: &ChunkStore,
    id: &str,
    recipes: &[Recipe],
    key: Option<&SnapshotKey>,
) -> Result<(), StoreError> {
    let mut record = Record {
        format: RECORD_FORMAT,
        snapshot: id.to_owned(),
        recipes: recipes.to_vec(),
        mac: None,
    };
    if let Some(key) = key {
        let mac = key.record_mac(&record.unsealed_bytes(id)?);
        record.mac = Some(mac.to_hex().to_string());
    }
    let json = serde_json::to_vec(&record).map_err(|source| StoreError::RecordEncode {
        id: id.to_owned(),
        source,
    })?;
    let tmp = store
        .tmp_dir()
        .join(format!("{id}{RECORD_SUFFIX}.{}", std::process::id()));
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(&json)?;
            f.sync_all()
        })
        .map_err(|e| io_error("write", &tmp, e));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    let path = record_path(store, id);
    // link(2) fails with EEXIST instead of replacing: two commits of one id cannot both win.
    let linked = fs::hard_link(&tmp, &path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(StoreError::SnapshotExists { id: id.to_owned() })
        }
        Err(e) => return Err(io_error("write", &path, e)),
    }
    sync_dir(&store.refs_dir())
}

fn read_record(path: &Path, id: &str) -> Result<Record, StoreError> {
    let bytes = fs::read(path).map_err(|e| io_error("read", path, e))?;
    let record: Record =
        serde_json::from_slice(&bytes).map_err(|source| StoreError::RecordCorrupt {
            path: path.to_path_buf(),
            source,
        })?;
    let mismatch = |what: String| StoreError::RecordCorrupt {
        path: path.to_path_buf(),
        source: serde::de::Error::custom(what),
    };
    if record.format != RECORD_FORMAT {
        return Err(mismatch(format!(
            "record format {}, this torpor reads {RECORD_FORMAT}",
            record.format
        )));
    }
    if record.snapshot != id {
        return Err(mismatch(format!("it names snapshot {:?}", record.snapshot)));
    }
    for recipe in &record.recipes {
        recipe.validate()?;
    }
    Ok(record)
}

/// Every committed record, by snapshot id. Fails on the first unreadable one.
pub(crate) fn read_all(store: &ChunkStore) -> Result<BTreeMap<String, Record>, StoreError> {
    let dir = store.refs_dir();
    let mut all = BTreeMap::new();
    for entry in fs::read_dir(&dir).map_err(|e| io_error("list", &dir, e))? {
        let entry = entry.map_err(|e| io_error("list", &dir, e))?;
        let name = entry.file_name();
        let Some(id) = name.to_str().and_then(|n| n.strip_suffix(RECORD_SUFFIX)) else {
            continue;
        };
        if check_snapshot_id(id).is_err() {
            continue;
        }
        let record = match read_record(&entry.path(), id) {
            Ok(r) => r,
            // Released (its record deleted) between the listing and the read: it references
            // nothing any more. GC running beside a release saw this as an error (CI).
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                continue
            }
            Err(e) => return Err(e),
        };
        all.insert(id.to_owned(), record);
    }
    Ok(all)
}

impl ChunkStore {
    /// The ids of the committed snapshots, sorted.
    pub fn snapshots(&self) -> Result<Vec<String>, StoreError> {
        Ok(read_all(self)?.into_keys().collect())
    }

    /// The recipes committed for `snapshot_id`.
    pub fn recipes(&self, snapshot_id: &str) -> Result<Vec<Recipe>, StoreError> {
        check_snapshot_id(snapshot_id)?;
        let path = record_path(self, snapshot_id);
        if !path.exists() {
            return Err(self.unknown(snapshot_id));
        }
        Ok(read_record(&path, snapshot_id)?.recipes)
    }

    /// [`recipes`](Self::recipes), for a restore: the record must carry `key`'s MAC (written by
    /// [`StoreWriter::commit_sealed`](crate::store::StoreWriter::commit_sealed)). Every chunk is
    /// then covered too: each is checked against its id, which the sealed recipes list.
    pub fn sealed_recipes(
        &self,
        snapshot_id: &str,
        key: &SnapshotKey,
    ) -> Result<Vec<Recipe>, StoreError> {
        check_snapshot_id(snapshot_id)?;
        let path = record_path(self, snapshot_id);
        if !path.exists() {
            return Err(self.unknown(snapshot_id));
        }
        let record = read_record(&path, snapshot_id)?;
        let id = snapshot_id.to_owned();
        let Some(mac) = &record.mac else {
            return Err(StoreError::RecordUnsealed { id });
        };
        let expected = key.record_mac(&record.unsealed_bytes(snapshot_id)?);
        // Hash equality is constant-time.
        if blake3::Hash::from_hex(mac).ok() != Some(expected) {
            return Err(StoreError::RecordSealMismatch { id });
        }
        Ok(record.recipes)
    }

    /// Drops the references of `snapshot_id`. Its chunks stay until [`gc`](Self::gc) finds
    /// them unreferenced.
    pub fn release(&self, snapshot_id: &str) -> Result<(), StoreError> {
        check_snapshot_id(snapshot_id)?;
        let path = record_path(self, snapshot_id);
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.refs_dir()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(self.unknown(snapshot_id)),
            Err(e) => Err(io_error("remove", &path, e)),
        }
    }

    /// How many committed snapshots reference chunk `id`.
    pub fn refcount(&self, id: &ChunkId) -> Result<u64, StoreError> {
        Ok(self.refcounts()?.get(id).copied().unwrap_or(0))
    }

    /// The reference count of every referenced chunk: the number of committed snapshots whose
    /// record lists it (a snapshot listing a chunk several times counts once).
    pub fn refcounts(&self) -> Result<HashMap<ChunkId, u64>, StoreError> {
        Ok(refcounts(&read_all(self)?))
    }

    /// The snapshots that reference `id`, for error messages; best effort.
    pub(crate) fn holders(&self, id: &ChunkId) -> String {
        let Ok(all) = read_all(self) else {
            return "unknown (the store's records are unreadable)".to_owned();
        };
        let holders: Vec<&str> = all
            .values()
            .filter(|r| {
                r.recipes
                    .iter()
                    .any(|rc| rc.chunks.iter().any(|c| c.id == *id))
            })
            .map(|r| r.snapshot.as_str())
            .collect();
        if holders.is_empty() {
            "none".to_owned()
        } else {
            holders.join(", ")
        }
    }

    fn unknown(&self, id: &str) -> StoreError {
        StoreError::UnknownSnapshot {
            id: id.to_owned(),
            root: self.root.clone(),
        }
    }
}

pub(crate) fn refcounts(all: &BTreeMap<String, Record>) -> HashMap<ChunkId, u64> {
    let mut counts = HashMap::new();
    for record in all.values() {
        let mut mine: Vec<ChunkId> = record
            .recipes
            .iter()
            .flat_map(|r| r.chunks.iter().map(|c| c.id))
            .collect();
        mine.sort_unstable();
        mine.dedup();
        for id in mine {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    counts
}
