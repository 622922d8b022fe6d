//! Starting workers. `torpor_snapshot::launch` unshares namespaces in the calling process, which
//! a multi-threaded daemon must not do, so the daemon runs its own binary with the hidden
//! subcommand [`LAUNCH_SUBCOMMAND`] (`torpor __launch LOG STATE_DIR -- CMD…`), which launches CMD
//! exactly as `torpor run` does and prints the init's pid.
//!
//! Workers import the `torpor` Python package from `$TORPOR_PYTHONPATH` if set, else from the
//! `python/` directory of the source tree the running binary was built in (found by walking up
//! from the executable, e.g. `<repo>/target/release/torpor` → `<repo>/python`), or from the
//! site-packages the wheel installed it in beside the binary (`<venv>/bin/torpor` →
//! `<venv>/lib/python3.X/site-packages`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use torpor_snapshot::mounts::MountPolicy;

use crate::split::HookPreload;

/// The hidden subcommand of `torpor` and `torpord` that launches one worker.
pub const LAUNCH_SUBCOMMAND: &str = "__launch";
/// `__launch`'s option naming a `cgroup.procs` file to join (once per hierarchy).
const CGROUP_FLAG: &str = "--cgroup";
/// `__launch`'s option naming the user (`UID:GID`) the tree runs as (docs/security.md).
const USER_FLAG: &str = "--user";
/// The socket the worker connects to.
pub const WORKER_SOCKET_ENV: &str = "TORPOR_WORKER_SOCKET";

