//! NVML: the driver version, the GPUs and which processes use how much of their memory.

use std::ffi::{c_char, c_uint, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::driver::string_from_c;
use crate::error::CudaError;
use crate::ffi::{self, NvmlReturn};
use crate::library::{path_from_env, Loaded};
use crate::uuid::GpuUuid;
use crate::{DEFAULT_LIBNVML, LIBNVML_ENV};

/// A GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlGpu {
    /// NVML's index, which ignores `CUDA_VISIBLE_DEVICES` (unlike a CUDA ordinal).
    pub index: u32,
    pub name: String,
    pub uuid: GpuUuid,
    /// Bytes of device memory.
    pub total_memory: u64,
    /// Bytes not allocated by anyone.
    pub free_memory: u64,
}

/// A process with a CUDA context on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    pub gpu: GpuUuid,
    /// The pid as NVML sees it: in the initial PID namespace, not necessarily this process's.
    pub pid: u32,
    /// Bytes of device memory the process uses; `None` where NVML cannot tell.
    pub used_memory: Option<u64>,
}

struct Api {
    shutdown: ffi::NvmlShutdown,
    error_string: ffi::NvmlErrorString,
    system_get_driver_version: ffi::NvmlSystemGetDriverVersion,
    device_get_count: ffi::NvmlDeviceGetCount,
    device_get_handle_by_index: ffi::NvmlDeviceGetHandleByIndex,
    device_get_name: ffi::NvmlDeviceGetString,
    device_get_uuid: ffi::NvmlDeviceGetString,
    device_get_memory_info: ffi::NvmlDeviceGetMemoryInfo,
    device_get_compute_running_processes: ffi::NvmlDeviceGetComputeRunningProcesses,
}

/// `libnvidia-ml` loaded and initialised; shut down on drop.
pub struct Nvml {
    library: Loaded,
    api: Api,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Nvml>();
};

impl fmt::Debug for Nvml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvml")
            .field("path", self.library.path())
            .finish_non_exhaustive()
    }
}

/// How often a process list that keeps growing between the two calls is asked for again.
const PROCESS_LIST_TRIES: usize = 5;

impl Nvml {
    /// Loads the library named by `TORPOR_LIBNVML`, or `libnvidia-ml.so.1`, and initialises it.
    pub fn load() -> Result<Self, CudaError> {
        Self::load_from(path_from_env(LIBNVML_ENV, DEFAULT_LIBNVML))
    }

    /// Loads the NVML library at `path` and initialises it.
    pub fn load_from(path: impl Into<PathBuf>) -> Result<Self, CudaError> {
        let library = Loaded::open(path.into(), LIBNVML_ENV)?;
        // SAFETY: each `require` below names a type that is the `ffi` alias written from the
        // symbol's declaration in nvml.h.
        let (init, api) = unsafe {
            let init: ffi::NvmlInit = library.require("nvmlInit_v2")?;
            let api = Api {
                shutdown: library.require("nvmlShutdown")?,
                error_string: library.require("nvmlErrorString")?,
                system_get_driver_version: library.require("nvmlSystemGetDriverVersion")?,
                device_get_count: library.require("nvmlDeviceGetCount_v2")?,
                device_get_handle_by_index: library.require("nvmlDeviceGetHandleByIndex_v2")?,
                device_get_name: library.require("nvmlDeviceGetName")?,
                device_get_uuid: library.require("nvmlDeviceGetUUID")?,
                device_get_memory_info: library.require("nvmlDeviceGetMemoryInfo")?,
                device_get_compute_running_processes: library
                    .require("nvmlDeviceGetComputeRunningProcesses_v3")?,
            };
            (init, api)
        };
        // SAFETY: nvmlInit_v2 takes no arguments.
        let code = unsafe { init() };
        if code != ffi::NVML_SUCCESS {
            return Err(CudaError::NvmlInitFailed {
                path: library.path().clone(),
                code,
                message: message(&api, code),
            });
        }
        Ok(Nvml { library, api })
    }

    /// The path the library was loaded from, as given.
    pub fn path(&self) -> &Path {
        self.library.path()
    }

