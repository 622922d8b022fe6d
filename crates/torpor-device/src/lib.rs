//! The device a worker's big buffers live on, behind one trait with two real backends.
//!
//! Torpor's split snapshot path keeps a worker's big device buffers ("segments") outside the
//! CRIU image. Each segment is *physical memory* mapped into a *reserved range of virtual
//! addresses*; the two are separate so that the physical memory can be released at snapshot time
//! while the addresses stay reserved (they survive the driver checkpoint and CRIU), and new
//! physical memory, filled by another process, can be mapped at the same addresses after restore.
//! Physical memory travels between processes as a file descriptor ([`fd_passing`]).
//!
//! | operation | [`cuda`] (driver VMM) | [`host`] (memfd) |
//! |---|---|---|
//! | reserve addresses | `cuMemAddressReserve` | `mmap(PROT_NONE, MAP_NORESERVE)` |
//! | create physical memory | `cuMemCreate` (exportable as an fd) | `memfd_create` + `ftruncate` |
//! | map | `cuMemMap` + `cuMemSetAccess` | `mmap(MAP_FIXED \| MAP_SHARED)` |
//! | unmap, keeping the addresses | `cuMemUnmap` | `mmap(PROT_NONE, MAP_FIXED)` over it |
//! | export / import | `cuMemExportToShareableHandle` / `…ImportFromShareableHandle` | the memfd |
//! | copies | async copies on several streams, pinned staging | `memcpy` |
//! | read-only sharing | mappings with `CU_MEM_ACCESS_FLAGS_PROT_READ` | `F_SEAL_WRITE`, `PROT_READ` |
//!
//! The host backend runs every split-path mechanism on machines without a GPU; the cuda backend
//! is tested by the same scenario on the GPU machine (`tests/`).
//!
//! # Life of a segment
//!
//! The owner [`reserve`](Device::reserve)s addresses, [`create`](Device::create)s memory,
//! [`map`](Device::map)s it and fills it. To hand it on it [`export`](Device::export)s an fd;
//! the receiver [`import`](Device::import)s it and maps it at addresses it reserved. To release
//! the memory but keep the addresses, [`release`](Device::release) it (unmap, then drop the
//! memory handle): the memory is freed once no process maps it or holds a handle or fd to it.
//!
//! # Testing
//!
//! `tests/host.rs` runs the split-path mechanics on memfd memory with real child processes
//! (the test binary re-run as a child that imports the segment over a Unix socket).
//! `tests/cuda.rs` runs the same scenario on GPU 0 wherever `nvidia-smi -L` lists a GPU, and
//! prints `SKIP` elsewhere; `tests/cuda_fake_driver.rs` runs it on the fake driver of
//! `tests/fakes/` built with its VMM calls, so the cuda backend's own logic is tested everywhere.
//! `examples/fill_bw.rs` measures fill bandwidth.
//!
//! # Limitations
//!
//! - The driver has no seals: on the cuda backend [`Device::seal_read_only`] only stops this
//!   process mapping the memory writable; importers elsewhere must be told to map it read-only.
//! - The driver cannot tell an imported allocation's size, so the cuda backend checks it only when
//!   mapping (a size larger than the memory is refused by `cuMemMap`).
//! - Copies on one device share one set of streams and staging buffers: concurrent copies run
//!   one after another.
//! - Copies stay inside one mapping; a range spanning two adjacent mappings is refused.
//! - [`Device::copy_from_peer`] on cuda needs the two GPUs to reach each other directly
//!   (`cuDeviceCanAccessPeer`); without that it copies nothing and says so.

pub mod cuda;
pub mod fd_passing;
pub mod host;

mod address_space;
mod error;

use std::fmt;
use std::ops::DerefMut;
use std::os::fd::OwnedFd;

pub use error::DeviceError;

/// Whether `len` bytes fit memory of `size` bytes ([`Device::copy_from_peer`]'s destination).
fn fits(len: usize, size: usize) -> Result<(), DeviceError> {
    if len > size {
        return Err(DeviceError::OutOfRange {
            offset: 0,
            len,
            size,
        });
    }
    Ok(())
}

/// `memory` mapped at addresses reserved for it alone, for one copy: unmapped, and the addresses
/// given back, on drop.
pub struct Window<'a, D: Device> {
    device: &'a D,
    at: u64,
    len: usize,
    mapped: bool,
}

impl<'a, D: Device> Window<'a, D> {
    /// Reserves `len` bytes (the memory's size) and maps all of `memory` there.
    pub fn map(
        device: &'a D,
        memory: &D::Memory,
        len: usize,
        access: Access,
    ) -> Result<Self, DeviceError> {
        let at = device.reserve(len, None)?;
        let mut w = Window {
            device,
            at,
            len,
            mapped: false,
        };
        device.map(memory, at, access)?;
        w.mapped = true;
        Ok(w)
    }

    /// Where the memory is mapped.
    pub fn at(&self) -> u64 {
        self.at
    }
}

impl<D: Device> Drop for Window<'_, D> {
    fn drop(&mut self) {
        if self.mapped {
            let _ = self.device.unmap(self.at, self.len);
        }
        let _ = self.device.free_reservation(self.at, self.len);
    }
}

/// How a mapping may be accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    ReadWrite,
    /// Writes are refused: by the MMU on the host backend (a write faults), by the driver on the
    /// cuda backend (a write is an error), and by [`Device`]'s copies on both.
    ReadOnly,
}

