//! The restore server's fills of one plan: several segments at once, started in plan (first-use)
//! order, each handed on as it completes.
//!
//! One fill from the chunk store is a pipeline of its own (host buffer, chunk reads, the whole
//! segment's hash, the copy to the device); filled one after another, the disk idled at every
//! segment's boundary while the hash, the host buffer's allocation (pinned on cuda) and the copy
//! ran. So up to [`FillBounds::segments`] fills run at once, on as many threads, and together
//! they hold at most [`FillBounds::bytes`] of segments (their host buffers): a segment larger
//! than that still goes, alone. Fills *start* in plan order; they may *complete* out of it,
//! and each `Filled` is sent as it completes (the worker maps `map` frames in the order they
//! come; [`super::release::InstanceSegments::push`] keeps its leases beside their entries).
//!
//! The first error stops the rest: no fill starts after it, it alone is sent, and what the fills
//! still running produce is dropped (their memory with it). A receiver that went away stops the
//! fills the same way.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use tokio::sync::mpsc;

use super::index::Planned;
use super::lock;
use super::server::{Event, SegmentsError, Source};
use super::Split;

/// Tests: where a fill is when [`Split::fill_hook`] is called (with its plan index).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FillStep {
    /// It started (holds its place in the bounds).
    Start,
    /// It ended, before its place is given back and before it is sent.
    End,
}

/// How much of a plan is filled at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillBounds {
    /// Segments in flight at most (one thread each).
    pub segments: usize,
    /// Bytes of segments in flight at most (their host buffers); a larger segment goes alone.
    pub bytes: u64,
}

impl Default for FillBounds {
    /// `restore_server.fill_segments` and `fill_bytes` as the config leaves them.
    fn default() -> Self {
        Self {
            segments: crate::config::DEFAULT_FILL_SEGMENTS as usize,
            bytes: crate::config::DEFAULT_FILL_BYTES,
        }
    }
}

/// The fills' shared state: which entry starts next, what is in flight, whether they stop.
struct Gate {
    state: Mutex<GateState>,
    freed: Condvar,
    bounds: FillBounds,
    sizes: Vec<u64>,
}

struct GateState {
    /// Each entry's source until its fill starts.
    sources: Vec<Option<Source>>,
    next: usize,
    in_flight: usize,
    bytes: u64,
    /// An error was sent (or the receiver went): nothing more starts or is sent.
    stopped: bool,
}

impl Gate {
    fn new(plan: &[Planned], sources: Vec<Source>, bounds: FillBounds) -> Self {
        Self {
            state: Mutex::new(GateState {
                sources: sources.into_iter().map(Some).collect(),
                next: 0,
                in_flight: 0,
                bytes: 0,
                stopped: false,
            }),
            freed: Condvar::new(),
            bounds: FillBounds {
                segments: bounds.segments.max(1),
                bytes: bounds.bytes,
            },
            sizes: plan.iter().map(|(e, _)| e.size).collect(),
        }
    }

    /// The next entry to fill, in plan order, once the bounds let it start; `None` when none is
    /// left or the fills stopped.
    fn take(&self) -> Option<(usize, Source)> {
        let mut s = lock(&self.state);
        loop {
            if s.stopped || s.next >= self.sizes.len() {
                return None;
            }
            let size = self.sizes[s.next];
            let fits = s.in_flight == 0
                || (s.in_flight < self.bounds.segments
                    && s.bytes.saturating_add(size) <= self.bounds.bytes);
            if fits {
                let i = s.next;
                let source = s.sources[i].take()?;
                s.next += 1;
                s.in_flight += 1;
                s.bytes = s.bytes.saturating_add(size);
                return Some((i, source));
            }
            s = self.freed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Entry `i`'s fill ended (its host buffer is gone or cached).
    fn done(&self, i: usize) {
        let mut s = lock(&self.state);
        s.in_flight -= 1;
        s.bytes = s.bytes.saturating_sub(self.sizes[i]);
        self.freed.notify_all();
    }

    /// Stops the fills; true for the first caller only (who then sends the error).
    fn stop(&self) -> bool {
        let mut s = lock(&self.state);
        let first = !s.stopped;
        s.stopped = true;
        self.freed.notify_all();
        first
    }

    fn stopped(&self) -> bool {
        lock(&self.state).stopped
    }
}

/// A fill's place in the bounds, given back when it is dropped: also when the fill panics (a
/// bug), which then stops the others rather than leave them waiting for the place.
struct Place<'g> {
    gate: &'g Gate,
    i: usize,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.gate.stop();
        }
        self.gate.done(self.i);
    }
}

