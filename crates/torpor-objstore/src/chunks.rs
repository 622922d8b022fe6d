//! Moving the chunks of a set of recipes between the local chunk store and the bucket: what a
//! snapshot's files and a split snapshot's segment record both need.
//!
//! New chunks go up in packs (`packs/<hash>.pack`, chunk files concatenated, ~32 MiB each) with
//! an index per pack (`packs/<hash>.idx`); a push also writes a locator for its snapshot (where
//! in which pack each of its chunks lies). A pull reads the locator and fetches the chunks it
//! lacks in coalesced ranged GETs; chunks the locator does not place are loose objects
//! (`chunks/<hex>`, what pushes before packs wrote) and are fetched one by one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use torpor_image::store::{ChunkId, ChunkRef, ChunkStore, Recipe, StoreWriter};

use crate::client::Remote;
use crate::error::TransferError;
use crate::fetch_buffers::FetchBuffers;
use crate::{chunk_key, for_each_parallel, Phase, Progress};

/// A pack is closed once its chunks' raw lengths reach this.
pub(crate) const PACK_TARGET: u64 = 32 << 20;
/// Ranges of one pack closer than this are fetched as one (the gap is read and dropped): a
/// request costs more than this many bytes on any link worth the name.
const COALESCE_GAP: u64 = 1 << 20;
/// Format of pack indexes and locators.
const PACK_FORMAT: u32 = 1;
/// Pack indexes and locators larger than this are refused.
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Where chunks lie in one pack: (chunk, offset, length of its chunk file).
pub(crate) type Placement = Vec<(ChunkId, u64, u64)>;

/// `packs/<name>.idx`: the chunks of pack `packs/<name>.pack`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct PackIndex {
    format: u32,
    pack: String,
    size: u64,
    chunks: Placement,
}

/// A snapshot's locator (`snapshots/<id>/packs.json`): for each pack holding some of its
/// chunks, the pack's size and where they lie in it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct Locator {
    format: u32,
    packs: BTreeMap<String, PackPlacement>,
}

#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct PackPlacement {
    size: u64,
    chunks: Placement,
}

