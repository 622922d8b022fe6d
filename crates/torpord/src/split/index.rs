//! The segments index of a split snapshot: where each segment lives in the worker (VA, size,
//! backend, GPU), in which order to fill it, whether it is read-only (and why), and which
//! recipe of the chunk store holds its bytes.
//!
//! **Who wrote it.** The record is sealed with the daemon's snapshot key
//! ([`torpor_image::store::StoreWriter::commit_sealed`]) and [`load`] refuses one without that
//! MAC: a writer who rewrote a segment's chunks, its recipe and the index alike (all hashes
//! recomputed) still cannot forge the record's MAC.
//!
//! **Where it lives, and why there.** The index is stored in the chunk store itself, as the
//! recipe `segments.json` of the snapshot's record (`<state>/chunks/refs/<snapshot id>.json`),
//! beside one recipe per segment (`segment-<va in hex>`). So it is covered by the same integrity
//! as the segments: every chunk is checked against its BLAKE3 id when read, the whole index
//! against its recipe's hash, and each segment entry names its recipe's hash, which must match
//! the record's (a mismatch is refused). Putting it in the snapshot directory instead would have
//! needed a change to the snapshot writer (the manifest refuses unlisted files); the record is
//! written in one rename, so the index and the references it describes appear together.

use serde::{Deserialize, Serialize};
use torpor_image::store::{ChunkStore, Recipe, StoreError};

/// The recipe name of the index in a snapshot's record.
pub const INDEX_RECIPE: &str = "segments.json";
/// Layout version of the index.
pub const INDEX_FORMAT: u32 = 1;

/// One segment of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentEntry {
    pub va: u64,
    pub size: u64,
    /// `host` or `cuda`.
    pub backend: String,
    /// The GPU's CUDA ordinal (-1 for host).
    pub ordinal: i32,
    /// Creation order in the worker.
    pub order: u64,
    /// Place in first-use order (recorded during the warm-up); `None`: not marked.
    pub first_use: Option<u64>,
    /// The worker can run a request before it is mapped (it holds nothing but the weights of
    /// torch modules, which wait for it as they run: python/torpor/readiness.py).
    #[serde(default)]
    pub deferrable: bool,
    /// Mapped read-only, one physical copy shared by every instance.
    pub readonly: bool,
    /// Why it is read-only: `declared` (sealed by the worker: read-only declared data) or
    /// `unchanged` (same hash before and after the warm-up); empty when writable.
    pub readonly_why: String,
    /// Its recipe in the snapshot's record, and that recipe's BLAKE3 hash.
    pub recipe: String,
    pub blake3: String,
}

/// The index as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SegmentIndex {
    pub format: u32,
    pub segments: Vec<SegmentEntry>,
}

/// A segment with its recipe, ready to fill.
pub type Planned = (SegmentEntry, Recipe);

/// The recipe name of the segment at `va`.
pub fn recipe_name(va: u64) -> String {
    format!("segment-{va:x}")
}

/// The order the restore server fills segments in: first those a request waits for before it
/// runs (every segment but the deferrable ones), then the deferrable ones, which modules wait for
/// as they run; within each, those the warm-up marked in first-use order, then the rest in
/// creation order.
pub fn fill_order(planned: &mut [Planned]) {
    planned.sort_by_key(|(e, _)| {
        (
            e.deferrable,
            e.first_use.is_none(),
            e.first_use.unwrap_or(0),
            e.order,
        )
    });
}