impl Split {
    /// Sends the plan, then each segment as it is filled (several at once, within
    /// `self.fill_bounds`), until one fails or the receiver goes. Blocking: runs on the blocking
    /// pool, and its fills on threads of their own.
    pub(super) fn fill_all(
        &self,
        tx: &mpsc::UnboundedSender<Event>,
        of: &str,
        tenant: &str,
        plan: Arc<Vec<Planned>>,
        sources: Vec<Source>,
    ) {
        debug_assert_eq!(plan.len(), sources.len());
        let _ = tx.send(Event::Plan(Arc::clone(&plan)));
        if plan.is_empty() {
            return;
        }
        let t = Instant::now();
        let gate = Gate::new(&plan, sources, self.fill_bounds);
        let threads = gate.bounds.segments.min(plan.len());
        std::thread::scope(|scope| {
            // This thread is one of them; the others are started here. One that cannot be
            // started only narrows the fills.
            for k in 1..threads {
                let started = std::thread::Builder::new()
                    .name(format!("torpord-fill-{k}"))
                    .spawn_scoped(scope, || self.fill_some(&gate, tx, of, tenant, &plan));
                if let Err(e) = started {
                    tracing::warn!(error = %e, "cannot start a fill thread: fewer segments are filled at once");
                    break;
                }
            }
            self.fill_some(&gate, tx, of, tenant, &plan);
        });
        let bytes: u64 = plan.iter().map(|(e, _)| e.size).sum();
        let secs = t.elapsed().as_secs_f64();
        tracing::debug!(
            of,
            segments = plan.len(),
            bytes,
            s = secs,
            gbps = bytes as f64 / secs.max(1e-9) / 1e9,
            stopped = gate.stopped(),
            "segment fills done"
        );
    }

