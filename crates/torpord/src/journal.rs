//! The step journal of deploys and hibernations: each step is written to the registry (table
//! `journal`) before it acts, so that a daemon killed in the middle of one leaves a record of
//! what it was doing, and the next daemon finishes or undoes it (crate::recovery). A journal
//! ends when its operation finished or failed cleanly.
//!
//! The journal is a record, never a gate: a step whose record cannot be written (a full disk)
//! still runs, with a warning, since refusing it would leave the same state a crash does and
//! recovery copes with a missing or stale step.

use std::sync::Arc;

use crate::registry::{now_ms, JournalOp, Registry};

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
        let step = step.to_string();
        j.write(move |r, op, subject| {
            r.with(|s| s.journal_begin(op, subject, &step, None, now_ms()))
        })
        .await;
        j
    }

    /// Records that `step` is about to act, writing into `target` (a snapshot directory) if
    /// given.
    pub async fn step(&self, step: &str, target: Option<&std::path::Path>) {
        let step = step.to_string();
        let target = target.map(|t| t.to_string_lossy().into_owned());
        self.write(move |r, op, subject| {
            r.with(|s| s.journal_step(op, subject, &step, target.as_deref(), now_ms()))
        })
        .await;
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
