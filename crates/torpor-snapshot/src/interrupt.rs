//! Ctrl-C during a snapshot or restore: the signal only raises a flag. The operation checks it
//! between steps and rolls back, so the source process keeps running and no half-made snapshot
//! is left behind. CRIU runs in its own process group, so the terminal's SIGINT never reaches it
//! in the middle of a dump (which could leave its parasite code inside the target).

use std::sync::atomic::{AtomicI32, Ordering};

/// The last SIGINT/SIGTERM received, 0 for none.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Routes SIGINT and SIGTERM to the flag (with SA_RESTART, so blocking calls carry on).
pub fn install() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction is plain data; the handler only stores to an atomic, which is
        // async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// Whether SIGINT or SIGTERM arrived since [`install`].
pub fn interrupted() -> bool {
    signal().is_some()
}

/// The last SIGINT/SIGTERM received since [`install`], if any.
pub fn signal() -> Option<libc::c_int> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}
