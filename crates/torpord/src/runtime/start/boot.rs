//! Start by booting: a fresh `--role function` worker loads the function (import, setup,
//! warm-up), as at deploy; `cold_start = "boot"`, or the fallback when a restore fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::launcher::{self, WorkerCommand};
use crate::metrics::start;
use crate::protocol::{FromWorker, Load, ToWorker, Warmed};
use crate::runtime::instance::Instance;
use crate::runtime::invoke::Timings;
use crate::runtime::lifecycle::{Adopted, WorkerTree};
use crate::runtime::pool::FnInfo;
use crate::runtime::process::TreeGuard;
use crate::runtime::start::{NewInstance, StartError};
use crate::runtime::Runtime;
use crate::workers::{ConnError, WorkerConn};
use std::collections::BTreeMap;

impl Runtime {
    /// Boots an instance: launches a `--role function` worker, loads the function.
    pub(crate) async fn boot_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        new: &NewInstance<'_, '_>,
    ) -> Result<(Arc<Instance>, Timings, &'static str), StartError> {
        let t = Instant::now();
        let fdir = PathBuf::from(info.spec["dir"].as_str().unwrap_or_default());
        let (init, worker, conn, mut timings, cgroup) =
            boot_function(self, &info.spec, &fdir, new.log, new.id, Some(new.charge))
                .await
                .map_err(|source| StartError::Boot {
                    function: name.to_string(),
                    source,
                })?;
        timings.push(("start".to_string(), t.elapsed().as_secs_f64()));
        let tree = WorkerTree::new(init, worker, conn, cgroup);
        let adopted = Adopted::new(name, info, generation, None, tree);
        let inst = self.adopt(new.id, adopted).await?;
        tracing::info!(function = name, instance = %inst.id, pid = init, boot_ms = t.elapsed().as_secs_f64() * 1e3, "instance booted");
        Ok((inst, timings, start::BOOTED))
    }
}

/// How long a booted worker has to connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
// How long preloading (base) or loading (function: import, setup, warm-up) may take: the spec's
// load_timeout_s, else the config's workers.load_timeout_s (crate::limits::load_timeout).

