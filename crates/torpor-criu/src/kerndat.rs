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
//! never waits for a `criu check`. A dump of a root tree does the same under the same condition
//! ([`crate::DumpRequest::private_run`]): CRIU's probes otherwise run inside the stop of every
//! leave-running snapshot.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
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

// The new mount API (include/uapi/linux/mount.h; not in the libc crate's Linux module).
const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;
const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

/// The cache as `criu check` writes it, into a tmpfs that no mount namespace but `criu
/// check`'s own ever holds: made detached (`fsmount`), attached at `/run` only in the child's
/// private namespace, read back through its descriptor. Until session 49 it was mounted on a
/// temporary directory of the host and unmounted after; a daemon killed during the check
/// (crash tests do that) left the mount behind for good: 37 of them on the development VM.
fn make(criu: &Criu) -> io::Result<Vec<u8>> {
    let mount = detached_tmpfs()?;
    run_check(criu, mount.as_raw_fd())?;
    // SAFETY: openat(2) of a name inside the tmpfs's root, which `mount` holds open.
    let fd = unsafe {
        libc::openat(
            mount.as_raw_fd(),
            c"criu.kdat".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is the fresh descriptor above, owned from here.
    let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut file, &mut bytes)?;
    Ok(bytes)
}

/// A 1 MiB tmpfs (nosuid, nodev, noexec, mode 0700) mounted nowhere: its root's descriptor.
/// Its source names this process (`torpor-criu-kdat-PID`), should a mount table ever show it.
fn detached_tmpfs() -> io::Result<OwnedFd> {
    let source = std::ffi::CString::new(source_name()).map_err(io::Error::other)?;
    let fd = |r: libc::c_long| -> io::Result<OwnedFd> {
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the system call just returned, owned from here.
        Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
    };
    // SAFETY: fsopen/fsconfig/fsmount with valid C strings; each descriptor is owned at once.
    unsafe {
        let fs = fd(libc::syscall(
            libc::SYS_fsopen,
            c"tmpfs".as_ptr(),
            FSOPEN_CLOEXEC,
        ))?;
        for (key, value) in [
            (c"source", source.as_c_str()),
            (c"size", c"1m"),
            (c"mode", c"0700"),
        ] {
            let r = libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                FSCONFIG_SET_STRING,
                key.as_ptr(),
                value.as_ptr(),
                0,
            );
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let r = libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_void>(),
            0,
        );
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        fd(libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        ))
    }
}

/// The source name the cache's tmpfs had before session 49, mounted on a host directory.
const LEAKED_SOURCE: &str = "torpor-criu-kdat";

/// Unmounts what a Torpor older than session 49 left in this mount namespace when it was killed
/// while making the cache: tmpfs mounts named [`LEAKED_SOURCE`] on `.tmp*` directories of the
/// temporary directory (the directory is removed too). This version never mounts one there, so
/// any such mount is a leftover. Returns how many went.
pub fn remove_leaked_cache_mounts() -> usize {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return 0;
    };
    let tmp = std::env::temp_dir();
    let mut removed = 0;
    for line in table.lines() {
        // `... MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut after = right.split_whitespace();
        if after.next() != Some("tmpfs") || after.next() != Some(LEAKED_SOURCE) {
            continue;
        }
        let Some(point) = left.split_whitespace().nth(4) else {
            continue;
        };
        let point = std::path::Path::new(point);
        let leftover = point.parent() == Some(tmp.as_path())
            && point
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".tmp"));
        if !leftover {
            continue;
        }
        let Ok(c_point) = std::ffi::CString::new(point.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: umount2(2) of a path, lazily; nothing of ours is under it.
        if unsafe { libc::umount2(c_point.as_ptr(), libc::MNT_DETACH) } == 0 {
            let _ = std::fs::remove_dir(point);
            removed += 1;
        }
    }
    removed
}

fn source_name() -> String {
    format!("torpor-criu-kdat-{}", std::process::id())
}

