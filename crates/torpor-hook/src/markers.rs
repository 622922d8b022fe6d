//! Records, where `torpor snapshot` can see them from outside, the GPU state this process holds
//! that the driver's checkpoint cannot restore (see [`torpor_cuda::unsupported`]).
//!
//! Nothing in /proc shows that a process opened another's GPU memory through CUDA IPC, and the
//! driver checkpoints such a process without complaint and then cannot restore it. So the calls
//! that create such state are defined here too, and each success opens (once) a memfd named after
//! the kind of state: `/proc/PID/fd` then names it, and the snapshot refuses the tree before the
//! driver is touched. State that can be let go closes its marker again: the last
//! `cudaIpcCloseMemHandle` closes the import marker, and destroying the last multi-rank NCCL
//! communicator closes that one, so a program that lets go before its snapshot is snapshotted.
//!
//! These definitions work with `LD_PRELOAD` alone: they never change what the call does, they
//! only watch its result. Calls the runtime makes through `cuGetProcAddress` are not seen (that
//! is why the runtime's names are defined as well as the driver's).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

use torpor_cuda::unsupported::Unsupported;

use crate::interpose::{guarded, next_fn, Next, NOT_INITIALIZED};

/// The open marker fd of each kind (-1: none), and how many holds keep it open.
struct Marker {
    fd: AtomicI32,
    holds: Mutex<usize>,
}

impl Marker {
    const fn new() -> Self {
        Marker {
            fd: AtomicI32::new(-1),
            holds: Mutex::new(0),
        }
    }
}

static IPC_IMPORT: Marker = Marker::new();
static IPC_EXPORT: Marker = Marker::new();
static MANAGED: Marker = Marker::new();
static NCCL: Marker = Marker::new();
/// The multi-rank NCCL communicators alive, by handle.
static NCCL_COMMS: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn marker(kind: Unsupported) -> &'static Marker {
    match kind {
        Unsupported::IpcImport => &IPC_IMPORT,
        Unsupported::IpcExport => &IPC_EXPORT,
        Unsupported::Managed => &MANAGED,
        Unsupported::MultiRankNccl => &NCCL,
    }
}

/// One more hold of `kind`: opens its marker if none is open.
pub fn hold(kind: Unsupported) {
    let m = marker(kind);
    let mut holds = m.holds.lock().unwrap_or_else(|e| e.into_inner());
    *holds += 1;
    if m.fd.load(Ordering::Acquire) < 0 {
        let name = std::ffi::CString::new(kind.marker()).expect("marker names have no NUL");
        // SAFETY: name is a valid C string; memfd_create returns a new fd or -1. Close-on-exec:
        // a program exec'd by this one holds nothing of this process's GPU state.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        m.fd.store(fd, Ordering::Release);
    }
}

/// One hold of `kind` less: closes its marker when none is left.
pub fn release(kind: Unsupported) {
    let m = marker(kind);
    let mut holds = m.holds.lock().unwrap_or_else(|e| e.into_inner());
    *holds = holds.saturating_sub(1);
    if *holds == 0 {
        let fd = m.fd.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the fd is the marker this module opened and nobody else uses.
            unsafe { libc::close(fd) };
        }
    }
}

/// Whether a marker of `kind` is open in this process.
pub fn is_held(kind: Unsupported) -> bool {
    marker(kind).fd.load(Ordering::Acquire) >= 0
}

/// `cudaIpcMemHandle_t`, `cudaIpcEventHandle_t`, `CUipcMemHandle`: 64 opaque bytes, by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    pub reserved: [u8; 64],
}

/// `ncclUniqueId`: 128 opaque bytes, by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: [u8; 128],
}

/// Calls the next definition and holds `kind` when it succeeds (returns 0).
fn watch(kind: Unsupported, code: c_int, on_success: fn(Unsupported)) -> c_int {
    if code == 0 {
        on_success(kind);
    }
    code
}

