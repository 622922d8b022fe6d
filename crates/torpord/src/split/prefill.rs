//! The segments of a pulled split snapshot, put into the restore server's host cache while the
//! pull checks their chunks ([`torpor_objstore::SealedSink`]), so that the first restore on a
//! node that never had the function fills them from memory instead of reading back out of the
//! chunk store what the pull has just written there. On the H100 that read was most of the
//! first restore after a pull of GPT-2-Large: `segments` 1.5 s of 2.4–3.0 s
//! (bench/results/cluster-pull-h100.json, session 19); with the prefill the restore took
//! 0.71 s (cluster-pull-s20-prefill-ab-h100.json).
//!
//! Each chunk the pull hands over was checked against its id, and the ids and their order are
//! the sealed record's (its MAC checked before any chunk is fetched), so a buffer holding every
//! chunk of its recipe at its offset holds exactly that segment. What goes in is bounded by the
//! host cache's free room at the pull's start: a prefill never evicts what the cache holds.
//!
//! The buffers are allocated by one thread of the prefill's own, in the record's order, never
//! by the pull's writers: on the H100 the writers allocating pinned memory (`cuMemHostAlloc`,
//! 3.15 GB for GPT-2-Large) on their first chunk of a segment made the fetch 0.8 s slower, the
//! driver's mapping calls holding the address-space lock against every other thread's page
//! faults (session 20, docs/cluster.md). A chunk that arrives before its segment's buffer is
//! not kept by the writer that checked it; as each buffer is made, [`CATCH_UP_THREADS`] threads
//! of the prefill's own copy into it the chunks of its segment that are in the store by then
//! (those that came early, held in memory or written, and the ones the store had already),
//! checked, while the pull goes on: on the H100 that read-back, done only at the end, was
//! 0.27-0.38 s of a 2.6 s pull after its last chunk (session 21,
//! bench/results/cluster-pull-s21-hold-ab-h100.json). What is still missing at the end is read
//! then, on [`FINISH_THREADS`]. A buffer that cannot be had (memory) only means that segment is
//! read from the store at its restore, as before.
//!
//! Each chunk place is claimed before it is written (`Segment::written`), by the writer that
//! checked the chunk or by a catch-up thread, never both: a chunk handed to the sink was put in
//! the store first (the pipeline stores, then hands over), so one that found no buffer is in
//! the store when the catch-up of its segment runs, after the buffer was made.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use torpor_image::store::{ChunkId, ChunkRef, ChunkStore, Recipe};
use torpor_objstore::SealedSink;

use crate::split::device::HostBuffer;
use crate::split::index::INDEX_RECIPE;
use crate::split::{lock, Split};

/// Threads reading the chunks the pipeline did not keep back out of the store at the end.
const FINISH_THREADS: usize = 8;

/// Threads copying, as each buffer is made, the chunks of its segment that came before it.
const CATCH_UP_THREADS: usize = 2;

/// A pull's segments on their way into the host cache.
pub struct HostPrefill {
    split: Arc<Split>,
    tenant: String,
    plan: OnceLock<Arc<Plan>>,
    /// The allocator's thread and the catch-up threads.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Plan {
    /// Opened by the allocator, off the pull's path: on a node whose daemon has not opened its
    /// GPU yet that is the driver's context creation (crate::split::Split::open_gpus_at_start).
    split: Arc<Split>,
    /// The store the pull puts the chunks in (None: no catch-up, all read at the end).
    store: Option<ChunkStore>,
    segments: Vec<Segment>,
    /// Where each chunk lies: (segment, chunk's place in its recipe, offset).
    at: HashMap<ChunkId, Vec<(usize, usize, u64)>>,
    /// Set when the prefill is dropped unfinished (a failed pull): the allocator stops.
    cancelled: AtomicBool,
}

struct Segment {
    recipe: Recipe,
    /// Set by the allocator; never set after a failed allocation (`failed`).
    buf: OnceLock<Filling>,
    /// Which of the recipe's chunk places are in `buf`, or being written: claimed (false →
    /// true) before the write, given back if the write fails.
    written: Vec<AtomicBool>,
    failed: AtomicBool,
}

