//! An instance's life, in one place: its [`State`], the [`Transition`]s between states, and
//! what each transition charges to the metrics (stage seconds and GPU memory·seconds,
//! crate::accounting) and writes to the registry (the instance's row). Every change of state goes
//! through [`Runtime::step`], which checks it against [`Transition::apply`] and charges the time
//! up to it; nothing else writes `Keep::state`.
//!
//! ```text
//!  starting ─Adopt─▶ warm ◀────────────────────────── Readopt (an earlier daemon's instance)
//!     │  ▲            │ ▲ Begin(ReleaseGpu)  ╭─ ReleaseGpu ─▶ gpu_released ── Begin(ResumeGpu) ─╮
//!     │  │            │ ╰─────── Abort ──────┤ releasing                  ▲                    │
//!     │  │            │                      ╰────────────────────────────╯      resuming ◀──╯
//!     │  │            │ Standby (CPU) / Standby (GPU: gpu_released)                 │ ResumeGpu
//!     │  │            ▼                                                             ▼
//!     │  │        standby ── TakeStandby ──▶ warm (CPU) │ resuming (GPU) ─────────▶ warm
//!     │  │
//!     │  │   warm │ gpu_released ── Begin(Hibernate) ─▶ (gpu_released: resumed first unless
//!     │  │        its harness quiesces without CUDA, protocol 5)
//!     │  │        ── Quiesce ─▶ hibernating ── Hibernate ─▶ hibernated ── Begin(Evict) ─▶
//!     │  │        evicting ── Evict ─▶ evicted        (Abort: back to hibernated)
//!     │  ╰── Wake (a hibernated or evicted instance taken to be restored) ──╯
//!     ╰──── any live state ── Remove ─▶ gone (row deleted)
//! ```
//!
//! | Transition | From → to | Charged to (the time up to it) | Registry row | Run by |
//! |---|---|---|---|---|
//! | `Adopt` | starting → warm | nothing (the start's meter, `Runtime::starts`, carries over) | inserted, or a woken one's updated | [`Runtime::adopt`] |
//! | `Readopt(stage)` | starting → warm or gpu_released | nothing | kept | `runtime/readopt.rs` |
//! | `Standby` | warm → standby | nothing | kept (gpu_released on a GPU function: [`Runtime::record_stage`]) | `runtime/start/standby.rs` |
//! | `TakeStandby` | standby → warm, or resuming | nothing | kept | `runtime/pool.rs` `acquire` |
//! | `Begin(step)` | warm / gpu_released / hibernated → changing | nothing | kept | the ticker, `acquire` |
//! | `Abort` | changing → where it began | nothing | kept | `runtime/keepalive.rs` |
//! | `ReleaseGpu` | releasing → gpu_released | warm | gpu_released | `runtime/keepalive.rs` `release_gpu` |
//! | `ResumeGpu` | resuming → warm (or on to its hibernation) | gpu_released | warm | `runtime/keepalive.rs` `gpu_resume` |
//! | `Quiesce` | changing to hibernated (from warm, or gpu_released kept released) → hibernating | nothing (the time goes to hibernating) | kept | `runtime/keepalive.rs` `hibernate_inner` |
//! | `Hibernate` | hibernating → hibernated | hibernating | hibernated, with its snapshot ([`Runtime::record_hibernation`]) | `runtime/keepalive.rs` `hibernate_inner` |
//! | `Evict` | evicting → evicted | hibernated | evicted | `runtime/keepalive.rs` `evict` |
//! | `Wake` | hibernated / evicted → starting | the stage left | kept, updated by `Adopt` | `runtime/start/mod.rs` (via [`Runtime::close_sleeper`]) |
//! | `Remove` | any live state → gone | nothing (the ticker accounted it) | deleted | [`Runtime::remove_instance`] |
//!
//! A transition [`Transition::apply`] refuses is logged and not taken (the state stays what it
//! was); one from `gone` is only a race with a removal, and is logged at debug level.
//! `starting` is the state of an instance that is not an [`Instance`] yet: its pool counts it
//! (`PoolState::starting`) and `Runtime::starts` meters it. The registry keeps four persisted
//! stages ([`Stage`]); [`State::stage`] maps each state to the row's stage.
//!
//! States that later work adds (a migration, a concurrent checkpoint, a sandbox member) are new
//! [`State`]s and [`Transition`]s here (a checkpoint of a serving instance, for one, would be a
//! [`Doing`] of its own, warm → checkpointing → warm), and, where they need a row of their own,
//! new `Stage`s in the registry.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tokio::net::unix::OwnedReadHalf;

