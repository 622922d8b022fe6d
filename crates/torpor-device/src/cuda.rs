//! The cuda backend: device memory through the driver's virtual memory management (VMM) calls.
//!
//! Physical memory is created exportable as a POSIX fd (`cuMemCreate` with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), mapped into reservations made with
//! `cuMemAddressReserve`, and made accessible with `cuMemSetAccess` (read-write or read-only).
//! `cuMemUnmap` keeps the reservation, so a released segment's addresses stay reserved.
//!
//! Copies between host and device are cut into chunks spread round-robin over several streams.
//! From memory of [`Device::host_buffer`] (pinned) they run straight from it; from any other host
//! memory each chunk is first staged through a pinned buffer of its stream, so the copy of one
//! chunk overlaps the DMA of the others. Copies serialise on one set of streams per device.
//!
//! The driver calls act in the calling thread's current context: every operation first makes this
//! device's primary context current, so a `CudaDevice` may be used from any thread.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use torpor_cuda::{
    AllocationHandle, CudaDriver, CudaError, MemAccess, PrimaryContext, Stream, Vmm,
};

use crate::address_space::AddressSpace;
use crate::error::DeviceError;
use crate::{Access, Device, PhysicalMemory, Window};

const BACKEND: &str = "cuda";
/// The most one copy moves while it holds the address space's read lock: another fill's
/// `reserve` and `map` need the write lock, and a whole 16 GB segment's copy under one read lock
/// (a capture, a migration's pre-copy) would hold every cold start on this GPU for a second.
/// 256 MiB is ~10 ms at PCIe speed and still spans every stream of the copy engine.
const LOCK_SPAN: usize = 256 << 20;

/// How host↔device copies are spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyConfig {
    /// Streams copies are spread over (at least 1).
    pub streams: usize,
    /// Bytes per copy: the unit spread over the streams and the size of each pinned staging
    /// buffer.
    pub chunk: usize,
}

impl Default for CopyConfig {
    /// Four streams of 8 MiB chunks.
    fn default() -> Self {
        CopyConfig {
            streams: 4,
            chunk: 8 << 20,
        }
    }
}

/// What the device and everything made from it (memory, host buffers) share.
struct Shared {
    driver: CudaDriver,
    ordinal: i32,
    /// `None` only while being dropped.
    context: Option<PrimaryContext>,
    /// Pinned host buffers alive, start → length, so copies know when they need no staging.
    pinned: Mutex<BTreeMap<usize, usize>>,
}

impl Shared {
    /// The driver's VMM calls with this device's context current in the calling thread.
    fn vmm(&self) -> Result<Vmm<'_>, CudaError> {
        let vmm = self.driver.vmm()?;
        if let Some(context) = &self.context {
            vmm.set_current(context)?;
        }
        Ok(vmm)
    }

    /// Whether `ptr..ptr+len` lies inside one pinned buffer.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        let start = ptr as usize;
        let pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
        pinned
            .range(..=start)
            .next_back()
            .is_some_and(|(&s, &l)| start.saturating_add(len) <= s + l)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let (Some(context), Ok(vmm)) = (self.context.take(), self.driver.vmm()) {
            // Nothing to do about a failure at the end of the device's life.
            let _ = vmm.release_primary_context(context);
        }
    }
}

/// The streams and staging buffers of host↔device copies.
struct CopyEngine {
    shared: Arc<Shared>,
    streams: Vec<Stream>,
    staging: Vec<PinnedBuffer>,
    chunk: usize,
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        if let Ok(vmm) = self.shared.vmm() {
            for stream in self.streams.drain(..) {
                let _ = vmm.destroy_stream(stream);
            }
        }
    }
}

/// GPU `ordinal` through the driver's VMM calls.
pub struct CudaDevice {
    shared: Arc<Shared>,
    granularity: usize,
    space: RwLock<AddressSpace>,
    engine: Mutex<CopyEngine>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("driver", &self.shared.driver)
            .field("ordinal", &self.shared.ordinal)
            .field("granularity", &self.granularity)
            .finish_non_exhaustive()
    }
}

/// Physical memory on the GPU, exportable as an fd.
#[derive(Debug)]
pub struct CudaMemory {
    shared: Arc<Shared>,
    handle: AllocationHandle,
    size: usize,
    sealed: AtomicBool,
    /// The fd an imported allocation came from, kept to export it again: the driver refuses to
    /// export an imported handle (`CUDA_ERROR_INVALID_VALUE`, measured on the H100 with driver
    /// 580), which a restored worker does when it hibernates with the daemon's memory. It is
    /// closed with the memory, so a worker that released its segments holds no such fd when
    /// CRIU dumps it.
    imported_from: Option<OwnedFd>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

impl PhysicalMemory for CudaMemory {
    fn size(&self) -> usize {
        self.size
    }

