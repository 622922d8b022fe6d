//! What the driver's checkpoint API cannot restore, found before the driver is touched.
//!
//! A process that imported another's GPU memory checkpoints without complaint and then cannot be
//! restored, not even in place: the source is left stuck (see [`torpor_cuda::unsupported`]).
//! So `torpor snapshot` refuses such trees first, from what /proc shows:
//!
//! - the marker memfds Torpor's hook keeps open while a process holds CUDA IPC or managed
//!   memory, or has joined a NCCL communicator of more than one rank
//!   ([`torpor_cuda::unsupported::Unsupported::marker`]);
//! - io_uring instances, which CRIU cannot dump (it would fail after the driver checkpoint);
//! - shared-memory files of NCCL (`/dev/shm/nccl-*`) held by two or more processes of the tree:
//!   ranks of one communicator talking through shared memory, which the hook cannot see when the
//!   program was started without it.

use std::collections::BTreeMap;
use std::fs;

use torpor_cuda::unsupported::Unsupported;

/// How /proc/PID/fd names an io_uring instance.
const IO_URING: &str = "anon_inode:[io_uring]";

/// Prefix of NCCL's shared-memory files.
const NCCL_SHM_PREFIX: &str = "/dev/shm/nccl-";

/// A tree the driver could not restore, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A process holds GPU state of this kind.
    Holds { pid: i32, what: Unsupported },
    /// Processes of the tree are ranks of one NCCL communicator.
    MultiProcessNccl { pids: Vec<i32> },
    /// A process holds an io_uring instance, which CRIU cannot save.
    IoUring { pid: i32 },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Holds { pid, what } => write!(
                f,
                "process {pid} holds {}, which the CUDA driver's checkpoint cannot restore: {}",
                what.what(),
                what.fix()
            ),
            Refusal::MultiProcessNccl { pids } => write!(
                f,
                "processes {pids:?} share NCCL's shared-memory files: they are ranks of one \
                 NCCL communicator (multi-process NCCL), whose shared GPU memory the CUDA \
                 driver's checkpoint cannot restore: {}",
                Unsupported::MultiRankNccl.fix()
            ),
            Refusal::IoUring { pid } => write!(
                f,
                "process {pid} holds an io_uring instance, which CRIU cannot save: libuv (PyTorch's \
                 TCPStore, uvloop, Node.js) uses one unless UV_USE_IO_URING=0, which `torpor run` \
                 sets unless the environment already names it; start the program with \
                 UV_USE_IO_URING=0 (PyTorch: or USE_LIBUV=0), or without io_uring"
            ),
        }
    }
}

/// The first reason the tree's GPU state cannot be restored, if any. Unreadable processes
/// (exited meanwhile) are skipped: the dump finds them gone anyway.
pub fn find(pids: &[i32]) -> Option<Refusal> {
    let mut nccl_files: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for &pid in pids {
        for target in fd_targets(pid) {
            if let Some(what) = Unsupported::from_fd_target(&target) {
                return Some(Refusal::Holds { pid, what });
            }
            if target == IO_URING {
                return Some(Refusal::IoUring { pid });
            }
            if let Some(name) = nccl_shm_name(&target) {
                add(&mut nccl_files, name, pid);
            }
        }
        if let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) {
            for line in maps.lines() {
                if let Some(name) = line.find('/').and_then(|i| nccl_shm_name(&line[i..])) {
                    add(&mut nccl_files, name, pid);
                }
            }
        }
    }
    nccl_files
        .into_values()
        .find(|holders| holders.len() > 1)
        .map(|pids| Refusal::MultiProcessNccl { pids })
}

fn add(files: &mut BTreeMap<String, Vec<i32>>, name: String, pid: i32) {
    let holders = files.entry(name).or_default();
    if !holders.contains(&pid) {
        holders.push(pid);
    }
}

/// `/dev/shm/nccl-XXXX` of a path (a deleted file keeps its name).
fn nccl_shm_name(path: &str) -> Option<String> {
    let path = path.trim();
    let path = path.strip_suffix(" (deleted)").unwrap_or(path);
    path.starts_with(NCCL_SHM_PREFIX).then(|| path.to_string())
}

fn fd_targets(pid: i32) -> Vec<String> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .filter_map(|t| t.to_str().map(str::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    fn memfd(name: &str) -> std::os::fd::OwnedFd {
        let c = CString::new(name).unwrap();
        // SAFETY: c is a valid C string; memfd_create returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }
    }

    #[test]
    fn a_plain_process_is_not_refused() {
        assert_eq!(find(&[std::process::id() as i32]), None);
    }

    #[test]
    fn a_marker_memfd_is_found_and_named() {
        let me = std::process::id() as i32;
        let fd = memfd(Unsupported::IpcImport.marker());
        let r = find(&[me]).expect("refused");
        assert_eq!(
            r,
            Refusal::Holds {
                pid: me,
                what: Unsupported::IpcImport
            }
        );
        let line = r.to_string();
        assert!(
            line.contains("CUDA IPC") && line.contains("cudaIpcCloseMemHandle"),
            "{line}"
        );
        drop(fd);
        assert_eq!(find(&[me]), None);
    }

    #[test]
    fn nccl_shared_memory_counts_only_when_shared() {
        let mut files = BTreeMap::new();
        add(&mut files, "/dev/shm/nccl-a".into(), 1);
        add(&mut files, "/dev/shm/nccl-a".into(), 1);
        assert!(files.values().all(|h| h.len() == 1));
        add(&mut files, "/dev/shm/nccl-a".into(), 2);
        assert_eq!(files["/dev/shm/nccl-a"], vec![1, 2]);
        assert_eq!(
            nccl_shm_name("/dev/shm/nccl-Xy12 (deleted)").as_deref(),
            Some("/dev/shm/nccl-Xy12")
        );
        assert_eq!(nccl_shm_name("/dev/shm/torch_1"), None);
    }
}
