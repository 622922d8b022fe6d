//! Deploy (docs/torpord.md, "Snapshots"): validate the spec, make the base snapshot for its key
//! if there is none (boot a `--role base` worker, quiesce, snapshot), restore the base, `load`
//! the function, quiesce, and snapshot the function. Each phase is reported as it ends.
//!
//! The base key is (interpreter's absolute path, sorted preload list, GPU or not). Deploying a
//! second function on an existing base boots no Python: its first phase is `restore_base`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::journal::Journal;
use crate::launcher::{self, WorkerCommand};
use crate::protocol::{Empty, Invoke, Quiesce, ToWorker};
use crate::registry::{now_ms, Function, FunctionState, JournalOp, Snapshot, SnapshotKind};
use crate::runtime::process::{
    dir_bytes, restore, wake, TreeGuard, QUIET_TIMEOUT, RECONNECT_TIMEOUT,
};
use crate::runtime::start::boot::{base_key, load_frame, ready, NotReady, CONNECT_TIMEOUT};
use crate::runtime::Runtime;
use crate::workers::{ConnError, WorkerConn};

/// A spec that `python3 -m torpor.spec` accepted.
#[derive(Debug, Clone)]
pub struct ValidSpec {
    pub json: Value,
    pub name: String,
    pub dir: PathBuf,
    /// Who asks for the deploy ([`validate`] says every tenant; the API sets the caller's): a
    /// tenant's token may not replace another tenant's function of the same name.
    pub caller: crate::tenant::Scope,
}

/// Validates `dir`'s torpor.toml with `python3 -m torpor.spec`. The error says whether it is
/// the user's mistake (400) or the daemon's (500): [`ValidateError::is_users_mistake`].
pub async fn validate(rt: &Runtime, dir: &str) -> Result<ValidSpec, ValidateError> {
    let python_dir = rt.python_dir.clone()?;
    if dir.is_empty() {
        return Err(ValidateError::EmptyDir);
    }
    let dir = PathBuf::from(dir);
    if !dir.is_absolute() {
        return Err(ValidateError::RelativeDir { dir });
    }
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-m", "torpor.spec"])
            .arg(&dir)
            .env("PYTHONPATH", launcher::pythonpath(&python_dir))
            .stdin(std::process::Stdio::null())
            .output()
    })
    .await
    .map_err(ValidateError::Task)?
    .map_err(ValidateError::RunChecker)?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        return Err(ValidateError::Refused {
            status: out.status.code(),
            line: msg
                .lines()
                .last()
                .unwrap_or("spec check failed")
                .to_string(),
        });
    }
    let json: Value = serde_json::from_slice(&out.stdout).map_err(ValidateError::NoJson)?;
    // The one definition of the spec's shape (crate::spec): a torpor package of another
    // version is refused here, not halfway through the deploy.
    crate::spec::FunctionSpec::from_json(&json)?;
    let k = crate::runtime::keepalive_of(&json, &rt.config.keepalive);
    if !(k.gpu_release <= k.hibernate && k.hibernate <= k.evict) {
        return Err(ValidateError::KeepaliveOrder {
            gpu_release: k.gpu_release,
            hibernate: k.hibernate,
            evict: k.evict,
        });
    }
    let name = json["name"].as_str().unwrap_or_default().to_string();
    let dir = PathBuf::from(json["dir"].as_str().unwrap_or_default());
    Ok(ValidSpec {
        json,
        name,
        dir,
        caller: crate::tenant::Scope::All,
    })
}

/// Why a deploy's spec was not accepted (its `validate` phase, before anything is recorded).
#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    /// The `torpor` Python package, which checks the spec, cannot be found (the daemon's).
    #[error(transparent)]
    SdkDir(#[from] crate::sdk_dir::SdkDirError),
    /// The body names no directory (the user's).
    #[error("the body's \"dir\" is empty: name the function's directory")]
    EmptyDir,
    /// The directory is relative to nothing the daemon knows (the user's).
    #[error(
        "the function directory {} is relative: send an absolute path (`torpor deploy` does)",
        dir.display()
    )]
    RelativeDir { dir: PathBuf },
    /// The blocking task running the checker did not finish (the daemon's).
    #[error("spec task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    /// `python3` cannot be run (the daemon's).
    #[error("cannot run python3 -m torpor.spec: {0}; install python3")]
    RunChecker(#[source] std::io::Error),
    /// The checker refused the spec: `line` is the last line of its stderr, `status` its exit
    /// code (1: the spec is wrong, the user's; anything else: the checker failed, the daemon's).
    #[error("{line}")]
    Refused { status: Option<i32>, line: String },
    /// The checker printed no JSON (the daemon's).
    #[error("python3 -m torpor.spec printed no JSON: {0}")]
    NoJson(#[source] serde_json::Error),
    /// The checker's spec is not the one this daemon reads (the daemon's).
    #[error(transparent)]
    Spec(#[from] crate::spec::SpecMismatch),
    /// The keep-alive delays decrease (the user's).
    #[error(
        "torpor.toml: keepalive delays count from the moment the instance went idle, so they \
         must not decrease (gpu_release_s ≤ hibernate_s ≤ evict_s), got {}, {}, {}",
        gpu_release.as_secs_f64(),
        hibernate.as_secs_f64(),
        evict.as_secs_f64()
    )]
    KeepaliveOrder {
        gpu_release: std::time::Duration,
        hibernate: std::time::Duration,
        evict: std::time::Duration,
    },
}

