//! The step journal of deploys, hibernations and migrations' stops: each step is written to the registry (table
//! `journal`) before it acts, so that a daemon killed in the middle of one leaves a record of
//! what it was doing, and the next daemon finishes or undoes it (crate::recovery). A journal
//! ends when its operation finished or failed cleanly.
//!
//! The journal is a record, never a gate: a step whose record cannot be written (a full disk)
//! still runs, with a warning, since refusing it would leave the same state a crash does and
//! recovery copes with a missing or stale step.
//!
//! A test switch holds an operation right after one of its steps is recorded, so that a crash
//! test can kill the daemon exactly there: `TORPORD_HOLD=<op>:<step>` (e.g.
//! `hibernate:quiet`) makes that step wait [`HOLD`] before it acts, logging that it does.

use std::sync::Arc;
use std::time::Duration;

use crate::registry::{now_ms, JournalOp, Registry};

/// The environment variable of the test switch (see the module docs).
pub const HOLD_ENV: &str = "TORPORD_HOLD";

/// How long a held step waits (long enough for a test to kill the daemon, short enough that a
/// switch left set by mistake is seen as a stall, not a hang).
pub const HOLD: Duration = Duration::from_secs(60);

/// The environment variable of the timing switch: `TORPORD_DELAY=<point>:<ms>` makes the
/// daemon wait that long at `point` (logged), so that a test can act inside a window that is
/// otherwise too short to hit: `precopy` (a hibernation's pre-copy has read the segments, the
/// instance still serving), `hibernate-stop` (a hibernation's stop, after the worker's quiet),
/// `restored` / `woken` (a cold start's / a wake's restore: CRIU restored the tree, its worker
/// not yet woken, nothing adopted), `pages-served` (a lazily restored instance's pages are in,
/// its pages-pending marker not yet removed), `map-frames` (a split restore's instance is in
/// its pool, its `map` frames not sent yet), `hibernate-flush` (a hibernation recorded, its
/// snapshot not yet flushed to disk).
pub const DELAY_ENV: &str = "TORPORD_DELAY";

/// Waits as [`DELAY_ENV`] says for `point`, if it names it.
pub async fn delay(point: &str) {
    if let Some(ms) = torpor_snapshot::fault::delay_ms(DELAY_ENV, point) {
        tracing::warn!(point, ms, "{DELAY_ENV} delays this point");
        tokio::time::sleep(Duration::from_millis(ms.min(HOLD.as_millis() as u64))).await;
    }
}

/// The environment variable of the fault switch: `TORPORD_FAULT=<point>` makes the daemon fail
/// at `point` as if that step had failed, so that the rollback from there is tested with the
/// real worker and CRIU: `migrate:precopy`, `migrate:unmap`, `migrate:copy`, `migrate:residue`,
/// `migrate:map` (crate::runtime::migrate).
pub const FAULT_ENV: &str = "TORPORD_FAULT";

/// Whether [`FAULT_ENV`] names `point`.
pub fn fault(point: &str) -> bool {
    std::env::var(FAULT_ENV).is_ok_and(|v| v.trim() == point)
}

/// Whether `TORPORD_HOLD` names `op`'s `step`.
fn held(op: JournalOp, step: &str) -> bool {
    std::env::var(HOLD_ENV).is_ok_and(|v| v.trim().split_once(':') == Some((op.as_str(), step)))
}

/// The journal of one operation.
pub struct Journal {
    registry: Arc<Registry>,
    op: JournalOp,
    subject: String,
}

impl Journal {
    /// The journal of `op` on `subject`, begun elsewhere (a deploy begins its journal in the
    /// transaction that marks the function deploying).
    pub fn of(registry: &Arc<Registry>, op: JournalOp, subject: &str) -> Self {
        Self {
            registry: Arc::clone(registry),
            op,
            subject: subject.to_string(),
        }
    }