/// The `load` frame for a function: its spec, directory and declared data.
pub fn load_frame(spec: &Value, dir: &Path) -> ToWorker {
    let data: BTreeMap<String, Value> = spec["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| {
                    let name = d["name"].as_str()?.to_string();
                    // A source's object comes as a `data_fd` frame after `load`.
                    Some(match d.get("source") {
                        Some(Value::String(_)) => (name, serde_json::json!({"fd": true})),
                        _ => (name, d["abs_path"].clone()),
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    ToWorker::Load(Load {
        spec: spec.clone(),
        dir: dir.to_string_lossy().into_owned(),
        data,
    })
}

/// What [`boot_function`] returns: (init, worker, connection, timings, the tree's cgroup).
pub(crate) type Booted = (
    i32,
    i32,
    WorkerConn,
    Vec<(String, f64)>,
    Option<crate::cgroup::Cgroup>,
);

/// A launched `--role function` worker that said hello and waits for `load`: the first half of a
/// boot, and what the live-context pool keeps ready (crate::runtime::start::pooled), launched
/// with [`Announce::Warmed`] so that it is kept only once its preloads are imported and CUDA is
/// warmed (with `--gpu`). Dropping it kills its tree.
pub(crate) struct Launched {
    pub(crate) init: i32,
    pub(crate) worker: i32,
    pub(crate) conn: WorkerConn,
    pub(crate) cgroup: Option<crate::cgroup::Cgroup>,
    /// Runs as a tenant's user (not root): binds are made for an unprivileged worker.
    pub(crate) unprivileged: bool,
    pub(crate) guard: TreeGuard,
    /// Launch → hello.
    pub(crate) boot_s: f64,
    /// With [`Announce::Warmed`]: its `warmed` frame (preload and warm-up seconds).
    pub(crate) warmed: Option<Warmed>,
}

/// What [`launch_function_worker`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Announce {
    /// Its hello: `load` follows at once and waits behind the preloads and the warm-up (a boot).
    Hello,
    /// Its `warmed` after the hello (`--announce-warm`): the preloads imported and CUDA warmed,
    /// bounded by the spec's load timeout (a ready sandbox of the pool).
    Warmed,
}

/// A cold start without snapshots (`cold_start = "boot"`): launches a `--role function` worker
/// writing to `log` in a new cgroup named after `id`, sends it `load` and waits for `ready`.
/// Returns (init, worker, connection, timings: `boot` (launch and connect), `load` (import,
/// setup, warm-up), cgroup). `charge`, for an instance's start, learns the worker's tree as soon
/// as it is launched.
pub(crate) async fn boot_function(
    rt: &Runtime,
    spec: &Value,
    dir: &Path,
    log: &Path,
    id: &str,
    charge: Option<&crate::accounting::StartGuard<'_>>,
) -> Result<Booted, BootError> {
    // Platform-loaded data (crate::s3data): fetched while the worker is launched.
    let data_loading = crate::s3data::start_loading(rt.objstore.clone(), spec)?;
    // Platform-managed GPU data (crate::gpudata), on GPU 0: filled meanwhile too.
    let gpu_filling = crate::gpudata::start(&rt.split, spec, crate::tenant::of_spec(spec), 0)?;
    let launched = launch_function_worker(rt, spec, log, id, charge, Announce::Hello).await?;
    let boot_s = launched.boot_s;
    let loaded = load_into(rt, launched, spec, dir, log, data_loading, gpu_filling).await?;
    let mut phases = vec![
        ("boot".to_string(), boot_s),
        ("load".to_string(), loaded.load_s),
    ];
    phases.extend(loaded.phases("load"));
    Ok((
        loaded.init,
        loaded.worker,
        loaded.conn,
        phases,
        loaded.cgroup,
    ))
}

/// Launches a `--role function` worker for `spec`'s interpreter, preloads, GPU and tenant's
/// user, writing to `log`, in a new cgroup named after `id`, and waits for what `announce`
/// says.
pub(crate) async fn launch_function_worker(
    rt: &Runtime,
    spec: &Value,
    log: &Path,
    id: &str,
    charge: Option<&crate::accounting::StartGuard<'_>>,
    announce: Announce,
) -> Result<Launched, BootError> {
    let t = Instant::now();
    let cgroup = rt.worker_cgroup(id, spec)?;
    let cgroup_procs = cgroup
        .as_ref()
        .map_or_else(Vec::new, crate::cgroup::Cgroup::procs_files);
    let python_dir = rt.python_dir.clone()?;
    let user = rt.worker_user(spec)?;
    let (_, python, preload, gpu) = base_key(spec, &rt.split, user)?;
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
            announce_warm: announce == Announce::Warmed,
            log: &lg,
            state_dir: &sd,
            workers_socket: &ws,
            python_dir: &python_dir,
            hook: hook.as_deref(),
            preload_hook,
            cgroup: &cgroup_procs,
            user,
        })
    })
    .await
    .map_err(BootError::LaunchTask)??;
    let guard = TreeGuard(Some(init));
    if let Some(c) = charge {
        c.process_started(init);
    }
    let worker = launcher::worker_pid(init)?;
    let mut conn = rt
        .hub
        .claim(worker)
        .wait(CONNECT_TIMEOUT)
        .await
        .map_err(|source| BootError::Connect {
            source,
            log: log.clone(),
        })?;
    if conn.hello.role != "function" || conn.hello.resumed {
        return Err(BootError::WrongHello {
            role: conn.hello.role.clone(),
            resumed: conn.hello.resumed,
        });
    }
    let boot_s = t.elapsed().as_secs_f64();
    let warmed = match announce {
        Announce::Hello => None,
        Announce::Warmed => Some(
            read_warmed(
                &mut conn,
                crate::limits::load_timeout(spec, rt.config.load_timeout),
            )
            .await
            .map_err(|source| not_ready(cgroup.as_ref(), source, log.clone()))?,
        ),
    };
    Ok(Launched {
        init,
        worker,
        conn,
        cgroup,
        unprivileged: user.is_some(),
        guard,
        boot_s,
        warmed,
    })
}

/// Why a worker did not become ready: the kernel's OOM kill when its cgroup saw one, else the
/// worker's own failure or time-out.
fn not_ready(cgroup: Option<&crate::cgroup::Cgroup>, source: NotReady, log: PathBuf) -> BootError {
    match cgroup.filter(|c| c.oom_kills() > 0) {
        Some(c) => BootError::OutOfMemory {
            reason: crate::cgroup::out_of_memory(c.limits().memory),
            log,
        },
        None => BootError::NotReady { source, log },
    }
}

