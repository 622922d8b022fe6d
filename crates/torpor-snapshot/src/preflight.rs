//! Checks done before anything is stopped, each failing with the cause and the fix.

use std::path::Path;

use torpor_criu::{Criu, CriuError};

use crate::proctree::{self, ProcessInfo};

/// A precondition that does not hold.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    /// Not root.
    #[error("{action} needs root (CRIU and the CUDA checkpoint API need CAP_SYS_ADMIN): run it as root or with sudo")]
    NotRoot { action: &'static str },
    /// The kernel was built without CONFIG_CHECKPOINT_RESTORE.
    #[error("this kernel lacks checkpoint/restore support (CONFIG_CHECKPOINT_RESTORE: {probe} is missing): use a kernel built with CONFIG_CHECKPOINT_RESTORE=y")]
    KernelWithoutCheckpointRestore { probe: String },
    /// CRIU could not be found or is too old.
    #[error(transparent)]
    Criu(#[from] CriuError),
    /// No such process.
    #[error("no process with pid {pid}: check the pid printed by `torpor run`")]
    NoSuchProcess { pid: i32 },
    /// The pid is not the root of a tree started by `torpor run`.
    #[error("pid {pid} ({comm}) was not started with `torpor run` (it is not PID 1 of its own PID namespace): start it with `torpor run -- CMD` and snapshot the pid that prints")]
    NotATorporRoot { pid: i32, comm: String },
}

/// Root check.
pub fn require_root(action: &'static str) -> Result<(), PreflightError> {
    if crate::sys::is_root() {
        Ok(())
    } else {
        Err(PreflightError::NotRoot { action })
    }
}

/// `/proc/sys/kernel/ns_last_pid` exists only in kernels built with CONFIG_CHECKPOINT_RESTORE,
/// and CRIU needs it to restore pids.
pub fn require_checkpoint_restore_kernel(proc_root: &Path) -> Result<(), PreflightError> {
    let probe = proc_root.join("sys/kernel/ns_last_pid");
    if probe.exists() {
        Ok(())
    } else {
        Err(PreflightError::KernelWithoutCheckpointRestore {
            probe: probe.display().to_string(),
        })
    }
}

/// Finds a usable CRIU.
pub fn require_criu() -> Result<Criu, PreflightError> {
    Ok(Criu::locate()?)
}

/// Unmounts the kernel-feature cache mounts an older Torpor killed while making its cache left
/// in this mount namespace (`torpor_criu::remove_leaked_cache_mounts`); how many went.
pub fn remove_leaked_criu_cache_mounts() -> usize {
    torpor_criu::remove_leaked_cache_mounts()
}

/// Makes CRIU's kernel-feature cache for this process's restores and dumps
/// (`torpor_criu::kerndat`): a long-running caller (torpord) calls it once, off any request's
/// path, and every later restore or dump of a tree that reaches nothing in the host's `/run`
/// skips CRIU's probes of the kernel.
pub fn prepare_criu_kernel_cache() -> Result<(), PreflightError> {
    Ok(require_criu()?.prepare_kernel_cache()?)
}

/// The root process of a tree to snapshot.
pub fn require_torpor_root(pid: i32) -> Result<ProcessInfo, PreflightError> {
    let info = proctree::read_process(pid).map_err(|_| PreflightError::NoSuchProcess { pid })?;
    if !proctree::is_alive(pid) {
        return Err(PreflightError::NoSuchProcess { pid });
    }
    if !info.is_pidns_init() {
        return Err(PreflightError::NotATorporRoot {
            pid,
            comm: info.comm,
        });
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_probe_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = require_checkpoint_restore_kernel(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("ns_last_pid"), "{msg}");
        assert!(msg.contains("CONFIG_CHECKPOINT_RESTORE=y"), "{msg}");
        std::fs::create_dir_all(dir.path().join("sys/kernel")).unwrap();
        std::fs::write(dir.path().join("sys/kernel/ns_last_pid"), "1\n").unwrap();
        require_checkpoint_restore_kernel(dir.path()).unwrap();
    }

    #[test]
    fn this_kernel_supports_checkpoint_restore() {
        require_checkpoint_restore_kernel(Path::new("/proc")).unwrap();
    }

    #[test]
    fn rejects_missing_and_plain_processes() {
        assert!(matches!(
            require_torpor_root(i32::MAX - 7),
            Err(PreflightError::NoSuchProcess { .. })
        ));
        let me = std::process::id() as i32;
        assert!(matches!(
            require_torpor_root(me),
            Err(PreflightError::NotATorporRoot { .. })
        ));
    }
}
