//! An instance's segments across gpu_released (docs/split.md, "GPU release on the split path").
//!
//! The driver will not resume, from an in-place checkpoint, a process that maps device memory it
//! imported from the daemon (measured on the H100). So before the lock + checkpoint the worker
//! unmaps every segment (`unmap` → `unmapped`), the daemon copies each writable segment's memory
//! into host memory kept with the instance ([`Split::save_writable`]) and drops its handles on
//! all of them: the instance holds no device memory while released. After the driver's restore
//! the segments are filled again ([`InstanceSegments::sources`]: writable ones from the saved
//! contents, read-only ones from the restore server's usual sources) and handed over with `map`
//! frames, as after a restore ([`super::server::HandingOver::send_maps`]).

use std::sync::Arc;

use super::device::HostBuffer;
use super::index::Planned;
use super::server::{Lease, Leases, Source};
use super::Split;

/// What a GPU release kept of each segment ([`Split::save_writable`]).
pub type SavedContents = Vec<Option<HostBuffer>>;

/// What an instance holds from the restore server.
#[derive(Debug, Default)]
pub struct InstanceSegments {
    /// Its segments in the order they were handed over (empty: it has none from the restore
    /// server, e.g. a booted instance or one of a transparent snapshot).
    plan: Arc<Vec<Planned>>,
    held: Held,
}

enum Held {
    /// The worker maps them: the daemon's handle on each, one per plan entry.
    Mapped(Leases),
    /// Given back (gpu_released): each writable segment's contents, `None` for read-only ones.
    Saved(Vec<Option<HostBuffer>>),
}

impl Default for Held {
    fn default() -> Self {
        Held::Mapped(Vec::new())
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Held::Mapped(l) => write!(f, "Mapped({} leases)", l.len()),
            Held::Saved(s) => write!(f, "Saved({} buffers)", s.iter().flatten().count()),
        }
    }
}

impl InstanceSegments {
    /// A restore's segments, about to be handed over: each lease joins as its `map` frame goes
    /// out ([`InstanceSegments::push`]).
    pub fn handing(plan: Arc<Vec<Planned>>) -> Self {
        Self {
            plan,
            held: Held::Mapped(Vec::with_capacity(0)),
        }
    }

    /// Segments whose memory the daemon holds (`leases[i]` for `plan[i]`), not handed over yet:
    /// a migration's new memory, mapped with `map` frames from these handles.
    pub fn held(plan: Arc<Vec<Planned>>, leases: super::server::Leases) -> Self {
        Self {
            plan,
            held: Held::Mapped(leases),
        }
    }

    /// Bytes of its segments.
    pub fn bytes(&self) -> u64 {
        self.plan.iter().map(|(e, _)| e.size).sum()
    }

    /// The daemon's handle on the segment at `va`, as its `map` frame goes out. Fills complete
    /// in any order ([`super::fill`]): the plan is kept in the order they were handed over, so
    /// that `leases[i]` is always `plan[i]`'s (those not handed over yet follow, in plan order).
    pub fn push(&mut self, va: u64, lease: Lease) {
        let Held::Mapped(leases) = &mut self.held else {
            return;
        };
        let next = leases.len();
        let at = self.plan[next.min(self.plan.len())..]
            .iter()
            .position(|(e, _)| e.va == va)
            .map(|p| next + p);
        match at {
            Some(at) if at > next => Arc::make_mut(&mut self.plan)[next..=at].rotate_right(1),
            Some(_) => {}
            // Not in the plan (a bug): kept, so that every handle is dropped with the instance.
            None => tracing::warn!(va, "a segment handed over is not in the instance's plan"),
        }
        leases.push(lease);
    }

    /// The segments of `plan`, none handed over yet: released, each to be filled from the
    /// restore server's sources (a standby instance, crate::runtime::start::standby).
    pub fn unfilled(plan: Arc<Vec<Planned>>) -> Self {
        let saved = plan.iter().map(|_| None).collect();
        Self {
            plan,
            held: Held::Saved(saved),
        }
    }

    /// No segments from the restore server.
    pub fn is_empty(&self) -> bool {
        self.plan.is_empty()
    }

    /// The worker maps segments the daemon holds a handle on (a pre-copy can read them).
    pub fn is_held(&self) -> bool {
        !self.plan.is_empty() && matches!(self.held, Held::Mapped(_))
    }

    /// Given back: the worker has no memory behind its segments until they are handed over.
    pub fn is_released(&self) -> bool {
        matches!(self.held, Held::Saved(_))
    }