/// `__launch [--cgroup PROCS_FILE]… [--user UID:GID] LOG STATE_DIR CMD…`: launches CMD under a
/// new init in the cgroups (their `cgroup.procs` files, crate::cgroup), as the user if given
/// (an unprivileged worker: [`worker_mounts`]), prints the init's pid.
pub fn launch_main(args: &[OsString]) -> ExitCode {
    let usage = || {
        eprintln!(
            "usage: {LAUNCH_SUBCOMMAND} [{CGROUP_FLAG} FILE]... [{USER_FLAG} UID:GID] LOG STATE_DIR CMD... (internal to torpord)"
        );
        ExitCode::from(2)
    };
    let mut args = args;
    let mut cgroup = Vec::new();
    let mut user = None;
    while let [flag, value, rest @ ..] = args {
        if flag == CGROUP_FLAG {
            cgroup.push(PathBuf::from(value));
        } else if flag == USER_FLAG {
            match value.to_str().and_then(parse_user) {
                Some(u) => user = Some(u),
                None => return usage(),
            }
        } else {
            break;
        }
        args = rest;
    }
    let [log, state_dir, command @ ..] = args else {
        return usage();
    };
    let program = command.first().map(PathBuf::from);
    let mounts = match worker_mounts(Path::new(state_dir), user.is_some(), program.as_deref()) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match torpor_snapshot::launch::launch(&torpor_snapshot::launch::LaunchOptions {
        command,
        log: Path::new(log),
        state_dir: Path::new(state_dir),
        mounts: &mounts,
        // The worker's LD_PRELOAD, if any, is set by `launch_worker`.
        preload: None,
        // Joined right before the init is forked: every process of the tree is born in it.
        cgroup: &cgroup,
        user,
    }) {
        Ok(pid) => {
            println!("{pid}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}", e.to_string().replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn parse_user(text: &str) -> Option<torpor_snapshot::launch::User> {
    let (uid, gid) = text.split_once(':')?;
    Some(torpor_snapshot::launch::User {
        uid: uid.parse().ok()?,
        gid: gid.parse().ok()?,
    })
}

/// The directories of the state directory an unprivileged worker reaches (bound in, read-only
/// but `logs`): the init copies it runs ([`torpor_snapshot::launch::init_binary`]), the preload
/// copies (the hook), the workers socket's own directory and the logs (which the init opens
/// before it drops root; the directory is 0700, out of the worker's reach after).
pub const WORKER_STATE_DIRS: &[&str] = &["init", crate::split::HOOK_COPY_DIR, "sock", "logs"];

/// A worker's mount namespace (docs/mounts.md): its own /dev/shm and /tmp, none of the host's
/// memory filesystems, the state directory bound in, and the Python harness bound in where the
/// worker could not reach it otherwise. The function's directory is bound in when the function
/// is loaded ([`crate::function_mounts`]).
///
/// An unprivileged worker (docs/security.md) sees the host read-only, has `/var/tmp` of its own
/// too, and gets only [`WORKER_STATE_DIRS`] of the state directory; the harness, the interpreter's
/// prefix (`program`'s `bin/..`, and its target's) and `TORPOR_LIBCUDA`'s directory are bound in
/// where its user could not reach them (under the state directory, a host tmpfs, or a directory
/// others cannot enter, such as `/root`), the way to each made traversable.
fn worker_mounts(
    state_dir: &Path,
    unprivileged: bool,
    program: Option<&Path>,
) -> Result<MountPolicy, WorkerMountsError> {
    let state_dir =
        std::path::absolute(state_dir).map_err(|source| WorkerMountsError::StateDir {
            dir: state_dir.to_path_buf(),
            source,
        })?;
    let table =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(WorkerMountsError::MountTable)?;
    let table = torpor_snapshot::mounts::parse(&table);
    if !unprivileged {
        let mut policy = MountPolicy::worker(vec![state_dir]);
        if let Ok(python) = crate::sdk_dir::python_dir() {
            if !policy.reaches(&python, &table) {
                policy.binds.push(python);
            }
        }
        return Ok(policy);
    }
    let pieces: Vec<PathBuf> = WORKER_STATE_DIRS
        .iter()
        .map(|d| state_dir.join(d))
        .filter(|d| d.is_dir())
        .collect();
    let logs = state_dir.join("logs");
    let mut policy = MountPolicy::unprivileged_worker(pieces, vec![logs]);
    let mut wanted: Vec<PathBuf> = Vec::new();
    if let Ok(python) = crate::sdk_dir::python_dir() {
        wanted.push(python);
    }
    if let Some(program) = program.filter(|p| p.is_absolute()) {
        let prefix = |p: &Path| p.parent().and_then(Path::parent).map(Path::to_path_buf);
        wanted.extend(prefix(program));
        if let Ok(real) = std::fs::canonicalize(program) {
            wanted.extend(prefix(&real));
        }
    }
    if let Some(lib) = std::env::var_os("TORPOR_LIBCUDA").map(PathBuf::from) {
        wanted.extend(
            lib.parent()
                .filter(|p| p.is_absolute())
                .map(Path::to_path_buf),
        );
    }
    for path in wanted {
        let Ok(path) = std::fs::canonicalize(&path) else {
            continue;
        };
        // Never a directory holding the state directory: that would bind all of it in.
        if state_dir.starts_with(&path) {
            continue;
        }
        let out_of_reach = path.starts_with(&state_dir)
            || policy.hides(&path, &table)
            || !traversable_by_others(&path);
        let covered = policy
            .binds
            .iter()
            .any(|b| path.starts_with(b) && !b.starts_with(&state_dir));
        if out_of_reach && !covered && path != Path::new("/") {
            policy.binds.retain(|b| !b.starts_with(&path));
            policy.binds.push(path);
        }
    }
    Ok(policy)
}

/// Whether a user who is neither owner nor in the group can walk to `path` (every directory above
/// it lets others search it).
fn traversable_by_others(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors()
        .skip(1)
        .all(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}

/// Why the launcher could not work out a worker's mount namespace (it prints this and exits).
#[derive(Debug, thiserror::Error)]
pub enum WorkerMountsError {
    /// The state directory (bound into every worker) has no absolute form.
    #[error("cannot make the state directory {} absolute: {source}", dir.display())]
    StateDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `/proc/self/mountinfo` cannot be read, so whether the worker reaches the Python package
    /// is unknown.
    #[error(
        "cannot read this process's mount table (/proc/self/mountinfo): {0}; is /proc mounted?"
    )]
    MountTable(#[source] std::io::Error),
}

/// `PYTHONPATH` for workers: the package's directory, then whatever was set before.
pub fn pythonpath(python_dir: &Path) -> OsString {
    let mut out = python_dir.as_os_str().to_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        out.push(":");
        out.push(old);
    }
    out
}

/// The variables of the daemon's environment a worker keeps; every other one is left out, so a
/// function never sees the daemon's secrets (cloud credentials, tokens) or settings meant for it.
/// The worker also gets what the launcher sets: `TORPOR_WORKER_SOCKET`, `PYTHONPATH`,
/// `PYTHONUNBUFFERED` and, with the hook, `TORPOR_HOOK_LIB`, `TORPOR_HOOK_CUDA`, `LD_PRELOAD`
/// (every GPU worker preloads it: [`crate::split::Split::worker_hook`]).
/// (A restored instance has the environment its base was booted with: it is part of the
/// snapshot.) docs/torpord.md, "Worker environment".
/// `PYENV_ROOT` and `PYENV_VERSION`: a pyenv shim (the spec's `python3` found on `PATH`) finds
/// its interpreters by them, or by `HOME`, which an unprivileged worker's is not.
pub const WORKER_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "LD_LIBRARY_PATH",
    "PYENV_ROOT",
    "PYENV_VERSION",
];
/// Prefixes of the variables a worker keeps: locale, CUDA's and the NVIDIA container runtime's
/// (device selection, e.g. `CUDA_VISIBLE_DEVICES`), and Torpor's own (e.g. `TORPOR_LIBCUDA`).
pub const WORKER_ENV_PREFIXES: &[&str] = &["LC_", "CUDA_", "NVIDIA_", "TORPOR_"];
/// Torpor variables of the daemon that are not the worker's business.
const WORKER_ENV_DROPPED: &[&str] = &[crate::config::SOCKET_ENV];

/// The environment variable that marks a process as started by the daemon of a state
/// directory: its value is the state directory's canonical path (crate::recovery finds and
/// kills such processes after a crash).
pub const OWNER_ENV: &str = "TORPORD_STATE_DIR";

/// Whether a worker keeps the daemon's variable `name`. The owner marker ([`OWNER_ENV`]) is
/// always kept: it is how a restarted daemon finds the processes an earlier one started.
fn kept_in_worker(name: &str) -> bool {
    name == OWNER_ENV
        || (WORKER_ENV.contains(&name) || WORKER_ENV_PREFIXES.iter().any(|p| name.starts_with(p)))
            && !WORKER_ENV_DROPPED.contains(&name)
}

/// The daemon's variables a worker keeps ([`WORKER_ENV`], [`WORKER_ENV_PREFIXES`]).
pub fn worker_env() -> Vec<(OsString, OsString)> {
    std::env::vars_os()
        .filter(|(k, _)| k.to_str().is_some_and(kept_in_worker))
        .collect()
}

/// What a worker is started with.
pub struct WorkerCommand<'a> {
    pub python: &'a Path,
    pub role: &'a str,
    pub preload: &'a [String],
    pub gpu: bool,
    /// `--announce-warm` (role function): the worker sends `warmed` once its preloads are
    /// imported and CUDA warmed, before it waits for `load` (a ready sandbox of the pool).
    pub announce_warm: bool,
    pub log: &'a Path,
    pub state_dir: &'a Path,
    pub workers_socket: &'a Path,
    pub python_dir: &'a Path,
    /// The device-memory hook, used as `preload_hook` says ([`crate::split::Split::worker_hook`]).
    pub hook: Option<&'a Path>,
    /// How the worker uses `hook`: `TORPOR_HOOK_LIB` (so that `torpor.buffer()` works) and
    /// `LD_PRELOAD`, watching only or with `TORPOR_HOOK_CUDA=1` (so that its big `cudaMalloc`s
    /// become segments).
    pub preload_hook: crate::split::HookUse,
    /// The `cgroup.procs` files of the tree's cgroup (crate::cgroup); empty: unconfined.
    pub cgroup: &'a [PathBuf],
    /// The user the tree runs as (crate::users); `None`: root.
    pub user: Option<torpor_snapshot::launch::User>,
}

/// Why a worker could not be launched, or found under its init.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The daemon's own executable (which launches workers) cannot be found.
    #[error("cannot find torpord's own executable to launch a worker: {0}")]
    OwnExecutable(#[source] std::io::Error),
    /// The launcher process could not be run.
    #[error("cannot run {exe} {LAUNCH_SUBCOMMAND}: {source}")]
    Spawn {
        exe: String,
        #[source]
        source: std::io::Error,
    },
    /// The launcher ran and failed; `status` is its exit code (`None`: killed by a signal).
    #[error("launching the worker failed (exit status {status:?}): {stderr}")]
    Failed { status: Option<i32>, stderr: String },
    /// `/proc/<init>/task/<init>/children` cannot be read (the init is gone).
    #[error("cannot read {path} to find the worker under init {init}: {source}")]
    ReadChildren {
        init: i32,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The init has no child: its worker exited.
    #[error("init {0} has no worker process (it exited)")]
    NoWorker(i32),
}

/// Launches a worker (blocking); returns the host pid of its init.
pub fn launch_worker(w: &WorkerCommand) -> Result<i32, LaunchError> {
    let exe = std::env::current_exe().map_err(LaunchError::OwnExecutable)?;
    let mut cmd = Command::new(&exe);
    // A minimal environment: the daemon's own is not the function's.
    cmd.env_clear().envs(worker_env());
    // Nor its working directory: one under /tmp (a daemon started from there) would be out of
    // the worker's reach in its mount namespace (its own /tmp), and CRIU refuses to dump a cwd
    // it cannot open ("Unaccessible path opened"). So the paths go absolute and the worker
    // starts in /.
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    cmd.current_dir("/");
    cmd.arg(LAUNCH_SUBCOMMAND);
    for procs in w.cgroup {
        cmd.arg(CGROUP_FLAG).arg(procs);
    }
    if let Some(u) = w.user {
        cmd.arg(USER_FLAG).arg(format!("{}:{}", u.uid, u.gid));
        // No /etc/passwd entry names the user: `getpass.getuser()` and its kind read these.
        let name = format!("torpor-{}", u.uid);
        cmd.env("USER", &name).env("LOGNAME", &name);
        // The daemon's home (/root) is out of its reach: caches that default to it (Triton's
        // ~/.triton, ~/.cache) go to its own /tmp instead.
        cmd.env("HOME", "/tmp");
    }
    cmd.arg(absolute(w.log))
        .arg(absolute(w.state_dir))
        .arg(w.python)
        .args(["-m", "torpor.worker", "--role", w.role]);
    if !w.preload.is_empty() {
        cmd.arg("--preload").arg(w.preload.join(","));
    }
    if w.gpu {
        cmd.arg("--gpu");
    }
    if w.announce_warm {
        cmd.arg("--announce-warm");
    }
    // What the daemon's own environment says about the hook is not the worker's: without a
    // hook here (`split = false`), the worker must not find one through inherited variables.
    cmd.env_remove(crate::split::HOOK_LIB_ENV)
        .env_remove("TORPOR_HOOK_CUDA");
    if let Some(hook) = w.hook {
        let hook = absolute(hook);
        if w.preload_hook.buffers {
            cmd.env(crate::split::HOOK_LIB_ENV, &hook);
        }
        match w.preload_hook.preload {
            HookPreload::No => {}
            HookPreload::Watch => {
                cmd.env("LD_PRELOAD", &hook);
            }
            HookPreload::Segments => {
                cmd.env("LD_PRELOAD", &hook).env("TORPOR_HOOK_CUDA", "1");
            }
        }
    }
    let out = cmd
        .env(WORKER_SOCKET_ENV, absolute(w.workers_socket))
        .env("PYTHONPATH", pythonpath(&absolute(w.python_dir)))
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .output()
        .map_err(|source| LaunchError::Spawn {
            exe: exe.display().to_string(),
            source,
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.trim().parse::<i32>() {
        Ok(pid) if out.status.success() => Ok(pid),
        _ => Err(LaunchError::Failed {
            status: out.status.code(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }),
    }
}

/// What the worker tree under `init` holds that the CUDA driver's checkpoint cannot restore
/// (CUDA IPC, managed memory, multi-rank NCCL: the records of the hook every GPU worker
/// preloads), as the one line that names it and the way around it; `None` when nothing. An
/// io_uring counts only for a snapshot (`for_criu`): an in-place GPU release never meets CRIU.
/// The keep-alive steps ask this before touching the driver, so that such an instance is left
/// warm and serving instead of checkpointed and never resumed (docs/compat.md).
pub async fn unrestorable(init: i32, for_criu: bool) -> Option<String> {
    use torpor_snapshot::unsupported::{find, Refusal};
    tokio::task::spawn_blocking(move || find(&torpor_snapshot::proctree::tree(init)))
        .await
        .ok()
        .flatten()
        .filter(|r| for_criu || !matches!(r, Refusal::IoUring { .. }))
        .map(|r| r.to_string())
}

/// The host pid of the worker under init `init` (its only child).
pub fn worker_pid(init: i32) -> Result<i32, LaunchError> {
    let path = format!("/proc/{init}/task/{init}/children");
    let text = std::fs::read_to_string(&path).map_err(|source| LaunchError::ReadChildren {
        init,
        path: path.clone(),
        source,
    })?;
    text.split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or(LaunchError::NoWorker(init))
}

/// Resolves the interpreter named in a spec (`python3`, or a path) to an absolute path, so the
/// base key does not depend on `PATH` lookups at boot time. Symlinks are kept: a virtual
/// environment's `bin/python3` is a symlink to the base interpreter, and only the link's own
/// path makes Python pick up the environment's packages.
pub fn resolve_python(name: &str) -> Result<PathBuf, ResolvePythonError> {
    let found = if name.contains('/') {
        // Relative to what? Not the daemon's working directory (the spec checker refuses it too).
        if !Path::new(name).is_absolute() {
            return Err(ResolvePythonError::Relative {
                name: name.to_string(),
            });
        }
        Some(PathBuf::from(name))
    } else {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(name))
                .find(|p| is_executable(p))
        })
    };
    let path =
        found
            .filter(|p| is_executable(p))
            .ok_or_else(|| ResolvePythonError::NotExecutable {
                name: name.to_string(),
            })?;
    std::path::absolute(&path).map_err(|source| ResolvePythonError::Absolute { path, source })
}

/// Why the interpreter a spec names (its `python`) cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ResolvePythonError {
    /// A path relative to nothing the user chose (the daemon's working directory).
    #[error(
        "interpreter {name:?} (the spec's python) is a relative path: name a command on \
         PATH or an absolute path"
    )]
    Relative { name: String },
    /// Not found on `PATH`, or not an executable file.
    #[error("interpreter {name:?} (the spec's python) is not an executable on PATH: install it or name a full path")]
    NotExecutable { name: String },
    /// The found path has no absolute form.
    #[error("cannot make the interpreter path {} absolute: {source}", path.display())]
    Absolute {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interpreter_is_a_command_or_an_absolute_path() {
        let e = resolve_python("../../usr/bin/python3")
            .unwrap_err()
            .to_string();
        assert!(e.contains("relative path"), "{e}");
        assert!(resolve_python("/nonexistent/python3").is_err());
        assert!(resolve_python("sh").unwrap().is_absolute());
    }

    #[test]
    fn a_worker_keeps_only_the_listed_variables() {
        let kept = kept_in_worker;
        for k in [
            "PATH",
            "HOME",
            "LC_ALL",
            "CUDA_VISIBLE_DEVICES",
            "LD_LIBRARY_PATH",
            "TORPOR_LIBCUDA",
            OWNER_ENV,
        ] {
            assert!(kept(k), "{k}");
        }
        for k in [
            "AWS_SECRET_ACCESS_KEY",
            "TORPOR_SOCKET",
            "LD_PRELOAD",
            "SSH_AUTH_SOCK",
            "PYTHONSTARTUP",
        ] {
            assert!(!kept(k), "{k}");
        }
        for (k, _) in worker_env() {
            assert!(kept(k.to_str().unwrap()), "{k:?}");
        }
    }
}