use crate::protocol::{Attached, ToWorker};
use crate::registry::{now_ms, Instance as InstanceRow, Snapshot, SnapshotKind, Stage};
use crate::runtime::instance::{kill_tree, new_instance, Instance, Keep, Sleeper};
use crate::runtime::pool::{FnInfo, Pool};
use crate::runtime::Runtime;
use crate::sync::lock;
use crate::workers::{self, WorkerConn};

impl Runtime {
    /// Adds the time since the last account to `label` (`keep`'s stage, or hibernating), with
    /// the GPU memory last read for it; `reading`, where one was taken now, stands from now on.
    pub(crate) fn account(
        &self,
        function: &str,
        label: &str,
        keep: &mut Keep,
        reading: Option<u64>,
    ) {
        let charge = keep.meter.close(Instant::now(), reading);
        self.metrics.add_charge(function, label, charge);
    }

    /// The one checked way to change an instance's state: moves `keep` (an instance of
    /// `function`) along `t` when [`Transition::apply`] allows it from its state, first
    /// accounting the time since the last account to what [`Transition::charged_as`] says
    /// (between ticks nothing is read: the interval is charged at the last reading, as the next
    /// tick would have charged it). Returns the new state; a transition the state does not allow
    /// is refused and logged, and the state stays as it was.
    pub(crate) fn step(
        &self,
        function: &str,
        keep: &mut Keep,
        t: Transition,
    ) -> Result<State, Refused> {
        let from = keep.state;
        let Some(to) = t.apply(from) else {
            if from == State::Gone {
                // A removal won the race with this change: nothing left to change.
                tracing::debug!(function, transition = ?t, "a transition of a removed instance was not taken");
            } else {
                tracing::error!(function, from = ?from, transition = ?t, "an instance was asked to take a transition its state does not allow; it keeps its state");
            }
            return Err(Refused {
                from,
                transition: t,
            });
        };
        if let Some(label) = t.charged_as(from) {
            self.account(function, label, keep, None);
        }
        keep.state = to;
        Ok(to)
    }

    /// A hibernated instance (`sleeper`) is taken to be woken ([`Transition::Wake`]): its time
    /// as a sleeper is charged up to now (the start is metered as `starting` from here on).
    pub(crate) fn close_sleeper(&self, function: &str, sleeper: &mut Sleeper) {
        let _ = self.step(function, &mut sleeper.keep, Transition::Wake);
    }

    /// Records a stage in the registry (blocking pool).
    pub(crate) async fn record_stage(
        &self,
        id: &str,
        stage: Stage,
        pid: Option<i32>,
        snapshot: Option<String>,
    ) -> Result<(), RecordError> {
        self.record_stage_then(id, stage, pid, snapshot, || ())
            .await
    }

    /// [`Runtime::record_stage`], then `then` on the same thread right after the write: the
    /// pool's side of the change, so that no request sees the registry's new stage while the
    /// pool still has the old one.
    pub(crate) async fn record_stage_then<T: Send + 'static>(
        &self,
        id: &str,
        stage: Stage,
        pid: Option<i32>,
        snapshot: Option<String>,
        then: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RecordError> {
        let registry = Arc::clone(&self.registry);
        let instance = id.to_string();
        let id = instance.clone();
        let what = RecordError::stage_name(stage);
        tokio::task::spawn_blocking(move || {
            registry
                .with(|s| s.set_instance_stage(&id, stage, pid, snapshot.as_deref()))
                .map(|()| then())
        })
        .await
        .map_err(|source| RecordError::Task {
            instance: instance.clone(),
            source,
        })?
        .map_err(|source| RecordError::Registry {
            instance,
            what,
            source: Box::new(source),
        })
    }

