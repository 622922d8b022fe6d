//! The daemon's side of a segment's memory, over either backend of `torpor-device`: read the
//! memory behind a worker's fd (capture), make new exportable memory filled from host bytes or
//! from other device memory (restore), and export it for a `map` frame.
//!
//! The daemon maps each piece of memory only for the length of one copy, into addresses it
//! reserves and frees around it, so it never holds a segment's addresses longer than needed.
//!
//! Every host→device copy goes through the device's fair PCIe scheduler ([`super::pcie`]), which
//! each [`Backend`] owns: one per device.

use std::any::Any;
use std::ops::DerefMut;
use std::os::fd::OwnedFd;

use torpor_device::{Access, Device, DeviceError, Window};

use super::pcie::{Pcie, Source};

/// Memory of one backend, type-erased so that caches and shared copies can hold either.
pub type Memory = Box<dyn Any + Send + Sync>;

/// Host memory the device copies from and to fastest (pinned on cuda).
pub type HostBuffer = Box<dyn DerefMut<Target = [u8]> + Send>;

/// One device as the restore server and the capture use it.
pub trait SegmentDevice: Send + Sync {
    /// `"host"` or `"cuda"`.
    fn backend(&self) -> &'static str;

    /// The unit of its memory's sizes, in bytes (2 MiB on an H100, the page size on the host).
    fn granularity(&self) -> usize;

    /// `len` bytes of host memory for copies: from the device's pool when it has one with
    /// room ([`SegmentDevice::make_host_pool`]), made for this call otherwise.
    fn host_buffer(&self, len: usize) -> Result<HostBuffer, DeviceError>;

    /// Makes `bytes` of host memory for copies now, kept as a pool that
    /// [`SegmentDevice::host_buffer`] carves buffers from (crate::split::pool); set once: a
    /// second call leaves the first pool. Returns the pool's bytes.
    fn make_host_pool(&self, bytes: usize) -> Result<usize, DeviceError>;

    /// The pool's (bytes, free bytes), if it has one.
    fn host_pool(&self) -> Option<(usize, usize)>;

    /// Copies the memory behind `fd` (a worker's exported segment of `out.len()` bytes) into
    /// `out`.
    fn read_fd(&self, fd: OwnedFd, out: &mut [u8]) -> Result<(), DeviceError>;

