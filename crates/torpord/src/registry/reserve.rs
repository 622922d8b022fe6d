//! Room for the registry's critical writes on a full disk: a preallocated file beside the
//! database (`registry.reserve`), deleted to free its blocks when a write fails for want of
//! space, so that the write tried again (removing an instance that is gone, ending a journal)
//! completes and the registry never lists a process that no longer exists. It is made again
//! once the filesystem has room for it.
//!
//! `posix_fallocate` allocates the blocks for real (a sparse `set_len` would free nothing).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bytes kept in reserve: far more than the WAL frames of a few row deletes need.
pub const RESERVE_BYTES: u64 = 8 << 20;
/// How often a missing reserve is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(5);

/// The reserve file of one registry.
#[derive(Debug)]
pub struct Reserve {
    path: PathBuf,
    bytes: u64,
    /// When making it last failed (then it is not tried again before [`RETRY_EVERY`]).
    failed_at: Mutex<Option<Instant>>,
}

impl Reserve {
    /// The reserve beside the database at `db`; made now if there is room.
    pub fn beside(db: &Path, bytes: u64) -> Self {
        let mut name = db.file_stem().unwrap_or_default().to_os_string();
        name.push(".reserve");
        let r = Self {
            path: db.with_file_name(name),
            bytes,
            failed_at: Mutex::new(None),
        };
        if let Err(e) = r.make() {
            tracing::warn!(path = %r.path.display(), error = %e, "cannot set aside the registry's disk reserve: on a full disk its writes may fail; free space in the state directory");
        }
        r
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the reserve is in place (allocated in full).
    pub fn held(&self) -> bool {
        std::fs::metadata(&self.path).is_ok_and(|m| m.len() == self.bytes)
    }

    /// Allocates the file in full, or removes what was allocated of it.
    fn make(&self) -> std::io::Result<()> {
        if self.held() {
            return Ok(());
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.path)?;
        let len = libc::off_t::try_from(self.bytes).unwrap_or(libc::off_t::MAX);
        // SAFETY: posix_fallocate on a file descriptor we own; it touches no memory of ours.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
        if rc != 0 {
            drop(file);
            let _ = std::fs::remove_file(&self.path);
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        file.sync_all()
    }

    /// Frees the reserve's blocks; whether there was one to free.
    pub fn release(&self) -> bool {
        // Marked before the unlink, under the lock restore_if_missing takes: a registry query
        // of another task that succeeds meanwhile must not make the reserve again and take the
        // blocks back before the write they were freed for (seen in CI: "the reserve is back"
        // 0.3 ms after the release, then that write failed). The earliest remake is
        // RETRY_EVERY from now.
        let mut failed_at = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
        if std::fs::remove_file(&self.path).is_err() {
            return false;
        }
        *failed_at = Some(Instant::now());
        drop(failed_at);
        // ext4 hands blocks freed by an unlink out again only once its journal has committed
        // the unlink (every few seconds on its own), so the write tried next could still find
        // the disk full; syncing the directory commits it now.
        if let Some(dir) = self.path.parent() {
            if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
                tracing::warn!(path = %dir.display(), error = %e, "cannot sync the state directory after releasing the registry's disk reserve");
            }
        }
        tracing::warn!(path = %self.path.display(), bytes = self.bytes, "the state directory's filesystem is full: released the registry's disk reserve so its writes complete; free space there");
        true
    }

    /// Makes the reserve again if it is missing and was neither tried nor released within the
    /// last few seconds.
    pub fn restore_if_missing(&self) {
        if self.held() {
            return;
        }
        let mut failed_at = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
        if failed_at.is_some_and(|t| t.elapsed() < RETRY_EVERY) {
            return;
        }
        match self.make() {
            Ok(()) => {
                *failed_at = None;
                tracing::info!(path = %self.path.display(), "the registry's disk reserve is back");
            }
            Err(_) => *failed_at = Some(Instant::now()),
        }
    }
}

/// Whether `e` says the disk (or the database's size limit) is full.
pub fn is_disk_full(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_allocated_released_and_made_again() {
        let tmp = tempfile::tempdir().unwrap();
        let r = Reserve::beside(&tmp.path().join("registry.db"), 1 << 20);
        assert_eq!(r.path(), tmp.path().join("registry.reserve"));
        assert!(r.held());
        use std::os::unix::fs::MetadataExt;
        // Allocated, not sparse: 512-byte blocks for the whole length.
        assert!(std::fs::metadata(r.path()).unwrap().blocks() * 512 >= 1 << 20);
        assert!(r.release());
        assert!(!r.held());
        assert!(!r.release());
        // Not at once: the write the blocks were freed for comes first.
        r.restore_if_missing();
        assert!(!r.held());
        *r.failed_at.lock().unwrap() = Some(Instant::now() - RETRY_EVERY);
        r.restore_if_missing();
        assert!(r.held());
    }
}
