//! The daemon: takes the state directory, opens the registry, binds the listeners, then
//! serves the API until told to stop.

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{self, AppState};
use crate::auth::{TenantTokensError, Tokens};
use crate::config::Config;
use crate::connections;
use crate::metrics::Metrics;
use crate::registry::{now_ms, Registry, RegistryError};
use crate::runtime::Runtime;
use crate::socket::{self, BoundSocket, SocketError};
use crate::state_dir::{StateDir, StateDirError};

/// How long in-flight requests may run on after the shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    StateDir(#[from] StateDirError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Socket(#[from] SocketError),
    #[error(transparent)]
    Token(#[from] TenantTokensError),
    #[error(transparent)]
    SnapshotKey(#[from] torpor_image::KeyError),
    /// No cgroup file system can confine workers, and the config does not allow running them
    /// unconfined.
    #[error(transparent)]
    Cgroups(#[from] crate::cgroup::Unavailable),
    /// The TCP address cannot be bound.
    #[error("cannot listen on TCP {addr}: {source}")]
    Tcp {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The metrics cannot be registered (a bug: names are fixed).
    #[error("cannot register metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// `[objstore]`'s credentials file cannot be used.
    #[error("torpord.toml [objstore]: {0}")]
    Objstore(#[from] torpor_objstore::ConfigError),
}

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener cannot be handed to the async runtime.
    #[error("cannot set up listener {what}: {source}")]
    Listener {
        what: String,
        source: std::io::Error,
    },
    /// A listener failed while serving.
    #[error("serving on {what} failed: {source}")]
    Serve {
        what: String,
        source: std::io::Error,
    },
}

/// A daemon that has its state directory, registry and listeners, ready to serve.
#[derive(Debug)]
pub struct Daemon {
    config: Config,
    state_dir: StateDir,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    unix: BoundSocket,
    /// The socket workers connect to.
    workers: BoundSocket,
    tcp: Option<(TcpListener, SocketAddr, Tokens)>,
    /// Live instances of an earlier daemon whose processes are still there, to re-adopt.
    orphans: Vec<crate::registry::Instance>,
    /// Those of them whose interrupted hibernation was undone: their workers are woken.
    woken: Vec<String>,
    /// Seals every snapshot the daemon writes; every restore checks it (created on first start).
    snapshot_key: Arc<torpor_image::SnapshotKey>,
    /// Where worker trees get their cgroups; `None`: unconfined (`workers.allow_unconfined`).
    cgroups: Option<Arc<crate::cgroup::Cgroups>>,
    /// `[objstore]`, its credentials checked.
    objstore: Option<Arc<crate::bucket::Tier>>,
}

impl Daemon {
    /// Takes the state directory, opens (and migrates) the registry and binds the listeners.
    /// The config must have passed [`Config::validate`]. Nothing is served until [`Daemon::serve`].
    pub fn start(config: Config) -> Result<Self, StartError> {
        // The token first: a bad token file must not leave a bound socket behind.
        let token = match config.tcp {
            Some(_) => Some(Tokens::load(
                config.token_file.as_deref(),
                config.tenant_tokens_file.as_deref(),
            )?),
            None => None,
        };
        // Before the state directory: bad credentials leave nothing behind.
        let objstore = match &config.objstore {
            Some(o) => Some(Arc::new(crate::bucket::Tier::open(o)?)),
            None => None,
        };
        let state_dir = StateDir::open(&config.state_dir)?;
        let snapshot_key = Arc::new(torpor_image::SnapshotKey::load_or_create(
            &state_dir.snapshot_key(),
        )?);
        connections::raise_fd_limit();
        // A registry that went missing or empty is never made again silently over what it
        // recorded (issue 13).
        for holds in [state_dir.snapshots(), state_dir.functions()] {
            crate::registry::check_not_lost(&state_dir.registry(), &holds)?;
        }
        let registry = Registry::open(&state_dir.registry())?;
        // Instances whose memory was still on a page server (which the sweep kills) go first.
        crate::recovery::drop_pages_pending(&registry, state_dir.root())?;
        // The early sweep: processes of an earlier daemon outside the trees of its live
        // instances (CRIU, deploy workers) go first, so that none holds a tree the replay undoes.
        crate::recovery::sweep_processes(
            state_dir.root(),
            &crate::recovery::live_instance_inits(&registry)?,
        );
        // What an earlier daemon was doing when it died: finished or undone (crate::recovery).
        let replayed = crate::recovery::replay_journal(&registry, &snapshot_key)?;
        for name in registry.with(|s| s.fail_interrupted_deploys(now_ms()))? {
            tracing::warn!(function = %name, "deploy was interrupted by a daemon stop; marked failed");
        }
        let orphans = clean_up_instances(&registry, state_dir.root())?;
        let adopt: Vec<i32> = orphans.iter().filter_map(|i| i.pid).collect();
        crate::recovery::sweep_processes(state_dir.root(), &adopt);
        crate::recovery::sweep_snapshots(&registry, state_dir.root())?;
        match registry.shrink() {
            Ok(0) => {}
            Ok(bytes) => tracing::info!(bytes, "registry shrunk"),
            Err(e) => tracing::warn!(error = %e, "cannot shrink the registry"),
        }
        // The init copy workers run from, before any restore needs it: a snapshot pulled from
        // another node maps it by this binary's hash, and nothing may have launched here yet.
        if let Err(e) = torpor_snapshot::launch::init_binary(state_dir.root()) {
            tracing::warn!(error = %e, "cannot copy the init binary into the state directory; the first launch tries again");
        }
        if config.worker_users.unprivileged {
            let u = &config.worker_users;
            tracing::info!(
                uid_base = u.uid_base,
                uid_count = u.uid_count,
                "workers run unprivileged, as uid and gid uid_base + the tenant's number, seeing the host read-only"
            );
            for line in crate::users::unusable_gpu_devices(std::path::Path::new("/dev")) {
                tracing::warn!("{line}");
            }
        } else {
            tracing::warn!("workers run as root (workers.unprivileged = false): a hostile function can act on the node, the daemon and other tenants");
        }
        let metrics = Arc::new(Metrics::new()?);
        let unix = socket::bind(&config.socket)?;
        let workers = socket::bind_with_mode(&state_dir.workers_socket(), 0o666)?;
        let tcp = match (config.tcp, token) {
            (Some(addr), Some(token)) => {
                let tcp_err = |source| StartError::Tcp { addr, source };
                let listener = TcpListener::bind(addr).map_err(tcp_err)?;
                let bound = listener.local_addr().map_err(tcp_err)?;
                Some((listener, bound, token))
            }
            _ => None,
        };
        // Last: it makes the daemon's cgroup directory, which nothing after may leave behind.
        let cgroups = match crate::cgroup::Cgroups::detect(state_dir.root()) {
            Ok(c) => {
                tracing::info!(cgroup = ?c.version(), dir = %c.bases()[0].display(), "workers run in cgroups of their own");
                Some(c)
            }
            Err(e) if config.allow_unconfined => {
                tracing::warn!("{e} (workers.allow_unconfined = true: workers run without limits; set it to false to refuse to start instead)");
                None
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Self {
            config,
            state_dir,
            registry: Arc::new(registry),
            metrics,
            unix,
            workers,
            tcp,
            orphans,
            woken: replayed.woken,
            snapshot_key,
            cgroups,
            objstore,
        })
    }

    /// The registry (for code that runs beside the API: deploy, invoke, keep-alive).
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The metrics, to feed.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The state directory.
    pub fn state_dir(&self) -> &StateDir {
        &self.state_dir
    }

    /// The TCP address bound, if TCP is on (the real port when the config asked for port 0).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp.as_ref().map(|(_, addr, _)| *addr)
    }

    /// Serves the API until `shutdown` completes, then lets in-flight requests finish (for at
    /// most [`SHUTDOWN_GRACE`]) and removes the socket. Must run inside a Tokio runtime.
    pub async fn serve(
        mut self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let runtime = Arc::new(
            Runtime::new(
                self.config.clone(),
                Arc::clone(&self.registry),
                Arc::clone(&self.metrics),
                self.state_dir.root().to_path_buf(),
                self.state_dir.workers_socket(),
                Arc::clone(&self.snapshot_key),
                self.cgroups.clone(),
            )
            .with_objstore(self.objstore.clone()),
        );
        if let Err(e) = &runtime.python_dir {
            tracing::warn!(error = %e, "deploys will fail until this is fixed");
        }
        // CRIU's kernel-feature cache, made once here so that no restore pays CRIU's probes of
        // the kernel (67 ms on the H100; torpor_criu::kerndat). Without it restores still work.
        tokio::task::spawn_blocking(|| {
            // An older torpord killed while making it left its mount behind (torpor_criu::kerndat).
            let leaked = torpor_snapshot::preflight::remove_leaked_criu_cache_mounts();
            if leaked > 0 {
                tracing::info!(
                    mounts = leaked,
                    "removed the kernel-feature cache mounts an older torpord left behind"
                );
            }
            if let Err(e) = torpor_snapshot::preflight::prepare_criu_kernel_cache() {
                tracing::warn!(error = %e, "restores will probe the kernel each time");
            }
        });
        // The GPUs opened and the host cache pinned, so that the first pull or restore does not
        // pay them (crate::split::Split::open_gpus_at_start). Restores that start meanwhile
        // wait for the device they need, as they would have opened it.
        {
            let (split, pin) = (
                Arc::clone(&runtime.split),
                self.config.restore_server.pin_host_cache_at_start,
            );
            tokio::task::spawn_blocking(move || split.open_gpus_at_start(pin));
        }
        let workers_what = format!("workers socket {}", self.workers.path().display());
        let std_workers = self
            .workers
            .take_listener()
            .ok_or_else(|| ServeError::Listener {
                what: workers_what.clone(),
                source: std::io::Error::other("listener already taken"),
            })?;
        let workers_listener = std_workers
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(std_workers))
            .map_err(|source| ServeError::Listener {
                what: workers_what,
                source,
            })?;
        // The workers of the instances to re-adopt may say hello before they are claimed; any
        // other restored or re-attaching worker is a stray and is killed (workers::Hub::deliver).
        runtime.hub.expect(
            crate::recovery::owner_entry(self.state_dir.root()),
            self.orphans
                .iter()
                .filter_map(|o| o.pid)
                .filter_map(|init| crate::launcher::worker_pid(init).ok()),
        );
        let hub_task = tokio::spawn(Arc::clone(&runtime.hub).serve(workers_listener));
        // Before the API serves and before anything restores: a pull whose records never
        // reached the disk is settled from its chunks (crate::objstore).
        {
            let rt = Arc::clone(&runtime);
            if let Err(e) = tokio::task::spawn_blocking(move || rt.settle_pulls()).await {
                tracing::error!(error = %e, "settling the pulls left pending failed");
            }
        }
        // Before the API serves, so that a request waits for a re-adopted instance instead of
        // starting another one.
        runtime
            .readopt(
                std::mem::take(&mut self.orphans),
                std::mem::take(&mut self.woken),
            )
            .await;
        let keepalive_task = runtime.spawn_keepalive();
        // Failed pushes, tried again (crate::objstore); ends with the daemon.
        let _push_task = runtime.spawn_push_retries().map(AbortOnDrop);
        // The cgroups of trees that are gone (a re-adopted instance's, one whose removal found
        // its tree still exiting).
        let sweep_task = self.cgroups.clone().map(|cgroups| {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(crate::cgroup::SWEEP_EVERY).await;
                    let c = Arc::clone(&cgroups);
                    let _ = tokio::task::spawn_blocking(move || c.sweep()).await;
                }
            })
        });
        {
            let rt = Arc::clone(&runtime);
            tokio::spawn(async move {
                rt.take_up_hibernated().await;
                rt.take_up_standbys().await;
            });
        }
        {
            let rt = Arc::clone(&runtime);
            tokio::spawn(async move { rt.restage().await });
        }
        {
            // The live-context pool's ready sandboxes (crate::runtime::start::pooled).
            let rt = Arc::clone(&runtime);
            tokio::spawn(async move { rt.fill_sandbox_pools().await });
        }
        let state = Arc::new(AppState {
            runtime,
            config: self.config.clone(),
            registry: Arc::clone(&self.registry),
            metrics: Arc::clone(&self.metrics),
            state_dir: self.state_dir.root().to_path_buf(),
            tcp: self.tcp_addr(),
            started: Instant::now(),
            started_ms: now_ms(),
        });
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let bounds = |trusted| connections::Bounds {
            max_connections: self.config.http.max_connections,
            header_timeout: self.config.http.header_timeout,
            trusted,
        };

        let unix_what = format!("unix socket {}", self.unix.path().display());
        let std_unix = self
            .unix
            .take_listener()
            .ok_or_else(|| ServeError::Listener {
                what: unix_what.clone(),
                source: std::io::Error::other("listener already taken"),
            })?;
        let unix_listener = std_unix
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(std_unix))
            .map_err(|source| ServeError::Listener {
                what: unix_what.clone(),
                source,
            })?;
        let mut servers = tokio::task::JoinSet::new();
        {
            let app = api::router(Arc::clone(&state));
            let (rx, what, b) = (stop_rx.clone(), unix_what.clone(), bounds(true));
            servers.spawn(async move {
                connections::serve(unix_listener, app, b, rx, what).await;
                Ok(())
            });
        }
        if let Some((std_tcp, addr, token)) = self.tcp.take() {
            let what = format!("TCP {addr}");
            let tcp_listener = std_tcp
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(std_tcp))
                .map_err(|source| ServeError::Listener {
                    what: what.clone(),
                    source,
                })?;
            if !addr.ip().is_loopback() {
                tracing::warn!(%addr, "the API is on a non-loopback TCP address without TLS: the bearer token crosses the network in clear text");
            }
            let app = api::router_with_token(Arc::clone(&state), Arc::new(token));
            let (rx, b) = (stop_rx.clone(), bounds(false));
            servers.spawn(async move {
                connections::serve(tcp_listener, app, b, rx, what).await;
                Ok(())
            });
        }
        tracing::info!(
            version = env!("CARGO_PKG_VERSION"),
            socket = %self.unix.path().display(),
            tcp = %state.tcp.map_or_else(|| "off".to_string(), |a| a.to_string()),
            state_dir = %self.state_dir.root().display(),
            "torpord ready"
        );

        let mut result = Ok(());
        tokio::select! {
            () = shutdown => tracing::info!("shutting down: finishing in-flight requests"),
            Some(joined) = servers.join_next() => {
                // A listener stopped on its own: an error. Stop the others too.
                result = flatten(joined);
            }
        }
        // No new connection from here on (a client's connect now fails before it sends anything,
        // so it can retry against the next daemon), then the listeners stop and serve what is
        // already queued: a connection accepted by the kernel carries a request that was sent.
        self.unix.unlink();
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while let Some(joined) = servers.join_next().await {
                if let Err(e) = flatten(joined) {
                    tracing::error!(error = %e, "listener failed during shutdown");
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                grace_s = SHUTDOWN_GRACE.as_secs(),
                "requests still running after the grace period; stopping anyway"
            );
            servers.abort_all();
        }
        keepalive_task.abort();
        if let Some(t) = sweep_task {
            t.abort();
        }
        // The workers' socket serves on through the runtime's stop: a restore in flight wakes
        // its worker, which must reach the daemon to end the start (and be stopped with it).
        let runtime = Arc::clone(&state.runtime);
        let _ = tokio::task::spawn_blocking(move || runtime.shutdown()).await;
        hub_task.abort();
        if let Some(cgroups) = self.cgroups.clone() {
            let _ = tokio::task::spawn_blocking(move || cgroups.shut_down()).await;
        }
        // The socket file goes with `self.unix`, the state directory lock with `self.state_dir`.
        drop(self);
        tracing::info!("torpord stopped");
        result
    }
}

