//! `torpor run`: start a command so that it can be snapshotted and restored many times side by
//! side. The command runs under a small init at PID 1 of new PID, mount and network namespaces:
//!
//! - PID namespace: restored copies keep their pids without clashing with each other;
//! - mount namespace: built by [`LaunchOptions::mounts`] ([`crate::mounts::MountPolicy`]: a
//!   fresh /dev/shm of its own, the host's tmpfs either gone or left external, so a snapshot never
//!   carries the host's files), and /proc is remounted for the new PID namespace (CUDA's
//!   `cuInit` fails with error 304 without it), privately, so nothing leaks to the host;
//! - network namespace: each restored copy re-binds its sockets (abstract Unix sockets, TCP
//!   ports) in a namespace of its own; `lo` is brought up so 127.0.0.1 works.
//!
//! The init starts a new session (CRIU refuses a tree whose session leader is outside it),
//! closes every inherited fd (CRIU cannot dump an fd that points into another namespace) and
//! opens stdio inside. It forwards signals to the command, reaps orphans, and exits with the
//! command's status.

use std::ffi::{CString, OsString};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use crate::mounts::MountPolicy;
use crate::supervise;
use crate::sys;

/// Errors of `torpor run`; each message names the cause and the fix.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Not root.
    #[error("torpor run needs root (it creates PID, mount and network namespaces): run it as root or with sudo")]
    NotRoot,
    /// Empty command.
    #[error("no command given: use `torpor run -- CMD [ARGS...]`")]
    NoCommand,
    /// An argument or path contained a NUL byte.
    #[error("argument {0:?} contains a NUL byte: remove it")]
    Nul(String),
    /// The log file's directory could not be created.
    #[error("cannot create the log directory {path}: {source}; pass --log with a writable path")]
    LogDir { path: PathBuf, source: io::Error },
    /// The tree's cgroup could not be joined ([`LaunchOptions::cgroup`]).
    #[error("cannot start the tree in its cgroup ({path}): {source}")]
    Cgroup { path: PathBuf, source: io::Error },
    /// The mount namespace could not be built.
    #[error(transparent)]
    Mounts(#[from] crate::mount_ns::MountNsError),
    /// A path the launch needs lies where the new mount namespace has a tmpfs of its own (or
    /// none of the host's).
    #[error("the {what} {path} would be out of the command's reach in its mount namespace (a tmpfs of its own at /dev/shm, and for torpord's workers at /tmp, none of the host's tmpfs: docs/mounts.md); {fix}")]
    Unreachable {
        what: &'static str,
        path: PathBuf,
        fix: &'static str,
    },
    /// A system call in the setup failed.
    #[error(
        "{step} failed: {source}; the kernel must allow PID/mount/network namespaces for root"
    )]
    Setup {
        step: &'static str,
        source: io::Error,
    },
    /// The child reported a failure before exec.
    #[error("{0}")]
    Child(String),
    /// The init binary could not be prepared.
    #[error("cannot prepare the init binary in {dir}: {source}: free space on its filesystem, or make it writable")]
    InitBinary { dir: PathBuf, source: io::Error },
    /// The library to preload could not be copied.
    #[error(
        "cannot copy {library} into {dir}: {source}; set TORPOR_STATE_DIR to a writable directory"
    )]
    Preload {
        library: PathBuf,
        dir: PathBuf,
        source: io::Error,
    },
}

/// What `launch` needs.
pub struct LaunchOptions<'a> {
    /// The command and its arguments (the program is looked up in PATH).
    pub command: &'a [OsString],
    /// File that receives the command's stdout and stderr (appended).
    pub log: &'a Path,
    /// Where the init binary is kept (a content-addressed copy of the running torpor).
    pub state_dir: &'a Path,
    /// How the command's mount namespace is built.
    pub mounts: &'a MountPolicy,
    /// A library to preload into the command (put first in `LD_PRELOAD`); a content-addressed
    /// copy in `state_dir` is what the tree maps, so a rebuild never breaks a snapshot.
    pub preload: Option<&'a Path>,
    /// Cgroups to start the tree in: their `cgroup.procs` files (one per hierarchy), joined
    /// right before the init is forked, so that this launcher's own memory (it reads the init
    /// binary whole to hash it) is not charged to the tree. Empty: the caller's cgroup.
    pub cgroup: &'a [PathBuf],
    /// The user the tree runs as: the init drops root for it ([`drop_root`]) once the
    /// namespaces are built, before the command starts. `None`: root.
    pub user: Option<User>,
}

/// A user and group, by number (no `/etc/passwd` entry is needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

