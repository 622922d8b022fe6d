//! `pull`: a snapshot from the bucket into the local chunk store and a snapshot directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use std::sync::Mutex;

use torpor_image::store::{ChunkRef, ChunkStore, Commit, Pending, Recipe, StoreError};
use torpor_image::{Manifest, SnapshotKey, Trust, MAC_FILE, MANIFEST_FILE};

use crate::chunks::lock;
use crate::client::{Remote, Traffic};
use crate::error::TransferError;
pub use crate::inline_files::InlineStats;
use crate::inline_files::{Fetched, InlineFiles};
use crate::{
    snapshot_key, Phase, Progress, RemoteRecord, SealedRecordReport, LOCATOR_OBJECT,
    MAX_RECORD_BYTES, RECORD_FORMAT, RECORD_OBJECT,
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
/// The chunks of the files and of a sealed segment record travel in one pipeline, and the
/// files are written and verified while the rest of it runs, so `files_fetch_s`,
/// `segments_fetch_s`, `materialise_s` and `verify_s` overlap each other and `fetch_s`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PullTimings {
    /// The manifest, the record, the MAC, the locators (and the sealed record's): small GETs.
    pub metadata_s: f64,
    /// All the chunks: GETs, decoding, checking each against its id, writing them into the
    /// store (the pipeline, from its start to its last chunk).
    pub fetch_s: f64,
    /// From the pipeline's start until the files' chunks were all in the store.
    pub files_fetch_s: f64,
    /// From the pipeline's start until the sealed record's chunks were all in the store (0:
    /// no sealed record pulled).
    pub segments_fetch_s: f64,
    /// After the pipeline, waiting for the files to be written and verified, if they were not
    /// yet.
    pub materialise_wait_s: f64,
    /// The store's commit: one syncfs, then the records.
    pub commit_s: f64,
    /// Once the files' chunks are in (the pipeline wrote each into the directory as it
    /// came): the chunks the store had already written from it, the MAC and the manifest.
    pub materialise_s: f64,
    /// Authenticating the manifest and hashing every file of the directory against it.
    pub verify_s: f64,
    /// From the pull's start until the pipeline's: `metadata_s`, then the store's writer, the
    /// directory's files made and the sink's start.
    pub pipeline_start_s: f64,
    /// From the pull's start until it returns.
    pub total_s: f64,
    /// Where the pipeline's threads spent `fetch_s`.
    pub pipeline: crate::chunks::PipelineTimes,
    /// How the files' bytes went into the directory.
    pub files_written: InlineStats,
}

/// A split snapshot's sealed segment record to pull with a snapshot's files
/// ([`pull_snapshot`]): its id, and the key that must have sealed it.
#[derive(Debug, Clone, Copy)]
pub struct SealedPart<'a> {
    pub id: &'a str,
    pub key: &'a SnapshotKey,
}

/// Takes a pulled split snapshot's segments as the pull checks them, to have them in memory
/// for the first restore instead of read back out of the store (torpord's host cache). Errors
/// are its own: a sink that cannot keep something only keeps less; the pull goes on.
pub trait SealedSink: Sync {
    /// The sealed record's recipes (its MAC checked), before any of its chunks.
    fn begin(&self, recipes: &[Recipe]);
    /// One fetched chunk of the sealed record, checked against its id: its raw bytes (called
    /// from the pipeline's writer threads, each chunk once).
    fn chunk(&self, c: &ChunkRef, raw: &[u8]);
}

/// What [`pull_snapshot`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SnapshotPull {
    /// The files (and the whole pull's traffic and timings).
    pub files: PullReport,
    /// The sealed record, when one was asked for and the bucket has it.
    pub sealed: Option<SealedRecordReport>,
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
    pull_snapshot(remote, store, id, out, trust, None, parallel, progress).map(|p| p.files)
}

