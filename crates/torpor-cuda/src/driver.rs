//! The CUDA driver: device queries and the process checkpoint API, called on other processes.

use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::CudaError;
use crate::ffi::{self, CuResult};
use crate::library::{path_from_env, Loaded};
use crate::uuid::GpuUuid;
use crate::vmm::{Vmm, VmmApi};
use crate::{DEFAULT_LIBCUDA, LIBCUDA_ENV};

/// The checkpoint state of a CUDA process (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    /// CUDA calls run normally.
    Running,
    /// CUDA calls block; the GPU state is still on the GPU.
    Locked,
    /// The GPU state is in the process's host memory and the GPU is released.
    Checkpointed,
    /// A checkpoint or restore failed; the driver cannot use the process's GPU state.
    Failed,
}

impl ProcessState {
    fn from_raw(raw: c_int) -> Option<Self> {
        match raw {
            ffi::CU_PROCESS_STATE_RUNNING => Some(Self::Running),
            ffi::CU_PROCESS_STATE_LOCKED => Some(Self::Locked),
            ffi::CU_PROCESS_STATE_CHECKPOINTED => Some(Self::Checkpointed),
            ffi::CU_PROCESS_STATE_FAILED => Some(Self::Failed),
            _ => None,
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Running => "running",
            Self::Locked => "locked",
            Self::Checkpointed => "checkpointed",
            Self::Failed => "failed",
        })
    }
}

/// A GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDevice {
    /// The CUDA ordinal (`cuDeviceGet`), as numbered under this process's `CUDA_VISIBLE_DEVICES`.
    pub ordinal: i32,
    /// e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    pub uuid: GpuUuid,
    /// Bytes of device memory (`cuDeviceTotalMem_v2`).
    pub total_memory: u64,
}

/// The function pointers this crate calls, resolved once at load.
struct Api {
    init: ffi::CuInit,
    driver_get_version: ffi::CuDriverGetVersion,
    get_error_name: ffi::CuGetErrorName,
    device_get_count: ffi::CuDeviceGetCount,
    device_get: ffi::CuDeviceGet,
    device_get_name: ffi::CuDeviceGetName,
    device_get_uuid: ffi::CuDeviceGetUuid,
    device_total_mem: ffi::CuDeviceTotalMem,
    lock: ffi::CuCheckpointProcessLock,
    checkpoint: ffi::CuCheckpointProcessCheckpoint,
    restore: ffi::CuCheckpointProcessRestore,
    unlock: ffi::CuCheckpointProcessUnlock,
    get_state: ffi::CuCheckpointProcessGetState,
    get_restore_thread_id: ffi::CuCheckpointProcessGetRestoreThreadId,
}

/// `libcuda` loaded, its checkpoint API found and `cuInit(0)` done.
///
/// The checkpoint calls act on *another* process, named by pid in this process's PID namespace.
/// The library stays loaded for the life of the process once opened.
pub struct CudaDriver {
    library: Loaded,
    api: Api,
    /// The VMM, copy and stream calls, resolved on first use ([`CudaDriver::vmm`]); the error
    /// is the first missing symbol.
    vmm: OnceLock<Result<VmmApi, &'static str>>,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<CudaDriver>();
};

impl fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDriver")
            .field("path", self.library.path())
            .finish_non_exhaustive()
    }
}

const LOCK: &str = "cuCheckpointProcessLock";
const CHECKPOINT: &str = "cuCheckpointProcessCheckpoint";
const RESTORE: &str = "cuCheckpointProcessRestore";
const UNLOCK: &str = "cuCheckpointProcessUnlock";
const GET_STATE: &str = "cuCheckpointProcessGetState";
const GET_RESTORE_THREAD_ID: &str = "cuCheckpointProcessGetRestoreThreadId";

impl CudaDriver {
    /// Loads the library named by `TORPOR_LIBCUDA`, or `libcuda.so.1`, and initialises it.
    pub fn load() -> Result<Self, CudaError> {
        Self::load_from(path_from_env(LIBCUDA_ENV, DEFAULT_LIBCUDA))
    }

