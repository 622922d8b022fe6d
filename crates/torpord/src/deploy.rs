//! Deploy (docs/torpord.md, "Snapshots"): validate the spec, make the base snapshot for its key
//! if there is none (boot a `--role base` worker, quiesce, snapshot), restore the base, `load`
//! the function, quiesce, and snapshot the function. Each phase is reported as it ends.
//!
//! The base key is (interpreter's absolute path, sorted preload list, GPU or not). Deploying a
//! second function on an existing base boots no Python: its first phase is `restore_base`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::launcher::{self, WorkerCommand};
use crate::registry::{now_ms, Function, FunctionState, Snapshot, SnapshotKind};
use crate::runtime::{kill_tree, restore, wake, Runtime, RECONNECT_TIMEOUT};
use crate::workers::{ConnError, WorkerConn};

/// How long a booted worker has to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
// How long preloading (base) or loading (function: import, setup, warm-up) may take: the spec's
// load_timeout_s, else the config's workers.load_timeout_s (crate::limits::load_timeout).
/// How long a worker has to answer `quiesce` and close its connection.
pub(crate) const QUIET_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the snapshot waits for in-flight CUDA work when locking.
pub(crate) const CUDA_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// Snapshots the quiet worker tree rooted at `pid` into `out` in kill mode (the source is gone
/// afterwards), off the async runtime: `torpor_snapshot::snapshot` blocks for seconds.
pub(crate) async fn snapshot_and_kill(pid: i32, out: &Path, log_dir: &Path) -> Result<(), String> {
    let (out, log_dir) = (out.to_path_buf(), log_dir.to_path_buf());
    tokio::task::spawn_blocking(move || {
        torpor_snapshot::snapshot::snapshot(&torpor_snapshot::snapshot::SnapshotOptions {
            pid,
            out: &out,
            leave_running: false,
            lock_timeout: CUDA_LOCK_TIMEOUT,
            log_dir: &log_dir,
        })
        .map(|_| ())
        .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("snapshot task failed: {e}"))?
}

/// A spec that `python3 -m torpor.spec` accepted.
#[derive(Debug, Clone)]
pub struct ValidSpec {
    pub json: Value,
    pub name: String,
    pub dir: PathBuf,
}

/// Validates `dir`'s torpor.toml with `python3 -m torpor.spec`. `Err((true, msg))` is the
/// user's mistake (400), `Err((false, msg))` the daemon's (500).
pub async fn validate(rt: &Runtime, dir: &str) -> Result<ValidSpec, (bool, String)> {
    let python_dir = rt.python_dir.clone().map_err(|e| (false, e))?;
    if dir.is_empty() {
        return Err((
            true,
            "the body's \"dir\" is empty: name the function's directory".into(),
        ));
    }
    let dir = PathBuf::from(dir);
    if !dir.is_absolute() {
        return Err((
            true,
            format!(
                "the function directory {} is relative: send an absolute path (`torpor deploy` does)",
                dir.display()
            ),
        ));
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
    .map_err(|e| (false, format!("spec task failed: {e}")))?
    .map_err(|e| {
        (
            false,
            format!("cannot run python3 -m torpor.spec: {e}; install python3"),
        )
    })?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr).trim().to_string();
        let user = out.status.code() == Some(1);
        return Err((
            user,
            msg.lines()
                .last()
                .unwrap_or("spec check failed")
                .to_string(),
        ));
    }
    let json: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        (
            false,
            format!("python3 -m torpor.spec printed no JSON: {e}"),
        )
    })?;
    let k = crate::runtime::keepalive_of(&json, &rt.config.keepalive);
    if !(k.gpu_release <= k.hibernate && k.hibernate <= k.evict) {
        return Err((
            true,
            format!(
                "torpor.toml: keepalive delays count from the moment the instance went idle, so \
                 they must not decrease (gpu_release_s ≤ hibernate_s ≤ evict_s), got {}, {}, {}",
                k.gpu_release.as_secs_f64(),
                k.hibernate.as_secs_f64(),
                k.evict.as_secs_f64()
            ),
        ));
    }
    let name = json["name"].as_str().unwrap_or_default().to_string();
    let dir = PathBuf::from(json["dir"].as_str().unwrap_or_default());
    Ok(ValidSpec { json, name, dir })
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
}

fn fail(phase: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        phase,
        message: message.into(),
        error: None,
    }
}

/// Kills a worker tree unless defused.
struct TreeGuard(Option<i32>);

impl Drop for TreeGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            kill_tree(pid);
        }
    }
}