static NEXT_CUDA_IPC_OPEN_MEM: Next = Next::new(c"cudaIpcOpenMemHandle");
static NEXT_CUDA_IPC_CLOSE_MEM: Next = Next::new(c"cudaIpcCloseMemHandle");
static NEXT_CUDA_IPC_GET_MEM: Next = Next::new(c"cudaIpcGetMemHandle");
static NEXT_CUDA_IPC_OPEN_EVENT: Next = Next::new(c"cudaIpcOpenEventHandle");
static NEXT_CUDA_IPC_GET_EVENT: Next = Next::new(c"cudaIpcGetEventHandle");
static NEXT_CU_IPC_OPEN_MEM: Next = Next::new(c"cuIpcOpenMemHandle_v2");
static NEXT_CU_IPC_CLOSE_MEM: Next = Next::new(c"cuIpcCloseMemHandle");
static NEXT_CU_IPC_GET_MEM: Next = Next::new(c"cuIpcGetMemHandle");
static NEXT_CUDA_MALLOC_MANAGED: Next = Next::new(c"cudaMallocManaged");
static NEXT_CU_MEM_ALLOC_MANAGED: Next = Next::new(c"cuMemAllocManaged");
static NEXT_NCCL_INIT_RANK: Next = Next::new(c"ncclCommInitRank");
static NEXT_NCCL_INIT_RANK_CONFIG: Next = Next::new(c"ncclCommInitRankConfig");
static NEXT_NCCL_DESTROY: Next = Next::new(c"ncclCommDestroy");
static NEXT_NCCL_ABORT: Next = Next::new(c"ncclCommAbort");

type NcclInitRank = unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int) -> c_int;
type NcclInitRankConfig =
    unsafe extern "C" fn(*mut *mut c_void, c_int, NcclUniqueId, c_int, *mut c_void) -> c_int;
type NcclComm = unsafe extern "C" fn(*mut c_void) -> c_int;

/// `ncclInternalError`: what NCCL returns when its own symbol is missing.
const NCCL_INTERNAL_ERROR: c_int = 3;

/// Defines `$name`, which calls the next definition of the same name with the caller's
/// arguments and, when it succeeds, calls `$then($kind)`.
macro_rules! watched {
    ($(#[$doc:meta])* $name:ident, $next:ident, $kind:expr, $then:ident, ($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As for the library's own definition of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            guarded(stringify!($name), NOT_INITIALIZED, || {
                match next_fn!($next, unsafe extern "C" fn($($ty),*) -> c_int) {
                    // SAFETY: the caller's arguments, passed on unchanged.
                    Some(next) => watch($kind, unsafe { next($($arg),*) }, $then),
                    None => NOT_INITIALIZED,
                }
            })
        }
    };
}

watched!(
    /// `cudaIpcOpenMemHandle` (libcudart).
    cudaIpcOpenMemHandle, NEXT_CUDA_IPC_OPEN_MEM, Unsupported::IpcImport, hold,
    (dev_ptr: *mut *mut c_void, handle: IpcHandle, flags: c_uint)
);
watched!(
    /// `cudaIpcCloseMemHandle` (libcudart).
    cudaIpcCloseMemHandle, NEXT_CUDA_IPC_CLOSE_MEM, Unsupported::IpcImport, release,
    (dev_ptr: *mut c_void)
);
watched!(
    /// `cudaIpcGetMemHandle` (libcudart).
    cudaIpcGetMemHandle, NEXT_CUDA_IPC_GET_MEM, Unsupported::IpcExport, hold,
    (handle: *mut IpcHandle, dev_ptr: *mut c_void)
);
watched!(
    /// `cudaIpcOpenEventHandle` (libcudart).
    cudaIpcOpenEventHandle, NEXT_CUDA_IPC_OPEN_EVENT, Unsupported::IpcImport, hold,
    (event: *mut *mut c_void, handle: IpcHandle)
);
watched!(
    /// `cudaIpcGetEventHandle` (libcudart).
    cudaIpcGetEventHandle, NEXT_CUDA_IPC_GET_EVENT, Unsupported::IpcExport, hold,
    (handle: *mut IpcHandle, event: *mut c_void)
);
watched!(
    /// `cuIpcOpenMemHandle_v2` (libcuda; `cuIpcOpenMemHandle` in cuda.h).
    cuIpcOpenMemHandle_v2, NEXT_CU_IPC_OPEN_MEM, Unsupported::IpcImport, hold,
    (dptr: *mut u64, handle: IpcHandle, flags: c_uint)
);
watched!(
    /// `cuIpcCloseMemHandle` (libcuda).
    cuIpcCloseMemHandle, NEXT_CU_IPC_CLOSE_MEM, Unsupported::IpcImport, release,
    (dptr: u64)
);
watched!(
    /// `cuIpcGetMemHandle` (libcuda).
    cuIpcGetMemHandle, NEXT_CU_IPC_GET_MEM, Unsupported::IpcExport, hold,
    (handle: *mut IpcHandle, dptr: u64)
);
watched!(
    /// `cudaMallocManaged` (libcudart).
    cudaMallocManaged, NEXT_CUDA_MALLOC_MANAGED, Unsupported::Managed, hold,
    (dev_ptr: *mut *mut c_void, size: usize, flags: c_uint)
);
watched!(
    /// `cuMemAllocManaged` (libcuda).
    cuMemAllocManaged, NEXT_CU_MEM_ALLOC_MANAGED, Unsupported::Managed, hold,
    (dptr: *mut u64, size: usize, flags: c_uint)
);

