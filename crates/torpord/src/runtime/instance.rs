//! A live instance: its worker's connection, its requests in flight, its keep-alive state
//! ([`Keep`]); and a hibernated one ([`Sleeper`]). Which state an instance is in and how it moves
//! between states is [`super::lifecycle`]'s business: [`Keep::state`] changes only through
//! `Runtime::step`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::{Map, Value};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;

use crate::runtime::invoke::Answer;
use crate::runtime::lifecycle::{State, WorkerTree};
use crate::sync::lock;

/// A request sent to a worker: told when its handler starts, then given its result.
pub(crate) struct Pending {
    pub(crate) started: Option<oneshot::Sender<()>>,
    pub(crate) result: oneshot::Sender<Answer>,
}

/// The next [`Instance::store_holder`]; 0 is the store's `NO_RELEASE`.
static NEXT_STORE_HOLDER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A live worker of a function.
pub struct Instance {
    pub id: String,
    pub function: String,
    /// Host pid of its init (the root of its process tree).
    pub init_pid: i32,
    /// Host pid of the worker (the Python process).
    pub worker_pid: i32,
    /// The deploy it belongs to; an older one is retired once idle.
    pub(crate) generation: u64,
    pub(crate) writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Its harness sends `started` when a handler starts (protocol 2).
    pub(crate) announces_start: bool,
    /// Its harness takes `release_gpu` (protocol 3): told before the driver checkpoints its
    /// GPU in place, it starts no CUDA work of its own meanwhile.
    pub(crate) quiets_gpu: bool,
    /// Its harness keeps its mappings of the store's GPU memory between puts and gets and
    /// releases its gets (protocol 4; crate::runtime::store_gpu, "Kept mappings").
    pub(crate) keeps_store_mappings: bool,
    /// Its harness takes `quiesce` {released: true} (protocol 5): a hibernation from
    /// gpu_released need not resume its GPU first.
    pub(crate) quiets_released: bool,
    /// Its worker process as a holder of the store's GPU memory (crate::runtime::store):
    /// unique to this connection, so a restored process does not inherit the holds.
    pub(crate) store_holder: u64,
    pub(crate) pending: Mutex<HashMap<u64, Pending>>,
    /// Why it was removed (its state is `gone`).
    pub(crate) why_dead: Mutex<Option<String>>,
    /// Its state and keep-alive accounting.
    pub(crate) keep: Mutex<Keep>,
    /// Told when `quiet` arrives while hibernating (`State::Hibernating`: its reader then takes
    /// `quiet` and the EOF after it): the reader hands over the frame and the
    /// connection's read half, and the hibernation reads the rest (segment fds, EOF).
    pub(crate) quiet_tx: Mutex<Option<oneshot::Sender<QuietHandOver>>>,
    /// A GPU release failed: it stays warm until it hibernates.
    pub(crate) gpu_release_failed: AtomicBool,
    /// What its worker held on each GPU (NVML) just before its GPU was released in place, which
    /// NVML no longer shows: what a restore of a snapshot taken while released needs. `None`:
    /// not released by this daemon, or NVML unavailable.
    pub(crate) released_gpu: Mutex<Option<Vec<(torpor_cuda::GpuUuid, u64)>>>,
    /// The segments it has from the restore server (split path), mapped or, while its GPU is
    /// released, saved (crate::split::release).
    pub(crate) segments: Mutex<crate::split::release::InstanceSegments>,
    /// Its segments copied while it serves, for the stop of its next hibernation
    /// (crate::split::precopy).
    pub(crate) precopy: Mutex<crate::split::precopy::PreCopyState>,
    /// The GPU (the daemon's CUDA ordinal; a host-backend device for a CPU function) its
    /// segments and CUDA state are on: 0 until a live migration moves it
    /// (crate::runtime::migrate).
    pub(crate) gpu: std::sync::atomic::AtomicU32,
    /// A live migration of it is under way.
    pub(crate) migrating: AtomicBool,
    /// A migration's stop was asked for: no new request is routed to it (they wait in the
    /// queue), the ones in flight finish, then the stop begins.
    pub(crate) draining: AtomicBool,
    /// The worker's CUDA ordinals that are another GPU of the daemon's since a migration (the
    /// driver's restore swapped the two GPUs' UUIDs under the process, so its ordinal 0 is then
    /// the daemon's target); absent ones are the same.
    pub(crate) gpu_map: Mutex<HashMap<i32, i32>>,
    /// The GPU pairs its next driver restore must pass: a released standby placed on another
    /// GPU, restored by CRIU with its CUDA state left checkpointed as the deploy's GPU held it
    /// (crate::runtime::start::standby). Taken by its first resume.
    pub(crate) owed_gpu_pairs: Mutex<Vec<(torpor_cuda::GpuUuid, torpor_cuda::GpuUuid)>>,
    /// Set while the daemon unmaps its segments (GPU release): its reader forwards the
    /// `unmapped` answer here.
    pub(crate) segment_replies: Mutex<Option<SegmentReplies>>,
    /// Its `map` frames and the worker's `mapped` answers, counted by its reader: after a split
    /// restore (it takes requests before every segment is mapped) and during a GPU resume.
    pub(crate) mapping: Mutex<Option<crate::split::server::Mapping>>,
    /// Restored with lazy pages that CRIU's lazy-pages daemon is still serving: no keep-alive
    /// step (a snapshot or GPU checkpoint) until every page is in.
    pub(crate) pages_pending: AtomicBool,
    /// Told when `pages_pending` turns false: keyed requests wait for it (runtime::invoke).
    pub(crate) pages_served: tokio::sync::Notify,
    /// Told once it joined its pool, or was removed: a restore's background segment hand-over
    /// waits for it, so that a failed fill always finds the instance in its pool (and fails its
    /// request there) instead of racing the start that is adding it.
    pub(crate) joined: tokio::sync::Notify,
    /// Armed by a split restore whose segments were all filled by the worker's hello: its first
    /// request goes out only after every `map` frame (crate::split::server::HandingOver::all_filled).
    pub(crate) maps_first: Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    /// Its tree's cgroup (crate::cgroup), removed when the instance goes; `None`: unconfined,
    /// or re-adopted from an earlier daemon (whose cgroup the sweep removes once empty).
    pub(crate) cgroup: Option<crate::cgroup::Cgroup>,
}

