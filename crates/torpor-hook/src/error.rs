//! Errors of the hook's operations, and the per-thread last error the C API hands out.

use std::cell::RefCell;
use std::ffi::{c_char, CString};

use torpor_cuda::CudaError;
use torpor_device::DeviceError;

/// A hook operation that failed. Each message names the cause and the fix on one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HookError {
    /// An address that is not the start of a segment.
    #[error(
        "{va:#x} is not the start of a segment of this process: pass an address that \
         torpor_hook_list reports"
    )]
    NotASegment { va: u64 },

    /// An address that lies in no segment.
    #[error("{va:#x} lies in no segment of this process: pass an address inside a segment")]
    NotInASegment { va: u64 },

    /// An operation that needs the segment's memory, on a released segment.
    #[error(
        "the segment at {va:#x} has been released (it holds no memory): map memory there first \
         (torpor_hook_map)"
    )]
    Released { va: u64 },

    /// A map into a segment that still holds memory.
    #[error(
        "the segment at {va:#x} still holds its memory: only a released segment can be mapped \
         (torpor_hook_release_all first)"
    )]
    NotReleased { va: u64 },

    /// An operation for one backend on a segment of the other.
    #[error(
        "the segment at {va:#x} is a {actual} segment; {operation} works on {wanted} segments only"
    )]
    WrongBackend {
        va: u64,
        actual: &'static str,
        wanted: &'static str,
        operation: &'static str,
    },

    /// A descriptor that is not open.
    #[error("fd {fd} is not an open file descriptor: pass the fd the daemon sent with the frame")]
    BadFd { fd: i32 },

    /// The CUDA driver could not be used for segments.
    #[error("the CUDA driver cannot back segments: {reason}")]
    CudaUnavailable { reason: String },

    /// A device operation failed.
    #[error("{0}")]
    Device(#[from] DeviceError),

    /// A driver call failed.
    #[error("{0}")]
    Cuda(#[from] CudaError),

    /// A panic inside the hook (caught at the C boundary).
    #[error(
        "torpor-hook panicked in {call}: this is a Torpor bug; report it with the worker's stderr"
    )]
    Panicked { call: &'static str },
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `error` as this thread's last error.
pub(crate) fn set_last_error(error: &HookError) {
    // A message with a NUL in it (from a path, say) is cut there rather than lost.
    let text = error.to_string();
    let text = text.split('\0').next().unwrap_or_default();
    let message = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = message);
}

/// This thread's last error message: empty when no call has failed on this thread. The pointer
/// stays valid until the next failing call on the same thread.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// This thread's last error message, for Rust callers and tests.
pub fn last_error() -> String {
    LAST_ERROR.with(|last| last.borrow().to_string_lossy().into_owned())
}