    fn is_sealed(&self) -> bool {
        self.sealed.load(Ordering::Acquire)
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if let Ok(vmm) = self.shared.vmm() {
            // The handle is released once; a failure leaves memory the process exit frees.
            let _ = vmm.release(self.handle);
        }
    }
}

/// Pinned host memory (`cuMemHostAlloc`), zeroed when made.
pub struct PinnedBuffer {
    shared: Arc<Shared>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a Box<[u8]>); the driver's pinned
// memory may be used and freed from any thread.
unsafe impl Send for PinnedBuffer {}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for Deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let start = self.ptr.as_ptr() as usize;
        self.shared
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&start);
        if let Ok(vmm) = self.shared.vmm() {
            // SAFETY: the pointer came from alloc_pinned and is freed once, here; every copy that
            // used it was synchronised before the copy call returned.
            let _ = unsafe { vmm.free_pinned(self.ptr.as_ptr()) };
        }
    }
}

impl PinnedBuffer {
    fn new(shared: &Arc<Shared>, len: usize) -> Result<Self, DeviceError> {
        let vmm = shared.vmm()?;
        // cuMemHostAlloc refuses 0 bytes; an empty buffer still needs a distinct pointer.
        let ptr = vmm.alloc_pinned(len.max(1))?;
        // The driver reports a failed allocation as an error; a null pointer with success would
        // be the same failure.
        let ptr = NonNull::new(ptr).ok_or(DeviceError::Cuda(CudaError::Call {
            function: "cuMemHostAlloc",
            pid: None,
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        }))?;
        // SAFETY: the allocation holds at least `len` bytes; zeroing makes them initialised.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        shared
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ptr.as_ptr() as usize, len);
        Ok(PinnedBuffer {
            shared: Arc::clone(shared),
            ptr,
            len,
        })
    }
}

/// Host memory pinned in place by [`CudaDevice::pin`] (`cuMemHostRegister`), unpinned when
/// dropped. Copies from and to it (through [`std::ops::Deref`]) need no staging.
pub struct PinnedRegion<'a> {
    shared: Arc<Shared>,
    memory: &'a mut [u8],
}

impl std::ops::Deref for PinnedRegion<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.memory
    }
}

impl std::ops::DerefMut for PinnedRegion<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.memory
    }
}

impl Drop for PinnedRegion<'_> {
    fn drop(&mut self) {
        let start = self.memory.as_mut_ptr();
        self.shared
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(start as usize));
        if let Ok(vmm) = self.shared.vmm() {
            // SAFETY: the range was pinned by `CudaDevice::pin` and is unpinned once, here;
            // every copy that used it was synchronised before the copy call returned.
            let _ = unsafe { vmm.unpin(start) };
        }
    }
}

