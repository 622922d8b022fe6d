//! `push`: a snapshot directory into the local chunk store, then into the bucket.

use std::fs;
use std::path::Path;

use torpor_image::store::{ChunkStore, Recipe, StoreError};
use torpor_image::{Snapshot, Trust, MAC_FILE, MANIFEST_FILE};

use crate::client::{Remote, Traffic};
use crate::error::TransferError;
use crate::{
    snapshot_key, Phase, Progress, RemoteRecord, LOCATOR_OBJECT, RECORD_FORMAT, RECORD_OBJECT,
};

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PushReport {
    pub id: String,
    pub bucket: String,
    /// Distinct chunks the snapshot is made of.
    pub chunks: u64,
    /// Chunks uploaded by this push.
    pub uploaded: u64,
    /// Chunks the bucket had already.
    pub present: u64,
    /// Whether the snapshot's manifest was in the bucket already (nothing but missing chunks
    /// was then written).
    pub already_pushed: bool,
    pub traffic: Traffic,
}

/// Pushes the snapshot in `dir` as `id`: authenticates it under `trust` and verifies it, stores its files in `store` (unless the
/// store already holds `id`, which must then have the same contents), uploads the chunks the
/// bucket lacks with at most `parallel` requests at once, then the record, the seal and the
/// manifest, manifest last. Running it again completes an interrupted push.
pub fn push(
    remote: &Remote,
    store: &ChunkStore,
    dir: &Path,
    id: &str,
    trust: Trust<'_>,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<PushReport, TransferError> {
    torpor_image::store::check_snapshot_id(id)?;
    let snapshot = Snapshot::open(dir)?;
    snapshot.authenticate(trust)?;
    snapshot.verify()?;
    let manifest_bytes = read_file(&dir.join(MANIFEST_FILE))?;
    let mac_bytes = match fs::read(dir.join(MAC_FILE)) {
        Ok(b) => Some(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(TransferError::Io {
                op: "read",
                path: dir.join(MAC_FILE),
                source,
            })
        }
    };

    // A manifest already there: the same snapshot (complete what is missing) or a clash,
    // refused before anything is stored.
    let manifest_key = snapshot_key(id, MANIFEST_FILE);
    let already_pushed = match remote.get(&manifest_key, torpor_image::MAX_MANIFEST_BYTES)? {
        Some(theirs) if theirs == manifest_bytes => true,
        Some(_) => {
            return Err(TransferError::Conflict {
                id: id.to_owned(),
                bucket: remote.bucket().to_owned(),
            })
        }
        None => false,
    };

    let recipes = local_recipes(store, &snapshot, id, progress)?;
    let up = crate::chunks::upload(remote, store, &recipes, parallel, progress)?;
    let (total, uploaded) = (up.total, up.uploaded);

    // The locator before the manifest (a snapshot with a manifest has its locator); rewritten
    // when a push of a snapshot already there had to upload chunks the bucket had lost.
    if !already_pushed || uploaded > 0 {
        remote.put(&snapshot_key(id, LOCATOR_OBJECT), &up.locator.to_json())?;
    }
    if !already_pushed {
        let record = RemoteRecord {
            format: RECORD_FORMAT,
            snapshot: id.to_owned(),
            recipes,
        };
        let json = serde_json::to_vec(&record).map_err(|source| {
            TransferError::Store(StoreError::RecordEncode {
                id: id.to_owned(),
                source,
            })
        })?;
        remote.put(&snapshot_key(id, RECORD_OBJECT), &json)?;
        if let Some(mac) = &mac_bytes {
            remote.put(&snapshot_key(id, MAC_FILE), mac)?;
        }
        remote.put(&manifest_key, &manifest_bytes)?;
    }
    Ok(PushReport {
        id: id.to_owned(),
        bucket: remote.bucket().to_owned(),
        chunks: total,
        uploaded,
        present: total - uploaded,
        already_pushed,
        traffic: remote.traffic(),
    })
}

/// The recipes of the snapshot's files in `store` under `id`: the committed ones when `id` is
/// there (checked against the manifest), else stored and committed now.
fn local_recipes(
    store: &ChunkStore,
    snapshot: &Snapshot,
    id: &str,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Vec<Recipe>, TransferError> {
    let files = &snapshot.manifest().files;
    let committed = match store.recipes(id) {
        Ok(recipes) => Some(recipes),
        Err(StoreError::UnknownSnapshot { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    if let Some(recipes) = committed {
        for f in files {
            let same = recipes
                .iter()
                .any(|r| r.name == f.path && r.size == f.size && r.blake3 == f.blake3);
            if !same {
                return Err(TransferError::StoreDiffers {
                    id: id.to_owned(),
                    store: store.root().to_path_buf(),
                    dir: snapshot.dir().to_path_buf(),
                    file: f.path.clone(),
                });
            }
        }
        return Ok(recipes);
    }
    let mut writer = store.writer()?;
    let mut recipes = Vec::with_capacity(files.len());
    for (i, f) in files.iter().enumerate() {
        progress(Progress {
            phase: Phase::Storing,
            done: i as u64,
            total: files.len() as u64,
        });
        recipes.push(writer.put_file(&snapshot.dir().join(&f.path), &f.path)?);
    }
    writer.commit(id, &recipes)?;
    Ok(recipes)
}

fn read_file(path: &Path) -> Result<Vec<u8>, TransferError> {
    fs::read(path).map_err(|source| TransferError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })
}