    /// The kernel driver's version, e.g. "580.159.04".
    pub fn driver_version(&self) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; ffi::NVML_DRIVER_VERSION_LEN];
        // SAFETY: the buffer holds `buf.len()` bytes, the length passed.
        let code =
            unsafe { (self.api.system_get_driver_version)(buf.as_mut_ptr(), buf.len() as c_uint) };
        self.check("nvmlSystemGetDriverVersion", code)?;
        Ok(string_from_c(&buf))
    }

    /// Every GPU NVML sees, in index order.
    pub fn gpus(&self) -> Result<Vec<NvmlGpu>, CudaError> {
        (0..self.count()?).map(|index| self.gpu(index)).collect()
    }

    /// Every process with a compute context on any GPU, with the device memory it uses.
    pub fn process_memory(&self) -> Result<Vec<GpuProcess>, CudaError> {
        let mut out = Vec::new();
        for index in 0..self.count()? {
            let device = self.handle(index)?;
            let gpu = self.uuid(index, device)?;
            for info in self.compute_processes(device)? {
                out.push(GpuProcess {
                    gpu,
                    pid: info.pid,
                    used_memory: (info.used_gpu_memory != ffi::NVML_VALUE_NOT_AVAILABLE)
                        .then_some(info.used_gpu_memory),
                });
            }
        }
        Ok(out)
    }

    fn count(&self) -> Result<u32, CudaError> {
        let mut count: c_uint = 0;
        // SAFETY: the out pointer is a valid, writable unsigned int.
        let code = unsafe { (self.api.device_get_count)(&mut count) };
        self.check("nvmlDeviceGetCount_v2", code)?;
        Ok(count)
    }

    fn handle(&self, index: u32) -> Result<ffi::NvmlDevice, CudaError> {
        let mut device: ffi::NvmlDevice = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid, writable nvmlDevice_t.
        let code = unsafe { (self.api.device_get_handle_by_index)(index, &mut device) };
        self.check("nvmlDeviceGetHandleByIndex_v2", code)?;
        Ok(device)
    }

    fn uuid(&self, index: u32, device: ffi::NvmlDevice) -> Result<GpuUuid, CudaError> {
        let mut buf = [0 as c_char; ffi::NVML_UUID_LEN];
        // SAFETY: `device` came from nvmlDeviceGetHandleByIndex_v2; the buffer holds `buf.len()`
        // bytes, the length passed.
        let code =
            unsafe { (self.api.device_get_uuid)(device, buf.as_mut_ptr(), buf.len() as c_uint) };
        self.check("nvmlDeviceGetUUID", code)?;
        let value = string_from_c(&buf);
        value
            .parse()
            .map_err(|_| CudaError::NvmlBadUuid { index, value })
    }

    fn gpu(&self, index: u32) -> Result<NvmlGpu, CudaError> {
        let device = self.handle(index)?;
        let uuid = self.uuid(index, device)?;

        let mut name = [0 as c_char; ffi::NVML_NAME_LEN];
        // SAFETY: as in `uuid`.
        let code =
            unsafe { (self.api.device_get_name)(device, name.as_mut_ptr(), name.len() as c_uint) };
        self.check("nvmlDeviceGetName", code)?;

        let mut memory = ffi::NvmlMemory::default();
        // SAFETY: `device` is a valid handle; the out pointer is a valid, writable nvmlMemory_t.
        let code = unsafe { (self.api.device_get_memory_info)(device, &mut memory) };
        self.check("nvmlDeviceGetMemoryInfo", code)?;

        Ok(NvmlGpu {
            index,
            name: string_from_c(&name),
            uuid,
            total_memory: memory.total,
            free_memory: memory.free,
        })
    }

    fn compute_processes(
        &self,
        device: ffi::NvmlDevice,
    ) -> Result<Vec<ffi::NvmlProcessInfo>, CudaError> {
        const FUNCTION: &str = "nvmlDeviceGetComputeRunningProcesses_v3";
        let mut capacity: c_uint = 0;
        // SAFETY: with a count of 0 NVML writes no entries, so a null array is allowed; it sets
        // the count to the number of processes.
        let code = unsafe {
            (self.api.device_get_compute_running_processes)(
                device,
                &mut capacity,
                std::ptr::null_mut(),
            )
        };
        if code == ffi::NVML_SUCCESS {
            return Ok(Vec::new());
        }
        if code != ffi::NVML_ERROR_INSUFFICIENT_SIZE {
            return Err(self.error(FUNCTION, code));
        }
        for _ in 0..PROCESS_LIST_TRIES {
            // Room for processes that start between the two calls.
            let room = capacity.saturating_add(8);
            let mut infos = vec![ffi::NvmlProcessInfo::default(); room as usize];
            let mut count = room;
            // SAFETY: `infos` holds `count` writable entries; NVML writes at most `count`.
            let code = unsafe {
                (self.api.device_get_compute_running_processes)(
                    device,
                    &mut count,
                    infos.as_mut_ptr(),
                )
            };
            match code {
                ffi::NVML_SUCCESS => {
                    infos.truncate(count.min(room) as usize);
                    return Ok(infos);
                }
                ffi::NVML_ERROR_INSUFFICIENT_SIZE => capacity = count.max(room),
                _ => return Err(self.error(FUNCTION, code)),
            }
        }
        Err(self.error(FUNCTION, ffi::NVML_ERROR_INSUFFICIENT_SIZE))
    }

    fn check(&self, function: &'static str, code: NvmlReturn) -> Result<(), CudaError> {
        if code == ffi::NVML_SUCCESS {
            Ok(())
        } else {
            Err(self.error(function, code))
        }
    }

    fn error(&self, function: &'static str, code: NvmlReturn) -> CudaError {
        CudaError::NvmlCall {
            function,
            code,
            message: message(&self.api, code),
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: NVML was initialised in `load_from`; each init is paired with this one
        // shutdown. Its result is of no use at this point.
        unsafe { (self.api.shutdown)() };
    }
}

/// `nvmlErrorString`'s text for `code`.
fn message(api: &Api, code: NvmlReturn) -> String {
    // SAFETY: nvmlErrorString takes any code and works without nvmlInit.
    let text = unsafe { (api.error_string)(code) };
    if text.is_null() {
        return format!("unknown nvmlReturn_t {code}");
    }
    // SAFETY: NVML returns a NUL-terminated string with static lifetime.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}