/// The variable by which the launcher tells the init which user to drop root for (`UID:GID`);
/// the init removes it before it starts the command.
pub const INIT_USER_ENV: &str = "TORPOR_INIT_USER";

/// The argument that makes `torpor` run as the init (a hidden subcommand of the CLI).
pub const INIT_SUBCOMMAND: &str = "__init";

fn cstring(bytes: &[u8]) -> Result<CString, LaunchError> {
    CString::new(bytes).map_err(|_| LaunchError::Nul(String::from_utf8_lossy(bytes).into_owned()))
}

/// Starts the command; returns the host pid of its init (the pid to snapshot).
pub fn launch(opts: &LaunchOptions) -> Result<i32, LaunchError> {
    if !sys::is_root() {
        return Err(LaunchError::NotRoot);
    }
    if opts.command.is_empty() {
        return Err(LaunchError::NoCommand);
    }
    if let Some(dir) = opts.log.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| LaunchError::LogDir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    check_reachable(opts)?;
    let init = init_binary(opts.state_dir)?;
    let setup = |step, source| LaunchError::Setup { step, source };
    let (report_rd, report_wr) = sys::pipe_cloexec().map_err(|e| setup("pipe", e))?;

    // Everything the child needs is allocated before fork.
    let mut argv: Vec<CString> = vec![
        cstring(init.as_os_str().as_bytes())?,
        cstring(INIT_SUBCOMMAND.as_bytes())?,
        cstring(report_wr.as_raw_fd().to_string().as_bytes())?,
        cstring(opts.log.as_os_str().as_bytes())?,
    ];
    for a in opts.command {
        argv.push(cstring(a.as_bytes())?);
    }
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    let envp = environment(opts)?;
    let mut env_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());

    // Opened before the mount namespace is built: the cgroup file system may not be there after.
    let mut cgroup = opts
        .cgroup
        .iter()
        .map(|procs| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(procs)
                .map_err(|source| LaunchError::Cgroup {
                    path: procs.clone(),
                    source,
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // SAFETY: unshare changes only this (single-threaded) process's namespaces; the CLI exits
    // right after the launch, so nothing else observes the change.
    sys::check(unsafe {
        libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS | libc::CLONE_NEWNET)
    })
    .map_err(|e| setup("unshare(PID, mount, network namespaces)", e))?;
    crate::mount_ns::build(opts.mounts)?;
    for (procs, file) in opts.cgroup.iter().zip(&mut cgroup) {
        file.write_all(b"0").map_err(|source| LaunchError::Cgroup {
            path: procs.clone(),
            source,
        })?;
    }
    drop(cgroup);
    // SAFETY: the process is single-threaded here (the CLI starts no threads before run); the
    // child only clears a flag and execs.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(setup("fork", io::Error::last_os_error()));
    }
    if pid == 0 {
        // Exec now, inside the new mount namespace: a binary mapped before the unshare would
        // refer to a mount of the host's namespace, which CRIU cannot dump.
        // SAFETY: clearing FD_CLOEXEC on our own descriptor so it survives the exec.
        unsafe { libc::fcntl(report_wr.as_raw_fd(), libc::F_SETFD, 0) };
        // SAFETY: ptrs and env_ptrs are NUL-terminated arrays of valid C strings.
        unsafe { libc::execve(ptrs[0], ptrs.as_ptr(), env_ptrs.as_ptr()) };
        let msg = format!(
            "cannot execute the init {}: {}",
            init.display(),
            io::Error::last_os_error()
        );
        let _ = sys::write_all(&report_wr, msg.as_bytes());
        // SAFETY: leave the failed child at once.
        unsafe { libc::_exit(127) };
    }
    drop(report_wr);
    let report =
        sys::read_to_end(&report_rd).map_err(|e| setup("reading the child's report", e))?;
    let report = String::from_utf8_lossy(&report);
    if report != "ok" {
        // SAFETY: reap the failed child so no zombie is left behind.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        return Err(LaunchError::Child(report.into_owned()));
    }
    Ok(pid)
}

