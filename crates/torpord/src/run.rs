//! The whole daemon as a foreground program: what `torpor serve` and `torpord` run.

use std::future::Future;

use tokio::signal::unix::{signal, SignalKind};

use crate::config::{Config, ConfigError, ServeArgs};
use crate::logging;
use crate::server::{Daemon, ServeError, StartError};

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Start(#[from] StartError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// The async runtime cannot be built.
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    /// `--check`: the resolved config cannot be printed (a path that is not UTF-8).
    #[error("cannot print the configuration as JSON: {0}")]
    Check(serde_json::Error),
    /// SIGTERM/SIGINT cannot be caught.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error(transparent)]
    HugePages(#[from] crate::hugepages::ThpError),
}

/// Loads the config (file + flags), sets up logging, starts the daemon and serves until
/// SIGTERM or SIGINT. With `--check`, prints the resolved config as JSON and returns instead.
pub fn run(args: &ServeArgs) -> Result<(), RunError> {
    let config = Config::load(args)?;
    if args.check {
        let json = serde_json::to_string_pretty(&config).map_err(RunError::Check)?;
        println!("{json}");
        return Ok(());
    }
    logging::init(config.log_format, config.log_level);
    if let Some(file) = &config.file {
        tracing::info!(config = %file.display(), "config file read");
    }
    // Before the daemon starts restoring (its re-adoption and standbys may restore at once).
    let thp = crate::hugepages::apply(
        config.restore_server.transparent_hugepage,
        std::path::Path::new(crate::hugepages::SYSFS_ENABLED),
    )?;
    let daemon = match Daemon::start(config) {
        Ok(d) => d,
        Err(e) => {
            if let Some(changed) = thp {
                changed.restore();
            }
            return Err(e.into());
        }
    };
    crate::hugepages::report(std::path::Path::new(crate::hugepages::SYSFS_ENABLED));
    // Before any thread starts: every process the daemon starts from here on is findable by a
    // later daemon (crate::recovery).
    crate::recovery::mark_children(daemon.state_dir().root());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("torpord")
        .build()
        .map_err(RunError::Runtime)?;
    let served = runtime.block_on(async move {
        let stop = shutdown_signal().map_err(RunError::Signals)?;
        Ok(daemon.serve(stop).await?)
    });
    // Dropping the runtime would wait for every blocking task still running. The serve loop
    // awaited all that a stop needs; what may be left is background work that a stop can
    // abandon (the host cache being pinned at start: 4 GiB took ~2 s on the H100; a sweep),
    // so a stop waits for it no longer than this.
    runtime.shutdown_timeout(BACKGROUND_GRACE);
    if let Some(changed) = thp {
        changed.restore();
    }
    served
}

/// How long a stop waits for background blocking tasks once the daemon has stopped serving.
const BACKGROUND_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Completes at the first SIGTERM or SIGINT. The handlers are installed before it returns.
fn shutdown_signal() -> std::io::Result<impl Future<Output = ()>> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}
