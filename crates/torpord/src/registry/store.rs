//! Typed queries over one connection (inside a transaction or not).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSqlOutput, ValueRef};
use rusqlite::{Connection, OptionalExtension, Row, ToSql};

use super::model::*;
use super::RegistryError;

/// The registry's queries, on a connection the [`super::Registry`] lends out.
pub struct Store<'c> {
    pub(super) conn: &'c Connection,
    /// Instances removed whose rows could not be deleted yet ([`super::Registry::
    /// remove_instance_row`]): the instance queries leave them out.
    pub(super) hidden: &'c std::collections::HashSet<String>,
}

macro_rules! sql_text_enum {
    ($($name:ident),+) => {$(
        impl ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.as_str()))
            }
        }
        impl FromSql for $name {
            fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
                let text = value.as_str()?;
                $name::parse(text).ok_or_else(|| {
                    FromSqlError::Other(
                        format!("unknown {} {text:?}", stringify!($name)).into(),
                    )
                })
            }
        }
    )+};
}
sql_text_enum!(FunctionState, JournalOp, SnapshotKind, Stage);

fn path_text(path: &Path) -> Result<&str, RegistryError> {
    path.to_str()
        .ok_or_else(|| RegistryError::NonUtf8Path(path.to_path_buf()))
}

/// Maps a constraint failure to a typed error; `what`/`key` name the row being written.
fn write_error(err: rusqlite::Error, what: &'static str, key: &str) -> RegistryError {
    if let rusqlite::Error::SqliteFailure(e, msg) = &err {
        let key = key.to_string();
        match e.extended_code {
            rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY => {
                return RegistryError::Exists { what, key };
            }
            rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE => {
                return RegistryError::Conflict {
                    what,
                    key,
                    message: msg.clone().unwrap_or_else(|| e.to_string()),
                };
            }
            rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY => {
                return RegistryError::MissingReference { what, key };
            }
            rusqlite::ffi::SQLITE_CONSTRAINT_CHECK => {
                return RegistryError::Invalid {
                    what,
                    key,
                    message: msg.clone().unwrap_or_else(|| e.to_string()),
                };
            }
            _ => {}
        }
    }
    RegistryError::Sqlite(err)
}

const FUNCTION_COLUMNS: &str = "name, dir, spec_json, base_key, snapshot, state, created, updated";

fn function_row(row: &Row<'_>) -> rusqlite::Result<Function> {
    let spec: String = row.get(2)?;
    let spec = serde_json::from_str(&spec).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(2, rusqlite::types::Type::Text, Box::new(e))
    })?;
    Ok(Function {
        name: row.get(0)?,
        dir: PathBuf::from(row.get::<_, String>(1)?),
        spec,
        base_key: row.get(3)?,
        snapshot: row.get(4)?,
        state: row.get(5)?,
        created: row.get(6)?,
        updated: row.get(7)?,
    })
}

const SNAPSHOT_COLUMNS: &str = "id, kind, path, function, base_key, bytes, created";

fn snapshot_row(row: &Row<'_>) -> rusqlite::Result<Snapshot> {
    Ok(Snapshot {
        id: row.get(0)?,
        kind: row.get(1)?,
        path: PathBuf::from(row.get::<_, String>(2)?),
        function: row.get(3)?,
        base_key: row.get(4)?,
        bytes: row.get(5)?,
        created: row.get(6)?,
    })
}

const INSTANCE_COLUMNS: &str = "id, function, pid, stage, snapshot, started, last_used";

fn instance_row(row: &Row<'_>) -> rusqlite::Result<Instance> {
    Ok(Instance {
        id: row.get(0)?,
        function: row.get(1)?,
        pid: row.get(2)?,
        stage: row.get(3)?,
        snapshot: row.get(4)?,
        started: row.get(5)?,
        last_used: row.get(6)?,
    })
}