/// Refuses a log or state directory the command could not reach once its mount namespace is
/// built: the log would be written where nobody outside sees it, the init could not be run.
/// Likewise a command given by an absolute path there (e.g. a venv's interpreter under /tmp):
/// it would fail with a bare "No such file or directory".
fn check_reachable(opts: &LaunchOptions) -> Result<(), LaunchError> {
    let table =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| LaunchError::Setup {
            step: "reading the mount table",
            source,
        })?;
    let table = crate::mounts::parse(&table);
    let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    // The init is run from there (the state directory itself may be out of reach: only the
    // pieces a worker needs are bound in for unprivileged workers).
    let init_dir = opts.state_dir.join("init");
    for (what, path, fix) in [
        ("log file", opts.log, "pass --log with a path elsewhere"),
        (
            "state directory",
            init_dir.as_path(),
            "set TORPOR_STATE_DIR to a directory elsewhere",
        ),
    ] {
        let path = absolute(path);
        if !opts.mounts.reaches(&path, &table) {
            return Err(LaunchError::Unreachable { what, path, fix });
        }
    }
    if let Some(program) = opts.command.first().map(Path::new) {
        if program.is_absolute() && !opts.mounts.reaches(program, &table) {
            return Err(LaunchError::Unreachable {
                what: "command",
                path: program.to_path_buf(),
                fix: "install it (or its virtual environment) outside /tmp, /dev/shm and the \
                      host's other tmpfs mounts",
            });
        }
    }
    Ok(())
}

/// libuv (PyTorch's TCPStore, uvloop, Node.js) opens an io_uring instance, which CRIU cannot save,
/// unless this says not to; it then uses epoll, as it did before io_uring. Set for every tree
/// whose environment does not name it.
pub const NO_IO_URING: (&str, &str) = ("UV_USE_IO_URING", "0");
/// PyTorch's TCPStore runs on libuv by default, and the libuv it bundles opened an io_uring even
/// with [`NO_IO_URING`] on the H100 machine (tests/compat `nccl_world1_tcp`); `USE_LIBUV=0` gives
/// it the plain socket backend, which CRIU saves with TCP repair. Set likewise.
pub const NO_LIBUV_STORE: (&str, &str) = ("USE_LIBUV", "0");

/// This process's environment for the init and the command, with `opts.preload` (copied into the
/// state directory) first in `LD_PRELOAD`, [`NO_IO_URING`] and [`NO_LIBUV_STORE`].
fn environment(opts: &LaunchOptions) -> Result<Vec<CString>, LaunchError> {
    let preload = match opts.preload {
        Some(library) => Some(
            content_addressed_copy(library, &opts.state_dir.join("preload")).map_err(|source| {
                LaunchError::Preload {
                    library: library.to_path_buf(),
                    dir: opts.state_dir.join("preload"),
                    source,
                }
            })?,
        ),
        None => None,
    };
    let mut env = Vec::new();
    if let Some(u) = opts.user {
        env.push(cstring(
            format!("{INIT_USER_ENV}={}:{}", u.uid, u.gid).as_bytes(),
        )?);
    }
    let mut old_preload: Option<OsString> = None;
    for (key, value) in [NO_IO_URING, NO_LIBUV_STORE] {
        if std::env::var_os(key).is_none() {
            env.push(cstring(format!("{key}={value}").as_bytes())?);
        }
    }
    for (key, value) in std::env::vars_os() {
        if key == INIT_USER_ENV {
            continue;
        }
        if preload.is_some() && key == "LD_PRELOAD" {
            old_preload = Some(value);
            continue;
        }
        let mut entry = key.into_vec();
        entry.push(b'=');
        entry.extend_from_slice(value.as_bytes());
        env.push(cstring(&entry)?);
    }
    if let Some(path) = preload {
        let mut entry = b"LD_PRELOAD=".to_vec();
        entry.extend_from_slice(path.as_os_str().as_bytes());
        if let Some(old) = old_preload.filter(|o| !o.is_empty()) {
            entry.push(b' ');
            entry.extend_from_slice(old.as_bytes());
        }
        env.push(cstring(&entry)?);
    }
    Ok(env)
}