    /// The registry rows of [`Transition::Hibernate`], in one transaction: the hibernation
    /// snapshot `hib_id` at `out`, and the instance's row at hibernated, pointing at it, last
    /// used at `idle_ms`. `joined` runs on the same thread right after the commit: the
    /// sleeper joins its pool there, so that no request can see the instance hibernated in the
    /// registry (`GET /v1/functions/{name}`) while the pool has neither it nor its sleeper,
    /// and restore a second instance from the function snapshot instead of waking this one.
    pub(crate) async fn record_hibernation<T: Send + 'static>(
        &self,
        inst: &Instance,
        hib_id: &str,
        out: &Path,
        idle_ms: i64,
        joined: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RecordError> {
        let row = Snapshot {
            id: hib_id.to_string(),
            kind: SnapshotKind::Hibernation,
            path: out.to_path_buf(),
            function: Some(inst.function.clone()),
            base_key: None,
            bytes: crate::runtime::process::dir_bytes(out),
            created: now_ms(),
        };
        let registry = Arc::clone(&self.registry);
        let id = inst.id.clone();
        let function = inst.function.clone();
        let h = hib_id.to_string();
        tokio::task::spawn_blocking(move || {
            registry
                .transaction(|s| {
                    let mut row = row;
                    row.base_key = s.function(&function)?.map(|f| f.base_key);
                    s.insert_snapshot(&row)?;
                    s.set_instance_stage(&id, Stage::Hibernated, None, Some(&h))?;
                    s.touch_instance(&id, idle_ms)?;
                    Ok::<_, crate::registry::RegistryError>(())
                })
                .map(|()| joined())
        })
        .await
        .map_err(|source| RecordError::Task {
            instance: inst.id.clone(),
            source,
        })?
        .map_err(|source| RecordError::Registry {
            instance: inst.id.clone(),
            what: "the hibernation",
            source: Box::new(source),
        })
    }

    /// Makes a connected worker an instance of the pool ([`Transition::Adopt`]): records it,
    /// starts its reader.
    pub(crate) async fn adopt(
        self: &Arc<Self>,
        id: &str,
        adopted: Adopted<'_>,
    ) -> Result<Arc<Instance>, AdoptError> {
        let Adopted {
            function: name,
            info,
            generation,
            woken: sleeper,
            tree,
            keep_hibernation,
            stage,
        } = adopted;
        let init = tree.init;
        let now = now_ms();
        let (inst, rd) = new_instance(
            id.to_string(),
            name,
            generation,
            tree,
            Keep::new(State::Starting, Instant::now()),
        );
        {
            let mut keep = lock(&inst.keep);
            let _ = self.step(name, &mut keep, Transition::Adopt);
        }
        // Which process it is, so that a restarted daemon re-adopts this one only.
        let Some(process_start) = workers::process_start(init) else {
            kill_tree(init);
            return Err(AdoptError::Exited {
                function: name.to_string(),
                init,
            });
        };
        let row = InstanceRow {
            id: inst.id.clone(),
            function: name.to_string(),
            pid: Some(init),
            stage,
            snapshot: Some(info.snapshot_id.clone()),
            started: now,
            last_used: now,
        };
        let registry = Arc::clone(&self.registry);
        let woken = sleeper.map(|s| s.snapshot_id.clone());
        let recorded = tokio::task::spawn_blocking(move || match woken {
            // A woken instance keeps its row; its hibernation snapshot has served.
            Some(hib) => registry.transaction(|s| {
                s.set_instance_stage(&row.id, row.stage, Some(init), row.snapshot.as_deref())?;
                s.touch_instance(&row.id, now)?;
                if !keep_hibernation {
                    s.delete_snapshot(&hib)?;
                }
                s.set_instance_process(&row.id, init, process_start)?;
                Ok::<_, crate::registry::RegistryError>(())
            }),
            None => registry.transaction(|s| {
                s.insert_instance(&row)?;
                s.set_instance_process(&row.id, init, process_start)
            }),
        })
        .await
        .map_err(|source| RecordError::Task {
            instance: id.to_string(),
            source,
        })
        .and_then(|r| {
            r.map_err(|source| RecordError::Registry {
                instance: id.to_string(),
                what: "the new instance",
                source: Box::new(source),
            })
        });
        if let Err(source) = recorded {
            kill_tree(init);
            return Err(AdoptError::Record {
                function: name.to_string(),
                source,
            });
        }
        self.attach(&inst, rd).await;
        Ok(inst)
    }

    /// Tells the worker it is in service (and how long to outlive a lost daemon), then starts
    /// its reader.
    pub(crate) async fn attach(self: &Arc<Self>, inst: &Arc<Instance>, rd: OwnedReadHalf) {
        if inst.announces_start {
            let frame = ToWorker::Attached(Attached {
                reattach_s: self.config.reattach.as_secs_f64(),
            });
            let sent = workers::send(&mut *inst.writer.lock().await, &frame).await;
            if let Err(e) = sent {
                // Its reader sees the end of the connection and removes it.
                tracing::debug!(instance = %inst.id, error = %e, "cannot send attached");
            }
        }
        let rt = Arc::clone(self);
        let reader_inst = Arc::clone(inst);
        tokio::spawn(async move { rt.read_results(reader_inst, rd).await });
    }

