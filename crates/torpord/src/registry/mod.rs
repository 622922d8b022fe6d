//! The daemon's registry: functions, snapshots and instances in SQLite (`registry.db` in the
//! state directory), in WAL mode with foreign keys on and a versioned, migrated schema.
//!
//! One connection, behind a mutex: every operation is short, and callers on the async side run
//! them on the blocking pool. Queries are typed methods of [`Store`]; [`Registry::with`] runs
//! some without a transaction, [`Registry::transaction`] runs some atomically.

mod journal;
mod memory;
mod migrate;
mod model;
mod reserve;
mod store;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

pub use journal::JournalEntry;
pub use migrate::SCHEMA_VERSION;
pub use model::*;
pub use reserve::{is_disk_full, Reserve, RESERVE_BYTES};
pub use store::Store;

/// A registry operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The database file cannot be opened or set up.
    #[error("cannot open registry {path}: {source}")]
    Open {
        path: PathBuf,
        source: rusqlite::Error,
    },
    /// The database file is damaged: not a database, truncated, failing SQLite's own check, or
    /// holding a row no torpord writes. Nothing was changed.
    #[error(
        "registry {path} is damaged ({cause}); torpord did not start and left it as it is: \
         restore it from a backup, or move it and its -wal and -shm files aside to start with an \
         empty registry (every function must then be deployed again)"
    )]
    Corrupt { path: PathBuf, cause: Damage },
    /// The database file is missing or empty while the state directory holds what a registry
    /// recorded: starting would forget (and sweep away) it.
    #[error(
        "registry {path} is {what}, but {holds} is not empty ({entries} entries a registry \
         recorded); torpord did not start, since an empty registry would remove them: restore \
         the registry from a backup, or move the state directory aside to start afresh"
    )]
    Lost {
        path: PathBuf,
        what: &'static str,
        holds: PathBuf,
        entries: usize,
    },
    /// The database was written by a newer torpord.
    #[error(
        "registry {path} has schema version {found}, newer than this torpord knows ({known}): \
         run the torpord that wrote it, or a newer one"
    )]
    TooNew {
        path: PathBuf,
        found: u32,
        known: u32,
    },
    /// A migration failed; the database stays at the version before it.
    #[error("registry {path}: migration to schema version {to} failed: {source}")]
    Migrate {
        path: PathBuf,
        to: u32,
        source: rusqlite::Error,
    },
    /// Another process migrated the database while this one did.
    #[error("registry {path} was migrated by another process at the same time: start again")]
    Concurrent { path: PathBuf },
    /// A row with this key exists already.
    #[error("{what} {key:?} already exists")]
    Exists { what: &'static str, key: String },
    /// No row with this key.
    #[error("{what} {key:?} not found")]
    NotFound { what: &'static str, key: String },
    /// A unique column other than the key is taken (a snapshot path, a base key).
    #[error("{what} {key:?} conflicts with an existing row: {message}")]
    Conflict {
        what: &'static str,
        key: String,
        message: String,
    },
    /// The row refers to a function or snapshot that does not exist.
    #[error("{what} {key:?} refers to a function or snapshot that does not exist")]
    MissingReference { what: &'static str, key: String },
    /// The row breaks a rule of the schema (e.g. a base snapshot with a function).
    #[error("{what} {key:?} is not valid: {message}")]
    Invalid {
        what: &'static str,
        key: String,
        message: String,
    },
    /// Paths are stored as UTF-8 text.
    #[error("path {0:?} is not UTF-8; the registry stores UTF-8 paths only")]
    NonUtf8Path(PathBuf),
    /// Any other SQLite failure.
    #[error("registry query failed: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

/// What is damaged in a registry ([`RegistryError::Corrupt`]).
#[derive(Debug, thiserror::Error)]
pub enum Damage {
    /// SQLite says the file is no database, or a corrupt one (NOTADB, CORRUPT).
    #[error("{0}")]
    File(#[source] rusqlite::Error),
    /// `PRAGMA quick_check`'s first finding, on one line.
    #[error("SQLite's quick_check: {0}")]
    QuickCheck(String),
    /// A row the typed readers refuse (a state, stage or kind no torpord writes).
    #[error("table {table}: {source}")]
    Row {
        table: &'static str,
        #[source]
        source: Box<RegistryError>,
    },
    /// A pid a recovery would signal that is 0, 1 or below (a process group, every process).
    #[error("table {table}: instance {instance:?} has pid {pid}{also}")]
    Pid {
        table: &'static str,
        instance: String,
        pid: i64,
        also: &'static str,
    },
    /// `PRAGMA foreign_key_check`: a row refers to one that does not exist.
    #[error("table {table}: row {rowid} refers to a row that does not exist")]
    Dangling { table: String, rowid: i64 },
}

/// `e` as damage, when it says the file is not a sound database (SQLite's NOTADB, CORRUPT).
fn damage(e: rusqlite::Error) -> Result<Damage, rusqlite::Error> {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt) => {
            Ok(Damage::File(e))
        }
        _ => Err(e),
    }
}

fn is_damage(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::NotADatabase | rusqlite::ErrorCode::DatabaseCorrupt)
    )
}