    /// One fill thread: fills entries as the gate hands them out, sending each.
    fn fill_some(
        &self,
        gate: &Gate,
        tx: &mpsc::UnboundedSender<Event>,
        of: &str,
        tenant: &str,
        plan: &[Planned],
    ) {
        while let Some((i, source)) = gate.take() {
            let place = Place { gate, i };
            if tx.is_closed() {
                gate.stop();
                return;
            }
            #[cfg(test)]
            if let Some(hook) = &self.fill_hook {
                hook(FillStep::Start, i);
            }
            let planned = &plan[i];
            let filled = match source {
                Source::Fill => self.fill(planned, tenant),
                Source::Saved(buf) => self.fill_saved(&planned.0, &buf),
                Source::Held(lease) => self.export_held(&planned.0, lease),
            };
            // Stopped before this fill's place is given back: nothing starts after an error.
            let first_error = filled.is_err() && gate.stop();
            #[cfg(test)]
            if let Some(hook) = &self.fill_hook {
                hook(FillStep::End, i);
            }
            drop(place);
            match filled {
                // After an error nothing more goes: this one is dropped, its memory with it.
                Ok(f) if !gate.stopped() => {
                    if tx.send(Event::Filled(f)).is_err() {
                        gate.stop();
                    }
                }
                Ok(_) => {}
                Err(source) if first_error => {
                    let _ = tx.send(Event::Failed(SegmentsError::Fill {
                        va: planned.0.va,
                        of: of.to_string(),
                        source,
                    }));
                }
                Err(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::time::Duration;

    use torpor_image::store::{ChunkStore, Recipe};

    use super::*;
    use crate::split::index::{
        recipe_name, SegmentEntry, SegmentIndex, INDEX_FORMAT, INDEX_RECIPE,
    };
    use crate::split::test_worker::{hand_over, read_fd};

    const PAGE: usize = 4096;
    const BASE: u64 = 0x7f00_0000_0000;

    fn va(i: usize) -> u64 {
        BASE + (i as u64) * 0x100_0000
    }

    /// Segment `i`'s contents: `pages` pages, different from every other segment's (so that no
    /// two share a chunk).
    fn contents(i: usize, pages: usize) -> Vec<u8> {
        (0..pages * PAGE)
            .map(|b| (b % 251) as u8 ^ (i as u8).wrapping_mul(37))
            .collect()
    }

    /// A split snapshot `id` in the default tenant's store at `state/chunks`: one read-only host
    /// segment per entry of `pages` (its size in pages), in that (fill) order. Returns the
    /// segments' recipes.
    fn snapshot(state: &std::path::Path, id: &str, pages: &[usize]) -> Vec<Recipe> {
        let root = crate::split::store_root_of(
            &state.join(crate::split::STORE_DIR),
            crate::tenant::DEFAULT_TENANT,
        );
        let store = ChunkStore::open(&root).unwrap();
        let mut w = store.writer().unwrap();
        let mut recipes = Vec::new();
        let mut entries = Vec::new();
        for (i, &n) in pages.iter().enumerate() {
            let r = w.put_bytes(&recipe_name(va(i)), &contents(i, n)).unwrap();
            entries.push(SegmentEntry {
                va: va(i),
                size: (n * PAGE) as u64,
                backend: "host".into(),
                ordinal: -1,
                order: i as u64,
                first_use: None,
                deferrable: false,
                readonly: true,
                readonly_why: "declared".into(),
                recipe: recipe_name(va(i)),
                blake3: r.blake3.clone(),
            });
            recipes.push(r);
        }
        let index = SegmentIndex {
            format: INDEX_FORMAT,
            segments: entries,
        };
        let idx = w
            .put_bytes(INDEX_RECIPE, &serde_json::to_vec(&index).unwrap())
            .unwrap();
        let mut all = vec![idx];
        all.extend(recipes.iter().cloned());
        w.commit_sealed(id, &all, &crate::staging::test_key())
            .unwrap();
        recipes
    }

    /// A split daemon state without caches, filling with `bounds` and calling `hook`.
    fn split(
        state: &std::path::Path,
        bounds: FillBounds,
        hook: crate::split::FillHook,
    ) -> Arc<Split> {
        let limits = crate::config::RestoreServer {
            host_cache_bytes: 0,
            gpu_cache_bytes: 0,
            ..Default::default()
        };
        let metrics = crate::metrics::Metrics::new().unwrap();
        let key = Arc::new(crate::staging::test_key());
        let mut s = Split::new(state, true, true, &limits, &metrics, key);
        s.fill_bounds = bounds;
        s.fill_hook = Some(hook);
        Arc::new(s)
    }

    /// A count the hook and the test share, with a wait for it to reach a value.
    #[derive(Default)]
    struct Count(Mutex<usize>, Condvar);

    impl Count {
        fn add(&self) {
            *lock(&self.0) += 1;
            self.1.notify_all();
        }

        /// Waits until it is at least `n` (at most 20 s); whether it got there.
        fn wait_for(&self, n: usize) -> bool {
            let (c, _) = self
                .1
                .wait_timeout_while(lock(&self.0), Duration::from_secs(20), |c| *c < n)
                .unwrap();
            *c >= n
        }
    }

    /// The first segment's fill ends only once the three after it were handed over: they were
    /// filled while it was, and sent as they completed, out of plan order. Every segment
    /// arrives with its contents, and the instance's leases stay beside their plan entries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn segments_are_filled_at_once_and_sent_as_they_complete() {
        let dir = tempfile::tempdir().unwrap();
        let pages = [64, 1, 2, 3];
        snapshot(dir.path(), "fn-c-1", &pages);
        let handed = Arc::new(Count::default());
        let hook = {
            let handed = Arc::clone(&handed);
            Arc::new(move |step, i| {
                if step == FillStep::End && i == 0 {
                    // A fill at a time would wait here in vain, then send it first.
                    handed.wait_for(3);
                }
            })
        };
        let bounds = FillBounds {
            segments: 4,
            bytes: 1 << 30,
        };
        let split = split(dir.path(), bounds, hook);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (segments, maps) = {
            let (order, handed) = (Arc::clone(&order), Arc::clone(&handed));
            hand_over(
                split.begin_restore("fn-c-1", "default"),
                usize::MAX,
                move |va| {
                    lock(&order).push(va);
                    handed.add();
                },
            )
            .await
        };
        let segments = segments.unwrap();
        let order = lock(&order).clone();
        assert_eq!(order.len(), 4);
        assert_eq!(
            order[3],
            va(0),
            "the first segment was sent last: {order:x?}"
        );
        // The worker got them in the order they were sent, each with its own contents.
        for ((frame, fd), sent) in maps.iter().zip(&order) {
            assert_eq!(frame["va"], *sent);
            let i = (0..4).find(|&i| va(i) == *sent).unwrap();
            assert_eq!(read_fd(fd, pages[i] * PAGE), contents(i, pages[i]));
        }
        let (plan, leases) = segments.leases().unwrap();
        assert_eq!(leases.len(), 4);
        let kept: Vec<u64> = plan.iter().map(|(e, _)| e.va).collect();
        assert_eq!(
            kept, order,
            "the plan follows the order they were handed over"
        );
    }

    /// At most `segments` fills at once and `bytes` of them, a larger segment alone; all are
    /// delivered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fills_keep_to_their_bounds_and_a_larger_segment_goes_alone() {
        let dir = tempfile::tempdir().unwrap();
        // Bounds: 3 segments, 4 pages. 0-2 go together, 3 waits; 4 (8 pages) goes alone; 5
        // and 6 together; 7 waits for room.
        let pages = [1, 1, 1, 1, 8, 2, 2, 1];
        snapshot(dir.path(), "fn-b-1", &pages);
        struct Seen {
            count: usize,
            bytes: usize,
            most: usize,
            broken: Vec<String>,
        }
        let seen = Arc::new(Mutex::new(Seen {
            count: 0,
            bytes: 0,
            most: 0,
            broken: Vec::new(),
        }));
        let started = Arc::new(Count::default());
        let hook = {
            let (seen, started) = (Arc::clone(&seen), Arc::clone(&started));
            Arc::new(move |step, i: usize| {
                let size = pages[i] * PAGE;
                {
                    let mut s = lock(&seen);
                    match step {
                        FillStep::Start => {
                            s.count += 1;
                            s.bytes += size;
                            s.most = s.most.max(s.count);
                            if s.count > 3 || (s.count > 1 && s.bytes > 4 * PAGE) {
                                let what = format!("{} fills, {} bytes at {i}", s.count, s.bytes);
                                s.broken.push(what);
                            }
                        }
                        FillStep::End => {
                            s.count -= 1;
                            s.bytes -= size;
                        }
                    }
                }
                if step == FillStep::Start {
                    started.add();
                    if i < 3 {
                        // The first three are in flight together (or the bound was too tight).
                        started.wait_for(3);
                    }
                }
            })
        };
        let bounds = FillBounds {
            segments: 3,
            bytes: 4 * PAGE as u64,
        };
        let split = split(dir.path(), bounds, hook);
        let (segments, maps) =
            hand_over(split.begin_restore("fn-b-1", "default"), usize::MAX, |_| {}).await;
        segments.unwrap();
        assert_eq!(maps.len(), pages.len());
        let vas: HashSet<u64> = maps
            .iter()
            .map(|(f, _)| f["va"].as_u64().unwrap())
            .collect();
        assert_eq!(vas, (0..pages.len()).map(va).collect());
        for (frame, fd) in &maps {
            let i = (0..pages.len()).find(|&i| frame["va"] == va(i)).unwrap();
            assert_eq!(read_fd(fd, pages[i] * PAGE), contents(i, pages[i]));
        }
        let s = lock(&seen);
        assert!(s.broken.is_empty(), "bounds broken: {:?}", s.broken);
        assert_eq!(s.most, 3);
    }

    /// Segment 1 fails while segment 0 is still being filled: the error names segment 1, no
    /// further fill starts, segment 0's memory is dropped rather than sent, and nothing stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_first_error_stops_the_rest_and_names_its_segment() {
        let dir = tempfile::tempdir().unwrap();
        let pages = [4, 1, 1, 1, 1, 1];
        let recipes = snapshot(dir.path(), "fn-e-1", &pages);
        // Segment 1's chunk is gone from the store.
        let root = crate::split::store_root_of(
            &dir.path().join(crate::split::STORE_DIR),
            crate::tenant::DEFAULT_TENANT,
        );
        let store = ChunkStore::open(&root).unwrap();
        std::fs::remove_file(store.chunk_path(&recipes[1].chunks[0].id)).unwrap();
        let started = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(Count::default());
        let hook = {
            let (started, failed) = (Arc::clone(&started), Arc::clone(&failed));
            Arc::new(move |step, i| match (step, i) {
                (FillStep::Start, _) => lock(&started).push(i),
                (FillStep::End, 1) => failed.add(),
                // Segment 0 ends after segment 1 failed.
                (FillStep::End, 0) => assert!(failed.wait_for(1), "segment 1 never ended"),
                (FillStep::End, _) => {}
            })
        };
        let bounds = FillBounds {
            segments: 2,
            bytes: 1 << 30,
        };
        let split = split(dir.path(), bounds, hook);
        let (segments, maps) =
            hand_over(split.begin_restore("fn-e-1", "default"), usize::MAX, |_| {}).await;
        let err = segments.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "cannot restore the segment at {:#x} of snapshot fn-e-1:",
                va(1)
            )),
            "{err}"
        );
        assert!(err.contains("missing"), "{err}");
        assert!(maps.is_empty(), "sent after the error: {}", maps.len());
        let mut started = lock(&started).clone();
        started.sort_unstable();
        assert_eq!(started, [0, 1], "fills started after the error");
        // Segment 0's shared copy went with the fills (its thread ends shortly after).
        let deadline = Instant::now() + Duration::from_secs(20);
        while split.metrics.shared_bytes.get() != 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(split.metrics.shared_bytes.get(), 0);
    }

    /// A fill that panics (a bug) gives its place back and stops the others: the restore ends
    /// with the fill task's error at once, not at the map timeout, and no thread is left waiting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fill_that_panics_ends_the_fills_without_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        snapshot(dir.path(), "fn-p-1", &[1, 1, 1, 1, 1]);
        let hook = Arc::new(|step, i| {
            assert!(
                !(step == FillStep::Start && i == 1),
                "a fill's bug (this test's)"
            );
        });
        // One page at a time: a place not given back would hold up every later fill.
        let bounds = FillBounds {
            segments: 2,
            bytes: PAGE as u64,
        };
        let split = split(dir.path(), bounds, hook);
        let t = Instant::now();
        let (segments, _maps) =
            hand_over(split.begin_restore("fn-p-1", "default"), usize::MAX, |_| {}).await;
        let err = segments.unwrap_err();
        assert!(matches!(err, SegmentsError::FillTaskEnded), "{err}");
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    }
}