    /// Takes an instance out of service for good: fails its requests, kills its tree, drops
    /// its registry row. Idempotent.
    pub fn remove_instance(self: &Arc<Self>, inst: &Arc<Instance>, why: &str, kill: bool) {
        match lock(&self.pools).get(&inst.function).cloned() {
            Some(pool) => self.remove_instance_of(&pool, inst, why, kill),
            None => self.remove_instance_from(None, inst, why, kill),
        }
    }

    pub(crate) fn remove_instance_of(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
        why: &str,
        kill: bool,
    ) {
        self.remove_instance_from(Some(pool), inst, why, kill);
    }

    pub(crate) fn remove_instance_from(
        self: &Arc<Self>,
        pool: Option<&Arc<Pool>>,
        inst: &Arc<Instance>,
        why: &str,
        kill: bool,
    ) {
        // A worker the kernel killed for its cgroup's memory limit: say so, and how to raise it,
        // instead of "it closed its connection".
        let why = crate::cgroup::Cgroup::explain_death(inst.cgroup.as_ref(), why.to_string());
        let why = why.as_str();
        // Its memory went with its process (crate::runtime::memory).
        self.memory_forget(&inst.id);
        // So did the answers of keyed requests it held for a lost daemon: their retries run.
        self.keys.drop_held_by(&inst.id);
        {
            let mut keep = lock(&inst.keep);
            // Idempotent: removed already, or hibernated (its process went with the snapshot).
            if !keep.state.is_live() && keep.state != State::Starting {
                return;
            }
            // The cause first, then the state, under the state's lock: whoever sees the
            // instance dead (`Instance::is_dead`, e.g. a request about to be sent to it) finds
            // why. The other way round, a request racing a failed segment fill was answered
            // with the generic "closed its connection" instead of the fill's cause.
            *lock(&inst.why_dead) = Some(why.to_string());
            let _ = self.step(&inst.function, &mut keep, Transition::Remove);
            // Where a migration put it no longer matters.
            self.forget_placement(&inst.id);
        }
        // Dropping the senders fails every request still waiting on this instance.
        lock(&inst.pending).clear();
        lock(&inst.quiet_tx).take();
        // A step waiting for its segment replies sees the end.
        lock(&inst.segment_replies).take();
        lock(&inst.segments).clear();
        // Its hand-over, if one is still going, learns it from the dropped mapping.
        lock(&inst.mapping).take();
        inst.joined.notify_one();
        if kill {
            kill_tree(inst.init_pid);
        }
        if let Some(pool) = pool {
            lock(&pool.state)
                .instances
                .retain(|(i, _)| !Arc::ptr_eq(i, inst));
            pool.changed.notify_waiters();
        }
        if why.starts_with("retired") || why.starts_with("stopped: idle") {
            tracing::info!(instance = %inst.id, function = %inst.function, "instance removed: {why}");
        } else {
            let cgroup = inst
                .cgroup
                .as_ref()
                .map(|c| c.dirs()[0].display().to_string());
            tracing::warn!(instance = %inst.id, function = %inst.function, pid = inst.worker_pid, cgroup, "instance removed: {why}");
        }
        let registry = Arc::clone(&self.registry);
        let id = inst.id.clone();
        tokio::task::spawn_blocking(move || {
            // Critical: a row left behind would list a process that is gone.
            if let Err(e) = registry.remove_instance_row(&id) {
                tracing::error!(instance = %id, error = %e, "cannot remove the instance's registry row even after releasing the disk reserve: it is out of service and no longer listed; its row goes at a later row removal that succeeds, or at the next start");
            }
        });
    }
}

/// A registry write of a transition failed (the instance's state changed anyway: the row
/// follows at its next transition, or is cleaned at the next start).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The blocking task that writes the registry did not finish (it panicked, or the daemon is
    /// stopping).
    #[error("the registry task recording instance {instance} failed ({source}); torpord's log has the cause")]
    Task {
        instance: String,
        #[source]
        source: tokio::task::JoinError,
    },
    /// The registry refused the write (e.g. a full disk).
    #[error("cannot record {what} of instance {instance}: {source}")]
    Registry {
        instance: String,
        /// What was being recorded (`the gpu_released stage`, `the hibernation`, …).
        what: &'static str,
        /// Boxed: the registry's error is large, and this one travels in every start's result.
        #[source]
        source: Box<crate::registry::RegistryError>,
    },
}

impl RecordError {
    fn stage_name(stage: Stage) -> &'static str {
        match stage {
            Stage::Warm => "the warm stage",
            Stage::GpuReleased => "the gpu_released stage",
            Stage::Hibernated => "the hibernated stage",
            Stage::Evicted => "the evicted stage",
        }
    }
}