/// SQLite's own check of the file's structure (`PRAGMA quick_check`: pages, records, NOT NULL;
/// linear in the file's size, milliseconds for a registry). The first problem, if any.
fn check_integrity(conn: &Connection) -> Result<(), Damage> {
    let first: String = conn
        .prepare("PRAGMA quick_check")
        .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
        .map_err(Damage::File)?;
    if first == "ok" {
        Ok(())
    } else {
        // Its report spans lines; the error is one.
        Err(Damage::QuickCheck(
            first.split_whitespace().collect::<Vec<_>>().join(" "),
        ))
    }
}

/// Every row read through the typed readers (a state, stage or kind no torpord writes, a spec
/// that is not JSON), the pids a recovery would signal (a pid of 0, 1 or below would signal a
/// process group or every process) and the references between rows. The first problem, if any.
fn check_rows(conn: &Connection) -> Result<(), Damage> {
    let hidden = HashSet::new();
    let s = Store {
        conn,
        hidden: &hidden,
    };
    let table = |table: &'static str, e: RegistryError| Damage::Row {
        table,
        source: Box::new(e),
    };
    s.functions().map_err(|e| table("functions", e))?;
    s.snapshots().map_err(|e| table("snapshots", e))?;
    s.journal().map_err(|e| table("journal", e))?;
    for i in s.instances().map_err(|e| table("instances", e))? {
        if let Some(pid) = i.pid.filter(|p| *p <= 1) {
            return Err(Damage::Pid {
                table: "instances",
                instance: i.id,
                pid: pid.into(),
                also: "",
            });
        }
    }
    let bad: Option<(String, i64)> = conn
        .query_row(
            "SELECT instance, pid FROM instance_processes WHERE pid <= 1 OR start < 0 LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(|e| table("instance_processes", e.into()))?;
    if let Some((id, pid)) = bad {
        return Err(Damage::Pid {
            table: "instance_processes",
            instance: id,
            pid,
            also: " or a negative start time",
        });
    }
    let dangling: Option<(String, i64)> = conn
        .query_row("PRAGMA foreign_key_check", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()
        .map_err(Damage::File)?;
    if let Some((table, rowid)) = dangling {
        return Err(Damage::Dangling { table, rowid });
    }
    Ok(())
}

/// Refuses to start on a registry that is missing or empty while `dir` (the snapshots or
/// functions directory) holds entries a registry would have recorded: opening it would make an
/// empty registry, and the start-up sweep would remove every snapshot it does not name.
pub fn check_not_lost(path: &Path, dir: &Path) -> Result<(), RegistryError> {
    let what = match std::fs::metadata(path) {
        Ok(m) if m.len() > 0 => return Ok(()),
        Ok(_) => "empty",
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "missing",
        Err(_) => return Ok(()),
    };
    let entries = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| !e.file_name().as_encoded_bytes().starts_with(b"."))
                .count()
        })
        .unwrap_or(0);
    if entries == 0 {
        return Ok(());
    }
    Err(RegistryError::Lost {
        path: path.to_path_buf(),
        what,
        holds: dir.to_path_buf(),
        entries,
    })
}

