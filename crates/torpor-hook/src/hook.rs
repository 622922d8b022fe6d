//! The hook of this process: its devices and its segment table, and the operations on them that
//! the interposed CUDA functions and the C API share.
//!
//! Device work (driver calls, mmap) runs outside the table's lock; the lock is held only to
//! look a segment up, insert it or take its memory, so allocations on several threads overlap.

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, IntoRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use torpor_cuda::CudaDriver;
use torpor_device::cuda::{CopyConfig, CudaDevice};
use torpor_device::host::HostDevice;
use torpor_device::{Access, Device};

use crate::error::HookError;
use crate::segments::{Backend, Memory, SegmentInfo, SegmentTable};

/// The environment variable that turns interposition of the CUDA allocation calls on (`1`).
pub const CUDA_ENV: &str = "TORPOR_HOOK_CUDA";

/// Copies are not the hook's job (the restore server fills segments), so each GPU's device gets
/// the least the cuda backend needs: one stream and a small pinned staging buffer.
const HOOK_COPY_CONFIG: CopyConfig = CopyConfig {
    streams: 1,
    chunk: 64 << 10,
};

/// The hook's state in this process.
pub struct Hook {
    host: HostDevice,
    /// The driver for the queries made before a device is chosen (current context and GPU),
    /// loaded on first use; `Err` is why it cannot be.
    driver: OnceLock<Result<CudaDriver, String>>,
    /// One device per GPU that has segments, opened on first use; `Err` is why it cannot be.
    cuda: Mutex<BTreeMap<i32, Result<Arc<CudaDevice>, String>>>,
    table: Mutex<SegmentTable>,
}

/// The hook of this process.
pub fn hook() -> &'static Hook {
    static HOOK: OnceLock<Hook> = OnceLock::new();
    HOOK.get_or_init(|| Hook {
        host: HostDevice::new(),
        driver: OnceLock::new(),
        cuda: Mutex::new(BTreeMap::new()),
        table: Mutex::new(SegmentTable::default()),
    })
}

/// Whether `TORPOR_HOOK_CUDA=1` was set when the hook was first asked.
pub fn cuda_interposition_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var_os(CUDA_ENV).is_some_and(|v| v == "1"))
}

fn round_up(size: usize, granularity: usize) -> Option<usize> {
    size.checked_next_multiple_of(granularity)
}

impl Hook {
    fn table(&self) -> MutexGuard<'_, SegmentTable> {
        // Every table change is one call on the map, so a panic elsewhere while the lock was
        // held cannot have left it half-changed.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host (memfd) device.
    pub fn host(&self) -> &HostDevice {
        &self.host
    }

    /// The CUDA driver for queries.
    pub fn driver(&self) -> Result<&CudaDriver, HookError> {
        self.driver
            .get_or_init(|| CudaDriver::load().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|reason| HookError::CudaUnavailable {
                reason: reason.clone(),
            })
    }

    /// The device of GPU `ordinal`, opened on first use.
    pub fn cuda_device(&self, ordinal: i32) -> Result<Arc<CudaDevice>, HookError> {
        let mut devices = self.cuda.lock().unwrap_or_else(|p| p.into_inner());
        devices
            .entry(ordinal)
            .or_insert_with(|| {
                CudaDriver::load()
                    .map_err(|e| e.to_string())
                    .and_then(|driver| {
                        CudaDevice::open_with(driver, ordinal, HOOK_COPY_CONFIG)
                            .map_err(|e| e.to_string())
                    })
                    .map(Arc::new)
            })
            .clone()
            .map_err(|reason| HookError::CudaUnavailable { reason })
    }

    /// Runs `f` and puts the calling thread's CUDA context back as it was (the cuda backend
    /// makes its own primary context current), when a driver is loaded.
    pub fn keeping_context<T>(&self, f: impl FnOnce() -> T) -> T {
        let saved = match self.driver.get() {
            Some(Ok(driver)) => driver
                .vmm()
                .ok()
                .and_then(|vmm| vmm.current_context().ok().map(|c| (vmm, c))),
            _ => None,
        };
        let result = f();
        if let Some((vmm, context)) = saved {
            let _ = vmm.restore_context(context);
        }
        result
    }

    // ---- segments of each backend ----------------------------------------------------------