    /// Begins the journal of `op` on `subject` at `step`.
    pub async fn begin(registry: &Arc<Registry>, op: JournalOp, subject: &str, step: &str) -> Self {
        let j = Self::of(registry, op, subject);
        let name = step.to_string();
        j.write(move |r, op, subject| {
            r.with(|s| s.journal_begin(op, subject, &name, None, now_ms()))
        })
        .await;
        j.hold(step).await;
        j
    }

    /// Records that `step` is about to act, writing into `target` (a snapshot directory) if
    /// given.
    pub async fn step(&self, step: &str, target: Option<&std::path::Path>) {
        let name = step.to_string();
        let target = target.map(|t| t.to_string_lossy().into_owned());
        self.write(move |r, op, subject| {
            r.with(|s| s.journal_step(op, subject, &name, target.as_deref(), now_ms()))
        })
        .await;
        self.hold(step).await;
    }

    /// The test switch [`HOLD_ENV`]: waits [`HOLD`] when it names this step.
    async fn hold(&self, step: &str) {
        if held(self.op, step) {
            tracing::warn!(op = self.op.as_str(), subject = %self.subject, step, "{HOLD_ENV} holds this step for {} s", HOLD.as_secs());
            tokio::time::sleep(HOLD).await;
        }
    }

    /// Ends the journal: the operation is over, done or undone.
    pub async fn end(self) {
        self.write(|r, op, subject| r.critical(|s| s.journal_end(op, subject).map(|_| ())))
            .await;
    }

    async fn write(
        &self,
        f: impl FnOnce(&Registry, JournalOp, &str) -> Result<(), crate::registry::RegistryError>
            + Send
            + 'static,
    ) {
        let (registry, op, subject) = (Arc::clone(&self.registry), self.op, self.subject.clone());
        let written = tokio::task::spawn_blocking(move || f(&registry, op, &subject)).await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(op = self.op.as_str(), subject = %self.subject, error = %e, "cannot write the step journal: a crash now is recovered from the last step recorded")
            }
            Err(e) => tracing::error!(error = %e, "journal task failed"),
        }
    }
}

/// The steps of a hibernation's journal (crate::runtime::keepalive; replayed by crate::recovery), in order. Each is
/// recorded before it acts.
/// The steps of a migration's stop (crate::runtime::migrate), each recorded before it acts.
/// From the first the worker may have released its segments, whose memory only the daemon
/// holds then: a daemon that dies in the stop leaves an instance that cannot serve, which the
/// next one removes (crate::recovery).
pub mod migration_step {
    /// The worker is about to unmap its segments (it serves no request since the drain).
    pub const UNMAP: &str = "unmap";
    /// The blocks that changed since the pre-copy go to the new memory.
    pub const COPY: &str = "copy";
    /// The driver moves the CUDA residue to the target GPU (a GPU function).
    pub const RESIDUE: &str = "residue";
    /// The new memory is mapped at the segments' addresses.
    pub const MAP: &str = "map";
    pub const ALL: &[&str] = &[UNMAP, COPY, RESIDUE, MAP];
}

pub mod hibernation_step {
    /// `quiesce` is about to be sent: the worker serves on until it reads it.
    pub const QUIESCE: &str = "quiesce";
    /// The worker answered `quiet` and closed its connection: it waits for SIGUSR2.
    pub const QUIET: &str = "quiet";
    /// Split path: the segments go to the chunk store and the worker releases them (the split
    /// path's last step before `record`). From here the worker may hold none of the memory the
    /// daemon handed it, and what the daemon saved of it dies with the daemon: a crash from
    /// here cannot be undone.
    pub const SEGMENTS: &str = "segments";
    /// CRIU dumps the tree (frozen with SIGSTOP until the snapshot is committed, then killed).
    pub const DUMP: &str = "dump";
    /// The snapshot is committed and the tree killed: the registry records the hibernation.
    pub const RECORD: &str = "record";
    pub const ALL: &[&str] = &[QUIESCE, QUIET, SEGMENTS, DUMP, RECORD];
}
