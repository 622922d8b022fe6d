//! The host (memfd) backend with real memory and real processes.

mod common;

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;

use common::{owned_segment, pattern, Child};
use torpor_device::host::HostDevice;
use torpor_device::{Access, Device, DeviceError, PhysicalMemory};

/// Each test reserves at its own fixed address, far from where the kernel puts mappings, so the
/// child processes can reserve the same addresses.
fn test_address(slot: u64) -> u64 {
    0x3f00_0000_0000 + slot * 0x1_0000_0000
}

const PAGES: usize = 16;

fn len(device: &HostDevice) -> usize {
    PAGES * device.granularity()
}

/// Not a test of its own: the entry point of the child processes the tests start
/// (`common::Child`). Run without the child's socket it does nothing.
#[test]
fn child_process_entry() {
    if let Some(conn) = common::child_connection() {
        common::serve_as_child(&HostDevice::new(), conn, |at| {
            // SAFETY: `at` is the start of the child's mapping of the segment; a write through a
            // read-only mapping is what this command exists to try (it faults).
            unsafe { std::ptr::write_volatile(at as *mut u8, 0xee) };
            Ok(())
        });
    }
}

#[test]
fn a_segment_exported_to_a_child_is_seen_there_at_the_same_address() {
    let device = HostDevice::new();
    common::scenario_export_import_release(&device, Some(test_address(1)), len(&device));
}

#[test]
fn two_importers_share_one_physical_copy() {
    let device = HostDevice::new();
    common::scenario_two_importers_share_one_copy(&device, Some(test_address(2)), len(&device));
}

#[test]
fn a_write_through_a_sealed_read_only_mapping_faults_and_changes_nothing() {
    let device = HostDevice::new();
    let len = len(&device);
    let (child, at, memory) = common::scenario_sealed_segment(&device, Some(test_address(3)), len);

    // The kernel itself refuses a writable mapping of the sealed memfd to anyone holding it.
    let fd = device.export(&memory).unwrap();
    // SAFETY: a new mapping anywhere the kernel chooses; it is unmapped below if made.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    let errno = std::io::Error::last_os_error().raw_os_error();
    assert_eq!(
        ptr,
        libc::MAP_FAILED,
        "a writable mapping of a sealed memfd was allowed"
    );
    assert_eq!(errno, Some(libc::EPERM));
    // A child that asks for a writable mapping gets the clear error.
    let err = Child::start(&device, &memory, at, Access::ReadWrite)
        .err()
        .unwrap();
    assert!(err.contains("sealed read-only"), "{err}");

    let status = child
        .write_behind_the_device()
        .expect_err("the write through a read-only mapping did not fault");
    assert_eq!(
        status.signal(),
        Some(libc::SIGSEGV),
        "the child should die by SIGSEGV, it ended with {status}"
    );
    let mut back = vec![0; len];
    device.copy_to_host(at, &mut back).unwrap();
    assert!(back == pattern(len, 20), "the owner's data changed");
    device.release(at, memory).unwrap();
    device.free_reservation(at, len).unwrap();
}

#[test]
fn sealing_waits_for_writable_mappings_to_go() {
    let device = HostDevice::new();
    let len = len(&device);
    let (at, memory) = owned_segment(&device, Some(test_address(4)), len, 30);
    let err = device.seal_read_only(&memory).unwrap_err();
    assert!(matches!(err, DeviceError::WritableMappingExists), "{err:?}");
    assert!(!memory.is_sealed());
    device.unmap(at, len).unwrap();
    device.seal_read_only(&memory).unwrap();
    // Sealing twice is harmless.
    device.seal_read_only(&memory).unwrap();
    assert!(memory.is_sealed());
    // An import of the sealed memory knows it is sealed.
    let imported = device.import(device.export(&memory).unwrap(), len).unwrap();
    assert!(imported.is_sealed());
    assert!(matches!(
        device.map(&imported, at, Access::ReadWrite),
        Err(DeviceError::Sealed)
    ));
    device.free_reservation(at, len).unwrap();
}

/// The device and inode numbers of a descriptor's file.
fn file_id(fd: impl AsFd) -> (u64, u64) {
    let meta = std::fs::File::from(fd.as_fd().try_clone_to_owned().unwrap())
        .metadata()
        .unwrap();
    (meta.dev(), meta.ino())
}