impl CudaDevice {
    /// Pins `memory` in place (`cuMemHostRegister`) for as long as the returned region lives,
    /// so copies from and to it run at full speed without staging. Pinning costs time (DESIGN
    /// §1: 2.6 s for 4 GiB; `fill_bw` on the H100: 0.04–0.06 s for 1 GiB already in memory,
    /// bench/results/fill-bw-h100.json): pin long-lived buffers such as a host cache, once.
    pub fn pin<'a>(&self, memory: &'a mut [u8]) -> Result<PinnedRegion<'a>, DeviceError> {
        if memory.is_empty() {
            return Err(DeviceError::ZeroSize {
                what: "host memory to pin",
                granularity: 1,
            });
        }
        let vmm = self.shared.vmm()?;
        // SAFETY: `memory` is mapped host memory borrowed mutably for the region's lifetime, and
        // the region's drop unpins it before the borrow ends.
        unsafe { vmm.pin(memory.as_mut_ptr(), memory.len())? };
        self.shared
            .pinned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(memory.as_ptr() as usize, memory.len());
        Ok(PinnedRegion {
            shared: Arc::clone(&self.shared),
            memory,
        })
    }

    /// Opens GPU `ordinal` with the driver named by `TORPOR_LIBCUDA` (or `libcuda.so.1`) and the
    /// default [`CopyConfig`].
    pub fn open(ordinal: i32) -> Result<Self, DeviceError> {
        Self::open_with(CudaDriver::load()?, ordinal, CopyConfig::default())
    }

    /// Opens GPU `ordinal` of `driver`, retaining its primary context.
    pub fn open_with(
        driver: CudaDriver,
        ordinal: i32,
        config: CopyConfig,
    ) -> Result<Self, DeviceError> {
        let vmm = driver.vmm()?;
        let context = vmm.retain_primary_context(ordinal)?;
        vmm.set_current(&context)?;
        let granularity = vmm.granularity(ordinal)?;
        let shared = Arc::new(Shared {
            driver,
            ordinal,
            context: Some(context),
            pinned: Mutex::new(BTreeMap::new()),
        });
        let mut engine = CopyEngine {
            shared: Arc::clone(&shared),
            streams: Vec::new(),
            staging: Vec::new(),
            chunk: config.chunk.max(1),
        };
        for _ in 0..config.streams.max(1) {
            engine.streams.push(shared.vmm()?.create_stream()?);
            engine
                .staging
                .push(PinnedBuffer::new(&shared, engine.chunk)?);
        }
        Ok(CudaDevice {
            shared,
            granularity,
            space: RwLock::new(AddressSpace::new(BACKEND, granularity)),
            engine: Mutex::new(engine),
        })
    }

    /// The driver, for its checkpoint API and device queries.
    pub fn driver(&self) -> &CudaDriver {
        &self.shared.driver
    }

    /// The CUDA ordinal of the GPU.
    pub fn ordinal(&self) -> i32 {
        self.shared.ordinal
    }

    /// The driver's VMM calls with this device's context current in the calling thread, for
    /// what the trait does not cover (a `cuMemsetD8` in a test, say).
    pub fn vmm(&self) -> Result<Vmm<'_>, DeviceError> {
        Ok(self.shared.vmm()?)
    }

    fn space(&self) -> std::sync::RwLockReadGuard<'_, AddressSpace> {
        // The bookkeeping changes only after each driver call succeeded, so a panic while the
        // lock was held cannot have left it inconsistent.
        self.space.read().unwrap_or_else(|p| p.into_inner())
    }

    fn space_mut(&self) -> std::sync::RwLockWriteGuard<'_, AddressSpace> {
        self.space.write().unwrap_or_else(|p| p.into_inner())
    }

    fn engine(&self) -> std::sync::MutexGuard<'_, CopyEngine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Waits for every stream, keeping the first error (of the copy or of a wait).
fn finish(
    vmm: &Vmm<'_>,
    streams: &[Stream],
    result: Result<(), CudaError>,
) -> Result<(), CudaError> {
    let mut result = result;
    for stream in streams {
        let synced = vmm.synchronize_stream(stream);
        if result.is_ok() {
            result = synced;
        }
    }
    result
}

impl CopyEngine {
    /// Host → device. The caller has checked `dst..dst+src.len()` against the address space.
    fn copy_in(&mut self, vmm: &Vmm<'_>, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        let n = self.streams.len();
        let direct = self.shared.is_pinned(src.as_ptr(), src.len());
        let mut in_use = vec![false; n];
        let mut queue = || -> Result<(), CudaError> {
            for (i, chunk) in src.chunks(self.chunk).enumerate() {
                let s = i % n;
                let at = dst + (i * self.chunk) as u64;
                if direct {
                    // SAFETY: `chunk` is borrowed for the whole call, and every stream is
                    // synchronised (finish) before this function returns.
                    unsafe {
                        vmm.copy_to_device_async(at, chunk.as_ptr(), chunk.len(), &self.streams[s])?
                    };
                    continue;
                }
                if in_use[s] {
                    vmm.synchronize_stream(&self.streams[s])?;
                }
                let staging = &mut self.staging[s];
                staging[..chunk.len()].copy_from_slice(chunk);
                // SAFETY: the staging buffer is not touched again until its stream has been
                // synchronised (above, or in finish).
                unsafe {
                    vmm.copy_to_device_async(at, staging.as_ptr(), chunk.len(), &self.streams[s])?
                };
                in_use[s] = true;
            }
            Ok(())
        };
        let result = queue();
        finish(vmm, &self.streams, result)
    }