/// [`Runtime::adopt`] could not make a started worker an instance; its tree was killed.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The tree exited between its start and its record (its log under the state directory's
    /// `logs/` says why).
    #[error("the new instance of {function:?} (init pid {init}) exited before it was recorded")]
    Exited { function: String, init: i32 },
    /// Its registry row could not be written.
    #[error("cannot record the new instance of {function:?}: {source}")]
    Record {
        function: String,
        #[source]
        source: RecordError,
    },
}

/// A started worker tree, connected to the daemon: what every way of starting hands to
/// [`Runtime::adopt`].
pub(crate) struct WorkerTree {
    /// Host pid of its init (the root of its PID namespace).
    pub(crate) init: i32,
    /// Host pid of the worker (the Python process).
    pub(crate) worker: i32,
    pub(crate) conn: WorkerConn,
    /// Its cgroup, which the instance keeps.
    pub(crate) cgroup: Option<crate::cgroup::Cgroup>,
}

impl WorkerTree {
    pub(crate) fn new(
        init: i32,
        worker: i32,
        conn: WorkerConn,
        cgroup: Option<crate::cgroup::Cgroup>,
    ) -> Self {
        Self {
            init,
            worker,
            conn,
            cgroup,
        }
    }
}

/// What [`Runtime::adopt`] makes an instance of.
pub(crate) struct Adopted<'a> {
    pub(crate) function: &'a str,
    pub(crate) info: &'a FnInfo,
    /// The pool's deploy it belongs to.
    pub(crate) generation: u64,
    /// The hibernated instance it was woken from (it keeps its row and id).
    pub(crate) woken: Option<&'a Sleeper>,
    pub(crate) tree: WorkerTree,
    /// A woken instance whose lazy pages are still being served: its hibernation snapshot's
    /// row stays until they are in (crate::runtime::pages_pending::mark).
    pub(crate) keep_hibernation: bool,
    /// The stage its row is recorded in: warm, or gpu_released for a standby whose driver
    /// restore is still to come (so the API never lists one being made as warm, and a daemon
    /// restarted meanwhile does not take its checkpointed CUDA state for a live one).
    pub(crate) stage: Stage,
}

impl<'a> Adopted<'a> {
    pub(crate) fn new(
        function: &'a str,
        info: &'a FnInfo,
        generation: u64,
        woken: Option<&'a Sleeper>,
        tree: WorkerTree,
    ) -> Self {
        Self {
            function,
            info,
            generation,
            woken,
            tree,
            keep_hibernation: false,
            stage: Stage::Warm,
        }
    }

    /// See [`Adopted::keep_hibernation`].
    pub(crate) fn keeping_hibernation(mut self, keep: bool) -> Self {
        self.keep_hibernation = keep;
        self
    }

    /// See [`Adopted::stage`].
    pub(crate) fn in_stage(mut self, stage: Stage) -> Self {
        self.stage = stage;
        self
    }
}

/// Removes a snapshot directory the daemon wrote (a hibernation), logging a failure.
pub fn remove_snapshot_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove a hibernation snapshot");
        }
    }
    // Its segments in the chunk store, if it is a split snapshot, and its page profile.
    crate::split::release_snapshot_of_dir(dir);
    crate::profiles::remove_of_dir(dir);
}

/// A snapshot directory removed once the last holder drops it (e.g. a woken hibernation, read
/// by its segment fills and its lazy pages).
pub(crate) struct RemoveWhenDone(pub(crate) PathBuf);

impl Drop for RemoveWhenDone {
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.0);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || remove_snapshot_dir(&dir));
            }
            Err(_) => remove_snapshot_dir(&dir),
        }
    }
}

/// Where an instance is in its life (see the module doc for the diagram).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Being booted, restored or woken; no [`Instance`] exists yet, except between its
    /// creation and [`Transition::Adopt`] / [`Transition::Readopt`].
    Starting,
    /// Live, holding its GPU state: serves requests at once.
    Warm,
    /// Live, its CUDA state checkpointed in place (`gpus = 1`): a request resumes it first.
    GpuReleased,
    /// An unused standby (crate::runtime::start::standby), at rest in `Stage::Warm` (a CPU
    /// function) or `Stage::GpuReleased` (a GPU function, whose driver restore was put off):
    /// routed to last, never stepped down.
    Standby(Stage),
    /// A change is under way from the persisted stage `from`: not routable, not stepped down;
    /// charged as `from` until it is done or aborted.
    Changing(Stage, Doing),
    /// Quiesced and being snapshotted: charged `hibernating` until the snapshot is in; its
    /// reader hands the worker's `quiet` over to the hibernation.
    Hibernating,
    /// No process: a snapshot on disk (a [`Sleeper`]).
    Hibernated,
    /// Hibernated, its snapshot's pages dropped from the page cache.
    Evicted,
    /// Out of service for good (its process killed, its row deleted).
    Gone,
}

