//! Errors of the driver and NVML calls. Raw codes stay typed fields; each message names the
//! cause and what to do about it.

use std::path::PathBuf;
use std::time::Duration;

use crate::ffi::{self, CuResult, NvmlReturn};

/// A failure to load or call the CUDA driver or NVML.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The library could not be opened (absent, wrong architecture, unreadable).
    #[error(
        "cannot load {}: {reason}; install the NVIDIA driver, or set {env_var} to the \
         library's full path",
        path.display()
    )]
    LibraryNotFound {
        path: PathBuf,
        /// The environment variable that chooses another path.
        env_var: &'static str,
        /// `dlerror`'s text.
        reason: String,
    },

    /// The library lacks a function every driver of the supported versions has.
    #[error(
        "{} has no function {symbol}, so it is not the NVIDIA library Torpor needs: set \
         {env_var} to the NVIDIA driver's own library",
        path.display()
    )]
    SymbolMissing {
        path: PathBuf,
        env_var: &'static str,
        symbol: &'static str,
    },

    /// The driver predates the process checkpoint API.
    #[error(
        "the NVIDIA driver at {} has no checkpoint API ({symbol} missing): install driver >= 570",
        path.display()
    )]
    CheckpointApiMissing { path: PathBuf, symbol: &'static str },

    /// The driver lacks the virtual memory management calls the split path needs.
    #[error(
        "the CUDA driver at {} has no {symbol}: it is too old for exportable device memory; \
         install driver >= 570, or set TORPOR_LIBCUDA to the NVIDIA driver's own library",
        path.display()
    )]
    VmmApiMissing { path: PathBuf, symbol: &'static str },

    /// `cuInit(0)` failed.
    #[error("cuInit failed with {name} ({code}) using {}: {}", path.display(), init_hint(*.code))]
    InitFailed {
        path: PathBuf,
        code: CuResult,
        /// `cuGetErrorName`'s name for `code`.
        name: String,
    },

    /// A driver call failed with a code that has no variant of its own.
    #[error("{function}{} failed with {name} ({code}): {}", for_pid(*.pid), cuda_hint(*.code))]
    Call {
        function: &'static str,
        /// The target process, for the checkpoint calls.
        pid: Option<i32>,
        code: CuResult,
        name: String,
    },

    /// `cuCheckpointProcessLock` gave up waiting for the process's CUDA work.
    #[error(
        "CUDA lock of pid {pid} timed out after {timeout:?}: the process keeps running; retry \
         with a larger --timeout or when it is idle"
    )]
    Timeout {
        pid: i32,
        timeout: Duration,
        /// The driver's code: `CUDA_ERROR_NOT_READY` (600) from driver 580,
        /// `CUDA_ERROR_TIMEOUT` (909) as `cuda.h` documents.
        code: CuResult,
    },

    /// The process exists but has no CUDA state (`CUDA_ERROR_NOT_INITIALIZED` from a checkpoint
    /// call).
    #[error(
        "{function}: pid {pid} is not a CUDA process (it has not initialised CUDA): check the \
         pid; a process without CUDA state needs no GPU step"
    )]
    NotCudaProcess { function: &'static str, pid: i32 },

    /// The process does not exist (`CUDA_ERROR_OPERATING_SYSTEM` and no `/proc/<pid>`).
    #[error("{function}: pid {pid} does not exist (it may have exited): check the pid")]
    NoSuchProcess { function: &'static str, pid: i32 },

    /// The driver reported a `CUprocessState` this crate does not know.
    #[error(
        "the driver reported an unknown checkpoint state {raw} for pid {pid}: the driver is \
         newer than this Torpor; update Torpor"
    )]
    UnknownProcessState { pid: i32, raw: i32 },

    /// More GPU pairs than the driver's `unsigned int` count can hold.
    #[error(
        "{count} GPU pairs are more than the driver accepts: give at most {} pairs",
        u32::MAX
    )]
    TooManyGpuPairs { count: usize },

    /// `nvmlInit_v2` failed.
    #[error("nvmlInit_v2 failed with {message} ({code}) using {}: {}", path.display(), nvml_hint(*.code))]
    NvmlInitFailed {
        path: PathBuf,
        code: NvmlReturn,
        /// `nvmlErrorString`'s text for `code`.
        message: String,
    },

    /// An NVML query failed.
    #[error("{function} failed with {message} ({code}): {}", nvml_hint(*.code))]
    NvmlCall {
        function: &'static str,
        code: NvmlReturn,
        message: String,
    },

    /// NVML returned a UUID that is not of the `GPU-…` form.
    #[error(
        "NVML gave `{value}` as the UUID of GPU {index}, which is not a GPU-… UUID: report \
         this with the output of `nvidia-smi -L`"
    )]
    NvmlBadUuid { index: u32, value: String },
}