impl ValidateError {
    /// The user's mistake (answered 400), not the daemon's (500).
    pub fn is_users_mistake(&self) -> bool {
        match self {
            Self::EmptyDir | Self::RelativeDir { .. } | Self::KeepaliveOrder { .. } => true,
            Self::Refused { status, .. } => *status == Some(1),
            Self::SdkDir(_)
            | Self::Task(_)
            | Self::RunChecker(_)
            | Self::NoJson(_)
            | Self::Spec(_) => false,
        }
    }
}

/// One NDJSON line of a deploy's answer.
fn phase(name: &str, s: f64, extra: Value) -> Value {
    let mut v = json!({"phase": name, "s": s});
    if let (Some(m), Value::Object(e)) = (v.as_object_mut(), extra) {
        m.extend(e);
    }
    v
}

/// A deploy that failed in `phase`.
struct Failure {
    phase: &'static str,
    message: String,
    error: Option<Value>,
    /// The node's GPU had too little free memory (not the function's fault): the error line
    /// says `"cause": "gpu_memory"`, and a cluster deploys on another node (torpor.cluster).
    gpu_memory: bool,
}

fn fail(phase: &'static str, message: impl std::fmt::Display) -> Failure {
    Failure {
        phase,
        message: message.to_string(),
        error: None,
        gpu_memory: false,
    }
}

/// The `cause` of a deploy's error line that says the node, not the function, was at fault.
pub const CAUSE_GPU_MEMORY: &str = "gpu_memory";

