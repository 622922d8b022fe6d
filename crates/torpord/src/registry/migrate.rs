//! The registry's schema and its migrations.
//!
//! `MIGRATIONS[i]` takes the schema from version `i` to `i + 1`; version 0 is an empty
//! database. Each runs in its own transaction together with the version bump, so a crash
//! leaves the database at one version or the next, never in between. A migration, once
//! released, is never edited: changes are new entries.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use super::model::now_ms;
use super::RegistryError;

/// The schema version this build writes.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

const MIGRATIONS: &[&str] = &[
    // 0 → 1: functions, snapshots, instances.
    r#"
    CREATE TABLE functions (
        name      TEXT PRIMARY KEY,
        dir       TEXT NOT NULL,
        spec_json TEXT NOT NULL CHECK (json_valid(spec_json)),
        base_key  TEXT NOT NULL,
        snapshot  TEXT REFERENCES snapshots(id) ON DELETE SET NULL,
        state     TEXT NOT NULL CHECK (state IN ('deploying', 'ready', 'failed')),
        created   INTEGER NOT NULL,
        updated   INTEGER NOT NULL
    ) STRICT;

    CREATE TABLE snapshots (
        id       TEXT PRIMARY KEY,
        kind     TEXT NOT NULL CHECK (kind IN ('base', 'function', 'hibernation')),
        path     TEXT NOT NULL UNIQUE,
        function TEXT REFERENCES functions(name) ON DELETE CASCADE,
        base_key TEXT,
        bytes    INTEGER NOT NULL CHECK (bytes >= 0),
        created  INTEGER NOT NULL,
        CHECK ((kind = 'base') = (function IS NULL)),
        CHECK (kind != 'base' OR base_key IS NOT NULL)
    ) STRICT;
    CREATE INDEX snapshots_by_function ON snapshots(function);
    CREATE UNIQUE INDEX one_base_per_key ON snapshots(base_key) WHERE kind = 'base';

    CREATE TABLE instances (
        id        TEXT PRIMARY KEY,
        function  TEXT NOT NULL REFERENCES functions(name) ON DELETE CASCADE,
        pid       INTEGER,
        stage     TEXT NOT NULL
                  CHECK (stage IN ('warm', 'gpu_released', 'hibernated', 'evicted')),
        snapshot  TEXT REFERENCES snapshots(id) ON DELETE SET NULL,
        started   INTEGER NOT NULL,
        last_used INTEGER NOT NULL,
        CHECK ((stage IN ('warm', 'gpu_released')) = (pid IS NOT NULL))
    ) STRICT;
    CREATE INDEX instances_by_function ON instances(function);
    "#,
    // 1 → 2: which process a live instance is, so that a restarted daemon re-adopts only that
    // process and never one that reused its pid (start time in clock ticks after boot, from
    // /proc/PID/stat).
    r#"
    CREATE TABLE instance_processes (
        instance TEXT PRIMARY KEY REFERENCES instances(id) ON DELETE CASCADE,
        pid      INTEGER NOT NULL,
        start    INTEGER NOT NULL CHECK (start >= 0)
    ) STRICT;
    "#,
    // 2 → 3: the step journal of deploys and hibernations (crate::journal), written before each
    // step acts so that a restarted daemon finishes or undoes what a crash interrupted, and why
    // a function's last deploy failed.
    r#"
    CREATE TABLE journal (
        op       TEXT NOT NULL CHECK (op IN ('deploy', 'hibernate')),
        subject  TEXT NOT NULL,
        step     TEXT NOT NULL,
        previous TEXT,
        target   TEXT,
        started  INTEGER NOT NULL,
        updated  INTEGER NOT NULL,
        PRIMARY KEY (op, subject)
    ) STRICT;

    CREATE TABLE function_failures (
        function TEXT PRIMARY KEY REFERENCES functions(name) ON DELETE CASCADE,
        message  TEXT NOT NULL,
        at       INTEGER NOT NULL
    ) STRICT;
    "#,
    // 3 → 4: each tenant's number, from 0 in the order they were first seen, never reused: its
    // workers run as uid and gid workers.uid_base + number (crate::users, docs/security.md).
    r#"
    CREATE TABLE tenant_numbers (
        tenant TEXT PRIMARY KEY,
        number INTEGER NOT NULL UNIQUE CHECK (number >= 0)
    ) STRICT;
    "#,
    // 4 → 5: each function's memory model, measured at its deploy by its pool (a sandbox
    // admits a request where its peak fits: crate::runtime::memory).
    r#"
    CREATE TABLE function_memory (
        function     TEXT PRIMARY KEY REFERENCES functions(name) ON DELETE CASCADE,
        backend      TEXT NOT NULL CHECK (backend IN ('cuda', 'host')),
        resident     INTEGER NOT NULL CHECK (resident >= 0),
        request_peak INTEGER NOT NULL CHECK (request_peak >= 0),
        measured     INTEGER NOT NULL
    ) STRICT;
    "#,
    // 5 → 6: the journal records migrations between GPUs too (crate::runtime::migrate): the
    // table is made again with the wider CHECK (SQLite cannot alter one), its rows kept.
    r#"
    CREATE TABLE journal_6 (
        op       TEXT NOT NULL CHECK (op IN ('deploy', 'hibernate', 'migrate')),
        subject  TEXT NOT NULL,
        step     TEXT NOT NULL,
        previous TEXT,
        target   TEXT,
        started  INTEGER NOT NULL,
        updated  INTEGER NOT NULL,
        PRIMARY KEY (op, subject)
    ) STRICT;
    INSERT INTO journal_6 SELECT op, subject, step, previous, target, started, updated FROM journal;
    DROP TABLE journal;
    ALTER TABLE journal_6 RENAME TO journal;
    "#,
];

