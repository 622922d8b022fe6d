//! The driver's virtual memory management (VMM), copy and stream calls: what a process needs to
//! hold big device buffers as exportable physical memory mapped at addresses it chooses.
//!
//! These symbols are resolved the first time [`CudaDriver::vmm`] is called, not at load, so a
//! driver (or a test's fake driver) without them still serves the checkpoint API; asking for them
//! then is [`CudaError::VmmApiMissing`].
//!
//! The calls are thin: each maps its `CUresult` to [`CudaError::Call`] and nothing more. Callers
//! (the `torpor-device` crate) keep track of what is reserved and mapped. Every call acts in the
//! calling thread's current context: call [`Vmm::set_current`] first on each thread.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::driver::CudaDriver;
use crate::error::CudaError;
use crate::ffi;
use crate::library::Loaded;

/// The function pointers of the VMM, copy and stream calls.
pub(crate) struct VmmApi {
    primary_ctx_retain: ffi::CuDevicePrimaryCtxRetain,
    primary_ctx_release: ffi::CuDevicePrimaryCtxRelease,
    ctx_set_current: ffi::CuCtxSetCurrent,
    ctx_synchronize: ffi::CuCtxSynchronize,
    ctx_get_current: ffi::CuCtxGetCurrent,
    ctx_get_device: ffi::CuCtxGetDevice,
    get_granularity: ffi::CuMemGetAllocationGranularity,
    address_reserve: ffi::CuMemAddressReserve,
    address_free: ffi::CuMemAddressFree,
    create: ffi::CuMemCreate,
    release: ffi::CuMemRelease,
    map: ffi::CuMemMap,
    unmap: ffi::CuMemUnmap,
    set_access: ffi::CuMemSetAccess,
    export: ffi::CuMemExportToShareableHandle,
    import: ffi::CuMemImportFromShareableHandle,
    stream_create: ffi::CuStreamCreate,
    stream_synchronize: ffi::CuStreamSynchronize,
    stream_destroy: ffi::CuStreamDestroy,
    memcpy_htod_async: ffi::CuMemcpyHtoDAsync,
    memcpy_dtoh_async: ffi::CuMemcpyDtoHAsync,
    memcpy_dtod_async: ffi::CuMemcpyDtoDAsync,
    memset_d8: ffi::CuMemsetD8,
    host_alloc: ffi::CuMemHostAlloc,
    free_host: ffi::CuMemFreeHost,
    host_register: ffi::CuMemHostRegister,
    host_unregister: ffi::CuMemHostUnregister,
    /// Optional: a driver (or fake) without it has no peer path ([`Vmm::can_access_peer`]).
    can_access_peer: Option<ffi::CuDeviceCanAccessPeer>,
}

impl VmmApi {
    /// Resolves every symbol, or names the first one the library lacks.
    pub(crate) fn resolve(library: &Loaded) -> Result<Self, &'static str> {
        /// Looks a symbol up, returning its name as the error when it is absent.
        ///
        /// # Safety
        /// `T` must be the `ffi` alias written from the symbol's declaration in cuda.h.
        unsafe fn sym<T: Copy>(library: &Loaded, name: &'static str) -> Result<T, &'static str> {
            // SAFETY: forwarded from the caller.
            unsafe { library.get(name) }.ok_or(name)
        }
        // SAFETY: each name below is paired with the `ffi` alias of its cuda.h declaration; the
        // `_v2` names are the ones cuda.h's macros select for the unversioned calls.
        unsafe {
            Ok(VmmApi {
                primary_ctx_retain: sym(library, "cuDevicePrimaryCtxRetain")?,
                primary_ctx_release: sym(library, "cuDevicePrimaryCtxRelease_v2")?,
                ctx_set_current: sym(library, "cuCtxSetCurrent")?,
                ctx_synchronize: sym(library, "cuCtxSynchronize")?,
                ctx_get_current: sym(library, "cuCtxGetCurrent")?,
                ctx_get_device: sym(library, "cuCtxGetDevice")?,
                get_granularity: sym(library, "cuMemGetAllocationGranularity")?,
                address_reserve: sym(library, "cuMemAddressReserve")?,
                address_free: sym(library, "cuMemAddressFree")?,
                create: sym(library, "cuMemCreate")?,
                release: sym(library, "cuMemRelease")?,
                map: sym(library, "cuMemMap")?,
                unmap: sym(library, "cuMemUnmap")?,
                set_access: sym(library, "cuMemSetAccess")?,
                export: sym(library, "cuMemExportToShareableHandle")?,
                import: sym(library, "cuMemImportFromShareableHandle")?,
                stream_create: sym(library, "cuStreamCreate")?,
                stream_synchronize: sym(library, "cuStreamSynchronize")?,
                stream_destroy: sym(library, "cuStreamDestroy_v2")?,
                memcpy_htod_async: sym(library, "cuMemcpyHtoDAsync_v2")?,
                memcpy_dtoh_async: sym(library, "cuMemcpyDtoHAsync_v2")?,
                memcpy_dtod_async: sym(library, "cuMemcpyDtoDAsync_v2")?,
                memset_d8: sym(library, "cuMemsetD8_v2")?,
                host_alloc: sym(library, "cuMemHostAlloc")?,
                free_host: sym(library, "cuMemFreeHost")?,
                host_register: sym(library, "cuMemHostRegister_v2")?,
                host_unregister: sym(library, "cuMemHostUnregister")?,
                can_access_peer: library.get("cuDeviceCanAccessPeer"),
            })
        }
    }
}