impl Locator {
    pub(crate) fn to_json(&self) -> Vec<u8> {
        // Only strings and integers: serialising cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses a locator; `Err` says what is wrong with it.
    pub(crate) fn from_json(bytes: &[u8]) -> Result<Locator, String> {
        let locator: Locator = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if locator.format != PACK_FORMAT {
            return Err(format!(
                "locator format {}, this torpor reads {PACK_FORMAT}",
                locator.format
            ));
        }
        for (name, p) in &locator.packs {
            check_pack_name(name)?;
            for (id, offset, len) in &p.chunks {
                match offset.checked_add(*len) {
                    Some(end) if end <= p.size => {}
                    _ => return Err(format!("chunk {id} lies past the end of pack {name}")),
                }
            }
        }
        Ok(locator)
    }

    fn chunks(&self) -> u64 {
        self.packs.values().map(|p| p.chunks.len() as u64).sum()
    }
}

fn pack_key(name: &str) -> String {
    format!("packs/{name}.pack")
}

fn index_key(name: &str) -> String {
    format!("packs/{name}.idx")
}

/// Pack names are BLAKE3 hashes of the pack: 64 lowercase hex digits, nothing that could
/// reach another key.
fn check_pack_name(name: &str) -> Result<(), String> {
    if ChunkId::from_hex(name).is_some() {
        Ok(())
    } else {
        Err(format!("pack name {name:?} is not 64 hex digits"))
    }
}

/// The largest chunk file a chunk of `len` raw bytes can have: header, and a body of at most
/// the raw length plus zstd's worst-case growth.
fn max_chunk_file(len: u64) -> u64 {
    16 + len + len / 64 + 1024
}

/// Each distinct chunk of `recipes` once, in the order the recipes first use them (a file's
/// chunks stay together in a pack), with the name of a file that holds it (for errors).
pub(crate) fn distinct(recipes: &[Recipe]) -> Vec<(ChunkRef, &str)> {
    let mut seen: HashSet<ChunkId> = HashSet::new();
    let mut out = Vec::new();
    for r in recipes {
        for c in &r.chunks {
            if seen.insert(c.id) {
                out.push((*c, r.name.as_str()));
            }
        }
    }
    out
}

/// What the bucket holds already: every chunk of every pack (from the pack indexes) and the
/// loose chunk objects.
struct BucketChunks {
    packed: HashMap<ChunkId, (String, u64, u64, u64)>,
    loose: HashSet<ChunkId>,
}

fn bucket_chunks(remote: &Remote, parallel: usize) -> Result<BucketChunks, TransferError> {
    let indexes: Vec<String> = remote
        .list("packs/")?
        .into_iter()
        .filter_map(|(key, _)| {
            let name = key.strip_prefix("packs/")?.strip_suffix(".idx")?;
            check_pack_name(name).ok()?;
            Some(name.to_owned())
        })
        .collect();
    let packed = Mutex::new(HashMap::new());
    for_each_parallel(&indexes, parallel, |name| {
        let key = index_key(name);
        // An index whose pack is gone or that does not parse is ignored: its chunks are
        // simply uploaded again.
        let Some(bytes) = remote.get(&key, MAX_INDEX_BYTES)? else {
            return Ok(());
        };
        let Ok(index) = serde_json::from_slice::<PackIndex>(&bytes) else {
            return Ok(());
        };
        if index.format != PACK_FORMAT || index.pack != *name {
            return Ok(());
        }
        let mut map = packed.lock().unwrap_or_else(|p| p.into_inner());
        for (id, offset, len) in index.chunks {
            map.entry(id)
                .or_insert((name.clone(), index.size, offset, len));
        }
        Ok::<(), TransferError>(())
    })?;
    let loose = remote
        .list("chunks/")?
        .into_iter()
        .filter_map(|(key, _)| ChunkId::from_hex(key.strip_prefix("chunks/")?))
        .collect();
    Ok(BucketChunks {
        packed: packed.into_inner().unwrap_or_else(|p| p.into_inner()),
        loose,
    })
}

/// What an upload did.
pub(crate) struct Uploaded {
    /// Distinct chunks of the recipes.
    pub total: u64,
    /// Chunks uploaded (in new packs).
    pub uploaded: u64,
    /// Where the recipes' packed chunks lie (the loose ones are not in it).
    pub locator: Locator,
}

/// Uploads the chunks of `recipes` the bucket lacks (in no pack and not loose) from `store`,
/// in new packs, each pack before its index.
pub(crate) fn upload(
    remote: &Remote,
    store: &ChunkStore,
    recipes: &[Recipe],
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Uploaded, TransferError> {
    let chunks = distinct(recipes);
    let total = chunks.len() as u64;
    let have = bucket_chunks(remote, parallel)?;
    let mut locator = Locator {
        format: PACK_FORMAT,
        packs: BTreeMap::new(),
    };
    let mut plans: Vec<Vec<(ChunkRef, &str)>> = Vec::new();
    let mut open: Vec<(ChunkRef, &str)> = Vec::new();
    let mut open_len = 0u64;
    let mut present = 0u64;
    for (c, file) in chunks {
        if let Some((pack, size, offset, len)) = have.packed.get(&c.id) {
            let p = locator.packs.entry(pack.clone()).or_default();
            p.size = *size;
            p.chunks.push((c.id, *offset, *len));
            present += 1;
        } else if have.loose.contains(&c.id) {
            present += 1;
        } else {
            open.push((c, file));
            open_len += c.len;
            if open_len >= PACK_TARGET {
                plans.push(std::mem::take(&mut open));
                open_len = 0;
            }
        }
    }
    if !open.is_empty() {
        plans.push(open);
    }
    let ticker = Ticker::start(present, total, progress);
    let made = Mutex::new(Vec::new());
    for_each_parallel(&plans, parallel, |plan| {
        let mut bytes = Vec::new();
        let mut placed = Vec::with_capacity(plan.len());
        for (c, file) in plan {
            let chunk = store.chunk_file(c, file)?;
            placed.push((c.id, bytes.len() as u64, chunk.len() as u64));
            bytes.extend_from_slice(&chunk);
        }
        let name = blake3::hash(&bytes).to_hex().to_string();
        let index = PackIndex {
            format: PACK_FORMAT,
            pack: name.clone(),
            size: bytes.len() as u64,
            chunks: placed,
        };
        remote.put(&pack_key(&name), &bytes)?;
        // Only strings and integers: serialising cannot fail.
        remote.put(
            &index_key(&name),
            &serde_json::to_vec(&index).unwrap_or_default(),
        )?;
        ticker.tick_n(plan.len() as u64);
        made.lock().unwrap_or_else(|p| p.into_inner()).push(index);
        Ok::<(), TransferError>(())
    })?;
    let mut uploaded = 0;
    for index in made.into_inner().unwrap_or_else(|p| p.into_inner()) {
        uploaded += index.chunks.len() as u64;
        let p = locator.packs.entry(index.pack).or_default();
        p.size = index.size;
        p.chunks.extend(index.chunks);
    }
    Ok(Uploaded {
        total,
        uploaded,
        locator,
    })
}

/// Chunks with their offset and length in a pack.
type InPack = Vec<(ChunkRef, u64, u64)>;

/// One ranged GET: bytes `start..start + len` of a pack and the chunks that lie in them.
#[derive(Debug)]
struct RangeJob {
    pack: String,
    start: u64,
    len: u64,
    chunks: InPack,
}

/// What a download fetched.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Downloaded {
    /// Distinct chunks of the recipes.
    pub total: u64,
    /// Chunks fetched (packed and loose).
    pub fetched: u64,
    /// Of those, fetched as loose objects (one GET each).
    pub loose: u64,
    /// Ranged GETs of packs.
    pub ranges: u64,
}

/// Where the pipeline's threads spent their time, each figure summed over its threads, in
/// seconds: fetchers waiting on a full queue mean the writers are the bound, writers waiting
/// on an empty one mean the GETs are; `check_s` against `place_s` then splits the writers'
/// work between the CPU (decoding, hashing) and the file system.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PipelineTimes {
    /// Fetcher threads (GETs in flight at most).
    pub fetchers: u64,
    /// Writer threads.
    pub writers: u64,
    /// In GETs: the request and its body read into memory.
    pub get_s: f64,
    /// Fetchers waiting for room in the queue to the writers.
    pub queue_full_s: f64,
    /// Writers waiting for a fetched range.
    pub queue_empty_s: f64,
    /// Writers checking chunks against their ids (decoding, hashing).
    pub check_s: f64,
    /// Writers placing checked chunks in the store (written, renamed).
    pub place_s: f64,
    /// Of `place_s`, the chunks' raw bytes handed on past the store: the files' chunks
    /// written into the snapshot directory (the first set's sink), the others' (a sealed
    /// record's segments: into the restore server's host cache).
    pub hand_files_s: f64,
    pub hand_others_s: f64,
    /// Range buffers made ahead of the fetchers, faulted in (fetch_buffers.rs): as many as
    /// the ranges when the store holds every buffer, few when they go round.
    pub buffers_made: u64,
}

