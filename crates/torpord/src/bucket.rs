//! A function in an S3 bucket, without the daemon's runtime: the function records, pushing a
//! snapshot and the record, pulling both into the local chunk store (verified, portability
//! checked), and bounding that store ([`Tier`]). `objstore.rs` drives it from the runtime
//! (push after a deploy, pull on demand, registering what was pulled); this module stays
//! below the runtime so that the runtime can hold a [`Tier`] without importing that driver.
//!
//! The object tier in the daemon (docs/objstore.md, "torpord"): with `[objstore]` configured,
//! every successful deploy pushes its function snapshot and a function record to the bucket,
//! and a node that does not know a function pulls it from there on `POST
//! /v1/functions/{name}/pull` or on its first invoke, so that any node can serve any function.
//!
//! The transfers are `torpor_objstore`'s `push` and `pull` (the same as `torpor push/pull`:
//! only missing chunks move, each hashed against its name before it is stored), run on the
//! blocking pool against the daemon's chunk store (`<state>/chunks`, the split path's). What
//! this module adds is the function: its record in the bucket, tenancy, registering a pulled
//! function as if it were deployed, retrying failed pushes, and bounding the chunk store.
//!
//! # In the bucket, beside `torpor push`'s layout
//!
//! ```text
//! <prefix>functions/<tenant>/<name>.json   the function record: spec, dir, base key, snapshot id
//! <prefix>function-names/<name>.json       {"tenant": …}: which tenant owns the name (for admin pulls)
//! <prefix>tenants/<tenant>/packs/…, snapshots/…   a non-default tenant's snapshots (`torpor push`'s
//!                                          layout under a prefix of its own: dedup within a tenant)
//! <prefix>snapshots/<id>/pages-profile     the snapshot's hot set, sealed (torpor_objstore::push_profile)
//! ```
//!
//! A tenant's token reads `functions/<its tenant>/…` only, so it can pull nothing of another
//! tenant's (the answer is the same 404 as for a function nowhere). The name file exists
//! because function names are node-wide, so cluster-wide: the admin token (and the Unix
//! socket) pull by name alone.
//!
//! # The local chunk store as a cache
//!
//! A push stores the snapshot's files in the chunk store (so a later push or pull of a function
//! on the same base moves only what differs), and a pull commits what it fetched there. The
//! records of snapshots the registry still names are kept; the others (an older deploy's, a
//! removed function's) are only a cache of chunks. After each push and pull, while the store's
//! chunks take more than `cache_bytes`, the least recently written of those records is released
//! and the chunks nothing references any more are deleted (the store's GC).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use torpor_image::store::{ChunkStore, StoreError};
use torpor_objstore::{ObjError, Remote, TransferError};

use crate::config::Objstore;
use crate::registry::Function;
use crate::sync::lock;
use crate::tenant::Scope;

/// A failed push is tried again after this, doubling up to [`RETRY_MAX`].
pub const RETRY_FIRST: Duration = Duration::from_secs(30);
pub const RETRY_MAX: Duration = Duration::from_secs(600);
/// The id under which a function snapshot's files are kept in the chunk store and the bucket:
/// not the snapshot's own id, which the split path uses for the sealed record of its segments
/// (a record under that id would be taken for one).
pub fn files_id(snapshot: &str) -> String {
    format!("{snapshot}.files")
}

/// The chunk store's directory of records (`refs/<id>.json`), whose mtimes order the cache.
const REFS_DIR: &str = "refs";
/// The function record's format.
const RECORD_FORMAT: u32 = 1;
/// Function records are small (a spec); anything larger is not one torpord wrote.
const MAX_RECORD_BYTES: u64 = 4 << 20;

/// What the bucket holds about one function.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionRecord {
    pub format: u32,
    pub name: String,
    pub tenant: String,
    /// The parsed torpor.toml, as the registry keeps it.
    pub spec: serde_json::Value,
    /// The function's directory: each node binds it into restored workers, so it must exist
    /// at this path on the node that pulls.
    pub dir: PathBuf,
    pub base_key: String,
    /// The function snapshot (its id in `snapshots/` of the bucket and of every node).
    pub snapshot: String,
    /// Every snapshot the function needs (today the function snapshot alone).
    pub snapshots: Vec<String>,
    /// When it was pushed (Unix ms).
    pub pushed_ms: i64,
    /// The pushing daemon's state directory: the snapshot's workers reconnect to
    /// `<state_dir>/workers.sock` by that path, so a node whose state_dir differs cannot take
    /// its restored instances (they fall back to a boot). Empty in records of older torpords.
    #[serde(default)]
    pub state_dir: PathBuf,
    /// The files the snapshot's processes reopen (its manifest's, which the pull checks after
    /// the transfer): a pulling node reads them while the transfer runs
    /// (torpor_image::warm_reopened). Empty in records of older torpords.
    #[serde(default)]
    pub reopened: Vec<torpor_image::ReopenedFile>,
}