    /// Device → host. The caller has checked `src..src+dst.len()` against the address space.
    fn copy_out(&mut self, vmm: &Vmm<'_>, src: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        let n = self.streams.len();
        let chunk_len = self.chunk;
        if self.shared.is_pinned(dst.as_ptr(), dst.len()) {
            let streams = &self.streams;
            let mut queue = || -> Result<(), CudaError> {
                for (i, chunk) in dst.chunks_mut(chunk_len).enumerate() {
                    let at = src + (i * chunk_len) as u64;
                    // SAFETY: `dst` is borrowed mutably for the whole call and every stream is
                    // synchronised (finish) before this function returns.
                    unsafe {
                        vmm.copy_to_host_async(
                            chunk.as_mut_ptr(),
                            at,
                            chunk.len(),
                            &streams[i % n],
                        )?
                    };
                }
                Ok(())
            };
            let result = queue();
            return finish(vmm, streams, result);
        }
        // Staged: chunk i lands in its stream's staging buffer and is copied out when the stream
        // comes round again (or at the end).
        let mut pending: Vec<Option<(usize, usize)>> = vec![None; n];
        let streams = &self.streams;
        let staging = &mut self.staging;
        let mut queue = |pending: &mut Vec<Option<(usize, usize)>>| -> Result<(), CudaError> {
            for (i, offset) in (0..dst.len()).step_by(chunk_len).enumerate() {
                let s = i % n;
                if let Some((off, len)) = pending[s].take() {
                    vmm.synchronize_stream(&streams[s])?;
                    dst[off..off + len].copy_from_slice(&staging[s][..len]);
                }
                let len = chunk_len.min(dst.len() - offset);
                // SAFETY: the staging buffer is read only after its stream is synchronised.
                unsafe {
                    vmm.copy_to_host_async(
                        staging[s].as_mut_ptr(),
                        src + offset as u64,
                        len,
                        &streams[s],
                    )?
                };
                pending[s] = Some((offset, len));
            }
            Ok(())
        };
        let result = queue(&mut pending);
        let result = finish(vmm, streams, result);
        if result.is_ok() {
            for (s, p) in pending.iter().enumerate() {
                if let Some((off, len)) = *p {
                    dst[off..off + len].copy_from_slice(&staging[s][..len]);
                }
            }
        }
        result
    }
}

impl Device for CudaDevice {
    type Memory = CudaMemory;
    type HostBuffer = PinnedBuffer;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn granularity(&self) -> usize {
        self.granularity
    }

    fn reserve(&self, len: usize, at: Option<u64>) -> Result<u64, DeviceError> {
        let mut space = self.space_mut();
        space.check_reserve(at, len)?;
        let vmm = self.shared.vmm()?;
        let start = vmm.reserve(len, self.granularity, at.unwrap_or(0))?;
        if let Some(at) = at.filter(|&at| at != start) {
            // The driver takes the address as a hint and chose another.
            let _ = vmm.free_reservation(start, len);
            return Err(DeviceError::AddressInUse { at, len });
        }
        space.add_reservation(start, len);
        Ok(start)
    }