/// Where an instance's reader forwards the worker's answer to `unmap`.
pub(crate) type SegmentReplies = tokio::sync::mpsc::UnboundedSender<Map<String, Value>>;

/// The `quiet` frame of a hibernating instance and its connection's read half, handed from the
/// instance's reader to the hibernation.
pub(crate) type QuietHandOver = (Map<String, Value>, OwnedReadHalf);

/// The state of an instance (live or hibernated) and its keep-alive accounting.
#[derive(Debug)]
pub struct Keep {
    /// Where it is in its life; changed by `Runtime::step` only (crate::runtime::lifecycle).
    pub(crate) state: State,
    /// When it last became idle (no request in flight).
    pub idle_since: Instant,
    /// Its stage time and GPU memory, up to when they were added to the metrics.
    pub meter: crate::accounting::Meter,
}

impl Keep {
    /// The keep of an instance in `state`: `State::Starting` for a new one, which
    /// `Transition::Adopt` or `Transition::Readopt` then makes live, or what its registry row
    /// says (`State::at_rest`) for a hibernated one listed at the pool's creation.
    pub(crate) fn new(state: State, idle_since: Instant) -> Self {
        Self {
            state,
            idle_since,
            meter: crate::accounting::Meter::new(Instant::now()),
        }
    }

    /// Its state (see crate::runtime::lifecycle).
    pub fn state(&self) -> State {
        self.state
    }
}

/// A hibernated (or evicted) instance: no process, a snapshot on disk.
#[derive(Debug)]
pub struct Sleeper {
    pub id: String,
    pub snapshot_id: String,
    pub snapshot_dir: PathBuf,
    pub keep: Keep,
}

impl Instance {
    /// Out of service: removed, or hibernated (its process is gone).
    pub(crate) fn is_dead(&self) -> bool {
        !lock(&self.keep).state.is_live()
    }

    /// Its state (see crate::runtime::lifecycle).
    pub(crate) fn state(&self) -> State {
        lock(&self.keep).state
    }

    pub(crate) fn reason(&self) -> String {
        lock(&self.why_dead)
            .clone()
            .unwrap_or_else(|| "the worker closed its connection".to_string())
    }

    /// The daemon's CUDA ordinal of the worker's ordinal `worker` (see `gpu_map`).
    pub(crate) fn daemon_ordinal(&self, worker: i32) -> i32 {
        lock(&self.gpu_map).get(&worker).copied().unwrap_or(worker)
    }

    /// The worker's ordinal of the daemon's GPU `daemon` (the inverse of
    /// [`Instance::daemon_ordinal`]).
    pub(crate) fn worker_ordinal(&self, daemon: i32) -> i32 {
        let map = lock(&self.gpu_map);
        if let Some((&w, _)) = map.iter().find(|(_, &d)| d == daemon) {
            return w;
        }
        // Unmapped ordinals are the identity, unless that worker ordinal maps elsewhere.
        if map.contains_key(&daemon) {
            return -1;
        }
        daemon
    }

