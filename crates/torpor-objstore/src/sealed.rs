//! A sealed chunk store record (the split path's device segments: a record the daemon sealed
//! with the node's snapshot key, `torpor_image::store::StoreWriter::commit_sealed`) between a
//! node's store and the bucket, so a split snapshot restores on any node that shares the key.
//!
//! The record travels as the bytes the pushing store committed, MAC included
//! (`snapshots/<id>/sealed-record.json`); the pulling node checks that MAC with its own key
//! before it fetches a chunk (`torpor_image::store::open_sealed_record`), checks every chunk
//! against its id, and commits the recipes sealed with its key, which yields the same MAC.
//! Nobody without the key can make a record this accepts.

use std::path::Path;

use torpor_image::store::{open_sealed_record, ChunkStore, Recipe, StoreError};
use torpor_image::SnapshotKey;

use crate::client::Remote;
use crate::error::TransferError;
use crate::{snapshot_key, Progress, MAX_RECORD_BYTES};

/// The object holding a snapshot's sealed record, under `snapshots/<id>/`.
pub const SEALED_RECORD_OBJECT: &str = "sealed-record.json";
/// The locator of the sealed record's chunks in packs, under `snapshots/<id>/`.
pub(crate) const SEALED_LOCATOR_OBJECT: &str = "sealed-packs.json";

/// What a push or pull of a sealed record moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SealedRecordReport {
    /// Distinct chunks the record lists.
    pub chunks: u64,
    /// Chunks uploaded (push) or fetched (pull) by this call.
    pub moved: u64,
}

/// Pushes the committed record `id` of `store` (it must be sealed) and the chunks the bucket
/// lacks; the record last, so a record in the bucket always has its chunks there.
pub fn push_sealed_record(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    key: &SnapshotKey,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SealedRecordReport, TransferError> {
    let bytes = store.record_bytes(id)?;
    // Only what this node sealed goes out (and it is what the pulling node will check).
    let recipes = open_sealed_record(&bytes, &store.root().join("refs"), id, key)?;
    let up = crate::chunks::upload(remote, store, &recipes, parallel, progress)?;
    remote.put(
        &snapshot_key(id, SEALED_LOCATOR_OBJECT),
        &up.locator.to_json(),
    )?;
    remote.put(&snapshot_key(id, SEALED_RECORD_OBJECT), &bytes)?;
    Ok(SealedRecordReport {
        chunks: up.total,
        moved: up.uploaded,
    })
}

/// A snapshot's sealed record as the bucket holds it, its MAC checked: its recipes, and the
/// locator of their chunks in packs (`None`: pushed before packs, its chunks loose).
pub(crate) struct SealedInBucket {
    pub(crate) recipes: Vec<Recipe>,
    pub(crate) locator: Option<crate::chunks::Locator>,
}

/// The sealed record of snapshot `id` in the bucket (`Ok(None)`: it has none), opened with
/// `key` before anything else is fetched, and its locator.
pub(crate) fn fetch_sealed_record(
    remote: &Remote,
    id: &str,
    key: &SnapshotKey,
) -> Result<Option<SealedInBucket>, TransferError> {
    let object = snapshot_key(id, SEALED_RECORD_OBJECT);
    // The locator is fetched beside the record (one round trip, not two) and used only once
    // the record's MAC has been checked.
    let (bytes, locator) = crate::pull::at_once(
        || remote.get(&object, MAX_RECORD_BYTES),
        || crate::chunks::fetch_locator(remote, &snapshot_key(id, SEALED_LOCATOR_OBJECT)),
    );
    let Some(bytes) = bytes? else {
        return Ok(None);
    };
    let origin = format!(
        "object {} in bucket {}",
        remote.full_key(&object),
        remote.bucket()
    );
    let recipes = open_sealed_record(&bytes, Path::new(&origin), id, key)?;
    Ok(Some(SealedInBucket {
        recipes,
        locator: locator?,
    }))
}

/// Pulls the sealed record `id` into `store` if the bucket has one (`Ok(None)`: it has none):
/// its MAC checked with `key`, its missing chunks fetched and checked, then committed sealed.
/// A record `store` holds already must be the same.
pub fn pull_sealed_record(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    key: &SnapshotKey,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Option<SealedRecordReport>, TransferError> {
    torpor_image::store::check_snapshot_id(id)?;
    let Some(SealedInBucket { recipes, locator }) = fetch_sealed_record(remote, id, key)? else {
        return Ok(None);
    };
    let writer = store.writer()?;
    let bucket = remote.bucket().to_owned();
    let missing = |k: &str| TransferError::MissingObject {
        id: id.to_owned(),
        bucket: bucket.clone(),
        key: remote.full_key(k),
    };
    let source = crate::chunks::Source {
        remote,
        locator: locator.as_ref(),
        missing: &missing,
    };
    let down = crate::chunks::download(&source, store, &writer, &recipes, parallel, progress)?;
    let (chunks, moved) = (down.total, down.fetched);
    match store.sealed_recipes(id, key) {
        Ok(have) if have == recipes => drop(writer),
        Ok(_) => {
            return Err(TransferError::StoreDiffers {
                id: id.to_owned(),
                store: store.root().to_path_buf(),
                dir: store.root().to_path_buf(),
                file: "its sealed record".to_owned(),
            })
        }
        Err(StoreError::UnknownSnapshot { .. }) => writer.commit_sealed(id, &recipes, key)?,
        Err(e) => return Err(e.into()),
    }
    Ok(Some(SealedRecordReport { chunks, moved }))
}
