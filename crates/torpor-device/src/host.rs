//! The host backend: "device" memory is memfd-backed memory of this process.
//!
//! Addresses are reserved with an inaccessible anonymous mapping, physical memory is a memfd,
//! mapping puts the memfd over part of a reservation with `MAP_FIXED | MAP_SHARED`, and unmapping
//! puts an inaccessible anonymous mapping back, so the range stays reserved (no later `mmap` can
//! land in it). A memfd's size is sealed when it is created, so no process holding it can shrink
//! it under another's mapping (which would turn reads into `SIGBUS`); read-only sharing adds
//! `F_SEAL_WRITE`, after which the kernel refuses every writable mapping of it.

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::RwLock;

use crate::address_space::AddressSpace;
use crate::error::DeviceError;
use crate::{Access, Device, PhysicalMemory};

const BACKEND: &str = "host";

/// The host backend. Granularity: the page size.
#[derive(Debug)]
pub struct HostDevice {
    page_size: usize,
    space: RwLock<AddressSpace>,
}

/// A memfd of a fixed size.
#[derive(Debug)]
pub struct HostMemory {
    fd: OwnedFd,
    size: usize,
}

impl AsFd for HostMemory {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The seals of `fd`, or the error `fcntl(F_GET_SEALS)` gave (`EINVAL` for a file that is not a
/// memfd or on tmpfs).
fn seals(fd: BorrowedFd<'_>) -> Result<i32, std::io::Error> {
    // SAFETY: F_GET_SEALS takes no argument and only reads the descriptor's state.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(seals)
}

impl PhysicalMemory for HostMemory {
    fn size(&self) -> usize {
        self.size
    }

    fn is_sealed(&self) -> bool {
        seals(self.fd.as_fd()).is_ok_and(|s| s & libc::F_SEAL_WRITE != 0)
    }
}

/// The most one copy moves while it holds the address space's read lock. A fill's `reserve` and
/// `map` need the write lock, so a copy of a whole large segment under one read lock made a
/// small fill wait for all of it (the fair PCIe test on the H100: the small fill reached the
/// scheduler only after the 1 GiB copy ended); 16 MiB is ~10 ms of page-faulting memcpy.
const LOCK_SPAN: usize = 16 << 20;

/// Seals that every memfd of this backend carries from its creation: its size never changes.
const SIZE_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
/// How long sealing waits out a writable mapping that a forked child still holds (it goes when
/// the child execs); a mapping that outlasts this is a real one, and the seal is refused.
const SEAL_BUSY_RETRY: std::time::Duration = std::time::Duration::from_millis(500);

impl Default for HostDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl HostDevice {
    pub fn new() -> Self {
        // SAFETY: sysconf only reads a system constant.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page_size = usize::try_from(page).unwrap_or(4096);
        HostDevice {
            page_size,
            space: RwLock::new(AddressSpace::new(BACKEND, page_size)),
        }
    }

    fn space(&self) -> std::sync::RwLockReadGuard<'_, AddressSpace> {
        // The bookkeeping is updated only after each system call succeeded, so a panic while
        // the lock was held cannot have left it inconsistent.
        self.space.read().unwrap_or_else(|p| p.into_inner())
    }

    fn space_mut(&self) -> std::sync::RwLockWriteGuard<'_, AddressSpace> {
        self.space.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Puts an inaccessible, unbacked anonymous mapping at `at..at+len` (over whatever this device
/// had there).
fn map_inaccessible(at: u64, len: usize) -> Result<(), DeviceError> {
    // SAFETY: the range is one of this device's reservations (checked by the caller against the
    // address space), so replacing its pages affects no memory Rust code refers to.
    let ptr = unsafe {
        libc::mmap(
            at as *mut c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(DeviceError::os(
            "mmap(PROT_NONE, MAP_FIXED)",
            "the process may be out of mappings (vm.max_map_count); raise it",
        ));
    }
    Ok(())
}

impl Device for HostDevice {
    type Memory = HostMemory;
    type HostBuffer = Vec<u8>;

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn granularity(&self) -> usize {
        self.page_size
    }

    fn reserve(&self, len: usize, at: Option<u64>) -> Result<u64, DeviceError> {
        let mut space = self.space_mut();
        space.check_reserve(at, len)?;
        let fixed = if at.is_some() {
            libc::MAP_FIXED_NOREPLACE
        } else {
            0
        };
        // SAFETY: without MAP_FIXED the kernel picks free addresses, and MAP_FIXED_NOREPLACE
        // fails rather than replace an existing mapping, so no memory in use is touched.
        let ptr = unsafe {
            libc::mmap(
                at.unwrap_or(0) as *mut c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let source = std::io::Error::last_os_error();
            if let (Some(at), Some(libc::EEXIST)) = (at, source.raw_os_error()) {
                return Err(DeviceError::AddressInUse { at, len });
            }
            return Err(DeviceError::Os {
                call: "mmap(PROT_NONE)",
                hint: "the address space or vm.max_map_count is exhausted; reserve less",
                source,
            });
        }
        let start = ptr as u64;
        if let Some(at) = at.filter(|&at| at != start) {
            // A kernel older than 4.17 reads MAP_FIXED_NOREPLACE as a hint.
            // SAFETY: `ptr..ptr+len` is the mapping just made, which nothing else refers to.
            unsafe { libc::munmap(ptr, len) };
            return Err(DeviceError::AddressInUse { at, len });
        }
        space.add_reservation(start, len);
        Ok(start)
    }

    fn free_reservation(&self, at: u64, len: usize) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.remove_reservation(at, len)?;
        // SAFETY: the range is a whole reservation of this device with nothing mapped in it.
        if unsafe { libc::munmap(at as *mut c_void, len) } != 0 {
            space.add_reservation(at, len);
            return Err(DeviceError::os("munmap", "report this as a Torpor bug"));
        }
        Ok(())
    }

    fn create(&self, len: usize) -> Result<HostMemory, DeviceError> {
        self.space().check_size("memory size", len)?;
        // SAFETY: the name is a NUL-terminated literal; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(
                c"torpor-segment".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(DeviceError::os(
                "memfd_create",
                "the process may be out of file descriptors (ulimit -n); raise the limit",
            ));
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len).map_err(|_| DeviceError::Os {
            call: "ftruncate",
            hint: "give a smaller size",
            source: std::io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        // SAFETY: the descriptor is a memfd this function owns.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(DeviceError::os(
                "ftruncate(memfd)",
                "tmpfs may be full or limited; free memory or give a smaller size",
            ));
        }
        // SAFETY: F_ADD_SEALS takes an int of seal flags.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
            return Err(DeviceError::os(
                "fcntl(F_ADD_SEALS)",
                "the kernel does not support memfd seals; use Linux >= 3.17",
            ));
        }
        Ok(HostMemory { fd, size: len })
    }

    fn export(&self, memory: &HostMemory) -> Result<OwnedFd, DeviceError> {
        memory.fd.try_clone().map_err(|source| DeviceError::Os {
            call: "dup",
            hint: "the process may be out of file descriptors (ulimit -n); raise the limit",
            source,
        })
    }

    fn import(&self, fd: OwnedFd, len: usize) -> Result<HostMemory, DeviceError> {
        self.space().check_size("memory size", len)?;
        let not_memory = |reason: String| DeviceError::NotDeviceMemory {
            backend: BACKEND,
            fd: fd.as_raw_fd(),
            reason,
        };
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: the out pointer is valid for one `struct stat`.
        if unsafe { libc::fstat(fd.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
            return Err(not_memory(format!(
                "fstat: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: fstat succeeded, so it filled the struct.
        let stat = unsafe { stat.assume_init() };
        if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(not_memory(
                "it is not a regular file (a socket, pipe or device?)".into(),
            ));
        }
        match seals(fd.as_fd()) {
            Err(e) => return Err(not_memory(format!("it is not a memfd: F_GET_SEALS: {e}"))),
            Ok(s) if s & SIZE_SEALS != SIZE_SEALS => {
                return Err(not_memory(
                    "its size is not sealed, so its owner could shrink it under a mapping".into(),
                ))
            }
            Ok(_) => {}
        }
        if u64::try_from(stat.st_size).ok() != Some(len as u64) {
            return Err(DeviceError::SizeMismatch {
                expected: len,
                actual: stat.st_size as u64,
            });
        }
        Ok(HostMemory { fd, size: len })
    }

    fn seal_read_only(&self, memory: &HostMemory) -> Result<(), DeviceError> {
        // F_SEAL_SEAL too: nobody can change the seals after this.
        let add = libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // A child this process forked meanwhile (torpord runs CRIU while it fills segments)
        // holds a copy of every writable mapping until it execs: EBUSY then passes in moments.
        let deadline = std::time::Instant::now() + SEAL_BUSY_RETRY;
        // SAFETY: F_ADD_SEALS takes an int of seal flags.
        while unsafe { libc::fcntl(memory.fd.as_raw_fd(), libc::F_ADD_SEALS, add) } != 0 {
            let source = std::io::Error::last_os_error();
            if source.raw_os_error() == Some(libc::EBUSY) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
                continue;
            }
            return match source.raw_os_error() {
                Some(libc::EBUSY) => Err(DeviceError::WritableMappingExists),
                // Already sealed (F_SEAL_SEAL is set): fine when the write seal is there.
                Some(libc::EPERM) if memory.is_sealed() => Ok(()),
                _ => Err(DeviceError::Os {
                    call: "fcntl(F_ADD_SEALS, F_SEAL_WRITE)",
                    hint: "the memory's seals are fixed already; seal it before sharing it",
                    source,
                }),
            };
        }
        Ok(())
    }

    fn map(&self, memory: &HostMemory, at: u64, access: Access) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.check_map(at, memory.size)?;
        if access == Access::ReadWrite && memory.is_sealed() {
            return Err(DeviceError::Sealed);
        }
        let prot = match access {
            Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            Access::ReadOnly => libc::PROT_READ,
        };
        // SAFETY: `at..at+size` lies inside one of this device's reservations with nothing mapped
        // there (checked above), so MAP_FIXED replaces only inaccessible reserved pages.
        let ptr = unsafe {
            libc::mmap(
                at as *mut c_void,
                memory.size,
                prot,
                libc::MAP_SHARED | libc::MAP_FIXED,
                memory.fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let source = std::io::Error::last_os_error();
            // A failed MAP_FIXED may have removed the old pages: reserve the range again.
            let _ = map_inaccessible(at, memory.size);
            if source.raw_os_error() == Some(libc::EPERM) && access == Access::ReadWrite {
                return Err(DeviceError::Sealed);
            }
            return Err(DeviceError::Os {
                call: "mmap(MAP_FIXED | MAP_SHARED)",
                hint: "the process may be out of mappings (vm.max_map_count); raise it",
                source,
            });
        }
        space.add_mapping(at, memory.size, access);
        Ok(())
    }

    fn unmap(&self, at: u64, len: usize) -> Result<(), DeviceError> {
        let mut space = self.space_mut();
        space.mapping(at, len)?;
        map_inaccessible(at, len)?;
        space.remove_mapping(at, len)?;
        Ok(())
    }

    fn copy_to_device(&self, dst: u64, src: &[u8]) -> Result<(), DeviceError> {
        for (i, piece) in src.chunks(LOCK_SPAN).enumerate() {
            let at = dst + (i * LOCK_SPAN) as u64;
            let space = self.space();
            space.check_access(at, piece.len(), true)?;
            // SAFETY: `at..at+len` lies inside one writable mapping of this device, which cannot
            // be unmapped while the read lock is held; `piece` is a distinct host buffer.
            unsafe { std::ptr::copy(piece.as_ptr(), at as *mut u8, piece.len()) };
        }
        Ok(())
    }

    fn copy_to_host(&self, src: u64, dst: &mut [u8]) -> Result<(), DeviceError> {
        for (i, piece) in dst.chunks_mut(LOCK_SPAN).enumerate() {
            let at = src + (i * LOCK_SPAN) as u64;
            let space = self.space();
            space.check_access(at, piece.len(), false)?;
            // SAFETY: `at..at+len` lies inside one mapping of this device, readable and kept
            // mapped while the read lock is held; `piece` is an exclusive host buffer.
            unsafe { std::ptr::copy(at as *const u8, piece.as_mut_ptr(), piece.len()) };
        }
        Ok(())
    }

    fn copy_within_device(&self, src: u64, dst: u64, len: usize) -> Result<(), DeviceError> {
        // Overlapping ranges go in one copy (`ptr::copy` handles the overlap only as a whole).
        let span = if src.abs_diff(dst) < len as u64 {
            len
        } else {
            LOCK_SPAN
        };
        let mut done = 0;
        while done < len {
            let n = span.min(len - done);
            let (from, to) = (src + done as u64, dst + done as u64);
            let space = self.space();
            space.check_access(from, n, false)?;
            space.check_access(to, n, true)?;
            // SAFETY: both ranges lie inside mappings of this device (the destination writable),
            // kept mapped while the read lock is held; `copy` allows the ranges to overlap.
            unsafe { std::ptr::copy(from as *const u8, to as *mut u8, n) };
            done += n;
        }
        Ok(())
    }

    fn copy_from_peer(
        &self,
        _from: &Self,
        src: &HostMemory,
        dst: &HostMemory,
    ) -> Result<bool, DeviceError> {
        use std::os::unix::fs::FileExt;
        crate::fits(src.size, dst.size)?;
        // Borrowed, not owned: the memfds stay with their memory.
        let borrow = |m: &HostMemory| {
            std::mem::ManuallyDrop::new(
                // SAFETY: the descriptor is open while `m` is borrowed, and the ManuallyDrop
                // keeps this File from closing it.
                unsafe { std::fs::File::from_raw_fd(m.fd.as_raw_fd()) },
            )
        };
        let (from, to) = (borrow(src), borrow(dst));
        let os = |call| {
            move |source| DeviceError::Os {
                call,
                hint: "the memfd of a segment could not be copied",
                source,
            }
        };
        let mut buf = vec![0u8; LOCK_SPAN.min(src.size)];
        let mut at = 0usize;
        while at < src.size {
            let n = buf.len().min(src.size - at);
            from.read_exact_at(&mut buf[..n], at as u64)
                .map_err(os("pread(memfd)"))?;
            to.write_all_at(&buf[..n], at as u64)
                .map_err(os("pwrite(memfd)"))?;
            at += n;
        }
        Ok(true)
    }

    fn host_buffer(&self, len: usize) -> Result<Vec<u8>, DeviceError> {
        Ok(vec![0; len])
    }

    const WRITES_UNMAPPED: bool = true;

    /// `pwrite` into the memfd: no mapping in this process, so no address-space lock is taken.
    fn write_unmapped(
        &self,
        memory: &HostMemory,
        offset: usize,
        src: &[u8],
    ) -> Result<(), DeviceError> {
        use std::os::unix::fs::FileExt;
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > memory.size)
        {
            return Err(DeviceError::OutOfRange {
                offset,
                len: src.len(),
                size: memory.size,
            });
        }
        // Borrowed, not owned: the memfd stays with `memory`.
        let file = std::mem::ManuallyDrop::new(
            // SAFETY: the descriptor is open for as long as `memory` is borrowed, and the
            // ManuallyDrop keeps this File from closing it.
            unsafe { std::fs::File::from_raw_fd(memory.fd.as_raw_fd()) },
        );
        file.write_all_at(src, offset as u64)
            .map_err(|source| DeviceError::Os {
                call: "pwrite(memfd)",
                hint: "tmpfs may be full or limited; free memory or give a smaller size",
                source,
            })
    }
}