fn run_check(criu: &Criu, run: RawFd) -> io::Result<()> {
    let mut cmd = criu.command();
    cmd.arg("check")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: the closure runs in the forked child before exec and makes only unshare, mount
    // and move_mount system calls (async-signal-safe) with static strings and a descriptor
    // number; the mount it attaches exists in the child's namespace only.
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
            check(libc::syscall(
                libc::SYS_move_mount,
                run,
                c"".as_ptr(),
                libc::AT_FDCWD,
                c"/run".as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            ) as libc::c_int)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Mounts in our namespace made by this process's cache (other processes may be making
    /// theirs meanwhile).
    fn our_kdat_mounts() -> usize {
        let ours = format!(" - tmpfs {} ", source_name());
        std::fs::read_to_string("/proc/self/mountinfo")
            .expect("mountinfo")
            .lines()
            .filter(|l| l.contains(&ours))
            .count()
    }

    #[test]
    fn the_cache_is_made_without_a_mount_in_our_namespace_even_while_the_check_runs() {
        // SAFETY: geteuid(2) reads this process's id.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: needs root (mount namespaces)");
            return;
        }
        // A stand-in for `criu check` that writes its cache where CRIU does and takes its time.
        let criu = Criu::unchecked(
            "/bin/sh",
            vec![
                "-c".into(),
                "printf cache > /run/criu.kdat && sleep 1".into(),
                "sh".into(),
            ],
        );
        let host_had_one = std::path::Path::new("/run/criu.kdat").exists();
        let making = std::thread::spawn(move || make(&criu));
        std::thread::sleep(std::time::Duration::from_millis(400));
        // While it runs, nothing is mounted here: a caller killed now leaves nothing behind.
        assert_eq!(our_kdat_mounts(), 0);
        let cache = making
            .join()
            .expect("thread")
            .expect("the stand-in wrote a cache");
        assert_eq!(cache, b"cache");
        assert_eq!(our_kdat_mounts(), 0);
        assert_eq!(
            std::path::Path::new("/run/criu.kdat").exists(),
            host_had_one
        );
    }

    #[test]
    fn mounts_an_older_torpor_left_behind_are_removed_and_others_kept() {
        // SAFETY: geteuid(2) reads this process's id.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: needs root (mount)");
            return;
        }
        let mount = |dir: &std::path::Path, source: &std::ffi::CStr| {
            let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).expect("path");
            // SAFETY: mounts a tmpfs on a fresh directory of this test.
            let r = unsafe {
                libc::mount(
                    source.as_ptr(),
                    path.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    c"size=64k".as_ptr().cast(),
                )
            };
            assert_eq!(r, 0, "{}", io::Error::last_os_error());
        };
        // What the old code left: its name, on a `.tmp*` directory of the temporary directory.
        let leaked = tempfile::Builder::new()
            .prefix(".tmp")
            .tempdir()
            .expect("tempdir");
        let leaked = leaked.keep();
        mount(&leaked, c"torpor-criu-kdat");
        // The same name elsewhere, and another tmpfs there: not ours to touch.
        let elsewhere = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        mount(elsewhere.path(), c"torpor-criu-kdat");
        let other = tempfile::Builder::new()
            .prefix(".tmp")
            .tempdir()
            .expect("tempdir");
        mount(other.path(), c"someone-else");

        assert!(remove_leaked_cache_mounts() >= 1);
        let table = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let mounted = |p: &std::path::Path| {
            table
                .lines()
                .any(|l| l.split_whitespace().nth(4) == p.to_str())
        };
        assert!(!mounted(&leaked) && !leaked.exists(), "the leftover stayed");
        assert!(
            mounted(elsewhere.path()),
            "a mount outside the temporary directory went"
        );
        assert!(mounted(other.path()), "another tmpfs went");
        for p in [elsewhere.path(), other.path()] {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("path");
            // SAFETY: unmounts what this test mounted.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }

    #[test]
    fn the_real_criu_check_writes_a_cache() {
        // SAFETY: geteuid(2) reads this process's id.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP: needs root (criu check, mount namespaces)");
            return;
        }
        let Ok(criu) = crate::locate() else {
            eprintln!("SKIP: no CRIU (make criu)");
            return;
        };
        let cache = make(&criu).expect("criu check writes its cache");
        assert!(cache.len() > 64, "a cache of {} bytes", cache.len());
        // That it is the cache CRIU loads: tests/dump_restore.rs, `..._skips_crius_kernel_probes_...`.
    }
}
