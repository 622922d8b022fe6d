use std::path::Path;
use std::process::ExitCode;

use torpor_snapshot::gpu_map::parse_gpu_map;
use torpor_snapshot::restore::{restore, RestoreOptions};
use torpor_snapshot::{interrupt, supervise};

pub fn run(
    dir: &Path,
    detach: bool,
    gpu: Option<&str>,
    log: Option<&Path>,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let gpu_map = match gpu {
        Some(spec) => parse_gpu_map(spec).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    interrupt::install();
    let log_dir = super::log_dir();
    let restored = restore(&RestoreOptions {
        dir,
        detach,
        gpu_map: &gpu_map,
        log_dir: &log_dir,
        stdio: log,
    })?;
    if verbose {
        super::print_phases(restored.phases.0.iter().map(|(n, s)| (n, s)));
        eprintln!("phase total {:.6}", restored.total_s);
    }
    if detach {
        println!("{}", restored.pid);
        return Ok(ExitCode::SUCCESS);
    }
    // Block before announcing the wait: a SIGTERM sent once "waiting" is printed then stays
    // pending until `supervise` forwards it. One that arrived after the restore's last check
    // only raised the interrupt flag, and is forwarded here instead of being lost.
    supervise::block_all_signals();
    if let Some(sig) = interrupt::signal() {
        // SAFETY: kill(2) only sends a signal, to the tree this command just restored.
        unsafe { libc::kill(restored.pid, sig) };
    }
    eprintln!(
        "torpor: restored pid {}; waiting for it to exit",
        restored.pid
    );
    let code = supervise::supervise(restored.pid)?;
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}