    /// Loads the driver library at `path` (a bare name is searched for as `dlopen` does) and
    /// initialises it.
    ///
    /// Fails with [`CudaError::LibraryNotFound`] when it cannot be opened,
    /// [`CudaError::SymbolMissing`] when it is not a CUDA driver,
    /// [`CudaError::CheckpointApiMissing`] when the driver predates the checkpoint API and
    /// [`CudaError::InitFailed`] when `cuInit(0)` fails.
    pub fn load_from(path: impl Into<PathBuf>) -> Result<Self, CudaError> {
        let library = Loaded::open(path.into(), LIBCUDA_ENV)?;
        // SAFETY: each `require`/`get` below names a type that is the `ffi` alias written from the
        // symbol's declaration in cuda.h.
        let api = unsafe {
            let init = library.require("cuInit")?;
            let driver_get_version = library.require("cuDriverGetVersion")?;
            let get_error_name = library.require("cuGetErrorName")?;
            let device_get_count = library.require("cuDeviceGetCount")?;
            let device_get = library.require("cuDeviceGet")?;
            let device_get_name = library.require("cuDeviceGetName")?;
            let device_get_uuid = match library.get("cuDeviceGetUuid_v2") {
                Some(f) => f,
                None => library.require("cuDeviceGetUuid")?,
            };
            let device_total_mem = library.require("cuDeviceTotalMem_v2")?;
            let checkpoint_fn = |symbol: &'static str| CudaError::CheckpointApiMissing {
                path: library.path().clone(),
                symbol,
            };
            Api {
                init,
                driver_get_version,
                get_error_name,
                device_get_count,
                device_get,
                device_get_name,
                device_get_uuid,
                device_total_mem,
                lock: library.get(LOCK).ok_or_else(|| checkpoint_fn(LOCK))?,
                checkpoint: library
                    .get(CHECKPOINT)
                    .ok_or_else(|| checkpoint_fn(CHECKPOINT))?,
                restore: library.get(RESTORE).ok_or_else(|| checkpoint_fn(RESTORE))?,
                unlock: library.get(UNLOCK).ok_or_else(|| checkpoint_fn(UNLOCK))?,
                get_state: library
                    .get(GET_STATE)
                    .ok_or_else(|| checkpoint_fn(GET_STATE))?,
                get_restore_thread_id: library
                    .get(GET_RESTORE_THREAD_ID)
                    .ok_or_else(|| checkpoint_fn(GET_RESTORE_THREAD_ID))?,
            }
        };
        let driver = CudaDriver {
            library,
            api,
            vmm: OnceLock::new(),
        };
        // SAFETY: cuInit takes flags by value; 0 is the only valid value.
        let code = unsafe { (driver.api.init)(0) };
        if code != ffi::CUDA_SUCCESS {
            return Err(CudaError::InitFailed {
                path: driver.library.path().clone(),
                code,
                name: driver.error_name(code),
            });
        }
        Ok(driver)
    }

    /// The path the library was loaded from, as given.
    pub fn path(&self) -> &Path {
        self.library.path()
    }

    /// The CUDA version the driver supports, as `cuDriverGetVersion` gives it (13000 for 13.0).
    pub fn driver_version(&self) -> Result<i32, CudaError> {
        let mut version: c_int = 0;
        // SAFETY: the out pointer is a valid, writable c_int.
        let code = unsafe { (self.api.driver_get_version)(&mut version) };
        self.check_call("cuDriverGetVersion", None, code)?;
        Ok(version)
    }

    /// The virtual memory management, copy and stream calls. They are looked up on the first call
    /// (so a driver without them still serves the checkpoint API); a driver that lacks one is
    /// [`CudaError::VmmApiMissing`].
    pub fn vmm(&self) -> Result<Vmm<'_>, CudaError> {
        match self.vmm.get_or_init(|| VmmApi::resolve(&self.library)) {
            Ok(api) => Ok(Vmm::new(self, api)),
            Err(symbol) => Err(CudaError::VmmApiMissing {
                path: self.library.path().clone(),
                symbol,
            }),
        }
    }

    /// The GPUs visible to this process, in ordinal order.
    pub fn devices(&self) -> Result<Vec<GpuDevice>, CudaError> {
        let mut count: c_int = 0;
        // SAFETY: the out pointer is a valid, writable c_int.
        let code = unsafe { (self.api.device_get_count)(&mut count) };
        self.check_call("cuDeviceGetCount", None, code)?;
        (0..count).map(|ordinal| self.device(ordinal)).collect()
    }

    /// The driver's handle of GPU `ordinal`.
    pub(crate) fn device_handle(&self, ordinal: c_int) -> Result<ffi::CuDevice, CudaError> {
        let mut device: ffi::CuDevice = 0;
        // SAFETY: the out pointer is a valid, writable CUdevice.
        let code = unsafe { (self.api.device_get)(&mut device, ordinal) };
        self.check_call("cuDeviceGet", None, code)?;
        Ok(device)
    }

    fn device(&self, ordinal: c_int) -> Result<GpuDevice, CudaError> {
        let device = self.device_handle(ordinal)?;

        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds `name.len()` bytes, the length passed.
        let code =
            unsafe { (self.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, device) };
        self.check_call("cuDeviceGetName", None, code)?;

        let mut uuid = ffi::CuUuid::default();
        // SAFETY: the out pointer is a valid, writable CUuuid.
        let code = unsafe { (self.api.device_get_uuid)(&mut uuid, device) };
        self.check_call("cuDeviceGetUuid_v2", None, code)?;

        let mut total: usize = 0;
        // SAFETY: the out pointer is a valid, writable size_t.
        let code = unsafe { (self.api.device_total_mem)(&mut total, device) };
        self.check_call("cuDeviceTotalMem_v2", None, code)?;

        Ok(GpuDevice {
            ordinal,
            name: string_from_c(&name),
            uuid: GpuUuid(uuid.bytes),
            total_memory: total as u64,
        })
    }

    /// The checkpoint state of process `pid`; `None` when the process exists but has not
    /// initialised CUDA. A pid that does not exist is [`CudaError::NoSuchProcess`].
    pub fn process_state(&self, pid: i32) -> Result<Option<ProcessState>, CudaError> {
        let mut raw: c_int = -1;
        // SAFETY: the out pointer is a valid, writable CUprocessState (an int-sized enum).
        let code = unsafe { (self.api.get_state)(pid, &mut raw) };
        match self.check_process(GET_STATE, pid, code) {
            Ok(()) => ProcessState::from_raw(raw)
                .map(Some)
                .ok_or(CudaError::UnknownProcessState { pid, raw }),
            Err(CudaError::NotCudaProcess { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The thread of process `pid` that the driver uses to restore it (CRIU must leave it
    /// running).
    pub fn restore_thread_id(&self, pid: i32) -> Result<i32, CudaError> {
        let mut tid: c_int = 0;
        // SAFETY: the out pointer is a valid, writable int.
        let code = unsafe { (self.api.get_restore_thread_id)(pid, &mut tid) };
        self.check_process(GET_RESTORE_THREAD_ID, pid, code)?;
        Ok(tid)
    }

    /// Locks the CUDA API of process `pid` (running → locked), waiting up to `timeout` for its
    /// submitted GPU work to finish. The timeout is rounded up to whole milliseconds, at least 1
    /// (the driver reads 0 as "wait for ever") and at most `u32::MAX`. A lock that times out is
    /// [`CudaError::Timeout`] and leaves the process running.
    pub fn lock(&self, pid: i32, timeout: Duration) -> Result<(), CudaError> {
        let mut args = ffi::LockArgs {
            timeout_ms: timeout_ms(timeout),
            ..Default::default()
        };
        // SAFETY: `args` is a valid, zeroed-but-for-the-timeout CUcheckpointLockArgs.
        let code = unsafe { (self.api.lock)(pid, &mut args) };
        match code {
            ffi::CUDA_ERROR_NOT_READY | ffi::CUDA_ERROR_TIMEOUT => {
                Err(CudaError::Timeout { pid, timeout, code })
            }
            _ => self.check_process(LOCK, pid, code),
        }
    }

    /// Copies the GPU state of process `pid` into its host memory and releases the GPU
    /// (locked → checkpointed).
    pub fn checkpoint(&self, pid: i32) -> Result<(), CudaError> {
        let mut args = ffi::CheckpointArgs::default();
        // SAFETY: `args` is a valid, zeroed CUcheckpointCheckpointArgs.
        let code = unsafe { (self.api.checkpoint)(pid, &mut args) };
        self.check_process(CHECKPOINT, pid, code)
    }

    /// Puts the GPU state of process `pid` back on the GPU (checkpointed → locked).
    /// `gpu_pairs` maps each GPU the process had (old UUID) to the GPU to restore onto (new
    /// UUID); empty restores onto the same GPUs. When not empty it must name every GPU the
    /// process had.
    pub fn restore(&self, pid: i32, gpu_pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), CudaError> {
        let count = u32::try_from(gpu_pairs.len()).map_err(|_| CudaError::TooManyGpuPairs {
            count: gpu_pairs.len(),
        })?;
        let mut pairs: Vec<ffi::GpuPair> = gpu_pairs
            .iter()
            .map(|(old, new)| ffi::GpuPair {
                old_uuid: ffi::CuUuid { bytes: old.0 },
                new_uuid: ffi::CuUuid { bytes: new.0 },
            })
            .collect();
        let mut args = ffi::RestoreArgs {
            gpu_pairs: if pairs.is_empty() {
                std::ptr::null_mut()
            } else {
                pairs.as_mut_ptr()
            },
            gpu_pairs_count: count,
            reserved: [0; 44],
            reserved1: 0,
        };
        // SAFETY: `args` is a valid CUcheckpointRestoreArgs whose `gpu_pairs` points to `count`
        // initialised pairs (or is null with a count of 0); `pairs` outlives the call.
        let code = unsafe { (self.api.restore)(pid, &mut args) };
        self.check_process(RESTORE, pid, code)
    }

    /// Lets process `pid` make CUDA calls again (locked → running).
    pub fn unlock(&self, pid: i32) -> Result<(), CudaError> {
        let mut args = ffi::UnlockArgs::default();
        // SAFETY: `args` is a valid, zeroed CUcheckpointUnlockArgs.
        let code = unsafe { (self.api.unlock)(pid, &mut args) };
        self.check_process(UNLOCK, pid, code)
    }

    /// The driver's name for `code` (`CUDA_ERROR_…`).
    pub fn error_name(&self, code: i32) -> String {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: the out pointer is valid; on success the driver sets it to a static string.
        let result = unsafe { (self.api.get_error_name)(code, &mut name) };
        if result != ffi::CUDA_SUCCESS || name.is_null() {
            return format!("unknown CUresult {code}");
        }
        // SAFETY: the driver returned a NUL-terminated string with static lifetime.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    pub(crate) fn check_call(
        &self,
        function: &'static str,
        pid: Option<i32>,
        code: CuResult,
    ) -> Result<(), CudaError> {
        if code == ffi::CUDA_SUCCESS {
            return Ok(());
        }
        Err(CudaError::Call {
            function,
            pid,
            code,
            name: self.error_name(code),
        })
    }

    /// Maps a checkpoint call's result, telling a process without CUDA and a missing process
    /// apart from other failures.
    fn check_process(
        &self,
        function: &'static str,
        pid: i32,
        code: CuResult,
    ) -> Result<(), CudaError> {
        match code {
            ffi::CUDA_ERROR_NOT_INITIALIZED => Err(CudaError::NotCudaProcess { function, pid }),
            ffi::CUDA_ERROR_OPERATING_SYSTEM if !process_exists(pid) => {
                Err(CudaError::NoSuchProcess { function, pid })
            }
            _ => self.check_call(function, Some(pid), code),
        }
    }
}

/// Whether `pid` names a process (or thread) in this PID namespace.
fn process_exists(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// `timeout` in whole milliseconds, rounded up, within 1..=u32::MAX.
fn timeout_ms(timeout: Duration) -> u32 {
    let ms = timeout.as_nanos().div_ceil(1_000_000).max(1);
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// The text of a NUL-terminated C string in `buf` (all of `buf` when it has no NUL).
pub(crate) fn string_from_c(buf: &[c_char]) -> String {
    // c_char is i8 or u8 by platform; the bytes are what matter.
    let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_round_up_to_whole_milliseconds() {
        assert_eq!(timeout_ms(Duration::ZERO), 1);
        assert_eq!(timeout_ms(Duration::from_nanos(1)), 1);
        assert_eq!(timeout_ms(Duration::from_micros(1500)), 2);
        assert_eq!(timeout_ms(Duration::from_secs(10)), 10_000);
        assert_eq!(timeout_ms(Duration::from_secs(u64::MAX)), u32::MAX);
    }

    #[test]
    fn c_strings_stop_at_the_first_nul() {
        let buf: Vec<c_char> = b"H100\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(string_from_c(&buf), "H100");
        let unterminated: Vec<c_char> = b"abc".iter().map(|&b| b as c_char).collect();
        assert_eq!(string_from_c(&unterminated), "abc");
    }

    #[test]
    fn process_states_match_cuda_h() {
        assert_eq!(ProcessState::from_raw(0), Some(ProcessState::Running));
        assert_eq!(ProcessState::from_raw(1), Some(ProcessState::Locked));
        assert_eq!(ProcessState::from_raw(2), Some(ProcessState::Checkpointed));
        assert_eq!(ProcessState::from_raw(3), Some(ProcessState::Failed));
        assert_eq!(ProcessState::from_raw(4), None);
        assert_eq!(ProcessState::Checkpointed.to_string(), "checkpointed");
    }

    #[test]
    fn only_live_pids_exist() {
        assert!(process_exists(std::process::id() as i32));
        assert!(!process_exists(0));
        assert!(!process_exists(-1));
        assert!(!process_exists(i32::MAX));
    }
}