/// A change an instance is going through ([`State::Changing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doing {
    /// warm → gpu_released (the ticker).
    ReleaseGpu,
    /// gpu_released → warm, for a request.
    ResumeGpu,
    /// → hibernated (a gpu_released instance is resumed first, in place).
    Hibernate,
    /// hibernated → evicted.
    Evict,
    /// warm or gpu_released → gone: idle past `hibernate_s` with `cold_start = "boot"`.
    Stop,
    /// warm → warm on another GPU: the stop of a live migration (crate::runtime::migrate); it
    /// ends with `Abort`, back to warm, whether it moved or not.
    Migrate,
}

impl State {
    /// The instance's row's stage in the registry; `None` where it has no row of its own
    /// (starting, gone).
    pub fn stage(self) -> Option<Stage> {
        match self {
            State::Warm | State::Hibernating => Some(Stage::Warm),
            State::GpuReleased => Some(Stage::GpuReleased),
            State::Standby(stage) | State::Changing(stage, _) => Some(stage),
            State::Hibernated => Some(Stage::Hibernated),
            State::Evicted => Some(Stage::Evicted),
            State::Starting | State::Gone => None,
        }
    }

    /// What the ticker charges its time to; `None` where nothing is (its start is metered by
    /// `Runtime::starts`; a removed instance is charged no more).
    pub fn charged_as(self) -> Option<&'static str> {
        match self {
            State::Hibernating => Some(crate::metrics::HIBERNATING),
            State::Starting | State::Gone => None,
            other => other.stage().map(Stage::as_str),
        }
    }

    /// It has a process and may still serve: not starting, hibernated, evicted or gone.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            State::Warm
                | State::GpuReleased
                | State::Standby(_)
                | State::Changing(Stage::Warm | Stage::GpuReleased, _)
                | State::Hibernating
        )
    }

    /// A request may be routed to it (perhaps after a GPU resume).
    pub fn is_routable(self) -> bool {
        matches!(self, State::Warm | State::GpuReleased | State::Standby(_))
    }

    /// At rest and not a standby: the ticker may step it down.
    pub fn is_idle_stage(self) -> bool {
        matches!(
            self,
            State::Warm | State::GpuReleased | State::Hibernated | State::Evicted
        )
    }

    /// A state an instance loaded from its registry row starts in (an earlier daemon's
    /// instance, a hibernated instance listed at the pool's creation).
    pub fn at_rest(stage: Stage) -> State {
        match stage {
            Stage::Warm => State::Warm,
            Stage::GpuReleased => State::GpuReleased,
            Stage::Hibernated => State::Hibernated,
            Stage::Evicted => State::Evicted,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            State::Starting => f.write_str("starting"),
            State::Warm => f.write_str("warm"),
            State::GpuReleased => f.write_str("gpu_released"),
            State::Standby(s) => write!(f, "standby ({s})"),
            State::Changing(s, d) => write!(f, "{s}, {d:?} under way"),
            State::Hibernating => f.write_str("hibernating"),
            State::Hibernated => f.write_str("hibernated"),
            State::Evicted => f.write_str("evicted"),
            State::Gone => f.write_str("gone"),
        }
    }
}

/// The transitions between an instance's states (see the module doc's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// starting → warm: a started worker becomes an instance ([`Runtime::adopt`]).
    Adopt,
    /// starting → the row's live stage: an earlier daemon's instance taken back.
    Readopt(Stage),
    /// warm → standby: a standby start's instance, never served; on a GPU function in
    /// gpu_released from the start (the restore left its CUDA state checkpointed).
    Standby { gpu_released: bool },
    /// standby → warm (CPU) or resuming (GPU): a request takes it.
    TakeStandby,
    /// A resting state → changing: a keep-alive step, a resume or a stop begins.
    Begin(Doing),
    /// changing → the stage it began in: the change failed and the instance stays as it was.
    Abort,
    /// releasing → gpu_released: the CUDA state checkpointed in place.
    ReleaseGpu,
    /// resuming → warm (for a request), or a hibernation's resume → on to its hibernation.
    ResumeGpu,
    /// A hibernation (from warm) → hibernating: `quiesce` is sent.
    Quiesce,
    /// hibernating → hibernated: the snapshot is in, the process gone.
    Hibernate,
    /// evicting → evicted: its snapshot's pages dropped from the page cache.
    Evict,
    /// hibernated or evicted → starting: taken to be woken (crate::runtime::start::wake).
    Wake,
    /// any live state → gone.
    Remove,
}