/// The ranges of /proc/self/maps as (start, end, perms, inode, path).
fn maps() -> Vec<(u64, u64, String, u64, String)> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-').unwrap();
            (
                u64::from_str_radix(start, 16).unwrap(),
                u64::from_str_radix(end, 16).unwrap(),
                fields[1].to_owned(),
                fields[4].parse().unwrap(),
                fields.get(5..).map(|p| p.join(" ")).unwrap_or_default(),
            )
        })
        .collect()
}

/// Whether a mapping of this process is of the memfd with inode `ino`.
fn memfd_is_mapped(ino: u64) -> bool {
    maps()
        .iter()
        .any(|m| m.3 == ino && m.4.contains("memfd:torpor-segment"))
}

/// Whether any descriptor of this process refers to the file `id`.
fn some_fd_refers_to(id: (u64, u64)) -> bool {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::metadata(entry.ok()?.path()).ok())
        .any(|m| (m.dev(), m.ino()) == id)
}

#[test]
fn release_keeps_the_addresses_reserved_and_frees_the_memory() {
    let device = HostDevice::new();
    let len = 64 * device.granularity();
    // Reserved wherever the kernel likes, as the worker's hook does.
    let (at, memory) = owned_segment(&device, None, len, 40);
    let id = file_id(&memory);
    assert!(maps()
        .iter()
        .any(|m| m.3 == id.1 && m.0 == at && m.1 == at + len as u64));
    assert!(some_fd_refers_to(id));

    device.release(at, memory).unwrap();

    // The memfd is gone: no mapping and no descriptor refers to it any more.
    assert!(!memfd_is_mapped(id.1), "the memfd is still mapped");
    assert!(!some_fd_refers_to(id), "a descriptor still holds the memfd");
    // The addresses are still reserved: one inaccessible anonymous range covers them.
    assert!(
        maps()
            .iter()
            .any(|m| m.0 <= at && at + len as u64 <= m.1 && m.2 == "---p" && m.3 == 0),
        "no PROT_NONE range covers {at:#x}..{:#x} in /proc/self/maps",
        at + len as u64
    );
    // New mappings never land inside the reservation.
    let mut others = Vec::new();
    for _ in 0..256 {
        // SAFETY: a new private anonymous mapping wherever the kernel chooses.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        let start = ptr as u64;
        assert!(
            start + len as u64 <= at || at + len as u64 <= start,
            "a new mapping at {start:#x} landed in the reservation at {at:#x}"
        );
        others.push(ptr);
    }
    for ptr in others {
        // SAFETY: each is a mapping made above of `len` bytes, used by nothing.
        unsafe { libc::munmap(ptr, len) };
    }
    device.free_reservation(at, len).unwrap();
    let err = device.free_reservation(at, len).unwrap_err();
    assert!(matches!(err, DeviceError::NotReserved { .. }), "{err:?}");
}

/// Each error's message is one line and names the fix.
fn one_clear_line(err: &DeviceError, fix: &str) {
    let text = err.to_string();
    assert!(!text.contains('\n'), "{text}");
    assert!(text.contains(fix), "`{text}` should say `{fix}`");
}