/// [`Registry::shrink`] runs from this many free pages on (256 KiB at SQLite's 4 KiB pages).
pub const SHRINK_MIN_FREE_PAGES: i64 = 64;

/// How long a writer waits for another connection's lock (e.g. a tool reading the registry).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// An open registry.
#[derive(Debug)]
pub struct Registry {
    path: PathBuf,
    conn: Mutex<Connection>,
    /// Room for [`Registry::critical`] writes on a full disk.
    reserve: Reserve,
    /// Instances removed whose rows could not be deleted even with the reserve: hidden from the
    /// instance queries, and deleted at the next critical write that succeeds.
    unremoved: Mutex<HashSet<String>>,
}

impl Registry {
    /// Opens (creating if needed) the registry at `path` and migrates it to [`SCHEMA_VERSION`].
    pub fn open(path: &Path) -> Result<Self, RegistryError> {
        let open_err = |source: rusqlite::Error| match damage(source) {
            Ok(cause) => RegistryError::Corrupt {
                path: path.to_path_buf(),
                cause,
            },
            Err(source) => RegistryError::Open {
                path: path.to_path_buf(),
                source,
            },
        };
        let mut conn = Connection::open(path).map_err(open_err)?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(open_err)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(open_err(rusqlite::Error::InvalidParameterName(format!(
                "journal_mode stayed {mode:?}, WAL is required"
            ))));
        }
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(open_err)?;
        conn.pragma_update(None, "foreign_keys", true)
            .map_err(open_err)?;
        check_integrity(&conn).map_err(|cause| RegistryError::Corrupt {
            path: path.to_path_buf(),
            cause,
        })?;
        migrate::migrate(&mut conn, path).map_err(|e| match e {
            RegistryError::Migrate { source, .. } | RegistryError::Sqlite(source)
                if is_damage(&source) =>
            {
                open_err(source)
            }
            other => other,
        })?;
        check_rows(&conn).map_err(|cause| RegistryError::Corrupt {
            path: path.to_path_buf(),
            cause,
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            conn: Mutex::new(conn),
            reserve: Reserve::beside(path, RESERVE_BYTES),
            unremoved: Mutex::new(HashSet::new()),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves the connection usable: an open transaction
        // was rolled back when its guard dropped.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the connection outside any explicit transaction: each statement commits
    /// on its own. For reads, and for single writes.
    pub fn with<T, E: From<RegistryError>>(
        &self,
        f: impl FnOnce(&Store<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        let out = {
            let conn = self.lock();
            let hidden = self.hidden();
            f(&Store {
                conn: &conn,
                hidden: &hidden,
            })
        };
        if out.is_ok() {
            self.reserve.restore_if_missing();
        }
        out
    }

    /// Runs `f` in one transaction: committed if it returns `Ok`, rolled back otherwise.
    pub fn transaction<T, E: From<RegistryError>>(
        &self,
        f: impl FnOnce(&Store<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut conn = self.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(RegistryError::from)?;
        let hidden = self.hidden();
        let value = f(&Store {
            conn: &tx,
            hidden: &hidden,
        })?;
        tx.commit().map_err(RegistryError::from)?;
        drop(conn);
        self.reserve.restore_if_missing();
        Ok(value)
    }

    /// Runs `f` in one transaction, as a write that must not fail for want of space (removing
    /// the row of an instance that is gone, ending a journal): if the disk is full, the
    /// registry's reserve ([`Reserve`]) is freed and `f` runs once more. While the reserve is
    /// missing, each query that succeeds tries to make it again (at most every few seconds).
    pub fn critical<T>(
        &self,
        f: impl Fn(&Store<'_>) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let first = self.transaction(&f);
        let out = match first {
            Err(RegistryError::Sqlite(e)) if is_disk_full(&e) && self.reserve.release() => {
                self.transaction(&f)
            }
            other => other,
        };
        if out.is_ok() {
            self.reserve.restore_if_missing();
            self.delete_unremoved();
        }
        out
    }

    /// Deletes the row of an instance taken out of service, as a critical write. If even that
    /// fails, the instance queries hide the row from now on (the listed state must not name a
    /// process that is gone) and a later critical write, or the next start, deletes it.
    pub fn remove_instance_row(&self, id: &str) -> Result<(), RegistryError> {
        let deleted = self.critical(|s| s.delete_instance(id).map(|_| ()));
        if deleted.is_err() {
            self.unremoved_lock().insert(id.to_string());
        }
        deleted
    }

    fn unremoved_lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.unremoved.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hidden(&self) -> HashSet<String> {
        self.unremoved_lock().clone()
    }

    fn delete_unremoved(&self) {
        let ids: Vec<String> = self.unremoved_lock().iter().cloned().collect();
        for id in ids {
            if self.transaction(|s| s.delete_instance(&id)).is_ok() {
                self.unremoved_lock().remove(&id);
                tracing::info!(instance = %id, "removed the registry row of an instance that left on a full disk");
            }
        }
    }

    /// The disk reserve of [`Registry::critical`].
    pub fn reserve(&self) -> &Reserve {
        &self.reserve
    }

    /// Gives the pages that deletions freed back to the file system, when they are at least a
    /// quarter of the file and [`SHRINK_MIN_FREE_PAGES`] or more: `VACUUM` (which rewrites the
    /// database without them), then a checkpoint that truncates the WAL. Returns the bytes the
    /// files shrank by (0: nothing to do). SQLite never shrinks a file on its own, so a registry
    /// that once held big specs stayed big after they were removed.
    pub fn shrink(&self) -> Result<u64, RegistryError> {
        let conn = self.lock();
        let pragma = |name: &str| -> Result<i64, RegistryError> {
            Ok(conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))?)
        };
        let (free, pages) = (pragma("freelist_count")?, pragma("page_count")?);
        if free < SHRINK_MIN_FREE_PAGES || free.saturating_mul(4) < pages {
            return Ok(0);
        }
        let before = self.bytes_on_disk();
        conn.execute_batch("VACUUM")?;
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok(before.saturating_sub(self.bytes_on_disk()))
    }

    /// The database file and its WAL, in bytes.
    fn bytes_on_disk(&self) -> u64 {
        let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        let mut wal = self.path.as_os_str().to_os_string();
        wal.push("-wal");
        len(&self.path) + len(Path::new(&wal))
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<u32, RegistryError> {
        Ok(migrate::current_version(&self.lock())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn function(name: &str) -> Function {
        Function {
            name: name.to_string(),
            dir: PathBuf::from(format!("/state/functions/{name}")),
            spec: serde_json::json!({"name": name, "entry": "model:MLP", "gpus": 0}),
            base_key: "python3|numpy|cpu".to_string(),
            snapshot: None,
            state: FunctionState::Deploying,
            created: 1_000,
            updated: 1_000,
        }
    }

    fn snapshot(id: &str, kind: SnapshotKind, function: Option<&str>) -> Snapshot {
        Snapshot {
            id: id.to_string(),
            kind,
            path: PathBuf::from(format!("/state/snapshots/{id}")),
            function: function.map(str::to_string),
            base_key: Some("python3|numpy|cpu".to_string()),
            bytes: 123_456_789,
            created: 2_000,
        }
    }

    fn instance(id: &str, function: &str, stage: Stage) -> Instance {
        Instance {
            id: id.to_string(),
            function: function.to_string(),
            pid: stage.has_process().then_some(4242),
            stage,
            snapshot: None,
            started: 3_000,
            last_used: 3_500,
        }
    }

    fn open() -> (tempfile::TempDir, Registry) {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(&dir.path().join("registry.db")).unwrap();
        (dir, reg)
    }

    #[test]
    fn new_database_is_at_the_current_version_in_wal_mode() {
        let (dir, reg) = open();
        assert_eq!(reg.schema_version().unwrap(), SCHEMA_VERSION);
        drop(reg);
        let conn = Connection::open(dir.path().join("registry.db")).unwrap();
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        // Reopening does not migrate again.
        let reg = Registry::open(&dir.path().join("registry.db")).unwrap();
        assert_eq!(reg.schema_version().unwrap(), SCHEMA_VERSION);
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.db");
        drop(Registry::open(&path).unwrap());
        let conn = Connection::open(&path).unwrap();
        conn.execute("UPDATE schema_version SET version = 99", [])
            .unwrap();
        drop(conn);
        let err = Registry::open(&path).unwrap_err();
        assert!(
            matches!(err, RegistryError::TooNew { found: 99, .. }),
            "{err}"
        );
    }

    #[test]
    fn a_damaged_database_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.db");
        std::fs::write(&path, vec![0x5a; 16384]).unwrap();
        let err = Registry::open(&path).unwrap_err();
        assert!(matches!(err, RegistryError::Corrupt { .. }), "{err}");
        assert!(
            err.to_string().contains("restore it from a backup"),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), vec![0x5a; 16384]);

        std::fs::remove_file(&path).unwrap();
        drop(Registry::open(&path).unwrap());
        let conn = Connection::open(&path).unwrap();
        conn.execute(
            "INSERT INTO functions VALUES ('f', '/f', '{}', 'k', NULL, 'ready', 1, 1)",
            [],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO instances VALUES ('f-1', 'f', 0, 'warm', NULL, 1, 1)",
            [],
        )
        .unwrap();
        drop(conn);
        let err = Registry::open(&path).unwrap_err();
        assert!(
            matches!(&err, RegistryError::Corrupt { cause, .. } if cause.to_string().contains("has pid 0")),
            "{err}"
        );
    }

    #[test]
    fn a_lost_registry_is_refused_only_beside_what_it_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (path, snaps) = (dir.path().join("registry.db"), dir.path().join("snapshots"));
        std::fs::create_dir(&snaps).unwrap();
        check_not_lost(&path, &snaps).unwrap();
        std::fs::create_dir(snaps.join(".fn-a.partial-1")).unwrap();
        check_not_lost(&path, &snaps).unwrap();
        std::fs::create_dir(snaps.join("fn-a")).unwrap();
        let err = check_not_lost(&path, &snaps).unwrap_err();
        assert!(
            matches!(
                err,
                RegistryError::Lost {
                    what: "missing",
                    entries: 1,
                    ..
                }
            ),
            "{err}"
        );
        std::fs::write(&path, b"").unwrap();
        assert!(matches!(
            check_not_lost(&path, &snaps),
            Err(RegistryError::Lost { what: "empty", .. })
        ));
        drop(Registry::open(&dir.path().join("other.db")).unwrap());
        check_not_lost(&dir.path().join("other.db"), &snaps).unwrap();
    }

    #[test]
    fn rows_round_trip() {
        let (_dir, reg) = open();
        let mut f = function("cpu-mlp");
        let base = snapshot("base-1", SnapshotKind::Base, None);
        let fsnap = snapshot("fn-1", SnapshotKind::Function, Some("cpu-mlp"));
        reg.transaction(|s| {
            s.insert_function(&f)?;
            s.insert_snapshot(&base)?;
            s.insert_snapshot(&fsnap)?;
            Ok::<_, RegistryError>(())
        })
        .unwrap();
        f.snapshot = Some("fn-1".to_string());
        f.state = FunctionState::Ready;
        f.updated = 5_000;
        reg.with(|s| s.update_function(&f)).unwrap();
        let mut i = instance("cpu-mlp-1", "cpu-mlp", Stage::Warm);
        i.snapshot = Some("fn-1".to_string());
        reg.with(|s| s.insert_instance(&i)).unwrap();

        reg.with(|s| {
            assert_eq!(s.function("cpu-mlp")?.as_ref(), Some(&f));
            assert_eq!(s.functions()?, vec![f.clone()]);
            assert_eq!(s.snapshot("base-1")?.as_ref(), Some(&base));
            assert_eq!(s.base_snapshot("python3|numpy|cpu")?.as_ref(), Some(&base));
            assert_eq!(s.snapshots_of("cpu-mlp")?, vec![fsnap.clone()]);
            assert_eq!(s.snapshots()?.len(), 2);
            assert_eq!(s.instance("cpu-mlp-1")?.as_ref(), Some(&i));
            assert_eq!(s.instances_of("cpu-mlp")?, vec![i.clone()]);
            Ok::<_, RegistryError>(())
        })
        .unwrap();

        reg.with(|s| {
            s.touch_instance("cpu-mlp-1", 9_000)?;
            s.set_instance_stage("cpu-mlp-1", Stage::Hibernated, None, Some("fn-1"))
        })
        .unwrap();
        let got = reg.with(|s| s.instance("cpu-mlp-1")).unwrap().unwrap();
        assert_eq!(
            (got.stage, got.pid, got.last_used),
            (Stage::Hibernated, None, 9_000)
        );

        let counts = reg.with(|s| s.counts()).unwrap();
        assert_eq!(counts.functions, 1);
        assert_eq!(counts.snapshots.base, 1);
        assert_eq!(counts.snapshots.function, 1);
        assert_eq!(counts.instances.hibernated, 1);
        assert_eq!(counts.instances.total(), 1);
        let by_fn = reg.with(|s| s.stage_counts_by_function()).unwrap();
        assert_eq!(by_fn["cpu-mlp"].hibernated, 1);
    }

    #[test]
    fn an_instance_process_is_recorded_replaced_and_goes_with_its_instance() {
        let (_dir, reg) = open();
        reg.transaction(|s| {
            s.insert_function(&function("a"))?;
            s.insert_instance(&instance("a-1", "a", Stage::Warm))
        })
        .unwrap();
        assert_eq!(reg.with(|s| s.instance_process("a-1")).unwrap(), None);
        reg.with(|s| s.set_instance_process("a-1", 4242, 77))
            .unwrap();
        assert_eq!(
            reg.with(|s| s.instance_process("a-1")).unwrap(),
            Some((4242, 77))
        );
        reg.with(|s| s.set_instance_process("a-1", 5151, 88))
            .unwrap();
        assert_eq!(
            reg.with(|s| s.instance_process("a-1")).unwrap(),
            Some((5151, 88))
        );
        assert!(reg.with(|s| s.set_instance_process("ghost", 1, 1)).is_err());
        reg.with(|s| s.delete_instance("a-1")).unwrap();
        assert_eq!(reg.with(|s| s.instance_process("a-1")).unwrap(), None);
    }

    #[test]
    fn shrink_gives_freed_pages_back() {
        let (dir, reg) = open();
        let file = dir.path().join("registry.db");
        let size = || {
            std::fs::metadata(&file).unwrap().len()
                + std::fs::metadata(dir.path().join("registry.db-wal")).map_or(0, |m| m.len())
        };
        // Nothing freed yet: nothing to do.
        assert_eq!(reg.shrink().unwrap(), 0);
        let mut big = function("big");
        big.spec = serde_json::json!({"pad": "x".repeat(4 << 20)});
        reg.with(|s| s.insert_function(&big)).unwrap();
        reg.with(|s| s.insert_function(&function("small"))).unwrap();
        let full = size();
        assert!(full > 4 << 20, "{full}");
        reg.with(|s| s.delete_function("big")).unwrap();
        assert!(size() >= full, "SQLite keeps freed pages in the file");
        assert!(reg.shrink().unwrap() > 3 << 20);
        assert!(size() < 1 << 20, "{}", size());
        // The rest is intact.
        assert!(reg.with(|s| s.function("small")).unwrap().is_some());
        assert_eq!(reg.shrink().unwrap(), 0);
    }

    #[test]
    fn delete_function_cascades_to_its_rows_only() {
        let (_dir, reg) = open();
        reg.transaction(|s| {
            s.insert_function(&function("a"))?;
            s.insert_function(&function("b"))?;
            s.insert_snapshot(&snapshot("base", SnapshotKind::Base, None))?;
            s.insert_snapshot(&snapshot("a-fn", SnapshotKind::Function, Some("a")))?;
            s.insert_snapshot(&snapshot("a-hib", SnapshotKind::Hibernation, Some("a")))?;
            s.insert_snapshot(&snapshot("b-fn", SnapshotKind::Function, Some("b")))?;
            s.insert_instance(&instance("a-1", "a", Stage::Evicted))?;
            s.insert_instance(&instance("b-1", "b", Stage::Warm))?;
            Ok::<_, RegistryError>(())
        })
        .unwrap();
        let removed = reg.with(|s| s.delete_function("a")).unwrap().unwrap();
        let ids: Vec<_> = removed.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["a-fn", "a-hib"]);
        let counts = reg.with(|s| s.counts()).unwrap();
        assert_eq!(counts.functions, 1);
        assert_eq!(counts.snapshots.base, 1);
        assert_eq!(counts.snapshots.function, 1);
        assert_eq!(counts.snapshots.hibernation, 0);
        assert_eq!(counts.instances.total(), 1);
        assert_eq!(reg.with(|s| s.delete_function("a")).unwrap(), None);
    }

    #[test]
    fn schema_rules_are_typed_errors() {
        let (_dir, reg) = open();
        reg.with(|s| s.insert_function(&function("a"))).unwrap();
        let e = reg.with(|s| s.insert_function(&function("a"))).unwrap_err();
        assert!(
            matches!(
                e,
                RegistryError::Exists {
                    what: "function",
                    ..
                }
            ),
            "{e}"
        );
        let e = reg
            .with(|s| s.insert_snapshot(&snapshot("x", SnapshotKind::Function, Some("nope"))))
            .unwrap_err();
        assert!(matches!(e, RegistryError::MissingReference { .. }), "{e}");
        let e = reg
            .with(|s| s.insert_snapshot(&snapshot("x", SnapshotKind::Base, Some("a"))))
            .unwrap_err();
        assert!(matches!(e, RegistryError::Invalid { .. }), "{e}");
        let mut warm_without_pid = instance("i", "a", Stage::Warm);
        warm_without_pid.pid = None;
        let e = reg
            .with(|s| s.insert_instance(&warm_without_pid))
            .unwrap_err();
        assert!(matches!(e, RegistryError::Invalid { .. }), "{e}");
        reg.with(|s| s.insert_snapshot(&snapshot("b1", SnapshotKind::Base, None)))
            .unwrap();
        let mut second_base = snapshot("b2", SnapshotKind::Base, None);
        second_base.path = PathBuf::from("/elsewhere");
        let e = reg.with(|s| s.insert_snapshot(&second_base)).unwrap_err();
        assert!(matches!(e, RegistryError::Conflict { .. }), "{e}");
        let e = reg
            .with(|s| s.set_instance_stage("ghost", Stage::Warm, Some(1), None))
            .unwrap_err();
        assert!(matches!(e, RegistryError::NotFound { .. }), "{e}");
    }

    #[test]
    fn a_failed_transaction_leaves_nothing() {
        let (_dir, reg) = open();
        let result = reg.transaction(|s| {
            s.insert_function(&function("a"))?;
            s.insert_function(&function("a"))
        });
        assert!(result.is_err());
        assert_eq!(reg.with(|s| s.counts()).unwrap().functions, 0);
    }

    #[test]
    fn enum_texts_round_trip() {
        for s in Stage::ALL {
            assert_eq!(Stage::parse(s.as_str()), Some(*s));
        }
        for k in SnapshotKind::ALL {
            assert_eq!(SnapshotKind::parse(k.as_str()), Some(*k));
        }
        for f in FunctionState::ALL {
            assert_eq!(FunctionState::parse(f.as_str()), Some(*f));
        }
        assert_eq!(
            serde_json::to_string(&Stage::GpuReleased).unwrap(),
            "\"gpu_released\""
        );
    }
}