    /// New exportable memory holding `src`, memory of [`SegmentDevice::host_buffer`] (pinned on
    /// cuda, so copied from in place); sealed read-only for sharing when `seal`. The copy is one
    /// transfer of the device's PCIe scheduler.
    fn fill_from_bytes(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError>;

    /// The same from any other host memory (a memfd, a file's pages): each block goes through
    /// the scheduler's shared staging buffer.
    fn fill_from_pageable(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError>;

    /// The device's PCIe scheduler.
    fn pcie(&self) -> &Pcie;

    /// New exportable memory of `len` bytes (a multiple of the granularity), unfilled: another
    /// process fills it through an exported fd (the communication store's GPU values).
    fn create(&self, len: usize) -> Result<Memory, DeviceError>;

    /// Seals `memory` (made by this device) read-only for good ([`Device::seal_read_only`]);
    /// no writable mapping of it may exist any more.
    fn seal(&self, memory: &Memory) -> Result<(), DeviceError>;

    /// New exportable memory holding a copy of `src` (device to device); sealed when `seal`.
    fn fill_from_memory(
        &self,
        src: &Memory,
        size: usize,
        seal: bool,
    ) -> Result<Memory, DeviceError>;

    /// New exportable memory on this device holding a copy of `src` (`size` bytes of memory of
    /// `from`, another device of this node), copied device to device: over the GPUs' peer path
    /// on cuda, never through host memory and not through the PCIe scheduler (which orders the
    /// host's transfers); sealed when `seal`. `Ok(None)`: the two devices have no such path
    /// (another backend, no peer access); the caller copies through host memory.
    fn fill_from_peer(
        &self,
        from: &dyn SegmentDevice,
        src: &Memory,
        size: usize,
        seal: bool,
    ) -> Result<Option<Memory>, DeviceError>;

    /// This device as `Any`, so that [`SegmentDevice::fill_from_peer`] can find its backend.
    fn as_any(&self) -> &dyn Any;

    /// A new fd for `memory`, for a `map` frame.
    fn export(&self, memory: &Memory) -> Result<OwnedFd, DeviceError>;

    /// Copies the first `out.len()` bytes of `memory` (made by this device) into `out`: the
    /// contents of an instance's writable segment, saved while its GPU is released.
    fn read_memory(&self, memory: &Memory, out: &mut [u8]) -> Result<(), DeviceError>;

    /// The memory behind `fd` (a worker's segment of `out.len()` bytes), block by block of
    /// `block` bytes: each block whose BLAKE3 hash is not `hashes[i]` is copied into `out` at its
    /// place; returns the indices of those blocks. `out` held the segment's contents when
    /// `hashes` were taken (a pre-copy), so afterwards it holds them as they are now. Each block
    /// goes through the device's host staging and is hashed on the CPU (no hashing kernel on
    /// the GPU yet: docs/checkpoints.md).
    fn refresh_fd(
        &self,
        fd: OwnedFd,
        block: usize,
        hashes: &[[u8; 32]],
        out: &mut [u8],
    ) -> Result<Vec<usize>, DeviceError>;

    /// [`SegmentDevice::refresh_fd`] on `memory` (made by this device).
    fn refresh_memory(
        &self,
        memory: &Memory,
        block: usize,
        hashes: &[[u8; 32]],
        out: &mut [u8],
    ) -> Result<Vec<usize>, DeviceError>;

    /// Copies the blocks `blocks` (indices of `block`-byte blocks) of `src` into `memory` (made
    /// by this device, writable), at the same places.
    fn write_blocks(
        &self,
        memory: &Memory,
        src: &[u8],
        block: usize,
        blocks: &[usize],
    ) -> Result<(), DeviceError>;
}

/// [`SegmentDevice`] over a `torpor-device` backend, with its PCIe scheduler.
pub struct Backend<D> {
    device: D,
    pcie: Pcie,
    pool: std::sync::OnceLock<super::pool::HostPool>,
}

impl<D: Device> Backend<D> {
    pub fn new(device: D, pcie: Pcie) -> Self {
        Self {
            device,
            pcie,
            pool: std::sync::OnceLock::new(),
        }
    }
}

impl<D: Device> Backend<D>
where
    D::Memory: 'static,
{
    fn memory<'m>(&self, m: &'m Memory) -> &'m D::Memory {
        m.downcast_ref::<D::Memory>()
            .expect("memory of one backend is only handed to that backend")
    }

    fn fill(&self, src: &[u8], seal: bool, from: Source<'_>) -> Result<Memory, DeviceError> {
        let t = std::time::Instant::now();
        let memory = self.device.create(src.len())?;
        let created = t.elapsed().as_secs_f64();
        // Written without a mapping where the backend can (host): nothing to wait for but the
        // link's turn.
        if D::WRITES_UNMAPPED {
            tracing::debug!(
                bytes = src.len(),
                create_s = created,
                "device fill: memory made, written unmapped"
            );
            self.pcie.transfer(src, from, |offset, bytes| {
                self.device.write_unmapped(&memory, offset, bytes)
            })?;
        } else {
            let w = Window::map(&self.device, &memory, src.len(), Access::ReadWrite)?;
            // What came before the transfer line (the fair PCIe test's diagnosis: a small fill
            // that reached the scheduler late, docs/sandboxes.md).
            tracing::debug!(
                bytes = src.len(),
                create_s = created,
                map_s = t.elapsed().as_secs_f64() - created,
                "device fill: memory made and mapped"
            );
            self.pcie.transfer(src, from, |offset, bytes| {
                self.device.copy_to_device(w.at() + offset as u64, bytes)
            })?;
        }
        if seal {
            self.device.seal_read_only(&memory)?;
        }
        Ok(Box::new(memory))
    }
}

