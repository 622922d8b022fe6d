//! Concurrent snapshot of a split instance (issue 10 item 1; docs/checkpoints.md, "Concurrent
//! hibernation"). A hibernation used to copy every segment into the chunk store while the worker
//! was stopped (quiesced). Now, with `restore_server.concurrent_snapshot` (the default):
//!
//! 1. **pre-copy, while the instance serves** ([`Split::precopy`]): the daemon reads each
//!    writable segment it handed the instance (it keeps a handle on that memory, crate::split::
//!    server::Lease) into host memory, takes the BLAKE3 hash of every [`BLOCK`]-byte block and
//!    stores the copy in the chunk store. The instance stays warm and routable meanwhile;
//! 2. **the stop** (quiesce → CRIU's dump, crate::split::capture::store_all_with): each segment
//!    the instance maps read-only from the restore server keeps the recipe it was restored from
//!    without being read (a read-only mapping cannot have changed it); each pre-copied segment is
//!    read again block by block through the worker's fd and hashed, and only the blocks whose
//!    hash changed are copied into the pre-copy (then stored; unchanged chunks are already in the
//!    store); every other segment (made by the worker since its restore) is copied whole, as
//!    before. Then the worker releases its segments and CRIU dumps the small rest, as before.
//!
//! A write that lands in a segment during or after the pre-copy is in a block whose hash
//! differs at the stop, so it is copied then: correctness rests on the hashes, not on knowing
//! who wrote what. Torpor intercepts no kernel launch, so it cannot tell which blocks a kernel
//! wrote; hashing finds out.
//!
//! Failure: the pre-copy touches only the daemon's own handles (a failure is logged and the
//! hibernation takes the whole capture in the stop, as without it); the stop fails exactly where
//! the stop-the-world capture fails, with the same rollback.

use std::collections::HashMap;
use std::time::Instant;

use torpor_image::store::{ChunkStore, Recipe, StoreError};

use super::capture::{all_stored, Listed};
use super::device::{block_hashes, HostBuffer};
use super::index::{self, Planned};
use super::release::SaveError;
use super::server::Lease;
use super::{Split, StoreOpenError};

/// The block a changed segment is compared and copied by: 2 MiB, the GPU's VMM granularity.
pub const BLOCK: usize = 2 << 20;

/// One writable segment as the pre-copy read it.
pub struct CopiedSegment {
    pub va: u64,
    pub size: u64,
    /// Its contents when read (host memory of its device: pinned on cuda).
    pub buf: HostBuffer,
    /// The BLAKE3 hash of each [`BLOCK`] of `buf`.
    pub hashes: Vec<[u8; 32]>,
    /// `buf` stored in the chunk store (not committed: a commit checks its chunks are still
    /// there, and the stop stores the segment again if not).
    pub recipe: Option<Recipe>,
}

/// What a pre-copy read while the instance served.
pub struct PreCopy {
    /// When it began.
    pub began: Instant,
    /// How long it took.
    pub seconds: f64,
    /// Bytes read.
    pub bytes: u64,
    pub segments: Vec<CopiedSegment>,
}

impl std::fmt::Debug for PreCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreCopy")
            .field("seconds", &self.seconds)
            .field("bytes", &self.bytes)
            .field("segments", &self.segments.len())
            .finish_non_exhaustive()
    }
}

/// Where an instance is with its pre-copy (crate::runtime::keepalive).
#[derive(Debug, Default)]
pub enum PreCopyState {
    /// None taken: the next hibernation of a split instance begins with one.
    #[default]
    None,
    /// Under way; the instance serves meanwhile.
    Running,
    /// Done: the hibernation's stop uses it.
    Done(PreCopy),
    /// Failed (logged): the next hibernation captures everything in its stop.
    Failed,
}

/// What the stop of a concurrent snapshot knows of an instance's segments.
pub struct Known {
    /// The segments the instance was restored with, read-only ones by VA.
    read_only: HashMap<u64, Planned>,
    /// The pre-copied ones, by VA.
    copied: HashMap<u64, CopiedSegment>,
}