impl Store<'_> {
    fn collect<T>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
        map: fn(&Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, RegistryError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let rows = stmt.query_map(params, map)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn one<T>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
        map: fn(&Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Option<T>, RegistryError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        Ok(stmt.query_row(params, map).optional()?)
    }

    // ---- tenants ----

    /// The number of `tenant` (crate::users): the one it was given when first seen, or the next
    /// free one (the highest so far + 1, from 0), recorded now. Numbers are never reused.
    pub fn tenant_number(&self, tenant: &str) -> Result<u32, RegistryError> {
        self.conn
            .prepare_cached(
                "INSERT OR IGNORE INTO tenant_numbers (tenant, number) \
                 VALUES (?1, (SELECT COALESCE(MAX(number) + 1, 0) FROM tenant_numbers))",
            )?
            .execute([tenant])?;
        let n: i64 = self
            .conn
            .prepare_cached("SELECT number FROM tenant_numbers WHERE tenant = ?1")?
            .query_row([tenant], |r| r.get(0))?;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    // ---- functions ----

    /// Adds a function; [`RegistryError::Exists`] if the name is taken.
    pub fn insert_function(&self, f: &Function) -> Result<(), RegistryError> {
        let sql = format!(
            "INSERT INTO functions ({FUNCTION_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
        );
        self.conn
            .prepare_cached(&sql)?
            .execute((
                &f.name,
                path_text(&f.dir)?,
                f.spec.to_string(),
                &f.base_key,
                &f.snapshot,
                f.state,
                f.created,
                f.updated,
            ))
            .map_err(|e| write_error(e, "function", &f.name))?;
        Ok(())
    }

    /// Replaces every column of the function named `f.name` except `created`.
    pub fn update_function(&self, f: &Function) -> Result<(), RegistryError> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE functions SET dir = ?2, spec_json = ?3, base_key = ?4, snapshot = ?5, \
                 state = ?6, updated = ?7 WHERE name = ?1",
            )?
            .execute((
                &f.name,
                path_text(&f.dir)?,
                f.spec.to_string(),
                &f.base_key,
                &f.snapshot,
                f.state,
                f.updated,
            ))
            .map_err(|e| write_error(e, "function", &f.name))?;
        if n == 0 {
            return Err(RegistryError::NotFound {
                what: "function",
                key: f.name.clone(),
            });
        }
        Ok(())
    }

    /// The function named `name`.
    pub fn function(&self, name: &str) -> Result<Option<Function>, RegistryError> {
        let sql = format!("SELECT {FUNCTION_COLUMNS} FROM functions WHERE name = ?1");
        self.one(&sql, [name], function_row)
    }

    /// Every function, by name.
    pub fn functions(&self) -> Result<Vec<Function>, RegistryError> {
        let sql = format!("SELECT {FUNCTION_COLUMNS} FROM functions ORDER BY name");
        self.collect(&sql, [], function_row)
    }

    /// Removes a function with its snapshots and instances (the rows only: the caller removes
    /// the snapshot directories it gets back and stops any process first).
    /// `None` if there is no such function.
    pub fn delete_function(&self, name: &str) -> Result<Option<Vec<Snapshot>>, RegistryError> {
        if self.function(name)?.is_none() {
            return Ok(None);
        }
        let snapshots = self.snapshots_of(name)?;
        self.conn
            .prepare_cached("DELETE FROM functions WHERE name = ?1")?
            .execute([name])?;
        Ok(Some(snapshots))
    }

    /// Marks every function still `deploying` as `failed` (at `now`, Unix ms): no deploy
    /// outlives the daemon that ran it. Returns their names.
    pub fn fail_interrupted_deploys(&self, now: i64) -> Result<Vec<String>, RegistryError> {
        let mut stmt = self.conn.prepare_cached(
            "UPDATE functions SET state = 'failed', updated = ?1 \
             WHERE state = 'deploying' RETURNING name",
        )?;
        let names = stmt.query_map([now], |row| row.get(0))?;
        let mut names: Vec<String> = names.collect::<Result<_, _>>()?;
        names.sort();
        Ok(names)
    }

    // ---- snapshots ----

    /// Adds a snapshot; its function, if any, must exist.
    pub fn insert_snapshot(&self, s: &Snapshot) -> Result<(), RegistryError> {
        let sql = format!(
            "INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
        );
        self.conn
            .prepare_cached(&sql)?
            .execute((
                &s.id,
                s.kind,
                path_text(&s.path)?,
                &s.function,
                &s.base_key,
                s.bytes,
                s.created,
            ))
            .map_err(|e| write_error(e, "snapshot", &s.id))?;
        Ok(())
    }

    /// The snapshot with id `id`.
    pub fn snapshot(&self, id: &str) -> Result<Option<Snapshot>, RegistryError> {
        let sql = format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id = ?1");
        self.one(&sql, [id], snapshot_row)
    }

    /// The base snapshot for `base_key`.
    pub fn base_snapshot(&self, base_key: &str) -> Result<Option<Snapshot>, RegistryError> {
        let sql = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE kind = 'base' AND base_key = ?1"
        );
        self.one(&sql, [base_key], snapshot_row)
    }

    /// Every snapshot, oldest first.
    pub fn snapshots(&self) -> Result<Vec<Snapshot>, RegistryError> {
        let sql = format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY created, id");
        self.collect(&sql, [], snapshot_row)
    }

    /// The snapshots of one function (function and hibernation), oldest first.
    pub fn snapshots_of(&self, function: &str) -> Result<Vec<Snapshot>, RegistryError> {
        let sql = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE function = ?1 ORDER BY created, id"
        );
        self.collect(&sql, [function], snapshot_row)
    }

    /// Removes a snapshot row (a function or instance pointing at it then points nowhere).
    /// Whether it existed.
    pub fn delete_snapshot(&self, id: &str) -> Result<bool, RegistryError> {
        let n = self
            .conn
            .prepare_cached("DELETE FROM snapshots WHERE id = ?1")?
            .execute([id])?;
        Ok(n > 0)
    }

    // ---- instances ----

    /// Adds an instance; its function (and snapshot, if any) must exist.
    pub fn insert_instance(&self, i: &Instance) -> Result<(), RegistryError> {
        let sql = format!(
            "INSERT INTO instances ({INSTANCE_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
        );
        self.conn
            .prepare_cached(&sql)?
            .execute((
                &i.id,
                &i.function,
                i.pid,
                i.stage,
                &i.snapshot,
                i.started,
                i.last_used,
            ))
            .map_err(|e| write_error(e, "instance", &i.id))?;
        Ok(())
    }

    /// Moves an instance to `stage`, with the pid and snapshot that stage has.
    pub fn set_instance_stage(
        &self,
        id: &str,
        stage: Stage,
        pid: Option<i32>,
        snapshot: Option<&str>,
    ) -> Result<(), RegistryError> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE instances SET stage = ?2, pid = ?3, snapshot = ?4 WHERE id = ?1",
            )?
            .execute((id, stage, pid, snapshot))
            .map_err(|e| write_error(e, "instance", id))?;
        if n == 0 {
            return Err(RegistryError::NotFound {
                what: "instance",
                key: id.to_string(),
            });
        }
        Ok(())
    }

    /// Records that an instance served a request at `at` (Unix ms).
    pub fn touch_instance(&self, id: &str, at: i64) -> Result<(), RegistryError> {
        let n = self
            .conn
            .prepare_cached("UPDATE instances SET last_used = ?2 WHERE id = ?1")?
            .execute((id, at))?;
        if n == 0 {
            return Err(RegistryError::NotFound {
                what: "instance",
                key: id.to_string(),
            });
        }
        Ok(())
    }

    /// The instance with id `id`.
    pub fn instance(&self, id: &str) -> Result<Option<Instance>, RegistryError> {
        let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE id = ?1");
        Ok(self
            .one(&sql, [id], instance_row)?
            .filter(|i| !self.hidden.contains(&i.id)))
    }

    /// Every instance, by function then start time.
    pub fn instances(&self) -> Result<Vec<Instance>, RegistryError> {
        let sql =
            format!("SELECT {INSTANCE_COLUMNS} FROM instances ORDER BY function, started, id");
        Ok(self.visible(self.collect(&sql, [], instance_row)?))
    }

    fn visible(&self, mut instances: Vec<Instance>) -> Vec<Instance> {
        instances.retain(|i| !self.hidden.contains(&i.id));
        instances
    }

    /// The instances of one function, by start time.
    pub fn instances_of(&self, function: &str) -> Result<Vec<Instance>, RegistryError> {
        let sql = format!(
            "SELECT {INSTANCE_COLUMNS} FROM instances WHERE function = ?1 ORDER BY started, id"
        );
        Ok(self.visible(self.collect(&sql, [function], instance_row)?))
    }

    /// Removes an instance row. Whether it existed.
    pub fn delete_instance(&self, id: &str) -> Result<bool, RegistryError> {
        let n = self
            .conn
            .prepare_cached("DELETE FROM instances WHERE id = ?1")?
            .execute([id])?;
        Ok(n > 0)
    }

    /// Records which process a live instance is: its init's pid and that process's start time
    /// (clock ticks after boot), replacing an earlier record.
    pub fn set_instance_process(
        &self,
        id: &str,
        pid: i32,
        start: u64,
    ) -> Result<(), RegistryError> {
        let start = i64::try_from(start).unwrap_or(i64::MAX);
        self.conn
            .prepare_cached(
                "INSERT INTO instance_processes (instance, pid, start) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (instance) DO UPDATE SET pid = excluded.pid, start = excluded.start",
            )?
            .execute((id, pid, start))
            .map_err(|e| write_error(e, "instance", id))?;
        Ok(())
    }

    /// The process recorded for an instance: (pid, start time in clock ticks after boot).
    pub fn instance_process(&self, id: &str) -> Result<Option<(i32, u64)>, RegistryError> {
        Ok(self
            .conn
            .prepare_cached("SELECT pid, start FROM instance_processes WHERE instance = ?1")?
            .query_row([id], |row| {
                Ok((row.get::<_, i32>(0)?, row.get::<_, i64>(1)?.max(0) as u64))
            })
            .optional()?)
    }

    // ---- aggregates ----

    /// Instances per stage, per function (functions without instances are absent).
    pub fn stage_counts_by_function(&self) -> Result<BTreeMap<String, StageCounts>, RegistryError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT function, stage, COUNT(*) FROM instances GROUP BY function, stage",
        )?;
        let rows = stmt.query_map([], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, Stage>(1)?,
                row.get::<_, u64>(2)?,
            ))
        })?;
        let mut out: BTreeMap<String, StageCounts> = BTreeMap::new();
        for row in rows {
            let (function, stage, n) = row?;
            out.entry(function).or_default().add(stage, n);
        }
        for id in self.hidden {
            let sql = format!("SELECT {INSTANCE_COLUMNS} FROM instances WHERE id = ?1");
            if let Some(i) = self.one(&sql, [id], instance_row)? {
                if let Some(c) = out.get_mut(&i.function) {
                    c.remove(i.stage);
                }
            }
        }
        Ok(out)
    }

    /// Functions, snapshots per kind and instances per stage.
    pub fn counts(&self) -> Result<Counts, RegistryError> {
        let mut counts = Counts {
            functions: self
                .conn
                .prepare_cached("SELECT COUNT(*) FROM functions")?
                .query_row([], |row| row.get(0))?,
            ..Counts::default()
        };
        let mut stmt = self
            .conn
            .prepare_cached("SELECT kind, COUNT(*) FROM snapshots GROUP BY kind")?;
        for row in stmt.query_map([], |row| {
            Ok((row.get::<_, SnapshotKind>(0)?, row.get::<_, u64>(1)?))
        })? {
            let (kind, n) = row?;
            match kind {
                SnapshotKind::Base => counts.snapshots.base = n,
                SnapshotKind::Function => counts.snapshots.function = n,
                SnapshotKind::Hibernation => counts.snapshots.hibernation = n,
            }
        }
        let mut stmt = self
            .conn
            .prepare_cached("SELECT stage, COUNT(*) FROM instances GROUP BY stage")?;
        for row in stmt.query_map([], |row| {
            Ok((row.get::<_, Stage>(0)?, row.get::<_, u64>(1)?))
        })? {
            let (stage, n) = row?;
            counts.instances.add(stage, n);
        }
        Ok(counts)
    }
}