/// A copy of `file` in `dir` named by its hash (and keeping its name), made once.
pub fn content_addressed_copy(file: &Path, dir: &Path) -> io::Result<PathBuf> {
    let bytes = std::fs::read(file)?;
    let hash = blake3::hash(&bytes).to_hex();
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let path = dir.join(&hash[..16]).join(&name);
    if !path.exists() {
        std::fs::create_dir_all(path.parent().unwrap_or(dir))?;
        let tmp = dir.join(format!(".{}-{name}.{}", &hash[..16], std::process::id()));
        std::fs::write(&tmp, &bytes)?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
}

/// A copy of the running torpor binary named by its hash. Snapshots map the init's binary, and
/// CRIU refuses to restore a mapping whose file changed; a content-addressed copy keeps every
/// snapshot restorable when torpor itself is rebuilt or upgraded. A daemon makes it at start
/// too: a snapshot another node took with the same binary restores before anything launched.
pub fn init_binary(state_dir: &Path) -> Result<PathBuf, LaunchError> {
    // A daemon launches many workers: hash the running binary once per process and state dir.
    static CACHE: std::sync::Mutex<Option<(PathBuf, PathBuf)>> = std::sync::Mutex::new(None);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((dir, path)) = cache.as_ref() {
        if dir == state_dir && path.exists() {
            return Ok(path.clone());
        }
    }
    let path = copy_init_binary(state_dir)?;
    *cache = Some((state_dir.to_path_buf(), path.clone()));
    Ok(path)
}

fn copy_init_binary(state_dir: &Path) -> Result<PathBuf, LaunchError> {
    let fail = |source| LaunchError::InitBinary {
        dir: state_dir.to_path_buf(),
        source,
    };
    let exe = std::env::current_exe().map_err(fail)?;
    let bytes = std::fs::read(&exe).map_err(fail)?;
    let hash = blake3::hash(&bytes).to_hex();
    let dir = state_dir.join("init");
    let path = dir.join(format!("torpor-init-{}", &hash[..16]));
    if !path.exists() {
        std::fs::create_dir_all(&dir).map_err(fail)?;
        let tmp = dir.join(format!(
            ".torpor-init-{}.{}",
            &hash[..16],
            std::process::id()
        ));
        std::fs::write(&tmp, &bytes).map_err(fail)?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(fail)?;
        std::fs::rename(&tmp, &path).map_err(fail)?;
    }
    Ok(path)
}

/// The init: runs as PID 1 of the new namespaces, exec'd by [`launch`]. Sets up the namespaces'
/// inside, starts the command, reports "ok" or an error line on `report_fd`, then supervises the
/// command and returns its exit code.
pub fn init_main(report_fd: i32, log: &Path, command: &[OsString]) -> i32 {
    // SAFETY: the launcher passed this descriptor to us and nothing else owns it.
    let report = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(report_fd) };
    // It was made inheritable only to cross the exec; the command must not inherit it, or the
    // launcher would never see the pipe close.
    // SAFETY: setting a flag on our own descriptor.
    unsafe { libc::fcntl(report.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    // Read and removed while single-threaded, before anything runs: the command must not see it.
    let user = std::env::var(INIT_USER_ENV).ok();
    std::env::remove_var(INIT_USER_ENV);
    let user = match user.map(|u| parse_user(&u)) {
        None => None,
        Some(Some(u)) => Some(u),
        Some(None) => {
            let msg = format!("{INIT_USER_ENV} must be UID:GID (internal to torpord)");
            let _ = sys::write_all(&report, msg.as_bytes());
            return 127;
        }
    };
    let prepared = command
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|argv| Ok((argv, cstring(log.as_os_str().as_bytes())?)));
    let (argv, log) = match prepared {
        Ok(v) => v,
        Err(e) => {
            let _ = sys::write_all(&report, e.to_string().as_bytes());
            return 127;
        }
    };
    match init(&argv, &log, user, report) {
        Ok(code) => code,
        Err((msg, report)) => {
            if let Some(r) = report {
                let _ = sys::write_all(&r, msg.as_bytes());
            }
            127
        }
    }
}

type InitError = (String, Option<OwnedFd>);

fn parse_user(text: &str) -> Option<User> {
    let (uid, gid) = text.split_once(':')?;
    Some(User {
        uid: uid.parse().ok()?,
        gid: gid.parse().ok()?,
    })
}

/// The highest capability number any kernel may know; dropping an unknown one is EINVAL.
const LAST_CAPABILITY: libc::c_ulong = 63;

/// Drops root for `user` for good: no capability left in any set (the bounding set too, so no
/// file capability brings one back), no supplementary group, real, effective and saved ids all
/// the user's, and `no_new_privs` (no set-uid program raises it again). Checked: getting root
/// back must fail. CRIU dumps and restores all of it with the process.
pub fn drop_root(user: User) -> io::Result<()> {
    for cap in 0..=LAST_CAPABILITY {
        // SAFETY: prctl with integer arguments only; EINVAL for a number this kernel lacks.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(io::Error::last_os_error());
        }
    }
    // SAFETY: as above; clears the ambient set.
    sys::check(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    })?;
    // SAFETY: an empty group list (the pointer is not read with a size of 0).
    sys::check(unsafe { libc::setgroups(0, std::ptr::null()) })?;
    // SAFETY: integer arguments only; this process is single-threaded.
    sys::check(unsafe { libc::setresgid(user.gid, user.gid, user.gid) })?;
    // SAFETY: as above. With every uid non-zero, the kernel clears the permitted and effective
    // capabilities (no SECBIT_KEEP_CAPS).
    sys::check(unsafe { libc::setresuid(user.uid, user.uid, user.uid) })?;
    // SAFETY: integer arguments only.
    sys::check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    // SAFETY: must fail now; if it succeeds, root was not dropped.
    if user.uid != 0 && unsafe { libc::setuid(0) } == 0 {
        return Err(io::Error::other(
            "root could be taken back after dropping it",
        ));
    }
    Ok(())
}

