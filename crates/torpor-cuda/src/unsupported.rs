//! GPU state the driver's checkpoint API cannot restore, and how a process says it holds some.
//!
//! cuda-checkpoint's README (driver 570 onwards) says the API "does not support UVM or IPC
//! memory", and on the H100 (driver 580) a process that imported another's memory with
//! `cuIpcOpenMemHandle` checkpoints but cannot be restored: `cuCheckpointProcessRestore` fails
//! with `CUDA_ERROR_INVALID_VALUE` and leaves it stuck. Nothing in /proc shows such an import, so
//! the process records it itself: Torpor's hook (`libtorpor_hook.so`, preloaded by `torpor run`
//! and into managed workers) opens a memfd named [`Unsupported::marker`] while the process holds
//! such memory, and `torpor snapshot` looks for that name among the tree's open files before it
//! touches the driver.

/// One kind of GPU state the checkpoint API cannot restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsupported {
    /// Device memory of another process opened with `cuIpcOpenMemHandle` (legacy CUDA IPC;
    /// `torch.multiprocessing` sharing a CUDA tensor), or an event with `cuIpcOpenEventHandle`.
    IpcImport,
    /// Device memory or an event exported with `cuIpcGetMemHandle`/`cuIpcGetEventHandle`: the
    /// importer may be outside the snapshot, and the driver cannot restore either side.
    IpcExport,
    /// Managed memory (`cudaMallocManaged`, `cuMemAllocManaged`; UVM).
    Managed,
    /// A NCCL communicator of more than one rank: its ranks share GPU memory through IPC.
    MultiRankNccl,
}

impl Unsupported {
    pub const ALL: [Unsupported; 4] = [
        Unsupported::IpcImport,
        Unsupported::IpcExport,
        Unsupported::Managed,
        Unsupported::MultiRankNccl,
    ];

    /// The memfd name a process holding this state keeps open (`/proc/PID/fd/N` reads
    /// `/memfd:NAME (deleted)`).
    pub fn marker(self) -> &'static str {
        match self {
            Unsupported::IpcImport => "torpor-unsupported-cuda-ipc-import",
            Unsupported::IpcExport => "torpor-unsupported-cuda-ipc-export",
            Unsupported::Managed => "torpor-unsupported-cuda-managed-memory",
            Unsupported::MultiRankNccl => "torpor-unsupported-nccl-multi-rank",
        }
    }

    /// The kind a `/proc/PID/fd` link target names, if any.
    pub fn from_fd_target(target: &str) -> Option<Unsupported> {
        let name = target.strip_prefix("/memfd:")?;
        let name = name.strip_suffix(" (deleted)").unwrap_or(name);
        Unsupported::ALL.into_iter().find(|u| u.marker() == name)
    }

    /// What the process holds, for the error line.
    pub fn what(self) -> &'static str {
        match self {
            Unsupported::IpcImport => "GPU memory of another process opened through CUDA IPC",
            Unsupported::IpcExport => "GPU memory exported to other processes through CUDA IPC",
            Unsupported::Managed => "CUDA managed memory (UVM, cudaMallocManaged)",
            Unsupported::MultiRankNccl => {
                "a NCCL communicator of more than one rank (multi-process NCCL)"
            }
        }
    }

    /// The way around it, for the error line.
    pub fn fix(self) -> &'static str {
        match self {
            Unsupported::IpcImport | Unsupported::IpcExport => {
                "close the IPC handles before the snapshot (cudaIpcCloseMemHandle in the importer, \
                 after which the exporter may free the memory), share the data through host \
                 memory, or snapshot each process as its own `torpor run` tree"
            }
            Unsupported::Managed => {
                "allocate with cudaMalloc instead (CuPy: keep the default memory pool, not \
                 cupy.cuda.malloc_managed)"
            }
            Unsupported::MultiRankNccl => {
                "destroy the communicator before the snapshot (dist.destroy_process_group()) and \
                 create it again after the restore, or snapshot a world of size 1 per GPU"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_round_trip_through_fd_targets() {
        for u in Unsupported::ALL {
            assert_eq!(
                Unsupported::from_fd_target(&format!("/memfd:{} (deleted)", u.marker())),
                Some(u)
            );
            assert_eq!(
                Unsupported::from_fd_target(&format!("/memfd:{}", u.marker())),
                Some(u)
            );
        }
        assert_eq!(Unsupported::from_fd_target("/memfd:other (deleted)"), None);
        assert_eq!(Unsupported::from_fd_target("/dev/nvidiactl"), None);
    }
}
