use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail};
use torpor_snapshot::gpu_map::GpuRef;
use torpor_snapshot::migrate::{migrate, MigrateOptions};

pub fn run(pid: i32, gpu: &str, timeout: f64, verbose: bool) -> anyhow::Result<ExitCode> {
    if !(timeout.is_finite() && timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, got {timeout}");
    }
    let target: GpuRef = gpu
        .parse()
        .map_err(|e: String| anyhow!("--gpu {e}: give an ordinal (0, 1, …) or a UUID"))?;
    let report = migrate(&MigrateOptions {
        pid,
        target,
        lock_timeout: Duration::from_secs_f64(timeout),
    })?;
    if verbose {
        super::print_phases(report.phases.0.iter().map(|(n, s)| (n, s)));
    }
    let held = report
        .bytes
        .map_or_else(String::new, |b| format!(", {}", super::human(b)));
    println!(
        "pid {pid}: {} CUDA process(es){held} moved from GPU {} to GPU {}; CUDA stopped {:.3} s",
        report.pids.len(),
        report.from,
        report.to,
        report.stopped_s
    );
    Ok(ExitCode::SUCCESS)
}