/// A function loaded into a launched worker ([`load_into`]).
pub(crate) struct Loaded {
    pub init: i32,
    pub worker: i32,
    pub conn: WorkerConn,
    pub cgroup: Option<crate::cgroup::Cgroup>,
    /// From the directory's bind to the last `ready`.
    pub load_s: f64,
    /// Of it: binding the directory and waiting for the platform's data (`data`), then as the
    /// worker timed them: binding and mapping that data (`map`), importing the function's
    /// module (`import`), its setup() (`setup`), weight packing (`pack`) and its warm-up
    /// request (`warmup`).
    pub data_s: f64,
    pub map_s: Option<f64>,
    pub import_s: Option<f64>,
    pub setup_s: Option<f64>,
    pub pack_s: Option<f64>,
    pub warmup_s: Option<f64>,
}

impl Loaded {
    /// The load's own phases as timings, each named `PREFIX.PHASE` (X-Torpor-Timings).
    pub fn phases(&self, prefix: &str) -> Vec<(String, f64)> {
        [
            ("data", Some(self.data_s)),
            ("map", self.map_s),
            ("import", self.import_s),
            ("setup", self.setup_s),
            ("pack", self.pack_s),
            ("warmup", self.warmup_s),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((format!("{prefix}.{k}"), v?)))
        .collect()
    }
}

/// The second half of a boot: binds `dir` into the launched worker, sends `load` (with the
/// data `data_loading` fetched and the GPU data `gpu_filling` filled), waits for `ready` and, for
/// a sandbox's host, loads the other members of its group.
pub(crate) async fn load_into(
    rt: &Runtime,
    launched: Launched,
    spec: &Value,
    dir: &Path,
    log: &Path,
    data_loading: Option<crate::s3data::Loading>,
    gpu_filling: Option<crate::gpudata::Filling>,
) -> Result<Loaded, BootError> {
    let Launched {
        init,
        worker,
        mut conn,
        cgroup,
        unprivileged,
        mut guard,
        ..
    } = launched;
    let log = log.to_path_buf();
    let t = Instant::now();
    crate::function_mounts::bind_function_dir(init, dir, unprivileged).await?;
    let (data, _) = crate::s3data::finish_loading(data_loading).await?;
    let gpu_data = crate::gpudata::finish(gpu_filling).await?;
    let data_s = t.elapsed().as_secs_f64();
    for f in &gpu_data {
        tracing::debug!(data = %f.name, source = f.source, bytes = f.size, "platform-managed GPU data ready for the load");
    }
    conn.send(&load_frame(spec, dir))
        .await
        .map_err(BootError::SendLoad)?;
    crate::s3data::send_fds(&mut conn, &data)
        .await
        .map_err(BootError::SendLoad)?;
    drop(data);
    crate::gpudata::send(&mut conn, &gpu_data)
        .await
        .map_err(BootError::SendLoad)?;
    let answer = ready(
        &mut conn,
        crate::limits::load_timeout(spec, rt.config.load_timeout),
    )
    .await
    .map_err(|source| not_ready(cgroup.as_ref(), source, log))?;
    // A sandbox's host boots with the other functions of its sandbox (crate::runtime::sandbox).
    if let Some(group) = crate::runtime::sandbox::group_of(spec) {
        let name = spec["name"].as_str().unwrap_or_default();
        crate::runtime::sandbox::load_members(
            rt,
            &mut conn,
            init,
            name,
            &group,
            unprivileged,
            crate::limits::load_timeout(spec, rt.config.load_timeout),
        )
        .await?;
    }
    let load_s = t.elapsed().as_secs_f64();
    guard.0 = None;
    Ok(Loaded {
        init,
        worker,
        conn,
        cgroup,
        load_s,
        data_s,
        map_s: answer.get("map_s").and_then(Value::as_f64),
        import_s: answer.get("import_s").and_then(Value::as_f64),
        setup_s: answer.get("setup_s").and_then(Value::as_f64),
        pack_s: answer.get("pack_s").and_then(Value::as_f64),
        warmup_s: answer.get("warmup_s").and_then(Value::as_f64),
    })
}

