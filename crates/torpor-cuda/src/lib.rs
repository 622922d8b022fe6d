//! The CUDA driver's process checkpoint API, its virtual memory management calls ([`Vmm`]) and
//! NVML, loaded at run time.
//!
//! Torpor must build, test and run on machines without a GPU, so nothing here links against the
//! NVIDIA libraries: [`CudaDriver`] opens `libcuda.so.1` and [`Nvml`] opens `libnvidia-ml.so.1`
//! with `dlopen` when they are asked for, and a missing library is an ordinary error. The paths can
//! be overridden with the environment variables [`LIBCUDA_ENV`] (`TORPOR_LIBCUDA`) and
//! [`LIBNVML_ENV`] (`TORPOR_LIBNVML`); the tests point them at the fake drivers in `tests/fakes/`.
//!
//! # Why not `cudarc`
//!
//! The design named `cudarc`'s dynamic loading for the plain driver calls. It was checked (0.19.10,
//! features `driver`, `dynamic-loading`, `cuda-13000`): it adds about 8 s to a clean build on two
//! cores, which would be acceptable, but its loader panics (`panic_no_lib_found`) when
//! `libcuda.so` is absent and on any missing symbol, resolves the library from a fixed list of
//! names into a process-wide `OnceLock`, and so can neither be pointed at a fake driver nor at a
//! driver in an unusual place. Torpor needs an error, not a panic, on a machine without a GPU, and
//! one library handle for both the plain and the checkpoint calls, so every symbol here is
//! resolved with `libloading` from the one library the user chose.
//!
//! # What the real driver does (H100, driver 580.159.04, CUDA 13.0)
//!
//! Read off the real driver with `cuInit(0)` done in the calling process:
//! - `cuCheckpointProcessGetState` (and every other checkpoint call) on a live process that has
//!   not initialised CUDA returns `CUDA_ERROR_NOT_INITIALIZED` (3); on a pid that does not exist,
//!   or on pid 0 or -1, it returns `CUDA_ERROR_OPERATING_SYSTEM` (304). The calling process itself
//!   counts as a CUDA process (state running) once it has called `cuInit`.
//! - A lock that times out returns `CUDA_ERROR_NOT_READY` (600), not `CUDA_ERROR_TIMEOUT` (909);
//!   both are reported as [`CudaError::Timeout`]. The process stays running.
//! - The state machine is strict: lock needs running, checkpoint needs locked, restore needs
//!   checkpointed (and leaves the process locked), unlock needs locked; any other order returns
//!   `CUDA_ERROR_ILLEGAL_STATE` (401). In particular a checkpointed process cannot be unlocked: a
//!   rollback after a checkpoint is restore, then unlock.
//! - Restore accepts a GPU pair list; a pair mapping a GPU onto itself works. When pairs are given
//!   they must name every GPU the process had (NVIDIA's documentation).
//! - `cuDeviceGetUuid_v2` returns the 16 bytes that `nvidia-smi` prints as
//!   `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, in the same order ([`GpuUuid`]).
//! - NVML's total memory (85520809984 bytes on the H100) is larger than `cuDeviceTotalMem_v2`'s
//!   (85017493504); a checkpointed process no longer appears in NVML's process list.
//!
//! `gpu-check/run.sh` repeats these observations with the `cuda_probe` example on a GPU machine;
//! the fake drivers in `tests/fakes/` (built by [`fakes::build`]) reproduce them without one.

mod driver;
mod error;
mod ffi;
mod library;
mod nvml;
pub mod unsupported;
mod uuid;
mod vmm;

pub mod fakes;

pub use driver::{CudaDriver, GpuDevice, ProcessState};
pub use error::CudaError;
pub use nvml::{GpuProcess, Nvml, NvmlGpu};
pub use uuid::{GpuUuid, ParseGpuUuidError};
pub use vmm::{AllocationHandle, MemAccess, PrimaryContext, SavedContext, Stream, Vmm};

/// Environment variable that overrides the path of the CUDA driver library.
pub const LIBCUDA_ENV: &str = "TORPOR_LIBCUDA";
/// The CUDA driver library opened when [`LIBCUDA_ENV`] is not set.
pub const DEFAULT_LIBCUDA: &str = "libcuda.so.1";
/// Environment variable that overrides the path of the NVML library.
pub const LIBNVML_ENV: &str = "TORPOR_LIBNVML";
/// The NVML library opened when [`LIBNVML_ENV`] is not set.
pub const DEFAULT_LIBNVML: &str = "libnvidia-ml.so.1";