    /// Forgets everything (the process is gone): shared copies it held may go.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// The plan and another handle on each segment's memory, for saving while mapped.
    pub fn leases(&self) -> Option<(Arc<Vec<Planned>>, Leases)> {
        match &self.held {
            Held::Mapped(l) => Some((Arc::clone(&self.plan), l.clone())),
            Held::Saved(_) => None,
        }
    }

    /// Takes the saved contents of a released instance for its hibernation
    /// ([`super::capture::store_released`]); `None` if its segments are not released. The
    /// instance keeps its plan, its segments then filled from the restore server's sources.
    pub fn take_saved(&mut self) -> Option<(Arc<Vec<Planned>>, SavedContents)> {
        let Held::Saved(saved) = &mut self.held else {
            return None;
        };
        let taken = std::mem::replace(saved, self.plan.iter().map(|_| None).collect());
        Some((Arc::clone(&self.plan), taken))
    }

    /// Drops the daemon's handles on the memory, keeping `saved` (from
    /// [`Split::save_writable`]) until the segments are handed over again.
    pub fn release(&mut self, saved: Vec<Option<HostBuffer>>) {
        self.held = Held::Saved(saved);
    }

    /// Where each segment's memory comes from to hand it over again: the saved contents (they
    /// are taken) or the restore server's sources once released, the memory still held
    /// otherwise (a release that failed before the memory was dropped).
    pub fn sources(&mut self) -> (Arc<Vec<Planned>>, Vec<Source>) {
        let sources = match std::mem::take(&mut self.held) {
            Held::Mapped(leases) => {
                let sources = leases.iter().cloned().map(Source::Held).collect();
                self.held = Held::Mapped(leases);
                sources
            }
            Held::Saved(saved) => saved
                .into_iter()
                .map(|s| s.map_or(Source::Fill, Source::Saved))
                .collect(),
        };
        (Arc::clone(&self.plan), sources)
    }
}

impl Split {
    /// Copies the memory of each writable segment (`leases[i]` holds `plan[i]`) into host memory
    /// of its device (pinned on cuda); read-only ones are `None`: their contents are in the shared
    /// copy, the caches or the chunk store. Blocking.
    pub fn save_writable(
        &self,
        plan: &[Planned],
        leases: &[Lease],
    ) -> Result<Vec<Option<HostBuffer>>, SaveError> {
        if plan.len() != leases.len() {
            return Err(SaveError::Mismatch {
                held: leases.len(),
                planned: plan.len(),
            });
        }
        plan.iter()
            .zip(leases)
            .map(|((e, _), lease)| {
                let Lease::Own(own) = lease else {
                    return Ok(None);
                };
                let dev = self.device(&e.backend, e.ordinal)?;
                let size = usize::try_from(e.size).map_err(|_| SaveError::TooLarge {
                    va: e.va,
                    size: e.size,
                })?;
                let mut buf = dev
                    .host_buffer(size)
                    .map_err(|source| SaveError::HostBuffer { va: e.va, source })?;
                dev.read_memory(&own.memory, &mut buf)
                    .map_err(|source| SaveError::Read { va: e.va, source })?;
                Ok(Some(buf))
            })
            .collect()
    }
}

