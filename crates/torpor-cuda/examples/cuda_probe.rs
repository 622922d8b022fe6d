//! Calls the driver through torpor-cuda from the command line, one step per run, so the crate
//! can be checked against a real driver and a real CUDA process:
//!
//! ```text
//! cuda_probe info                   driver version, CUDA devices, NVML GPUs and processes
//! cuda_probe state <pid>            checkpoint state of <pid>
//! cuda_probe lock <pid> <ms>        lock with a timeout
//! cuda_probe checkpoint <pid>
//! cuda_probe restore <pid> [remap]  restore; `remap` passes every GPU mapped onto itself
//! cuda_probe unlock <pid>
//! ```
//!
//! Each step prints one line: `ok <what>` or `error <Debug> | <Display>`, and how long it took.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use torpor_cuda::{CudaDriver, CudaError, Nvml};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let driver = match CudaDriver::load() {
        Ok(driver) => driver,
        Err(e) => return report("load", Err(e)),
    };
    let pid = |i: usize| -> Option<i32> { words.get(i).and_then(|w| w.parse().ok()) };
    match (words.first().copied(), pid(1)) {
        (Some("info") | None, _) => info(&driver),
        (Some("state"), Some(pid)) => {
            report("state", driver.process_state(pid).map(|s| format!("{s:?}")))
        }
        (Some("lock"), Some(pid)) => {
            let ms = words.get(2).and_then(|w| w.parse().ok()).unwrap_or(10_000);
            report(
                "lock",
                driver
                    .lock(pid, Duration::from_millis(ms))
                    .map(|()| String::new()),
            )
        }
        (Some("checkpoint"), Some(pid)) => {
            report("checkpoint", driver.checkpoint(pid).map(|()| String::new()))
        }
        (Some("restore"), Some(pid)) => {
            let pairs = match words.get(2) {
                Some(&"remap") => match driver.devices() {
                    Ok(devices) => devices.iter().map(|d| (d.uuid, d.uuid)).collect(),
                    Err(e) => return report("devices", Err(e)),
                },
                _ => Vec::new(),
            };
            report(
                "restore",
                driver
                    .restore(pid, &pairs)
                    .map(|()| format!("pairs={}", pairs.len())),
            )
        }
        (Some("unlock"), Some(pid)) => report("unlock", driver.unlock(pid).map(|()| String::new())),
        (Some("tid"), Some(pid)) => {
            report("tid", driver.restore_thread_id(pid).map(|t| t.to_string()))
        }
        _ => {
            eprintln!("usage: cuda_probe info | state|checkpoint|unlock|tid <pid> | lock <pid> <ms> | restore <pid> [remap]");
            ExitCode::from(2)
        }
    }
}

fn info(driver: &CudaDriver) -> ExitCode {
    let start = Instant::now();
    let version = driver.driver_version();
    let devices = driver.devices();
    println!(
        "driver {:?} at {} ({:?})",
        version,
        driver.path().display(),
        start.elapsed()
    );
    match devices {
        Ok(devices) => {
            for d in devices {
                println!(
                    "cuda device {} {} {} {} bytes",
                    d.ordinal, d.name, d.uuid, d.total_memory
                );
            }
        }
        Err(e) => return report("devices", Err(e)),
    }
    let nvml = match Nvml::load() {
        Ok(nvml) => nvml,
        Err(e) => return report("nvml", Err(e)),
    };
    println!("nvml driver {:?}", nvml.driver_version());
    match nvml.gpus() {
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "nvml gpu {} {} {} total {} free {}",
                    g.index, g.name, g.uuid, g.total_memory, g.free_memory
                );
            }
        }
        Err(e) => return report("nvml gpus", Err(e)),
    }
    match nvml.process_memory() {
        Ok(procs) => {
            for p in procs {
                println!(
                    "nvml process {} on {} uses {:?}",
                    p.pid, p.gpu, p.used_memory
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => report("nvml processes", Err(e)),
    }
}

fn report(step: &str, result: Result<String, CudaError>) -> ExitCode {
    match result {
        Ok(what) => {
            println!("ok {step} {what}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error {step} {e:?} | {e}");
            ExitCode::FAILURE
        }
    }
}