    fn free_reservation(&self, at: u64, len: usize) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.remove_reservation(at, len)?;
        if let Err(e) = self
            .shared
            .vmm()
            .and_then(|vmm| vmm.free_reservation(at, len))
        {
            space.add_reservation(at, len);
            return Err(e.into());
        }
        Ok(())
    }

    fn create(&self, len: usize) -> Result<CudaMemory, DeviceError> {
        self.space().check_size("memory size", len)?;
        let handle = self.shared.vmm()?.create(self.shared.ordinal, len)?;
        Ok(CudaMemory {
            shared: Arc::clone(&self.shared),
            handle,
            size: len,
            sealed: AtomicBool::new(false),
            imported_from: None,
        })
    }

    fn export(&self, memory: &CudaMemory) -> Result<OwnedFd, DeviceError> {
        if let Some(fd) = &memory.imported_from {
            return fd.try_clone().map_err(|source| DeviceError::Os {
                call: "dup",
                hint: "the process may be out of file descriptors (raise RLIMIT_NOFILE)",
                source,
            });
        }
        Ok(self.shared.vmm()?.export_fd(memory.handle)?)
    }

    /// The driver cannot tell an imported allocation's size: a `len` larger than the memory is
    /// refused by [`Device::map`] (`cuMemMap`), a smaller one maps only part of it.
    fn import(&self, fd: OwnedFd, len: usize) -> Result<CudaMemory, DeviceError> {
        use std::os::fd::AsRawFd;
        self.space().check_size("memory size", len)?;
        let vmm = self.shared.vmm()?;
        let handle = vmm.import_fd(fd.as_fd()).map_err(|e| match e {
            CudaError::Call { name, code, .. } => DeviceError::NotDeviceMemory {
                backend: BACKEND,
                fd: fd.as_raw_fd(),
                reason: format!("cuMemImportFromShareableHandle failed with {name} ({code})"),
            },
            other => other.into(),
        })?;
        // The driver holds its own reference to the memory; the fd is kept only to export the
        // memory again (see `imported_from`).
        Ok(CudaMemory {
            shared: Arc::clone(&self.shared),
            handle,
            size: len,
            sealed: AtomicBool::new(false),
            imported_from: Some(fd),
        })
    }

    /// The driver has no seals: this marks the handle so this device refuses writable mappings
    /// of it from now on. Mappings made before stay as they are, and importers in other
    /// processes must be told to map it read-only.
    fn seal_read_only(&self, memory: &CudaMemory) -> Result<(), DeviceError> {
        memory.sealed.store(true, Ordering::Release);
        Ok(())
    }

    fn map(&self, memory: &CudaMemory, at: u64, access: Access) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.check_map(at, memory.size)?;
        if access == Access::ReadWrite && memory.is_sealed() {
            return Err(DeviceError::Sealed);
        }
        let vmm = self.shared.vmm()?;
        vmm.map(at, memory.size, memory.handle)?;
        let flags = match access {
            Access::ReadWrite => MemAccess::ReadWrite,
            Access::ReadOnly => MemAccess::Read,
        };
        if let Err(e) = vmm.set_access(at, memory.size, self.shared.ordinal, flags) {
            let _ = vmm.unmap(at, memory.size);
            return Err(e.into());
        }
        space.add_mapping(at, memory.size, access);
        Ok(())
    }

    fn unmap(&self, at: u64, len: usize) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.mapping(at, len)?;
        self.shared.vmm()?.unmap(at, len)?;
        space.remove_mapping(at, len)?;
        Ok(())
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), DeviceError> {
        let vmm = self.shared.vmm()?;
        for (i, piece) in src.chunks(LOCK_SPAN).enumerate() {
            let at = dst + (i * LOCK_SPAN) as u64;
            let space = self.space();
            space.check_access(at, piece.len(), true)?;
            self.engine().copy_in(&vmm, at, piece)?;
        }
        Ok(())
    }

    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        let vmm = self.shared.vmm()?;
        for (i, piece) in dst.chunks_mut(LOCK_SPAN).enumerate() {
            let at = src + (i * LOCK_SPAN) as u64;
            let space = self.space();
            space.check_access(at, piece.len(), false)?;
            self.engine().copy_out(&vmm, at, piece)?;
        }
        Ok(())
    }

    fn copy_within_device(&self, src: u64, dst: u64, len: usize) -> Result<(), DeviceError> {
        if len == 0 {
            return Ok(());
        }
        let space = self.space();
        space.check_access(src, len, false)?;
        space.check_access(dst, len, true)?;
        let vmm = self.shared.vmm()?;
        let engine = self.engine();
        // SAFETY: both ranges are mappings of device memory made by this device (checked above),
        // not host memory, and the stream is synchronised before returning.
        let result = unsafe { vmm.copy_within_device_async(dst, src, len, &engine.streams[0]) };
        Ok(finish(&vmm, &engine.streams[..1], result)?)
    }

    fn copy_from_peer(
        &self,
        from: &Self,
        src: &CudaMemory,
        dst: &CudaMemory,
    ) -> Result<bool, DeviceError> {
        crate::fits(src.size, dst.size)?;
        let (here, there) = (self.shared.ordinal, from.shared.ordinal);
        if src.size == 0 || here == there || !self.shared.vmm()?.can_access_peer(here, there)? {
            return Ok(false);
        }
        // The source mapped read-only in `from`'s addresses and made readable by this GPU too;
        // the destination in this device's. Both unmapped, and their addresses given back, on
        // the way out.
        let source = Window::map(from, src, src.size, Access::ReadOnly)?;
        if from
            .shared
            .vmm()?
            .set_access(source.at(), src.size, here, MemAccess::Read)
            .is_err()
        {
            // The driver said the pair can reach each other, then refused the mapping: copy
            // through the host instead.
            return Ok(false);
        }
        let target = Window::map(self, dst, dst.size, Access::ReadWrite)?;
        let vmm = self.shared.vmm()?;
        let engine = self.engine();
        // SAFETY: both ranges are device memory mapped above (not host memory), readable by this
        // GPU, the destination writable; the stream is synchronised before the windows go.
        let result = unsafe {
            vmm.copy_within_device_async(target.at(), source.at(), src.size, &engine.streams[0])
        };
        finish(&vmm, &engine.streams[..1], result)?;
        Ok(true)
    }

    fn host_buffer(&self, len: usize) -> Result<PinnedBuffer, DeviceError> {
        PinnedBuffer::new(&self.shared, len)
    }
}
