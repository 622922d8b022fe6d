//! The C API the worker harness binds (`python/torpor/hook.py`, with ctypes). Stable: change
//! only by adding, and bump [`TORPOR_HOOK_ABI_VERSION`] when a change is not compatible.
//!
//! ```c
//! struct torpor_hook_segment {
//!     uint64_t va;          /* start address */
//!     uint64_t size;        /* bytes, a multiple of the backend's granularity */
//!     uint64_t order;       /* creation order: 0, 1, 2, ... */
//!     int64_t  first_use;   /* place in first-use order, -1 while unused */
//!     uint32_t backend;     /* 0 host (memfd), 1 cuda */
//!     int32_t  ordinal;     /* the GPU's CUDA ordinal; -1 for host */
//!     uint32_t mapped;      /* 1 holds memory, 0 released */
//!     uint32_t read_only;   /* 1 mapped read-only */
//! };
//!
//! uint32_t    torpor_hook_abi_version(void);
//! int         torpor_hook_host_alloc(size_t size, uint64_t *va);  /* memfd segment, read-write */
//! int         torpor_hook_host_free(uint64_t va);
//! int         torpor_hook_seal(uint64_t va);            /* host segment -> read-only for good */
//! int         torpor_hook_mark_first_use(uint64_t addr);   /* any address inside a segment */
//! size_t      torpor_hook_list(struct torpor_hook_segment *out, size_t capacity);
//! int         torpor_hook_export(uint64_t va);          /* a new fd (the caller closes it) */
//! int         torpor_hook_release_all(uint64_t *bytes); /* synchronise, unmap, keep the VAs */
//! int         torpor_hook_release(uint64_t va);          /* one segment, as release_all */
//! int         torpor_hook_map(uint64_t va, int fd, int read_only);   /* fd stays the caller's */
//! int         torpor_hook_cuda_reserve(size_t size, uint64_t *va);  /* released, no memory */
//! const char *torpor_hook_last_error(void);
//! ```
//!
//! Every `int` function returns 0 (or the fd) on success and -1 on failure, with the reason in
//! `torpor_hook_last_error()` (per thread, valid until the next failure on that thread). Every
//! function is safe to call from any thread; none unwinds into the caller.

use std::ffi::{c_char, c_int};
use std::os::fd::BorrowedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{last_error_ptr, set_last_error, HookError};
use crate::hook::hook;
use crate::segments::{Backend, SegmentInfo};

/// The version of this API; `torpor_hook_abi_version` returns it.
pub const TORPOR_HOOK_ABI_VERSION: u32 = 2;

/// One segment as `torpor_hook_list` reports it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorporHookSegment {
    pub va: u64,
    pub size: u64,
    pub order: u64,
    pub first_use: i64,
    pub backend: u32,
    pub ordinal: i32,
    pub mapped: u32,
    pub read_only: u32,
}

impl From<SegmentInfo> for TorporHookSegment {
    fn from(s: SegmentInfo) -> Self {
        let (backend, ordinal) = match s.backend {
            Backend::Host => (0, -1),
            Backend::Cuda { ordinal } => (1, ordinal),
        };
        TorporHookSegment {
            va: s.va,
            size: s.size as u64,
            order: s.order,
            first_use: s.first_use.map_or(-1, |n| n as i64),
            backend,
            ordinal,
            mapped: u32::from(s.mapped),
            read_only: u32::from(s.read_only),
        }
    }
}

/// Runs `f`; an error or a panic becomes -1 with the last error set.
fn call(name: &'static str, f: impl FnOnce() -> Result<c_int, HookError>) -> c_int {
    let result =
        catch_unwind(AssertUnwindSafe(f)).unwrap_or(Err(HookError::Panicked { call: name }));
    result.unwrap_or_else(|e| {
        set_last_error(&e);
        -1
    })
}

#[no_mangle]
pub extern "C" fn torpor_hook_abi_version() -> u32 {
    TORPOR_HOOK_ABI_VERSION
}

/// A new host segment of at least `size` bytes (rounded up to pages), mapped read-write, its
/// start written to `*va`.
///
/// # Safety
/// `va` is valid for writing one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn torpor_hook_host_alloc(size: usize, va: *mut u64) -> c_int {
    call("torpor_hook_host_alloc", || {
        let segment = hook().alloc_host(size)?;
        // SAFETY: per the contract.
        unsafe { *va = segment.va };
        Ok(0)
    })
}