/// Why the writable segments of an instance releasing its GPU could not be saved (the release
/// is undone: the instance keeps its memory).
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The instance's leases and its plan disagree (a bug).
    #[error("the instance holds {held} segments but its plan lists {planned}")]
    Mismatch { held: usize, planned: usize },
    /// The device of a segment cannot be opened.
    #[error(transparent)]
    Device(#[from] crate::split::DeviceOpenError),
    /// A segment larger than this machine's address space.
    #[error("the segment at {va:#x} ({size} bytes) is too large to save on this machine")]
    TooLarge { va: u64, size: u64 },
    /// No host memory (pinned, on cuda) for the copy.
    #[error("host memory to save the segment at {va:#x}: {source}")]
    HostBuffer {
        va: u64,
        #[source]
        source: torpor_device::DeviceError,
    },
    /// Copying the segment to the host failed (the driver's code is inside).
    #[error("saving the segment at {va:#x}: {source}")]
    Read {
        va: u64,
        #[source]
        source: torpor_device::DeviceError,
    },
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, OwnedFd};

    use serde_json::Value;
    use torpor_image::store::ChunkStore;

    use super::*;
    use crate::split::index::{
        recipe_name, SegmentEntry, SegmentIndex, INDEX_FORMAT, INDEX_RECIPE,
    };
    use crate::split::test_worker::{hand_over, read_fd};

    const PAGE: usize = 4096;
    const WRITABLE: u64 = 0x7f00_0000_0000;
    const READ_ONLY: u64 = 0x7f00_1000_0000;

    fn entry(va: u64, size: usize, order: u64, readonly: bool, blake3: String) -> SegmentEntry {
        SegmentEntry {
            va,
            size: size as u64,
            backend: "host".into(),
            ordinal: -1,
            order,
            first_use: None,
            readonly,
            readonly_why: if readonly {
                "declared".into()
            } else {
                String::new()
            },
            deferrable: false,
            recipe: recipe_name(va),
            blake3,
        }
    }

    /// A split snapshot `id` in the default tenant's store at `state/chunks` with one writable
    /// and one read-only host segment.
    fn snapshot(state: &std::path::Path, id: &str, writable: &[u8], read_only: &[u8]) {
        snapshot_of(state, "default", id, writable, read_only);
    }

    /// [`snapshot`] in `tenant`'s store.
    fn snapshot_of(
        state: &std::path::Path,
        tenant: &str,
        id: &str,
        writable: &[u8],
        read_only: &[u8],
    ) {
        let root = crate::split::store_root_of(&state.join(crate::split::STORE_DIR), tenant);
        let store = ChunkStore::open(&root).unwrap();
        let mut w = store.writer().unwrap();
        let a = w.put_bytes(&recipe_name(WRITABLE), writable).unwrap();
        let b = w.put_bytes(&recipe_name(READ_ONLY), read_only).unwrap();
        let index = SegmentIndex {
            format: INDEX_FORMAT,
            segments: vec![
                entry(WRITABLE, writable.len(), 0, false, a.blake3.clone()),
                entry(READ_ONLY, read_only.len(), 1, true, b.blake3.clone()),
            ],
        };
        let idx = w
            .put_bytes(INDEX_RECIPE, &serde_json::to_vec(&index).unwrap())
            .unwrap();
        w.commit_sealed(id, &[idx, a, b], &crate::staging::test_key())
            .unwrap();
    }

    /// A split daemon state without caches, so read-only segments come from the shared copy or
    /// the store.
    fn split(state: &std::path::Path) -> Arc<Split> {
        let limits = crate::config::RestoreServer {
            host_cache_bytes: 0,
            gpu_cache_bytes: 0,
            ..Default::default()
        };
        let metrics = crate::metrics::Metrics::new().unwrap();
        let key = Arc::new(crate::staging::test_key());
        Arc::new(Split::new(state, true, true, &limits, &metrics, key))
    }

    /// The map frame of the segment at `va` (fills complete in any order).
    fn at(maps: &[(Value, OwnedFd)], va: u64) -> &(Value, OwnedFd) {
        maps.iter()
            .find(|(f, _)| f["va"] == va)
            .unwrap_or_else(|| panic!("no map frame for {va:#x}"))
    }

    fn bytes(maps: &[(Value, OwnedFd)]) -> u64 {
        maps.iter().map(|(f, _)| f["size"].as_u64().unwrap()).sum()
    }

    fn write_at(fd: &OwnedFd, data: &[u8]) {
        // SAFETY: pwrite of `data` to an open memfd.
        let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
        assert_eq!(n, data.len() as isize);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writable_contents_are_saved_and_every_segment_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let writable: Vec<u8> = (0..2 * PAGE).map(|i| (i % 241) as u8).collect();
        let read_only: Vec<u8> = (0..3 * PAGE).map(|i| (i % 239) as u8).collect();
        snapshot(dir.path(), "fn-t-1", &writable, &read_only);
        let split = split(dir.path());

        let (handed, maps) = hand_over(split.begin_restore("fn-t-1", "default"), 2, |_| {}).await;
        let mut segments = handed.unwrap();
        assert!(!segments.is_empty() && !segments.is_released());
        // The worker wrote into its writable segment after the restore.
        let (w_frame, w_fd) = at(&maps, WRITABLE);
        assert_eq!(w_frame["readonly"], false);
        let changed: Vec<u8> = writable.iter().map(|b| b ^ 0x5a).collect();
        write_at(w_fd, &changed);
        drop(maps);

        // A release that fails before the memory is dropped hands the same memory back.
        let (plan, sources) = segments.sources();
        assert!(sources.iter().all(|s| matches!(s, Source::Held(_))));
        let (handed, again) = hand_over(
            split.begin_refill(plan, sources, "t".into(), "default".into()),
            2,
            |_| {},
        )
        .await;
        assert!(handed.is_ok() && again.len() == 2);
        assert_eq!(read_fd(&at(&again, WRITABLE).1, writable.len()), changed);
        // The same memory: dropping this second set of handles leaves it held.
        drop((handed, again));

        // Saved, then every handle dropped: the shared copy goes with its only holder.
        let (plan, leases) = segments.leases().unwrap();
        let saved = split.save_writable(&plan, &leases).unwrap();
        drop(leases);
        // Beside their entries, in the order they were handed over.
        for ((e, _), saved) in plan.iter().zip(&saved) {
            match e.va {
                WRITABLE => assert!(saved.as_ref().is_some_and(|b| b[..] == changed[..])),
                _ => assert!(saved.is_none()),
            }
        }
        segments.release(saved);
        assert!(segments.is_released() && segments.leases().is_none());
        assert_eq!(split.metrics.shared_bytes.get(), 0);

        let (plan, sources) = segments.sources();
        for ((e, _), source) in plan.iter().zip(&sources) {
            match e.va {
                WRITABLE => assert!(matches!(source, Source::Saved(_))),
                _ => assert!(matches!(source, Source::Fill)),
            }
        }
        let (handed, back) = hand_over(
            split.begin_refill(plan, sources, "t".into(), "default".into()),
            2,
            |_| {},
        )
        .await;
        let segments = handed.unwrap();
        assert_eq!((back.len(), bytes(&back)), (2, (5 * PAGE) as u64));
        assert_eq!(at(&back, WRITABLE).0["readonly"], false);
        assert_eq!(read_fd(&at(&back, WRITABLE).1, writable.len()), changed);
        // The read-only one came from the store into a new shared copy, sealed.
        let (ro_frame, ro_fd) = at(&back, READ_ONLY);
        assert_eq!(ro_frame["readonly"], true);
        assert_eq!(read_fd(ro_fd, read_only.len()), read_only);
        assert_eq!(split.metrics.shared_bytes.get(), (3 * PAGE) as i64);
        // SAFETY: F_GET_SEALS only reads the memfd's seals.
        let seals = unsafe { libc::fcntl(ro_fd.as_raw_fd(), libc::F_GET_SEALS) };
        assert!(seals & libc::F_SEAL_WRITE != 0, "seals {seals:#x}");
        assert!(!segments.is_released() && segments.leases().is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refill_whose_source_is_gone_names_the_segment() {
        let dir = tempfile::tempdir().unwrap();
        let writable = vec![1u8; PAGE];
        let read_only = vec![2u8; PAGE];
        snapshot(dir.path(), "fn-t-2", &writable, &read_only);
        // One fill at a time: the writable segment (first in the plan) is handed over before
        // the read-only one fails.
        let mut split = split(dir.path());
        Arc::get_mut(&mut split).unwrap().fill_bounds.segments = 1;
        let (handed, maps) = hand_over(split.begin_restore("fn-t-2", "default"), 2, |_| {}).await;
        drop(maps);
        let mut segments = handed.unwrap();
        let (plan, leases) = segments.leases().unwrap();
        segments.release(split.save_writable(&plan, &leases).unwrap());
        drop(leases);
        // The snapshot goes meanwhile (e.g. removed by hand) and no cache holds the read-only
        // segment: the store's chunks are gone.
        let store = split.store_for(crate::tenant::DEFAULT_TENANT).unwrap();
        store.release("fn-t-2").unwrap();
        store.try_gc().unwrap();
        let (plan, sources) = segments.sources();
        let (handed, maps) = hand_over(
            split.begin_refill(plan, sources, "instance i-1".into(), "default".into()),
            1,
            |_| {},
        )
        .await;
        let err = handed.unwrap_err().to_string();
        assert!(
            err.contains(&format!("segment at {READ_ONLY:#x} of instance i-1")),
            "{err}"
        );
        // The writable one was handed over before.
        assert_eq!(read_fd(&maps[0].1, PAGE), writable);
    }

    /// The inode of an fd's file (a memfd: one per copy).
    fn inode(fd: &OwnedFd) -> u64 {
        std::fs::File::from(fd.try_clone().unwrap())
            .metadata()
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap()
    }

    /// Issue 13, tenants: two functions with the same read-only contents share one copy when
    /// they are one tenant's, and get one each when they are two tenants'.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn read_only_copies_are_shared_within_a_tenant_only() {
        let dir = tempfile::tempdir().unwrap();
        let read_only: Vec<u8> = (0..3 * PAGE).map(|i| (i % 239) as u8).collect();
        // fn-c-1 in two tenants' stores: restored as each (the same contents, two tenants).
        for (tenant, id) in [
            ("team-a", "fn-a-1"),
            ("team-a", "fn-b-1"),
            ("team-b", "fn-c-1"),
            ("default", "fn-c-1"),
        ] {
            snapshot_of(dir.path(), tenant, id, &[7u8; PAGE], &read_only);
        }
        let split = split(dir.path());
        let one = (3 * PAGE) as i64;
        let (a, a_maps) = hand_over(split.begin_restore("fn-a-1", "team-a"), 2, |_| {}).await;
        assert_eq!(split.metrics.shared_bytes.get(), one);
        // Another function of the same tenant: the same copy.
        let (b, b_maps) = hand_over(split.begin_restore("fn-b-1", "team-a"), 2, |_| {}).await;
        assert_eq!(split.metrics.shared_bytes.get(), one);
        assert_eq!(
            inode(&at(&a_maps, READ_ONLY).1),
            inode(&at(&b_maps, READ_ONLY).1)
        );
        // Another tenant's function with the same weights: a copy of its own.
        let (c, c_maps) = hand_over(split.begin_restore("fn-c-1", "team-b"), 2, |_| {}).await;
        assert_eq!(split.metrics.shared_bytes.get(), 2 * one);
        assert_ne!(
            inode(&at(&a_maps, READ_ONLY).1),
            inode(&at(&c_maps, READ_ONLY).1)
        );
        assert_eq!(
            read_fd(&at(&c_maps, READ_ONLY).1, read_only.len()),
            read_only
        );
        // The default tenant is a tenant like the others.
        let (d, d_maps) = hand_over(split.begin_restore("fn-c-1", "default"), 2, |_| {}).await;
        assert_eq!(split.metrics.shared_bytes.get(), 3 * one);
        assert_ne!(
            inode(&at(&a_maps, READ_ONLY).1),
            inode(&at(&d_maps, READ_ONLY).1)
        );
        drop((a, b, c, d, a_maps, b_maps, c_maps, d_maps));
        assert_eq!(split.metrics.shared_bytes.get(), 0);
    }

    /// The restore server's caches are scoped the same way: a segment another tenant's restore
    /// cached is a miss.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cached_segments_are_hits_within_a_tenant_only() {
        let dir = tempfile::tempdir().unwrap();
        let writable: Vec<u8> = (0..PAGE).map(|i| (i % 233) as u8).collect();
        for (tenant, id) in [
            ("team-a", "fn-a-1"),
            ("team-a", "fn-b-1"),
            ("team-b", "fn-c-1"),
        ] {
            snapshot_of(dir.path(), tenant, id, &writable, &[9u8; PAGE]);
        }
        let limits = crate::config::RestoreServer {
            host_cache_bytes: 1 << 20,
            gpu_cache_bytes: 0,
            ..Default::default()
        };
        let metrics = crate::metrics::Metrics::new().unwrap();
        let key = Arc::new(crate::staging::test_key());
        let split = Arc::new(Split::new(dir.path(), true, true, &limits, &metrics, key));
        let hits = || {
            split
                .metrics
                .cache_requests
                .with_label_values(&["host", "hit"])
                .get()
        };
        let (a, _) = hand_over(split.begin_restore("fn-a-1", "team-a"), 2, |_| {}).await;
        assert_eq!(hits(), 0);
        // The same tenant: its writable segment comes from the host cache.
        let (b, _) = hand_over(split.begin_restore("fn-b-1", "team-a"), 2, |_| {}).await;
        assert_eq!(hits(), 1);
        // Another tenant: from the store, as if nothing were cached.
        let (c, maps) = hand_over(split.begin_restore("fn-c-1", "team-b"), 2, |_| {}).await;
        assert_eq!(hits(), 1);
        assert_eq!(read_fd(&at(&maps, WRITABLE).1, PAGE), writable);
        drop((a, b, c));
    }

    #[test]
    fn saving_needs_one_lease_per_segment() {
        let dir = tempfile::tempdir().unwrap();
        let split = split(dir.path());
        let plan = vec![(
            entry(WRITABLE, PAGE, 0, false, String::new()),
            torpor_image::store::Recipe {
                name: recipe_name(WRITABLE),
                size: PAGE as u64,
                blake3: String::new(),
                chunks: Vec::new(),
            },
        )];
        let Err(err) = split.save_writable(&plan, &[]) else {
            panic!("saved without a lease");
        };
        assert!(
            err.to_string()
                .contains("holds 0 segments but its plan lists 1"),
            "{err}"
        );
    }
}