/// [`PipelineTimes`] as the threads add to it.
#[derive(Default)]
struct PipelineClock {
    get: AtomicU64,
    queue_full: AtomicU64,
    queue_empty: AtomicU64,
    check: AtomicU64,
    place: AtomicU64,
    /// The first set's sink, the others'.
    hand: [AtomicU64; 2],
}

impl PipelineClock {
    fn add(counter: &AtomicU64, d: std::time::Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
    }

    fn times(&self, fetchers: usize, writers: usize) -> PipelineTimes {
        let s = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / 1e9;
        PipelineTimes {
            fetchers: fetchers as u64,
            writers: writers as u64,
            get_s: s(&self.get),
            queue_full_s: s(&self.queue_full),
            queue_empty_s: s(&self.queue_empty),
            check_s: s(&self.check),
            place_s: s(&self.place),
            hand_files_s: s(&self.hand[0]),
            hand_others_s: s(&self.hand[1]),
            buffers_made: 0,
        }
    }
}

/// Where a download's chunks come from: the bucket, the snapshot's locator (`None`: a push
/// before packs, every chunk loose), and the error naming an absent object.
pub(crate) struct Source<'a> {
    pub remote: &'a Remote,
    pub locator: Option<&'a Locator>,
    pub missing: &'a (dyn Fn(&str) -> TransferError + Sync),
}