/// A transition [`Transition::apply`] does not allow from the instance's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("an instance in state {from} cannot take {transition:?}")]
pub struct Refused {
    pub from: State,
    pub transition: Transition,
}

impl Transition {
    /// The state `self` leads to from `from`; `None`: not allowed from there.
    pub fn apply(self, from: State) -> Option<State> {
        use Doing as D;
        use Stage as S;
        use State as St;
        Some(match (self, from) {
            (Transition::Adopt, St::Starting) => St::Warm,
            (Transition::Readopt(stage @ (S::Warm | S::GpuReleased)), St::Starting) => {
                State::at_rest(stage)
            }
            (Transition::Standby { gpu_released }, St::Warm) => St::Standby(if gpu_released {
                S::GpuReleased
            } else {
                S::Warm
            }),
            (Transition::TakeStandby, St::Standby(S::Warm)) => St::Warm,
            (Transition::TakeStandby, St::Standby(S::GpuReleased)) => {
                St::Changing(S::GpuReleased, D::ResumeGpu)
            }
            (Transition::Begin(D::ReleaseGpu), St::Warm) => St::Changing(S::Warm, D::ReleaseGpu),
            (Transition::Begin(D::Migrate), St::Warm) => St::Changing(S::Warm, D::Migrate),
            (Transition::Begin(D::ResumeGpu), St::GpuReleased) => {
                St::Changing(S::GpuReleased, D::ResumeGpu)
            }
            (Transition::Begin(d @ (D::Hibernate | D::Stop)), St::Warm | St::GpuReleased) => {
                St::Changing(from.stage()?, d)
            }
            (Transition::Begin(D::Evict), St::Hibernated) => St::Changing(S::Hibernated, D::Evict),
            (Transition::Abort, St::Changing(stage, _)) => State::at_rest(stage),
            (Transition::ReleaseGpu, St::Changing(S::Warm, D::ReleaseGpu)) => St::GpuReleased,
            (Transition::ResumeGpu, St::Changing(S::GpuReleased, D::ResumeGpu)) => St::Warm,
            (Transition::ResumeGpu, St::Changing(S::GpuReleased, D::Hibernate)) => {
                St::Changing(S::Warm, D::Hibernate)
            }
            // From gpu_released: a hibernation that does not resume the GPU (keepalive.rs).
            (Transition::Quiesce, St::Changing(S::Warm | S::GpuReleased, D::Hibernate)) => {
                St::Hibernating
            }
            (Transition::Hibernate, St::Hibernating) => St::Hibernated,
            (Transition::Evict, St::Changing(S::Hibernated, D::Evict)) => St::Evicted,
            (Transition::Wake, St::Hibernated | St::Evicted) => St::Starting,
            (Transition::Remove, from) if from.is_live() || from == St::Starting => St::Gone,
            _ => return None,
        })
    }