/// A device's primary context, retained by [`Vmm::retain_primary_context`].
#[derive(Debug)]
pub struct PrimaryContext {
    raw: ffi::CuContext,
    device: ffi::CuDevice,
}

// SAFETY: a CUcontext is a handle the driver lets any thread make current (cuCtxSetCurrent); this
// type only carries it between threads and never dereferences it.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for Send; shared references only read the handle's value.
unsafe impl Sync for PrimaryContext {}

/// The context that was current in a thread ([`Vmm::current_context`]), possibly none, to be
/// made current again with [`Vmm::restore_context`]: code running inside another program (the
/// device-memory hook) must leave the program's current context as it found it.
#[derive(Debug)]
pub struct SavedContext(ffi::CuContext);

/// A CUDA stream created by [`Vmm::create_stream`]; destroy it with [`Vmm::destroy_stream`].
#[derive(Debug)]
pub struct Stream(ffi::CuStream);

// SAFETY: a CUstream may be used from any thread in which its context is current; this type only
// carries the handle.
unsafe impl Send for Stream {}

/// A handle to physical device memory (`CUmemGenericAllocationHandle`). It is a plain number: the
/// caller releases it with [`Vmm::release`] exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationHandle(pub u64);

/// How a mapping may be accessed from the device (`CUmemAccess_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemAccess {
    /// `CU_MEM_ACCESS_FLAGS_PROT_READ`: writes are refused.
    Read,
    /// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
    ReadWrite,
}

/// The VMM, copy and stream calls of a loaded driver ([`CudaDriver::vmm`]).
#[derive(Clone, Copy)]
pub struct Vmm<'a> {
    driver: &'a CudaDriver,
    api: &'a VmmApi,
}

