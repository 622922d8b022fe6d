//! Errors of the device operations. Each message names the cause and the fix on one line.

use std::io;

use torpor_cuda::CudaError;

/// A device operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// A size of zero bytes.
    #[error("{what} is 0 bytes: give a size of at least one granule ({granularity} bytes)")]
    ZeroSize {
        what: &'static str,
        granularity: usize,
    },

    /// A size, offset or address that is not a multiple of the device's granularity.
    #[error(
        "{what} {value:#x} is not a multiple of the {backend} device's granularity \
         ({granularity:#x} bytes): round it up to a whole number of granules"
    )]
    Misaligned {
        backend: &'static str,
        what: &'static str,
        value: u64,
        granularity: usize,
    },

    /// A reservation at a chosen address that could not be had there.
    #[error(
        "cannot reserve {len:#x} bytes at {at:#x}: part of that range is already in use in this \
         process; reserve elsewhere, or free what holds it first"
    )]
    AddressInUse { at: u64, len: usize },

    /// A mapping or copy outside every reservation of this device.
    #[error(
        "{at:#x}..{:#x} is not inside one reservation of this device: reserve the range first \
         (Device::reserve) and map within it",
        at.saturating_add(*len as u64)
    )]
    NotReserved { at: u64, len: usize },

    /// A mapping over a range that is already mapped.
    #[error(
        "{at:#x}..{:#x} overlaps memory already mapped there: unmap it first (Device::unmap)",
        at.saturating_add(*len as u64)
    )]
    AlreadyMapped { at: u64, len: usize },

    /// An unmap or copy of a range that is not one mapping of this device.
    #[error(
        "{at:#x}..{:#x} is not mapped by this device as one mapping: give the exact address and \
         size a Device::map call used (copies must stay inside one mapping)",
        at.saturating_add(*len as u64)
    )]
    NotMapped { at: u64, len: usize },

    /// A reservation freed while memory is still mapped in it.
    #[error(
        "the reservation at {at:#x} still has {mappings} mapping(s) in it: unmap them before \
         freeing it"
    )]
    StillMapped { at: u64, mappings: usize },

    /// A write to a range mapped read-only.
    #[error(
        "{at:#x} is mapped read-only: shared read-only segments cannot be written; copy the data \
         into a writable segment instead"
    )]
    ReadOnly { at: u64 },

    /// A writable mapping of memory sealed read-only.
    #[error(
        "the memory is sealed read-only (it is shared between instances): map it with \
         Access::ReadOnly"
    )]
    Sealed,

    /// Sealing memory that still has a writable mapping somewhere.
    #[error(
        "cannot seal the memory read-only while a writable mapping of it exists: unmap the \
         writable mapping (in every process) first, then seal"
    )]
    WritableMappingExists,

    /// An imported fd whose size differs from the size the caller expects.
    #[error(
        "the fd holds {actual:#x} bytes but {expected:#x} were expected: the exporter and the \
         importer disagree about the segment's size; check the manifest"
    )]
    SizeMismatch { expected: usize, actual: u64 },

    /// An fd that is not memory exported by this backend.
    #[error(
        "fd {fd} is not {backend} device memory ({reason}): pass an fd made by Device::export"
    )]
    NotDeviceMemory {
        backend: &'static str,
        fd: i32,
        reason: String,
    },

    /// A write past the end of the memory it targets.
    #[error(
        "a write of {len:#x} bytes at offset {offset:#x} runs past the memory's {size:#x} bytes: \
         report this as a Torpor bug"
    )]
    OutOfRange {
        offset: usize,
        len: usize,
        size: usize,
    },

    /// A system call failed.
    #[error("{call} failed: {source}; {hint}")]
    Os {
        call: &'static str,
        hint: &'static str,
        #[source]
        source: io::Error,
    },

    /// A CUDA driver call failed.
    #[error("{0}")]
    Cuda(#[from] CudaError),
}

impl DeviceError {
    pub(crate) fn os(call: &'static str, hint: &'static str) -> Self {
        DeviceError::Os {
            call,
            hint,
            source: io::Error::last_os_error(),
        }
    }
}