/// What [`Known::take`] has for one listed segment.
pub enum Prior {
    /// Nothing: read it whole.
    None,
    /// Mapped read-only from the restore server: this recipe, every chunk in the store.
    ReadOnly(Recipe),
    /// Pre-copied: compare and refresh.
    Copied(CopiedSegment),
}

impl Known {
    /// `plan`: the segments the instance was restored with (crate::split::release::
    /// InstanceSegments); `pre`: its pre-copy, if one was taken.
    pub fn new(plan: &[Planned], pre: Option<PreCopy>) -> Self {
        Self {
            read_only: plan
                .iter()
                .filter(|(e, _)| e.readonly)
                .map(|p| (p.0.va, p.clone()))
                .collect(),
            copied: pre
                .map(|p| p.segments.into_iter().map(|s| (s.va, s)).collect())
                .unwrap_or_default(),
        }
    }

    /// What is known of listed segment `l` (each is taken once).
    pub fn take(&mut self, l: &Listed, store: &ChunkStore) -> Prior {
        // Mapped read-only now (the hook says so) at the address and size of a read-only segment
        // of its restore: the restore server's memory, which no one can have written.
        if l.sealed {
            if let Some((e, recipe)) = self.read_only.remove(&l.va) {
                if e.size == l.size
                    && recipe.name == index::recipe_name(l.va)
                    && all_stored(store, &recipe)
                {
                    return Prior::ReadOnly(recipe);
                }
            }
        }
        match self.copied.remove(&l.va) {
            Some(c) if c.size == l.size && c.buf.len() as u64 == l.size => Prior::Copied(c),
            _ => Prior::None,
        }
    }
}

/// What the stop of a concurrent snapshot did, for its log line and the benchmark.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Delta {
    /// Read-only segments kept by recipe, not read.
    pub read_only_kept: u64,
    pub read_only_bytes: u64,
    /// Pre-copied segments compared block by block.
    pub pre_copied: u64,
    pub blocks: u64,
    /// Blocks whose hash changed since the pre-copy, copied again in the stop.
    pub changed_blocks: u64,
    /// Bytes copied in the stop: the changed blocks and the segments not pre-copied.
    pub changed_bytes: u64,
    /// Segments copied whole in the stop (not pre-copied: made since the restore).
    pub copied_in_stop: u64,
}