    /// A new host segment of at least `size` bytes, mapped read-write. Returns its start.
    pub fn alloc_host(&self, size: usize) -> Result<SegmentInfo, HookError> {
        let device = &self.host;
        let len = round_up(size, device.granularity()).unwrap_or(usize::MAX);
        let memory = device.create(len)?;
        let va = device.reserve(len, None)?;
        if let Err(e) = device.map(&memory, va, Access::ReadWrite) {
            let _ = device.free_reservation(va, len);
            return Err(e.into());
        }
        Ok(self.table().insert(va, Backend::Host, Memory::Host(memory)))
    }

    /// A new segment of at least `size` bytes on `device` (GPU `ordinal`), mapped read-write.
    pub fn alloc_cuda(
        &self,
        device: &CudaDevice,
        ordinal: i32,
        size: usize,
    ) -> Result<SegmentInfo, HookError> {
        let len = round_up(size, device.granularity()).unwrap_or(usize::MAX);
        let va = device.reserve(len, None)?;
        let memory = match device.create(len) {
            Ok(memory) => memory,
            Err(e) => {
                let _ = device.free_reservation(va, len);
                return Err(e.into());
            }
        };
        if let Err(e) = device.map(&memory, va, Access::ReadWrite) {
            drop(memory);
            let _ = device.free_reservation(va, len);
            return Err(e.into());
        }
        Ok(self
            .table()
            .insert(va, Backend::Cuda { ordinal }, Memory::Cuda(memory)))
    }

    /// A new released segment of at least `size` bytes of addresses on `device` (GPU
    /// `ordinal`), without memory: for memory the daemon hands over, mapped next with
    /// [`Hook::map`]. Allocating the segment's memory only to release it, as a `cuMemAlloc`
    /// would, held the GPU memory twice for a moment and cost a create and a release.
    pub fn reserve_cuda(
        &self,
        device: &CudaDevice,
        ordinal: i32,
        size: usize,
    ) -> Result<SegmentInfo, HookError> {
        let len = round_up(size, device.granularity()).unwrap_or(usize::MAX);
        let va = device.reserve(len, None)?;
        Ok(self
            .table()
            .insert_released(va, Backend::Cuda { ordinal }, len))
    }

    /// Whether a segment starts at `va`.
    pub fn is_segment(&self, va: u64) -> bool {
        self.table().contains(va)
    }

    /// Frees the segment at `va` (unmap, release, give back the addresses). A cuda segment's GPU
    /// is synchronised first, as `cudaFree` does.
    pub fn free(&self, va: u64) -> Result<(), HookError> {
        let (info, memory) = self.table().remove(va)?;
        match info.backend {
            Backend::Host => {
                if let Some(Memory::Host(memory)) = memory {
                    self.host.release(va, memory)?;
                }
                self.host.free_reservation(va, info.size)?;
            }
            Backend::Cuda { ordinal } => {
                let device = self.cuda_device(ordinal)?;
                device.vmm()?.synchronize()?;
                if let Some(Memory::Cuda(memory)) = memory {
                    device.release(va, memory)?;
                }
                device.free_reservation(va, info.size)?;
            }
        }
        Ok(())
    }

    /// Frees the host segment at `va`; a cuda segment is refused (the program frees those).
    pub fn free_host(&self, va: u64) -> Result<(), HookError> {
        let info = self.table().get(va)?;
        if info.backend != Backend::Host {
            return Err(HookError::WrongBackend {
                va,
                actual: info.backend.name(),
                wanted: "host",
                operation: "torpor_hook_host_free",
            });
        }
        self.free(va)
    }

    /// Every segment, in creation order.
    pub fn list(&self) -> Vec<SegmentInfo> {
        self.table().list()
    }

    /// Marks the segment holding `at` as used (first-use order).
    pub fn mark_first_use(&self, at: u64) -> Result<SegmentInfo, HookError> {
        self.table().mark_first_use(at)
    }

    /// A new fd for the memory of the segment at `va`; the caller owns it.
    pub fn export(&self, va: u64) -> Result<RawFd, HookError> {
        let table = self.table();
        let fd = match (table.get(va)?.backend, table.memory(va)?) {
            (_, Memory::Host(memory)) => self.host.export(memory)?,
            (Backend::Cuda { ordinal }, Memory::Cuda(memory)) => {
                self.cuda_device(ordinal)?.export(memory)?
            }
            (Backend::Host, Memory::Cuda(_)) => unreachable!("host segments hold host memory"),
        };
        Ok(fd.into_raw_fd())
    }