/// Threads that hash the reopened files during a pull (the pipeline keeps the others busy).
const WARM_THREADS: usize = 8;

/// The owner of a name.
#[derive(Debug, Serialize, Deserialize)]
struct NameRecord {
    tenant: String,
}

/// What a push did, for the deploy's answer and `POST …/push`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Pushed {
    pub function: String,
    pub snapshot: String,
    pub bucket: String,
    /// Distinct chunks of the snapshot.
    pub chunks: u64,
    /// Chunks uploaded (the bucket lacked them).
    pub uploaded_chunks: u64,
    pub uploaded_bytes: u64,
    /// Bytes of the sealed page profile put beside the snapshot (0: it has none recorded).
    pub profile_bytes: u64,
    pub seconds: f64,
}

/// What a pull did (`POST …/pull`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Pulled {
    pub function: String,
    /// Bytes downloaded (0 when the function was known here already).
    pub pulled_bytes: u64,
    /// Chunks downloaded: the ones this node's store lacked.
    pub pulled_chunks: u64,
    /// Bytes of the page profile (the hot set) that came with the snapshot and is kept for its
    /// restores; 0: the bucket had none (or nothing was pulled).
    pub profile_bytes: u64,
    pub seconds: f64,
    /// Where the seconds went (absent when nothing was pulled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phases: Option<PullPhases>,
}

/// Where a pull's seconds went. The snapshot's files and its segments travel in one pipeline
/// (`torpor_objstore::pull_snapshot`): `files_s` is all of the transfer, from the first small
/// GET to the snapshot directory in place; within it `files_metadata_s`, then `fetch_s` (the
/// pipeline), `materialise_wait_s` and `files_commit_s` follow each other, while
/// `files_fetch_s`, `segments_s`, `files_materialise_s` and `files_verify_s` overlap the
/// pipeline.
#[derive(Debug, Clone, Copy, Default, Serialize, utoipa::ToSchema)]
pub struct PullPhases {
    /// The function's record from the bucket.
    pub record_s: f64,
    /// The page profile: its GET and MAC check (before the transfer), and writing it where
    /// restores find it (after the portability check).
    pub profile_s: f64,
    /// The snapshot's transfer, all of it: the steps below.
    pub files_s: f64,
    /// The small GETs: the files' manifest, record, MAC and locator, the segments' sealed
    /// record and locator.
    pub files_metadata_s: f64,
    /// From the transfer's start until the pipeline's: the small GETs, then the store's writer,
    /// the directory's files made and the prefill's start.
    pub files_pipeline_start_s: f64,
    /// From the transfer's start until it returned (what follows the pipeline: the commit, the
    /// directory renamed into place, what the pull's end drops).
    pub files_returned_s: f64,
    /// The pipeline: every chunk of the files and the segments fetched, checked and written
    /// into the store.
    pub fetch_s: f64,
    /// Of the pipeline: from its start until the files' chunks were all in the store.
    pub files_fetch_s: f64,
    /// After the pipeline: waiting for the snapshot directory to be written and verified.
    pub materialise_wait_s: f64,
    /// The store's commit of both records: one syncfs, then the records.
    pub files_commit_s: f64,
    /// Finishing the snapshot directory, beside the pipeline (the pipeline writes each of the
    /// files' chunks into it as it comes): the chunks the store had already, the MAC, the
    /// manifest.
    pub files_materialise_s: f64,
    /// Authenticating the manifest and hashing the directory's files, beside the pipeline.
    pub files_verify_s: f64,
    /// Bytes written into the directory's files, and bytes of chunks of zeros left as holes
    /// (torpor_objstore::InlineStats).
    pub files_written_bytes: u64,
    pub files_zero_bytes: u64,
    /// Writes into a file another writer held, handed to it; seconds writers waited for a
    /// file all the same (its queue full).
    pub files_handed_over: u64,
    pub files_wait_s: f64,
    /// Of the directory's files, those its writers filled side by side through a mapping.
    pub files_mapped: u64,
    /// Blocks of the directory's files hashed as they landed, before its verification (which
    /// then compares their hashes instead of reading the files again).
    pub files_hashed_early_blocks: u64,
    /// From the start of the transfer until the segments' chunks were all in the store (0: a
    /// snapshot without a segment record).
    pub segments_s: f64,
    /// Checking that the files the snapshot reopens are this node's (with the wait for the
    /// warm-up below, when it had not finished).
    pub portability_s: f64,
    /// Reading the files the snapshot reopens while the transfer ran: hashing the ones this
    /// node's hash cache lacks, the kernel's readahead for the others (0: the record lists
    /// none).
    pub reopened_warm_s: f64,
    /// Bytes of them hashed then (the cache did not know them).
    pub reopened_hashed_bytes: u64,
    /// Bytes of them the cache did not know whose hashes their installer had recorded (a
    /// wheel's RECORD; torpor_image's installer_record): taken from there, not read.
    pub reopened_recorded_bytes: u64,
    /// Registering the function (its snapshot is staged and the store trimmed after the
    /// answer).
    pub register_s: f64,
    /// The pipeline's threads (`torpor_objstore::PipelineTimes`), each time below summed over
    /// its threads: fetchers and writers.
    pub fetchers: u64,
    pub writers: u64,
    /// Fetchers in GETs.
    pub fetch_get_busy_s: f64,
    /// Fetchers waiting for a writer (the writers are behind).
    pub fetch_queue_full_s: f64,
    /// Writers waiting for a GET (the GETs are behind).
    pub fetch_queue_empty_s: f64,
    /// Writers checking chunks (decoding, hashing).
    pub fetch_check_busy_s: f64,
    /// Writers placing chunks in the store (the file system).
    pub fetch_place_busy_s: f64,
    /// Of `fetch_place_busy_s`: writing the files' chunks into the snapshot directory, and
    /// copying the segments' into the host cache (`torpor_objstore::PipelineTimes::hand_*`).
    pub fetch_place_directory_busy_s: f64,
    pub fetch_place_host_cache_busy_s: f64,
    /// Range buffers made and faulted in ahead of the fetchers (torpor_objstore's
    /// fetch_buffers.rs): the ranges whose buffers the store holds.
    pub fetch_buffers_made: u64,
    /// The segments' bytes put into the restore server's host cache as they came
    /// (crate::split::prefill), for the first restore to fill from memory.
    pub prefilled_bytes: u64,
    /// After the pipeline: the prefilled segments' chunks the store had, read, and the
    /// segments put into the host cache.
    pub prefill_s: f64,
    /// Fetched chunk files held in memory at the answer, written into the store after it
    /// (`objstore.hold_bytes`; docs/objstore.md, "Chunk files placed after the answer").
    pub held_chunks: u64,
    /// Requests sent to the bucket for the snapshot's files and segments (their small objects,
    /// the ranged GETs of packs, loose chunks): with `objstore.range_bytes` shorter, more.
    pub requests: u64,
}

