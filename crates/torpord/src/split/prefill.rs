//! The segments of a pulled split snapshot, put into the restore server's host cache while the
//! pull checks their chunks ([`torpor_objstore::SealedSink`]), so that the first restore on a
//! node that never had the function fills them from memory instead of reading back out of the
//! chunk store what the pull has just written there. On the H100 that read was most of the
//! first restore after a pull of GPT-2-Large: `segments` 1.5 s of 2.4–3.0 s
//! (bench/results/cluster-pull-h100.json, session 19).
//!
//! Each chunk the pull hands over was checked against its id, and the ids and their order are
//! the sealed record's (its MAC checked before any chunk is fetched), so a buffer holding every
//! chunk of its recipe at its offset holds exactly that segment. Chunks the store had already
//! (not fetched) are read from it, checked, at the end. A buffer that cannot be had (memory)
//! only means that segment is read from the store as before. What goes in is bounded by the
//! host cache's free room at the pull's start: a prefill never evicts what the cache holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use torpor_image::store::{ChunkId, ChunkRef, ChunkStore, Recipe};
use torpor_objstore::SealedSink;

use crate::split::device::{HostBuffer, SegmentDevice};
use crate::split::index::INDEX_RECIPE;
use crate::split::{lock, Split};

/// A pull's segments on their way into the host cache.
pub struct HostPrefill<'a> {
    split: &'a Split,
    tenant: String,
    plan: OnceLock<Plan>,
}

struct Plan {
    device: Arc<dyn SegmentDevice>,
    segments: Vec<Segment>,
    /// Where each chunk lies: (segment, chunk's place in its recipe, offset).
    at: HashMap<ChunkId, Vec<(usize, usize, u64)>>,
}

struct Segment {
    recipe: Recipe,
    /// Made on its first chunk; `None` also after a failed allocation (`failed`).
    buf: Mutex<Option<HostBuffer>>,
    /// Which of the recipe's chunks are in `buf`.
    written: Vec<AtomicBool>,
    failed: AtomicBool,
}

/// What a prefill put into the host cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefilled {
    pub segments: u64,
    pub bytes: u64,
}

impl<'a> HostPrefill<'a> {
    /// For a pull of a function of `tenant`.
    pub fn new(split: &'a Split, tenant: &str) -> Self {
        HostPrefill {
            split,
            tenant: tenant.to_owned(),
            plan: OnceLock::new(),
        }
    }

    /// After a successful pull: the chunks the pipeline did not bring (the store had them)
    /// read from `store`, then every whole segment into the host cache. Blocking.
    pub fn finish(self, store: &ChunkStore) -> Prefilled {
        let Some(plan) = self.plan.into_inner() else {
            return Prefilled::default();
        };
        let mut done = Prefilled::default();
        for seg in plan.segments {
            if seg.failed.load(Ordering::Acquire) {
                continue;
            }
            let Some(mut buf) = seg.buf.into_inner().unwrap_or_else(|p| p.into_inner()) else {
                continue;
            };
            let mut offset = 0u64;
            let mut whole = true;
            for (c, written) in seg.recipe.chunks.iter().zip(&seg.written) {
                let range = offset as usize..(offset + c.len) as usize;
                offset += c.len;
                if written.load(Ordering::Acquire) {
                    continue;
                }
                if let Err(e) = store.read_chunk(c, &seg.recipe.name, &mut buf[range]) {
                    tracing::debug!(segment = %seg.recipe.name, error = %e, "a pulled segment stays out of the host cache");
                    whole = false;
                    break;
                }
            }
            if !whole {
                continue;
            }
            let key = crate::tenant::scoped_key(&self.tenant, &seg.recipe.blake3);
            lock(&self.split.host_cache).insert(&key, Arc::new(Mutex::new(buf)), seg.recipe.size);
            done.segments += 1;
            done.bytes += seg.recipe.size;
        }
        self.split.update_cache_gauges();
        done
    }

    fn plan(&self, recipes: &[Recipe]) -> Option<Plan> {
        // Pinned memory where the node has a GPU (what a fill from the host cache copies
        // fastest from), plain memory otherwise.
        let device = self
            .split
            .device("cuda", 0)
            .or_else(|_| self.split.device("host", -1))
            .ok()?;
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
                buf: Mutex::new(None),
                written: r.chunks.iter().map(|_| AtomicBool::new(false)).collect(),
                failed: AtomicBool::new(false),
            });
        }
        (!segments.is_empty()).then_some(Plan {
            device,
            segments,
            at,
        })
    }
}

impl SealedSink for HostPrefill<'_> {
    fn begin(&self, recipes: &[Recipe]) {
        if let Some(plan) = self.plan(recipes) {
            let _ = self.plan.set(plan);
        }
    }

    fn chunk(&self, c: &ChunkRef, raw: &[u8]) {
        let Some(plan) = self.plan.get() else { return };
        let Some(places) = plan.at.get(&c.id) else {
            return;
        };
        for &(index, place, offset) in places {
            let seg = &plan.segments[index];
            if seg.failed.load(Ordering::Acquire) {
                continue;
            }
            let mut buf = lock(&seg.buf);
            if buf.is_none() {
                match plan.device.host_buffer(seg.recipe.size as usize) {
                    Ok(b) => *buf = Some(b),
                    Err(e) => {
                        tracing::debug!(segment = %seg.recipe.name, error = %e, "no host buffer for a pulled segment: its restore reads the store");
                        seg.failed.store(true, Ordering::Release);
                        continue;
                    }
                }
            }
            if let Some(b) = buf.as_mut() {
                let start = offset as usize;
                if let Some(dst) = b.get_mut(start..start + raw.len()) {
                    dst.copy_from_slice(raw);
                    seg.written[place].store(true, Ordering::Release);
                }
            }
        }
    }
}
