//! Queries of the step journal (crate::journal) and of why a function's last deploy failed.

use rusqlite::{OptionalExtension, Row};

use super::model::JournalOp;
use super::store::Store;
use super::RegistryError;

/// One operation in progress: the step it is in (recorded before the step acts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalEntry {
    pub op: JournalOp,
    /// The function (deploy) or instance (hibernation) id.
    pub subject: String,
    /// The step being taken (a deploy's phase names: `boot_base`, `load`, …).
    pub step: String,
    /// A redeploy: the snapshot that served before it began.
    pub previous: Option<String>,
    /// The snapshot directory the step writes, if it writes one.
    pub target: Option<String>,
    pub started: i64,
    pub updated: i64,
}

fn entry_row(row: &Row<'_>) -> rusqlite::Result<JournalEntry> {
    Ok(JournalEntry {
        op: row.get(0)?,
        subject: row.get(1)?,
        step: row.get(2)?,
        previous: row.get(3)?,
        target: row.get(4)?,
        started: row.get(5)?,
        updated: row.get(6)?,
    })
}

impl Store<'_> {
    /// Starts (or restarts) the journal of `op` on `subject` at `step`.
    pub fn journal_begin(
        &self,
        op: JournalOp,
        subject: &str,
        step: &str,
        previous: Option<&str>,
        now: i64,
    ) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached(
                "INSERT INTO journal (op, subject, step, previous, target, started, updated) \
                 VALUES (?1, ?2, ?3, ?4, NULL, ?5, ?5) \
                 ON CONFLICT (op, subject) DO UPDATE SET step = excluded.step, \
                 previous = excluded.previous, target = NULL, started = excluded.started, \
                 updated = excluded.updated",
            )?
            .execute((op, subject, step, previous, now))?;
        Ok(())
    }

    /// Records the next step of a journal begun with [`Store::journal_begin`], and the
    /// snapshot directory it writes (kept from the step before when `None`).
    pub fn journal_step(
        &self,
        op: JournalOp,
        subject: &str,
        step: &str,
        target: Option<&str>,
        now: i64,
    ) -> Result<(), RegistryError> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE journal SET step = ?3, target = COALESCE(?4, target), updated = ?5 \
                 WHERE op = ?1 AND subject = ?2",
            )?
            .execute((op, subject, step, target, now))?;
        if n == 0 {
            return Err(RegistryError::NotFound {
                what: "journal entry",
                key: format!("{} {subject}", op.as_str()),
            });
        }
        Ok(())
    }

    /// Ends a journal: the operation finished or was undone. Whether it existed.
    pub fn journal_end(&self, op: JournalOp, subject: &str) -> Result<bool, RegistryError> {
        let n = self
            .conn
            .prepare_cached("DELETE FROM journal WHERE op = ?1 AND subject = ?2")?
            .execute((op, subject))?;
        Ok(n > 0)
    }

    /// Every operation in progress, oldest first.
    pub fn journal(&self) -> Result<Vec<JournalEntry>, RegistryError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT op, subject, step, previous, target, started, updated FROM journal \
             ORDER BY started, op, subject",
        )?;
        let rows = stmt.query_map([], entry_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records why the last deploy of `function` failed.
    pub fn set_function_failure(
        &self,
        function: &str,
        message: &str,
        now: i64,
    ) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached(
                "INSERT INTO function_failures (function, message, at) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (function) DO UPDATE SET message = excluded.message, at = excluded.at",
            )?
            .execute((function, message, now))?;
        Ok(())
    }

    /// Why the last deploy of `function` failed, if it did.
    pub fn function_failure(&self, function: &str) -> Result<Option<String>, RegistryError> {
        Ok(self
            .conn
            .prepare_cached("SELECT message FROM function_failures WHERE function = ?1")?
            .query_row([function], |r| r.get(0))
            .optional()?)
    }

    /// Forgets why `function`'s last deploy failed (a deploy of it began or succeeded).
    pub fn clear_function_failure(&self, function: &str) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached("DELETE FROM function_failures WHERE function = ?1")?
            .execute([function])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Function, FunctionState, Registry};

    #[test]
    fn a_journal_records_steps_and_ends() {
        let tmp = tempfile::tempdir().unwrap();
        let reg = Registry::open(&tmp.path().join("r.db")).unwrap();
        reg.with(|s| {
            s.journal_begin(JournalOp::Deploy, "f", "validate", Some("fn-f-1"), 10)?;
            s.journal_step(JournalOp::Deploy, "f", "boot_base", None, 11)?;
            s.journal_step(
                JournalOp::Deploy,
                "f",
                "snapshot_base",
                Some("/s/base-1"),
                12,
            )?;
            s.journal_step(JournalOp::Deploy, "f", "load", None, 13)?;
            let rows = s.journal()?;
            assert_eq!(
                rows,
                vec![JournalEntry {
                    op: JournalOp::Deploy,
                    subject: "f".into(),
                    step: "load".into(),
                    previous: Some("fn-f-1".into()),
                    target: Some("/s/base-1".into()),
                    started: 10,
                    updated: 13,
                }]
            );
            assert!(s.journal_end(JournalOp::Deploy, "f")?);
            assert!(!s.journal_end(JournalOp::Deploy, "f")?);
            assert!(s.journal()?.is_empty());
            let missing = s.journal_step(JournalOp::Hibernate, "i", "snapshot", None, 14);
            assert!(matches!(missing, Err(RegistryError::NotFound { .. })));
            Ok::<_, RegistryError>(())
        })
        .unwrap();
    }

    #[test]
    fn a_failure_goes_with_its_function() {
        let tmp = tempfile::tempdir().unwrap();
        let reg = Registry::open(&tmp.path().join("r.db")).unwrap();
        reg.with(|s| {
            s.insert_function(&Function {
                name: "f".into(),
                dir: "/f".into(),
                spec: serde_json::json!({"name": "f"}),
                base_key: "k".into(),
                snapshot: None,
                state: FunctionState::Failed,
                created: 1,
                updated: 1,
            })?;
            s.set_function_failure("f", "first", 2)?;
            s.set_function_failure("f", "second", 3)?;
            assert_eq!(s.function_failure("f")?.as_deref(), Some("second"));
            s.clear_function_failure("f")?;
            assert_eq!(s.function_failure("f")?, None);
            s.set_function_failure("f", "again", 4)?;
            s.delete_function("f")?;
            assert_eq!(s.function_failure("f")?, None);
            Ok::<_, RegistryError>(())
        })
        .unwrap();
    }
}
