use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use torpor_snapshot::interrupt;
use torpor_snapshot::snapshot::{snapshot, SnapshotOptions};

use super::progress::Progress;

/// The snapshot's guard process; dropped (on every return, error or panic), it is told that the
/// snapshot ended, and exits.
struct Guard(Option<std::process::ChildStdin>);

impl Guard {
    fn start(pid: i32) -> anyhow::Result<Self> {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["__snapshot-guard", "--pid", &pid.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null());
        // A session of its own: a terminal's Ctrl-C (or a kill of the process group) does not
        // reach it; this process's Ctrl-C handling tells it the snapshot ended.
        // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
        let mut child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start the snapshot's guard process: {e}"))?;
        Ok(Self(child.stdin.take()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut pipe) = self.0.take() {
            use std::io::Write;
            let _ = pipe.write_all(torpor_snapshot::guard::DONE);
        }
    }
}

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
    // Before anything touches the source: if this process is killed mid-way, the guard returns
    // the source's CUDA processes to running (torpor_snapshot::guard). Told at every end.
    let _guard = Guard::start(pid)?;
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
        durability: torpor_image::Durability::Synced,
        gpu_released: None,
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
