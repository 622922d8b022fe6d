use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail};
use torpord::runtime::migrate::Migrated;

use super::DaemonArgs;
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

/// `torpor migrate --instance ID --gpu N`: `POST /v1/instances/{id}/migrate` (docs/migration.md).
pub fn run_instance(
    daemon: &DaemonArgs,
    id: &str,
    gpu: &str,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let gpu: u32 = gpu.trim().parse().map_err(|_| {
        anyhow!("--gpu {gpu:?}: with --instance, give the target GPU's ordinal (0, 1, …)")
    })?;
    let body = serde_json::to_vec(&serde_json::json!({ "gpu": gpu }))?;
    let path = format!("/v1/instances/{id}/migrate");
    let response = daemon.client().request("POST", &path, Some(&body))?.ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let m: Migrated = response.json()?;
    println!(
        "instance {} ({}) moved from GPU {} to GPU {}: {} segment(s), {}, pre-copied in {:.3} s while serving; \
         stopped {:.3} s ({} changed block(s) copied{}); total {:.3} s",
        m.instance,
        m.function,
        m.from,
        m.to,
        m.segments,
        super::human(m.bytes),
        m.precopy_s,
        m.stop_s,
        m.changed_blocks,
        match (m.residue_moved, m.residue_bytes) {
            (true, Some(b)) => format!(", CUDA state of {} moved by the driver", super::human(b)),
            (true, None) => ", CUDA state moved by the driver".to_string(),
            (false, _) => String::new(),
        },
        m.total_s
    );
    Ok(ExitCode::SUCCESS)
}