/// A new released cuda segment of at least `size` bytes of addresses on the current context's
/// GPU, holding no memory, its start written to `*va` (ABI 2): where `torpor_hook_map` puts memory the
/// daemon hands over (platform-managed GPU data) without allocating any first.
///
/// # Safety
/// `va` is valid for writing one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn torpor_hook_cuda_reserve(size: usize, va: *mut u64) -> c_int {
    call("torpor_hook_cuda_reserve", || {
        // As a cuMemAlloc would be: cuda segments are the split GPU path's only.
        if !crate::hook::cuda_interposition_enabled() {
            return Err(HookError::CudaUnavailable {
                reason: "TORPOR_HOOK_CUDA=1 is not set: the worker runs off the split GPU path"
                    .into(),
            });
        }
        let hook = hook();
        let ordinal = hook.driver()?.vmm()?.current_device()?;
        let segment = hook.keeping_context(|| {
            let device = hook.cuda_device(ordinal)?;
            hook.reserve_cuda(&device, ordinal, size)
        })?;
        // SAFETY: per the contract.
        unsafe { *va = segment.va };
        Ok(0)
    })
}

/// Frees the host segment at `va` (its addresses too).
#[no_mangle]
pub extern "C" fn torpor_hook_host_free(va: u64) -> c_int {
    call("torpor_hook_host_free", || hook().free_host(va).map(|()| 0))
}

/// Makes the host segment at `va` read-only for good (the memfd is sealed, the mapping becomes
/// read-only): declared read-only data that instances may share. A write then faults.
#[no_mangle]
pub extern "C" fn torpor_hook_seal(va: u64) -> c_int {
    call("torpor_hook_seal", || hook().seal_host(va).map(|()| 0))
}

/// Gives the segment holding `addr` the next place in first-use order (once).
#[no_mangle]
pub extern "C" fn torpor_hook_mark_first_use(addr: u64) -> c_int {
    call("torpor_hook_mark_first_use", || {
        hook().mark_first_use(addr).map(|_| 0)
    })
}

/// Writes up to `capacity` segments, in creation order, to `out`; returns how many there are
/// (call again with a larger buffer when that is more than `capacity`).
///
/// # Safety
/// `out` is valid for writing `capacity` segments (or `capacity` is 0).
#[no_mangle]
pub unsafe extern "C" fn torpor_hook_list(out: *mut TorporHookSegment, capacity: usize) -> usize {
    catch_unwind(AssertUnwindSafe(|| {
        let all = hook().list();
        for (i, segment) in all.iter().take(capacity).enumerate() {
            // SAFETY: i < capacity, and `out` holds `capacity` entries per the contract.
            unsafe { out.add(i).write(TorporHookSegment::from(*segment)) };
        }
        all.len()
    }))
    .unwrap_or(0)
}

/// A new fd for the memory of the segment at `va` (the caller owns it), or -1.
#[no_mangle]
pub extern "C" fn torpor_hook_export(va: u64) -> c_int {
    call("torpor_hook_export", || {
        hook().keeping_context(|| hook().export(va))
    })
}

/// Releases every segment's memory and keeps its addresses (GPUs synchronised first); the
/// bytes released are written to `*bytes` when it is not null.
///
/// # Safety
/// `bytes` is null or valid for writing one `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn torpor_hook_release_all(bytes: *mut u64) -> c_int {
    call("torpor_hook_release_all", || {
        let released = hook().keeping_context(|| hook().release_all())?;
        if !bytes.is_null() {
            // SAFETY: per the contract.
            unsafe { *bytes = released };
        }
        Ok(0)
    })
}

/// Releases the memory of the segment starting at `va` and keeps its addresses (its GPU
/// synchronised first), as `torpor_hook_release_all` does for every segment.
#[no_mangle]
pub extern "C" fn torpor_hook_release(va: u64) -> c_int {
    call("torpor_hook_release", || {
        hook().keeping_context(|| hook().release(va)).map(|_| 0)
    })
}

/// Maps the memory behind `fd` into the released segment at `va`, read-only when `read_only`
/// is non-zero. The fd stays open and the caller's.
#[no_mangle]
pub extern "C" fn torpor_hook_map(va: u64, fd: c_int, read_only: c_int) -> c_int {
    call("torpor_hook_map", || {
        // SAFETY: F_GETFD only asks whether the descriptor is open.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(HookError::BadFd { fd });
        }
        // SAFETY: `fd` is open (checked above) and borrowed only for this call.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        hook()
            .keeping_context(|| hook().map(va, fd, read_only != 0))
            .map(|()| 0)
    })
}

/// This thread's last error: empty when nothing failed yet. Valid until the next failing call
/// on this thread.
#[no_mangle]
pub extern "C" fn torpor_hook_last_error() -> *const c_char {
    last_error_ptr()
}
