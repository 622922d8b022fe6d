//! Interposition without a GPU: a C program that calls `cuMemAlloc_v2`/`cuMemFree_v2` through
//! its ordinary dynamic symbols, linked against the fake driver with VMM calls
//! (`tests/fakes/fake_libcuda.c`, `-DFAKE_CUDA_VMM`, whose device memory is memfd-backed host
//! memory), run with `LD_PRELOAD=libtorpor_hook.so`. The program asks the hook's C API what
//! became of each allocation. `cudaMalloc` needs libcudart, so it is tested on the GPU machine
//! (`tests/test_hook_gpu.py`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use torpor_cuda::fakes::{self, Fake};

const PROGRAM_C: &str = include_str!("programs/driver_alloc.c");

/// The hook cdylib cargo built beside this test binary (target/<profile>/).
fn hook_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let library = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("libtorpor_hook.so");
    assert!(
        library.exists(),
        "{} is missing: build it with `cargo build -p torpor-hook`",
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
            .args(["-O1", "-Wall", "-std=c11", "-o"])
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

/// Runs the program (preloading the hook when `preload`), returning its key=value lines.
fn run(preload: bool, hook_cuda: Option<&str>) -> BTreeMap<String, Vec<String>> {
    let (driver, program) = built();
    let mut command = Command::new(program);
    command
        .env("TORPOR_LIBCUDA", driver)
        .env_remove("TORPOR_HOOK_CUDA");
    if preload {
        command.env("LD_PRELOAD", hook_library());
    }
    if let Some(value) = hook_cuda {
        command.env("TORPOR_HOOK_CUDA", value);
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
    facts
}

fn one<'a>(facts: &'a BTreeMap<String, Vec<String>>, key: &str) -> &'a str {
    facts
        .get(key)
        .and_then(|v| v.first())
        .unwrap_or_else(|| panic!("the program printed no {key}: {facts:?}"))
}

#[test]
fn big_driver_allocations_become_segments_that_release_and_map_back() {
    let facts = run(true, Some("1"));
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
}

#[test]
fn without_torpor_hook_cuda_every_allocation_goes_to_the_driver() {
    for setting in [None, Some("0")] {
        let facts = run(true, setting);
        assert_eq!(one(&facts, "big.result"), "0");
        assert_eq!(one(&facts, "allocated.segments"), "0", "{setting:?}");
        assert_eq!(one(&facts, "free_big.result"), "0");
    }
}
