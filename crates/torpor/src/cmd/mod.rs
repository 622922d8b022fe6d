//! One module per subcommand; each parses nothing and prints little, the work is in the crates.

pub mod deploy;
pub mod inspect;
pub mod invoke;
pub mod logs;
pub mod ls;
pub mod progress;
pub mod restore;
pub mod rm;
pub mod run;
pub mod serve;
pub mod snapshot;
pub mod stage;
pub mod status;
pub mod stop;
pub mod verify;

use std::path::PathBuf;
use std::time::Duration;

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

/// How to reach torpord, for the commands that talk to it.
#[derive(clap::Args)]
pub struct DaemonArgs {
    /// torpord's API socket [default: /run/torpor/torpord.sock]
    #[arg(long, value_name = "PATH", env = torpord::config::SOCKET_ENV)]
    socket: Option<PathBuf>,
}

impl DaemonArgs {
    /// A client for the daemon's socket; a request that hangs fails after 30 s.
    pub fn client(&self) -> torpord::client::Client {
        let socket = self
            .socket
            .clone()
            .unwrap_or_else(torpord::client::default_socket);
        torpord::client::Client::unix(socket).with_timeout(Duration::from_secs(30))
    }

    /// A client that waits as long as the daemon takes (deploys, invocations).
    pub fn client_without_timeout(&self) -> torpord::client::Client {
        let socket = self
            .socket
            .clone()
            .unwrap_or_else(torpord::client::default_socket);
        torpord::client::Client::unix(socket)
    }
}

/// How long ago a Unix-ms time was, shortly: `42s`, `5m`, `3h`, `2d`.
pub fn ago(unix_ms: i64) -> String {
    let secs = (torpord::registry::now_ms() - unix_ms).max(0) / 1000;
    short_duration(secs as f64)
}

/// Seconds as a short duration: `42s`, `5m 3s`, `3h 2m`, `2d 4h`.
pub fn short_duration(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86399 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// The non-zero stages of a count, e.g. `1 warm, 2 hibernated`, or `none`.
pub fn stages(counts: &torpord::registry::StageCounts) -> String {
    let parts: Vec<String> = torpord::registry::Stage::ALL
        .iter()
        .filter(|s| counts.get(**s) > 0)
        .map(|s| format!("{} {}", counts.get(*s), s))
        .collect();
    if parts.is_empty() {
        "none".to_string()
    } else {
        parts.join(", ")
    }
}