/// A segment's buffer while the pull's writers copy chunks into it: each into its own range.
struct Filling {
    buf: HostBuffer,
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into `buf`'s allocation, which does not move while the Filling lives
// (a boxed buffer). The writers (`chunk`) and the catch-up threads write through `base` only
// into the disjoint ranges of distinct chunk places, each by the one thread that claimed the
// place (`Segment::written`); nothing reads the buffer until `finish`, which runs after the
// pipeline, the allocator and the catch-up have ended and takes the buffer by value.
unsafe impl Sync for Filling {}
// SAFETY: as above; HostBuffer itself is Send.
unsafe impl Send for Filling {}

impl Filling {
    fn new(mut buf: HostBuffer) -> Self {
        let len = buf.len();
        let base = buf.as_mut_ptr();
        Filling { buf, base, len }
    }

    /// Copies `raw` to `offset`; false when it does not fit (a recipe that lies).
    fn write(&self, offset: u64, raw: &[u8]) -> bool {
        let Some(end) = (offset as usize).checked_add(raw.len()) else {
            return false;
        };
        if end > self.len {
            return false;
        }
        // SAFETY: within the buffer (checked), and no other thread writes or reads this range
        // (see the Sync impl).
        unsafe {
            std::ptr::copy_nonoverlapping(raw.as_ptr(), self.base.add(offset as usize), raw.len())
        };
        true
    }
}

/// What a prefill put into the host cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefilled {
    pub segments: u64,
    pub bytes: u64,
}

impl HostPrefill {
    /// For a pull of a function of `tenant`.
    pub fn new(split: Arc<Split>, tenant: &str) -> Self {
        HostPrefill {
            split,
            tenant: tenant.to_owned(),
            plan: OnceLock::new(),
            threads: Mutex::new(Vec::new()),
        }
    }

    /// After a successful pull: the chunks the pipeline did not keep (the store had them, or
    /// they came before their buffer) read from `store`, then every whole segment into the
    /// host cache. Blocking.
    pub fn finish(mut self, store: &ChunkStore) -> Prefilled {
        self.join_threads();
        let Some(plan) = self.plan.take() else {
            return Prefilled::default();
        };
        let Ok(plan) = Arc::try_unwrap(plan) else {
            // Only the allocator shared it, and it has ended.
            return Prefilled::default();
        };
        // The missing chunks, segment by segment, on a few threads.
        let next = AtomicUsize::new(0);
        let whole: Vec<AtomicBool> = plan
            .segments
            .iter()
            .map(|s| AtomicBool::new(!s.failed.load(Ordering::Acquire) && s.buf.get().is_some()))
            .collect();
        std::thread::scope(|scope| {
            for _ in 0..FINISH_THREADS.min(plan.segments.len()) {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(seg) = plan.segments.get(i) else {
                        break;
                    };
                    if whole[i].load(Ordering::Acquire) && !read_missing(seg, store) {
                        whole[i].store(false, Ordering::Release);
                    }
                });
            }
        });
        let mut done = Prefilled::default();
        for (seg, whole) in plan.segments.into_iter().zip(whole) {
            if !whole.into_inner() {
                continue;
            }
            let Some(filling) = seg.buf.into_inner() else {
                continue;
            };
            let key = crate::tenant::scoped_key(&self.tenant, &seg.recipe.blake3);
            lock(&self.split.host_cache).insert(
                &key,
                Arc::new(Mutex::new(filling.buf)),
                seg.recipe.size,
            );
            done.segments += 1;
            done.bytes += seg.recipe.size;
        }
        self.split.update_cache_gauges();
        done
    }

    fn join_threads(&self) {
        let threads = std::mem::take(&mut *lock(&self.threads));
        for handle in threads {
            if handle.join().is_err() {
                tracing::warn!("a thread of the pull's prefill panicked: the pulled segments it had not filled are read from the store");
            }
        }
    }

    fn plan(&self, recipes: &[Recipe]) -> Option<Plan> {
        let mut room = {
            let cache = lock(&self.split.host_cache);
            cache.capacity().saturating_sub(cache.used())
        };
        let cached = |k: &str| lock(&self.split.host_cache).contains(k);
        let mut segments = Vec::new();
        let mut at: HashMap<ChunkId, Vec<(usize, usize, u64)>> = HashMap::new();
        for r in recipes
            .iter()
            .filter(|r| r.name != INDEX_RECIPE && r.size > 0)
        {
            if r.size > room || cached(&crate::tenant::scoped_key(&self.tenant, &r.blake3)) {
                continue;
            }
            room -= r.size;
            let index = segments.len();
            let mut offset = 0u64;
            for (i, c) in r.chunks.iter().enumerate() {
                at.entry(c.id).or_default().push((index, i, offset));
                offset += c.len;
            }
            segments.push(Segment {
                recipe: r.clone(),
                buf: OnceLock::new(),
                written: r.chunks.iter().map(|_| AtomicBool::new(false)).collect(),
                failed: AtomicBool::new(false),
            });
        }
        (!segments.is_empty()).then_some(Plan {
            split: Arc::clone(&self.split),
            store: self.split.store_for(&self.tenant).ok(),
            segments,
            at,
            cancelled: AtomicBool::new(false),
        })
    }
}

