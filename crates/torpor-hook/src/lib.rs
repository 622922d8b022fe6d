//! Torpor's device-memory hook, `libtorpor_hook.so`: loaded into a worker so that the worker's
//! big buffers live in *segments* the split snapshot path can take out of the process and put
//! back (docs/split.md).
//!
//! - [`interpose`]: with `LD_PRELOAD` and `TORPOR_HOOK_CUDA=1` it defines `cudaMalloc`,
//!   `cudaFree`, `cuMemAlloc_v2` and `cuMemFree_v2`; allocations of at least the GPU's VMM
//!   granularity become segments of exportable device memory (the cuda backend of
//!   `torpor-device`).
//! - [`capi`]: the C API the worker harness binds with ctypes: host (memfd) segments for
//!   `torpor.buffer()` and declared data, the segment list, export, release (the snapshot step)
//!   and map (the restore step).
//! - [`segments`]: the table of every segment; [`hook`]: the process-wide state behind both.
//! - [`markers`]: with `LD_PRELOAD` alone (no variable needed), records while the process holds
//!   GPU state the driver's checkpoint cannot restore (CUDA IPC, managed memory, a NCCL
//!   communicator of several ranks), so that `torpor snapshot` refuses it before touching it.
//!
//! The library is found by the harness through `TORPOR_HOOK_LIB`, which must name the same file
//! as `LD_PRELOAD` so that both see one segment table.
//!
//! # Limitations
//!
//! - Segments are mapped for the allocating GPU only: peer access from another GPU
//!   (`cudaDeviceEnablePeerAccess`) and legacy CUDA IPC (`cudaIpcGetMemHandle`, used by
//!   `torch.multiprocessing` to share CUDA tensors) do not work on them.
//! - PyTorch's `expandable_segments` maps its own VMM memory, which the hook does not see: keep
//!   it off (the default).
//! - Calls the runtime makes through `cuGetProcAddress` (its own allocations, the stream-ordered
//!   allocator `cudaMallocAsync`) are not interposed; they stay in the driver's checkpoint.
//! - Each GPU with segments gets one CUDA stream and a 64 KiB pinned buffer of the cuda backend.

pub mod capi;
pub mod hook;
pub mod interpose;
pub mod markers;
pub mod segments;

mod error;

pub use error::{last_error, HookError};
