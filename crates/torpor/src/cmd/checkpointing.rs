//! Periodic checkpoints of a job (`torpor run --checkpoint-every`, `torpor restore DIR
//! --checkpoint-every`): the options' checks and the loop that takes them until the job exits
//! (docs/checkpoints.md).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use torpor_snapshot::checkpoints::Checkpoints;
use torpor_snapshot::interrupt;

/// `--checkpoint-every`: checkpoint the job periodically (docs/checkpoints.md).
pub struct Periodic {
    pub every: f64,
    pub dir: PathBuf,
    pub keep: usize,
    pub timeout: f64,
    /// Pre-dump rounds of each checkpoint (0: stop-the-world).
    pub pre_dump_rounds: u32,
}

/// Refuses options that cannot work, before anything starts; returns the sealing key.
pub fn check(
    p: &Periodic,
    key: &super::KeyArgs,
    what: &'static str,
) -> anyhow::Result<Option<torpor_image::SnapshotKey>> {
    if !(p.every.is_finite() && p.every > 0.0) {
        bail!(
            "--checkpoint-every must be a positive number of seconds, got {}",
            p.every
        );
    }
    if !(p.timeout.is_finite() && p.timeout > 0.0) {
        bail!(
            "--timeout must be a positive number of seconds, got {}",
            p.timeout
        );
    }
    if p.keep == 0 {
        bail!("--keep must be at least 1 (the newest checkpoint is the one a restore needs)");
    }
    torpor_snapshot::preflight::require_root(what)?;
    if p.pre_dump_rounds > 0 {
        match torpor_snapshot::dirty_tracking::available() {
            Ok(true) => {}
            Ok(false) => bail!("--concurrent-rounds needs the kernel's soft-dirty page tracking (CONFIG_MEM_SOFT_DIRTY), which this kernel lacks: leave --concurrent-rounds out (stop-the-world checkpoints)"),
            Err(e) => bail!("--concurrent-rounds needs the kernel's soft-dirty page tracking, which could not be probed ({e}): leave --concurrent-rounds out (stop-the-world checkpoints)"),
        }
    }
    key.sealing_key()
}

/// Checkpoints the job every `p.every` seconds until it exits; returns its exit status (128 +
/// the signal when a signal ended it). A checkpoint that fails is reported and the job runs on
/// (the snapshot's guarantee); the next one is tried on time. SIGINT/SIGTERM stop the
/// checkpointing and leave the job running.
pub fn until_exit(
    pid: i32,
    p: &Periodic,
    mut cps: Checkpoints,
    key: Option<&torpor_image::SnapshotKey>,
) -> anyhow::Result<ExitCode> {
    interrupt::install();
    let every = Duration::from_secs_f64(p.every);
    let log_dir = super::log_dir();
    eprintln!(
        "torpor: checkpointing pid {pid} every {} s into {} (keeping {}), {}",
        p.every,
        cps.dir().display(),
        p.keep,
        if p.pre_dump_rounds > 0 {
            format!("concurrently ({} pre-dump rounds each)", p.pre_dump_rounds)
        } else {
            "stop-the-world".to_string()
        }
    );
    let mut next = Instant::now() + every;
    loop {
        if let Some(code) = exited(pid)? {
            eprintln!(
                "torpor: pid {pid} exited with status {code}; checkpoints stay in {}",
                cps.dir().display()
            );
            return Ok(ExitCode::from(code.clamp(0, 255) as u8));
        }
        if interrupt::interrupted() {
            eprintln!("torpor: interrupted: checkpointing stopped, pid {pid} keeps running");
            return Ok(ExitCode::from(130));
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        next = Instant::now() + every;
        match cps.take(
            pid,
            p.keep,
            p.pre_dump_rounds,
            Duration::from_secs_f64(p.timeout),
            &log_dir,
            key,
        ) {
            Ok(t) => {
                for w in &t.warnings {
                    eprintln!("torpor: warning: {w}");
                }
                let pruned = if t.pruned.is_empty() {
                    String::new()
                } else {
                    format!("; pruned {}", t.pruned.join(", "))
                };
                eprintln!(
                    "torpor: checkpoint {}: job stopped {:.3} s; {} ({} chunks), {} new to the store ({} chunks); took {:.3} s{pruned}",
                    t.id,
                    t.stop_s,
                    super::human(t.stats.logical_bytes),
                    t.stats.chunks,
                    super::human(t.stats.new_raw_bytes),
                    t.stats.new_chunks,
                    t.total_s,
                );
            }
            // The job may have ended during the checkpoint: the loop's next turn says so.
            Err(_) if exited_quietly(pid) => {}
            Err(e) => eprintln!(
                "torpor: warning: checkpoint failed, pid {pid} keeps running: {}",
                e.to_string().replace('\n', " ")
            ),
        }
    }
}

/// The job's exit status once it has exited (reaped: torpor run is the init's parent).
fn exited(pid: i32) -> anyhow::Result<Option<i32>> {
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid pointer to a local.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if r == 0 {
        return Ok(None);
    }
    if r < 0 {
        bail!(
            "cannot wait for pid {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(Some(if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }))
}

/// Whether the job is gone or a zombie (without reaping it).
fn exited_quietly(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}