/// Fetches into `store` (through `writer`, whose lock keeps a GC off them until the commit) the
/// chunks of `recipes` it lacks, each checked against its id: those the locator places in
/// ranged GETs of their packs, the others as loose objects ([`download_sets`] with one set).
pub(crate) fn download(
    source: &Source<'_>,
    store: &ChunkStore,
    writer: &StoreWriter<'_>,
    recipes: &[Recipe],
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Downloaded, TransferError> {
    let sets = [Wanted {
        source: Source { ..*source },
        recipes,
    }];
    let (down, _) = download_sets(
        &sets,
        store,
        writer,
        parallel,
        progress,
        &|_| {},
        &|_, _, _| Ok(()),
    )?;
    Ok(down.into_iter().next().unwrap_or_default())
}

/// What one writer hands a checked chunk's raw bytes to: (chunk, bytes).
type ChunkSink<'a> = dyn Fn(&ChunkRef, &[u8]) -> Result<(), TransferError> + Sync + 'a;

/// What [`download_sets`] hands each fetched chunk's raw bytes to: (set, chunk, bytes).
pub(crate) type RawSink<'a> =
    dyn Fn(usize, &ChunkRef, &[u8]) -> Result<(), TransferError> + Sync + 'a;

/// One set of recipes to download, from its own source: a snapshot's files, or a split
/// snapshot's sealed segment record, each with its own locator.
pub(crate) struct Wanted<'a> {
    pub source: Source<'a>,
    pub recipes: &'a [Recipe],
}

/// A job of the pipeline: one ranged GET, or one loose chunk.
enum Job {
    Range(RangeJob),
    Loose(ChunkRef),
}

/// Chunk files in flight between the fetchers and the writers, per fetcher: at most this many
/// fetched ranges (each at most the remote's `range_bytes`) wait for a writer, per request in flight.
const QUEUED_PER_FETCHER: usize = 1;

