//! `torpor cluster …`: Torpor across nodes on Ray, which is Python (`python3 -m torpor.cluster`,
//! docs/cluster.md). This subcommand only finds the `torpor` Python package the way torpord
//! finds it for its workers (`$TORPOR_PYTHONPATH`, else beside this binary) and execs the
//! module with every argument unchanged, so the CLI has one entry point and the cluster code
//! one implementation. The interpreter is `$TORPOR_PYTHON`, else `python3` on `PATH` (the one
//! Ray is installed for).

use std::ffi::{OsStr, OsString};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

/// Why `torpor cluster` could not start the Python module.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The `torpor` Python package is not where torpord would look for it.
    #[error("torpor cluster needs the torpor Python package: {0}")]
    Sdk(#[from] torpord::sdk_dir::SdkDirError),
    /// exec of the interpreter failed (missing, not executable).
    #[error("cannot run {python} -m torpor.cluster ({source}): install Python 3.11+ with Ray (pip install \"ray[serve]>=2.40,<3\") or set $TORPOR_PYTHON")]
    Exec {
        python: String,
        #[source]
        source: std::io::Error,
    },
}

pub fn run(args: &[OsString]) -> anyhow::Result<ExitCode> {
    let dir = torpord::sdk_dir::python_dir().map_err(ClusterError::from)?;
    let python = std::env::var_os("TORPOR_PYTHON")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| OsString::from("python3"));
    let mut path = dir.into_os_string();
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let err = Command::new(&python)
        .args([OsStr::new("-m"), OsStr::new("torpor.cluster")])
        .args(args)
        .env("PYTHONPATH", path)
        .exec();
    Err(ClusterError::Exec {
        python: python.to_string_lossy().into_owned(),
        source: err,
    }
    .into())
}