/// The allocator: each segment's buffer in the record's order (the order its chunks come in),
/// each made one sent to the catch-up threads.
fn allocate(plan: &Plan, made: &std::sync::mpsc::Sender<usize>) {
    // Pinned memory where the node has a GPU (what a fill from the host cache copies fastest
    // from; the pool made at the daemon's start, crate::split::pool), plain memory otherwise.
    let Some(device) = plan.split.pool_device() else {
        for seg in &plan.segments {
            seg.failed.store(true, Ordering::Release);
        }
        return;
    };
    for (i, seg) in plan.segments.iter().enumerate() {
        if plan.cancelled.load(Ordering::Acquire) {
            return;
        }
        match device.host_buffer(seg.recipe.size as usize) {
            Ok(b) if b.len() as u64 >= seg.recipe.size => {
                let _ = seg.buf.set(Filling::new(b));
                let _ = made.send(i);
            }
            Ok(_) => seg.failed.store(true, Ordering::Release),
            Err(e) => {
                tracing::debug!(segment = %seg.recipe.name, error = %e, "no host buffer for a pulled segment: its restore reads the store");
                seg.failed.store(true, Ordering::Release);
            }
        }
    }
}

/// A catch-up thread: for each segment whose buffer was just made, the chunks of it that are in
/// the store already (they came before the buffer, or the store had them), read, checked and
/// copied in; the others come through [`HostPrefill::chunk`] now that the buffer is there.
fn catch_up(plan: &Plan, made: &Mutex<std::sync::mpsc::Receiver<usize>>) {
    let Some(store) = &plan.store else { return };
    let mut chunk = Vec::new();
    loop {
        let next = lock(made).recv();
        let Ok(i) = next else { return };
        if plan.cancelled.load(Ordering::Acquire) {
            return;
        }
        let seg = &plan.segments[i];
        let Some(filling) = seg.buf.get() else {
            continue;
        };
        let mut offset = 0u64;
        for (c, written) in seg.recipe.chunks.iter().zip(&seg.written) {
            let at = offset;
            offset += c.len;
            if written.load(Ordering::Acquire) || !store.contains(&c.id) {
                continue;
            }
            chunk.resize(c.len as usize, 0);
            // Damaged or gone: left for the end, which keeps the segment out if it still is.
            if store.read_chunk(c, &seg.recipe.name, &mut chunk).is_err() {
                continue;
            }
            if written
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
                && !filling.write(at, &chunk)
            {
                written.store(false, Ordering::Release);
            }
        }
    }
}