    /// The metrics label the time up to the transition is charged to, leaving `from`; `None`:
    /// nothing is charged (the time goes to the new state, whose label is the same, or the
    /// start's meter takes over).
    pub fn charged_as(self, from: State) -> Option<&'static str> {
        match self {
            Transition::ReleaseGpu
            | Transition::ResumeGpu
            | Transition::Hibernate
            | Transition::Evict
            | Transition::Wake => from.charged_as(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOINGS: [Doing; 5] = [
        Doing::ReleaseGpu,
        Doing::ResumeGpu,
        Doing::Hibernate,
        Doing::Evict,
        Doing::Stop,
    ];

    fn states() -> Vec<State> {
        let mut all = vec![
            State::Starting,
            State::Warm,
            State::GpuReleased,
            State::Standby(Stage::Warm),
            State::Standby(Stage::GpuReleased),
            State::Hibernating,
            State::Hibernated,
            State::Evicted,
            State::Gone,
        ];
        for stage in [Stage::Warm, Stage::GpuReleased, Stage::Hibernated] {
            for d in DOINGS {
                all.push(State::Changing(stage, d));
            }
        }
        all
    }

    fn transitions() -> Vec<Transition> {
        let mut all = vec![
            Transition::Adopt,
            Transition::Standby { gpu_released: true },
            Transition::Standby {
                gpu_released: false,
            },
            Transition::TakeStandby,
            Transition::Abort,
            Transition::ReleaseGpu,
            Transition::ResumeGpu,
            Transition::Quiesce,
            Transition::Hibernate,
            Transition::Evict,
            Transition::Wake,
            Transition::Remove,
        ];
        for stage in [
            Stage::Warm,
            Stage::GpuReleased,
            Stage::Hibernated,
            Stage::Evicted,
        ] {
            all.push(Transition::Readopt(stage));
        }
        for d in DOINGS {
            all.push(Transition::Begin(d));
        }
        all
    }

    #[test]
    fn nothing_leaves_gone_and_only_a_hibernation_ends_a_process_in_place() {
        for t in transitions() {
            assert_eq!(t.apply(State::Gone), None, "{t:?}");
            for from in states() {
                let Some(to) = t.apply(from) else { continue };
                assert_ne!(from, to, "{t:?} from {from:?} must change the state");
                // Only a hibernation (and a removal, and a wake of what has no process) moves a
                // live instance to a state without a process.
                if from.is_live() && !to.is_live() {
                    assert!(
                        matches!(t, Transition::Hibernate | Transition::Remove),
                        "{t:?} from {from:?}"
                    );
                }
                // Nothing brings a process back in place: only a start does.
                if !from.is_live() && to.is_live() {
                    assert!(
                        matches!(t, Transition::Adopt | Transition::Readopt(_)),
                        "{t:?} from {from:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_change_under_way_is_neither_routed_nor_stepped_down_and_ends_where_it_began_on_abort() {
        for from in states() {
            if let State::Changing(stage, _) = from {
                assert!(!from.is_routable() && !from.is_idle_stage(), "{from:?}");
                assert_eq!(Transition::Abort.apply(from), Some(State::at_rest(stage)));
                // Until it is done it is charged as where it began.
                assert_eq!(from.charged_as(), Some(stage.as_str()));
            }
        }
        assert!(!State::Hibernating.is_routable());
        assert!(!State::Standby(Stage::Warm).is_idle_stage());
    }

    #[test]
    fn a_release_a_resume_a_hibernation_and_an_eviction_follow_their_paths() {
        let walk = |from: State, path: &[Transition]| {
            path.iter().fold(from, |s, t| {
                t.apply(s)
                    .unwrap_or_else(|| panic!("{t:?} refused from {s:?}"))
            })
        };
        use Transition as T;
        assert_eq!(
            walk(
                State::Starting,
                &[T::Adopt, T::Begin(Doing::ReleaseGpu), T::ReleaseGpu]
            ),
            State::GpuReleased
        );
        assert_eq!(
            walk(
                State::GpuReleased,
                &[
                    T::Begin(Doing::Hibernate),
                    T::ResumeGpu,
                    T::Quiesce,
                    T::Hibernate,
                    T::Begin(Doing::Evict),
                    T::Evict,
                    T::Wake,
                    T::Adopt
                ]
            ),
            State::Warm
        );
        assert_eq!(
            walk(
                State::Warm,
                &[
                    T::Standby { gpu_released: true },
                    T::TakeStandby,
                    T::ResumeGpu
                ]
            ),
            State::Warm
        );
        // A hibernation from gpu_released either resumes first or quiesces it as it is.
        assert_eq!(
            walk(
                State::GpuReleased,
                &[T::Begin(Doing::Hibernate), T::Quiesce, T::Hibernate]
            ),
            State::Hibernated
        );
        // But not one resuming for a request.
        assert_eq!(
            T::Quiesce.apply(State::Changing(Stage::GpuReleased, Doing::ResumeGpu)),
            None
        );
        // An earlier daemon's row never re-adopts a process that has none.
        assert_eq!(T::Readopt(Stage::Hibernated).apply(State::Starting), None);
    }

    #[test]
    fn the_time_before_a_transition_goes_to_the_stage_left_except_hibernating_and_standby() {
        let changing = |s, d| State::Changing(s, d);
        assert_eq!(
            Transition::ReleaseGpu.charged_as(changing(Stage::Warm, Doing::ReleaseGpu)),
            Some("warm")
        );
        assert_eq!(
            Transition::ResumeGpu.charged_as(changing(Stage::GpuReleased, Doing::ResumeGpu)),
            Some("gpu_released")
        );
        assert_eq!(
            Transition::Evict.charged_as(changing(Stage::Hibernated, Doing::Evict)),
            Some("hibernated")
        );
        assert_eq!(
            Transition::Hibernate.charged_as(State::Hibernating),
            Some("hibernating")
        );
        assert_eq!(
            Transition::Standby { gpu_released: true }.charged_as(State::Warm),
            None
        );
        assert_eq!(State::Hibernating.stage(), Some(Stage::Warm));
        assert_eq!(
            State::Standby(Stage::GpuReleased).charged_as(),
            Some("gpu_released")
        );
    }
}
