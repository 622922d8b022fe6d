//! The cuda backend's tests, run on a real GPU by `tests/cuda.rs` and on the fake driver with
//! VMM calls by `tests/cuda_fake_driver.rs`. Each takes the device to test.

use std::os::fd::OwnedFd;

use torpor_device::cuda::{CopyConfig, CudaDevice};
use torpor_device::{Access, Device, DeviceError};

use super::{owned_segment, pattern};

/// The small chunks and three streams `copies_are_exact` needs, so that a 16 MiB copy goes
/// round the streams many times.
pub const SMALL_CHUNKS: CopyConfig = CopyConfig {
    streams: 3,
    chunk: 1 << 20,
};

/// The body of each test binary's `child_process_entry`: the device is the one
/// `TORPOR_LIBCUDA` names, which the parent passes on.
pub fn child_process_entry() {
    if let Some(conn) = super::child_connection() {
        let device = CudaDevice::open(0).unwrap_or_else(|e| {
            eprintln!("child: cannot open GPU 0: {e}");
            std::process::exit(5)
        });
        super::serve_as_child(&device, conn, |at| {
            let vmm = device.vmm().map_err(|e| e.to_string())?;
            // SAFETY: `at` is the child's mapping of imported device memory, not host memory.
            unsafe { vmm.fill(at, 0xee, 1) }.map_err(|e| e.to_string())?;
            vmm.synchronize().map_err(|e| e.to_string())
        });
    }
}

pub fn export_import_release(device: CudaDevice) {
    let len = 2 * device.granularity();
    super::scenario_export_import_release(&device, None, len);
}

pub fn two_importers_share_one_physical_copy(device: CudaDevice) {
    let len = 2 * device.granularity();
    super::scenario_two_importers_share_one_copy(&device, None, len);
}

pub fn a_write_through_a_read_only_mapping_is_refused(device: CudaDevice) {
    let len = 2 * device.granularity();
    let (child, at, memory) = super::scenario_sealed_segment(&device, None, len);
    match child.write_behind_the_device() {
        Ok(Err(message)) => assert!(
            message.contains("cuMemsetD8_v2 failed"),
            "the write was refused, but not by the driver's memset: {message}"
        ),
        Ok(Ok(())) => panic!(
            "the driver let the child write through a mapping set to CU_MEM_ACCESS_FLAGS_PROT_READ"
        ),
        Err(status) => panic!("the child died ({status}) writing through its read-only mapping"),
    }
    let mut back = vec![0; len];
    device.copy_to_host(at, &mut back).unwrap();
    assert!(
        back == pattern(len, 20),
        "the owner's data changed after the refused write"
    );
    device.release(at, memory).unwrap();
    device.free_reservation(at, len).unwrap();
}

/// Open the device with [`SMALL_CHUNKS`].
pub fn copies_are_exact(device: CudaDevice) {
    let len = (16_usize << 20).next_multiple_of(device.granularity());
    let (at, memory) = owned_segment(&device, None, len, 60);

    // Pageable → device was done by owned_segment; read back staged (pageable) and straight
    // (pinned).
    let mut staged = vec![0; len];
    device.copy_to_host(at, &mut staged).unwrap();
    assert!(
        staged == pattern(len, 60),
        "a staged device→host copy is wrong"
    );
    let mut pinned = device.host_buffer(len).unwrap();
    device.copy_to_host(at, &mut pinned).unwrap();
    assert!(
        *pinned == pattern(len, 60)[..],
        "a pinned device→host copy is wrong"
    );

    // Pinned → device, at an odd offset and length (not a whole number of chunks).
    let odd = 5 * (1 << 20) + 12345;
    pinned[..odd].copy_from_slice(&pattern(odd, 61));
    device.copy_to_device(at + 4099, &pinned[..odd]).unwrap();
    let mut expected = pattern(len, 60);
    expected[4099..4099 + odd].copy_from_slice(&pattern(odd, 61));
    let mut back = vec![0; len];
    device.copy_to_host(at, &mut back).unwrap();
    assert!(
        back == expected,
        "a pinned host→device copy at an odd offset is wrong"
    );

    // Host memory pinned in place: both directions, straight from and into it.
    let mut cache = pattern(len, 63);
    {
        let mut region = device.pin(&mut cache).unwrap();
        device.copy_to_device(at, &region).unwrap();
        region.fill(0);
        device.copy_to_host(at, &mut region).unwrap();
    }
    assert!(
        cache == pattern(len, 63),
        "a copy through host memory pinned in place is wrong"
    );
    device.copy_to_device(at, &expected).unwrap();

    // Device → device into a second segment.
    let (second, second_memory) = owned_segment(&device, None, len, 62);
    device.copy_within_device(at, second, len).unwrap();
    let mut copied = vec![0; 7777];
    device
        .copy_to_host(second + len as u64 - 7777, &mut copied)
        .unwrap();
    assert!(
        copied == expected[len - 7777..],
        "a device→device copy is wrong"
    );

    for (at, memory) in [(at, memory), (second, second_memory)] {
        device.release(at, memory).unwrap();
        device.free_reservation(at, len).unwrap();
    }
}

