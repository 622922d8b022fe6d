//! Thin, checked wrappers over the few libc calls the launcher and supervisor need.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Turns a libc return value into `io::Result`, reading errno on -1.
pub(crate) fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

pub(crate) fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Writes all of `buf`, retrying on EINTR. Usable after fork (no allocation).
pub(crate) fn write_all(fd: &OwnedFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: buf points to initialised memory of the given length.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Reads until EOF (the writer closed or exec'd), retrying on EINTR.
pub(crate) fn read_to_end(fd: &OwnedFd) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        // SAFETY: buf is a valid writable buffer of the given length.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(out);
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
}

pub(crate) fn open(path: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: path is a valid NUL-terminated string.
    let fd =
        check(unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC, mode as libc::c_uint) })?;
    // SAFETY: open succeeded; we own the new fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Closes every fd from `first` up, except `keep`.
pub(crate) fn close_fds_from(first: RawFd, keep: RawFd) {
    let ranges = [(first, keep - 1), (keep + 1, RawFd::MAX)];
    for (lo, hi) in ranges {
        if lo <= hi {
            // SAFETY: close_range only closes descriptors; nothing in this process refers to
            // the closed ones afterwards (the caller is a freshly forked child).
            unsafe {
                libc::syscall(
                    libc::SYS_close_range,
                    lo as libc::c_uint,
                    hi as libc::c_uint,
                    0,
                )
            };
        }
    }
}

/// Sets the flags of the loopback interface to up in the current network namespace, so a
/// process can use 127.0.0.1 there (a new network namespace starts with `lo` down).
pub(crate) fn loopback_up() -> io::Result<()> {
    // SAFETY: plain socket creation.
    let sock =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: socket succeeded; we own it.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the flags of the named interface into req.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: the ioctl above filled the flags member of the union.
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: SIOCSIFFLAGS reads req, which holds the name and the new flags.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

/// Whether the calling process runs as root (namespaces and CRIU need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Sends `sig` to `pid`, ignoring "no such process".
pub(crate) fn kill(pid: i32, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(pid, sig) };
}

/// Milliseconds since the Unix epoch, for unique log file names.
pub(crate) fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// What waiting for a traced thread found.
pub(crate) enum TraceeStop {
    /// In a ptrace stop: its signal and its ptrace event (0 for none).
    Stopped {
        signal: libc::c_int,
        event: libc::c_int,
    },
    /// It exited or was killed.
    Gone,
}

/// Waits for the next stop of traced thread `tid` (`__WALL`: threads too), retrying on EINTR.
pub(crate) fn wait_tracee(tid: i32) -> io::Result<TraceeStop> {
    loop {
        let mut status = 0;
        // SAFETY: status is a valid int to write.
        let rc = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Ok(TraceeStop::Gone);
        }
        if libc::WIFSTOPPED(status) {
            return Ok(TraceeStop::Stopped {
                signal: libc::WSTOPSIG(status),
                event: status >> 16,
            });
        }
    }
}