/// Everything the init does; an error before the command started comes back with the report
/// fd, so the launcher hears about it.
fn init(
    argv: &[CString],
    log: &CString,
    user: Option<User>,
    report: OwnedFd,
) -> Result<i32, InitError> {
    let report = Some(report);
    let fail = |what: &str, e: io::Error| format!("{what} failed in the new namespaces: {e}");
    macro_rules! try_init {
        ($e:expr) => {
            match $e {
                Ok(v) => v,
                Err(msg) => return Err((msg, report)),
            }
        };
    }
    if argv.is_empty() {
        return Err((LaunchError::NoCommand.to_string(), report));
    }
    try_init!(crate::mount_ns::make_private().map_err(|e| fail("making mounts private", e)));
    // SAFETY: mounts a fresh procfs of the new PID namespace over /proc, in this namespace only.
    try_init!(sys::check(unsafe {
        libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    })
    .map_err(|e| fail("mounting /proc", e)));
    try_init!(sys::loopback_up().map_err(|e| fail("bringing up lo", e)));
    // SAFETY: setsid has no preconditions; PID 1 of a new namespace is never a group leader.
    try_init!(sys::check(unsafe { libc::setsid() }).map_err(|e| fail("setsid", e)));

    // Stdio is opened inside the new mount namespace; every other inherited fd is closed.
    let null = try_init!(
        sys::open(c"/dev/null", libc::O_RDONLY, 0).map_err(|e| fail("opening /dev/null", e))
    );
    let out = try_init!(
        sys::open(log, libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND, 0o644).map_err(
            |e| format!(
                "cannot open the log file {}: {e}; pass --log with a writable path",
                log.to_string_lossy()
            )
        )
    );
    // SAFETY: dup2 onto the standard descriptors; the originals stay owned by `null`/`out`.
    unsafe {
        libc::dup2(null.as_raw_fd(), 0);
        libc::dup2(out.as_raw_fd(), 1);
        libc::dup2(out.as_raw_fd(), 2);
    }
    drop(null);
    drop(out);
    let keep = report.as_ref().map_or(-1, |r| r.as_raw_fd());
    sys::close_fds_from(3, keep);
    // Last: the namespaces and the mounts are built, stdio is open; nothing of the command's
    // has run yet. The init itself runs on as that user too.
    if let Some(u) = user {
        try_init!(drop_root(u).map_err(|e| fail("dropping root", e)));
    }

    let old_mask = supervise::block_all_signals();
    let (exec_rd, exec_wr) = try_init!(sys::pipe_cloexec().map_err(|e| fail("pipe", e)));
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: the init is single-threaded; the child only resets its mask and execs.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err((fail("fork", io::Error::last_os_error()), report));
    }
    if child == 0 {
        supervise::restore_signal_mask(&old_mask);
        // SAFETY: ptrs is a NUL-terminated array of valid C strings that outlive the call.
        unsafe { libc::execvp(ptrs[0], ptrs.as_ptr()) };
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let _ = sys::write_all(&exec_wr, &errno.to_ne_bytes());
        // SAFETY: leave the failed child at once.
        unsafe { libc::_exit(127) };
    }
    drop(exec_wr);
    let exec_result =
        try_init!(sys::read_to_end(&exec_rd).map_err(|e| fail("reading the exec status", e)));
    if let Ok(bytes) = <[u8; 4]>::try_from(exec_result.as_slice()) {
        let e = io::Error::from_raw_os_error(i32::from_ne_bytes(bytes));
        let msg = format!(
            "cannot execute {:?}: {e}; check the command name and PATH",
            argv[0].to_string_lossy()
        );
        return Err((msg, report));
    }
    if let Some(r) = &report {
        try_init!(sys::write_all(r, b"ok").map_err(|e| fail("reporting", e)));
    }
    // The report pipe was the last fd inherited from the launcher: closing it leaves the tree
    // holding nothing that points outside its namespaces.
    drop(report);
    Ok(supervise::supervise(child).unwrap_or(1))
}
