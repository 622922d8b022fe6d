//! C types and function signatures of the driver API (`cuda.h`) and NVML (`nvml.h`) that Torpor
//! calls. Layouts are checked at compile time against the sizes and offsets in the headers.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::mem::{offset_of, size_of};

// ---- CUDA driver API ------------------------------------------------------------------------

/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `CUdevice`.
pub(crate) type CuDevice = c_int;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
pub(crate) const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// What every checkpoint call returns for a live process that has not initialised CUDA.
pub(crate) const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub(crate) const CUDA_ERROR_NO_DEVICE: CuResult = 100;
pub(crate) const CUDA_ERROR_INVALID_DEVICE: CuResult = 101;
/// What every checkpoint call returns for a pid that does not exist (and in other cases where the
/// driver cannot reach the process).
pub(crate) const CUDA_ERROR_OPERATING_SYSTEM: CuResult = 304;
pub(crate) const CUDA_ERROR_ILLEGAL_STATE: CuResult = 401;
pub(crate) const CUDA_ERROR_NOT_FOUND: CuResult = 500;
/// What driver 580 returns when a lock times out.
pub(crate) const CUDA_ERROR_NOT_READY: CuResult = 600;
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
/// What `cuda.h` says a lock that times out returns.
pub(crate) const CUDA_ERROR_TIMEOUT: CuResult = 909;

/// `CUprocessState` values.
pub(crate) const CU_PROCESS_STATE_RUNNING: c_int = 0;
pub(crate) const CU_PROCESS_STATE_LOCKED: c_int = 1;
pub(crate) const CU_PROCESS_STATE_CHECKPOINTED: c_int = 2;
pub(crate) const CU_PROCESS_STATE_FAILED: c_int = 3;