    /// On device `d` since its start (a placed cold start or standby, a wake): it counts there,
    /// and for a CUDA process (`cuda`) the driver's pairs swapped the deploy's GPU 0 and `d`
    /// under it, so its ordinal 0 is GPU `d`.
    pub(crate) fn placed_on(&self, d: u32, cuda: bool) {
        self.gpu.store(d, std::sync::atomic::Ordering::SeqCst);
        if cuda {
            self.swap_gpus(0, i32::try_from(d).unwrap_or(0));
        }
    }

    /// Records that the driver moved its CUDA state from the daemon's GPU `a` to `b` (and `b`'s
    /// to `a`: the pairs swap the two).
    pub(crate) fn swap_gpus(&self, a: i32, b: i32) {
        swap_in(&mut lock(&self.gpu_map), a, b);
    }

    /// Some of its segments are not mapped yet: it serves, but must not be stepped down (the
    /// worker refuses a quiesce meanwhile).
    pub(crate) fn still_mapping(&self) -> bool {
        lock(&self.mapping)
            .as_ref()
            .is_some_and(|m| m.unmapped() > 0)
    }
}

/// Composes a move of the daemon's GPUs `a` ⇄ `b` into `map` (worker ordinal → daemon
/// ordinal, identities left out).
fn swap_in(map: &mut HashMap<i32, i32>, a: i32, b: i32) {
    for w in [a, b] {
        map.entry(w).or_insert(w);
    }
    for d in map.values_mut() {
        if *d == a {
            *d = b;
        } else if *d == b {
            *d = a;
        }
    }
    map.retain(|w, d| w != d);
}

/// An instance around a connected worker tree; its reader half is for [`Runtime::attach`].
pub(crate) fn new_instance(
    id: String,
    function: &str,
    generation: u64,
    tree: WorkerTree,
    keep: Keep,
) -> (Arc<Instance>, OwnedReadHalf) {
    let WorkerTree {
        init,
        worker,
        conn,
        cgroup,
    } = tree;
    let inst = Arc::new(Instance {
        id,
        function: function.to_string(),
        init_pid: init,
        worker_pid: worker,
        generation,
        writer: tokio::sync::Mutex::new(conn.wr),
        announces_start: conn.hello.protocol >= 2,
        quiets_gpu: conn.hello.protocol >= 3,
        keeps_store_mappings: conn.hello.protocol >= 4,
        quiets_released: conn.hello.protocol >= 5,
        store_holder: NEXT_STORE_HOLDER.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        pending: Mutex::new(HashMap::new()),
        why_dead: Mutex::new(None),
        keep: Mutex::new(keep),
        quiet_tx: Mutex::new(None),
        gpu_release_failed: AtomicBool::new(false),
        released_gpu: Mutex::new(None),
        segments: Mutex::new(Default::default()),
        precopy: Mutex::new(Default::default()),
        gpu: std::sync::atomic::AtomicU32::new(0),
        migrating: AtomicBool::new(false),
        draining: AtomicBool::new(false),
        gpu_map: Mutex::new(HashMap::new()),
        owed_gpu_pairs: Mutex::new(Vec::new()),
        segment_replies: Mutex::new(None),
        mapping: Mutex::new(None),
        pages_pending: AtomicBool::new(false),
        pages_served: tokio::sync::Notify::new(),
        joined: tokio::sync::Notify::new(),
        maps_first: Mutex::new(None),
        cgroup,
    });
    (inst, conn.rd)
}

/// SIGUSR1 to an instance's worker: the harness writes every thread's stack to its log
/// (python/torpor/worker.py registers faulthandler for it).
pub fn dump_stacks(worker: i32) {
    if worker > 1 {
        // SAFETY: kill(2) only sends a signal; the pid is one this daemon started or restored.
        unsafe { libc::kill(worker, libc::SIGUSR1) };
    }
}

/// SIGKILL to the init of an instance: its whole PID namespace goes.
pub fn kill_tree(init: i32) {
    if init > 1 {
        // SAFETY: kill(2) only sends a signal; the pid is one this daemon started or restored.
        unsafe { libc::kill(init, libc::SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn swapped(moves: &[(i32, i32)]) -> HashMap<i32, i32> {
        let mut map = HashMap::new();
        for &(a, b) in moves {
            swap_in(&mut map, a, b);
        }
        map
    }

    #[test]
    fn migrations_compose_into_the_workers_ordinal_map() {
        assert_eq!(swapped(&[(0, 1)]), HashMap::from([(0, 1), (1, 0)]));
        // There and back: the identity again.
        assert!(swapped(&[(0, 1), (1, 0)]).is_empty());
        // 0 → 1 → 2: the worker's 0 is the daemon's 2; its 1 the daemon's 0; its 2 the daemon's 1.
        assert_eq!(
            swapped(&[(0, 1), (1, 2)]),
            HashMap::from([(0, 2), (1, 0), (2, 1)])
        );
    }
}
