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

/// A held lock; dropping it closes the descriptor, which releases the lock. The kernel releases
/// it too when the holder dies, so a crashed writer never blocks GC for good.
#[derive(Debug)]
pub(crate) struct StoreLock {
    _file: File,
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
            return Ok(Some(StoreLock { _file: file }));
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
}