/// Fetches into `store` (through `writer`, whose lock keeps a GC off them until the commit) the
/// chunks of every set's recipes it lacks, each chunk once whichever sets list it, each checked
/// against its id before it is stored.
///
/// A pipeline: `parallel` fetchers run the GETs (the sets' ranged GETs of packs, then loose
/// chunks, set by set in the order given) and hand what they fetched through a bounded channel
/// to the writers (as many as the fetchers or the cores, whichever is more), which decode and
/// hash every chunk and place it in the store. So the GETs go on while earlier ranges are checked and written, and the fetched bytes
/// waiting for a writer are bounded (`parallel` × [`QUEUED_PER_FETCHER`] ranges of at most
/// the remote's [`range_bytes`](crate::Remote::range_bytes)). With a writer made by
/// [`StoreWriter::write_back_early`](torpor_image::store::StoreWriter::write_back_early) the
/// disk writes meanwhile too.
///
/// `raw(i, chunk, bytes)` is given each fetched chunk of set `i` once it is checked and stored,
/// with its raw bytes (a writer thread's; an error fails the download like a store error).
/// `done(i)` is called (from a writer thread) once every chunk of set `i` that this call
/// fetches is stored; for the first set that means all of its chunks are in the store (a set's
/// chunks that an earlier set also lists are that set's jobs). The first error stops the
/// fetchers, the writers store what was fetched before it, and it is returned: the chunks
/// stored stay, verified and unreferenced (the caller does not commit), for the next pull.
pub(crate) fn download_sets(
    sets: &[Wanted<'_>],
    store: &ChunkStore,
    writer: &StoreWriter<'_>,
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
    done: &(dyn Fn(usize) + Sync),
    raw: &RawSink<'_>,
) -> Result<(Vec<Downloaded>, PipelineTimes), TransferError> {
    let mut claimed: HashSet<ChunkId> = HashSet::new();
    let mut every: HashSet<ChunkId> = HashSet::new();
    let mut jobs: Vec<(usize, Job)> = Vec::new();
    let mut downs = Vec::with_capacity(sets.len());
    for (i, set) in sets.iter().enumerate() {
        let chunks = distinct(set.recipes);
        let total = chunks.len() as u64;
        every.extend(chunks.iter().map(|(c, _)| c.id));
        let wanted: Vec<ChunkRef> = chunks
            .into_iter()
            .map(|(c, _)| c)
            .filter(|c| !store.contains(&c.id) && claimed.insert(c.id))
            .collect();
        let remote = set.source.remote;
        let (ranges, loose) = plan_ranges(&wanted, set.source.locator, remote.range_bytes())
            .map_err(|(pack, reason)| TransferError::CorruptObject {
                bucket: remote.bucket().to_owned(),
                key: remote.full_key(&pack_key(&pack)),
                reason,
            })?;
        downs.push(Downloaded {
            total,
            fetched: wanted.len() as u64,
            loose: loose.len() as u64,
            ranges: ranges.len() as u64,
        });
        // Ranges first (the bulk), then the loose chunks.
        jobs.extend(ranges.into_iter().map(|r| (i, Job::Range(r))));
        jobs.extend(loose.into_iter().map(|c| (i, Job::Loose(c))));
    }
    let wanted: u64 = claimed.len() as u64;
    let ticker = Ticker::start(every.len() as u64 - wanted, every.len() as u64, progress);
    let remaining: Vec<AtomicUsize> = (0..sets.len())
        .map(|i| AtomicUsize::new(jobs.iter().filter(|(s, _)| *s == i).count()))
        .collect();
    for (i, left) in remaining.iter().enumerate() {
        if left.load(Ordering::Relaxed) == 0 {
            done(i);
        }
    }
    if jobs.is_empty() {
        return Ok((downs, PipelineTimes::default()));
    }

    let threads = parallel.clamp(1, 64).min(jobs.len());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let writers = threads.max(cores.min(64)).min(jobs.len());
    let clock = PipelineClock::default();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first: Mutex<Option<TransferError>> = Mutex::new(None);
    let fail = |e: TransferError| {
        failed.store(true, Ordering::Relaxed);
        first
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Vec<u8>)>(threads * QUEUED_PER_FETCHER);
    // The ranges' buffers go round (fetcher, queue, writer, back); those the store keeps are
    // replaced by buffers made ahead (fetch_buffers.rs).
    let ranges: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .filter_map(|(n, (_, j))| match j {
            Job::Range(r) => Some((n, r.len as usize)),
            Job::Loose(_) => None,
        })
        .collect();
    let buffers = FetchBuffers::new(&ranges, &next, threads);
    let rx = Mutex::new(rx);
    let made = std::thread::scope(|scope| {
        let maker = (!ranges.is_empty()).then(|| {
            let buffers = &buffers;
            spawn_named(scope, "pull-buffers", move || buffers.make_ahead())
        });
        for _ in 0..threads {
            let tx = tx.clone();
            let (jobs, sets, next, failed, fail) = (&jobs, sets, &next, &failed, &fail);
            let (clock, buffers) = (&clock, &buffers);
            spawn_named(scope, "pull-fetch", move || {
                while !failed.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let Some((set, job)) = jobs.get(n) else { break };
                    let getting = Instant::now();
                    let buffer = match job {
                        Job::Range(r) => buffers.take(n, r.len as usize),
                        Job::Loose(_) => Vec::new(),
                    };
                    let got = fetch_job(&sets[*set].source, job, buffer);
                    PipelineClock::add(&clock.get, getting.elapsed());
                    match got {
                        // The writers are gone only once every one of them ended: on an error.
                        Ok(bytes) => {
                            let sending = Instant::now();
                            let sent = tx.send((n, bytes));
                            PipelineClock::add(&clock.queue_full, sending.elapsed());
                            if sent.is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            fail(e);
                            break;
                        }
                    }
                }
                // No range is taken after this one's last (none left, or a failure).
                buffers.stop();
            });
        }
        // The channel closes when the last fetcher ends.
        drop(tx);
        for _ in 0..writers {
            let (jobs, sets, rx, fail) = (&jobs, sets, &rx, &fail);
            let (remaining, ticker, clock, buffers) = (&remaining, &ticker, &clock, &buffers);
            spawn_named(scope, "pull-write", move || {
                let mut scratch = Vec::new();
                loop {
                    let waiting = Instant::now();
                    let got = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    PipelineClock::add(&clock.queue_empty, waiting.elapsed());
                    // What was fetched is stored even after an error elsewhere (no more than the
                    // queue holds): verified chunks that the next pull need not fetch again.
                    let Ok((n, bytes)) = got else { break };
                    let (set, job) = &jobs[n];
                    let sink = |c: &ChunkRef, bytes: &[u8]| {
                        let handing = Instant::now();
                        let handed = raw(*set, c, bytes);
                        PipelineClock::add(&clock.hand[(*set).min(1)], handing.elapsed());
                        handed
                    };
                    let bytes = Arc::new(bytes);
                    let stored = store_job(
                        &sets[*set].source,
                        writer,
                        job,
                        &bytes,
                        clock,
                        &mut scratch,
                        &sink,
                    );
                    // Back into the round unless the store holds chunks of it in memory
                    // (StoreWriter::hold_up_to): those are written after the commit.
                    if let Ok(bytes) = Arc::try_unwrap(bytes) {
                        buffers.give_back(bytes);
                    }
                    match stored {
                        Ok(chunks) => {
                            ticker.tick_n(chunks);
                            if remaining[*set].fetch_sub(1, Ordering::AcqRel) == 1 {
                                done(*set);
                            }
                        }
                        Err(e) => fail(e),
                    }
                }
            });
        }
        maker.map_or(0, |m| m.join().unwrap_or(0))
    });
    match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok((
            downs,
            PipelineTimes {
                buffers_made: made as u64,
                ..clock.times(threads, writers)
            },
        )),
    }
}

