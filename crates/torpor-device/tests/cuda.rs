//! The cuda backend on a real GPU: the host backend's scenario, plus the copy paths.
//!
//! Runs by plain `cargo test` wherever `nvidia-smi -L` lists a GPU; elsewhere each test prints
//! `SKIP <test>: <reason>` and passes. With a GPU present every failure is a failure, including
//! a driver that cannot be loaded.

mod common;

use std::process::Command;

use common::cuda_cases::{self, SMALL_CHUNKS};
use torpor_cuda::CudaDriver;
use torpor_device::cuda::{CopyConfig, CudaDevice};

/// Whether this machine has an NVIDIA GPU, as the repository's GPU tests decide it.
fn gpu_present() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|out| {
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("GPU ")
        })
}

/// GPU 0 as a cuda device, or `None` after printing why the test is skipped.
fn device_or_skip(test: &str, config: CopyConfig) -> Option<CudaDevice> {
    if !gpu_present() {
        eprintln!("SKIP {test}: no NVIDIA GPU (`nvidia-smi -L` fails or lists none)");
        return None;
    }
    let driver = CudaDriver::load().unwrap_or_else(|e| {
        panic!("{test}: `nvidia-smi -L` lists a GPU but the CUDA driver does not load: {e}")
    });
    Some(CudaDevice::open_with(driver, 0, config).unwrap_or_else(|e| {
        panic!("{test}: `nvidia-smi -L` lists a GPU but GPU 0 cannot be opened as a cuda device: {e}")
    }))
}

/// Not a test of its own: the entry point of the child processes the tests start
/// (`common::Child`). Run without the child's socket it does nothing.
#[test]
fn child_process_entry() {
    cuda_cases::child_process_entry();
}

#[test]
fn a_segment_exported_to_a_child_is_seen_there_with_the_same_bytes() {
    let test = "a_segment_exported_to_a_child_is_seen_there_with_the_same_bytes";
    if let Some(device) = device_or_skip(test, CopyConfig::default()) {
        cuda_cases::export_import_release(device);
    }
}

#[test]
fn two_importers_share_one_physical_copy() {
    let test = "two_importers_share_one_physical_copy";
    if let Some(device) = device_or_skip(test, CopyConfig::default()) {
        cuda_cases::two_importers_share_one_physical_copy(device);
    }
}

#[test]
fn a_write_through_a_read_only_mapping_is_refused_and_changes_nothing() {
    let test = "a_write_through_a_read_only_mapping_is_refused_and_changes_nothing";
    if let Some(device) = device_or_skip(test, CopyConfig::default()) {
        cuda_cases::a_write_through_a_read_only_mapping_is_refused(device);
    }
}

#[test]
fn copies_are_exact_staged_or_pinned_and_of_any_length() {
    let test = "copies_are_exact_staged_or_pinned_and_of_any_length";
    if let Some(device) = device_or_skip(test, SMALL_CHUNKS) {
        cuda_cases::copies_are_exact(device);
    }
}

#[test]
fn bad_addresses_sizes_and_fds_are_clear_errors() {
    let test = "bad_addresses_sizes_and_fds_are_clear_errors";
    if let Some(device) = device_or_skip(test, CopyConfig::default()) {
        cuda_cases::bad_addresses_sizes_and_fds(device);
    }
}

#[test]
fn an_imported_allocation_exports_again() {
    let test = "an_imported_allocation_exports_again";
    if let Some(device) = device_or_skip(test, CopyConfig::default()) {
        cuda_cases::an_imported_allocation_exports_again(device);
    }
}
