//! Ctrl-C during a snapshot or restore: the signal only raises a flag. The operation checks it
//! between steps and rolls back, so the source process keeps running and no half-made snapshot
//! is left behind. CRIU runs in its own process group, so the terminal's SIGINT never reaches it
//! in the middle of a dump (which could leave its parasite code inside the target).
//!
//! SIGINT and SIGTERM are blocked rather than handled, and taken when the flag is checked. A
//! handler runs on whichever thread the kernel picks, a thread of a library's pool included;
//! blocked in every thread, a signal stays pending on the process until this module (or
//! [`crate::supervise`]) takes it, so none is lost to a thread that does not look for it.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The SIGINT/SIGTERM taken, 0 for none.
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether [`install`] ran: only then are the signals blocked, so only then is taking one ours.
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn interrupt_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset only write to it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks SIGINT and SIGTERM, so that they wait for [`signal`]. Call it before the process
/// starts any thread (threads inherit the mask; one started earlier could still take them).
pub fn install() {
    let set = interrupt_set();
    // SAFETY: set is a valid sigset_t; the old mask is not wanted.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    INSTALLED.store(true, Ordering::SeqCst);
}

/// Whether SIGINT or SIGTERM arrived since [`install`].
pub fn interrupted() -> bool {
    signal().is_some()
}

/// The first SIGINT/SIGTERM that arrived since [`install`], if any. Taking it removes it from
/// the pending signals: whoever sees `Some` owns it (and forwards it, if it must go on).
pub fn signal() -> Option<libc::c_int> {
    if SIGNAL.load(Ordering::SeqCst) == 0 && INSTALLED.load(Ordering::SeqCst) {
        let set = interrupt_set();
        let now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: set and now are valid; a null info pointer is allowed. A zero timeout only
        // polls: it takes a pending signal of the set or fails with EAGAIN.
        let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &now) };
        if sig > 0 {
            let _ = SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
        }
    }
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}