fn for_pid(pid: Option<i32>) -> String {
    pid.map(|p| format!(" for pid {p}")).unwrap_or_default()
}

fn init_hint(code: CuResult) -> &'static str {
    match code {
        ffi::CUDA_ERROR_NO_DEVICE => "no GPU is visible to this process; check `nvidia-smi` and the container's device access",
        ffi::CUDA_ERROR_OPERATING_SYSTEM => {
            "inside a PID namespace CUDA needs that namespace's /proc; mount it, or check `nvidia-smi`"
        }
        _ => "check that `nvidia-smi` works and that libcuda matches the kernel driver",
    }
}

impl CudaError {
    /// Whether this is `CUDA_ERROR_OPERATING_SYSTEM` from a driver call: the code of the
    /// intermittent `cuCheckpointProcessRestore` failure seen with JAX processes on driver 580,
    /// after which that process cannot be restored again, but a fresh restore of the same
    /// snapshot can.
    pub fn is_operating_system_error(&self) -> bool {
        matches!(self, CudaError::Call { code, .. } if *code == ffi::CUDA_ERROR_OPERATING_SYSTEM)
    }

    /// Whether a driver call failed with `CUDA_ERROR_OUT_OF_MEMORY`: the GPU had too little free
    /// memory (e.g. a driver restore whose memory another process took after the restore's own
    /// check), which says nothing about the process or the snapshot.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Call { code, .. } if *code == ffi::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Whether the process the call was about has no CUDA state or no longer exists: what a
    /// driver restore meets when a freshly restored process died before it (see
    /// torpor_snapshot's `restore_with`).
    pub fn is_process_lost(&self) -> bool {
        matches!(
            self,
            CudaError::NotCudaProcess { .. } | CudaError::NoSuchProcess { .. }
        )
    }
}

fn cuda_hint(code: CuResult) -> &'static str {
    match code {
        ffi::CUDA_ERROR_INVALID_VALUE => {
            "the driver rejected an argument; report this as a Torpor bug with the driver version"
        }
        ffi::CUDA_ERROR_OUT_OF_MEMORY => {
            "the GPU has too little free memory; free some (`nvidia-smi` lists its users) and retry"
        }
        ffi::CUDA_ERROR_NOT_INITIALIZED => "the process has not initialised CUDA; check the pid",
        ffi::CUDA_ERROR_NO_DEVICE | ffi::CUDA_ERROR_INVALID_DEVICE => {
            "the GPU is not visible to this process; check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        }
        ffi::CUDA_ERROR_OPERATING_SYSTEM => {
            "the driver could not reach the process: run Torpor in its PID namespace with that \
             namespace's /proc; after a failed restore the process cannot be restored again and \
             must be killed"
        }
        ffi::CUDA_ERROR_ILLEGAL_STATE => {
            "the process is not in the state this step needs (lock: running, checkpoint: \
             locked, restore: checkpointed, unlock: locked); read its state and run the step it \
             is ready for"
        }
        ffi::CUDA_ERROR_NOT_FOUND => "the driver found no such object; check the pid and the GPU",
        ffi::CUDA_ERROR_NOT_READY | ffi::CUDA_ERROR_TIMEOUT => {
            "the operation did not finish in time; retry with a larger timeout or when the process is idle"
        }
        ffi::CUDA_ERROR_NOT_SUPPORTED => {
            "the driver cannot checkpoint what the process holds: CUDA managed memory (UVM, \
             cudaMallocManaged) and CUDA IPC memory are not supported by the checkpoint API of \
             this driver; allocate with cudaMalloc instead and share GPU memory between \
             processes through host memory (or use driver >= 570 on a supported GPU if neither \
             applies)"
        }
        _ => "read the NVIDIA driver's messages in the kernel log (`dmesg`) and retry; report the code if it persists",
    }
}