/// (key, interpreter, preload in spec order, gpu). The key ends with how the base's workers got
/// the device-memory hook ([`crate::split::Split::base_key_suffix`]), so a base booted
/// otherwise is never restored for this deploy, and starts with the spec's tenant unless it is
/// the default one ([`crate::tenant::scoped_key`]): tenants never share a base (nor learn from
/// `base_reused` that another tenant deployed on it). `Err`: the spec's interpreter is not
/// found.
///
/// An unprivileged worker's base ends with its user (`|uid N`): a base booted as root, or as
/// another user, is never restored for it (CRIU restores the credentials it dumped).
pub fn base_key(
    spec: &Value,
    split: &crate::split::Split,
    user: Option<torpor_snapshot::launch::User>,
) -> Result<(String, PathBuf, Vec<String>, bool), launcher::ResolvePythonError> {
    let python = launcher::resolve_python(spec["python"].as_str().unwrap_or("python3"))?;
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
    let key = crate::tenant::scoped_key(
        crate::tenant::of_spec(spec),
        &format!(
            "{}|{}|{}{}{}",
            python.display(),
            sorted.join(","),
            if gpu { "gpu" } else { "cpu" },
            split.base_key_suffix(gpu),
            user.map(|u| format!("|uid {}:{}", u.uid, u.gid))
                .unwrap_or_default()
        ),
    );
    Ok((key, python, preload, gpu))
}