/// Reads the chunks of `seg` that are not in its buffer from `store`, checked. Whether the
/// buffer now holds the whole segment.
fn read_missing(seg: &Segment, store: &ChunkStore) -> bool {
    let Some(filling) = seg.buf.get() else {
        return false;
    };
    let mut offset = 0u64;
    let mut chunk = Vec::new();
    for (c, written) in seg.recipe.chunks.iter().zip(&seg.written) {
        let at = offset;
        offset += c.len;
        if written.load(Ordering::Acquire) {
            continue;
        }
        chunk.resize(c.len as usize, 0);
        if let Err(e) = store.read_chunk(c, &seg.recipe.name, &mut chunk) {
            tracing::debug!(segment = %seg.recipe.name, error = %e, "a pulled segment stays out of the host cache");
            return false;
        }
        if !filling.write(at, &chunk) {
            return false;
        }
        written.store(true, Ordering::Release);
    }
    true
}

impl Drop for HostPrefill {
    fn drop(&mut self) {
        // A prefill dropped unfinished (the pull failed): stop the allocator and the catch-up
        // and wait for them, so that no buffer is made for nothing after the pull has answered.
        if let Some(plan) = self.plan.get() {
            plan.cancelled.store(true, Ordering::Release);
        }
        self.join_threads();
    }
}

impl SealedSink for HostPrefill {
    fn begin(&self, recipes: &[Recipe]) {
        let Some(plan) = self.plan(recipes) else {
            return;
        };
        let plan = Arc::new(plan);
        if self.plan.set(Arc::clone(&plan)).is_err() {
            return;
        }
        let (made, to_catch_up) = std::sync::mpsc::channel();
        let to_catch_up = Arc::new(Mutex::new(to_catch_up));
        for _ in 0..CATCH_UP_THREADS {
            let (plan, rx) = (Arc::clone(&plan), Arc::clone(&to_catch_up));
            // Without one, what came early is read at the end instead.
            if let Ok(handle) = std::thread::Builder::new()
                .name("pull-prefill-catch-up".into())
                .spawn(move || catch_up(&plan, &rx))
            {
                lock(&self.threads).push(handle);
            }
        }
        let spawned = std::thread::Builder::new()
            .name("pull-prefill".into())
            .spawn(move || allocate(&plan, &made));
        match spawned {
            Ok(handle) => lock(&self.threads).push(handle),
            Err(e) => {
                tracing::debug!(error = %e, "no thread for the pull's prefill: its segments are read from the store");
                if let Some(plan) = self.plan.get() {
                    for seg in &plan.segments {
                        seg.failed.store(true, Ordering::Release);
                    }
                }
            }
        }
    }

