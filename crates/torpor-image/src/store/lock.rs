//! The store's lock file: writers share it, garbage collection holds it alone (flock(2)).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::store::error::{io_error, StoreError};

/// Who holds the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Writers (put, commit, release): any number at once.
    Shared,
    /// Garbage collection: nobody else.
    Exclusive,
}

/// A held lock; dropping it unlocks and closes the descriptor. The kernel releases it too when
/// the holder dies, so a crashed writer never blocks GC for good.
///
/// The unlock is explicit because a flock belongs to the open file description, which a child
/// forked meanwhile shares until it execs (the descriptor is close-on-exec) or exits: a close
/// alone would leave the lock held by that child (a restore's helper stuck between fork and
/// exec kept GC out). `LOCK_UN` on the description releases it for every copy.
#[derive(Debug)]
pub(crate) struct StoreLock {
    file: File,
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        // SAFETY: flock only reads the descriptor, which `self.file` keeps open for the call.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Takes the lock at `path` in `mode`. With `wait` false, returns `None` when it is held in a
/// conflicting mode instead of waiting.
///
/// flock locks belong to the open file description, so two `StoreLock`s in one process conflict
/// like two processes do: a GC thread waits for the writer threads of its own process.
pub(crate) fn lock(path: &Path, mode: Mode, wait: bool) -> Result<Option<StoreLock>, StoreError> {
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| io_error("open the lock file", path, e))?;
    let mut op = match mode {
        Mode::Shared => libc::LOCK_SH,
        Mode::Exclusive => libc::LOCK_EX,
    };
    if !wait {
        op |= libc::LOCK_NB;
    }
    loop {
        // SAFETY: flock only reads the descriptor, which `file` keeps open for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(Some(StoreLock { file }));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) if !wait => return Ok(None),
            _ => return Err(io_error("lock", path, err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_holders_exclude_the_exclusive_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        let a = lock(&path, Mode::Shared, false)
            .expect("lock")
            .expect("free");
        let b = lock(&path, Mode::Shared, false)
            .expect("lock")
            .expect("shared");
        assert!(lock(&path, Mode::Exclusive, false).expect("lock").is_none());
        drop(a);
        assert!(lock(&path, Mode::Exclusive, false).expect("lock").is_none());
        drop(b);
        let x = lock(&path, Mode::Exclusive, false)
            .expect("lock")
            .expect("free");
        assert!(lock(&path, Mode::Shared, false).expect("lock").is_none());
        drop(x);
        assert!(lock(&path, Mode::Shared, true).expect("lock").is_some());
    }

    #[test]
    fn a_child_forked_while_the_lock_was_held_does_not_keep_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        let held = lock(&path, Mode::Shared, false)
            .expect("lock")
            .expect("free");
        // SAFETY: the child only sleeps and exits (async-signal-safe calls), as a child between
        // fork and exec would hold the descriptor.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", io::Error::last_os_error());
        if child == 0 {
            // SAFETY: sleep and _exit are async-signal-safe; the child touches nothing else.
            unsafe {
                libc::sleep(30);
                libc::_exit(0);
            }
        }
        drop(held);
        let free = lock(&path, Mode::Exclusive, false).expect("lock");
        // SAFETY: `child` is this test's own child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        assert!(
            free.is_some(),
            "the forked child kept the lock after its holder let go"
        );
    }
}
