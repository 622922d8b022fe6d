//! The state directory: its layout, created on first start, and the lock that keeps a second
//! daemon off it.
//!
//! ```text
//! <state>/torpord.lock   a record lock the daemon process holds while it runs; holds its pid
//! <state>/registry.db    SQLite registry (+ -wal, -shm)
//! <state>/snapshots/     base, function and hibernation snapshots
//! <state>/functions/     the deployed functions' directories
//! <state>/logs/          deploy and worker logs
//! <state>/sock/workers.sock  the socket workers connect to (0666, in a directory of its own
//!                        that workers' mount namespaces expose; docs/security.md)
//! <state>/workers.sock   a symlink to it, for workers snapshotted before it moved
//! ```
//! Everything is created mode 0700: snapshots hold process memory. The state directory itself
//! is 0700, so only what a worker's mount namespace binds in of it is reachable by workers
//! (`init`, `preload`, `sock`; crate::launcher::WORKER_STATE_DIRS).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateDirError {
    /// A directory of the layout cannot be created.
    #[error("cannot create state directory {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The lock file cannot be opened or locked.
    #[error("cannot lock state directory {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The filesystem cannot serve: torpord runs each worker's init from the state directory.
    #[error("state directory {path} cannot serve: its filesystem ({fstype} mounted at {mount}) is {what}, and torpord runs workers from it; remount it (mount -o remount,{fix} {mount}) or pass --state-dir on another filesystem")]
    Filesystem {
        path: PathBuf,
        fstype: String,
        mount: String,
        what: &'static str,
        fix: &'static str,
    },
    /// Another daemon holds the lock.
    #[error(
        "state directory {path} is in use by another torpord{}: stop it, or pass --state-dir",
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    InUse { path: PathBuf, pid: Option<i32> },
}

/// The locked state directory; the lock is released when this is dropped.
#[derive(Debug)]
pub struct StateDir {
    root: PathBuf,
    _lock: ProcessLock,
}

/// The state directory's lock: a POSIX record lock (`fcntl(F_SETLK)`) on its whole lock file,
/// not `flock(2)`. A record lock belongs to the process, so a child the daemon forks does not
/// share it: with `flock`, a child between its fork and its exec holds the lock's open file
/// description (close-on-exec closes it only at the exec), and a child stuck there (a fork in
/// a multithreaded process with a CUDA context is one way) kept the next daemon out after this
/// one had died. Record locks do not conflict within one process, so [`HELD`] refuses a second
/// lock of the same file here; and since closing any descriptor of the file drops a process's
/// record locks, the file is opened here only once, before the lock is taken.
#[derive(Debug)]
struct ProcessLock {
    path: PathBuf,
    _file: File,
}

/// Lock files this process holds (see [`ProcessLock`]).
static HELD: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn held() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for ProcessLock {
    fn drop(&mut self) {
        held().retain(|p| p != &self.path);
    }
}

/// `fcntl(F_SETLK | F_GETLK)` with a write lock over the whole file.
fn record_lock(file: &File, cmd: libc::c_int) -> std::io::Result<libc::flock> {
    // SAFETY: an all-zero `flock` is a valid value of the plain C struct.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    // SAFETY: fcntl on a descriptor we own, with a pointer to a live struct.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut l) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l)
}