/// Reads `files` ahead of the portability check on a thread of its own
/// (torpor_image::warm_reopened): what it did, and its seconds. None when there are none.
fn warm_reopened_in_background(
    files: Vec<torpor_image::ReopenedFile>,
) -> Option<std::thread::JoinHandle<(torpor_image::Warmed, f64)>> {
    if files.is_empty() {
        return None;
    }
    std::thread::Builder::new()
        .name("torpor-warm-reopened".into())
        .spawn(move || {
            let t = Instant::now();
            let mut cache = torpor_image::HashCache::open(&torpor_image::hash_cache_path());
            let warmed =
                torpor_image::warm_reopened(&files, Path::new("/"), &mut cache, WARM_THREADS);
            (warmed, t.elapsed().as_secs_f64())
        })
        .ok()
}

/// Makes a pull's records durable now (blocking), or logs why not: their markers then stay
/// for the next start's settle.
pub fn finish_pending(pending: Option<torpor_image::store::Pending>) {
    if let Some(p) = pending {
        let ids = p.ids().join(", ");
        if let Err(e) = p.finish() {
            tracing::error!(snapshots = %ids, error = %e, "a pull's records are not durable: the next start checks their chunks");
        }
    }
}

/// A pull's transfer, before the function is registered.
#[derive(Debug)]
pub struct Fetched {
    pub record: FunctionRecord,
    pub snapshot_dir: PathBuf,
    pub pulled_bytes: u64,
    pub pulled_chunks: u64,
    /// Bytes of the page profile kept (0: none came).
    pub profile_bytes: u64,
    pub phases: PullPhases,
    /// The records' durability, still to come ([`torpor_image::store::Pending::finish`], in
    /// the background): the pull answers before the disk (docs/objstore.md, "Durability after
    /// the answer").
    pub pending: Option<torpor_image::store::Pending>,
}