pub(crate) fn fnv(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Runs the deploy of an accepted spec, sending phase lines and then the result on `tx`.
pub async fn run(rt: Arc<Runtime>, spec: ValidSpec, tx: mpsc::UnboundedSender<Value>) {
    let t0 = Instant::now();
    // Deploys of other functions run meanwhile (crate::deploy_locks).
    let _this_function = rt.deploy_locks.function(&spec.name).await;
    let name = spec.name.clone();
    let previous = match deploying(&rt, &spec).await {
        Ok(p) => p,
        Err(e) => {
            let _ = tx.send(json!({"error": e.to_string(), "phase": "register"}));
            return;
        }
    };
    let journal = Journal::of(&rt.registry, JournalOp::Deploy, &name);
    let done = steps(&rt, &spec, &tx, &journal).await;
    // Failed or not, the function's row says how it ended once this is over.
    let ended = async {
        journal.end().await;
    };
    match done {
        Ok((snapshot, base, base_reused)) => {
            let total = t0.elapsed().as_secs_f64();
            rt.metrics.observe_phase(&name, "deploy", total);
            tracing::info!(function = %name, snapshot = %snapshot, base = %base, total_s = total, "deployed");
            ended.await;
            let mut result = json!({
                "function": name, "snapshot": snapshot, "base": base,
                "base_reused": base_reused, "total_s": total,
            });
            // With [objstore], the new snapshot goes to the bucket (crate::objstore). A failed
            // push does not fail the deploy: it is reported here and tried again later.
            if rt.objstore.is_some() {
                result["pushed"] = match rt.push_function(&name).await {
                    Ok(p) => json!(p),
                    Err(e) => json!(e),
                };
            }
            let _ = tx.send(json!({ "result": result }));
        }
        Err(f) => {
            tracing::warn!(function = %name, phase = f.phase, error = %f.message, "deploy failed");
            let restored = previous.is_some();
            let registry = Arc::clone(&rt.registry);
            let (n, message) = (name.clone(), f.message.clone());
            let _ = tokio::task::spawn_blocking(move || {
                registry.with(|s| {
                    if !restored {
                        s.set_function_failure(&n, &message, now_ms())?;
                    }
                    if let Some(mut f) = s.function(&n)? {
                        f.state = if restored {
                            FunctionState::Ready
                        } else {
                            FunctionState::Failed
                        };
                        f.updated = now_ms();
                        s.update_function(&f)?;
                    }
                    Ok::<_, crate::registry::RegistryError>(())
                })
            })
            .await;
            ended.await;
            let mut line = json!({"error": f.message, "phase": f.phase});
            if let Some(e) = f.error {
                line["worker_error"] = e;
            }
            if f.gpu_memory {
                line["cause"] = json!(CAUSE_GPU_MEMORY);
            }
            if restored {
                line["previous_kept"] = json!(true);
            }
            let _ = tx.send(line);
        }
    }
}

/// Records the function as deploying; returns the previous snapshot id, if it was deployed.
async fn deploying(rt: &Runtime, spec: &ValidSpec) -> Result<Option<Function>, RegisterError> {
    let registry = Arc::clone(&rt.registry);
    let spec = spec.clone();
    let user = rt.worker_user(&spec.json)?;
    let data: Vec<(String, std::path::PathBuf)> = spec.json["data"]
        .as_array()
        .into_iter()
        .flatten()
        // A source's object is loaded by torpord, not read from a path.
        .filter(|d| d.get("source").is_none_or(Value::is_null))
        .filter_map(|d| {
            Some((
                d["name"].as_str()?.to_string(),
                d["abs_path"].as_str()?.into(),
            ))
        })
        .collect();
    crate::function_mounts::check_readable(&spec.dir, &data, user)?;
    let key = base_key(&spec.json, &rt.split, user)?;
    tokio::task::spawn_blocking(move || {
        registry.transaction(|s| {
            let now = now_ms();
            s.clear_function_failure(&spec.name)?;
            match s.function(&spec.name)? {
                Some(mut f) => {
                    // Checked here, in the transaction that records the deploy, so that two
                    // tenants' first deploys of one name cannot both pass.
                    if !spec.caller.sees_spec(&f.spec) {
                        return Err(RegisterError::NameTaken {
                            name: spec.name.clone(),
                        });
                    }
                    let prev = (f.state == FunctionState::Ready && f.snapshot.is_some())
                        .then(|| f.clone());
                    // Recorded with the deploying state: a crash from here on is replayed
                    // (crate::recovery), back to `prev` if there is one.
                    let prev_id = prev.as_ref().and_then(|p| p.snapshot.as_deref());
                    s.journal_begin(JournalOp::Deploy, &spec.name, "validate", prev_id, now)?;
                    f.state = FunctionState::Deploying;
                    f.updated = now;
                    s.update_function(&f)?;
                    Ok(prev)
                }
                None => {
                    s.insert_function(&Function {
                        name: spec.name.clone(),
                        dir: spec.dir.clone(),
                        spec: spec.json.clone(),
                        base_key: key.0,
                        snapshot: None,
                        state: FunctionState::Deploying,
                        created: now,
                        updated: now,
                    })?;
                    s.journal_begin(JournalOp::Deploy, &spec.name, "validate", None, now)?;
                    Ok(None)
                }
            }
        })
    })
    .await
    .map_err(RegisterError::Task)?
}

impl From<crate::registry::RegistryError> for RegisterError {
    fn from(e: crate::registry::RegistryError) -> Self {
        Self::Registry(Box::new(e))
    }
}

/// Why a deploy could not be recorded as begun (its `register` phase); nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The spec's interpreter cannot be used (its base key needs its absolute path).
    #[error(transparent)]
    Python(#[from] launcher::ResolvePythonError),
    /// The tenant has no user for its workers.
    #[error(transparent)]
    User(#[from] crate::users::UserError),
    /// The function's directory is out of its workers' user's reach.
    #[error(transparent)]
    Unreadable(#[from] crate::function_mounts::UnreadableError),
    /// The blocking task writing the registry did not finish.
    #[error("the registry task recording the deploy failed ({0}); torpord's log has the cause")]
    Task(#[source] tokio::task::JoinError),
    /// The registry refused the write (e.g. a full disk).
    #[error(transparent)]
    Registry(Box<crate::registry::RegistryError>),
    /// Another tenant's function has this name (names are node-wide).
    #[error(
        "the function name {name:?} is taken on this node by another tenant (function names are \
         node-wide): choose another name in torpor.toml"
    )]
    NameTaken { name: String },
}

/// [`not_ready`], unless the kernel killed the worker for its cgroup's memory limit: then the
/// deploy fails with that reason (crate::cgroup::out_of_memory).
fn out_of_memory_or(
    cgroup: Option<&crate::cgroup::Cgroup>,
    phase: &'static str,
    e: NotReady,
) -> Failure {
    if cgroup.is_some_and(|c| c.oom_kills() > 0) {
        return fail(
            phase,
            crate::cgroup::Cgroup::explain_death(cgroup, String::new()),
        );
    }
    not_ready(phase, e)
}

/// A worker that did not become ready fails the deploy in `phase`, with the worker's own step
/// and error document where it sent one.
fn not_ready(phase: &'static str, e: NotReady) -> Failure {
    let error = match &e {
        NotReady::Failed {
            worker_phase,
            error,
        } => Some(json!({"phase": worker_phase, "error": error})),
        NotReady::Conn(_) | NotReady::TimedOut { .. } => None,
    };
    Failure {
        phase,
        message: e.to_string(),
        error,
        gpu_memory: e.gpu_memory_short(),
    }
}

fn conn_fail(phase: &'static str, what: &str, e: ConnError) -> Failure {
    fail(phase, format!("{what}: {e}"))
}

/// quiesce → quiet → EOF → snapshot (the source is killed).
async fn quiesce_and_snapshot(
    rt: &Runtime,
    mut conn: WorkerConn,
    init: &mut TreeGuard,
    out: &Path,
    phase: &'static str,
) -> Result<(), Failure> {
    conn.send(&ToWorker::Quiesce(Quiesce::default()))
        .await
        .map_err(|e| conn_fail(phase, "sending quiesce", e))?;
    conn.expect("quiet", QUIET_TIMEOUT)
        .await
        .map_err(|e| conn_fail(phase, "waiting for quiet", e))?;
    conn.expect_eof(QUIET_TIMEOUT)
        .await
        .map_err(|e| conn_fail(phase, "waiting for the worker to close after quiet", e))?;
    rt.snapshot_and_kill(
        init.0.unwrap_or_default(),
        out,
        torpor_image::Durability::Synced,
    )
    .await
    .map_err(|e| fail(phase, e.to_string()))?;
    // Kill mode: the source is gone.
    init.0 = None;
    Ok(())
}

/// A split capture at deploy, before the function snapshot.
struct SplitCapture {
    segments: Vec<crate::split::index::SegmentEntry>,
    bytes: u64,
    new_bytes: u64,
    /// From the capturing `quiesce` until the record was committed.
    stop_s: f64,
    /// With `restore_server.concurrent_snapshot`: the probe pre-copied the segments and the
    /// capture copied only what changed (crate::split::precopy).
    delta: Option<crate::split::precopy::Delta>,
}

/// The deploy's split capture (crate::split::capture): a probe quiesce for the segments'
/// hashes, the spec's warm-up request once more, then the capture into the chunk store under
/// snapshot id `id`. `None` when the worker has no segments (the transparent path follows); the
/// worker then serves on, as after `resume`.
async fn split_snapshot(
    rt: &Arc<Runtime>,
    conn: &mut WorkerConn,
    spec: &Value,
    id: &str,
) -> Result<Option<SplitCapture>, Failure> {
    use crate::split::capture;
    const PHASE: &str = "snapshot_function";
    let (_, probe) = capture::quiesce(conn)
        .await
        .map_err(|e| conn_fail(PHASE, "split quiesce", e))?;
    if probe.is_empty() {
        conn.send(&ToWorker::Resume(Empty {}))
            .await
            .map_err(|e| conn_fail(PHASE, "sending resume", e))?;
        return Ok(None);
    }
    let warmup = spec.pointer("/warmup/request").cloned();
    let concurrent = rt.config.restore_server.concurrent_snapshot;
    // A concurrent snapshot: the probe's read is the pre-copy (stored now, hashed per block),
    // and the capture's stop copies only the blocks the warm-up changed.
    let mut pre = None;
    let before = match (&warmup, concurrent) {
        (_, true) => {
            let split = Arc::clone(&rt.split);
            let tenant = crate::tenant::of_spec(spec).to_string();
            let (hashes, copied) = blocking(PHASE, move || {
                let store = split.store_for(&tenant)?;
                capture::precopy_listed(&split, &store, &probe)
            })
            .await?;
            pre = Some(copied);
            warmup.is_some().then_some(hashes)
        }
        (Some(_), false) => {
            let split = Arc::clone(&rt.split);
            Some(blocking(PHASE, move || capture::hash_all(&split, &probe)).await?)
        }
        (None, false) => {
            drop(probe);
            None
        }
    };
    conn.send(&ToWorker::Resume(Empty {}))
        .await
        .map_err(|e| conn_fail(PHASE, "sending resume", e))?;
    let bound = crate::limits::load_timeout(spec, rt.config.load_timeout);
    if let Some(request) = warmup {
        let request = serde_json::value::to_raw_value(&request)
            .map_err(|e| fail(PHASE, format!("the warm-up request cannot be sent: {e}")))?;
        let invoke = ToWorker::Invoke(Invoke {
            id: 0,
            request,
            timeout_s: bound.as_secs_f64(),
            function: None,
            key: None,
            fingerprint: None,
        });
        conn.send(&invoke)
            .await
            .map_err(|e| conn_fail(PHASE, "sending the read-only probe's warm-up request", e))?;
        let r = conn
            .expect("result", bound)
            .await
            .map_err(|e| conn_fail(PHASE, "waiting for the probe's warm-up result", e))?;
        if r.get("ok").and_then(Value::as_bool) != Some(true) {
            return Err(fail(
                PHASE,
                format!(
                    "the warm-up request failed when sent again to find the read-only segments: {}",
                    r.get("error").unwrap_or(&Value::Null)
                ),
            ));
        }
    }
    let t = Instant::now();
    let (_, listed) = capture::quiesce(conn)
        .await
        .map_err(|e| conn_fail(PHASE, "split quiesce", e))?;
    let (split, sid) = (Arc::clone(&rt.split), id.to_string());
    let tenant = crate::tenant::of_spec(spec).to_string();
    let known = pre.map(|p| crate::split::precopy::Known::new(&[], Some(p)));
    let captured = blocking(PHASE, move || {
        let store = split.store_for(&tenant)?;
        capture::store_all_with(
            &split,
            &store,
            &sid,
            &tenant,
            listed,
            &before.unwrap_or_default(),
            known,
        )
    })
    .await?;
    Ok(Some(SplitCapture {
        segments: captured.segments,
        bytes: captured.bytes,
        new_bytes: captured.new_bytes,
        stop_s: t.elapsed().as_secs_f64(),
        delta: captured.delta,
    }))
}

/// After a split capture: `release` → `released` → EOF → the transparent snapshot of what
/// remains. On failure the capture's record is released.
async fn finish_split(
    rt: &Runtime,
    mut conn: WorkerConn,
    init: &mut TreeGuard,
    out: &Path,
    (id, tenant): (&str, &str),
) -> Result<(), Failure> {
    const PHASE: &str = "snapshot_function";
    let done = async {
        crate::split::capture::release(&mut conn, QUIET_TIMEOUT)
            .await
            .map_err(|e| conn_fail(PHASE, "releasing the segments", e))?;
        conn.expect_eof(QUIET_TIMEOUT)
            .await
            .map_err(|e| conn_fail(PHASE, "waiting for the worker to close after released", e))?;
        rt.snapshot_and_kill(
            init.0.unwrap_or_default(),
            out,
            torpor_image::Durability::Synced,
        )
        .await
        .map_err(|e| fail(PHASE, e.to_string()))?;
        init.0 = None;
        Ok(())
    }
    .await;
    if done.is_err() {
        if let Ok(store) = rt.split.store_for(tenant) {
            let id = id.to_string();
            let _ = tokio::task::spawn_blocking(move || store.release(&id)).await;
        }
    }
    done
}

/// Runs `f` on the blocking pool; its error fails the deploy in `phase`.
async fn blocking<T: Send + 'static, E: std::fmt::Display + Send + 'static>(
    phase: &'static str,
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| fail(phase, format!("task failed: {e}")))?
        .map_err(|e| fail(phase, e))
}

/// The phases; returns (function snapshot id, base snapshot id, base reused).
async fn steps(
    rt: &Arc<Runtime>,
    spec: &ValidSpec,
    tx: &mpsc::UnboundedSender<Value>,
    journal: &Journal,
) -> Result<(String, String, bool), Failure> {
    let name = spec.name.as_str();
    let send = |line: Value| {
        let _ = tx.send(line);
    };
    let python_dir = rt.python_dir.clone().map_err(|e| fail("validate", e))?;
    let user = rt
        .worker_user(&spec.json)
        .map_err(|e| fail("validate", e))?;
    let (key, python, preload, gpu) =
        base_key(&spec.json, &rt.split, user).map_err(|e| fail("validate", e))?;
    let (hook, preload_hook) = rt.split.worker_hook(gpu);
    let state_root = rt.state_root.clone();
    let snapshots = rt.snapshots_dir();
    let bound = crate::limits::load_timeout(&spec.json, rt.config.load_timeout);
    // Platform-loaded data (crate::s3data): fetched while the base boots or is restored.
    let data_loading = crate::s3data::start_loading(rt.objstore.clone(), &spec.json)
        .map_err(|e| fail("validate", e))?;
    // Platform-managed GPU data (crate::gpudata): filled meanwhile too, on GPU 0.
    let gpu_filling =
        crate::gpudata::start(&rt.split, &spec.json, crate::tenant::of_spec(&spec.json), 0)
            .map_err(|e| fail("validate", e))?;
    // Two first deploys on one key make one base; held until it is recorded, not across the load.
    let base_lock = rt.deploy_locks.base(&key).await;

    // The base snapshot: reuse, or boot and snapshot.
    let registry = Arc::clone(&rt.registry);
    let k = key.clone();
    let snapshot_key = Arc::clone(&rt.snapshot_key);
    let existing = blocking("boot_base", move || {
        registry
            .with(|s| {
                let Some(b) = s.base_snapshot(&k)? else {
                    return Ok(None);
                };
                let sealed = torpor_image::Snapshot::open(&b.path)
                    .and_then(|o| o.authenticate(torpor_image::Trust::Key(&snapshot_key)));
                match sealed {
                    Ok(()) => return Ok(Some(b)),
                    Err(e) if b.path.is_dir() => {
                        tracing::warn!(base = %b.id, error = %e, "not reusing the base snapshot: booting a new one");
                    }
                    Err(_) => {}
                }
                // Its directory is gone, or this daemon's key did not seal it (taken before
                // snapshots were sealed, or rewritten since): forget it and make a new one.
                s.delete_snapshot(&b.id)?;
                Ok::<_, crate::registry::RegistryError>(None)
            })
            .map_err(|e| e.to_string())
    })
    .await?;
    let (base, reused) = match existing {
        Some(b) => (b, true),
        None => {
            journal.step("boot_base", None).await;
            let t = Instant::now();
            let log = rt.logs_dir().join(format!("base-{}.log", fnv(&key)));
            // The base boots under the limits of the function whose deploy boots it.
            let base_cgroup = rt
                .worker_cgroup(&format!("base-{}", fnv(&key)), &spec.json)
                .map_err(|e| fail("boot_base", e))?;
            let procs = base_cgroup
                .as_ref()
                .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files);
            let (ws, sd, lg, py, pl, pd, hk) = (
                rt.workers_socket.clone(),
                state_root.clone(),
                log.clone(),
                python.clone(),
                preload.clone(),
                python_dir.clone(),
                hook.clone(),
            );
            let init = blocking("boot_base", move || {
                launcher::launch_worker(&WorkerCommand {
                    python: &py,
                    role: "base",
                    preload: &pl,
                    gpu,
                    announce_warm: false,
                    log: &lg,
                    state_dir: &sd,
                    workers_socket: &ws,
                    python_dir: &pd,
                    hook: hk.as_deref(),
                    preload_hook,
                    cgroup: &procs,
                    user,
                })
                .map_err(|e| e.to_string())
            })
            .await?;
            let mut guard = TreeGuard(Some(init));
            let worker =
                launcher::worker_pid(init).map_err(|e| fail("boot_base", e.to_string()))?;
            let mut conn = rt
                .hub
                .claim(worker)
                .wait(CONNECT_TIMEOUT)
                .await
                .map_err(|e| {
                    fail(
                        "boot_base",
                        format!(
                            "the base worker did not connect: {e}; see {}",
                            log.display()
                        ),
                    )
                })?;
            let r = ready(&mut conn, bound)
                .await
                .map_err(|e| out_of_memory_or(base_cgroup.as_ref(), "boot_base", e))?;
            send(phase(
                "boot_base",
                t.elapsed().as_secs_f64(),
                json!({"import_s": r["setup_s"], "gpu_warmup_s": r["warmup_s"], "key": key}),
            ));
            let t = Instant::now();
            let id = format!("base-{}", fnv(&key));
            let out = snapshots.join(&id);
            if out.exists() {
                // Left by an interrupted deploy; the registry does not know it.
                let o = out.clone();
                blocking("snapshot_base", move || {
                    std::fs::remove_dir_all(&o)
                        .map_err(|e| format!("cannot remove stale {}: {e}", o.display()))
                })
                .await?;
            }
            journal.step("snapshot_base", Some(&out)).await;
            quiesce_and_snapshot(rt, conn, &mut guard, &out, "snapshot_base").await?;
            let registry = Arc::clone(&rt.registry);
            let row = Snapshot {
                id,
                kind: SnapshotKind::Base,
                bytes: dir_bytes(&out),
                path: out,
                function: None,
                base_key: Some(key.clone()),
                created: now_ms(),
            };
            let r2 = row.clone();
            blocking("snapshot_base", move || {
                registry
                    .with(|s| s.insert_snapshot(&r2))
                    .map_err(|e| e.to_string())
            })
            .await?;
            send(phase(
                "snapshot_base",
                t.elapsed().as_secs_f64(),
                json!({"snapshot": row.id, "bytes": row.bytes}),
            ));
            (row, false)
        }
    };

    drop(base_lock);

    // Restore the base and load the function into it.
    journal.step("restore_base", None).await;
    let t = Instant::now();
    let log = crate::instance_logs::deploy_log(&rt.logs_dir(), name, now_ms());
    let cgroup = rt
        .worker_cgroup(&format!("deploy-{name}"), &spec.json)
        .map_err(|e| fail("restore_base", e))?;
    let procs = cgroup
        .as_ref()
        .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files);
    let (init, worker) = restore(
        &base.path,
        &rt.logs_dir(),
        &log,
        &rt.snapshot_key,
        procs,
        &rt.state_root,
    )
    .await
    .map_err(|e| Failure {
        gpu_memory: e.short_of_gpu_memory(),
        ..fail("restore_base", restore_base_error(&e))
    })?;
    let mut guard = TreeGuard(Some(init));
    let mut conn = wake(&rt.hub, worker, RECONNECT_TIMEOUT)
        .await
        .map_err(|e| {
            fail(
                "restore_base",
                format!("the restored base did not reconnect: {e}"),
            )
        })?;
    send(phase(
        "restore_base",
        t.elapsed().as_secs_f64(),
        json!({"snapshot": base.id, "reused": reused}),
    ));

    journal.step("load", None).await;
    let t = Instant::now();
    crate::function_mounts::bind_function_dir(init, &spec.dir, user.is_some())
        .await
        .map_err(|e| fail("load", e))?;
    let t_wait = Instant::now();
    let (data, data_s) = crate::s3data::finish_loading(data_loading)
        .await
        .map_err(|e| fail("load", e))?;
    let gpu_data = crate::gpudata::finish(gpu_filling)
        .await
        .map_err(|e| fail("load", e))?;
    let data_wait_s = t_wait.elapsed().as_secs_f64();
    conn.send(&load_frame(&spec.json, &spec.dir))
        .await
        .map_err(|e| conn_fail("load", "sending load", e))?;
    crate::s3data::send_fds(&mut conn, &data)
        .await
        .map_err(|e| conn_fail("load", "sending the loaded data", e))?;
    drop(data);
    crate::gpudata::send(&mut conn, &gpu_data)
        .await
        .map_err(|e| conn_fail("load", "sending the GPU data", e))?;
    let r = ready(&mut conn, bound)
        .await
        .map_err(|e| out_of_memory_or(cgroup.as_ref(), "load", e))?;
    // The worker mapped it before its setup(): the daemon's handles may go.
    drop(gpu_data);
    // What a start in a ready sandbox would spend loading it (runtime::start::pooled): the
    // load's phases in the worker, not the data, which such a start finds in the caches.
    let mut load_s: Option<f64> = ["map_s", "import_s", "setup_s", "pack_s", "warmup_s"]
        .iter()
        .map(|k| r[*k].as_f64())
        .sum();
    let mut loaded = json!({"setup_s": r["setup_s"], "warmup_s": r["warmup_s"]});
    if data_s > 0.0 {
        // The object store's part: how long the loads took, and how much of that the load
        // still waited for after the base was up (the rest overlapped the start).
        loaded["data_s"] = json!(data_s);
        loaded["data_wait_s"] = json!(data_wait_s);
    }
    // What the harness packed into segments of their own (docs/split.md, "Weight packing").
    if let Some(packed) = r.get("packed") {
        loaded["packed"] = packed.clone();
    }
    // Its memory model, measured by its pool (crate::runtime::memory); a harness of before
    // sends none.
    let memory: Option<crate::protocol::MemoryModel> = r
        .get("memory")
        .and_then(|m| serde_json::from_value(m.clone()).ok());
    if let Some(m) = &memory {
        loaded["memory"] = json!(m);
    }
    send(phase("load", t.elapsed().as_secs_f64(), loaded));
    // A sandboxed function: the other functions of its sandbox join it, so that its snapshot
    // holds them all (crate::runtime::sandbox).
    if let Some(group) = crate::runtime::sandbox::group_of(&spec.json) {
        let t = Instant::now();
        let members = crate::runtime::sandbox::load_members(
            rt,
            &mut conn,
            init,
            name,
            &group,
            user.is_some(),
            bound,
        )
        .await
        .map_err(|e| {
            let mut f = fail("load_sandbox", &e);
            f.error = e.worker_error();
            f
        })?;
        let members_s = t.elapsed().as_secs_f64();
        // A start in a ready sandbox loads them too.
        load_s = load_s.map(|s| s + members_s);
        // What each member packed: a member loaded after another has run is packed too
        // (torpor.pack), and a deploy shows it.
        let packed: serde_json::Map<String, Value> = members
            .iter()
            .filter_map(|m| Some((m.name.clone(), m.packed.clone()?)))
            .collect();
        let names: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
        send(phase(
            "load_sandbox",
            members_s,
            json!({"sandbox": group, "functions": names, "packed": packed}),
        ));
    }

    let t = Instant::now();
    let id = format!("fn-{name}-{}", now_ms());
    let out = snapshots.join(&id);
    journal.step("snapshot_function", Some(&out)).await;
    let split = if rt.split.enabled {
        split_snapshot(rt, &mut conn, &spec.json, &id).await?
    } else {
        None
    };
    let stop = Instant::now();
    let mut details = json!({});
    match &split {
        Some(c) => {
            let tenant = crate::tenant::of_spec(&spec.json);
            finish_split(rt, conn, &mut guard, &out, (&id, tenant)).await?;
            details = json!({
                "segments": c.segments.len(),
                "segment_bytes": c.bytes,
                "stored_bytes": c.new_bytes,
                "readonly_segments": c.segments.iter().filter(|s| s.readonly).count(),
                "concurrent": c.delta.is_some(),
            });
            if let (Some(d), Value::Object(m)) = (&c.delta, &mut details) {
                m.insert("changed_blocks".to_string(), json!(d.changed_blocks));
                m.insert("changed_bytes".to_string(), json!(d.changed_bytes));
            }
        }
        None => quiesce_and_snapshot(rt, conn, &mut guard, &out, "snapshot_function").await?,
    }
    let stop_s = split.as_ref().map_or(stop.elapsed().as_secs_f64(), |c| {
        c.stop_s + stop.elapsed().as_secs_f64()
    });
    let row = Snapshot {
        id: id.clone(),
        kind: SnapshotKind::Function,
        bytes: dir_bytes(&out),
        path: out.clone(),
        function: Some(name.to_string()),
        base_key: Some(key.clone()),
        created: now_ms(),
    };
    let registry = Arc::clone(&rt.registry);
    let (n, sp, dir, r2) = (
        name.to_string(),
        spec.json.clone(),
        spec.dir.clone(),
        row.clone(),
    );
    let old = blocking("snapshot_function", move || {
        registry
            .transaction(|s| {
                s.insert_snapshot(&r2)?;
                let mut f = s
                    .function(&n)?
                    .ok_or(crate::registry::RegistryError::NotFound {
                        what: "function",
                        key: n.clone(),
                    })?;
                let old = f.snapshot.replace(r2.id.clone());
                f.state = FunctionState::Ready;
                f.spec = sp;
                f.dir = dir;
                f.base_key = key;
                f.updated = now_ms();
                s.update_function(&f)?;
                if let Some(m) = &memory {
                    s.set_function_memory(&n, m, now_ms())?;
                }
                let old = match old {
                    Some(o) => s.snapshot(&o)?.inspect(|_| {
                        let _ = s.delete_snapshot(&o);
                    }),
                    None => None,
                };
                Ok::<_, crate::registry::RegistryError>(old)
            })
            .map_err(|e| e.to_string())
    })
    .await?;
    let mut line =
        json!({"snapshot": id, "bytes": row.bytes, "stop_s": stop_s, "split": split.is_some()});
    if let (Some(m), Value::Object(d)) = (line.as_object_mut(), details) {
        m.extend(d);
    }
    send(phase("snapshot_function", t.elapsed().as_secs_f64(), line));
    // Into memory, so that restores read it from there (crate::staging); a failure only costs
    // speed: restores read the disk copy.
    journal.step("stage", None).await;
    if rt.staging.dir().is_some() {
        let t = Instant::now();
        let (staging, o) = (Arc::clone(&rt.staging), out.clone());
        match tokio::task::spawn_blocking(move || staging.stage(&o)).await {
            Ok(Ok(Some(copy))) => send(phase(
                "stage",
                t.elapsed().as_secs_f64(),
                json!({"path": copy.dir()}),
            )),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                tracing::warn!(function = %name, error = %e, "staging the function snapshot failed: its restores read the disk copy")
            }
            Err(e) => tracing::error!(function = %name, error = %e, "staging task failed"),
        }
    }
    // The order its restores first touch their pages (crate::runtime::page_profile), where they use
    // Torpor's page server: served first by every later restore.
    if rt.config.restore_server.pages.records_profile() {
        journal.step("profile", None).await;
        if let Some((s, r)) = crate::runtime::page_profile::record_at_deploy(
            rt,
            name,
            &spec.json,
            (&out, &id),
            split.is_some(),
            &log,
        )
        .await
        {
            send(phase(
                "profile",
                s,
                json!({"ranges": r.ranges, "bytes": r.bytes}),
            ));
        }
    }
    // Hibernated instances of the older deploy go before the new one takes requests, so that
    // none of them is woken to serve the old code.
    let (rt2, n) = (Arc::clone(rt), name.to_string());
    if let Err(e) = tokio::task::spawn_blocking(move || rt2.discard_sleepers_of(&n)).await {
        tracing::error!(function = %name, error = %e, "discarding the older deploy's hibernated instances failed");
    }
    rt.deployed(name, &spec.json, &id, &out);
    rt.sandbox_deployed(name, &spec.json, load_s).await;
    rt.keep_standbys(name, &spec.json).await;
    if let Some(old) = old {
        // Live instances were restored from it and no longer need it.
        rt.staging.remove(&old.path);
        let _ = tokio::task::spawn_blocking(move || {
            crate::runtime::remove_snapshot_dir(&old.path);
        })
        .await;
    }
    Ok((id, base.id, reused))
}

