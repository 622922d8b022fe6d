//! Bringing up `lo` inside another process's network namespace.
//!
//! A network namespace created by CRIU for `--empty-ns net` starts with `lo` down, so a restored
//! process that listens on 127.0.0.1 cannot be reached (connect fails with ENETUNREACH) until
//! `lo` is up. [`set_loopback_up`] does that; call it for the restored root's pid, or set
//! `RestoreRequest::loopback_up` to have it done during CRIU's "setup-namespaces" step.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// A failure to bring `lo` up in a process's network namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// `/proc/<pid>/ns/net` cannot be opened.
    #[error("cannot open {path}: {source}; the process is gone or this needs root")]
    Open { path: PathBuf, source: io::Error },

    /// Joining the namespace failed.
    #[error("cannot enter the network namespace of pid {pid} (errno {errno}): {source}; this needs CAP_SYS_ADMIN (run as root)")]
    Enter {
        pid: i32,
        errno: i32,
        source: io::Error,
    },

    /// The helper socket or the interface ioctl failed inside the namespace.
    #[error("cannot {step} in the network namespace of pid {pid} (errno {errno}): {source}; this needs CAP_NET_ADMIN (run as root)")]
    Interface {
        pid: i32,
        step: &'static str,
        errno: i32,
        source: io::Error,
    },

    /// The helper thread could not be started or died.
    #[error(
        "cannot run the namespace helper thread: {source}; check the thread limit (ulimit -u)"
    )]
    Thread { source: io::Error },
}

/// Sets `lo` up (IFF_UP) in the network namespace of `pid`. Idempotent.
///
/// Runs on a short-lived helper thread that joins the namespace (`setns` changes only the calling
/// thread), so the caller's own namespace is never touched.
pub fn set_loopback_up(pid: i32) -> Result<(), NetnsError> {
    let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
    let ns = File::options()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| NetnsError::Open { path, source })?;
    std::thread::Builder::new()
        .name("torpor-netns".into())
        .spawn(move || loopback_up_in(pid, &ns))
        .map_err(|source| NetnsError::Thread { source })?
        .join()
        .map_err(|_| NetnsError::Thread {
            source: io::Error::other("the helper thread panicked"),
        })?
}

/// On a thread of its own: join `ns`, then set IFF_UP on `lo`.
fn loopback_up_in(pid: i32, ns: &File) -> Result<(), NetnsError> {
    let os_error = || {
        let e = io::Error::last_os_error();
        (e.raw_os_error().unwrap_or(0), e)
    };
    // SAFETY: setns on an open namespace descriptor affects only this (helper) thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let (errno, source) = os_error();
        return Err(NetnsError::Enter { pid, errno, source });
    }
    let interface = |step, (errno, source)| NetnsError::Interface {
        pid,
        step,
        errno,
        source,
    };
    // SAFETY: plain socket creation; the result is checked before use.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(interface("create a socket", os_error()));
    }
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: ifreq is plain data (a name and a union of plain fields); zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the flags of the interface named in `req` into `req`, which is
    // a valid, writable ifreq for the duration of the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } != 0 {
        return Err(interface("read the flags of lo", os_error()));
    }
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads `req` (name and flags), a valid ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } != 0 {
        return Err(interface("set lo up", os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_process_is_named() {
        // pid_max is at most 2^22, so this pid never exists.
        match set_loopback_up(i32::MAX) {
            Err(NetnsError::Open { path, .. }) => {
                assert_eq!(path, PathBuf::from(format!("/proc/{}/ns/net", i32::MAX)))
            }
            other => panic!("expected Open, got {other:?}"),
        }
    }
}
