use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::ExitCode;

use torpor_snapshot::gpu_map::parse_gpu_map;
use torpor_snapshot::restore::{restore_with, PageOptions, PageSource, RestoreOptions, Verify};
use torpor_snapshot::{interrupt, supervise};

use super::progress::Progress;

#[allow(clippy::too_many_arguments)]
pub fn run(
    dir: &Path,
    detach: bool,
    gpu: Option<&str>,
    log: Option<&Path>,
    pages: PageSource,
    checkpoint: Option<&str>,
    periodic: Option<super::checkpointing::Periodic>,
    verbose: bool,
    key: &super::KeyArgs,
) -> anyhow::Result<ExitCode> {
    // Before the key: a user who may not restore learns that first, not where keys live.
    torpor_snapshot::preflight::require_root("torpor restore")?;
    let key_args = key;
    let key = key.checking_key()?;
    let gpu_map = match gpu {
        Some(spec) => parse_gpu_map(spec).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    // Going on checkpointing: the directory is locked before anything is restored from it.
    let checkpointing = match &periodic {
        Some(p) => {
            if !torpor_snapshot::checkpoints::is_checkpoint_dir(dir) {
                anyhow::bail!(
                    "--checkpoint-every goes on with the checkpoints of a checkpoint directory, and {} is not one (no store/ in it): restore one made by `torpor run --checkpoint-every`, or start the job with that",
                    dir.display()
                );
            }
            let sealing =
                super::checkpointing::check(p, key_args, "torpor restore --checkpoint-every")?;
            Some((
                torpor_snapshot::checkpoints::Checkpoints::open(dir)?,
                sealing,
            ))
        }
        None => None,
    };
    if !detach && checkpointing.is_none() {
        // Before the restore starts any thread (the hashing pool, the CUDA driver's): every
        // thread inherits the mask, so a signal meant for the restored tree, or the SIGCHLD
        // of its exit, stays pending until `supervise` takes it. A thread that did not block
        // it would take it instead, and lose it.
        supervise::block_all_signals();
    }
    interrupt::install();
    // A checkpoint directory (`torpor run --checkpoint-every`): its newest checkpoint, written
    // back out of the chunk store beside it, removed once the restore no longer needs it.
    let materialised = if torpor_snapshot::checkpoints::is_checkpoint_dir(dir) {
        let m = torpor_snapshot::checkpoints::materialise(dir, checkpoint)?;
        eprintln!("torpor: restoring checkpoint {} of {}", m.id, dir.display());
        Some(m)
    } else if checkpoint.is_some() {
        anyhow::bail!(
            "--checkpoint picks a checkpoint of a checkpoint directory, and {} is not one (no store/ in it): leave --checkpoint out to restore the snapshot",
            dir.display()
        );
    } else {
        None
    };
    let dir = materialised.as_ref().map_or(dir, |m| m.dir.as_path());
    let log_dir = super::log_dir();
    let progress = Progress::start(format!("restore of {}", dir.display()));
    let restored = restore_with(
        &RestoreOptions {
            dir,
            detach,
            gpu_map: &gpu_map,
            log_dir: &log_dir,
            stdio: log,
            verify: Verify::default(),
            trust: super::trust(key.as_ref()),
            resume_gpu: true,
            cgroup: &[],
            external_sources: &[],
            gpu_restore_slots: None,
            gpu_lane: 0,
            gpu_alone: false,
        },
        &PageOptions {
            source: pages,
            ..PageOptions::default()
        },
    );
    progress.finish();
    let restored = restored?;
    if restored.attempts > 1 {
        eprintln!(
            "torpor: note: the driver's restore failed with CUDA_ERROR_OPERATING_SYSTEM; restored \
             again from the snapshot, attempt {} succeeded",
            restored.attempts
        );
    }
    if verbose {
        super::print_phases(restored.phases.0.iter().map(|(n, s)| (n, s)));
        eprintln!("phase total {:.6}", restored.total_s);
    }
    if detach {
        println!("{}", restored.pid);
        if let Some(lazy) = restored.lazy_pages {
            // The pid is out; stdout closes so a reader piping it goes on at once. The
            // lazy-pages daemon is our child: wait until it has served every page, and reap it.
            close_stdout();
            lazy.finish()?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    // A SIGINT/SIGTERM that came after the restore's last interrupt check is still pending
    // (blocked since the start), and `supervise` forwards it with any later one.
    eprintln!(
        "torpor: restored pid {}; waiting for it to exit",
        restored.pid
    );
    // The supervisor reaps every child: let the lazy-pages daemon finish (all pages served)
    // first, so that its own exit status is the one checked.
    if let Some(lazy) = restored.lazy_pages {
        lazy.finish()?;
    }
    drop(materialised);
    if let (Some(p), Some((cps, sealing))) = (periodic, checkpointing) {
        return super::checkpointing::until_exit(restored.pid, &p, cps, sealing.as_ref());
    }
    let code = supervise::supervise(restored.pid)?;
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// Flushes stdout and points descriptor 1 at /dev/null.
fn close_stdout() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto descriptor 1 only replaces what stdout refers to; Rust's stdout
        // handle was flushed above and keeps using descriptor 1.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
}