/// `f` on a thread of `scope` named `name`, so that profiles (`perf sched`, `top -H`) tell
/// the pipeline's threads apart. Panics where `Scope::spawn` would: no thread to be had.
fn spawn_named<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::thread::ScopedJoinHandle<'scope, T> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn_scoped(scope, f)
        .expect("failed to spawn thread")
}

/// A poisoned lock's data is still whole here: every holder only pushes, pops or sets.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The bytes of one job, as long as its plan says; a range is read into `buffer`.
fn fetch_job(source: &Source<'_>, job: &Job, buffer: Vec<u8>) -> Result<Vec<u8>, TransferError> {
    let Source {
        remote, missing, ..
    } = *source;
    match job {
        Job::Loose(c) => {
            let key = chunk_key(&c.id);
            remote
                .get(&key, max_chunk_file(c.len))?
                .ok_or_else(|| missing(&key))
        }
        Job::Range(r) => {
            let key = pack_key(&r.pack);
            let mut bytes = buffer;
            if !remote.get_range_into(&key, r.start, r.len, &mut bytes)? {
                return Err(missing(&key));
            }
            if bytes.len() as u64 != r.len {
                return Err(TransferError::CorruptObject {
                    bucket: remote.bucket().to_owned(),
                    key: remote.full_key(&key),
                    reason: format!(
                        "bytes {}..{} asked, {} came: shorter than its index says",
                        r.start,
                        r.start + r.len,
                        bytes.len()
                    ),
                });
            }
            Ok(bytes)
        }
    }
}

/// Checks and stores the chunks of one fetched job; returns how many it held.
fn store_job(
    source: &Source<'_>,
    writer: &StoreWriter<'_>,
    job: &Job,
    bytes: &Arc<Vec<u8>>,
    clock: &PipelineClock,
    scratch: &mut Vec<u8>,
    raw: &ChunkSink<'_>,
) -> Result<u64, TransferError> {
    let remote = source.remote;
    let bucket = remote.bucket();
    match job {
        Job::Loose(c) => {
            let origin = format!(
                "object {} in bucket {bucket}",
                remote.full_key(&chunk_key(&c.id))
            );
            put_timed(
                writer,
                c,
                bytes,
                0..bytes.len(),
                &origin,
                clock,
                scratch,
                raw,
            )?;
            Ok(1)
        }
        Job::Range(r) => {
            let full = remote.full_key(&pack_key(&r.pack));
            // One after the other on this writer's thread, not on rayon's pool: storing a chunk
            // waits for the disk (a full device queue), and a pool of one thread a core blocked
            // on the segments' writes would hold up every other writer's chunks (the files'
            // first). The writers are as many as the cores or the fetchers, whichever is more.
            for (c, offset, len) in &r.chunks {
                let at = (offset - r.start) as usize;
                let origin = format!(
                    "object {full} (bytes {offset}..{}) in bucket {bucket}",
                    offset + len
                );
                put_timed(
                    writer,
                    c,
                    bytes,
                    at..at + *len as usize,
                    &origin,
                    clock,
                    scratch,
                    raw,
                )?;
            }
            Ok(r.chunks.len() as u64)
        }
    }
}