pub fn bad_addresses_sizes_and_fds(device: CudaDevice) {
    let g = device.granularity();
    let err = device.create(g + 4096).unwrap_err();
    assert!(matches!(err, DeviceError::Misaligned { .. }), "{err:?}");
    let memory = device.create(g).unwrap();
    let err = device
        .map(&memory, 0x7000_0000_0000, Access::ReadWrite)
        .unwrap_err();
    assert!(matches!(err, DeviceError::NotReserved { .. }), "{err:?}");
    let err = device
        .copy_to_host(0x7000_0000_0000, &mut [0; 8])
        .unwrap_err();
    assert!(matches!(err, DeviceError::NotMapped { .. }), "{err:?}");

    let (read, _write) = std::io::pipe().unwrap();
    let err = device.import(OwnedFd::from(read), g).unwrap_err();
    assert!(
        matches!(err, DeviceError::NotDeviceMemory { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        !text.contains('\n') && text.contains("pass an fd made by Device::export"),
        "{text}"
    );

    // A size larger than the exported memory is refused by the driver at map time.
    let at = device.reserve(2 * g, None).unwrap();
    let imported = device
        .import(device.export(&memory).unwrap(), 2 * g)
        .unwrap();
    let err = device.map(&imported, at, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, DeviceError::Cuda(_)), "{err:?}");
    assert!(err.to_string().contains("cuMemMap failed"), "{err}");
    device.free_reservation(at, 2 * g).unwrap();
}

/// The driver refuses to export an imported handle (`CUDA_ERROR_INVALID_VALUE` on the H100): a
/// restored worker that hibernates re-exports the daemon's memory it imported, so the device
/// hands out the fd the memory came from. The re-exported fd reaches the same bytes.
pub fn an_imported_allocation_exports_again(device: CudaDevice) {
    let len = 2 * device.granularity();
    let (at, memory) = owned_segment(&device, None, len, 3);
    let imported = device.import(device.export(&memory).unwrap(), len).unwrap();
    let again = device
        .import(
            device
                .export(&imported)
                .unwrap_or_else(|e| panic!("exporting imported memory: {e}")),
            len,
        )
        .unwrap();
    let at2 = device.reserve(len, None).unwrap();
    device.map(&again, at2, Access::ReadOnly).unwrap();
    let mut back = vec![0; len];
    device.copy_to_host(at2, &mut back).unwrap();
    assert!(
        back == pattern(len, 3),
        "the re-exported fd reaches other bytes"
    );
    device.release(at2, again).unwrap();
    device.free_reservation(at2, len).unwrap();
    drop(imported);
    device.release(at, memory).unwrap();
    device.free_reservation(at, len).unwrap();
}

/// `a` and `b` are two GPUs of one driver. Memory of `a` is copied into new memory of `b` device
/// to device, exactly, and the source is left as it was; `expect_peer` is whether the pair has
/// the peer path (without it nothing is copied and `false` says so).
pub fn peer_copy(a: &CudaDevice, b: &CudaDevice, expect_peer: bool) {
    let len = (6_usize << 20).next_multiple_of(a.granularity());
    let (at, src) = owned_segment(a, None, len, 70);
    let dst = b.create(len).unwrap();
    let copied = b.copy_from_peer(a, &src, &dst).unwrap();
    assert_eq!(copied, expect_peer, "copy_from_peer's answer");
    let got = b.reserve(len, None).unwrap();
    b.map(&dst, got, Access::ReadOnly).unwrap();
    let mut back = vec![0; len];
    b.copy_to_host(got, &mut back).unwrap();
    if expect_peer {
        assert!(back == pattern(len, 70), "the peer copy is not exact");
    } else {
        assert!(back != pattern(len, 70), "nothing was to be copied");
    }
    let mut source = vec![0; len];
    a.copy_to_host(at, &mut source).unwrap();
    assert!(source == pattern(len, 70), "the source changed");
    // The copy's own windows are gone: both devices map only what the test mapped.
    b.release(got, dst).unwrap();
    b.free_reservation(got, len).unwrap();
    a.release(at, src).unwrap();
    a.free_reservation(at, len).unwrap();
    // A smaller destination is refused before anything is copied.
    let (at, src) = owned_segment(a, None, len, 71);
    let small = b.create(a.granularity()).unwrap();
    assert!(matches!(
        b.copy_from_peer(a, &src, &small),
        Err(DeviceError::OutOfRange { .. })
    ));
    a.release(at, src).unwrap();
    a.free_reservation(at, len).unwrap();
}
