//! Interposition without a GPU: a C program that calls `cuMemAlloc_v2`/`cuMemFree_v2` through
//! its ordinary dynamic symbols, linked against the fake driver with VMM calls
//! (`tests/fakes/fake_libcuda.c`, `-DFAKE_CUDA_VMM`, whose device memory is memfd-backed host
//! memory), run with `LD_PRELOAD=libtorpor_hook.so`. The program asks the hook's C API what
//! became of each allocation. `cudaMalloc` needs libcudart, so it is tested on the GPU machine
//! (`tests/test_hook_gpu.py`).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use torpor_cuda::fakes::{self, Fake};

const PROGRAM_C: &str = include_str!("programs/driver_alloc.c");

/// The hook cdylib cargo built for this test run: beside the test binary in target/<profile>/deps
/// (`cargo build` also copies it to target/<profile>/, but `cargo test` does not update that copy).
fn hook_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let library = exe.with_file_name("libtorpor_hook.so");
    assert!(
        library.exists(),
        "{} is missing: cargo builds it with the crate's tests (crate-type cdylib)",
        library.display()
    );
    library
}

/// The fake driver and the program linked against it, built once.
fn built() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("torpor-hook-fakes");
        let driver = fakes::build(Fake::CudaWithVmm, &dir).unwrap_or_else(|e| panic!("{e}"));
        let source = dir.join("driver_alloc.c");
        std::fs::write(&source, PROGRAM_C).unwrap();
        // Built aside and renamed, so concurrent test runs never run a half-written program.
        let program = dir.join("driver_alloc");
        let aside = dir.join(format!(".driver_alloc.{}", std::process::id()));
        let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
        let output = Command::new(&compiler)
            .args(["-O1", "-Wall", "-std=c11", "-pthread", "-o"])
            .arg(&aside)
            .arg(&source)
            .arg(&driver)
            .arg("-ldl")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {compiler}: {e}; install a C compiler"));
        assert!(
            output.status.success(),
            "{compiler} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        std::fs::rename(&aside, &program).unwrap();
        (driver, program)
    })
}

/// Runs the program with the hook preloaded and `env`, returning its key=value lines and its
/// stderr.
fn run(env: &[(&str, &OsStr)]) -> (BTreeMap<String, Vec<String>>, String) {
    let (driver, program) = built();
    let mut command = Command::new(program);
    command
        .env("TORPOR_LIBCUDA", driver)
        .env("LD_PRELOAD", hook_library())
        .env_remove("TORPOR_HOOK_CUDA")
        .env_remove("FAKE_CUDA_MEM_CREATE_RESULT");
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the program failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let mut facts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in stdout.lines() {
        let (key, value) = line.split_once('=').unwrap();
        facts.entry(key.into()).or_default().push(value.into());
    }
    (facts, String::from_utf8_lossy(&output.stderr).into_owned())
}

const ON: (&str, &str) = ("TORPOR_HOOK_CUDA", "1");

fn os(pairs: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static OsStr)> {
    pairs.iter().map(|&(k, v)| (k, OsStr::new(v))).collect()
}

fn one<'a>(facts: &'a BTreeMap<String, Vec<String>>, key: &str) -> &'a str {
    facts
        .get(key)
        .and_then(|v| v.first())
        .unwrap_or_else(|| panic!("the program printed no {key}: {facts:?}"))
}