impl<D: Device + 'static> SegmentDevice for Backend<D>
where
    D::Memory: 'static,
    D::HostBuffer: 'static,
{
    fn backend(&self) -> &'static str {
        self.device.backend()
    }

    fn granularity(&self) -> usize {
        self.device.granularity()
    }

    fn host_buffer(&self, len: usize) -> Result<HostBuffer, DeviceError> {
        if let Some(b) = self.pool.get().and_then(|p| p.take(len)) {
            return Ok(b);
        }
        Ok(Box::new(self.device.host_buffer(len)?))
    }

    fn make_host_pool(&self, bytes: usize) -> Result<usize, DeviceError> {
        if let Some(p) = self.pool.get() {
            return Ok(p.capacity());
        }
        let memory: HostBuffer = Box::new(self.device.host_buffer(bytes)?);
        let made = super::pool::HostPool::new(memory).map_or(0, |p| {
            let capacity = p.capacity();
            let _ = self.pool.set(p);
            capacity
        });
        Ok(made)
    }

    fn host_pool(&self) -> Option<(usize, usize)> {
        self.pool.get().map(|p| (p.capacity(), p.free_bytes()))
    }

    fn read_fd(&self, fd: OwnedFd, out: &mut [u8]) -> Result<(), DeviceError> {
        let memory = self.device.import(fd, out.len())?;
        let w = Window::map(&self.device, &memory, out.len(), Access::ReadOnly)?;
        self.device.copy_to_host(w.at(), out)
    }

    fn fill_from_bytes(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError> {
        self.fill(src, seal, Source::Pinned)
    }

    fn fill_from_pageable(&self, src: &[u8], seal: bool) -> Result<Memory, DeviceError> {
        let alloc = |len: usize| self.host_buffer(len);
        self.fill(src, seal, Source::Pageable(&alloc))
    }

    fn pcie(&self) -> &Pcie {
        &self.pcie
    }

    fn create(&self, len: usize) -> Result<Memory, DeviceError> {
        Ok(Box::new(self.device.create(len)?))
    }

    fn seal(&self, memory: &Memory) -> Result<(), DeviceError> {
        self.device.seal_read_only(self.memory(memory))
    }

    fn fill_from_memory(
        &self,
        src: &Memory,
        size: usize,
        seal: bool,
    ) -> Result<Memory, DeviceError> {
        let src = self.memory(src);
        let memory = self.device.create(size)?;
        {
            let from = Window::map(&self.device, src, size, Access::ReadOnly)?;
            let to = Window::map(&self.device, &memory, size, Access::ReadWrite)?;
            self.device.copy_within_device(from.at(), to.at(), size)?;
        }
        if seal {
            self.device.seal_read_only(&memory)?;
        }
        Ok(Box::new(memory))
    }

    fn fill_from_peer(
        &self,
        from: &dyn SegmentDevice,
        src: &Memory,
        size: usize,
        seal: bool,
    ) -> Result<Option<Memory>, DeviceError> {
        let Some(from) = from.as_any().downcast_ref::<Backend<D>>() else {
            return Ok(None);
        };
        let src = self.memory(src);
        let memory = self.device.create(size)?;
        if !self.device.copy_from_peer(&from.device, src, &memory)? {
            return Ok(None);
        }
        if seal {
            self.device.seal_read_only(&memory)?;
        }
        Ok(Some(Box::new(memory)))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn export(&self, memory: &Memory) -> Result<OwnedFd, DeviceError> {
        self.device.export(self.memory(memory))
    }

    fn read_memory(&self, memory: &Memory, out: &mut [u8]) -> Result<(), DeviceError> {
        let w = Window::map(
            &self.device,
            self.memory(memory),
            out.len(),
            Access::ReadOnly,
        )?;
        self.device.copy_to_host(w.at(), out)
    }

    fn refresh_fd(
        &self,
        fd: OwnedFd,
        block: usize,
        hashes: &[[u8; 32]],
        out: &mut [u8],
    ) -> Result<Vec<usize>, DeviceError> {
        let memory = self.device.import(fd, out.len())?;
        self.refresh(&memory, block, hashes, out)
    }

    fn refresh_memory(
        &self,
        memory: &Memory,
        block: usize,
        hashes: &[[u8; 32]],
        out: &mut [u8],
    ) -> Result<Vec<usize>, DeviceError> {
        self.refresh(self.memory(memory), block, hashes, out)
    }

    fn write_blocks(
        &self,
        memory: &Memory,
        src: &[u8],
        block: usize,
        blocks: &[usize],
    ) -> Result<(), DeviceError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let block = block.max(1);
        // Not through the fair PCIe scheduler: these are a migration's changed blocks, copied
        // inside its stop, where every millisecond is the instance's downtime.
        let w = Window::map(
            &self.device,
            self.memory(memory),
            src.len(),
            Access::ReadWrite,
        )?;
        for &i in blocks {
            let start = i * block;
            if start >= src.len() {
                continue;
            }
            let end = src.len().min(start + block);
            self.device
                .copy_to_device(w.at() + start as u64, &src[start..end])?;
        }
        Ok(())
    }
}