pub(crate) fn fnv(text: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

pub(crate) fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
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
            let _ = tx.send(json!({"error": e, "phase": "register"}));
            return;
        }
    };
    match steps(&rt, &spec, &tx).await {
        Ok((snapshot, base, base_reused)) => {
            let total = t0.elapsed().as_secs_f64();
            rt.metrics.observe_phase(&name, "deploy", total);
            tracing::info!(function = %name, snapshot = %snapshot, base = %base, total_s = total, "deployed");
            let _ = tx.send(json!({"result": {
                "function": name, "snapshot": snapshot, "base": base,
                "base_reused": base_reused, "total_s": total,
            }}));
        }
        Err(f) => {
            tracing::warn!(function = %name, phase = f.phase, error = %f.message, "deploy failed");
            let restored = previous.is_some();
            let registry = Arc::clone(&rt.registry);
            let n = name.clone();
            let _ = tokio::task::spawn_blocking(move || {
                registry.with(|s| {
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
            let mut line = json!({"error": f.message, "phase": f.phase});
            if let Some(e) = f.error {
                line["worker_error"] = e;
            }
            if restored {
                line["previous_kept"] = json!(true);
            }
            let _ = tx.send(line);
        }
    }
}

/// Records the function as deploying; returns the previous snapshot id, if it was deployed.
async fn deploying(rt: &Runtime, spec: &ValidSpec) -> Result<Option<Function>, String> {
    let registry = Arc::clone(&rt.registry);
    let spec = spec.clone();
    let key = base_key(&spec.json, &rt.split).map_err(|e| e.message)?;
    tokio::task::spawn_blocking(move || {
        registry.transaction(|s| {
            let now = now_ms();
            match s.function(&spec.name)? {
                Some(mut f) => {
                    let prev = (f.state == FunctionState::Ready && f.snapshot.is_some())
                        .then(|| f.clone());
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
                    Ok(None)
                }
            }
        })
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e: crate::registry::RegistryError| e.to_string())
}

/// The `load` frame for a function: its spec, directory and declared data.
fn load_frame(spec: &Value, dir: &Path) -> Value {
    let data: serde_json::Map<String, Value> = spec["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| Some((d["name"].as_str()?.to_string(), d["abs_path"].clone())))
                .collect()
        })
        .unwrap_or_default();
    json!({"type": "load", "spec": spec, "dir": dir, "data": data})
}

/// A cold start without snapshots (`cold_start = "boot"`): launches a `--role function` worker
/// writing to `log`, sends it `load` and waits for `ready`. Returns (init, worker, connection,
/// timings: `boot` (launch and connect), `load` (import, setup, warm-up)). `charge`, for an
/// instance's start, learns the worker's tree as soon as it is launched.
pub(crate) async fn boot_function(
    rt: &Runtime,
    spec: &Value,
    dir: &Path,
    log: &Path,
    charge: Option<&crate::accounting::StartGuard<'_>>,
) -> Result<(i32, i32, WorkerConn, Vec<(String, f64)>), String> {
    let t = Instant::now();
    let python_dir = rt.python_dir.clone()?;
    let (_, python, preload, gpu) = base_key(spec, &rt.split).map_err(|f| f.message)?;
    let (hook, preload_hook) = rt.split.worker_hook(gpu);
    let log = log.to_path_buf();
    let (ws, sd, lg) = (
        rt.workers_socket.clone(),
        rt.state_root.clone(),
        log.clone(),
    );
    let init = tokio::task::spawn_blocking(move || {
        launcher::launch_worker(&WorkerCommand {
            python: &python,
            role: "function",
            preload: &preload,
            gpu,
            log: &lg,
            state_dir: &sd,
            workers_socket: &ws,
            python_dir: &python_dir,
            hook: hook.as_deref(),
            preload_hook,
        })
    })
    .await
    .map_err(|e| format!("launch task failed: {e}"))??;
    let mut guard = TreeGuard(Some(init));
    if let Some(c) = charge {
        c.process_started(init);
    }
    let worker = launcher::worker_pid(init)?;
    let mut conn = rt
        .hub
        .claim(worker)
        .wait(CONNECT_TIMEOUT)
        .await
        .map_err(|e| {
            format!(
                "the booted worker did not connect: {e}; see {}",
                log.display()
            )
        })?;
    if conn.hello.role != "function" || conn.hello.resumed {
        return Err(format!(
            "the booted worker said hello as role {} (resumed: {}), not a fresh function worker",
            conn.hello.role, conn.hello.resumed
        ));
    }
    let boot_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    conn.send(&load_frame(spec, dir))
        .await
        .map_err(|e| format!("sending load: {e}"))?;
    let bound = crate::limits::load_timeout(spec, rt.config.load_timeout);
    ready(&mut conn, "load", bound)
        .await
        .map_err(|f| format!("{}; see {}", f.message, log.display()))?;
    let load_s = t.elapsed().as_secs_f64();
    guard.0 = None;
    Ok((
        init,
        worker,
        conn,
        vec![("boot".to_string(), boot_s), ("load".to_string(), load_s)],
    ))
}

/// (key, interpreter, preload in spec order, gpu). The key ends with how the base's workers got
/// the device-memory hook ([`crate::split::Split::base_key_suffix`]), so a base booted
/// otherwise is never restored for this deploy.
fn base_key(
    spec: &Value,
    split: &crate::split::Split,
) -> Result<(String, PathBuf, Vec<String>, bool), Failure> {
    let python = launcher::resolve_python(spec["python"].as_str().unwrap_or("python3"))
        .map_err(|e| fail("validate", e))?;
    let preload: Vec<String> = spec["preload"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut sorted = preload.clone();
    sorted.sort();
    sorted.dedup();
    let gpu = spec["gpus"].as_u64().unwrap_or(0) > 0;
    let key = format!(
        "{}|{}|{}{}",
        python.display(),
        sorted.join(","),
        if gpu { "gpu" } else { "cpu" },
        split.base_key_suffix(gpu)
    );
    Ok((key, python, preload, gpu))
}

fn conn_fail(phase: &'static str, what: &str, e: ConnError) -> Failure {
    fail(phase, format!("{what}: {e}"))
}

/// Reads `ready`; `ok: false` fails the deploy with the worker's phase and error.
async fn ready(
    conn: &mut WorkerConn,
    phase: &'static str,
    bound: Duration,
) -> Result<Value, Failure> {
    let msg = match conn.expect("ready", bound).await {
        // The caller's guard kills the worker.
        Err(ConnError::Timeout(_)) => {
            return Err(fail(phase, crate::limits::load_timed_out(bound)))
        }
        r => r.map_err(|e| conn_fail(phase, "waiting for the worker's ready", e))?,
    };
    if msg.get("ok").and_then(Value::as_bool) == Some(true) {
        return Ok(Value::Object(msg));
    }
    let wphase = msg.get("phase").and_then(Value::as_str).unwrap_or("?");
    let err = msg.get("error").cloned().unwrap_or(Value::Null);
    Err(Failure {
        phase,
        message: format!(
            "the worker failed in its {wphase} step: {}: {}",
            err["type"].as_str().unwrap_or("Error"),
            err["message"].as_str().unwrap_or("")
        ),
        error: Some(json!({"phase": wphase, "error": err})),
    })
}

/// quiesce → quiet → EOF → snapshot (the source is killed).
async fn quiesce_and_snapshot(
    rt: &Runtime,
    mut conn: WorkerConn,
    init: &mut TreeGuard,
    out: &Path,
    phase: &'static str,
) -> Result<(), Failure> {
    conn.send(&json!({"type": "quiesce"}))
        .await
        .map_err(|e| conn_fail(phase, "sending quiesce", e))?;
    conn.expect("quiet", QUIET_TIMEOUT)
        .await
        .map_err(|e| conn_fail(phase, "waiting for quiet", e))?;
    conn.expect_eof(QUIET_TIMEOUT)
        .await
        .map_err(|e| conn_fail(phase, "waiting for the worker to close after quiet", e))?;
    snapshot_and_kill(init.0.unwrap_or_default(), out, &rt.logs_dir())
        .await
        .map_err(|e| fail(phase, e))?;
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
        conn.send(&json!({"type": "resume"}))
            .await
            .map_err(|e| conn_fail(PHASE, "sending resume", e))?;
        return Ok(None);
    }
    let warmup = spec.pointer("/warmup/request").cloned();
    let before = match &warmup {
        Some(_) => {
            let split = Arc::clone(&rt.split);
            Some(blocking(PHASE, move || capture::hash_all(&split, &probe)).await?)
        }
        None => {
            drop(probe);
            None
        }
    };
    conn.send(&json!({"type": "resume"}))
        .await
        .map_err(|e| conn_fail(PHASE, "sending resume", e))?;
    let bound = crate::limits::load_timeout(spec, rt.config.load_timeout);
    if let Some(request) = warmup {
        conn.send(&json!({"type": "invoke", "id": 0, "request": request, "timeout_s": bound.as_secs_f64()}))
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
    let captured = blocking(PHASE, move || {
        capture::store_all(&split, &sid, listed, &before.unwrap_or_default())
    })
    .await?;
    Ok(Some(SplitCapture {
        segments: captured.segments,
        bytes: captured.bytes,
        new_bytes: captured.new_bytes,
        stop_s: t.elapsed().as_secs_f64(),
    }))
}

/// After a split capture: `release` → `released` → EOF → the transparent snapshot of what
/// remains. On failure the capture's record is released.
async fn finish_split(
    rt: &Runtime,
    mut conn: WorkerConn,
    init: &mut TreeGuard,
    out: &Path,
    id: &str,
) -> Result<(), Failure> {
    const PHASE: &str = "snapshot_function";
    let done = async {
        crate::split::capture::release(&mut conn, QUIET_TIMEOUT)
            .await
            .map_err(|e| conn_fail(PHASE, "releasing the segments", e))?;
        conn.expect_eof(QUIET_TIMEOUT)
            .await
            .map_err(|e| conn_fail(PHASE, "waiting for the worker to close after released", e))?;
        snapshot_and_kill(init.0.unwrap_or_default(), out, &rt.logs_dir())
            .await
            .map_err(|e| fail(PHASE, e))?;
        init.0 = None;
        Ok(())
    }
    .await;
    if done.is_err() {
        if let Ok(store) = rt.split.store() {
            let id = id.to_string();
            let _ = tokio::task::spawn_blocking(move || store.release(&id)).await;
        }
    }
    done
}

async fn blocking<T: Send + 'static>(
    phase: &'static str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
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
) -> Result<(String, String, bool), Failure> {
    let name = spec.name.as_str();
    let send = |line: Value| {
        let _ = tx.send(line);
    };
    let python_dir = rt.python_dir.clone().map_err(|e| fail("validate", e))?;
    let (key, python, preload, gpu) = base_key(&spec.json, &rt.split)?;
    let (hook, preload_hook) = rt.split.worker_hook(gpu);
    let state_root = rt.state_root.clone();
    let snapshots = rt.snapshots_dir();
    let bound = crate::limits::load_timeout(&spec.json, rt.config.load_timeout);
    // Two first deploys on one key make one base; held until it is recorded, not across the load.
    let base_lock = rt.deploy_locks.base(&key).await;

    // The base snapshot: reuse, or boot and snapshot.
    let registry = Arc::clone(&rt.registry);
    let k = key.clone();
    let existing = blocking("boot_base", move || {
        registry
            .with(|s| {
                let Some(b) = s.base_snapshot(&k)? else {
                    return Ok(None);
                };
                if b.path.is_dir() {
                    return Ok(Some(b));
                }
                // Its directory is gone: forget it and make a new one.
                s.delete_snapshot(&b.id)?;
                Ok::<_, crate::registry::RegistryError>(None)
            })
            .map_err(|e| e.to_string())
    })
    .await?;
    let (base, reused) = match existing {
        Some(b) => (b, true),
        None => {
            let t = Instant::now();
            let log = rt.logs_dir().join(format!("base-{}.log", fnv(&key)));
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
                    log: &lg,
                    state_dir: &sd,
                    workers_socket: &ws,
                    python_dir: &pd,
                    hook: hk.as_deref(),
                    preload_hook,
                })
            })
            .await?;
            let mut guard = TreeGuard(Some(init));
            let worker = launcher::worker_pid(init).map_err(|e| fail("boot_base", e))?;
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
            let r = ready(&mut conn, "boot_base", bound).await?;
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
    let t = Instant::now();
    let log = crate::instance_logs::deploy_log(&rt.logs_dir(), name, now_ms());
    let (init, worker) = restore(&base.path, &rt.logs_dir(), &log)
        .await
        .map_err(|e| fail("restore_base", e))?;
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

    let t = Instant::now();
    conn.send(&load_frame(&spec.json, &spec.dir))
        .await
        .map_err(|e| conn_fail("load", "sending load", e))?;
    let r = ready(&mut conn, "load", bound).await?;
    let mut loaded = json!({"setup_s": r["setup_s"], "warmup_s": r["warmup_s"]});
    // What the harness packed into segments of their own (docs/split.md, "Weight packing").
    if let Some(packed) = r.get("packed") {
        loaded["packed"] = packed.clone();
    }
    send(phase("load", t.elapsed().as_secs_f64(), loaded));

    let t = Instant::now();
    let id = format!("fn-{name}-{}", now_ms());
    let out = snapshots.join(&id);
    let split = if rt.split.enabled {
        split_snapshot(rt, &mut conn, &spec.json, &id).await?
    } else {
        None
    };
    let stop = Instant::now();
    let mut details = json!({});
    match &split {
        Some(c) => {
            finish_split(rt, conn, &mut guard, &out, &id).await?;
            details = json!({
                "segments": c.segments.len(),
                "segment_bytes": c.bytes,
                "stored_bytes": c.new_bytes,
                "readonly_segments": c.segments.iter().filter(|s| s.readonly).count(),
            });
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
    // Hibernated instances of the older deploy go before the new one takes requests, so that
    // none of them is woken to serve the old code.
    let (rt2, n) = (Arc::clone(rt), name.to_string());
    if let Err(e) = tokio::task::spawn_blocking(move || rt2.discard_sleepers_of(&n)).await {
        tracing::error!(function = %name, error = %e, "discarding the older deploy's hibernated instances failed");
    }
    rt.deployed(name, &spec.json, &id, &out);
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
