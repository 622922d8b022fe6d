//! Dumping a tree that runs as a user other than root (torpord's unprivileged workers).
//!
//! CRIU reads every dumped task's resource limits with `prlimit(pid, …)`, which the kernel allows
//! only to a process holding CAP_SYS_RESOURCE or whose *real* uid and gid are the task's. Root
//! lacks CAP_SYS_RESOURCE in some containers (this project's CI machine), so the dump runs CRIU
//! with the tree's real ids and root's effective and saved ones (every capability kept).
//!
//! One thing then breaks: CRIU's start-up probes of the kernel (kerndat) call libnftables, which
//! exits (status 111) in any process whose real and effective uids differ. A CRIU that finds its
//! cache of those probes (`/run/criu.kdat`) skips them; CRIU only writes that cache on a tmpfs,
//! and `/run` is none here. So: one `criu check` as root, in a mount namespace of its own whose
//! `/run` is a fresh tmpfs, makes the cache ([`cache`], once per process); each such dump runs in
//! a mount namespace of its own whose `/run` is a tmpfs holding that cache
//! ([`crate::swrk`]). The host's `/run` is never written.
//!
//! Restores use the same cache for speed: without it every CRIU run probes the kernel again,
//! 67 ms of the 0.26 s a lazy restore of a GPT-2-Large worker took on the H100 (most of it
//! creating and tearing down network namespaces; `/run` is no tmpfs there either, nor in most
//! containers). A restore runs CRIU with such a `/run` only when its tree reaches nothing in the
//! host's `/run` ([`crate::RestoreRequest::private_run`]) and this process already made the
//! cache ([`crate::Criu::prepare_kernel_cache`], which torpord calls once at start): a restore
//! never waits for a `criu check`.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use crate::error::CriuError;
use crate::locate::Criu;

/// Where CRIU reads its cache (root's).
pub(crate) const CACHE_FILE: &std::ffi::CStr = c"/run/criu.kdat";

/// How CRIU's process is set up before it runs: a `/run` of its own holding `cache`, and for a
/// dump of a tree that is not root's, that tree's real ids.
#[derive(Clone)]
pub(crate) struct OwnRun {
    pub ids: Option<(u32, u32)>,
    pub cache: Arc<Vec<u8>>,
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The cache, once this process made it.
static CACHE: Mutex<Option<Arc<Vec<u8>>>> = Mutex::new(None);

/// The cache if this process made it already ([`cache`]); a restore never makes one.
pub(crate) fn cached() -> Option<Arc<Vec<u8>>> {
    CACHE.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// CRIU's kernel-feature cache as a `criu check` run as root writes it; made once per process.
pub(crate) fn cache(criu: &Criu, uid: u32) -> Result<Arc<Vec<u8>>, CriuError> {
    let mut held = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = held.as_ref() {
        return Ok(Arc::clone(c));
    }
    let fail = |detail: String| CriuError::KernelCache { uid, detail };
    let made = make(criu).map_err(|e| fail(e.to_string()))?;
    let made = Arc::new(made);
    *held = Some(Arc::clone(&made));
    Ok(made)
}

fn make(criu: &Criu) -> io::Result<Vec<u8>> {
    let dir = tempfile::tempdir()?;
    let path = CString::new(dir.path().as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: mounts a tmpfs on our own fresh temporary directory; all strings are valid.
    check(unsafe {
        libc::mount(
            c"torpor-criu-kdat".as_ptr(),
            path.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"size=1m,mode=0700".as_ptr().cast(),
        )
    })?;
    let made = run_check(criu, &path).and_then(|()| std::fs::read(dir.path().join("criu.kdat")));
    // SAFETY: detaches the tmpfs mounted above.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    made
}

fn run_check(criu: &Criu, run: &CString) -> io::Result<()> {
    let run = run.clone();
    let mut cmd = criu.command();
    cmd.arg("check")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the closure runs in the forked child before exec and makes only unshare and mount
    // system calls (async-signal-safe) on strings allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                run.as_ptr(),
                c"/run".as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ))
        });
    }
    let status = cmd.status()?;
    if !status.success() {
        return Err(io::Error::other(format!("`criu check` failed ({status})")));
    }
    Ok(())
}

/// In CRIU's child before `execve` (crate::spawn: it shares the caller's memory, so raw system
/// calls only, nothing allocated, failures as an errno): a mount
/// namespace of its own whose `/run` is a tmpfs holding `cache`, then the tree's real ids if
/// there are any.
pub(crate) fn enter(t: &OwnRun) -> io::Result<()> {
    // SAFETY: system calls on this (forked, single-threaded) child only; every pointer is to
    // memory allocated before the fork.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS))?;
        check(libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(
            c"torpor-criu-kdat".as_ptr(),
            c"/run".as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"size=1m,mode=0755".as_ptr().cast(),
        ))?;
        let fd = libc::open(
            CACHE_FILE.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let wrote = libc::write(fd, t.cache.as_ptr().cast(), t.cache.len());
        libc::close(fd);
        if wrote != t.cache.len() as isize {
            // An errno, not a message: this runs where nothing may allocate (crate::spawn).
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        if let Some((uid, gid)) = t.ids {
            // u32::MAX: "leave unchanged" (the effective and saved ids stay root's). Raw
            // system calls: glibc's wrappers would change the ids of every thread of the
            // process, and this child shares the caller's memory and so its thread list.
            check(libc::syscall(libc::SYS_setresgid, gid, u32::MAX, u32::MAX) as libc::c_int)?;
            check(libc::syscall(libc::SYS_setresuid, uid, u32::MAX, u32::MAX) as libc::c_int)?;
        }
    }
    Ok(())
}