/// Stores one fetched chunk file, `buf[range]` (written, or held in memory where the writer
/// holds chunks: StoreWriter::hold_up_to), its check and its placing timed apart, then hands
/// its raw bytes to `raw` (timed as placing: it writes them elsewhere).
#[allow(clippy::too_many_arguments)]
fn put_timed(
    writer: &StoreWriter<'_>,
    c: &ChunkRef,
    buf: &Arc<Vec<u8>>,
    range: std::ops::Range<usize>,
    origin: &str,
    clock: &PipelineClock,
    scratch: &mut Vec<u8>,
    raw: &ChunkSink<'_>,
) -> Result<(), TransferError> {
    let putting = Instant::now();
    let put = writer.hold_chunk_file(c, buf, range, origin, scratch)?;
    raw(c, put.raw)?;
    PipelineClock::add(&clock.check, put.checked);
    PipelineClock::add(&clock.place, putting.elapsed().saturating_sub(put.checked));
    Ok(())
}

/// Groups the `wanted` chunks `locator` places by pack into coalesced ranges of at most
/// `max_range` bytes (a chunk longer than that is a range of its own); returns them and the
/// chunks it does not place (loose). `Err`: (pack, what is wrong with its placement).
fn plan_ranges(
    wanted: &[ChunkRef],
    locator: Option<&Locator>,
    max_range: u64,
) -> Result<(Vec<RangeJob>, Vec<ChunkRef>), (String, String)> {
    let Some(locator) = locator else {
        return Ok((Vec::new(), wanted.to_vec()));
    };
    let mut place: HashMap<ChunkId, (&str, u64, u64)> =
        HashMap::with_capacity(locator.chunks() as usize);
    for (name, p) in &locator.packs {
        for (id, offset, len) in &p.chunks {
            place.entry(*id).or_insert((name, *offset, *len));
        }
    }
    let mut by_pack: BTreeMap<&str, InPack> = BTreeMap::new();
    let mut loose = Vec::new();
    for c in wanted {
        match place.get(&c.id) {
            Some(&(name, offset, len)) => {
                if len > max_chunk_file(c.len) {
                    return Err((
                        name.to_owned(),
                        format!(
                            "its locator gives chunk {} {len} bytes, more than a chunk of {} can take",
                            c.id, c.len
                        ),
                    ));
                }
                by_pack.entry(name).or_default().push((*c, offset, len));
            }
            None => loose.push(*c),
        }
    }
    let mut jobs = Vec::new();
    for (name, mut chunks) in by_pack {
        chunks.sort_by_key(|&(_, offset, _)| offset);
        let mut current: Option<RangeJob> = None;
        for (c, offset, len) in chunks {
            if let Some(r) = current.as_mut() {
                let end = r.start + r.len;
                let new_end = (offset + len).max(end);
                if offset <= end + COALESCE_GAP && new_end - r.start <= max_range {
                    r.len = new_end - r.start;
                    r.chunks.push((c, offset, len));
                    continue;
                }
                jobs.extend(current.take());
            }
            current = Some(RangeJob {
                pack: name.to_owned(),
                start: offset,
                len,
                chunks: vec![(c, offset, len)],
            });
        }
        jobs.extend(current);
    }
    Ok((jobs, loose))
}

/// Counts the chunks done and reports each to `progress`.
struct Ticker<'a> {
    done: AtomicU64,
    total: u64,
    progress: &'a (dyn Fn(Progress) + Sync),
}

impl<'a> Ticker<'a> {
    fn start(done: u64, total: u64, progress: &'a (dyn Fn(Progress) + Sync)) -> Self {
        progress(Progress {
            phase: Phase::Chunks,
            done,
            total,
        });
        Ticker {
            done: AtomicU64::new(done),
            total,
            progress,
        }
    }

    fn tick_n(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        (self.progress)(Progress {
            phase: Phase::Chunks,
            done,
            total: self.total,
        });
    }
}