/// A handle to physical device memory. Dropping it releases the handle; the memory itself lives
/// on while a mapping or an exported fd refers to it.
pub trait PhysicalMemory: fmt::Debug + Send + Sync {
    /// Bytes of memory (a multiple of the device's granularity).
    fn size(&self) -> usize;

    /// Whether the memory was sealed read-only ([`Device::seal_read_only`]).
    fn is_sealed(&self) -> bool;
}

/// A device: reserves addresses, creates, maps, shares and copies physical memory.
///
/// Addresses are device virtual addresses (for the host backend, ordinary addresses of this
/// process). Sizes, offsets and addresses given to [`reserve`](Device::reserve),
/// [`create`](Device::create) and [`map`](Device::map) must be multiples of
/// [`granularity`](Device::granularity). Every address given is checked against what this device
/// reserved and mapped in this process, so a wrong address is an error, never a fault.
pub trait Device: Send + Sync {
    /// Physical memory of this device.
    type Memory: PhysicalMemory;
    /// Host memory the device copies from and to fastest (pinned, on the cuda backend).
    type HostBuffer: DerefMut<Target = [u8]> + Send;

    /// The backend's name: `"cuda"` or `"host"`.
    fn backend(&self) -> &'static str;

    /// The unit of sizes and addresses, in bytes (2 MiB on an H100, the page size on the host).
    fn granularity(&self) -> usize;

    /// Reserves `len` bytes of addresses, with nothing mapped, at `at` when given (an error when
    /// that range cannot be had), else wherever the device chooses. Returns the start.
    fn reserve(&self, len: usize, at: Option<u64>) -> Result<u64, DeviceError>;

    /// Gives back a whole reservation made by [`Device::reserve`]; nothing may be mapped in it.
    fn free_reservation(&self, at: u64, len: usize) -> Result<(), DeviceError>;

    /// Creates `len` bytes of physical memory that can be exported.
    fn create(&self, len: usize) -> Result<Self::Memory, DeviceError>;

    /// A new fd for `memory`, to send to another process ([`fd_passing::send_fd`]).
    fn export(&self, memory: &Self::Memory) -> Result<OwnedFd, DeviceError>;

    /// The memory behind `fd` (made by [`Device::export`], here or in another process), which
    /// must hold `len` bytes.
    fn import(&self, fd: OwnedFd, len: usize) -> Result<Self::Memory, DeviceError>;

    /// Makes `memory` read-only for good, so that it can be shared between instances. On the
    /// host backend the kernel then refuses every writable mapping of it in any process (so no
    /// writable mapping may exist when it is sealed); on the cuda backend the driver cannot
    /// enforce it across processes, so this device refuses writable mappings of it and every
    /// importer must map it [`Access::ReadOnly`].
    fn seal_read_only(&self, memory: &Self::Memory) -> Result<(), DeviceError>;

    /// Maps all of `memory` at `at`, inside a reservation, over nothing already mapped.
    fn map(&self, memory: &Self::Memory, at: u64, access: Access) -> Result<(), DeviceError>;

    /// Unmaps the mapping that is exactly `at..at+len`; the addresses stay reserved.
    fn unmap(&self, at: u64, len: usize) -> Result<(), DeviceError>;

    /// Releases `memory`, mapped at `at`, keeping its addresses reserved: the snapshot step that
    /// takes a segment out of the process.
    fn release(&self, at: u64, memory: Self::Memory) -> Result<(), DeviceError> {
        self.unmap(at, memory.size())?;
        drop(memory);
        Ok(())
    }

    /// Copies `src` to device addresses `dst..`, inside one writable mapping.
    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), DeviceError>;

    /// Copies device addresses `src..` into `dst`, from inside one mapping.
    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceError>;

    /// Copies `len` bytes between device addresses, each range inside one mapping.
    fn copy_within_device(&self, src: u64, dst: u64, len: usize) -> Result<(), DeviceError>;

    /// Copies `src` (memory of `from`, another device of this backend in this process) into
    /// `dst` (memory of this device, as large, not sealed), device to device: on cuda over the
    /// GPUs' peer path (NVLink or PCIe peer-to-peer), never through host memory; on host from
    /// memfd to memfd. Returns `false`, having copied nothing, where the two devices have no
    /// such path (the caller copies through host memory).
    fn copy_from_peer(
        &self,
        from: &Self,
        src: &Self::Memory,
        dst: &Self::Memory,
    ) -> Result<bool, DeviceError>
    where
        Self: Sized;

    /// `len` bytes of zeroed host memory that copies use at full speed.
    fn host_buffer(&self, len: usize) -> Result<Self::HostBuffer, DeviceError>;

    /// Whether [`Device::write_unmapped`] works here (host: `pwrite` into the memfd). A fill
    /// that needs no mapping takes no part of the address space, so fills side by side never
    /// wait on each other's `reserve`, `map` or `unmap`; elsewhere the caller maps the memory
    /// and uses `copy_to_device`.
    const WRITES_UNMAPPED: bool = false;

    /// Writes `src` into `memory` at `offset` without mapping it; only where
    /// [`Device::WRITES_UNMAPPED`].
    fn write_unmapped(
        &self,
        memory: &Self::Memory,
        offset: usize,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        let _ = (memory, offset, src);
        Err(DeviceError::Os {
            call: "write_unmapped",
            hint: "this backend's memory is written through a mapping (copy_to_device)",
            source: std::io::Error::from(std::io::ErrorKind::Unsupported),
        })
    }
}