/// Why a push did not happen. The deploy still succeeded: this is reported beside it.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error(transparent)]
    Transfer(Box<TransferError>),
    #[error(transparent)]
    Remote(Box<ObjError>),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The chunk store cannot be opened.
    #[error("{0}")]
    StoreOpen(String),
    /// The name belongs to another tenant in the bucket.
    #[error("the name {name:?} belongs to tenant {owner:?} in bucket {bucket} (function names are cluster-wide): rename the function, or remove functions/{owner}/{name}.json and function-names/{name}.json from the bucket")]
    NameTaken {
        name: String,
        owner: String,
        bucket: String,
    },
    #[error("cannot encode the function record: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("cannot read the page profile {path}: {source}")]
    Profile {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Why a pull did not register the function.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// Not in the bucket (or not the caller's tenant's): 404.
    #[error("no function named {name:?} in bucket {bucket}{tenant}: deploy it on a node of this cluster first (its deploy pushes it)")]
    NotInBucket {
        name: String,
        bucket: String,
        tenant: String,
    },
    /// The record is not one torpord wrote, or names something else.
    #[error("the function record {key} in bucket {bucket} is invalid ({reason}): deploy the function again to replace it")]
    BadRecord {
        key: String,
        bucket: String,
        reason: String,
    },
    /// The function's directory is not on this node.
    #[error("function {name:?} needs its directory {dir} on this node (restored workers bind it at that path), and it is not a directory here: copy the function's directory to {dir} on this node and pull again")]
    NoDir { name: String, dir: PathBuf },
    /// A file the snapshot's processes reopen differs on this node.
    #[error(transparent)]
    NotPortable(torpor_image::ImageError),
    #[error(transparent)]
    Transfer(Box<TransferError>),
    #[error(transparent)]
    Remote(Box<ObjError>),
    #[error("{0}")]
    StoreOpen(String),
    #[error("cannot remove the stale {path}: {source}")]
    Stale {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot keep the pulled page profile at {path}: {source}")]
    Profile {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl From<TransferError> for PushError {
    fn from(e: TransferError) -> Self {
        Self::Transfer(Box::new(e))
    }
}

impl From<ObjError> for PushError {
    fn from(e: ObjError) -> Self {
        Self::Remote(Box::new(e))
    }
}

impl From<TransferError> for PullError {
    fn from(e: TransferError) -> Self {
        Self::Transfer(Box::new(e))
    }
}

impl From<ObjError> for PullError {
    fn from(e: ObjError) -> Self {
        Self::Remote(Box::new(e))
    }
}

impl PullError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            Self::NotInBucket { .. } => StatusCode::NOT_FOUND,
            Self::NoDir { .. } | Self::NotPortable(_) => StatusCode::CONFLICT,
            Self::BadRecord { .. } | Self::Transfer(_) | Self::Remote(_) => StatusCode::BAD_GATEWAY,
            Self::StoreOpen(_) | Self::Stale { .. } | Self::Profile { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

/// The page profile recorded for snapshot `id` under `state_root`, to push beside it (`None`:
/// none recorded, or one too large for a pull to take, which only costs the hot set).
fn read_profile(state_root: &Path, id: &str) -> Result<Option<Vec<u8>>, PushError> {
    let Some(path) = crate::profiles::recorded(state_root, id) else {
        return Ok(None);
    };
    match std::fs::read(&path) {
        Ok(p) if p.len() as u64 > torpor_objstore::MAX_PROFILE_BYTES => {
            tracing::warn!(path = %path.display(), bytes = p.len(), "the page profile is too large to push: nodes that pull the snapshot serve no hot set");
            Ok(None)
        }
        Ok(p) => Ok(Some(p)),
        // Removed meanwhile with its snapshot.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PushError::Profile { path, source }),
    }
}

/// Writes a pulled snapshot's profile where its restores look for it
/// (crate::profiles::recorded): aside, mode 0600, then renamed, so a restore never reads half
/// of one. `None`: the bucket had none, and a file left there by a pull that died goes.
fn keep_profile(path: &Path, profile: Option<&[u8]>) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let Some(profile) = profile else {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let aside = path.with_extension("pulled");
    let _ = std::fs::remove_file(&aside);
    // No fsync: like the pull's records, its durability follows the answer; a profile lost to
    // a power cut only costs the hot set.
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&aside)?
        .write_all(profile)?;
    std::fs::rename(&aside, path)
}

/// The object tier of one daemon.
#[derive(Debug)]
pub struct Tier {
    pub config: Objstore,
    /// Functions whose last push failed: when to try again, and the delay after that.
    pending: Mutex<BTreeMap<String, (Instant, Duration)>>,
    /// Last push error per function, for `placement` and logs.
    last_error: Mutex<BTreeMap<String, String>>,
}

fn record_key(tenant: &str, name: &str) -> String {
    format!("functions/{tenant}/{name}.json")
}

fn name_key(name: &str) -> String {
    format!("function-names/{name}.json")
}

impl Tier {
    /// The tier for `config`; its credentials file is read now, so that a bad one stops the
    /// start in one line rather than failing every deploy's push.
    pub fn open(config: &Objstore) -> Result<Tier, torpor_objstore::ConfigError> {
        torpor_objstore::Credentials::load(&config.credentials_file)?;
        Ok(Tier {
            config: config.clone(),
            pending: Mutex::new(BTreeMap::new()),
            last_error: Mutex::new(BTreeMap::new()),
        })
    }

    /// A client for one operation: the credentials file is read again, so rotated credentials
    /// take effect without a restart.
    pub(crate) fn remote(&self) -> Result<Remote, TransferError> {
        Remote::open(&self.config.remote())
    }

    /// A client for `tenant`'s snapshots (packs, locators, segment records): the bucket's prefix
    /// for the default tenant, `<prefix>tenants/<tenant>/` for another, so that chunks are
    /// deduplicated within a tenant only, as in the node's stores (crate::split::store_root_of),
    /// and a push's `uploaded_bytes` cannot tell one tenant what another pushed.
    fn snapshots_remote(&self, tenant: &str) -> Result<Remote, TransferError> {
        let mut config = self.config.remote();
        if tenant != crate::tenant::DEFAULT_TENANT {
            let part = crate::tenant::path_component(tenant);
            config.prefix = format!("{}tenants/{part}/", config.prefix);
        }
        Remote::open(&config)
    }

    /// Pushes function `f`'s snapshot at `dir` (sealed by `key`) and its record. Blocking.
    pub fn push(
        &self,
        store: &ChunkStore,
        key: &torpor_image::SnapshotKey,
        f: &Function,
        dir: &Path,
        state_dir: &Path,
    ) -> Result<Pushed, PushError> {
        let t = Instant::now();
        let Some(id) = f.snapshot.clone() else {
            return Err(PushError::StoreOpen(format!(
                "function {:?} has no snapshot to push",
                f.name
            )));
        };
        let tenant = crate::tenant::of_spec(&f.spec).to_string();
        // A split snapshot's segments are a sealed record under the snapshot's id: it travels
        // too (torpor_objstore::push_sealed_record), or no other node could restore it.
        let split = match store.recipes(&id) {
            Ok(_) => true,
            Err(StoreError::UnknownSnapshot { .. }) => false,
            Err(e) => return Err(e.into()),
        };
        let remote = self.remote()?;
        if let Some(owner) = remote.get(&name_key(&f.name), MAX_RECORD_BYTES)? {
            let owner: NameRecord = serde_json::from_slice(&owner).unwrap_or(NameRecord {
                tenant: tenant.clone(),
            });
            if owner.tenant != tenant {
                return Err(PushError::NameTaken {
                    name: f.name.clone(),
                    owner: owner.tenant,
                    bucket: remote.bucket().to_owned(),
                });
            }
        }
        let snapshots = self.snapshots_remote(&tenant)?;
        let report = torpor_objstore::push(
            &snapshots,
            store,
            dir,
            &files_id(&id),
            torpor_image::Trust::Key(key),
            self.config.parallel,
            &|_| {},
        )?;
        let segments = if split {
            Some(torpor_objstore::push_sealed_record(
                &snapshots,
                store,
                &id,
                key,
                self.config.parallel,
                &|_| {},
            )?)
        } else {
            None
        };
        // The hot set its deploy recorded, sealed, before the record: a record in the bucket
        // never precedes its profile, so the first restore on a pulling node serves it.
        let profile_bytes = match read_profile(state_dir, &id)? {
            Some(profile) => torpor_objstore::push_profile(&snapshots, &id, key, &profile)?,
            None => 0,
        };
        let record = FunctionRecord {
            format: RECORD_FORMAT,
            name: f.name.clone(),
            tenant: tenant.clone(),
            spec: f.spec.clone(),
            dir: f.dir.clone(),
            base_key: f.base_key.clone(),
            snapshot: id.clone(),
            snapshots: vec![id.clone()],
            pushed_ms: crate::registry::now_ms(),
            state_dir: state_dir.to_path_buf(),
            // A hint for the pulling node only: the pull checks the sealed manifest's list.
            reopened: torpor_image::Snapshot::open(dir)
                .map(|s| s.manifest().reopened_files.clone())
                .unwrap_or_default(),
        };
        // The snapshot first, then the record that points at it, then the name.
        remote.put(&record_key(&tenant, &f.name), &serde_json::to_vec(&record)?)?;
        remote.put(
            &name_key(&f.name),
            &serde_json::to_vec(&NameRecord {
                tenant: tenant.clone(),
            })?,
        )?;
        let traffic = snapshots.traffic();
        Ok(Pushed {
            function: f.name.clone(),
            snapshot: id,
            bucket: report.bucket,
            chunks: report.chunks + segments.map_or(0, |s| s.chunks),
            uploaded_chunks: report.uploaded + segments.map_or(0, |s| s.moved),
            uploaded_bytes: traffic.bytes_up,
            profile_bytes,
            seconds: t.elapsed().as_secs_f64(),
        })
    }

    /// The tenant whose record of `name` the caller may read: its own for a tenant's token;
    /// for every-tenant callers, the name file's, or `None` when the bucket has no such name.
    fn tenant_for(
        &self,
        remote: &Remote,
        scope: &Scope,
        name: &str,
    ) -> Result<Option<String>, PullError> {
        match scope {
            Scope::Tenant(t) => Ok(Some(t.clone())),
            Scope::All => {
                let Some(bytes) = remote.get(&name_key(name), MAX_RECORD_BYTES)? else {
                    return Ok(None);
                };
                let owner: NameRecord =
                    serde_json::from_slice(&bytes).map_err(|e| PullError::BadRecord {
                        key: remote.full_key(&name_key(name)),
                        bucket: remote.bucket().to_owned(),
                        reason: e.to_string(),
                    })?;
                Ok(Some(owner.tenant))
            }
        }
    }

    /// The function record of `name` the caller may read, if the bucket has it. Blocking.
    pub fn record(&self, scope: &Scope, name: &str) -> Result<FunctionRecord, PullError> {
        let remote = self.remote()?;
        self.record_with(&remote, scope, name)
    }

    fn record_with(
        &self,
        remote: &Remote,
        scope: &Scope,
        name: &str,
    ) -> Result<FunctionRecord, PullError> {
        let missing = || PullError::NotInBucket {
            name: name.to_owned(),
            bucket: remote.bucket().to_owned(),
            tenant: match scope {
                Scope::Tenant(t) => format!(" for tenant {t:?}"),
                Scope::All => String::new(),
            },
        };
        let Some(tenant) = self.tenant_for(remote, scope, name)? else {
            return Err(missing());
        };
        let key = record_key(&tenant, name);
        let Some(bytes) = remote.get(&key, MAX_RECORD_BYTES)? else {
            return Err(missing());
        };
        let bad = |reason: String| PullError::BadRecord {
            key: remote.full_key(&key),
            bucket: remote.bucket().to_owned(),
            reason,
        };
        let r: FunctionRecord = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if r.format != RECORD_FORMAT {
            return Err(bad(format!(
                "format {}, this torpord reads {RECORD_FORMAT}",
                r.format
            )));
        }
        if r.name != name || r.tenant != tenant || crate::tenant::of_spec(&r.spec) != tenant {
            return Err(bad(format!(
                "it names function {:?} of tenant {:?}",
                r.name, r.tenant
            )));
        }
        if !r.snapshot.starts_with(&format!("fn-{name}-")) || r.snapshots != [r.snapshot.clone()] {
            return Err(bad(format!(
                "its snapshot {:?} is not this function's",
                r.snapshot
            )));
        }
        torpor_image::store::check_snapshot_id(&r.snapshot).map_err(|e| bad(e.to_string()))?;
        crate::spec::FunctionSpec::from_json(&r.spec).map_err(|e| bad(e.to_string()))?;
        if !r.dir.is_absolute() {
            return Err(bad(format!("its dir {} is relative", r.dir.display())));
        }
        Ok(r)
    }

    /// Fetches function `name`'s record and snapshot into `snapshots` (`<state>/snapshots`),
    /// and its page profile if the bucket has one into `<state_root>/profiles`, and checks that
    /// the snapshot can run here (its directory, the files it reopens). Blocking; registers
    /// nothing.
    pub fn fetch(
        &self,
        stores: &dyn Fn(&str) -> Result<ChunkStore, PullError>,
        key: &torpor_image::SnapshotKey,
        scope: &Scope,
        name: &str,
        (snapshots, state_root): (&Path, &Path),
        split: Option<&Arc<crate::split::Split>>,
    ) -> Result<Fetched, PullError> {
        let clock = Instant::now();
        let remote = self.remote()?;
        let record = self.record_with(&remote, scope, name)?;
        // The chunk store of the function's tenant (crate::split::Split::store_for), and its
        // snapshots' place in the bucket.
        let store = &stores(&record.tenant)?;
        let remote = self.snapshots_remote(&record.tenant)?;
        let mut phases = PullPhases {
            record_s: clock.elapsed().as_secs_f64(),
            ..PullPhases::default()
        };
        if !record.dir.is_dir() {
            return Err(PullError::NoDir {
                name: name.to_owned(),
                dir: record.dir.clone(),
            });
        }
        // The files the restore will reopen, read while the transfer runs: on a node that never
        // ran the snapshot's base their hashing would follow the transfer, and CRIU would read
        // them from disk (docs/cluster.md, "Reopened files read during the pull").
        let warming = warm_reopened_in_background(record.reopened.clone());
        // The hot set, its MAC checked before any chunk is fetched (a rewritten one fails the
        // pull having fetched nothing); kept only once the snapshot is in place.
        let t = Instant::now();
        let profile = torpor_objstore::pull_profile(&remote, &record.snapshot, key)?;
        phases.profile_s = t.elapsed().as_secs_f64();
        let out = snapshots.join(&record.snapshot);
        // Left by a pull that died before registering it (the registry does not know it: the
        // caller checked that the function is unknown, under its deploy lock).
        if out.exists() {
            std::fs::remove_dir_all(&out).map_err(|source| PullError::Stale {
                path: out.clone(),
                source,
            })?;
        }
        // Left by a pull killed while it wrote the directory beside its place
        // (torpor_objstore writes it as `.<snapshot>.pull-<pid>`, then renames it): with the
        // pipeline that is most of a pull of a split snapshot, the files written while the
        // segments come. No other pull of this function runs (its deploy lock).
        let aside = format!(".{}.pull-", record.snapshot);
        for entry in std::fs::read_dir(snapshots).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&aside) {
                let path = entry.path();
                tracing::info!(path = %path.display(), "removing what a pull that did not finish left aside");
                std::fs::remove_dir_all(&path)
                    .map_err(|source| PullError::Stale { path, source })?;
            }
        }
        // The files and the split snapshot's segment record (sealed by a node with this
        // node's key) in one pipeline and one commit (torpor_objstore::pull_snapshot): the
        // chunks of both fetched by one pool, checked and written as they come, the disk
        // writing meanwhile, the directory written and verified as soon as the files' chunks
        // are in, then one syncfs for both records.
        // The segments into the restore server's host cache as they come, for the first
        // restore (crate::split::prefill).
        let prefill =
            split.map(|s| crate::split::prefill::HostPrefill::new(Arc::clone(s), &record.tenant));
        let t = Instant::now();
        let pulled = torpor_objstore::pull_snapshot_deferred(
            &remote,
            store,
            &files_id(&record.snapshot),
            &out,
            torpor_image::Trust::Key(key),
            Some(torpor_objstore::SealedPart {
                id: &record.snapshot,
                key,
            }),
            self.config.parallel,
            torpor_objstore::AfterAnswer {
                early_write_back: self.config.early_write_back,
                hold_bytes: self.config.hold_bytes,
            },
            &|_| {},
            prefill
                .as_ref()
                .map(|p| p as &dyn torpor_objstore::SealedSink),
        );
        phases.files_s = t.elapsed().as_secs_f64();
        // Nothing is committed on an error, but for a failed write of the segments' record
        // after the files' one (the files' record is committed first): that one is only a
        // cache of chunks, trimmed as such (Tier::trim).
        let (pulled, pending) = pulled?;
        let (report, segments) = (pulled.files, pulled.sealed);
        let t = report.timings;
        phases.files_metadata_s = t.metadata_s;
        phases.files_pipeline_start_s = t.pipeline_start_s;
        phases.files_returned_s = t.total_s;
        phases.files_fetch_s = t.files_fetch_s;
        phases.files_commit_s = t.commit_s;
        phases.files_materialise_s = t.materialise_s;
        phases.files_verify_s = t.verify_s;
        phases.files_written_bytes = t.files_written.written_bytes;
        phases.files_zero_bytes = t.files_written.zero_bytes;
        phases.files_handed_over = t.files_written.handed_over;
        phases.files_mapped = t.files_written.mapped_files;
        phases.files_wait_s = t.files_written.waited_s;
        phases.files_hashed_early_blocks = t.files_written.hashed_early_blocks;
        phases.fetch_s = t.fetch_s;
        phases.materialise_wait_s = t.materialise_wait_s;
        phases.fetchers = t.pipeline.fetchers;
        phases.writers = t.pipeline.writers;
        phases.fetch_get_busy_s = t.pipeline.get_s;
        phases.fetch_queue_full_s = t.pipeline.queue_full_s;
        phases.fetch_queue_empty_s = t.pipeline.queue_empty_s;
        phases.fetch_check_busy_s = t.pipeline.check_s;
        phases.fetch_place_busy_s = t.pipeline.place_s;
        phases.fetch_buffers_made = t.pipeline.buffers_made;
        phases.fetch_place_directory_busy_s = t.pipeline.hand_files_s;
        phases.fetch_place_host_cache_busy_s = t.pipeline.hand_others_s;
        // From the pull's start to the segments' last chunk in the store (their commit is the
        // files' one).
        phases.segments_s = if segments.is_some() {
            t.metadata_s + t.segments_fetch_s
        } else {
            0.0
        };
        let portability = Instant::now();
        if let Some((warmed, seconds)) = warming.and_then(|w| w.join().ok()) {
            phases.reopened_warm_s = seconds;
            phases.reopened_hashed_bytes = warmed.hashed_bytes;
            phases.reopened_recorded_bytes = warmed.recorded_bytes;
        }
        // Refused here rather than at the first restore: the files this node would map into
        // the restored processes must be the ones the snapshot was taken with.
        let checked = torpor_image::Snapshot::open(&out).and_then(|s| {
            let mut cache = torpor_image::HashCache::open(&torpor_image::hash_cache_path());
            torpor_image::check_reopened(
                &s.manifest().reopened_files,
                Path::new("/"),
                &out,
                &mut cache,
            )
        });
        if let Err(e) = checked {
            // Not a registered snapshot yet: its directory, and any split record of it.
            if let Err(e) = std::fs::remove_dir_all(&out) {
                tracing::warn!(path = %out.display(), error = %e, "cannot remove a pulled snapshot that is not portable");
            }
            crate::split::release_snapshot_of_dir(&out);
            // The records stay as a cache of chunks: durable like any other.
            finish_pending(pending);
            return Err(PullError::NotPortable(e));
        }
        phases.portability_s = portability.elapsed().as_secs_f64();
        let t = Instant::now();
        let profile_path = crate::profiles::path(state_root, &record.snapshot);
        if let Err(source) = keep_profile(&profile_path, profile.as_deref()) {
            if let Err(e) = std::fs::remove_dir_all(&out) {
                tracing::warn!(path = %out.display(), error = %e, "cannot remove a pulled snapshot whose profile could not be kept");
            }
            crate::split::release_snapshot_of_dir(&out);
            finish_pending(pending);
            return Err(PullError::Profile {
                path: profile_path,
                source,
            });
        }
        phases.profile_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let prefilled = prefill.map(|p| p.finish(store)).unwrap_or_default();
        phases.prefill_s = t.elapsed().as_secs_f64();
        phases.prefilled_bytes = prefilled.bytes;
        phases.held_chunks = pending.as_ref().map_or(0, |p| p.held_chunks() as u64);
        phases.requests = remote.traffic().requests;
        Ok(Fetched {
            record,
            snapshot_dir: out,
            pulled_bytes: remote.traffic().bytes_down,
            pulled_chunks: report.fetched + segments.map_or(0, |s| s.moved),
            profile_bytes: profile.map_or(0, |p| p.len() as u64),
            phases,
            pending,
        })
    }

    /// Whether the bucket has the record of `name` for the caller (`None`: it cannot be told,
    /// the server did not answer). Blocking.
    pub fn in_bucket(&self, scope: &Scope, tenant: Option<&str>, name: &str) -> Option<bool> {
        let remote = self.remote().ok()?;
        let tenant = match tenant {
            Some(t) => Some(t.to_owned()),
            None => self.tenant_for(&remote, scope, name).ok()?,
        };
        match tenant {
            Some(t) => remote.exists(&record_key(&t, name)).ok(),
            None => Some(false),
        }
    }

    /// Records a failed push of `name`: it is tried again later ([`Tier::due`]).
    pub fn failed(&self, name: &str, error: &str) {
        let mut pending = lock(&self.pending);
        let delay = pending
            .get(name)
            .map_or(RETRY_FIRST, |(_, d)| (*d * 2).min(RETRY_MAX));
        pending.insert(name.to_owned(), (Instant::now() + delay, delay));
        lock(&self.last_error).insert(name.to_owned(), error.to_owned());
    }

    /// Records a successful push (or a function gone): nothing to retry.
    pub fn done(&self, name: &str) {
        lock(&self.pending).remove(name);
        lock(&self.last_error).remove(name);
    }

    /// The functions whose push is due for another try.
    pub fn due(&self) -> Vec<String> {
        let now = Instant::now();
        lock(&self.pending)
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Keeps the chunk store within `cache_bytes` beyond what `registered` (the snapshot ids
    /// the registry names) need: releases the least recently written other function-snapshot
    /// records, oldest first, and deletes the chunks nothing references any more. Blocking.
    pub fn trim(
        &self,
        store: &ChunkStore,
        registered: &BTreeSet<String>,
    ) -> Result<u64, StoreError> {
        let mut others: Vec<(std::time::SystemTime, String)> = store
            .snapshots()?
            .into_iter()
            .filter(|id| {
                id.strip_suffix(".files")
                    .is_some_and(|snapshot| !registered.contains(snapshot))
            })
            .map(|id| {
                let written =
                    std::fs::metadata(store.root().join(REFS_DIR).join(format!("{id}.json")))
                        .and_then(|m| m.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                (written, id)
            })
            .collect();
        others.sort();
        let mut freed = 0;
        let mut report = match store.try_gc()? {
            Some(r) => r,
            // A writer is busy: the next push or pull trims.
            None => return Ok(0),
        };
        freed += report.freed_bytes;
        for (_, id) in others {
            if report.kept_bytes <= self.config.cache_bytes {
                break;
            }
            store.release(&id)?;
            report = match store.try_gc()? {
                Some(r) => r,
                None => break,
            };
            freed += report.freed_bytes;
            tracing::info!(snapshot = %id, kept_bytes = report.kept_bytes, cache_bytes = self.config.cache_bytes, "released a cached snapshot's chunks from the store (objstore.cache_bytes)");
        }
        Ok(freed)
    }
}