#[test]
fn bad_addresses_and_sizes_are_clear_errors() {
    let device = HostDevice::new();
    let page = device.granularity();
    let len = len(&device);
    let (at, memory) = owned_segment(&device, Some(test_address(5)), len, 50);

    let err = device.reserve(page + 1, None).unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{err:?}");
    one_clear_line(&err, "round it up to a whole number of granules");
    let err = device.create(page / 2).unwrap_err();
    one_clear_line(&err, "round it up");
    let err = device.create(0).unwrap_err();
    assert!(matches!(err, DeviceError::ZeroSize { .. }), "{err:?}");

    // Addresses this device did not reserve, or reserved by something else.
    let other = device.create(page).unwrap();
    let err = device.map(&other, 0x10000, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, DeviceError::NotReserved { .. }), "{err:?}");
    one_clear_line(&err, "reserve the range first");
    let err = device
        .map(&other, at + len as u64 - page as u64 / 2, Access::ReadWrite)
        .unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{err:?}");
    let err = device.map(&other, at, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, DeviceError::AlreadyMapped { .. }), "{err:?}");
    one_clear_line(&err, "unmap it first");
    let err = device.reserve(len, Some(at + page as u64)).unwrap_err();
    assert!(matches!(err, DeviceError::AddressInUse { .. }), "{err:?}");
    // Held by a mapping this device knows nothing of: the kernel says so.
    let stack = &err as *const DeviceError as u64 & !(page as u64 - 1);
    let err = device.reserve(page, Some(stack)).unwrap_err();
    assert!(matches!(err, DeviceError::AddressInUse { .. }), "{err:?}");
    one_clear_line(&err, "reserve elsewhere");

    // Copies outside a mapping are errors, not faults.
    let err = device
        .copy_to_device(at + len as u64 - 4, &[0; 8])
        .unwrap_err();
    assert!(matches!(err, DeviceError::NotMapped { .. }), "{err:?}");
    one_clear_line(&err, "copies must stay inside one mapping");
    let err = device.copy_to_host(0x1000, &mut [0; 8]).unwrap_err();
    assert!(matches!(err, DeviceError::NotMapped { .. }), "{err:?}");
    let err = device.unmap(at, page).unwrap_err();
    assert!(matches!(err, DeviceError::NotMapped { .. }), "{err:?}");
    let err = device.free_reservation(at, len).unwrap_err();
    assert!(
        matches!(err, DeviceError::StillMapped { mappings: 1, .. }),
        "{err:?}"
    );
    one_clear_line(&err, "unmap them before freeing it");

    // Copies within the device.
    device
        .copy_within_device(at, at + page as u64, 100)
        .unwrap();
    let mut back = vec![0; 100];
    device.copy_to_host(at + page as u64, &mut back).unwrap();
    assert!(back == pattern(len, 50)[..100]);

    device.release(at, memory).unwrap();
    device.free_reservation(at, len).unwrap();
}

#[test]
fn bad_fds_are_clear_errors() {
    let device = HostDevice::new();
    let page = device.granularity();
    let memory = device.create(4 * page).unwrap();

    let err = device
        .import(device.export(&memory).unwrap(), 8 * page)
        .unwrap_err();
    assert!(
        matches!(err, DeviceError::SizeMismatch { expected, actual } if expected == 8 * page && actual == 4 * page as u64),
        "{err:?}"
    );
    one_clear_line(&err, "check the manifest");

    let (read, _write) = std::io::pipe().unwrap();
    let err = device.import(OwnedFd::from(read), page).unwrap_err();
    assert!(
        matches!(err, DeviceError::NotDeviceMemory { .. }),
        "{err:?}"
    );
    one_clear_line(&err, "pass an fd made by Device::export");
    assert!(err.to_string().contains("not a regular file"), "{err}");

    let file = tempfile::tempfile().unwrap();
    file.set_len(page as u64).unwrap();
    let err = device.import(OwnedFd::from(file), page).unwrap_err();
    assert!(err.to_string().contains("not a memfd"), "{err}");

    // A memfd whose owner can still resize it would let a mapping fault.
    // SAFETY: a NUL-terminated literal name and valid flags.
    let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0);
    // SAFETY: memfd_create returned a new descriptor owned by nothing else.
    let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
    std::fs::File::from(unsealed.try_clone().unwrap())
        .set_len(page as u64)
        .unwrap();
    let err = device.import(unsealed, page).unwrap_err();
    assert!(err.to_string().contains("size is not sealed"), "{err}");
}

#[test]
fn a_write_without_a_mapping_lands_in_the_memory_and_a_write_past_its_end_is_refused() {
    let device = HostDevice::new();
    let len = len(&device);
    let memory = device.create(len).unwrap();
    let data = pattern(len, 7);
    // In two pieces, the second at an offset, as the PCIe scheduler hands them out.
    let half = len / 2;
    device.write_unmapped(&memory, 0, &data[..half]).unwrap();
    device.write_unmapped(&memory, half, &data[half..]).unwrap();
    // Nothing of this device's address space was used.
    let at = device.reserve(len, Some(test_address(9))).unwrap();
    device.map(&memory, at, Access::ReadOnly).unwrap();
    let mut back = vec![0u8; len];
    device.copy_to_host(at, &mut back).unwrap();
    assert!(back == data, "the bytes written unmapped differ");
    device.unmap(at, len).unwrap();
    device.free_reservation(at, len).unwrap();
    let err = device
        .write_unmapped(&memory, len - 1, &[1, 2])
        .unwrap_err();
    assert!(matches!(err, DeviceError::OutOfRange { .. }), "{err}");
    one_clear_line(&err, "report this as a Torpor bug");
}