/// The schema version of `conn`'s database (0 when empty).
pub fn current_version(conn: &Connection) -> Result<u32, rusqlite::Error> {
    let has_table: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_schema \
         WHERE type = 'table' AND name = 'schema_version')",
        [],
        |row| row.get(0),
    )?;
    if !has_table {
        return Ok(0);
    }
    let version: Option<u32> = conn
        .query_row(
            "SELECT version FROM schema_version WHERE id = 1",
            [],
            |row| row.get(0),
        )
        .optional()?;
    Ok(version.unwrap_or(0))
}

/// Brings the database to [`SCHEMA_VERSION`]; refuses one written by a newer torpord.
/// Returns the version it started from.
pub fn migrate(conn: &mut Connection, path: &std::path::Path) -> Result<u32, RegistryError> {
    let found = current_version(conn)?;
    if found > SCHEMA_VERSION {
        return Err(RegistryError::TooNew {
            path: path.to_path_buf(),
            found,
            known: SCHEMA_VERSION,
        });
    }
    for version in found..SCHEMA_VERSION {
        let fail = |source| RegistryError::Migrate {
            path: path.to_path_buf(),
            to: version + 1,
            source,
        };
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Exclusive)
            .map_err(fail)?;
        // Another daemon may have migrated between the check and the lock.
        if current_version(&tx).map_err(fail)? != version {
            return Err(RegistryError::Concurrent {
                path: path.to_path_buf(),
            });
        }
        tx.execute_batch(
            "CREATE TABLE IF NOT EXISTS schema_version (\
                 id INTEGER PRIMARY KEY CHECK (id = 1), \
                 version INTEGER NOT NULL, \
                 migrated INTEGER NOT NULL) STRICT;",
        )
        .map_err(fail)?;
        tx.execute_batch(MIGRATIONS[version as usize])
            .map_err(fail)?;
        tx.execute(
            "INSERT INTO schema_version (id, version, migrated) VALUES (1, ?1, ?2) \
             ON CONFLICT (id) DO UPDATE SET version = excluded.version, \
             migrated = excluded.migrated",
            (version + 1, now_ms()),
        )
        .map_err(fail)?;
        tx.commit().map_err(fail)?;
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The database at `version`, as that torpord left it.
    fn at(version: u32) -> Connection {
        let mut conn = Connection::open_in_memory().unwrap();
        for v in 0..version {
            let tx = conn.transaction().unwrap();
            tx.execute_batch(MIGRATIONS[v as usize]).unwrap();
            tx.commit().unwrap();
        }
        conn.execute_batch(&format!(
            "CREATE TABLE schema_version (id INTEGER PRIMARY KEY CHECK (id = 1), \
             version INTEGER NOT NULL, migrated INTEGER NOT NULL) STRICT; \
             INSERT INTO schema_version VALUES (1, {version}, 0);"
        ))
        .unwrap();
        conn
    }

    /// Inserts a journal row of `op` on `subject`.
    fn journal_row(conn: &Connection, op: &str, subject: &str) -> rusqlite::Result<usize> {
        conn.execute(
            "INSERT INTO journal VALUES (?1, ?2, 'quiet', NULL, '/s/hib-1', 1, 2)",
            (op, subject),
        )
    }

    #[test]
    fn the_journal_keeps_its_rows_and_takes_migrations_from_version_6() {
        let mut conn = at(5);
        journal_row(&conn, "hibernate", "i-1").unwrap();
        assert!(
            journal_row(&conn, "migrate", "i-2").is_err(),
            "version 5 takes no migration row"
        );
        assert_eq!(migrate(&mut conn, Path::new("mem")).unwrap(), 5);
        assert_eq!(current_version(&conn).unwrap(), SCHEMA_VERSION);
        let kept: (String, String, String, Option<String>) = conn
            .query_row("SELECT op, subject, step, target FROM journal", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .unwrap();
        let want = ("hibernate", "i-1", "quiet", Some("/s/hib-1"));
        assert_eq!(
            (
                kept.0.as_str(),
                kept.1.as_str(),
                kept.2.as_str(),
                kept.3.as_deref()
            ),
            want
        );
        journal_row(&conn, "migrate", "i-2").unwrap();
        assert!(
            journal_row(&conn, "other", "i-3").is_err(),
            "the CHECK still refuses an unknown op"
        );
    }
}
