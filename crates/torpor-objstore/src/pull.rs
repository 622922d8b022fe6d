//! `pull`: a snapshot from the bucket into the local chunk store and a snapshot directory.

use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use torpor_image::store::{ChunkStore, Recipe, StoreError};
use torpor_image::{Manifest, Snapshot, Trust, MAC_FILE, MANIFEST_FILE};

use crate::client::{Remote, Traffic};
use crate::error::TransferError;
use crate::{
    snapshot_key, Phase, Progress, RemoteRecord, LOCATOR_OBJECT, MAX_RECORD_BYTES, RECORD_FORMAT,
    RECORD_OBJECT,
};

/// What a pull did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PullReport {
    pub id: String,
    pub bucket: String,
    pub out: PathBuf,
    /// Distinct chunks the snapshot is made of.
    pub chunks: u64,
    /// Chunks fetched from the bucket.
    pub fetched: u64,
    /// Chunks the local store had already.
    pub local: u64,
    /// Ranged GETs of packs that fetched the packed chunks.
    pub ranges: u64,
    /// Chunks fetched as loose objects, one GET each (pushed before packs).
    pub loose: u64,
    pub traffic: Traffic,
    pub timings: PullTimings,
}

/// Where a pull's time went, in seconds: what to look at when a pull is slower than the link.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PullTimings {
    /// The manifest, the record and the MAC: small GETs one after another.
    pub metadata_s: f64,
    /// The chunks: GETs, decoding, checking each against its id, writing them into the store.
    pub fetch_s: f64,
    /// The store's commit: one syncfs, then the record.
    pub commit_s: f64,
    /// Writing the snapshot directory from the store.
    pub materialise_s: f64,
    /// Authenticating the manifest and hashing every file of the directory against it.
    pub verify_s: f64,
}

/// Pulls snapshot `id` into `store` and writes it as the snapshot directory `out` (which must
/// not exist) once it authenticates under `trust` and verifies. Fetches only the chunks `store` lacks, at most `parallel` at once, each checked
/// against its id before it is stored. On failure nothing is committed and `out` is not
/// created; the chunks fetched so far stay in the store (verified, unreferenced: the next pull
/// uses them, a GC removes them).
pub fn pull(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    out: &Path,
    trust: Trust<'_>,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<PullReport, TransferError> {
    torpor_image::store::check_snapshot_id(id)?;
    let mut timings = PullTimings::default();
    let mut clock = Instant::now();
    let mut lap = move || {
        let now = Instant::now();
        let s = now.duration_since(clock).as_secs_f64();
        clock = now;
        s
    };
    if fs::symlink_metadata(out).is_ok() {
        return Err(TransferError::OutExists {
            path: out.to_path_buf(),
        });
    }
    let bucket = remote.bucket().to_owned();
    let manifest_key = snapshot_key(id, MANIFEST_FILE);
    let Some(manifest_bytes) = remote.get(&manifest_key, torpor_image::MAX_MANIFEST_BYTES)? else {
        return Err(TransferError::NotInBucket {
            id: id.to_owned(),
            bucket,
            key: remote.full_key(&manifest_key),
        });
    };
    let manifest = Manifest::from_json(
        &manifest_bytes,
        Path::new(&remote.full_key(&manifest_key)),
        out,
    )?;
    let record_key = snapshot_key(id, RECORD_OBJECT);
    let missing = |key: &str| TransferError::MissingObject {
        id: id.to_owned(),
        bucket: bucket.clone(),
        key: remote.full_key(key),
    };
    let record_bytes = remote
        .get(&record_key, MAX_RECORD_BYTES)?
        .ok_or_else(|| missing(&record_key))?;
    let recipes = check_record(&record_bytes, id, &manifest).map_err(|reason| {
        TransferError::CorruptObject {
            bucket: bucket.clone(),
            key: remote.full_key(&record_key),
            reason,
        }
    })?;
    let mac_key = snapshot_key(id, MAC_FILE);
    let mac = remote.get(&mac_key, 64 << 10)?;

    // Chunks: only those the store lacks. The writer's shared lock keeps a GC from deleting
    // the ones already here (or fetched) before the record that references them is committed.
    let writer = store.writer()?;
    let locator = crate::chunks::fetch_locator(remote, &snapshot_key(id, LOCATOR_OBJECT))?;
    let source = crate::chunks::Source {
        remote,
        locator: locator.as_ref(),
        missing: &missing,
    };
    timings.metadata_s = lap();
    let down = crate::chunks::download(&source, store, &writer, &recipes, parallel, progress)?;
    let (total, fetched_chunks) = (down.total, down.fetched);
    timings.fetch_s = lap();
    match store.recipes(id) {
        // Pulled before: the same contents are fine, other contents are not replaced.
        Ok(have) if have == recipes => drop(writer),
        Ok(_) => {
            return Err(TransferError::StoreDiffers {
                id: id.to_owned(),
                store: store.root().to_path_buf(),
                dir: out.to_path_buf(),
                file: "its record".to_owned(),
            })
        }
        Err(StoreError::UnknownSnapshot { .. }) => writer.commit(id, &recipes)?,
        Err(e) => return Err(e.into()),
    }
    timings.commit_s = lap();

    progress(Progress {
        phase: Phase::Materialising,
        done: 0,
        total: 1,
    });
    let fetched = Fetched {
        recipes: &recipes,
        manifest: &manifest,
        manifest_bytes: &manifest_bytes,
        mac: mac.as_deref(),
    };
    let (materialise_s, verify_s) = materialise(store, &fetched, trust, out)?;
    timings.materialise_s = materialise_s;
    timings.verify_s = verify_s;
    Ok(PullReport {
        id: id.to_owned(),
        bucket,
        out: out.to_path_buf(),
        chunks: total,
        fetched: fetched_chunks,
        local: total - fetched_chunks,
        ranges: down.ranges,
        loose: down.loose,
        traffic: remote.traffic(),
        timings,
    })
}