/// Why a pre-copy failed (nothing of the instance's was touched; the hibernation then copies in
/// its stop).
#[derive(Debug, thiserror::Error)]
pub enum PreCopyError {
    /// Reading a segment's memory failed.
    #[error("pre-copy: {0}")]
    Save(#[from] SaveError),
    /// The chunk store cannot be opened.
    #[error("pre-copy: {0}")]
    Store(#[from] StoreOpenError),
    /// The chunk store refused the copy (a full disk, say).
    #[error("pre-copy: storing the segment at {va:#x}: {source}")]
    Put {
        va: u64,
        #[source]
        source: Box<StoreError>,
    },
}

impl Split {
    /// Reads every writable segment an instance maps from the restore server (`leases[i]` holds
    /// `plan[i]`), hashes its blocks and stores it (blocking; see the module doc). Read-only
    /// segments are not read: the stop keeps their recipes.
    pub fn precopy(
        &self,
        store: &ChunkStore,
        plan: &[Planned],
        leases: &[Lease],
    ) -> Result<PreCopy, PreCopyError> {
        let began = Instant::now();
        let saved = self.save_writable(plan, leases)?;
        // The writer holds GC off while it stores; its chunks stay unreferenced until the
        // hibernation's commit, which checks that each is still there.
        let mut writer = store.writer().map_err(|e| PreCopyError::Put {
            va: 0,
            source: Box::new(e),
        })?;
        let mut segments = Vec::new();
        let mut bytes = 0;
        for ((e, _), buf) in plan.iter().zip(saved) {
            let Some(buf) = buf else { continue };
            let hashes = block_hashes(&buf, BLOCK);
            let recipe = writer
                .put_bytes(&index::recipe_name(e.va), &buf)
                .map_err(|source| PreCopyError::Put {
                    va: e.va,
                    source: Box::new(source),
                })?;
            bytes += e.size;
            segments.push(CopiedSegment {
                va: e.va,
                size: e.size,
                buf,
                hashes,
                recipe: Some(recipe),
            });
        }
        drop(writer);
        Ok(PreCopy {
            began,
            seconds: began.elapsed().as_secs_f64(),
            bytes,
            segments,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::index::SegmentEntry;

    fn listed(va: u64, size: u64, sealed: bool) -> Listed {
        Listed {
            va,
            size,
            backend: "host".to_string(),
            ordinal: -1,
            order: 0,
            first_use: None,
            sealed,
            shareable: true,
            deferrable: false,
            fd: std::fs::File::open("/dev/null").expect("/dev/null").into(),
        }
    }

    fn planned(store: &ChunkStore, va: u64, bytes: &[u8], readonly: bool) -> Planned {
        let mut w = store.writer().unwrap();
        let recipe = w.put_bytes(&index::recipe_name(va), bytes).unwrap();
        // Referenced, so that a GC keeps its chunks.
        w.commit(&format!("fn-{va:x}"), std::slice::from_ref(&recipe))
            .unwrap();
        let entry = SegmentEntry {
            va,
            size: bytes.len() as u64,
            backend: "host".to_string(),
            ordinal: -1,
            order: 0,
            first_use: None,
            deferrable: false,
            readonly,
            readonly_why: if readonly { "declared" } else { "" }.to_string(),
            recipe: index::recipe_name(va),
            blake3: recipe.blake3.clone(),
        };
        (entry, recipe)
    }

    fn copied(va: u64, size: u64) -> CopiedSegment {
        CopiedSegment {
            va,
            size,
            buf: Box::new(vec![0u8; size as usize]),
            hashes: Vec::new(),
            recipe: None,
        }
    }

    #[test]
    fn the_stop_keeps_only_read_only_mapped_segments_by_recipe_and_matches_copies_by_address_and_size(
    ) {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(dir.path()).unwrap();
        let plan = vec![
            planned(&store, 0x1000_0000, &[7u8; 8192], true),
            planned(&store, 0x2000_0000, &[9u8; 4096], true),
        ];
        let pre = PreCopy {
            began: Instant::now(),
            seconds: 0.0,
            bytes: 0,
            segments: vec![copied(0x3000_0000, 4096), copied(0x4000_0000, 4096)],
        };
        let mut known = Known::new(&plan, Some(pre));
        // Read-only in the plan and mapped read-only now: kept by its recipe.
        assert!(matches!(
            known.take(&listed(0x1000_0000, 8192, true), &store),
            Prior::ReadOnly(r) if r.name == index::recipe_name(0x1000_0000)
        ));
        // Read-only in the plan but mapped writable now (freed and made again by the worker):
        // read it.
        assert!(matches!(
            known.take(&listed(0x2000_0000, 4096, false), &store),
            Prior::None
        ));
        // Pre-copied: compared; at another size: read whole.
        assert!(matches!(
            known.take(&listed(0x3000_0000, 4096, false), &store),
            Prior::Copied(c) if c.va == 0x3000_0000
        ));
        assert!(matches!(
            known.take(&listed(0x4000_0000, 8192, false), &store),
            Prior::None
        ));
        // Each is taken once.
        assert!(matches!(
            known.take(&listed(0x1000_0000, 8192, true), &store),
            Prior::None
        ));
    }

    #[test]
    fn a_read_only_recipe_whose_chunks_are_gone_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let store = ChunkStore::open(dir.path()).unwrap();
        let plan = vec![planned(&store, 0x1000_0000, &[5u8; 4096], true)];
        // Its record released and collected: the chunks are gone.
        store.release(&format!("fn-{:x}", 0x1000_0000u64)).unwrap();
        store.gc().unwrap();
        let mut known = Known::new(&plan, None);
        assert!(matches!(
            known.take(&listed(0x1000_0000, 4096, true), &store),
            Prior::None
        ));
    }
}