    /// Seals the host segment at `va` read-only for good: it is remapped read-only, and the
    /// kernel refuses every writable mapping of its memory in any process, so the daemon may
    /// share it between instances.
    pub fn seal_host(&self, va: u64) -> Result<(), HookError> {
        let mut table = self.table();
        let info = table.get(va)?;
        if info.backend != Backend::Host {
            return Err(HookError::WrongBackend {
                va,
                actual: info.backend.name(),
                wanted: "host",
                operation: "torpor_hook_seal",
            });
        }
        if info.read_only {
            return Ok(());
        }
        let Memory::Host(memory) = table.take_memory(va)? else {
            unreachable!("host segments hold host memory")
        };
        // Sealing needs every writable mapping gone: unmap, seal, map back read-only. A step
        // that fails maps the memory back as it was (a failed map there drops it: the segment
        // stays released, and the error says why).
        if let Err(e) = self.host.unmap(va, info.size) {
            table.put_memory(va, Memory::Host(memory), false)?;
            return Err(e.into());
        }
        let sealed = self.host.seal_read_only(&memory);
        let access = if sealed.is_ok() {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        };
        self.host.map(&memory, va, access)?;
        table.put_memory(va, Memory::Host(memory), sealed.is_ok())?;
        Ok(sealed?)
    }

    /// Releases every segment's memory, keeping its addresses: the snapshot step. Each GPU with
    /// segments is synchronised first (`cuCtxSynchronize`), so no kernel still uses the memory.
    /// Returns the bytes released.
    pub fn release_all(&self) -> Result<u64, HookError> {
        let mapped = self.table().mapped();
        let mut ordinals: Vec<i32> = mapped
            .iter()
            .filter_map(|s| match s.backend {
                Backend::Cuda { ordinal } => Some(ordinal),
                Backend::Host => None,
            })
            .collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        for ordinal in ordinals {
            self.cuda_device(ordinal)?.vmm()?.synchronize()?;
        }
        let mut bytes = 0u64;
        for segment in mapped {
            bytes += self.release_mapped(&segment)?;
        }
        Ok(bytes)
    }

    /// Releases the memory of the segment at `va`, keeping its addresses (its GPU synchronised
    /// first): the daemon's memory a restored worker maps goes before an in-place GPU checkpoint,
    /// the worker's own segments stay. Returns the bytes released.
    pub fn release(&self, va: u64) -> Result<u64, HookError> {
        let segment = self.table().get(va)?;
        if !segment.mapped {
            return Err(HookError::Released { va });
        }
        if let Backend::Cuda { ordinal } = segment.backend {
            self.cuda_device(ordinal)?.vmm()?.synchronize()?;
        }
        self.release_mapped(&segment)
    }

    fn release_mapped(&self, segment: &SegmentInfo) -> Result<u64, HookError> {
        let memory = self.table().take_memory(segment.va)?;
        match memory {
            Memory::Host(memory) => self.host.release(segment.va, memory)?,
            Memory::Cuda(memory) => {
                let Backend::Cuda { ordinal } = segment.backend else {
                    unreachable!("cuda memory belongs to cuda segments")
                };
                self.cuda_device(ordinal)?.release(segment.va, memory)?
            }
        }
        Ok(segment.size as u64)
    }

    /// Maps the memory behind `fd` (which stays the caller's) into the released segment at
    /// `va`, read-only or read-write: the restore step.
    pub fn map(&self, va: u64, fd: BorrowedFd<'_>, read_only: bool) -> Result<(), HookError> {
        let info = self.table().get(va)?;
        if info.mapped {
            return Err(HookError::NotReleased { va });
        }
        let own = fd.try_clone_to_owned().map_err(|_| HookError::BadFd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
        })?;
        let access = if read_only {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        };
        let memory = match info.backend {
            Backend::Host => {
                let memory = self.host.import(own, info.size)?;
                self.host.map(&memory, va, access)?;
                Memory::Host(memory)
            }
            Backend::Cuda { ordinal } => {
                let device = self.cuda_device(ordinal)?;
                let memory = device.import(own, info.size)?;
                device.map(&memory, va, access)?;
                Memory::Cuda(memory)
            }
        };
        self.table().put_memory(va, memory, read_only)
    }
}
