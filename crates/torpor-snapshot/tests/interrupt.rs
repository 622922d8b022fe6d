//! `interrupt`: SIGINT/SIGTERM stay pending until the flag is checked, in every thread started
//! after `install`, so none is taken by a thread that never looks at it.
//!
//! One test, in a binary of its own: `install` changes the calling thread's mask and the flag is
//! global. Signals are sent to this thread only (`raise`): the test harness's other threads do
//! not block them, and a process-wide SIGTERM would end the test binary.

use torpor_snapshot::interrupt;

/// The blocked-signal mask of the calling thread, as the kernel reports it.
fn blocked_here() -> u64 {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("SigBlk:"))
        .expect("SigBlk in /proc/thread-self/status");
    u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
}

fn bit(sig: libc::c_int) -> u64 {
    1 << (sig - 1)
}

fn pending_here(sig: libc::c_int) -> bool {
    // SAFETY: sigset_t is plain data, written by sigpending.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut set);
        libc::sigismember(&set, sig) == 1
    }
}

#[test]
fn a_signal_waits_for_the_check_and_later_threads_cannot_take_it() {
    assert_eq!(interrupt::signal(), None, "nothing taken before install");
    interrupt::install();
    assert_eq!(interrupt::signal(), None, "no signal arrived yet");

    // A thread started afterwards (a hashing pool's, a driver's) blocks both.
    let theirs = std::thread::spawn(blocked_here).join().unwrap();
    for sig in [libc::SIGINT, libc::SIGTERM] {
        assert_ne!(theirs & bit(sig), 0, "a later thread does not block {sig}");
    }

    // SAFETY: raise sends SIGTERM to this thread only, where it is blocked: it stays pending.
    unsafe { libc::raise(libc::SIGTERM) };
    assert!(
        pending_here(libc::SIGTERM),
        "the blocked SIGTERM is pending until checked"
    );
    assert!(interrupt::interrupted());
    assert_eq!(interrupt::signal(), Some(libc::SIGTERM));
    assert!(!pending_here(libc::SIGTERM), "the check took the SIGTERM");

    // The first signal is the one reported; a later one stays pending for whoever waits next.
    // SAFETY: as above.
    unsafe { libc::raise(libc::SIGINT) };
    assert_eq!(interrupt::signal(), Some(libc::SIGTERM));
    assert!(pending_here(libc::SIGINT), "a later signal is left pending");
}
