//! The real loading and calling code run against the fake drivers of `tests/fakes/`.
//!
//! The fakes read their behaviour from the environment at each call, so the tests that set it
//! run one at a time (`ENV`).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use torpor_cuda::fakes::{self, Fake};
use torpor_cuda::{CudaDriver, CudaError, GpuUuid, Nvml, ProcessState};

static ENV: Mutex<()> = Mutex::new(());

/// The variables the fakes and the loaders read.
const VARS: &[&str] = &[
    "FAKE_CUDA_PIDS",
    "FAKE_CUDA_STATE_DIR",
    "FAKE_CUDA_LOG",
    "FAKE_CUDA_INIT_RESULT",
    "FAKE_CUDA_LOCK_RESULT",
    "FAKE_CUDA_CKPT_RESULT",
    "FAKE_CUDA_RESTORE_RESULT",
    "FAKE_CUDA_UNLOCK_RESULT",
    "FAKE_CUDA_STATE_RESULT",
    "FAKE_CUDA_DEVICES",
    "FAKE_CUDA_TOTAL_MEM",
    "FAKE_CUDA_DRIVER_VERSION",
    "FAKE_NVML_DRIVER_VERSION",
    "FAKE_NVML_INIT_RESULT",
    "FAKE_NVML_PROCS",
    "FAKE_NVML_PROCS_FILE",
    "TORPOR_LIBCUDA",
    "TORPOR_LIBNVML",
];

/// Holds the environment for one test: set on creation, cleared on drop.
struct Env {
    _guard: MutexGuard<'static, ()>,
    dir: tempfile::TempDir,
}

impl Env {
    fn new(vars: &[(&str, &str)]) -> Env {
        let guard = ENV.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        clear();
        let dir = tempfile::tempdir().unwrap();
        std::env::set_var("FAKE_CUDA_STATE_DIR", dir.path().join("state"));
        std::fs::create_dir(dir.path().join("state")).unwrap();
        std::env::set_var("FAKE_CUDA_LOG", dir.path().join("calls.log"));
        for (name, value) in vars {
            std::env::set_var(name, value);
        }
        Env { _guard: guard, dir }
    }

    fn log(&self) -> Vec<String> {
        match std::fs::read_to_string(self.dir.path().join("calls.log")) {
            Ok(text) => text.lines().map(str::to_owned).collect(),
            Err(_) => Vec::new(),
        }
    }

    fn state_file(&self, pid: i32) -> PathBuf {
        self.dir.path().join("state").join(pid.to_string())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        clear();
    }
}

fn clear() {
    for name in VARS {
        std::env::remove_var(name);
    }
}

fn fake(which: Fake) -> PathBuf {
    static BUILT: OnceLock<Mutex<Vec<(Fake, PathBuf)>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(Vec::new()));
    let mut built = built
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, path)) = built.iter().find(|(f, _)| *f == which) {
        return path.clone();
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("torpor-cuda-fakes");
    let path = fakes::build(which, &dir).unwrap_or_else(|e| panic!("{e}"));
    built.push((which, path.clone()));
    path
}

fn uuid(index: u8) -> GpuUuid {
    format!("GPU-fa4e0000-0000-0000-0000-0000000000{index:02x}")
        .parse()
        .unwrap()
}

const PID: i32 = 4242;

