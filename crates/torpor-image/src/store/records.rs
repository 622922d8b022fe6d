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

/// Whether `record` carries `key`'s MAC over itself.
fn check_seal(record: &Record, id: &str, key: &SnapshotKey) -> Result<(), StoreError> {
    let Some(mac) = &record.mac else {
        return Err(StoreError::RecordUnsealed { id: id.to_owned() });
    };
    let expected = key.record_mac(&record.unsealed_bytes(id)?);
    // Hash equality is constant-time.
    if blake3::Hash::from_hex(mac).ok() != Some(expected) {
        return Err(StoreError::RecordSealMismatch { id: id.to_owned() });
    }
    Ok(())
}

/// The recipes of record bytes another store committed sealed ([`ChunkStore::record_bytes`],
/// e.g. fetched from a bucket; `origin` names where in errors), if they are a valid record of
/// `id` sealed with `key`: nodes sharing the key trust each other's segment records, and no one
/// else can have written them. Commit them with
/// [`StoreWriter::commit_sealed`](crate::store::StoreWriter::commit_sealed), which seals them
/// again with the same MAC.
pub fn open_sealed_record(
    bytes: &[u8],
    origin: &Path,
    id: &str,
    key: &SnapshotKey,
) -> Result<Vec<Recipe>, StoreError> {
    check_snapshot_id(id)?;
    let record = parse_record(bytes, origin, id)?;
    check_seal(&record, id, key)?;
    Ok(record.recipes)
}

pub(crate) fn record_path(store: &ChunkStore, id: &str) -> PathBuf {
    store.refs_dir().join(format!("{id}{RECORD_SUFFIX}"))
}

/// Writes the record of `id` whole or not at all, never replacing an existing one; sealed with
/// `key` when given. `durable`: fsync'd with its directory before this returns; else the
/// caller makes it durable later (a deferred commit's syncfs, [`crate::store::Pending`]).
pub(crate) fn write_record(
    store: &ChunkStore,
    id: &str,
    recipes: &[Recipe],
    key: Option<&SnapshotKey>,
    durable: bool,
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
            if durable {
                f.sync_all()?;
            }
            Ok(())
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
    if durable {
        sync_dir(&store.refs_dir())?;
    }
    Ok(())
}

pub(crate) fn read_record(path: &Path, id: &str) -> Result<Record, StoreError> {
    let bytes = fs::read(path).map_err(|e| io_error("read", path, e))?;
    parse_record(&bytes, path, id)
}

/// A record's bytes, checked as [`read_record`] checks a file (`path` names where they came
/// from in errors).
fn parse_record(bytes: &[u8], path: &Path, id: &str) -> Result<Record, StoreError> {
    let record: Record =
        serde_json::from_slice(bytes).map_err(|source| StoreError::RecordCorrupt {
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
        check_seal(&record, snapshot_id, key)?;
        Ok(record.recipes)
    }

    /// The committed record of `snapshot_id` as it is on disk (its MAC included, if sealed):
    /// what another node's store takes with [`open_sealed_record`].
    pub fn record_bytes(&self, snapshot_id: &str) -> Result<Vec<u8>, StoreError> {
        check_snapshot_id(snapshot_id)?;
        let path = record_path(self, snapshot_id);
        if !path.exists() {
            return Err(self.unknown(snapshot_id));
        }
        fs::read(&path).map_err(|e| io_error("read", &path, e))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> SnapshotKey {
        SnapshotKey::from_bytes([byte; 32], Path::new("test.key"))
    }

    #[test]
    fn a_sealed_record_opens_on_another_node_with_the_same_key_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = ChunkStore::open(&dir.path().join("a")).expect("store");
        let file = dir.path().join("seg");
        fs::write(&file, vec![7u8; 100_000]).expect("write");
        let mut w = store.writer().expect("writer");
        let recipe = w.put_file(&file, "segment-1000").expect("put");
        w.commit_sealed("fn-x-1", std::slice::from_ref(&recipe), &key(1))
            .expect("commit");
        let bytes = store.record_bytes("fn-x-1").expect("bytes");
        let origin = Path::new("bucket object");
        assert_eq!(
            open_sealed_record(&bytes, origin, "fn-x-1", &key(1)).expect("opens"),
            vec![recipe]
        );
        // Another key, another id, a rewritten record, an unsealed one: refused.
        assert!(matches!(
            open_sealed_record(&bytes, origin, "fn-x-1", &key(2)),
            Err(StoreError::RecordSealMismatch { .. })
        ));
        assert!(open_sealed_record(&bytes, origin, "fn-x-2", &key(1)).is_err());
        let text = String::from_utf8(bytes.clone()).expect("utf8");
        let forged = text.replacen("\"size\":", "\"size\":1", 1);
        assert!(open_sealed_record(forged.as_bytes(), origin, "fn-x-1", &key(1)).is_err());
        let store_b = ChunkStore::open(&dir.path().join("b")).expect("store b");
        let w = store_b.writer().expect("writer");
        w.commit("fn-x-1", &[]).expect("commit");
        let unsealed = store_b.record_bytes("fn-x-1").expect("bytes");
        assert!(matches!(
            open_sealed_record(&unsealed, origin, "fn-x-1", &key(1)),
            Err(StoreError::RecordUnsealed { .. })
        ));
    }
}