fn nvml_hint(code: NvmlReturn) -> &'static str {
    match code {
        ffi::NVML_ERROR_NOT_SUPPORTED => {
            "this GPU or driver does not support the query; upgrade the driver or do without it"
        }
        ffi::NVML_ERROR_NO_PERMISSION => "run as root or as a user allowed to query the GPU",
        ffi::NVML_ERROR_DRIVER_NOT_LOADED => {
            "the NVIDIA kernel driver is not loaded; load it (`modprobe nvidia`) and check `nvidia-smi`"
        }
        ffi::NVML_ERROR_GPU_IS_LOST => "the GPU has fallen off the bus; reset it or reboot the machine",
        _ => "check that `nvidia-smi` works and retry; report the code if it persists",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_process_is_told_from_other_failures() {
        let lost = [
            CudaError::NotCudaProcess {
                function: "cuCheckpointProcessRestore",
                pid: 7,
            },
            CudaError::NoSuchProcess {
                function: "cuCheckpointProcessRestore",
                pid: 7,
            },
        ];
        assert!(lost.iter().all(CudaError::is_process_lost));
        let os = CudaError::Call {
            function: "cuCheckpointProcessRestore",
            pid: Some(7),
            code: ffi::CUDA_ERROR_OPERATING_SYSTEM,
            name: "CUDA_ERROR_OPERATING_SYSTEM".into(),
        };
        assert!(!os.is_process_lost() && os.is_operating_system_error());
    }

    #[test]
    fn messages_name_cause_and_fix_on_one_line() {
        let errors = [
            CudaError::LibraryNotFound {
                path: "libcuda.so.1".into(),
                env_var: "TORPOR_LIBCUDA",
                reason: "libcuda.so.1: cannot open shared object file".into(),
            },
            CudaError::CheckpointApiMissing {
                path: "/usr/lib/libcuda.so.1".into(),
                symbol: "cuCheckpointProcessLock",
            },
            CudaError::Timeout {
                pid: 42,
                timeout: Duration::from_secs(5),
                code: ffi::CUDA_ERROR_NOT_READY,
            },
            CudaError::Call {
                function: "cuCheckpointProcessUnlock",
                pid: Some(42),
                code: ffi::CUDA_ERROR_ILLEGAL_STATE,
                name: "CUDA_ERROR_ILLEGAL_STATE".into(),
            },
        ];
        for e in &errors {
            let text = e.to_string();
            assert!(!text.contains('\n'), "{text}");
            assert!(text.contains(": "), "{text}");
        }
        assert_eq!(
            errors[1].to_string(),
            "the NVIDIA driver at /usr/lib/libcuda.so.1 has no checkpoint API \
             (cuCheckpointProcessLock missing): install driver >= 570"
        );
        assert_eq!(
            errors[2].to_string(),
            "CUDA lock of pid 42 timed out after 5s: the process keeps running; \
             retry with a larger --timeout or when it is idle"
        );
        assert!(errors[3].to_string().starts_with(
            "cuCheckpointProcessUnlock for pid 42 failed with CUDA_ERROR_ILLEGAL_STATE (401): "
        ));
    }
}