impl StateDir {
    /// Creates the layout under `root` where missing and takes the lock.
    pub fn open(root: &Path) -> Result<Self, StateDirError> {
        let create = |path: &Path| {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|source| StateDirError::Create {
                    path: path.to_path_buf(),
                    source,
                })
        };
        create(root)?;
        check_filesystem(root)?;
        let lock_path = std::path::absolute(root.join("torpord.lock"))
            .unwrap_or_else(|_| root.join("torpord.lock"));
        let lock_err = |source| StateDirError::Lock {
            path: root.to_path_buf(),
            source,
        };
        let in_use = |pid: Option<i32>| StateDirError::InUse {
            path: root.to_path_buf(),
            pid,
        };
        // Checked and recorded under one guard: two threads of this process never both lock it.
        let mut mine = held();
        if mine.contains(&lock_path) {
            return Err(in_use(Some(std::process::id() as i32)));
        }
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(lock_err)?;
        if let Err(err) = record_lock(&lock, libc::F_SETLK) {
            if matches!(err.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) {
                // The holder as the kernel knows it, else the pid it wrote.
                let pid = record_lock(&lock, libc::F_GETLK)
                    .ok()
                    .filter(|l| l.l_type != libc::F_UNLCK as libc::c_short && l.l_pid > 0)
                    .map(|l| l.l_pid)
                    .or_else(|| {
                        let mut text = String::new();
                        lock.read_to_string(&mut text).ok()?;
                        text.trim().parse().ok()
                    });
                return Err(in_use(pid));
            }
            return Err(lock_err(err));
        }
        lock.set_len(0).map_err(lock_err)?;
        lock.rewind().map_err(lock_err)?;
        writeln!(lock, "{}", std::process::id()).map_err(lock_err)?;
        mine.push(lock_path.clone());
        drop(mine);
        let dir = Self {
            root: root.to_path_buf(),
            _lock: ProcessLock {
                path: lock_path,
                _file: lock,
            },
        };
        for sub in [dir.snapshots(), dir.functions(), dir.logs()] {
            create(&sub)?;
        }
        // What workers reach (bound into their mount namespaces): others may enter and read.
        for sub in ["sock", "init", crate::split::HOOK_COPY_DIR] {
            let path = root.join(sub);
            create(&path)?;
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .map_err(|source| StateDirError::Create {
                    path: path.clone(),
                    source,
                })?;
        }
        link_old_workers_socket(root)?;
        Ok(dir)
    }

    /// The state directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The SQLite registry.
    pub fn registry(&self) -> PathBuf {
        self.root.join("registry.db")
    }

    /// Where snapshots live.
    pub fn snapshots(&self) -> PathBuf {
        self.root.join("snapshots")
    }

    /// Where deployed functions' directories live.
    pub fn functions(&self) -> PathBuf {
        self.root.join("functions")
    }

    /// Deploy and worker logs.
    pub fn logs(&self) -> PathBuf {
        self.root.join("logs")
    }

    /// The key that seals every snapshot this daemon writes (mode 0600; docs/torpord.md,
    /// "Snapshot authentication").
    pub fn snapshot_key(&self) -> PathBuf {
        self.root.join(torpor_image::SNAPSHOT_KEY_FILE)
    }

    /// The socket workers connect to (docs/torpord.md, "Worker ⇄ daemon protocol").
    pub fn workers_socket(&self) -> PathBuf {
        self.root.join("sock").join("workers.sock")
    }
}

/// `<state>/workers.sock`, where workers snapshotted before the socket moved to `sock/` connect:
/// a symlink to the socket (a socket file a daemon of before left there is replaced).
fn link_old_workers_socket(root: &Path) -> Result<(), StateDirError> {
    let old = root.join("workers.sock");
    let target = Path::new("sock/workers.sock");
    let fail = |source| StateDirError::Create {
        path: old.clone(),
        source,
    };
    match std::fs::read_link(&old) {
        Ok(t) if t == target => return Ok(()),
        Ok(_) => std::fs::remove_file(&old).map_err(fail)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // Not a symlink: the socket of a daemon of before (the state directory is locked).
        Err(_) => std::fs::remove_file(&old).map_err(fail)?,
    }
    std::os::unix::fs::symlink(target, &old).map_err(fail)
}