    fn chunk(&self, c: &ChunkRef, raw: &[u8]) {
        let Some(plan) = self.plan.get() else { return };
        let Some(places) = plan.at.get(&c.id) else {
            return;
        };
        for &(index, place, offset) in places {
            let seg = &plan.segments[index];
            // No buffer yet: this chunk (in the store already) is copied by the catch-up once
            // the buffer is made, instead of waiting for the allocator here, on the pull's path.
            let Some(filling) = seg.buf.get() else {
                continue;
            };
            let written = &seg.written[place];
            if raw.len() as u64 != seg.recipe.chunks[place].len
                || written
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            if !filling.write(offset, raw) {
                written.store(false, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::store_root_of;
    use crate::tenant::DEFAULT_TENANT;

    const MIB: usize = 1 << 20;

    /// A split state with a host cache of `host_cache_bytes` (host backend: no GPU here), and
    /// segments of `sizes` stored in its store: their recipes and contents.
    fn setup(
        dir: &std::path::Path,
        host_cache_bytes: u64,
        sizes: &[usize],
    ) -> (Arc<Split>, ChunkStore, Vec<Recipe>, Vec<Vec<u8>>) {
        let limits = crate::config::RestoreServer {
            host_cache_bytes,
            gpu_cache_bytes: 0,
            ..Default::default()
        };
        let metrics = crate::metrics::Metrics::new().unwrap();
        let split = Split::new(
            dir,
            true,
            true,
            &limits,
            &metrics,
            Arc::new(crate::staging::test_key()),
        );
        let root = store_root_of(&dir.join(crate::split::STORE_DIR), DEFAULT_TENANT);
        let store = ChunkStore::open(&root).unwrap();
        let mut w = store.writer().unwrap();
        let mut recipes = Vec::new();
        let mut contents = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            // Different bytes in every chunk of every segment.
            let data: Vec<u8> = (0..n)
                .map(|b| (b / 4096 * 31 + i * 7 + b % 251) as u8)
                .collect();
            recipes.push(w.put_bytes(&format!("segment-{i}"), &data).unwrap());
            contents.push(data);
        }
        w.commit("fn-prefill-1", &recipes).unwrap();
        (Arc::new(split), store, recipes, contents)
    }

    /// Hands `recipe`'s chunks of `data` to the sink, those `keep` says.
    fn hand_over(
        sink: &dyn SealedSink,
        recipe: &Recipe,
        data: &[u8],
        keep: impl Fn(usize) -> bool,
    ) {
        let mut offset = 0usize;
        for (i, c) in recipe.chunks.iter().enumerate() {
            let end = offset + c.len as usize;
            if keep(i) {
                sink.chunk(c, &data[offset..end]);
            }
            offset = end;
        }
    }

    /// What a prefill of `r` alone did.
    fn just(r: &Recipe) -> Prefilled {
        Prefilled {
            segments: 1,
            bytes: r.size,
        }
    }

    fn cached(split: &Split, recipe: &Recipe) -> Option<Vec<u8>> {
        let buf = lock(&split.host_cache).get(&recipe.blake3)?;
        let b = lock(&buf);
        Some(b[..recipe.size as usize].to_vec())
    }

    /// Segments whose chunks all came, some, or none (the store had them) all land in the host
    /// cache whole, each exactly its contents, whenever the allocator made its buffer.
    #[test]
    fn every_segment_lands_whole_whatever_the_pipeline_handed_over() {
        let dir = tempfile::tempdir().unwrap();
        let (split, store, recipes, contents) =
            setup(dir.path(), 64 << 20, &[10 * MIB, 6 * MIB, 9 * MIB + 5]);
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        hand_over(&prefill, &recipes[0], &contents[0], |_| true);
        hand_over(&prefill, &recipes[2], &contents[2], |i| i % 2 == 0);
        let done = prefill.finish(&store);
        let total: u64 = recipes.iter().map(|r| r.size).sum();
        assert_eq!(
            done,
            Prefilled {
                segments: 3,
                bytes: total
            }
        );
        for (r, data) in recipes.iter().zip(&contents) {
            assert_eq!(cached(&split, r).as_deref(), Some(&data[..]), "{}", r.name);
        }
    }

    /// With a pool made at the daemon's start, the prefill's buffers are carved from it (no
    /// memory made on the pull's path), hold exactly their segments, and go back to the pool
    /// when the cache lets them go.
    #[test]
    fn buffers_come_from_the_pool_made_at_start_and_go_back_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let (split, store, recipes, contents) =
            setup(dir.path(), 64 << 20, &[10 * MIB, 6 * MIB + 3]);
        let dev = split.pool_device().expect("the host backend");
        assert_eq!(dev.make_host_pool(32 << 20).unwrap(), 32 << 20);
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        hand_over(&prefill, &recipes[0], &contents[0], |i| i % 3 != 0);
        hand_over(&prefill, &recipes[1], &contents[1], |_| true);
        let done = prefill.finish(&store);
        assert_eq!(done.segments, 2);
        for (r, data) in recipes.iter().zip(&contents) {
            assert_eq!(cached(&split, r).as_deref(), Some(&data[..]), "{}", r.name);
        }
        let (total, free) = dev.host_pool().expect("a pool");
        assert!(
            total - free >= 16 * MIB,
            "taken from the pool: {}",
            total - free
        );
        let before = metric(&split, "free");
        assert_eq!(before, free as i64, "the gauge follows the pool");
        for r in &recipes {
            assert!(lock(&split.host_cache).remove(&r.blake3));
        }
        assert_eq!(dev.host_pool(), Some((total, total)), "given back");
    }

    fn metric(split: &Split, state: &str) -> i64 {
        split
            .metrics
            .host_pool_bytes
            .with_label_values(&[state])
            .get()
    }

    /// Only the free room is used, what the cache holds stays, and a chunk that does not match
    /// its recipe's length is not kept (its segment's bytes then come from the store).
    #[test]
    fn a_prefill_takes_only_free_room_and_keeps_what_is_cached() {
        let dir = tempfile::tempdir().unwrap();
        let (split, store, recipes, contents) =
            setup(dir.path(), 16 << 20, &[6 * MIB, 8 * MIB, 4 * MIB]);
        // The cache already holds segment 2 (4 MiB): 12 MiB of room, for segment 0 (6 MiB)
        // but then not for segment 1 (8 MiB).
        let held: HostBuffer = Box::new(contents[2].clone());
        lock(&split.host_cache).insert(
            &recipes[2].blake3,
            Arc::new(Mutex::new(held)),
            recipes[2].size,
        );
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        let c0 = &recipes[0].chunks[0];
        prefill.chunk(c0, &contents[0][..c0.len as usize - 1]);
        hand_over(&prefill, &recipes[1], &contents[1], |_| true);
        let done = prefill.finish(&store);
        assert_eq!(done, just(&recipes[0]));
        assert_eq!(
            cached(&split, &recipes[0]).as_deref(),
            Some(&contents[0][..])
        );
        assert_eq!(cached(&split, &recipes[1]), None);
        assert_eq!(
            cached(&split, &recipes[2]).as_deref(),
            Some(&contents[2][..])
        );
    }

    /// Chunks that are in the store before their buffer is made (they came early, or the store
    /// had them) are copied in by the catch-up as each buffer is made, not left for the end;
    /// chunks handed over meanwhile land once, and every segment is exactly its contents.
    #[test]
    fn what_came_before_its_buffer_is_copied_in_as_the_buffer_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let (split, store, recipes, contents) =
            setup(dir.path(), 64 << 20, &[8 * MIB, 5 * MIB, 7 * MIB + 3]);
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        // Racing the catch-up: segment 1's chunks handed over as the pipeline would.
        hand_over(&prefill, &recipes[1], &contents[1], |_| true);
        prefill.join_threads();
        let plan = prefill.plan.get().expect("a plan");
        for seg in &plan.segments {
            assert!(
                seg.written.iter().all(|w| w.load(Ordering::Acquire)),
                "{}: a chunk in the store was left for the end",
                seg.recipe.name
            );
        }
        let done = prefill.finish(&store);
        assert_eq!(done.segments, 3);
        for (r, data) in recipes.iter().zip(&contents) {
            assert_eq!(cached(&split, r).as_deref(), Some(&data[..]), "{}", r.name);
        }
    }

    /// A pull that fails drops its prefill unfinished: nothing enters the cache.
    #[test]
    fn a_failed_pull_puts_nothing_in_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let (split, _store, recipes, contents) = setup(dir.path(), 64 << 20, &[10 * MIB]);
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        hand_over(&prefill, &recipes[0], &contents[0], |_| true);
        drop(prefill);
        assert_eq!(lock(&split.host_cache).used(), 0);
    }

    /// A damaged chunk in the store (one the pipeline did not hand over) keeps its segment out
    /// of the cache; the others still go in.
    #[test]
    fn a_damaged_stored_chunk_keeps_only_its_segment_out() {
        let dir = tempfile::tempdir().unwrap();
        let (split, store, recipes, contents) = setup(dir.path(), 64 << 20, &[4 * MIB, 4 * MIB]);
        let damaged = store.chunk_path(&recipes[1].chunks[0].id);
        std::fs::write(&damaged, b"not the chunk").unwrap();
        let prefill = HostPrefill::new(Arc::clone(&split), DEFAULT_TENANT);
        prefill.begin(&recipes);
        hand_over(&prefill, &recipes[0], &contents[0], |_| true);
        let done = prefill.finish(&store);
        assert_eq!(done, just(&recipes[0]));
        assert_eq!(cached(&split, &recipes[1]), None);
    }
}
