//! One module per subcommand; each parses nothing and prints little, the work is in the crates.

pub mod checkpointing;
pub mod cluster;
pub mod deploy;
pub mod inspect;
pub mod invoke;
pub mod logs;
pub mod ls;
pub mod migrate;
pub mod objstore;
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

/// `--key FILE` / `--unkeyed`: which key seals or authenticates a snapshot.
#[derive(clap::Args, Debug, Clone)]
pub struct KeyArgs {
    /// The snapshot key that seals (`snapshot`) or must have sealed (`restore`, `stage`,
    /// `verify`) the snapshot: a torpord's is <state-dir>/snapshot.key [default:
    /// ${XDG_DATA_HOME:-$HOME/.local/share}/torpor/snapshot.key, created mode 0600 by the first
    /// `torpor snapshot`]
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Unkeyed: write no MAC, or check none. The listed hashes still catch accidents, but anyone
    /// who can write the snapshot can recompute them: nothing then proves who wrote it.
    #[arg(long, conflicts_with = "key")]
    pub unkeyed: bool,
}

impl KeyArgs {
    /// The key file to use (`--key`, else the default), or `None` with `--unkeyed`.
    pub fn path(&self) -> anyhow::Result<Option<PathBuf>> {
        if self.unkeyed {
            return Ok(None);
        }
        if let Some(path) = &self.key {
            return Ok(Some(path.clone()));
        }
        let nonempty = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let data = match (nonempty("XDG_DATA_HOME"), nonempty("HOME")) {
            (Some(d), _) => PathBuf::from(d),
            (None, Some(home)) => PathBuf::from(home).join(".local/share"),
            (None, None) => anyhow::bail!(
                "neither XDG_DATA_HOME nor HOME is set, so the snapshot key has no default place: pass --key FILE (or --unkeyed)"
            ),
        };
        Ok(Some(
            data.join("torpor").join(torpor_image::SNAPSHOT_KEY_FILE),
        ))
    }

    /// The key that seals a new snapshot, created (and its directory, mode 0700) on first use.
    pub fn sealing_key(&self) -> anyhow::Result<Option<torpor_image::SnapshotKey>> {
        let Some(path) = self.path()? else {
            return Ok(None);
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| {
                    anyhow::anyhow!(
                        "cannot create {} for the snapshot key: {e}: create it, or pass --key FILE",
                        dir.display()
                    )
                })?;
        }
        Ok(Some(torpor_image::SnapshotKey::load_or_create(&path)?))
    }

    /// The key a snapshot must be sealed with (it must exist), or `None` with `--unkeyed`.
    pub fn checking_key(&self) -> anyhow::Result<Option<torpor_image::SnapshotKey>> {
        match self.path()? {
            None => Ok(None),
            Some(path) => Ok(Some(torpor_image::SnapshotKey::load(&path)?)),
        }
    }
}

/// `Trust` for an optional key: the key, or unkeyed.
/// The id a snapshot directory goes by in a chunk store or a bucket: `given`, else the
/// directory's own name; `flag` is the option that names it, for the error.
pub fn snapshot_id(
    dir: &std::path::Path,
    given: Option<&str>,
    flag: &str,
) -> anyhow::Result<String> {
    use anyhow::Context;
    match given {
        Some(id) => Ok(id.to_owned()),
        None => dir
            .canonicalize()
            .ok()
            .and_then(|d| d.file_name()?.to_str().map(str::to_owned))
            .with_context(|| format!("cannot name {}: pass {flag}", dir.display())),
    }
}

pub fn trust(key: Option<&torpor_image::SnapshotKey>) -> torpor_image::Trust<'_> {
    key.map_or(torpor_image::Trust::Unkeyed, torpor_image::Trust::Key)
}

/// How a checked snapshot was authenticated, for `verify` and `inspect` output.
pub fn authenticity(key: Option<&torpor_image::SnapshotKey>) -> String {
    match key {
        Some(key) => format!("sealed by key {} ({})", key.id(), key.path().display()),
        None => "unkeyed: MAC not checked, hashes only".to_owned(),
    }
}