/// What came from the bucket besides the chunks: the files' side.
struct FilesMeta {
    manifest: Manifest,
    manifest_bytes: Vec<u8>,
    recipes: Vec<Recipe>,
    mac: Option<Vec<u8>>,
    locator: Option<crate::chunks::Locator>,
}

/// [`pull`], and with `sealed` a split snapshot's sealed segment record too (as
/// [`pull_sealed_record`](crate::pull_sealed_record) would; none in the bucket is no error),
/// in one pipeline and one commit:
///
/// 1. the small objects: the files' manifest, record, MAC and locator, the sealed record (its
///    MAC checked with its key) and its locator;
/// 2. every chunk the store lacks, of both, through one pipeline of `parallel` fetchers and
///    writers ([`crate::chunks::download_sets`]), the files' first; the store's writer starts
///    each chunk's disk write as it places it
///    ([`StoreWriter::write_back_early`](torpor_image::store::StoreWriter::write_back_early)),
///    so the disk works while the link does; each of the files' chunks is also written into
///    the snapshot directory aside, wherever the files use it, as it comes;
/// 3. as soon as the files' chunks are in, beside the rest of the pipeline: the chunks the
///    store had already written into the directory, which is authenticated and verified;
/// 4. one commit for both records (one syncfs: every chunk on disk before either record), then
///    the directory renamed to `out`.
///
/// On failure nothing is committed, `out` is not created and nothing is left aside; but for an
/// error writing the sealed record after the files' one (each record is whole or absent, the
/// files' is committed first): the files' record without the segments' is only a cache of
/// chunks, which a caller that bounds its store releases as such.
#[allow(clippy::too_many_arguments)]
pub fn pull_snapshot(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    out: &Path,
    trust: Trust<'_>,
    sealed: Option<SealedPart<'_>>,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SnapshotPull, TransferError> {
    let mode = Mode {
        deferred: false,
        early_write_back: true,
        hold_bytes: 0,
    };
    pull_snapshot_with(
        remote, store, id, out, trust, sealed, parallel, progress, mode, None,
    )
    .map(|(pull, _)| pull)
}

/// [`pull_snapshot`] that answers before the disk: once every chunk is fetched, checked
/// against its id and written (into the page cache), and the directory written and verified,
/// the records are committed without a syncfs
/// ([`StoreWriter::commit_many_deferred`](torpor_image::store::StoreWriter::commit_many_deferred))
/// and `out` renamed into place; the returned [`Pending`] makes them durable
/// ([`Pending::finish`], one syncfs: run it in the background). Readers find the records at
/// once. Until it finishes, a dead process leaves the records pending, and
/// [`ChunkStore::settle`] decides at the next start (docs/objstore.md, "Durability after the
/// answer"). `commit_s` is then the records' writing alone. `sink` gets the sealed record's
/// segments as they come ([`SealedSink`]).
#[allow(clippy::too_many_arguments)]
pub fn pull_snapshot_deferred(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    out: &Path,
    trust: Trust<'_>,
    sealed: Option<SealedPart<'_>>,
    parallel: usize,
    after: AfterAnswer,
    progress: &(dyn Fn(Progress) + Sync),
    sink: Option<&dyn SealedSink>,
) -> Result<(SnapshotPull, Option<Pending>), TransferError> {
    let mode = Mode {
        deferred: true,
        early_write_back: after.early_write_back,
        hold_bytes: after.hold_bytes,
    };
    pull_snapshot_with(
        remote, store, id, out, trust, sealed, parallel, progress, mode, sink,
    )
}

/// What [`pull_snapshot_deferred`] leaves until after its answer, besides the syncfs.
#[derive(Debug, Clone, Copy, Default)]
pub struct AfterAnswer {
    /// false: the page cache holds the chunk files until [`Pending::finish`]'s syncfs; true:
    /// each one's disk write starts as it is written (as [`pull_snapshot`] does).
    pub early_write_back: bool,
    /// Up to this many bytes of fetched chunk files are held in memory, checked, instead of
    /// written into the store before the answer
    /// ([`StoreWriter::hold_up_to`](torpor_image::store::StoreWriter::hold_up_to)):
    /// [`Pending::finish`] writes them. Readers of the store in this process find them at once
    /// (the directory and the segments need nothing written to be restored). 0: every chunk
    /// written before the answer.
    pub hold_bytes: u64,
}