/// `CUuuid`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct CuUuid {
    pub bytes: [u8; 16],
}

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct LockArgs {
    /// 0 means no timeout.
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct CheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointGpuPair`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct GpuPair {
    pub old_uuid: CuUuid,
    pub new_uuid: CuUuid,
}

/// `CUcheckpointRestoreArgs` (CUDA 13.0: `char reserved[52 - sizeof(CUcheckpointGpuPair *)]` then
/// `cuuint64_t reserved1`; later headers give part of the reserved bytes names, at the same size).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RestoreArgs {
    pub gpu_pairs: *mut GpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 44],
    pub reserved1: u64,
}

/// `CUcheckpointUnlockArgs`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct UnlockArgs {
    pub reserved: [u64; 8],
}

const _: () = assert!(size_of::<CuUuid>() == 16);
const _: () = assert!(size_of::<LockArgs>() == 64);
const _: () = assert!(offset_of!(LockArgs, reserved1) == 8);
const _: () = assert!(size_of::<CheckpointArgs>() == 64);
const _: () = assert!(size_of::<GpuPair>() == 32);
const _: () = assert!(offset_of!(GpuPair, new_uuid) == 16);
const _: () = assert!(size_of::<RestoreArgs>() == 64);
const _: () = assert!(offset_of!(RestoreArgs, gpu_pairs_count) == 8);
const _: () = assert!(offset_of!(RestoreArgs, reserved) == 12);
const _: () = assert!(offset_of!(RestoreArgs, reserved1) == 56);
const _: () = assert!(size_of::<UnlockArgs>() == 64);

pub(crate) type CuInit = unsafe extern "C" fn(flags: c_uint) -> CuResult;
pub(crate) type CuDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> CuResult;
pub(crate) type CuGetErrorName =
    unsafe extern "C" fn(error: CuResult, name: *mut *const c_char) -> CuResult;
pub(crate) type CuDeviceGetCount = unsafe extern "C" fn(count: *mut c_int) -> CuResult;
pub(crate) type CuDeviceGet =
    unsafe extern "C" fn(device: *mut CuDevice, ordinal: c_int) -> CuResult;
pub(crate) type CuDeviceGetName =
    unsafe extern "C" fn(name: *mut c_char, len: c_int, device: CuDevice) -> CuResult;
pub(crate) type CuDeviceGetUuid =
    unsafe extern "C" fn(uuid: *mut CuUuid, device: CuDevice) -> CuResult;
pub(crate) type CuDeviceTotalMem =
    unsafe extern "C" fn(bytes: *mut usize, device: CuDevice) -> CuResult;
pub(crate) type CuCheckpointProcessLock =
    unsafe extern "C" fn(pid: c_int, args: *mut LockArgs) -> CuResult;
pub(crate) type CuCheckpointProcessCheckpoint =
    unsafe extern "C" fn(pid: c_int, args: *mut CheckpointArgs) -> CuResult;
pub(crate) type CuCheckpointProcessRestore =
    unsafe extern "C" fn(pid: c_int, args: *mut RestoreArgs) -> CuResult;
pub(crate) type CuCheckpointProcessUnlock =
    unsafe extern "C" fn(pid: c_int, args: *mut UnlockArgs) -> CuResult;
pub(crate) type CuCheckpointProcessGetState =
    unsafe extern "C" fn(pid: c_int, state: *mut c_int) -> CuResult;
pub(crate) type CuCheckpointProcessGetRestoreThreadId =
    unsafe extern "C" fn(pid: c_int, tid: *mut c_int) -> CuResult;

// ---- CUDA driver API: virtual memory management, copies, streams ----------------------------

/// `CUdeviceptr` (64-bit platforms).
pub(crate) type CuDevicePtr = c_ulonglong;
/// `CUmemGenericAllocationHandle`.
pub(crate) type CuMemHandle = c_ulonglong;
/// `CUcontext`.
pub(crate) type CuContext = *mut c_void;
/// `CUstream`.
pub(crate) type CuStream = *mut c_void;

/// `CUmemAllocationType`: `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub(crate) const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 0x1;
/// `CUmemAllocationHandleType`: `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub(crate) const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 0x1;
/// `CUmemLocationType`: `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 0x1;
/// `CUmemAccess_flags`.
pub(crate) const CU_MEM_ACCESS_FLAGS_PROT_READ: c_int = 0x1;
pub(crate) const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 0x3;
/// `CUmemAllocationGranularity_flags`.
pub(crate) const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0x0;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the current one.
pub(crate) const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x1;
/// `CU_MEMHOSTREGISTER_PORTABLE`.
pub(crate) const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x1;
/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MemLocation {
    /// `CUmemLocationType`.
    pub kind: c_int,
    pub id: c_int,
}

/// The `allocFlags` member of `CUmemAllocationProp`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MemAllocFlags {
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

/// `CUmemAllocationProp` (`CUmemAllocationProp_v1`, unchanged through CUDA 13).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MemAllocationProp {
    /// `CUmemAllocationType`.
    pub kind: c_int,
    /// `CUmemAllocationHandleType`.
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    /// Windows only; must be null elsewhere.
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: MemAllocFlags,
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MemAccessDesc {
    pub location: MemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_int,
}

const _: () = assert!(size_of::<MemLocation>() == 8);
const _: () = assert!(size_of::<MemAllocFlags>() == 8);
const _: () = assert!(size_of::<MemAllocationProp>() == 32);
const _: () = assert!(offset_of!(MemAllocationProp, requested_handle_types) == 4);
const _: () = assert!(offset_of!(MemAllocationProp, location) == 8);
const _: () = assert!(offset_of!(MemAllocationProp, win32_handle_meta_data) == 16);
const _: () = assert!(offset_of!(MemAllocationProp, alloc_flags) == 24);
const _: () = assert!(size_of::<MemAccessDesc>() == 12);
const _: () = assert!(offset_of!(MemAccessDesc, flags) == 8);

pub(crate) type CuDevicePrimaryCtxRetain =
    unsafe extern "C" fn(ctx: *mut CuContext, device: CuDevice) -> CuResult;
pub(crate) type CuDevicePrimaryCtxRelease = unsafe extern "C" fn(device: CuDevice) -> CuResult;
pub(crate) type CuCtxSetCurrent = unsafe extern "C" fn(ctx: CuContext) -> CuResult;
pub(crate) type CuCtxGetCurrent = unsafe extern "C" fn(ctx: *mut CuContext) -> CuResult;
pub(crate) type CuCtxGetDevice = unsafe extern "C" fn(device: *mut CuDevice) -> CuResult;
pub(crate) type CuDeviceCanAccessPeer =
    unsafe extern "C" fn(can_access: *mut c_int, device: CuDevice, peer: CuDevice) -> CuResult;
pub(crate) type CuMemGetAllocationGranularity = unsafe extern "C" fn(
    granularity: *mut usize,
    prop: *const MemAllocationProp,
    option: c_int,
) -> CuResult;
pub(crate) type CuMemAddressReserve = unsafe extern "C" fn(
    ptr: *mut CuDevicePtr,
    size: usize,
    alignment: usize,
    addr: CuDevicePtr,
    flags: c_ulonglong,
) -> CuResult;
pub(crate) type CuMemAddressFree = unsafe extern "C" fn(ptr: CuDevicePtr, size: usize) -> CuResult;
pub(crate) type CuMemCreate = unsafe extern "C" fn(
    handle: *mut CuMemHandle,
    size: usize,
    prop: *const MemAllocationProp,
    flags: c_ulonglong,
) -> CuResult;
pub(crate) type CuMemRelease = unsafe extern "C" fn(handle: CuMemHandle) -> CuResult;
pub(crate) type CuMemMap = unsafe extern "C" fn(
    ptr: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: CuMemHandle,
    flags: c_ulonglong,
) -> CuResult;
pub(crate) type CuMemUnmap = unsafe extern "C" fn(ptr: CuDevicePtr, size: usize) -> CuResult;
pub(crate) type CuMemSetAccess = unsafe extern "C" fn(
    ptr: CuDevicePtr,
    size: usize,
    desc: *const MemAccessDesc,
    count: usize,
) -> CuResult;
pub(crate) type CuMemExportToShareableHandle = unsafe extern "C" fn(
    shareable_handle: *mut c_void,
    handle: CuMemHandle,
    handle_type: c_int,
    flags: c_ulonglong,
) -> CuResult;
pub(crate) type CuMemImportFromShareableHandle = unsafe extern "C" fn(
    handle: *mut CuMemHandle,
    os_handle: *mut c_void,
    handle_type: c_int,
) -> CuResult;
pub(crate) type CuStreamCreate =
    unsafe extern "C" fn(stream: *mut CuStream, flags: c_uint) -> CuResult;
pub(crate) type CuStreamSynchronize = unsafe extern "C" fn(stream: CuStream) -> CuResult;
pub(crate) type CuStreamDestroy = unsafe extern "C" fn(stream: CuStream) -> CuResult;
pub(crate) type CuMemcpyHtoDAsync = unsafe extern "C" fn(
    dst: CuDevicePtr,
    src: *const c_void,
    bytes: usize,
    stream: CuStream,
) -> CuResult;
pub(crate) type CuMemcpyDtoHAsync = unsafe extern "C" fn(
    dst: *mut c_void,
    src: CuDevicePtr,
    bytes: usize,
    stream: CuStream,
) -> CuResult;
pub(crate) type CuMemcpyDtoDAsync = unsafe extern "C" fn(
    dst: CuDevicePtr,
    src: CuDevicePtr,
    bytes: usize,
    stream: CuStream,
) -> CuResult;
pub(crate) type CuMemsetD8 =
    unsafe extern "C" fn(dst: CuDevicePtr, value: u8, count: usize) -> CuResult;
pub(crate) type CuCtxSynchronize = unsafe extern "C" fn() -> CuResult;
pub(crate) type CuMemHostAlloc =
    unsafe extern "C" fn(ptr: *mut *mut c_void, bytes: usize, flags: c_uint) -> CuResult;
pub(crate) type CuMemFreeHost = unsafe extern "C" fn(ptr: *mut c_void) -> CuResult;
pub(crate) type CuMemHostRegister =
    unsafe extern "C" fn(ptr: *mut c_void, bytes: usize, flags: c_uint) -> CuResult;
pub(crate) type CuMemHostUnregister = unsafe extern "C" fn(ptr: *mut c_void) -> CuResult;

// ---- NVML -----------------------------------------------------------------------------------

/// `nvmlReturn_t`.
pub(crate) type NvmlReturn = c_uint;
/// `nvmlDevice_t`.
pub(crate) type NvmlDevice = *mut c_void;

pub(crate) const NVML_SUCCESS: NvmlReturn = 0;
pub(crate) const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub(crate) const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
pub(crate) const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub(crate) const NVML_ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub(crate) const NVML_ERROR_GPU_IS_LOST: NvmlReturn = 15;
/// `usedGpuMemory` when NVML cannot tell.
pub(crate) const NVML_VALUE_NOT_AVAILABLE: c_ulonglong = u64::MAX;
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`.
pub(crate) const NVML_DRIVER_VERSION_LEN: usize = 80;
/// `NVML_DEVICE_NAME_V2_BUFFER_SIZE`.
pub(crate) const NVML_NAME_LEN: usize = 96;
/// `NVML_DEVICE_UUID_V2_BUFFER_SIZE`.
pub(crate) const NVML_UUID_LEN: usize = 96;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct NvmlMemory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlProcessInfo_t` (the `_v3` process queries fill this one).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct NvmlProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

const _: () = assert!(size_of::<NvmlMemory>() == 24);
const _: () = assert!(size_of::<NvmlProcessInfo>() == 24);
const _: () = assert!(offset_of!(NvmlProcessInfo, used_gpu_memory) == 8);

pub(crate) type NvmlInit = unsafe extern "C" fn() -> NvmlReturn;
pub(crate) type NvmlShutdown = unsafe extern "C" fn() -> NvmlReturn;
pub(crate) type NvmlErrorString = unsafe extern "C" fn(result: NvmlReturn) -> *const c_char;
pub(crate) type NvmlSystemGetDriverVersion =
    unsafe extern "C" fn(version: *mut c_char, len: c_uint) -> NvmlReturn;
pub(crate) type NvmlDeviceGetCount = unsafe extern "C" fn(count: *mut c_uint) -> NvmlReturn;
pub(crate) type NvmlDeviceGetHandleByIndex =
    unsafe extern "C" fn(index: c_uint, device: *mut NvmlDevice) -> NvmlReturn;
pub(crate) type NvmlDeviceGetString =
    unsafe extern "C" fn(device: NvmlDevice, out: *mut c_char, len: c_uint) -> NvmlReturn;
pub(crate) type NvmlDeviceGetMemoryInfo =
    unsafe extern "C" fn(device: NvmlDevice, memory: *mut NvmlMemory) -> NvmlReturn;
pub(crate) type NvmlDeviceGetComputeRunningProcesses = unsafe extern "C" fn(
    device: NvmlDevice,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn;