/// Pinned device memory on `ordinal` that can be exported as a POSIX file descriptor.
fn exportable_prop(ordinal: i32) -> ffi::MemAllocationProp {
    ffi::MemAllocationProp {
        kind: ffi::CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: ffi::MemLocation {
            kind: ffi::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: ffi::MemAllocFlags::default(),
    }
}

impl<'a> Vmm<'a> {
    pub(crate) fn new(driver: &'a CudaDriver, api: &'a VmmApi) -> Self {
        Vmm { driver, api }
    }

    fn check(&self, function: &'static str, code: ffi::CuResult) -> Result<(), CudaError> {
        self.driver.check_call(function, None, code)
    }

    /// Retains the primary context of GPU `ordinal` (creating it on first use).
    pub fn retain_primary_context(&self, ordinal: i32) -> Result<PrimaryContext, CudaError> {
        let device = self.driver.device_handle(ordinal)?;
        let mut raw: ffi::CuContext = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid, writable CUcontext; `device` came from cuDeviceGet.
        let code = unsafe { (self.api.primary_ctx_retain)(&mut raw, device) };
        self.check("cuDevicePrimaryCtxRetain", code)?;
        Ok(PrimaryContext { raw, device })
    }

    /// Gives back a context retained by [`Vmm::retain_primary_context`].
    pub fn release_primary_context(&self, context: PrimaryContext) -> Result<(), CudaError> {
        // SAFETY: takes the device by value; the context was retained on it once.
        let code = unsafe { (self.api.primary_ctx_release)(context.device) };
        self.check("cuDevicePrimaryCtxRelease_v2", code)
    }

    /// Makes `context` the calling thread's current context.
    pub fn set_current(&self, context: &PrimaryContext) -> Result<(), CudaError> {
        // SAFETY: the handle is a retained, live context.
        let code = unsafe { (self.api.ctx_set_current)(context.raw) };
        self.check("cuCtxSetCurrent", code)
    }

    /// The calling thread's current context (none is a valid answer), to put back later.
    pub fn current_context(&self) -> Result<SavedContext, CudaError> {
        let mut raw: ffi::CuContext = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid, writable CUcontext.
        let code = unsafe { (self.api.ctx_get_current)(&mut raw) };
        self.check("cuCtxGetCurrent", code)?;
        Ok(SavedContext(raw))
    }

    /// Makes the context saved by [`Vmm::current_context`] current again (none: no context).
    pub fn restore_context(&self, saved: SavedContext) -> Result<(), CudaError> {
        // SAFETY: the handle was current in this process a moment ago (or is null, which
        // unbinds the thread's context).
        let code = unsafe { (self.api.ctx_set_current)(saved.0) };
        self.check("cuCtxSetCurrent", code)
    }

    /// The ordinal of the GPU of the calling thread's current context; an error
    /// (`CUDA_ERROR_INVALID_CONTEXT`, 201) when no context is current.
    pub fn current_device(&self) -> Result<i32, CudaError> {
        let mut device: ffi::CuDevice = -1;
        // SAFETY: the out pointer is a valid, writable CUdevice.
        let code = unsafe { (self.api.ctx_get_device)(&mut device) };
        self.check("cuCtxGetDevice", code)?;
        Ok(device)
    }

    /// Waits for all work of the current context.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: no arguments.
        let code = unsafe { (self.api.ctx_synchronize)() };
        self.check("cuCtxSynchronize", code)
    }

    /// The minimum granularity of exportable device memory on GPU `ordinal`: sizes, offsets and
    /// addresses of VMM calls must be multiples of it (2 MiB on an H100).
    pub fn granularity(&self, ordinal: i32) -> Result<usize, CudaError> {
        let prop = exportable_prop(ordinal);
        let mut granularity: usize = 0;
        // SAFETY: both pointers are valid for the call; `prop` is a fully initialised
        // CUmemAllocationProp.
        let code = unsafe {
            (self.api.get_granularity)(
                &mut granularity,
                &prop,
                ffi::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        };
        self.check("cuMemGetAllocationGranularity", code)?;
        Ok(granularity)
    }

    /// Reserves `size` bytes of device virtual addresses aligned to `alignment` (0: the
    /// granularity), preferably at `hint` (0: anywhere). The driver may return another address
    /// than the hint.
    pub fn reserve(&self, size: usize, alignment: usize, hint: u64) -> Result<u64, CudaError> {
        let mut ptr: ffi::CuDevicePtr = 0;
        // SAFETY: the out pointer is a valid, writable CUdeviceptr; flags must be 0.
        let code = unsafe { (self.api.address_reserve)(&mut ptr, size, alignment, hint, 0) };
        self.check("cuMemAddressReserve", code)?;
        Ok(ptr)
    }

    /// Frees a reservation made by [`Vmm::reserve`] (nothing may be mapped in it).
    pub fn free_reservation(&self, ptr: u64, size: usize) -> Result<(), CudaError> {
        // SAFETY: plain values; the driver checks that they name a reservation.
        let code = unsafe { (self.api.address_free)(ptr, size) };
        self.check("cuMemAddressFree", code)
    }

    /// Creates `size` bytes of physical memory on GPU `ordinal`, exportable as a POSIX fd.
    pub fn create(&self, ordinal: i32, size: usize) -> Result<AllocationHandle, CudaError> {
        let prop = exportable_prop(ordinal);
        let mut handle: ffi::CuMemHandle = 0;
        // SAFETY: the out pointer is valid and writable; `prop` is fully initialised; flags 0.
        let code = unsafe { (self.api.create)(&mut handle, size, &prop, 0) };
        self.check("cuMemCreate", code)?;
        Ok(AllocationHandle(handle))
    }

    /// Releases a handle; the memory is freed once no mapping uses it.
    pub fn release(&self, handle: AllocationHandle) -> Result<(), CudaError> {
        // SAFETY: a plain value; the driver checks that it names an allocation.
        let code = unsafe { (self.api.release)(handle.0) };
        self.check("cuMemRelease", code)
    }

    /// Maps `size` bytes of `handle` (from offset 0) at `ptr`, inside a reservation.
    pub fn map(&self, ptr: u64, size: usize, handle: AllocationHandle) -> Result<(), CudaError> {
        // SAFETY: plain values; the driver checks the range and the handle; flags must be 0.
        let code = unsafe { (self.api.map)(ptr, size, 0, handle.0, 0) };
        self.check("cuMemMap", code)
    }

    /// Unmaps `size` bytes at `ptr`; the addresses stay reserved.
    pub fn unmap(&self, ptr: u64, size: usize) -> Result<(), CudaError> {
        // SAFETY: plain values; the driver checks that they name a mapping.
        let code = unsafe { (self.api.unmap)(ptr, size) };
        self.check("cuMemUnmap", code)
    }

    /// Lets GPU `ordinal` access the mapping at `ptr` as `access` says (a new mapping has no
    /// access at all).
    pub fn set_access(
        &self,
        ptr: u64,
        size: usize,
        ordinal: i32,
        access: MemAccess,
    ) -> Result<(), CudaError> {
        let desc = ffi::MemAccessDesc {
            location: ffi::MemLocation {
                kind: ffi::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal,
            },
            flags: match access {
                MemAccess::Read => ffi::CU_MEM_ACCESS_FLAGS_PROT_READ,
                MemAccess::ReadWrite => ffi::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            },
        };
        // SAFETY: `desc` is one valid CUmemAccessDesc, the count passed.
        let code = unsafe { (self.api.set_access)(ptr, size, &desc, 1) };
        self.check("cuMemSetAccess", code)
    }

    /// Whether GPU `ordinal` can read and write memory of GPU `peer` directly (NVLink or PCIe
    /// peer-to-peer), so a mapping of `peer`'s memory may be given access for `ordinal`
    /// ([`Vmm::set_access`]). `false` for the same GPU and where the driver lacks the call.
    pub fn can_access_peer(&self, ordinal: i32, peer: i32) -> Result<bool, CudaError> {
        let Some(call) = self.api.can_access_peer else {
            return Ok(false);
        };
        if ordinal == peer {
            return Ok(false);
        }
        let (device, peer) = (
            self.driver.device_handle(ordinal)?,
            self.driver.device_handle(peer)?,
        );
        let mut can: c_int = 0;
        // SAFETY: the out pointer is a valid, writable int; both devices came from cuDeviceGet.
        let code = unsafe { call(&mut can, device, peer) };
        self.check("cuDeviceCanAccessPeer", code)?;
        Ok(can != 0)
    }

    /// A new file descriptor for `handle`'s memory, to hand to another process.
    pub fn export_fd(&self, handle: AllocationHandle) -> Result<OwnedFd, CudaError> {
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the out pointer is an int, which
        // `fd` is; flags must be 0.
        let code = unsafe {
            (self.api.export)(
                (&mut fd as *mut c_int).cast::<c_void>(),
                handle.0,
                ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        self.check("cuMemExportToShareableHandle", code)?;
        // SAFETY: on success the driver returned a new descriptor that this process owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// A handle to the memory behind `fd` (exported by [`Vmm::export_fd`], here or in another
    /// process). The driver does not take `fd`: the caller may close it afterwards.
    pub fn import_fd(&self, fd: BorrowedFd<'_>) -> Result<AllocationHandle, CudaError> {
        let mut handle: ffi::CuMemHandle = 0;
        // SAFETY: for POSIX fds the driver reads the descriptor's number from the pointer's value
        // (cuda.h: "(void *)(uintptr_t) fd"); the out pointer is valid and writable.
        let code = unsafe {
            (self.api.import)(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                ffi::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        self.check("cuMemImportFromShareableHandle", code)?;
        Ok(AllocationHandle(handle))
    }

    /// A stream that does not synchronise with the legacy default stream.
    pub fn create_stream(&self) -> Result<Stream, CudaError> {
        let mut raw: ffi::CuStream = std::ptr::null_mut();
        // SAFETY: the out pointer is a valid, writable CUstream.
        let code = unsafe { (self.api.stream_create)(&mut raw, ffi::CU_STREAM_NON_BLOCKING) };
        self.check("cuStreamCreate", code)?;
        Ok(Stream(raw))
    }

    /// Waits for all work queued on `stream`.
    pub fn synchronize_stream(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: the stream is live (not yet destroyed: `destroy_stream` takes it by value).
        let code = unsafe { (self.api.stream_synchronize)(stream.0) };
        self.check("cuStreamSynchronize", code)
    }

    /// Destroys `stream` (work already queued still completes).
    pub fn destroy_stream(&self, stream: Stream) -> Result<(), CudaError> {
        // SAFETY: the stream is live and is consumed here, so it is destroyed once.
        let code = unsafe { (self.api.stream_destroy)(stream.0) };
        self.check("cuStreamDestroy_v2", code)
    }

    /// Queues a copy of `len` bytes from host `src` to device `dst` on `stream`.
    ///
    /// # Safety
    /// `src..src+len` must stay readable, and unwritten by the host, until the stream has been
    /// synchronised; it runs at full speed only from pinned memory.
    pub unsafe fn copy_to_device_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller keeps the source valid until the stream is synchronised.
        let code = unsafe { (self.api.memcpy_htod_async)(dst, src.cast(), len, stream.0) };
        self.check("cuMemcpyHtoDAsync_v2", code)
    }

    /// Queues a copy of `len` bytes from device `src` to host `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` must stay writable, and untouched by the host, until the stream has been
    /// synchronised.
    pub unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller keeps the destination valid until the stream is synchronised.
        let code = unsafe { (self.api.memcpy_dtoh_async)(dst.cast(), src, len, stream.0) };
        self.check("cuMemcpyDtoHAsync_v2", code)
    }

    /// Queues a device-to-device copy of `len` bytes on `stream`.
    ///
    /// # Safety
    /// With unified addressing a device address may name host memory (pinned host buffers): `dst`
    /// must not be host memory that Rust code reads or writes before the stream is synchronised.
    pub unsafe fn copy_within_device_async(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        stream: &Stream,
    ) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller.
        let code = unsafe { (self.api.memcpy_dtod_async)(dst, src, len, stream.0) };
        self.check("cuMemcpyDtoDAsync_v2", code)
    }

    /// Sets `len` bytes at device `dst` to `value` (synchronous for the host).
    ///
    /// # Safety
    /// As for [`Vmm::copy_within_device_async`]: `dst` must not be host memory Rust code uses.
    pub unsafe fn fill(&self, dst: u64, value: u8, len: usize) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller.
        let code = unsafe { (self.api.memset_d8)(dst, value, len) };
        self.check("cuMemsetD8_v2", code)
    }

    /// `len` bytes of pinned host memory usable by every context (`CU_MEMHOSTALLOC_PORTABLE`),
    /// uninitialised. Free it with [`Vmm::free_pinned`].
    pub fn alloc_pinned(&self, len: usize) -> Result<*mut u8, CudaError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: the out pointer is valid and writable.
        let code = unsafe { (self.api.host_alloc)(&mut ptr, len, ffi::CU_MEMHOSTALLOC_PORTABLE) };
        self.check("cuMemHostAlloc", code)?;
        Ok(ptr.cast())
    }

    /// Frees memory from [`Vmm::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` came from `alloc_pinned`, is freed once, and no copy using it is still queued.
    pub unsafe fn free_pinned(&self, ptr: *mut u8) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller.
        let code = unsafe { (self.api.free_host)(ptr.cast()) };
        self.check("cuMemFreeHost", code)
    }

    /// Pins existing host memory (`CU_MEMHOSTREGISTER_PORTABLE`); undo with
    /// [`Vmm::unpin`].
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped host memory that stays mapped until it is unpinned.
    pub unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller.
        let code =
            unsafe { (self.api.host_register)(ptr.cast(), len, ffi::CU_MEMHOSTREGISTER_PORTABLE) };
        self.check("cuMemHostRegister_v2", code)
    }

    /// Unpins memory pinned by [`Vmm::pin`].
    ///
    /// # Safety
    /// `ptr` is the start of a range pinned by `pin`, and no copy using it is still queued.
    pub unsafe fn unpin(&self, ptr: *mut u8) -> Result<(), CudaError> {
        // SAFETY: forwarded from the caller.
        let code = unsafe { (self.api.host_unregister)(ptr.cast()) };
        self.check("cuMemHostUnregister", code)
    }
}