/// Reads the locator object `key`: `None` when there is none (a push before packs).
pub(crate) fn fetch_locator(remote: &Remote, key: &str) -> Result<Option<Locator>, TransferError> {
    let Some(bytes) = remote.get(key, MAX_INDEX_BYTES)? else {
        return Ok(None);
    };
    Locator::from_json(&bytes)
        .map(Some)
        .map_err(|reason| TransferError::CorruptObject {
            bucket: remote.bucket().to_owned(),
            key: remote.full_key(key),
            reason,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_RANGE_BYTES;

    fn chunk(n: u8, len: u64) -> ChunkRef {
        ChunkRef {
            id: ChunkId::of(&[n]),
            len,
        }
    }

    type Pack<'a> = (&'a str, u64, &'a [(ChunkRef, u64, u64)]);

    fn locator(packs: &[Pack<'_>]) -> Locator {
        Locator {
            format: PACK_FORMAT,
            packs: packs
                .iter()
                .map(|(name, size, chunks)| {
                    (
                        name.repeat(64),
                        PackPlacement {
                            size: *size,
                            chunks: chunks.iter().map(|(c, o, l)| (c.id, *o, *l)).collect(),
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn near_chunks_coalesce_far_ones_split_unplaced_ones_are_loose() {
        let (a, b, c, d, e) = (
            chunk(1, 1000),
            chunk(2, 1000),
            chunk(3, 1000),
            chunk(4, 1000),
            chunk(5, 1000),
        );
        let far = 10 << 20;
        let loc = locator(&[
            // a and b a small gap apart (b's neighbour not wanted), c far away.
            (
                "a",
                far + 2000,
                &[(a, 0, 900), (b, 1900, 900), (c, far, 900)],
            ),
            ("b", 900, &[(d, 0, 900)]),
        ]);
        let (jobs, loose) =
            plan_ranges(&[c, a, b, d, e], Some(&loc), DEFAULT_RANGE_BYTES).expect("plan");
        assert_eq!(loose.len(), 1);
        assert_eq!(loose[0].id, e.id);
        let spans: Vec<(u64, u64, usize)> = jobs
            .iter()
            .map(|j| (j.start, j.len, j.chunks.len()))
            .collect();
        assert_eq!(spans, [(0, 2800, 2), (far, 900, 1), (0, 900, 1)]);
        // No locator: everything loose.
        let (jobs, loose) = plan_ranges(&[a, b], None, DEFAULT_RANGE_BYTES).expect("plan");
        assert!(jobs.is_empty() && loose.len() == 2);
    }

    #[test]
    fn ranges_stop_at_the_cap_and_oversized_placements_are_refused() {
        let chunks: Vec<ChunkRef> = (0..40).map(|n| chunk(n, 1 << 20)).collect();
        let placed: Vec<(ChunkRef, u64, u64)> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| (*c, i as u64 * (1 << 20), 1 << 20))
            .collect();
        let loc = locator(&[("c", 40 << 20, &placed)]);
        let (jobs, _) = plan_ranges(&chunks, Some(&loc), DEFAULT_RANGE_BYTES).expect("plan");
        assert_eq!(jobs.len(), 2);
        assert!(jobs.iter().all(|j| j.len <= DEFAULT_RANGE_BYTES));
        assert_eq!(jobs.iter().map(|j| j.chunks.len()).sum::<usize>(), 40);
        // A shorter cap (`range_bytes`): more ranges, each within it, every chunk once.
        let (jobs, _) = plan_ranges(&chunks, Some(&loc), 8 << 20).expect("plan");
        assert_eq!(jobs.len(), 5);
        assert!(jobs.iter().all(|j| j.len <= 8 << 20));
        assert_eq!(jobs.iter().map(|j| j.chunks.len()).sum::<usize>(), 40);
        // A cap below one chunk: each chunk is a range of its own.
        let (jobs, _) = plan_ranges(&chunks[..3], Some(&loc), 1 << 19).expect("plan");
        assert_eq!(jobs.iter().map(|j| j.len).collect::<Vec<_>>(), [1 << 20; 3]);
        let small = chunk(99, 10);
        let loc = locator(&[("d", 1 << 20, &[(small, 0, 1 << 20)])]);
        let (pack, reason) =
            plan_ranges(&[small], Some(&loc), DEFAULT_RANGE_BYTES).expect_err("oversized");
        assert_eq!(pack, "d".repeat(64));
        assert!(reason.contains("more than a chunk"), "{reason}");
    }

    #[test]
    fn locators_with_chunks_past_their_pack_or_odd_names_are_refused() {
        let a = chunk(1, 100);
        let good = locator(&[("e", 100, &[(a, 0, 100)])]);
        Locator::from_json(&good.to_json()).expect("good");
        let past = locator(&[("e", 100, &[(a, 50, 100)])]);
        let err = Locator::from_json(&past.to_json()).expect_err("past");
        assert!(err.contains("past the end"), "{err}");
        let mut odd = locator(&[]);
        odd.packs.insert("../x".into(), PackPlacement::default());
        let err = Locator::from_json(&odd.to_json()).expect_err("odd");
        assert!(err.contains("not 64 hex"), "{err}");
    }
}