/// The record's recipes, if it is a valid record of `id` that has a recipe for every file of
/// the manifest, with the manifest's size and hash.
fn check_record(bytes: &[u8], id: &str, manifest: &Manifest) -> Result<Vec<Recipe>, String> {
    let record: RemoteRecord = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    if record.format != RECORD_FORMAT {
        return Err(format!(
            "record format {}, this torpor reads {RECORD_FORMAT}",
            record.format
        ));
    }
    if record.snapshot != id {
        return Err(format!("it names snapshot {:?}", record.snapshot));
    }
    for r in &record.recipes {
        r.validate().map_err(|e| e.to_string())?;
    }
    for f in &manifest.files {
        let same = record
            .recipes
            .iter()
            .any(|r| r.name == f.path && r.size == f.size && r.blake3 == f.blake3);
        if !same {
            return Err(format!("no recipe matches the manifest's {}", f.path));
        }
    }
    Ok(record.recipes)
}

/// What came from the bucket besides the chunks.
struct Fetched<'a> {
    recipes: &'a [Recipe],
    manifest: &'a Manifest,
    manifest_bytes: &'a [u8],
    mac: Option<&'a [u8]>,
}

/// Writes the snapshot directory aside, authenticates and verifies it, then renames it to `out`.
/// Returns the seconds spent writing and verifying.
fn materialise(
    store: &ChunkStore,
    fetched: &Fetched<'_>,
    trust: Trust<'_>,
    out: &Path,
) -> Result<(f64, f64), TransferError> {
    let Fetched {
        recipes,
        manifest,
        manifest_bytes,
        mac,
    } = *fetched;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot".to_owned());
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let aside = parent.join(format!(".{name}.pull-{}", std::process::id()));
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| TransferError::Io { op, path, source }
    };
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&aside)
        .map_err(io("create", &aside))?;
    let result = (|| {
        let start = Instant::now();
        let files: Vec<Recipe> = recipes
            .iter()
            .filter(|r| manifest.files.iter().any(|f| f.path == r.name))
            .cloned()
            .collect();
        store.materialise_all(&files, &aside)?;
        if let Some(mac) = mac {
            fs::write(aside.join(MAC_FILE), mac).map_err(io("write", &aside.join(MAC_FILE)))?;
        }
        let manifest_path = aside.join(MANIFEST_FILE);
        fs::write(&manifest_path, manifest_bytes).map_err(io("write", &manifest_path))?;
        let written = Instant::now();
        let snapshot = Snapshot::open(&aside)?;
        snapshot.authenticate(trust)?;
        snapshot.verify()?;
        fs::rename(&aside, out).map_err(io("rename", out))?;
        Ok((
            written.duration_since(start).as_secs_f64(),
            written.elapsed().as_secs_f64(),
        ))
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&aside);
    }
    result
}
