//! One module per subcommand; each parses nothing and prints little, the work is in the crates.

pub mod inspect;
pub mod restore;
pub mod run;
pub mod snapshot;
pub mod verify;

use std::path::PathBuf;

use torpor_snapshot::restore::RestoreError;
use torpor_snapshot::snapshot::SnapshotError;

/// Where CRIU logs of failed operations and `torpor run` output go by default.
pub fn log_dir() -> PathBuf {
    std::env::var_os("TORPOR_LOG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/log/torpor"))
}

/// Torpor's state directory (the init binary; later the daemon's registry and snapshots).
pub fn state_dir() -> PathBuf {
    std::env::var_os("TORPOR_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/torpor"))
}

/// Whether the error is a Ctrl-C (exit code 130, like a shell).
pub fn is_interrupted(err: &anyhow::Error) -> bool {
    matches!(
        err.downcast_ref::<SnapshotError>(),
        Some(SnapshotError::Interrupted { .. })
    ) || matches!(
        err.downcast_ref::<RestoreError>(),
        Some(RestoreError::Interrupted)
    )
}

/// Prints phase timings as `phase NAME SECONDS` lines on stderr (parsed by the benchmarks).
pub fn print_phases<'a>(phases: impl IntoIterator<Item = (&'a String, &'a f64)>) {
    for (name, secs) in phases {
        eprintln!("phase {name} {secs:.6}");
    }
}

/// Bytes as a short human size.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KB", "MB", "GB", "TB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1000.0 && u < UNITS.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