/// Refuses a filesystem a worker cannot be run from (read-only, noexec). Any other works:
/// ext4, xfs, tmpfs, a bind mount — workers reach the state directory through a bind mount
/// CRIU leaves out of every snapshot (docs/mounts.md).
fn check_filesystem(root: &Path) -> Result<(), StateDirError> {
    let st = torpor_snapshot::space::statvfs(root).map_err(|source| StateDirError::Create {
        path: root.to_path_buf(),
        source,
    })?;
    let (what, fix) = if st.f_flag & libc::ST_RDONLY != 0 {
        ("read-only", "rw")
    } else if st.f_flag & libc::ST_NOEXEC != 0 {
        ("mounted noexec", "exec")
    } else {
        return Ok(());
    };
    let path = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    let table = torpor_snapshot::mounts::parse(
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    );
    let (fstype, mount) = torpor_snapshot::mounts::containing(&path, &table)
        .map(|m| (m.fstype.clone(), m.point.clone()))
        .unwrap_or_else(|| ("unknown".into(), "/".into()));
    Err(StateDirError::Filesystem {
        path: root.to_path_buf(),
        fstype,
        mount,
        what,
        fix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn layout_is_created_private_and_locked() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("state");
        let dir = StateDir::open(&root).unwrap();
        for p in [
            dir.root().to_path_buf(),
            dir.snapshots(),
            dir.functions(),
            dir.logs(),
        ] {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", p.display());
        }
        let err = StateDir::open(&root).unwrap_err();
        let pid = std::process::id() as i32;
        assert!(
            matches!(err, StateDirError::InUse { pid: Some(p), .. } if p == pid),
            "{err}"
        );
        drop(dir);
        // At once, whatever children other test threads fork meanwhile (a record lock is the
        // process's, not shared with them).
        StateDir::open(&root).unwrap();
    }

    #[test]
    fn a_child_forked_by_the_daemon_does_not_keep_the_lock_after_the_daemon_lets_go() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("state");
        let dir = StateDir::open(&root).unwrap();
        // Another process is refused while this one holds it (Python's lockf is F_SETLK too).
        let try_other = || {
            std::process::Command::new("python3")
                .args([
                    "-c",
                    "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'r+'), fcntl.LOCK_EX | fcntl.LOCK_NB)",
                ])
                .arg(root.join("torpord.lock"))
                .stderr(std::process::Stdio::null())
                .status()
                .map(|s| s.success())
        };
        assert!(
            !try_other().unwrap(),
            "another process took the lock while it was held"
        );
        // A child forked and never exec'd, as a child stuck before its exec is: it has every
        // descriptor of the daemon, the lock file's included.
        // SAFETY: the child only calls pause(2), async-signal-safe, until it is killed.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", std::io::Error::last_os_error());
        if child == 0 {
            loop {
                // SAFETY: pause has no arguments and touches no memory.
                unsafe { libc::pause() };
            }
        }
        drop(dir);
        let other = try_other();
        let again = StateDir::open(&root);
        // SAFETY: signalling and reaping our own child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        // Nothing above panics while the child lives: an orphan holding the test's output
        // pipe would keep the test runner waiting.
        let other = other.unwrap();
        let again = again.expect("the lock was kept by the forked child");
        drop(again);
        assert!(
            other,
            "another process could not take the lock the daemon let go of"
        );
    }

    #[test]
    fn a_noexec_filesystem_is_refused_with_the_fix() {
        if !torpor_snapshot::is_root() {
            eprintln!("skipped: needs root to mount a tmpfs");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let point = tmp.path().join("noexec");
        std::fs::create_dir(&point).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "noexec,size=1m", "tmpfs"])
            .arg(&point)
            .status()
            .unwrap();
        assert!(ok.success());
        let err = StateDir::open(&point.join("state")).unwrap_err();
        let _ = std::process::Command::new("umount").arg(&point).status();
        let msg = err.to_string();
        assert!(matches!(err, StateDirError::Filesystem { .. }), "{msg}");
        assert!(msg.contains("mounted noexec"), "{msg}");
        assert!(
            msg.contains(&format!("mount -o remount,exec {}", point.display())),
            "{msg}"
        );
    }
}