#[test]
fn big_driver_allocations_become_segments_that_release_and_map_back() {
    let (facts, stderr) = run(&os(&[ON]));
    assert_eq!(stderr, "", "the hook complained");
    assert_eq!(one(&facts, "hook"), "loaded");
    // Without a current context the call goes to the driver, which refuses it as usual.
    assert_eq!(one(&facts, "no_context.result"), "201");
    assert_eq!(one(&facts, "big.result"), "0");
    assert_eq!(one(&facts, "small.result"), "0");
    assert_eq!(one(&facts, "context_kept"), "1");

    // Only the big one is a segment: 3 MiB + 1 rounded up to 4 MiB, cuda, GPU 0, mapped.
    let big = one(&facts, "big");
    assert_eq!(one(&facts, "allocated.segments"), "1");
    assert_eq!(
        one(&facts, "allocated.segment"),
        format!("{big},{},1,0,1", 4 << 20)
    );
    assert_eq!(one(&facts, "exported"), "1");
    assert_eq!(one(&facts, "export_small"), "-1");

    assert_eq!(one(&facts, "release.result"), "0");
    assert_eq!(one(&facts, "release.bytes"), (4u64 << 20).to_string());
    assert_eq!(
        one(&facts, "released.segment"),
        format!("{big},{},1,0,0", 4 << 20)
    );
    assert_eq!(one(&facts, "map.result"), "0");
    assert_eq!(one(&facts, "mapped_back"), "1");

    // Freeing the segment goes to the hook, the small block to the driver (whose free() of a
    // segment's address would crash the program).
    assert_eq!(one(&facts, "free_big.result"), "0");
    assert_eq!(one(&facts, "free_small.result"), "0");
    assert_eq!(one(&facts, "freed.segments"), "0");

    // Six threads allocating, writing and freeing segments at once.
    assert_eq!(one(&facts, "threads.failures"), "0");
    assert_eq!(one(&facts, "threads.segments"), "0");
}

#[test]
fn without_torpor_hook_cuda_every_allocation_goes_to_the_driver() {
    for env in [vec![], os(&[("TORPOR_HOOK_CUDA", "0")])] {
        let (facts, _) = run(&env);
        assert_eq!(one(&facts, "big.result"), "0");
        assert_eq!(one(&facts, "allocated.segments"), "0", "{env:?}");
        assert_eq!(one(&facts, "free_big.result"), "0");
    }
}

#[test]
fn lack_of_device_memory_is_the_callers_out_of_memory_error() {
    let (facts, stderr) = run(&os(&[ON, ("FAKE_CUDA_MEM_CREATE_RESULT", "2")]));
    assert_eq!(one(&facts, "big.result"), "2", "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(one(&facts, "small.result"), "0");
    assert_eq!(
        one(&facts, "allocated.segments"),
        "0",
        "a failed segment was kept"
    );
    assert_eq!(
        stderr, "",
        "lack of memory is the caller's to handle, not a warning"
    );
}

#[test]
fn a_segment_the_driver_cannot_make_falls_back_to_the_driver_with_one_warning() {
    // CUDA_ERROR_INVALID_VALUE from cuMemCreate: the allocation is made the ordinary way.
    let (facts, stderr) = run(&os(&[ON, ("FAKE_CUDA_MEM_CREATE_RESULT", "1")]));
    assert_eq!(one(&facts, "big.result"), "0");
    assert_eq!(one(&facts, "allocated.segments"), "0");
    assert_eq!(one(&facts, "free_big.result"), "0");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("torpor-hook: cannot make a segment: cuMemCreate failed"),
        "{stderr}"
    );
    assert!(
        stderr.contains("stay in the driver's checkpoint"),
        "{stderr}"
    );

    // A driver without the VMM calls: the same, with the reason named.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("torpor-hook-fakes");
    let old = fakes::build(Fake::Cuda, &dir).unwrap_or_else(|e| panic!("{e}"));
    let (facts, stderr) = run(&[ON.0, "TORPOR_LIBCUDA"]
        .into_iter()
        .zip([OsStr::new("1"), old.as_os_str()])
        .collect::<Vec<_>>());
    assert_eq!(one(&facts, "big.result"), "0");
    assert_eq!(one(&facts, "allocated.segments"), "0");
    assert!(
        stderr.starts_with("torpor-hook: cannot use the CUDA driver:") && stderr.contains("has no"),
        "{stderr}"
    );
}