/// Why [`boot_function`] could not boot a function worker (its tree, if launched, was killed).
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Another function of the sandbox did not load beside its host.
    #[error(transparent)]
    Sandbox(#[from] crate::runtime::sandbox::LoadMembersError),
    /// The `torpor` Python package, which the worker runs, cannot be found.
    #[error(transparent)]
    SdkDir(#[from] crate::sdk_dir::SdkDirError),
    /// The spec's interpreter cannot be used.
    #[error(transparent)]
    Python(#[from] launcher::ResolvePythonError),
    /// The blocking task launching the worker did not finish.
    #[error("launch task failed: {0}; torpord's log has the cause")]
    LaunchTask(#[source] tokio::task::JoinError),
    /// The launcher failed, or its worker is not under the init.
    #[error(transparent)]
    Launch(#[from] launcher::LaunchError),
    /// The worker did not connect to the workers socket in time (its log says why).
    #[error("the booted worker did not connect: {source}; see {}", log.display())]
    Connect {
        #[source]
        source: ConnError,
        log: PathBuf,
    },
    /// The worker that connected is not a fresh function worker.
    #[error("the booted worker said hello as role {role} (resumed: {resumed}), not a fresh function worker")]
    WrongHello { role: String, resumed: bool },
    /// The function's directory could not be bound into the worker's mount namespace.
    #[error(transparent)]
    Bind(#[from] crate::function_mounts::BindError),
    /// Platform-loaded data could not be loaded (crate::s3data).
    #[error(transparent)]
    Data(#[from] crate::s3data::DataError),
    /// Platform-managed GPU data could not be filled.
    #[error(transparent)]
    GpuData(#[from] crate::gpudata::GpuDataError),
    /// The `load` frame could not be sent.
    #[error("sending load: {0}")]
    SendLoad(#[source] ConnError),
    /// Its cgroup could not be made.
    #[error("cannot make the worker's cgroup: {0}")]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// Its tenant has no user to run it as.
    #[error(transparent)]
    User(#[from] crate::users::UserError),
    /// The kernel killed the worker for its cgroup's memory limit before it became ready.
    #[error("{reason}; see {}", log.display())]
    OutOfMemory { reason: String, log: PathBuf },
    /// The worker did not become ready after `load` (its log says why).
    #[error("{source}; see {}", log.display())]
    NotReady {
        #[source]
        source: NotReady,
        log: PathBuf,
    },
}

/// Why a worker did not become ready after `preload` or `load`.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// waiting for the worker's ready: {0}
    #[error("waiting for the worker's ready: {0}")]
    Conn(#[from] ConnError),
    /// The worker passed its load bound (the caller's guard kills it).
    #[error("{}", crate::limits::load_timed_out(*bound))]
    TimedOut { bound: Duration },
    /// The worker's own step failed; `error` is its error document (type, message, traceback).
    #[error("the worker failed in its {worker_phase} step: {}: {}{}", error["type"].as_str().unwrap_or("Error"), error["message"].as_str().unwrap_or(""), gpu_memory_hint(error))]
    Failed { worker_phase: String, error: Value },
}

impl NotReady {
    /// Whether the worker's step failed for lack of GPU memory: the node's GPU was too full,
    /// not the function at fault (a cluster deploys it on another node then).
    pub fn gpu_memory_short(&self) -> bool {
        matches!(self, NotReady::Failed { error, .. } if is_gpu_out_of_memory(error))
    }
}

/// Whether a worker's error document is a framework's or the driver's out-of-memory error.
fn is_gpu_out_of_memory(error: &Value) -> bool {
    let kind = error["type"].as_str().unwrap_or("");
    let message = error["message"].as_str().unwrap_or("").to_ascii_lowercase();
    kind.ends_with("OutOfMemoryError")
        || message.contains("cuda_error_out_of_memory")
        || message.contains("cuda out of memory")
        || message.contains("cudaerrormemoryallocation")
        || (message.contains("out of memory")
            && (message.contains("cuda") || message.contains("gpu")))
}

/// What to do when a worker's step failed for lack of GPU memory (a framework's or the
/// driver's out-of-memory error); empty for any other failure.
fn gpu_memory_hint(error: &Value) -> &'static str {
    if is_gpu_out_of_memory(error) {
        " (the GPU ran out of memory: free GPU memory on this node, whose other processes \
         `nvidia-smi` lists, or make the function use less, then deploy again)"
    } else {
        ""
    }
}

/// Reads `warmed` (a worker launched with `--announce-warm`), strictly; a `ready` {ok: false}
/// there is the failure of its preload or warm-up step.
pub async fn read_warmed(conn: &mut WorkerConn, bound: Duration) -> Result<Warmed, NotReady> {
    let msg = match tokio::time::timeout(bound, conn.recv()).await {
        Err(_) => return Err(NotReady::TimedOut { bound }),
        Ok(r) => r?,
    };
    let payload = serde_json::to_vec(&msg).map_err(|e| ConnError::Protocol(e.to_string()))?;
    match FromWorker::parse(&payload) {
        Ok(FromWorker::Warmed(w)) => Ok(w),
        Ok(FromWorker::Ready(r)) if !r.ok => Err(NotReady::Failed {
            worker_phase: r.phase.unwrap_or_else(|| "?".to_string()),
            error: r.error.unwrap_or(Value::Null),
        }),
        Ok(other) => Err(NotReady::Conn(ConnError::Protocol(format!(
            "expected a warmed frame, got {}",
            other.kind()
        )))),
        Err(e) => Err(NotReady::Conn(ConnError::Protocol(e.to_string()))),
    }
}

/// Reads `ready`: the worker's `ready` frame when it says `ok: true`.
pub async fn ready(conn: &mut WorkerConn, bound: Duration) -> Result<Value, NotReady> {
    let msg = match conn.expect("ready", bound).await {
        Err(ConnError::Timeout(_)) => return Err(NotReady::TimedOut { bound }),
        r => r?,
    };
    if msg.get("ok").and_then(Value::as_bool) == Some(true) {
        return Ok(Value::Object(msg));
    }
    Err(NotReady::Failed {
        worker_phase: msg
            .get("phase")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string(),
        error: msg.get("error").cloned().unwrap_or(Value::Null),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn not_ready(kind: &str, message: &str) -> NotReady {
        NotReady::Failed {
            worker_phase: "setup".into(),
            error: json!({"type": kind, "message": message, "traceback": ""}),
        }
    }

    fn failed(kind: &str, message: &str) -> String {
        not_ready(kind, message).to_string()
    }

    #[test]
    fn a_step_out_of_gpu_memory_says_so_and_what_to_do() {
        for (kind, message) in [
            (
                "OutOfMemoryError",
                "CUDA out of memory. Tried to allocate 2.00 GiB",
            ),
            (
                "RuntimeError",
                "cuMemAlloc_v2 failed with CUDA_ERROR_OUT_OF_MEMORY (2)",
            ),
            (
                "XlaRuntimeError",
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate on GPU",
            ),
        ] {
            let line = failed(kind, message);
            assert!(line.contains(message), "{line}");
            assert!(not_ready(kind, message).gpu_memory_short(), "{kind}");
            assert!(
                line.contains("the GPU ran out of memory: free GPU memory"),
                "{line}"
            );
            assert!(!line.contains('\n'), "{line}");
        }
        // Host memory, or anything else: no GPU hint.
        for (kind, message) in [("MemoryError", ""), ("ValueError", "bad weights")] {
            assert!(!failed(kind, message).contains("GPU"), "{kind}");
            assert!(!not_ready(kind, message).gpu_memory_short(), "{kind}");
        }
        assert!(!NotReady::TimedOut {
            bound: std::time::Duration::from_secs(1)
        }
        .gpu_memory_short());
    }
}