#[test]
fn a_missing_library_is_an_error_not_a_panic() {
    let err = CudaDriver::load_from("/nonexistent/libcuda.so.1").unwrap_err();
    match &err {
        CudaError::LibraryNotFound { path, env_var, .. } => {
            assert_eq!(path, Path::new("/nonexistent/libcuda.so.1"));
            assert_eq!(*env_var, "TORPOR_LIBCUDA");
        }
        other => panic!("expected LibraryNotFound, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.starts_with("cannot load /nonexistent/libcuda.so.1"),
        "{text}"
    );
    assert!(text.contains("set TORPOR_LIBCUDA"), "{text}");

    let err = Nvml::load_from("/nonexistent/libnvidia-ml.so.1").unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::LibraryNotFound {
                env_var: "TORPOR_LIBNVML",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn the_environment_chooses_the_library() {
    let _env = Env::new(&[("TORPOR_LIBCUDA", "/nonexistent/from-env.so")]);
    let err = CudaDriver::load().unwrap_err();
    assert!(
        matches!(&err, CudaError::LibraryNotFound { path, .. } if path == Path::new("/nonexistent/from-env.so")),
        "{err:?}"
    );
    std::env::set_var("TORPOR_LIBCUDA", fake(Fake::Cuda));
    let driver = CudaDriver::load().unwrap();
    assert_eq!(driver.path(), fake(Fake::Cuda));

    std::env::set_var("TORPOR_LIBNVML", "/nonexistent/nvml-from-env.so");
    let err = Nvml::load().unwrap_err();
    assert!(
        matches!(&err, CudaError::LibraryNotFound { path, .. } if path == Path::new("/nonexistent/nvml-from-env.so")),
        "{err:?}"
    );
}

#[test]
fn a_driver_without_the_checkpoint_api_is_refused() {
    let _env = Env::new(&[]);
    let path = fake(Fake::CudaWithoutCheckpoint);
    let err = CudaDriver::load_from(&path).unwrap_err();
    match &err {
        CudaError::CheckpointApiMissing { path: p, symbol } => {
            assert_eq!(p, &path);
            assert_eq!(*symbol, "cuCheckpointProcessLock");
        }
        other => panic!("expected CheckpointApiMissing, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "the NVIDIA driver at {} has no checkpoint API (cuCheckpointProcessLock missing): \
             install driver >= 570",
            path.display()
        )
    );
}

#[test]
fn a_library_that_is_not_a_driver_is_refused() {
    let _env = Env::new(&[]);
    let err = CudaDriver::load_from(fake(Fake::Nvml)).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::SymbolMissing {
                symbol: "cuInit",
                env_var: "TORPOR_LIBCUDA",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_failed_cu_init_keeps_its_code() {
    let _env = Env::new(&[("FAKE_CUDA_INIT_RESULT", "100")]);
    let err = CudaDriver::load_from(fake(Fake::Cuda)).unwrap_err();
    match &err {
        CudaError::InitFailed { code, name, .. } => {
            assert_eq!(*code, 100);
            assert_eq!(name, "CUDA_ERROR_NO_DEVICE");
        }
        other => panic!("expected InitFailed, got {other:?}"),
    }
    assert!(err.to_string().contains("no GPU is visible"), "{err}");
}

#[test]
fn devices_and_version_come_from_the_driver() {
    let _env = Env::new(&[
        ("FAKE_CUDA_DEVICES", "2"),
        ("FAKE_CUDA_TOTAL_MEM", "85520809984"),
        ("FAKE_CUDA_DRIVER_VERSION", "13000"),
    ]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    assert_eq!(driver.driver_version().unwrap(), 13000);
    let devices = driver.devices().unwrap();
    assert_eq!(devices.len(), 2);
    for (i, device) in devices.iter().enumerate() {
        assert_eq!(device.ordinal, i as i32);
        assert_eq!(device.name, format!("Fake NVIDIA GPU {i}"));
        assert_eq!(device.uuid, uuid(i as u8));
        assert_eq!(device.total_memory, 85_520_809_984);
    }
}

#[test]
fn lock_checkpoint_restore_unlock_round_trip() {
    let env = Env::new(&[("FAKE_CUDA_PIDS", "17,4242"), ("FAKE_CUDA_DEVICES", "2")]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    let state = || driver.process_state(PID).unwrap();

    assert_eq!(state(), Some(ProcessState::Running));
    driver.lock(PID, Duration::from_millis(1500)).unwrap();
    assert_eq!(state(), Some(ProcessState::Locked));
    // What another process (a later `torpor` run) reads.
    assert_eq!(
        std::fs::read_to_string(env.state_file(PID)).unwrap(),
        "locked\n"
    );
    driver.checkpoint(PID).unwrap();
    assert_eq!(state(), Some(ProcessState::Checkpointed));
    driver
        .restore(PID, &[(uuid(0), uuid(1)), (uuid(1), uuid(0))])
        .unwrap();
    assert_eq!(state(), Some(ProcessState::Locked));
    driver.unlock(PID).unwrap();
    assert_eq!(state(), Some(ProcessState::Running));

    // Restoring onto the same GPUs passes no pairs.
    driver.lock(PID, Duration::from_secs(10)).unwrap();
    driver.checkpoint(PID).unwrap();
    driver.restore(PID, &[]).unwrap();
    driver.unlock(PID).unwrap();

    // The fake refuses arguments whose reserved bytes are not zero, so `result=0` also says the
    // argument structs were laid out and zeroed as cuda.h wants.
    assert_eq!(
        env.log(),
        [
            "lock 4242 timeout_ms=1500 result=0",
            "checkpoint 4242 result=0",
            "restore 4242 pairs=2 GPU-fa4e0000-0000-0000-0000-000000000000>GPU-fa4e0000-0000-0000-0000-000000000001 \
             GPU-fa4e0000-0000-0000-0000-000000000001>GPU-fa4e0000-0000-0000-0000-000000000000 result=0",
            "unlock 4242 result=0",
            "lock 4242 timeout_ms=10000 result=0",
            "checkpoint 4242 result=0",
            "restore 4242 pairs=0 result=0",
            "unlock 4242 result=0",
        ]
    );
    assert_eq!(driver.restore_thread_id(PID).unwrap(), PID);
}

#[test]
fn lock_timeouts_are_their_own_error_and_leave_the_process_running() {
    for code in [600, 909] {
        let env = Env::new(&[
            ("FAKE_CUDA_PIDS", "4242"),
            ("FAKE_CUDA_LOCK_RESULT", &code.to_string()),
        ]);
        let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
        let err = driver.lock(PID, Duration::from_secs(5)).unwrap_err();
        match &err {
            CudaError::Timeout {
                pid,
                timeout,
                code: c,
            } => {
                assert_eq!(*pid, PID);
                assert_eq!(*timeout, Duration::from_secs(5));
                assert_eq!(*c, code);
            }
            other => panic!("expected Timeout, got {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "CUDA lock of pid 4242 timed out after 5s: the process keeps running; \
             retry with a larger --timeout or when it is idle"
        );
        assert_eq!(
            driver.process_state(PID).unwrap(),
            Some(ProcessState::Running)
        );
        assert_eq!(
            env.log(),
            [format!("lock 4242 timeout_ms=5000 result={code}")]
        );
    }
}

#[test]
fn a_failure_can_hit_one_pid_of_several() {
    let env = Env::new(&[
        ("FAKE_CUDA_PIDS", "17,4242"),
        ("FAKE_CUDA_LOCK_RESULT", "909@99,600@4242"),
    ]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    driver.lock(17, Duration::from_secs(1)).unwrap();
    let err = driver.lock(PID, Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(err, CudaError::Timeout { pid: PID, .. }),
        "{err:?}"
    );
    // The rollback a caller does: unlock what it locked.
    driver.unlock(17).unwrap();
    assert_eq!(
        env.log(),
        [
            "lock 17 timeout_ms=1000 result=0",
            "lock 4242 timeout_ms=1000 result=600",
            "unlock 17 result=0",
        ]
    );
}

#[test]
fn a_failed_checkpoint_keeps_the_code_and_the_lock() {
    let env = Env::new(&[("FAKE_CUDA_PIDS", "4242"), ("FAKE_CUDA_CKPT_RESULT", "2")]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    driver.lock(PID, Duration::from_secs(1)).unwrap();
    let err = driver.checkpoint(PID).unwrap_err();
    match &err {
        CudaError::Call {
            function,
            pid,
            code,
            name,
        } => {
            assert_eq!(*function, "cuCheckpointProcessCheckpoint");
            assert_eq!(*pid, Some(PID));
            assert_eq!(*code, 2);
            assert_eq!(name, "CUDA_ERROR_OUT_OF_MEMORY");
        }
        other => panic!("expected Call, got {other:?}"),
    }
    assert!(
        err.to_string().starts_with(
            "cuCheckpointProcessCheckpoint for pid 4242 failed with CUDA_ERROR_OUT_OF_MEMORY (2): \
             the GPU has too little free memory"
        ),
        "{err}"
    );
    assert_eq!(
        driver.process_state(PID).unwrap(),
        Some(ProcessState::Locked)
    );
    driver.unlock(PID).unwrap();
    assert_eq!(
        env.log(),
        [
            "lock 4242 timeout_ms=1000 result=0",
            "checkpoint 4242 result=2",
            "unlock 4242 result=0",
        ]
    );
}

#[test]
fn steps_out_of_order_are_illegal_state() {
    let env = Env::new(&[("FAKE_CUDA_PIDS", "4242")]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    for err in [
        driver.unlock(PID).unwrap_err(),
        driver.checkpoint(PID).unwrap_err(),
        driver.restore(PID, &[]).unwrap_err(),
    ] {
        assert!(matches!(err, CudaError::Call { code: 401, .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("lock: running, checkpoint: locked"),
            "{err}"
        );
    }
    // A checkpointed process cannot be unlocked: the rollback is restore, then unlock.
    driver.lock(PID, Duration::from_secs(1)).unwrap();
    driver.checkpoint(PID).unwrap();
    let err = driver.unlock(PID).unwrap_err();
    assert!(matches!(err, CudaError::Call { code: 401, .. }), "{err:?}");
    assert_eq!(env.log().len(), 6);
}

#[test]
fn a_state_written_by_another_process_is_read() {
    let env = Env::new(&[("FAKE_CUDA_PIDS", "4242")]);
    std::fs::write(env.state_file(PID), "failed\n").unwrap();
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();
    assert_eq!(
        driver.process_state(PID).unwrap(),
        Some(ProcessState::Failed)
    );
}

#[test]
fn processes_without_cuda_and_missing_processes_are_told_apart() {
    let _env = Env::new(&[("FAKE_CUDA_PIDS", "4242")]);
    let driver = CudaDriver::load_from(fake(Fake::Cuda)).unwrap();

    // This test process exists but is not listed as a CUDA process.
    let me = std::process::id() as i32;
    assert_eq!(driver.process_state(me).unwrap(), None);
    let err = driver.lock(me, Duration::from_secs(1)).unwrap_err();
    assert!(
        matches!(err, CudaError::NotCudaProcess { pid, .. } if pid == me),
        "{err:?}"
    );
    assert!(err.to_string().contains("is not a CUDA process"), "{err}");

    // No process has this pid (pid_max is at most 2^22).
    let gone = i32::MAX;
    for err in [
        driver.process_state(gone).unwrap_err(),
        driver.lock(gone, Duration::from_secs(1)).unwrap_err(),
        driver.unlock(gone).unwrap_err(),
    ] {
        assert!(
            matches!(err, CudaError::NoSuchProcess { pid, .. } if pid == gone),
            "{err:?}"
        );
        assert!(err.to_string().contains("does not exist"), "{err}");
    }
}

#[test]
fn nvml_reports_gpus_and_process_memory() {
    let _env = Env::new(&[
        ("FAKE_CUDA_DEVICES", "2"),
        ("FAKE_CUDA_TOTAL_MEM", "1000000"),
        ("FAKE_NVML_PROCS", "100:1000,200:-@1,300:250000@1"),
    ]);
    let nvml = Nvml::load_from(fake(Fake::Nvml)).unwrap();
    assert_eq!(nvml.driver_version().unwrap(), "580.159.04");
    let gpus = nvml.gpus().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].name, "Fake NVIDIA GPU 0");
    assert_eq!(gpus[0].uuid, uuid(0));
    assert_eq!(gpus[0].total_memory, 1_000_000);
    assert_eq!(gpus[0].free_memory, 999_000);
    assert_eq!(gpus[1].uuid, uuid(1));
    assert_eq!(gpus[1].free_memory, 750_000);

    let procs = nvml.process_memory().unwrap();
    let summary: Vec<(GpuUuid, u32, Option<u64>)> = procs
        .iter()
        .map(|p| (p.gpu, p.pid, p.used_memory))
        .collect();
    assert_eq!(
        summary,
        [
            (uuid(0), 100, Some(1000)),
            (uuid(1), 200, None),
            (uuid(1), 300, Some(250_000)),
        ]
    );
}

#[test]
fn nvml_lists_more_processes_than_its_first_guess() {
    let procs: Vec<String> = (1..=40).map(|pid| format!("{pid}:{}", pid * 10)).collect();
    let _env = Env::new(&[("FAKE_NVML_PROCS", &procs.join(","))]);
    let nvml = Nvml::load_from(fake(Fake::Nvml)).unwrap();
    let found = nvml.process_memory().unwrap();
    assert_eq!(found.len(), 40);
    assert_eq!(found[39].pid, 40);
    assert_eq!(found[39].used_memory, Some(400));
}

#[test]
fn nvml_rereads_its_process_file_at_every_call() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("procs");
    let path = file.to_str().unwrap();
    // The file takes the place of the variable, and a missing file lists nothing.
    let _env = Env::new(&[("FAKE_NVML_PROCS", "9:9"), ("FAKE_NVML_PROCS_FILE", path)]);
    let nvml = Nvml::load_from(fake(Fake::Nvml)).unwrap();
    assert!(nvml.process_memory().unwrap().is_empty());
    std::fs::write(&file, "100:1000").unwrap();
    let found: Vec<(u32, Option<u64>)> = nvml
        .process_memory()
        .unwrap()
        .iter()
        .map(|p| (p.pid, p.used_memory))
        .collect();
    assert_eq!(found, [(100, Some(1000))]);
    std::fs::write(&file, "").unwrap();
    assert!(nvml.process_memory().unwrap().is_empty());
}

#[test]
fn nvml_init_failure_keeps_its_code() {
    let _env = Env::new(&[("FAKE_NVML_INIT_RESULT", "9")]);
    let err = Nvml::load_from(fake(Fake::Nvml)).unwrap_err();
    match &err {
        CudaError::NvmlInitFailed { code, message, .. } => {
            assert_eq!(*code, 9);
            assert_eq!(message, "Driver Not Loaded");
        }
        other => panic!("expected NvmlInitFailed, got {other:?}"),
    }
    assert!(err.to_string().contains("modprobe nvidia"), "{err}");
}

#[test]
fn a_driver_without_vmm_still_checkpoints_and_says_what_is_missing() {
    let _env = Env::new(&[("FAKE_CUDA_PIDS", &PID.to_string())]);
    let path = fake(Fake::Cuda);
    let driver = CudaDriver::load_from(&path).unwrap();
    // The VMM calls are looked up on first use: their absence breaks nothing that loaded.
    let err = driver
        .vmm()
        .err()
        .expect("the fake driver has no VMM calls");
    match &err {
        CudaError::VmmApiMissing { path: p, symbol } => {
            assert_eq!(p, &path);
            assert_eq!(*symbol, "cuDevicePrimaryCtxRetain");
        }
        other => panic!("expected VmmApiMissing, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "the CUDA driver at {} has no cuDevicePrimaryCtxRetain: it is too old for exportable \
             device memory; install driver >= 570, or set TORPOR_LIBCUDA to the NVIDIA driver's \
             own library",
            path.display()
        )
    );
    // Asking again gives the same answer, and the checkpoint API still works.
    assert!(matches!(driver.vmm(), Err(CudaError::VmmApiMissing { .. })));
    assert_eq!(
        driver.process_state(PID).unwrap(),
        Some(ProcessState::Running)
    );
}
