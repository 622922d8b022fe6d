//! The cuda backend on the fake driver with VMM calls (`tests/fakes/fake_libcuda.c` built with
//! `-DFAKE_CUDA_VMM`), whose "device" memory is memfd-backed host memory: the backend's own
//! logic (address bookkeeping, chunked copies over streams, pinned staging, fd export and import
//! between processes, error mapping) runs on every machine. What only the real driver can show
//! (its refusals, bandwidth) is in `tests/cuda.rs`, on the GPU machine.

mod common;

use std::path::{Path, PathBuf};

use common::cuda_cases::{self, SMALL_CHUNKS};
use torpor_cuda::fakes::{self, Fake};
use torpor_cuda::CudaDriver;
use torpor_device::cuda::{CopyConfig, CudaDevice};

/// The fake driver, built once; the child processes load it too.
fn fake_driver() -> PathBuf {
    common::CHILD_LIBCUDA
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("torpor-device-fakes");
            fakes::build(Fake::CudaWithVmm, &dir).unwrap_or_else(|e| panic!("{e}"))
        })
        .clone()
}

fn device(config: CopyConfig) -> CudaDevice {
    let driver = CudaDriver::load_from(fake_driver()).unwrap();
    CudaDevice::open_with(driver, 0, config).unwrap()
}

/// Not a test of its own: the entry point of the child processes the tests start
/// (`common::Child`). Run without the child's socket it does nothing.
#[test]
fn child_process_entry() {
    cuda_cases::child_process_entry();
}

#[test]
fn a_segment_exported_to_a_child_is_seen_there_with_the_same_bytes() {
    cuda_cases::export_import_release(device(CopyConfig::default()));
}

#[test]
fn two_importers_share_one_physical_copy() {
    cuda_cases::two_importers_share_one_physical_copy(device(CopyConfig::default()));
}

#[test]
fn a_write_through_a_read_only_mapping_is_refused_and_changes_nothing() {
    cuda_cases::a_write_through_a_read_only_mapping_is_refused(device(CopyConfig::default()));
}

#[test]
fn copies_are_exact_staged_or_pinned_and_of_any_length() {
    cuda_cases::copies_are_exact(device(SMALL_CHUNKS));
}

#[test]
fn bad_addresses_sizes_and_fds_are_clear_errors() {
    cuda_cases::bad_addresses_sizes_and_fds(device(CopyConfig::default()));
}

#[test]
fn the_device_knows_its_driver_and_gpu() {
    let device = device(CopyConfig::default());
    assert_eq!(device.ordinal(), 0);
    assert_eq!(device.driver().path(), fake_driver());
    assert_eq!(
        torpor_device::Device::granularity(&device),
        2 << 20,
        "the fake's granularity is an H100's"
    );
}

#[test]
fn an_imported_allocation_exports_again() {
    cuda_cases::an_imported_allocation_exports_again(device(CopyConfig::default()));
}

#[test]
fn memory_of_one_gpu_is_copied_to_another_device_to_device_where_they_reach_each_other() {
    // Two fake GPUs for the whole test binary (the other tests use GPU 0 only); both cases in
    // one test, as FAKE_CUDA_PEER is read at each call.
    std::env::set_var("FAKE_CUDA_DEVICES", "2");
    let gpu = |ordinal| {
        let driver = CudaDriver::load_from(fake_driver()).unwrap();
        CudaDevice::open_with(driver, ordinal, CopyConfig::default()).unwrap()
    };
    let (a, b) = (gpu(0), gpu(1));
    cuda_cases::peer_copy(&a, &b, true);
    std::env::set_var("FAKE_CUDA_PEER", "0");
    cuda_cases::peer_copy(&a, &b, false);
    std::env::remove_var("FAKE_CUDA_PEER");
    // A GPU is no peer of itself: the caller copies within the device instead.
    cuda_cases::peer_copy(&a, &gpu(0), false);
}