/// Holds the NCCL marker for a new communicator of `nranks` ranks.
fn nccl_created(code: c_int, comm: *mut *mut c_void, nranks: c_int) -> c_int {
    if code == 0 && nranks > 1 && !comm.is_null() {
        // SAFETY: on success NCCL wrote the new communicator's handle through `comm`.
        let handle = unsafe { *comm } as usize;
        NCCL_COMMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
        hold(Unsupported::MultiRankNccl);
    }
    code
}

/// Releases the NCCL marker's hold of `comm` once it is destroyed or aborted.
fn nccl_gone(code: c_int, comm: *mut c_void) -> c_int {
    if code == 0 {
        let mut comms = NCCL_COMMS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = comms.iter().position(|&c| c == comm as usize) {
            comms.swap_remove(i);
            drop(comms);
            release(Unsupported::MultiRankNccl);
        }
    }
    code
}

/// `ncclCommInitRank` (libnccl).
///
/// # Safety
/// As for libnccl's `ncclCommInitRank`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    guarded("ncclCommInitRank", NCCL_INTERNAL_ERROR, || {
        match next_fn!(NEXT_NCCL_INIT_RANK, NcclInitRank) {
            // SAFETY: the caller's arguments, passed on unchanged.
            Some(next) => nccl_created(unsafe { next(comm, nranks, id, rank) }, comm, nranks),
            None => NCCL_INTERNAL_ERROR,
        }
    })
}

/// `ncclCommInitRankConfig` (libnccl; what PyTorch calls).
///
/// # Safety
/// As for libnccl's `ncclCommInitRankConfig`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> c_int {
    guarded("ncclCommInitRankConfig", NCCL_INTERNAL_ERROR, || {
        match next_fn!(NEXT_NCCL_INIT_RANK_CONFIG, NcclInitRankConfig) {
            Some(next) => {
                // SAFETY: the caller's arguments, passed on unchanged.
                nccl_created(
                    unsafe { next(comm, nranks, id, rank, config) },
                    comm,
                    nranks,
                )
            }
            None => NCCL_INTERNAL_ERROR,
        }
    })
}

/// `ncclCommDestroy` (libnccl).
///
/// # Safety
/// As for libnccl's `ncclCommDestroy`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    guarded("ncclCommDestroy", NCCL_INTERNAL_ERROR, || {
        match next_fn!(NEXT_NCCL_DESTROY, NcclComm) {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(next) => nccl_gone(unsafe { next(comm) }, comm),
            None => NCCL_INTERNAL_ERROR,
        }
    })
}

/// `ncclCommAbort` (libnccl).
///
/// # Safety
/// As for libnccl's `ncclCommAbort`.
#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    guarded("ncclCommAbort", NCCL_INTERNAL_ERROR, || {
        match next_fn!(NEXT_NCCL_ABORT, NcclComm) {
            // SAFETY: the caller's argument, passed on unchanged.
            Some(next) => nccl_gone(unsafe { next(comm) }, comm),
            None => NCCL_INTERNAL_ERROR,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .map(|t| t.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn holds_open_one_marker_until_the_last_release() {
        let kind = Unsupported::IpcExport;
        let shown = || {
            fd_names()
                .iter()
                .any(|t| Unsupported::from_fd_target(t) == Some(kind))
        };
        assert!(!is_held(kind) && !shown());
        hold(kind);
        hold(kind);
        assert!(is_held(kind) && shown());
        release(kind);
        assert!(is_held(kind), "one hold is left");
        release(kind);
        assert!(!is_held(kind) && !shown());
        release(kind); // one release too many is harmless
        assert!(!is_held(kind));
    }

    #[test]
    fn nccl_marker_follows_multi_rank_communicators_only() {
        let mut a: *mut c_void = 0x1000 as *mut c_void;
        let mut b: *mut c_void = 0x2000 as *mut c_void;
        assert_eq!(nccl_created(0, &mut a, 1), 0);
        assert!(!is_held(Unsupported::MultiRankNccl), "world size 1 is fine");
        nccl_created(0, &mut a, 2);
        nccl_created(0, &mut b, 4);
        nccl_created(5, &mut b, 4); // a failed init holds nothing
        assert!(is_held(Unsupported::MultiRankNccl));
        nccl_gone(0, a);
        assert!(is_held(Unsupported::MultiRankNccl));
        nccl_gone(0, 0x3000 as *mut c_void); // unknown comm: no change
        assert!(is_held(Unsupported::MultiRankNccl));
        nccl_gone(0, b);
        assert!(!is_held(Unsupported::MultiRankNccl));
    }
}