/// A deploy's failed restore of its base, in one line. Too little memory on GPU 0 names that
/// GPU and what to do, not the CLI's `--gpu` advice: a deploy always runs on the node's GPU 0
/// (its snapshot records that GPU; cold starts are placed on every GPU from it).
fn restore_base_error(e: &crate::runtime::process::RestoreTreeError) -> String {
    use crate::runtime::process::RestoreTreeError;
    use torpor_snapshot::restore::RestoreError;
    match e {
        RestoreTreeError::Restore(RestoreError::NoRoom {
            ordinal,
            free,
            need,
        }) => format!(
            "GPU {ordinal} has {free} MiB free but the base snapshot needs {need} MiB: a deploy \
             runs on the node's GPU 0 (its instances are placed on every GPU later); free \
             memory on GPU {ordinal} (its other processes, or idle instances: a shorter \
             keepalive.gpu_release_s) and deploy again"
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_users_mistakes_are_answered_400() {
        let refused = |status| ValidateError::Refused {
            status,
            line: "torpor.toml: name is missing".into(),
        };
        assert!(refused(Some(1)).is_users_mistake());
        assert_eq!(refused(Some(1)).to_string(), "torpor.toml: name is missing");
        // The checker itself failed (a traceback, a signal): the daemon's.
        assert!(!refused(Some(2)).is_users_mistake());
        assert!(!refused(None).is_users_mistake());
        assert!(ValidateError::EmptyDir.is_users_mistake());
        let relative = ValidateError::RelativeDir {
            dir: PathBuf::from("f"),
        };
        assert!(relative.is_users_mistake());
        assert!(relative.to_string().contains("send an absolute path"));
        let missing = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert!(!ValidateError::RunChecker(missing).is_users_mistake());
    }

    #[test]
    fn a_base_that_finds_gpu_0_full_says_so_without_the_clis_advice() {
        use crate::runtime::process::RestoreTreeError;
        use torpor_snapshot::restore::RestoreError;
        let why = restore_base_error(&RestoreTreeError::Restore(RestoreError::NoRoom {
            ordinal: 0,
            free: 10,
            need: 64,
        }));
        assert!(
            why.starts_with("GPU 0 has 10 MiB free but the base snapshot needs 64 MiB"),
            "{why}"
        );
        assert!(
            why.contains("deploy again") && !why.contains("--gpu"),
            "{why}"
        );
        let other = RestoreTreeError::CudaProcesses { cuda: 2 };
        assert_eq!(restore_base_error(&other), other.to_string());
        // The node's GPU, not the function: a cluster deploys on another node.
        assert!(RestoreTreeError::Restore(RestoreError::NoRoom {
            ordinal: 0,
            free: 10,
            need: 64,
        })
        .short_of_gpu_memory());
        assert!(!other.short_of_gpu_memory());
    }
}