impl<D: Device> Backend<D>
where
    D::Memory: 'static,
{
    /// See [`SegmentDevice::refresh_fd`]. The memory is copied to the host [`REFRESH_BLOCKS`]
    /// blocks at a time and each batch's blocks are hashed on all cores.
    fn refresh(
        &self,
        memory: &D::Memory,
        block: usize,
        hashes: &[[u8; 32]],
        out: &mut [u8],
    ) -> Result<Vec<usize>, DeviceError> {
        use rayon::prelude::*;
        let block = block.max(1);
        let len = out.len();
        let w = Window::map(&self.device, memory, len, Access::ReadOnly)?;
        let batch = block.saturating_mul(REFRESH_BLOCKS).min(len).max(1);
        // Pageable: pinning 64 MiB (~40 ms on the H100) would cost more than the device's own
        // pinned staging does, in the stop.
        let mut staging = vec![0u8; batch];
        let mut changed = Vec::new();
        let mut at = 0usize;
        while at < len {
            let n = batch.min(len - at);
            self.device
                .copy_to_host(w.at() + at as u64, &mut staging[..n])?;
            let first = at / block;
            let found: Vec<usize> = staging[..n]
                .par_chunks(block)
                .enumerate()
                .filter(|(i, b)| hashes.get(first + i) != Some(blake3::hash(b).as_bytes()))
                .map(|(i, _)| first + i)
                .collect();
            for &i in &found {
                let start = i * block;
                let end = len.min(start + block);
                out[start..end].copy_from_slice(&staging[start - at..end - at]);
            }
            changed.extend(found);
            at += n;
        }
        Ok(changed)
    }
}

/// Blocks a refresh copies to the host at once (32 × 2 MiB = 64 MiB of staging).
pub const REFRESH_BLOCKS: usize = 32;

