//! Waiting for a child while forwarding signals to it: the loop of the init that `torpor run`
//! puts at PID 1, and of `torpor restore` without `--detach`.
//!
//! All signals are blocked and taken with `sigwaitinfo`, so this works for PID 1 of a PID
//! namespace (which the kernel would otherwise not deliver default-action signals to), and it
//! keeps working after CRIU restores the process in the middle of the wait.

use std::io;

/// Signals passed on to the child; everything else the supervisor takes for itself.
const FORWARDED: [libc::c_int; 8] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
    libc::SIGCONT,
];

/// Blocks every signal in the calling thread and returns the previous mask, so a forked child
/// can restore it before exec. Threads started afterwards inherit the mask; call it before the
/// process starts any, or one of them could take (and lose) a signal meant for [`supervise`].
pub fn block_all_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigfillset/sigprocmask only write the given sets.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::sigprocmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

/// Restores a signal mask returned by [`block_all_signals`].
pub fn restore_signal_mask(mask: &libc::sigset_t) {
    // SAFETY: mask is a valid sigset_t.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
}

/// Converts a wait status into a shell-style exit code (128 + signal for a killed child).
pub fn exit_code(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

/// Waits until `child` exits, forwarding the usual termination and job-control signals to it and
/// reaping every other child that exits meanwhile (orphans re-parented to PID 1). Signals must
/// already be blocked in every thread of the process (see [`block_all_signals`]): the kernel
/// gives a process's signal to any thread that does not block it. Returns the child's exit code.
pub fn supervise(child: i32) -> io::Result<i32> {
    // SAFETY: sigset_t is plain data, filled by sigfillset.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: all is a valid sigset_t.
    unsafe { libc::sigfillset(&mut all) };
    // The child may have exited before signals were blocked, its SIGCHLD discarded.
    if let Some(code) = reap(child)? {
        return Ok(code);
    }
    loop {
        // SAFETY: all is a valid set; a null info pointer is allowed.
        let sig = unsafe { libc::sigwaitinfo(&all, std::ptr::null_mut()) };
        if sig < 0 {
            let e = io::Error::last_os_error();
            // EINTR also arrives once after CRIU restores a process that was waiting here.
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if sig == libc::SIGCHLD {
            if let Some(code) = reap(child)? {
                return Ok(code);
            }
        } else if FORWARDED.contains(&sig) {
            crate::sys::kill(child, sig);
        }
    }
}

/// Reaps every exited child; returns the exit code if `child` was among them.
fn reap(child: i32) -> io::Result<Option<i32>> {
    let mut result = None;
    loop {
        let mut status = 0;
        // SAFETY: status is a valid out-pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid == 0 {
            return Ok(result);
        }
        if pid < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ECHILD) {
                return Ok(result.or(Some(1)));
            }
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if pid == child {
            result = Some(exit_code(status));
        }
    }
}
