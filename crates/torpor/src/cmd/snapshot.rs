use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use torpor_snapshot::interrupt;
use torpor_snapshot::snapshot::{snapshot, SnapshotOptions};

use super::progress::Progress;

pub fn run(
    pid: i32,
    out: &Path,
    leave_running: bool,
    timeout: f64,
    pre_dump_rounds: u32,
    verbose: bool,
    key: &super::KeyArgs,
) -> anyhow::Result<ExitCode> {
    if !(timeout.is_finite() && timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds, got {timeout}");
    }
    // Before the key: a user who may not snapshot learns that first, not where keys live.
    torpor_snapshot::preflight::require_root("torpor snapshot")?;
    let key = key.sealing_key()?;
    interrupt::install();
    let start = std::time::Instant::now();
    let log_dir = super::log_dir();
    let progress = Progress::start(format!("snapshot of pid {pid} into {}", out.display()));
    let report = snapshot(&SnapshotOptions {
        pid,
        out,
        leave_running,
        lock_timeout: Duration::from_secs_f64(timeout),
        log_dir: &log_dir,
        key: key.as_ref(),
        state_dir: None,
        pre_dump_rounds,
    });
    progress.finish();
    let report = report?;
    let m = &report.manifest;
    for warning in &report.warnings {
        eprintln!("torpor: warning: {warning}");
    }
    if verbose {
        super::print_phases(report.phases.0.iter().map(|(n, s)| (n, s)));
        eprintln!("phase stop_time {:.6}", m.stop_time_s);
    }
    let gpus = m.gpu.as_ref().map_or(0, |g| g.gpus.len());
    println!(
        "snapshot {}: {} files, {}, {} GPU(s); source stopped {:.3} s, {}; took {:.3} s; {}",
        report.dir.display(),
        m.files.len(),
        super::human(m.total_size()),
        gpus,
        m.stop_time_s,
        if leave_running {
            "still running"
        } else {
            "now killed"
        },
        start.elapsed().as_secs_f64(),
        super::authenticity(key.as_ref())
    );
    Ok(ExitCode::SUCCESS)
}