/// The segments of snapshot `id`, in fill order, or `None` when it is not a split snapshot (the
/// store has no record of it, or the record has no index). A record `key` did not seal is
/// refused.
pub fn load(
    store: &ChunkStore,
    id: &str,
    key: &torpor_image::SnapshotKey,
) -> Result<Option<Vec<Planned>>, IndexError> {
    let id_ = || id.to_string();
    let recipes = match store.sealed_recipes(id, key) {
        Ok(r) => r,
        Err(StoreError::UnknownSnapshot { .. }) => return Ok(None),
        Err(e) => {
            return Err(IndexError::Record {
                id: id_(),
                source: Box::new(e),
            })
        }
    };
    let Some(index_recipe) = recipes.iter().find(|r| r.name == INDEX_RECIPE) else {
        return Ok(None);
    };
    let mut bytes = vec![0u8; index_recipe.size as usize];
    store
        .read_into(index_recipe, &mut bytes)
        .map_err(|e| IndexError::Damaged {
            id: id_(),
            source: Box::new(e),
        })?;
    let index: SegmentIndex = serde_json::from_slice(&bytes)
        .map_err(|source| IndexError::Invalid { id: id_(), source })?;
    if index.format != INDEX_FORMAT {
        return Err(IndexError::Format {
            id: id_(),
            format: index.format,
        });
    }
    let mut planned = Vec::with_capacity(index.segments.len());
    for entry in index.segments {
        let Some(recipe) = recipes.iter().find(|r| r.name == entry.recipe) else {
            return Err(IndexError::NoRecipe {
                id: id_(),
                recipe: entry.recipe,
            });
        };
        if recipe.blake3 != entry.blake3 || recipe.size != entry.size {
            return Err(IndexError::Altered {
                id: id_(),
                va: entry.va,
            });
        }
        planned.push((entry, recipe.clone()));
    }
    fill_order(&mut planned);
    Ok(Some(planned))
}