/// At startup: instances a previous daemon left. A live instance (warm, gpu_released) whose
/// init is still the very process recorded (same pid, same start time) is returned, to be
/// re-adopted once its worker reconnects. Any other live row is removed; its pid is killed only
/// if it still is the recorded process or, for rows written before start times were recorded,
/// its command line names this state directory. Hibernated and evicted instances need no
/// process: their rows and snapshots stay, and their function's pool takes them up again.
fn clean_up_instances(
    registry: &Registry,
    state_root: &std::path::Path,
) -> Result<Vec<crate::registry::Instance>, RegistryError> {
    let live: Vec<_> = registry
        .with(|s| s.instances())?
        .into_iter()
        .filter(|i| i.stage.has_process())
        .collect();
    let root = state_root.as_os_str().as_encoded_bytes();
    let mut orphans = Vec::new();
    let mut removed = 0;
    for i in live {
        let recorded = registry.with(|s| s.instance_process(&i.id))?;
        if let Some(pid) = i.pid.filter(|p| *p > 1 && crate::workers::alive(*p)) {
            let same = recorded.is_some_and(|(rpid, start)| {
                rpid == pid && crate::workers::process_start(pid) == Some(start)
            });
            if same {
                orphans.push(i);
                continue;
            }
            let ours = recorded.is_none()
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.windows(root.len().max(1)).any(|w| w == root));
            if ours {
                crate::runtime::kill_tree(pid);
                tracing::warn!(instance = %i.id, pid, "killed an instance left by an earlier torpord");
            } else {
                tracing::info!(instance = %i.id, pid, "the pid of an instance left by an earlier torpord is another process now; left alone");
            }
        }
        registry.with(|s| s.delete_instance(&i.id))?;
        removed += 1;
    }
    if removed > 0 {
        tracing::info!(
            instances = removed,
            "removed the live instances of an earlier torpord that are gone"
        );
    }
    if !orphans.is_empty() {
        tracing::info!(
            instances = orphans.len(),
            "waiting for the live instances of an earlier torpord to reconnect"
        );
    }
    Ok(orphans)
}

fn flatten(
    joined: Result<Result<(), ServeError>, tokio::task::JoinError>,
) -> Result<(), ServeError> {
    joined.unwrap_or_else(|e| {
        Err(ServeError::Serve {
            what: "listener task".to_string(),
            source: std::io::Error::other(e.to_string()),
        })
    })
}

/// Aborts its task when dropped (a background loop that must end with `serve`).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