/// The BLAKE3 hash of each `block`-byte block of `data` (the last may be shorter), in order.
pub fn block_hashes(data: &[u8], block: usize) -> Vec<[u8; 32]> {
    use rayon::prelude::*;
    data.par_chunks(block.max(1))
        .map(|b| *blake3::hash(b).as_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_device::host::HostDevice;

    #[test]
    fn bytes_go_through_memory_and_back() {
        let block = crate::config::PcieConfig {
            fair: true,
            block_bytes: 4096,
            solo_bytes: 4096,
        };
        let dev = Backend::new(HostDevice::new(), Pcie::new("host", block, None));
        let page = 4096;
        let data: Vec<u8> = (0..3 * page).map(|i| (i % 251) as u8).collect();
        let m = dev.fill_from_bytes(&data, false).unwrap();
        let copy = dev.fill_from_memory(&m, data.len(), true).unwrap();
        let mut out = vec![0u8; data.len()];
        dev.read_fd(dev.export(&copy).unwrap(), &mut out).unwrap();
        assert_eq!(out, data);
        let mut saved = dev.host_buffer(data.len()).unwrap();
        dev.read_memory(&m, &mut saved).unwrap();
        assert!(saved[..] == data[..]);
        // From pageable memory, through the scheduler's staging buffer, in blocks.
        let staged = dev.fill_from_pageable(&data, false).unwrap();
        dev.read_memory(&staged, &mut saved).unwrap();
        assert!(saved[..] == data[..]);
        // A sealed copy cannot be the source of a writable mapping anywhere.
        let sealed = copy
            .downcast_ref::<torpor_device::host::HostMemory>()
            .unwrap();
        assert!(torpor_device::PhysicalMemory::is_sealed(sealed));
    }

    #[test]
    fn refresh_copies_only_the_blocks_that_changed() {
        let dev = Backend::new(
            HostDevice::new(),
            Pcie::new("host", Default::default(), None),
        );
        let page = 4096;
        let mut data: Vec<u8> = (0..4 * page).map(|i| (i % 249) as u8).collect();
        let m = dev.fill_from_bytes(&data, false).unwrap();
        let mut copy = dev.host_buffer(data.len()).unwrap();
        dev.read_memory(&m, &mut copy).unwrap();
        let hashes = block_hashes(&copy, page);
        assert_eq!(hashes.len(), 4);
        // Nothing written: nothing copied.
        let none = dev
            .refresh_fd(dev.export(&m).unwrap(), page, &hashes, &mut copy)
            .unwrap();
        assert!(none.is_empty(), "{none:?}");
        // One byte of the third block written through another mapping of the memory.
        data[2 * page + 17] ^= 0xff;
        let changed = dev.fill_from_bytes(&data, false).unwrap();
        let found = dev
            .refresh_fd(dev.export(&changed).unwrap(), page, &hashes, &mut copy)
            .unwrap();
        assert_eq!(found, vec![2]);
        assert!(copy[..] == data[..], "the refreshed copy differs");
    }

    #[test]
    fn refresh_finds_changes_in_every_batch_and_in_a_short_last_block() {
        let dev = Backend::new(
            HostDevice::new(),
            Pcie::new("host", Default::default(), None),
        );
        let page = 4096;
        // More blocks than one batch, the last one short (memory is whole pages).
        let block = 3 * page;
        let blocks = REFRESH_BLOCKS + 8;
        let len = blocks * block - page;
        let mut data: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
        let mut copy = data.clone();
        let hashes = block_hashes(&copy, block);
        for i in [0, REFRESH_BLOCKS - 1, REFRESH_BLOCKS + 3] {
            data[i * block + 5] ^= 0x5a;
        }
        data[len - 1] ^= 0x5a;
        let m = dev.fill_from_bytes(&data, false).unwrap();
        let found = dev.refresh_memory(&m, block, &hashes, &mut copy).unwrap();
        assert_eq!(
            found,
            vec![0, REFRESH_BLOCKS - 1, REFRESH_BLOCKS + 3, blocks - 1]
        );
        assert!(copy == data, "the refreshed copy differs");
    }

    /// The cuda backend's path (import, map read-only, device→host through pinned staging on
    /// several streams; create, host→device; device→device) on the fake driver built with its
    /// VMM calls, whose device memory is memfd memory: the same code the GPU machine runs.
    #[test]
    fn the_cuda_backend_copies_through_the_fake_driver() {
        use torpor_cuda::fakes::{self, Fake};
        use torpor_device::cuda::{CopyConfig, CudaDevice};
        let dir = tempfile::tempdir().unwrap();
        let lib = fakes::build(Fake::CudaWithVmm, dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let driver = torpor_cuda::CudaDriver::load_from(lib).unwrap();
        let config = CopyConfig {
            chunk: 64 << 10,
            ..CopyConfig::default()
        };
        let cuda = CudaDevice::open_with(driver, 0, config).unwrap();
        let granule = torpor_device::Device::granularity(&cuda);
        let dev = Backend::new(cuda, Pcie::new("cuda0", Default::default(), None));
        assert_eq!(dev.backend(), "cuda");
        let data: Vec<u8> = (0..2 * granule).map(|i| (i % 253) as u8).collect();
        let m = dev.fill_from_bytes(&data, false).unwrap();
        let copy = dev.fill_from_memory(&m, data.len(), true).unwrap();
        let mut out = dev.host_buffer(data.len()).unwrap();
        dev.read_fd(dev.export(&copy).unwrap(), &mut out).unwrap();
        assert!(
            out[..] == data[..],
            "the bytes changed on their way through device memory"
        );
        let mut saved = dev.host_buffer(data.len()).unwrap();
        dev.read_memory(&m, &mut saved).unwrap();
        assert!(saved[..] == data[..], "the saved contents differ");
    }
}