/// Why the segments of a split snapshot cannot be planned from its record in the chunk store.
/// Every case but the first is fixed by deploying the function again.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The snapshot's record cannot be read (or this daemon's key did not seal it).
    #[error("cannot read the segments of snapshot {id}: {source}")]
    Record {
        id: String,
        #[source]
        source: Box<StoreError>,
    },
    /// The index's chunks cannot be read back.
    #[error("the segments index of snapshot {id} is damaged: {source}; deploy the function again")]
    Damaged {
        id: String,
        #[source]
        source: Box<StoreError>,
    },
    /// The index is not the JSON this daemon writes.
    #[error(
        "the segments index of snapshot {id} is not valid: {source}; deploy the function again"
    )]
    Invalid {
        id: String,
        #[source]
        source: serde_json::Error,
    },
    /// Another format of index.
    #[error("the segments index of snapshot {id} has format {format}, this torpord reads {INDEX_FORMAT}: deploy the function again")]
    Format { id: String, format: u32 },
    /// The index names a recipe the record does not hold.
    #[error("snapshot {id}'s segments index names {recipe} but its record holds no such recipe: deploy the function again")]
    NoRecipe { id: String, recipe: String },
    /// A segment's hash or size differs between the index and the record.
    #[error(
        "snapshot {id}'s segment at {va:#x} does not match its record (hash or size): the \
         store was altered; deploy the function again"
    )]
    Altered { id: String, va: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(va: u64, order: u64, first_use: Option<u64>) -> Planned {
        (
            SegmentEntry {
                va,
                size: 4096,
                backend: "host".into(),
                ordinal: -1,
                order,
                first_use,
                deferrable: false,
                readonly: false,
                readonly_why: String::new(),
                recipe: recipe_name(va),
                blake3: String::new(),
            },
            Recipe {
                name: recipe_name(va),
                size: 0,
                blake3: String::new(),
                chunks: vec![],
            },
        )
    }

    #[test]
    fn marked_segments_fill_first_in_first_use_order_then_creation_order() {
        let mut p = vec![
            entry(1, 0, None),
            entry(2, 1, Some(1)),
            entry(3, 2, Some(0)),
            entry(4, 3, None),
        ];
        fill_order(&mut p);
        let vas: Vec<u64> = p.iter().map(|(e, _)| e.va).collect();
        assert_eq!(vas, vec![3, 2, 1, 4]);
    }

    #[test]
    fn segments_a_request_waits_for_fill_before_the_deferrable_ones() {
        let deferrable = |va, order, first_use| {
            let mut p = entry(va, order, first_use);
            p.0.deferrable = true;
            p
        };
        let mut p = vec![
            deferrable(1, 0, Some(1)),
            deferrable(2, 1, Some(0)),
            entry(3, 2, None),
            entry(4, 3, Some(2)),
        ];
        fill_order(&mut p);
        let vas: Vec<u64> = p.iter().map(|(e, _)| e.va).collect();
        assert_eq!(vas, vec![4, 3, 2, 1]);
    }

    #[test]
    fn an_index_without_deferrable_flags_reads_as_none_deferrable() {
        let old = r#"{"va":4096,"size":4096,"backend":"host","ordinal":-1,"order":0,"first_use":null,"readonly":false,"readonly_why":"","recipe":"segment-1000","blake3":""}"#;
        let e: SegmentEntry = serde_json::from_str(old).unwrap();
        assert!(!e.deferrable);
    }

    /// Stores `data` as the segment at 0x1000 and an index naming it with `blake3` (the
    /// segment's own hash when `None`): the recipes of a one-segment split snapshot.
    fn store_segment(
        w: &mut torpor_image::store::StoreWriter,
        data: &[u8],
        blake3: Option<String>,
    ) -> Vec<Recipe> {
        let seg = w.put_bytes(&recipe_name(0x1000), data).unwrap();
        let mut e = entry(0x1000, 0, Some(0)).0;
        e.size = data.len() as u64;
        e.blake3 = blake3.unwrap_or_else(|| seg.blake3.clone());
        let index = SegmentIndex {
            format: INDEX_FORMAT,
            segments: vec![e],
        };
        let idx = w
            .put_bytes(INDEX_RECIPE, &serde_json::to_vec(&index).unwrap())
            .unwrap();
        vec![idx, seg]
    }

    #[test]
    fn a_tampered_index_is_refused_and_a_plain_snapshot_has_none() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(&dir.path().join("chunks")).unwrap();
        let key = crate::staging::test_key();
        assert_eq!(load(&store, "fn-x-1", &key).unwrap(), None);
        let mut w = store.writer().unwrap();
        let recipes = store_segment(&mut w, &[7u8; 8192], Some("0".repeat(64)));
        w.commit_sealed("fn-x-2", &recipes, &key).unwrap();
        let err = load(&store, "fn-x-2", &key).unwrap_err().to_string();
        assert!(err.contains("does not match its record"), "{err}");
    }

    #[test]
    fn a_record_the_key_did_not_seal_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(&dir.path().join("chunks")).unwrap();
        let key = crate::staging::test_key();
        let mut w = store.writer().unwrap();
        let recipes = store_segment(&mut w, &[7u8; 8192], None);
        w.commit_sealed("fn-x-3", &recipes, &key).unwrap();
        assert_eq!(load(&store, "fn-x-3", &key).unwrap().unwrap().len(), 1);
        // Another writer plants other bytes: new chunks for the segment and for an index that
        // names their hash, both recipes put in the record. Every hash agrees; only the MAC,
        // kept from the original record, does not.
        let path = dir.path().join("chunks/refs/fn-x-3.json");
        let mut record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let mut w = store.writer().unwrap();
        let planted = store_segment(&mut w, &[9u8; 8192], None);
        drop(w);
        record["recipes"] = serde_json::to_value(&planted).unwrap();
        std::fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
        let err = load(&store, "fn-x-3", &key).unwrap_err().to_string();
        assert!(err.contains("changed after the daemon sealed it"), "{err}");
        // The same record unsealed: its hashes alone would have planted the bytes.
        record.as_object_mut().unwrap().remove("mac");
        std::fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
        let planned = store.recipes("fn-x-3").unwrap();
        assert_eq!(
            planned, planted,
            "an unchecked reader takes the planted recipes"
        );
        let err = load(&store, "fn-x-3", &key).unwrap_err().to_string();
        assert!(err.contains("carries no MAC"), "{err}");
        // Committed unsealed (as by a torpord before sealing, or any other writer).
        let mut w = store.writer().unwrap();
        let recipes = store_segment(&mut w, &[7u8; 8192], None);
        w.commit("fn-x-4", &recipes).unwrap();
        let err = load(&store, "fn-x-4", &key).unwrap_err().to_string();
        assert!(err.contains("carries no MAC"), "{err}");
    }
}