/// How [`pull_snapshot_with`] makes its chunks and records durable.
#[derive(Debug, Clone, Copy)]
struct Mode {
    /// The records committed before their syncfs, which the caller runs ([`Pending`]).
    deferred: bool,
    /// Each chunk's disk write started as it is stored.
    early_write_back: bool,
    /// Chunk files held in memory until [`Pending::finish`] (only with `deferred`).
    hold_bytes: u64,
}

#[allow(clippy::too_many_arguments)]
fn pull_snapshot_with(
    remote: &Remote,
    store: &ChunkStore,
    id: &str,
    out: &Path,
    trust: Trust<'_>,
    sealed: Option<SealedPart<'_>>,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
    mode: Mode,
    sink: Option<&dyn SealedSink>,
) -> Result<(SnapshotPull, Option<Pending>), TransferError> {
    torpor_image::store::check_snapshot_id(id)?;
    if let Some(part) = sealed {
        torpor_image::store::check_snapshot_id(part.id)?;
    }
    let mut timings = PullTimings::default();
    let began = Instant::now();
    if fs::symlink_metadata(out).is_ok() {
        return Err(TransferError::OutExists {
            path: out.to_path_buf(),
        });
    }
    let bucket = remote.bucket().to_owned();
    let missing = |of: &str, key: &str| TransferError::MissingObject {
        id: of.to_owned(),
        bucket: bucket.clone(),
        key: remote.full_key(key),
    };
    // The two records' small objects are independent round trips to the bucket: at once.
    let (files, sealed_meta) = at_once(
        || files_meta(remote, id, out),
        || match sealed {
            Some(part) => crate::sealed::fetch_sealed_record(remote, part.id, part.key),
            None => Ok(None),
        },
    );
    let (files, sealed_meta) = (files?, sealed_meta?);
    timings.metadata_s = began.elapsed().as_secs_f64();

    // Chunks: only those the store lacks. The writer's shared lock keeps a GC from deleting
    // the ones already here (or fetched) before the records that reference them are committed.
    let writer = store.writer()?;
    let writer = if mode.early_write_back {
        writer.write_back_early()
    } else {
        writer
    };
    let writer = if mode.deferred {
        writer.hold_up_to(mode.hold_bytes)
    } else {
        writer
    };
    let files_missing = |key: &str| missing(id, key);
    let sealed_id = sealed.map_or("", |p| p.id);
    let sealed_missing = |key: &str| missing(sealed_id, key);
    let mut sets = vec![crate::chunks::Wanted {
        source: crate::chunks::Source {
            remote,
            locator: files.locator.as_ref(),
            missing: &files_missing,
        },
        recipes: &files.recipes,
    }];
    if let Some(m) = &sealed_meta {
        sets.push(crate::chunks::Wanted {
            source: crate::chunks::Source {
                remote,
                locator: m.locator.as_ref(),
                missing: &sealed_missing,
            },
            recipes: &m.recipes,
        });
    }
    let fetched = Fetched {
        manifest_bytes: &files.manifest_bytes,
        mac: files.mac.as_deref(),
    };
    // The snapshot directory, written aside as the files' chunks arrive.
    let inline = InlineFiles::create(out, &files.recipes, &files.manifest)?;
    if let (Some(sink), Some(m)) = (sink, &sealed_meta) {
        sink.begin(&m.recipes);
    }
    let raw = |set: usize, c: &ChunkRef, bytes: &[u8]| {
        if set == 0 {
            inline.write(c, bytes)
        } else {
            if let Some(sink) = sink {
                sink.chunk(c, bytes);
            }
            Ok(())
        }
    };
    let pipeline = Instant::now();
    timings.pipeline_start_s = began.elapsed().as_secs_f64();
    let landed: Mutex<[f64; 2]> = Mutex::new([0.0; 2]);
    let (files_in, files_in_rx) = std::sync::mpsc::channel::<()>();
    let files_in = Mutex::new(Some(files_in));
    let (down, aside) = std::thread::scope(|threads| {
        // The directory, as soon as the files' chunks are in (nothing, if they never are).
        let (fetched, inline) = (&fetched, &inline);
        let materialiser = threads.spawn(move || {
            files_in_rx.recv().ok()?;
            progress(Progress {
                phase: Phase::Materialising,
                done: 0,
                total: 1,
            });
            Some(inline.finish(store, fetched, trust))
        });
        let done = |set: usize| {
            if let Some(t) = lock(&landed).get_mut(set) {
                *t = pipeline.elapsed().as_secs_f64();
            }
            if set == 0 {
                if let Some(tx) = lock(&files_in).take() {
                    let _ = tx.send(());
                }
            }
        };
        let down =
            crate::chunks::download_sets(&sets, store, &writer, parallel, progress, &done, &raw);
        // Never sent on an error: the materialiser then ends without finishing the directory.
        drop(lock(&files_in).take());
        timings.fetch_s = pipeline.elapsed().as_secs_f64();
        let waited = Instant::now();
        let aside = materialiser.join().unwrap_or_else(|_| {
            Some(Err(TransferError::Io {
                op: "materialise",
                path: out.to_path_buf(),
                source: std::io::Error::other("the thread writing the snapshot panicked"),
            }))
        });
        timings.materialise_wait_s = waited.elapsed().as_secs_f64();
        (down, aside)
    });
    let down = down.map(|(down, pipeline)| {
        timings.pipeline = pipeline;
        down
    });
    let [files_landed, segments_landed] = *lock(&landed);
    timings.files_fetch_s = files_landed;
    timings.segments_fetch_s = segments_landed;
    let (down, aside) = match (down, aside) {
        (Ok(down), Some(Ok(aside))) => (down, aside),
        (Err(e), _) | (Ok(_), Some(Err(e))) => {
            inline.remove();
            return Err(e);
        }
        (Ok(_), None) => {
            inline.remove();
            return Err(TransferError::Io {
                op: "materialise",
                path: out.to_path_buf(),
                source: std::io::Error::other("the files' chunks were never all stored"),
            });
        }
    };
    timings.materialise_s = aside.materialise_s;
    timings.verify_s = aside.verify_s;
    timings.files_written = inline.stats();

    // One commit for both records. Pulled before: the same contents are fine, other contents
    // are not replaced.
    let committed = Instant::now();
    let differs = |file: &str| TransferError::StoreDiffers {
        id: id.to_owned(),
        store: store.root().to_path_buf(),
        dir: out.to_path_buf(),
        file: file.to_owned(),
    };
    let mut commits = Vec::new();
    let plan = (|| {
        match store.recipes(id) {
            Ok(have) if have == files.recipes => {}
            Ok(_) => return Err(differs("its record")),
            Err(StoreError::UnknownSnapshot { .. }) => commits.push(Commit {
                id,
                recipes: &files.recipes,
                key: None,
            }),
            Err(e) => return Err(e.into()),
        }
        if let (Some(part), Some(m)) = (sealed, &sealed_meta) {
            match store.sealed_recipes(part.id, part.key) {
                Ok(have) if have == m.recipes => {}
                Ok(_) => {
                    return Err(TransferError::StoreDiffers {
                        id: part.id.to_owned(),
                        store: store.root().to_path_buf(),
                        dir: store.root().to_path_buf(),
                        file: "its sealed record".to_owned(),
                    })
                }
                Err(StoreError::UnknownSnapshot { .. }) => commits.push(Commit {
                    id: part.id,
                    recipes: &m.recipes,
                    key: Some(part.key),
                }),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    })();
    let result = plan.and_then(|()| {
        if commits.is_empty() {
            drop(writer);
            Ok(None)
        } else if mode.deferred {
            writer
                .commit_many_deferred(&commits)
                .map(Some)
                .map_err(TransferError::from)
        } else {
            writer
                .commit_many(&commits)
                .map(|()| None)
                .map_err(TransferError::from)
        }
    });
    let pending = match result {
        Ok(p) => p,
        Err(e) => {
            aside.remove();
            return Err(e);
        }
    };
    timings.commit_s = committed.elapsed().as_secs_f64();
    aside.rename_to(out)?;
    timings.total_s = began.elapsed().as_secs_f64();
    let total = down.first().map_or(0, |d| d.total);
    let fetched_chunks = down.first().map_or(0, |d| d.fetched);
    let files_down = down.first().copied().unwrap_or_default();
    let sealed_report = sealed_meta
        .as_ref()
        .and(down.get(1))
        .map(|d| SealedRecordReport {
            chunks: d.total,
            moved: d.fetched,
        });
    let pull = SnapshotPull {
        files: PullReport {
            id: id.to_owned(),
            bucket,
            out: out.to_path_buf(),
            chunks: total,
            fetched: fetched_chunks,
            local: total - fetched_chunks,
            ranges: files_down.ranges,
            loose: files_down.loose,
            traffic: remote.traffic(),
            timings,
        },
        sealed: sealed_report,
    };
    Ok((pull, pending))
}

/// The files' small objects: manifest, record (its recipes checked against the manifest), MAC,
/// locator. Fetched at once, checked in that order (the first missing or bad one is the error).
fn files_meta(remote: &Remote, id: &str, out: &Path) -> Result<FilesMeta, TransferError> {
    let bucket = remote.bucket().to_owned();
    let manifest_key = snapshot_key(id, MANIFEST_FILE);
    let record_key = snapshot_key(id, RECORD_OBJECT);
    let (mac_key, locator_key) = (snapshot_key(id, MAC_FILE), snapshot_key(id, LOCATOR_OBJECT));
    let (manifest_bytes, record_bytes, mac, locator) = std::thread::scope(|s| {
        let record = s.spawn(|| remote.get(&record_key, MAX_RECORD_BYTES));
        let mac = s.spawn(|| remote.get(&mac_key, 64 << 10));
        let locator = s.spawn(|| crate::chunks::fetch_locator(remote, &locator_key));
        let manifest = remote.get(&manifest_key, torpor_image::MAX_MANIFEST_BYTES);
        (manifest, joined(record), joined(mac), joined(locator))
    });
    let Some(manifest_bytes) = manifest_bytes? else {
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
    let record_bytes = record_bytes?.ok_or_else(|| TransferError::MissingObject {
        id: id.to_owned(),
        bucket: bucket.clone(),
        key: remote.full_key(&record_key),
    })?;
    let recipes = check_record(&record_bytes, id, &manifest).map_err(|reason| {
        TransferError::CorruptObject {
            bucket: bucket.clone(),
            key: remote.full_key(&record_key),
            reason,
        }
    })?;
    Ok(FilesMeta {
        manifest,
        manifest_bytes,
        recipes,
        mac: mac?,
        locator: locator?,
    })
}

/// `a()` and `b()` side by side, `b` on a thread of its own: for requests to the bucket that
/// do not depend on each other, each a round trip (on the H100 the pull's six small GETs one
/// after the other took 0.10 s on loopback; more to a remote bucket).
pub(crate) fn at_once<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    std::thread::scope(|s| {
        let b = s.spawn(b);
        (a(), joined(b))
    })
}

/// A scoped thread's result; its panic goes on in the caller.
fn joined<T>(handle: std::thread::ScopedJoinHandle<'_, T>) -> T {
    handle
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
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

/// An I/O error's mapping, naming the operation and the path.
pub(crate) fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TransferError {
    let path = path.to_path_buf();
    move |source| TransferError::Io { op, path, source }
}
