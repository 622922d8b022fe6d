//! The real `torpord` process on a temporary state directory and socket, driven over its real
//! Unix socket and TCP listener; rows are put in through the registry API on the same SQLite
//! file the daemon has open.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use torpord::api::types::{Deleted, FunctionDetail, FunctionList, Status};
use torpord::client::Client;
use torpord::registry::{
    Function, FunctionState, Instance, Registry, Snapshot, SnapshotKind, Stage,
};

/// These tests start no worker: their daemons make no cgroup (a daemon a test kills would leave
/// its directory behind), with the cgroup file system out of reach (`TORPORD_CGROUP_FS`).
const UNCONFINED: &str = "[workers]\nallow_unconfined = true\n";

/// Upper bound on waiting for the daemon to answer (never reached when things work).
const STARTUP_LIMIT: Duration = Duration::from_secs(20);

struct Daemon {
    child: Option<Child>,
    socket: PathBuf,
    state: PathBuf,
    stderr: PathBuf,
}

/// Paths of one test: a temp dir with a state dir, a socket and a config file that turns the
/// stage area off (these tests deploy nothing, and the tmpfs of a daemon killed at the end of a
/// test would stay mounted in the temp dir), and cgroups too ([`UNCONFINED`]).
struct Env {
    tmp: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("torpord.toml"),
            format!("[restore_server]\nstage_bytes = 0\n{UNCONFINED}"),
        )
        .unwrap();
        Self { tmp }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    fn socket(&self) -> PathBuf {
        self.path("run/torpord.sock")
    }

    fn state(&self) -> PathBuf {
        self.path("state")
    }

    /// `torpord --config <empty> --state-dir … --socket …` plus `extra`, not waited for.
    fn spawn(&self, extra: &[&str]) -> Daemon {
        self.spawn_with(&self.state(), &self.socket(), extra)
    }

    fn spawn_with(&self, state: &Path, socket: &Path, extra: &[&str]) -> Daemon {
        let n = std::fs::read_dir(self.tmp.path()).unwrap().count();
        let stderr = self.path(&format!("stderr-{n}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_torpord"))
            .arg("--config")
            .arg(self.path("torpord.toml"))
            .arg("--state-dir")
            .arg(state)
            .arg("--socket")
            .arg(socket)
            .args(extra)
            .env_remove("TORPOR_SOCKET")
            .env(torpord::cgroup::FS_ENV, "/nonexistent")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        Daemon {
            child: Some(child),
            socket: socket.to_path_buf(),
            state: state.to_path_buf(),
            stderr,
        }
    }

    /// A daemon that answers on its socket.
    fn start(&self, extra: &[&str]) -> Daemon {
        let mut d = self.spawn(extra);
        d.wait_ready();
        d
    }

    /// A token file (mode 0600) holding `token`.
    fn token_file(&self, token: &str) -> PathBuf {
        let path = self.path("token");
        std::fs::write(&path, format!("{token}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }
}

impl Daemon {
    fn client(&self) -> Client {
        Client::unix(&self.socket)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + STARTUP_LIMIT;
        loop {
            if self.client().request("GET", "/v1/status", None).is_ok() {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("torpord exited with {status}:\n{}", self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "torpord did not answer:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for a daemon that is expected to fail at startup; returns its stderr.
    fn expect_failure(mut self) -> String {
        let status = self.child.take().unwrap().wait().unwrap();
        let stderr = self.stderr();
        assert!(!status.success(), "torpord should have failed:\n{stderr}");
        assert_eq!(status.code(), Some(1), "{stderr}");
        stderr
    }

    fn signal(&mut self, sig: i32) -> ExitStatus {
        let mut child = self.child.take().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        child.wait().unwrap()
    }

    /// SIGTERM, and the exit status.
    fn stop(mut self) -> ExitStatus {
        self.signal(libc::SIGTERM)
    }

    /// The daemon's registry, opened beside it.
    fn registry(&self) -> Registry {
        Registry::open(&self.state.join("registry.db")).unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn function(name: &str, state: FunctionState) -> Function {
    Function {
        name: name.to_string(),
        dir: PathBuf::from(format!("/srv/functions/{name}")),
        spec: serde_json::json!({"name": name, "entry": "model:MLP", "gpus": 0}),
        base_key: "python3|numpy|cpu".to_string(),
        snapshot: None,
        state,
        created: 1_700_000_000_000,
        updated: 1_700_000_000_000,
    }
}

fn snapshot(id: &str, kind: SnapshotKind, function: Option<&str>, path: PathBuf) -> Snapshot {
    Snapshot {
        id: id.to_string(),
        kind,
        path,
        function: function.map(str::to_string),
        base_key: Some("python3|numpy|cpu".to_string()),
        bytes: 4096,
        created: 1_700_000_000_000,
    }
}

fn instance(id: &str, function: &str, stage: Stage, pid: Option<i32>) -> Instance {
    Instance {
        id: id.to_string(),
        function: function.to_string(),
        pid,
        stage,
        snapshot: None,
        started: 1_700_000_000_000,
        last_used: 1_700_000_000_000,
    }
}

#[test]
fn status_functions_and_delete() {
    let env = Env::new();
    let d = env.start(&[]);
    let c = d.client();

    let status: Status = c.get_json("/v1/status").unwrap();
    assert_eq!(status.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(status.state_dir, env.state());
    assert_eq!(status.socket, env.socket());
    assert_eq!(status.tcp, None);
    assert_eq!(status.functions, 0);
    assert_eq!(status.instances.total(), 0);
    assert_eq!(status.keepalive.gpu_release_s, 30.0);
    assert_eq!(status.keepalive.hibernate_s, 120.0);
    assert_eq!(status.keepalive.evict_s, 600.0);
    assert_eq!(status.queue.length, 64);
    assert_eq!(status.queue.timeout_s, 30.0);
    assert_eq!(status.registry_schema, torpord::registry::SCHEMA_VERSION);
    for sub in ["registry.db", "snapshots", "functions", "logs"] {
        assert!(env.state().join(sub).exists(), "{sub}");
    }

    let list: FunctionList = c.get_json("/v1/functions").unwrap();
    assert!(list.functions.is_empty());

    // Rows put in beside the running daemon, through the registry API.
    let snap_dir = env.state().join("snapshots/mlp-fn");
    std::fs::create_dir_all(&snap_dir).unwrap();
    std::fs::write(snap_dir.join("manifest.json"), "{}").unwrap();
    let outside = env.path("elsewhere/mlp-hib");
    std::fs::create_dir_all(&outside).unwrap();
    let reg = d.registry();
    reg.transaction(|s| {
        let mut f = function("mlp", FunctionState::Ready);
        s.insert_function(&f)?;
        s.insert_function(&function("busy", FunctionState::Ready))?;
        s.insert_snapshot(&snapshot(
            "base-1",
            SnapshotKind::Base,
            None,
            env.state().join("snapshots/base-1"),
        ))?;
        s.insert_snapshot(&snapshot(
            "mlp-fn",
            SnapshotKind::Function,
            Some("mlp"),
            snap_dir.clone(),
        ))?;
        s.insert_snapshot(&snapshot(
            "mlp-hib",
            SnapshotKind::Hibernation,
            Some("mlp"),
            outside.clone(),
        ))?;
        f.snapshot = Some("mlp-fn".to_string());
        s.update_function(&f)?;
        s.insert_instance(&instance("mlp-1", "mlp", Stage::Hibernated, None))?;
        s.insert_instance(&instance("busy-1", "busy", Stage::Warm, Some(999_999)))?;
        Ok::<_, torpord::registry::RegistryError>(())
    })
    .unwrap();

    let list: FunctionList = c.get_json("/v1/functions").unwrap();
    let names: Vec<_> = list.functions.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["busy", "mlp"]);
    let mlp = &list.functions[1];
    assert_eq!(mlp.state, FunctionState::Ready);
    assert_eq!(mlp.snapshot.as_deref(), Some("mlp-fn"));
    assert_eq!(mlp.instances.hibernated, 1);
    assert_eq!(list.functions[0].instances.warm, 1);

    let detail: FunctionDetail = c.get_json("/v1/functions/mlp").unwrap();
    assert_eq!(detail.function.spec["entry"], "model:MLP");
    assert_eq!(detail.snapshots.len(), 2);
    assert_eq!(detail.instances[0].instance.id, "mlp-1");
    assert_eq!(detail.instances[0].device, 0);

    let status: Status = c.get_json("/v1/status").unwrap();
    assert_eq!(status.functions, 2);
    assert_eq!(status.snapshots.base, 1);
    assert_eq!(status.snapshots.function, 1);
    assert_eq!(status.snapshots.hibernation, 1);
    assert_eq!(status.instances.warm, 1);
    assert_eq!(status.instances.hibernated, 1);

    // Unknown function: 404 with a JSON error.
    let r = c.request("GET", "/v1/functions/nope", None).unwrap();
    assert_eq!(r.status, 404);
    assert!(
        r.error_message().contains("no function named \"nope\""),
        "{}",
        r.error_message()
    );
    let r = c.request("DELETE", "/v1/functions/nope", None).unwrap();
    assert_eq!(r.status, 404);

    // A function with a running instance is not deleted.
    let r = c.request("DELETE", "/v1/functions/busy", None).unwrap();
    assert_eq!(r.status, 409);
    assert!(
        r.error_message().contains("pid 999999"),
        "{}",
        r.error_message()
    );

    // Delete: rows gone, the snapshot under the state dir removed, the one outside kept.
    let r = c.request("DELETE", "/v1/functions/mlp", None).unwrap();
    assert_eq!(r.status, 200, "{}", r.error_message());
    let deleted: Deleted = r.json().unwrap();
    assert_eq!(deleted.deleted, "mlp");
    assert_eq!(deleted.snapshots, ["mlp-fn", "mlp-hib"]);
    assert_eq!(deleted.removed, std::slice::from_ref(&snap_dir));
    assert!(deleted.left_behind.contains_key(&outside));
    assert!(!snap_dir.exists());
    assert!(outside.exists());
    let r = c.request("GET", "/v1/functions/mlp", None).unwrap();
    assert_eq!(r.status, 404);
    let status: Status = c.get_json("/v1/status").unwrap();
    assert_eq!(status.functions, 1);
    assert_eq!(
        status.snapshots.base, 1,
        "base snapshots are shared and stay"
    );
    assert_eq!(status.snapshots.hibernation, 0);
    assert_eq!(status.instances.hibernated, 0);

    assert!(d.stop().success());
}

#[test]
fn unknown_functions_and_routes_answer_json_errors() {
    let env = Env::new();
    let d = env.start(&[]);
    let c = d.client();
    let r = c.request("GET", "/v1/functions/f/logs", None).unwrap();
    assert_eq!(r.status, 404);
    assert!(
        r.error_message().contains("no function named \"f\""),
        "{}",
        r.error_message()
    );
    // Deploy and invoke answer JSON errors for a bad directory and an unknown function.
    let r = c
        .request(
            "POST",
            "/v1/functions",
            Some(&br#"{"dir": "/nonexistent/fn"}"#[..]),
        )
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    assert!(
        r.error_message().contains("/nonexistent/fn"),
        "{}",
        r.error_message()
    );
    let r = c
        .request("POST", "/v1/functions", Some(&br#"{"dir": "rel"}"#[..]))
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    let r = c
        .request("POST", "/v1/functions", Some(&br#"{"path": "/x"}"#[..]))
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    let r = c
        .request("POST", "/v1/functions/f/invoke", Some(&b"{}"[..]))
        .unwrap();
    assert_eq!(r.status, 404, "{}", r.error_message());
    assert!(
        r.error_message().contains("no function named \"f\""),
        "{}",
        r.error_message()
    );
    let r = c
        .request("POST", "/v1/functions/f/invoke", Some(&b"{not json"[..]))
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.error_message());
    let r = c.request("GET", "/v2/nothing", None).unwrap();
    assert_eq!(r.status, 404);
    assert_eq!(r.error_message(), "no route for GET /v2/nothing");
    let r = c.request("PUT", "/v1/status", None).unwrap();
    assert_eq!(r.status, 405);
    assert!(
        r.error_message().contains("PUT is not allowed"),
        "{}",
        r.error_message()
    );
}

#[test]
fn socket_is_private_a_stale_one_is_replaced_and_a_live_one_refused() {
    let env = Env::new();
    let mut d = env.start(&[]);
    let mode = std::fs::metadata(env.socket())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);

    // A second daemon on the same socket (own state dir) is refused; the first keeps serving.
    let other_state = env.path("state2");
    let second = env.spawn_with(&other_state, &env.socket(), &[]);
    let err = second.expect_failure();
    assert!(
        err.contains(&format!(
            "torpord: error: another torpord is already listening on {}",
            env.socket().display()
        )),
        "{err}"
    );
    d.client().get_json::<Status>("/v1/status").unwrap();

    // A second daemon on the same state dir (own socket) is refused too.
    let second = env.spawn_with(&env.state(), &env.path("other.sock"), &[]);
    let err = second.expect_failure();
    assert!(err.contains("is in use by another torpord (pid"), "{err}");

    // A killed daemon leaves its socket behind; the next one replaces it.
    let status = d.signal(libc::SIGKILL);
    assert!(!status.success());
    assert!(env.socket().exists(), "SIGKILL leaves the socket file");
    let d = env.start(&[]);
    d.client().get_json::<Status>("/v1/status").unwrap();
    assert!(
        d.stderr().contains("removing stale socket"),
        "{}",
        d.stderr()
    );

    // SIGTERM: a clean exit that removes the socket.
    assert!(d.stop().success());
    assert!(!env.socket().exists());

    // Something that is not a socket is never removed.
    std::fs::write(env.socket(), "keep me").unwrap();
    let err = env.spawn(&[]).expect_failure();
    assert!(err.contains("exists and is not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(env.socket()).unwrap(), "keep me");
}

#[test]
fn tcp_requires_the_bearer_token() {
    let env = Env::new();
    let token = "s3cret-token-0123456789abcdef";
    let token_file = env.token_file(token);
    let d = env.start(&[
        "--tcp",
        "127.0.0.1:0",
        "--token-file",
        token_file.to_str().unwrap(),
    ]);
    // The Unix socket needs no token; it reports the port TCP got.
    let status: Status = d.client().get_json("/v1/status").unwrap();
    let addr = status.tcp.expect("tcp address in status");
    assert_ne!(addr.port(), 0);

    for bad in [None, Some("wrong-token-0123456789abcdef".to_string())] {
        let r = Client::tcp(addr, bad.clone())
            .request("GET", "/v1/status", None)
            .unwrap();
        assert_eq!(r.status, 401, "{bad:?}");
        assert!(
            r.error_message().contains("bearer token"),
            "{}",
            r.error_message()
        );
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    // Also on routes that do not exist: nothing is revealed without the token.
    let r = Client::tcp(addr, None)
        .request("GET", "/nope", None)
        .unwrap();
    assert_eq!(r.status, 401);

    let good = Client::tcp(addr, Some(token.to_string()));
    let status: Status = good.get_json("/v1/status").unwrap();
    assert_eq!(status.tcp, Some(addr));
    let r = good.request("GET", "/metrics", None).unwrap();
    assert_eq!(r.status, 200);
    assert!(d.stop().success());
}

#[test]
fn a_tenants_token_is_its_tenants_and_the_admin_token_everyones() {
    let env = Env::new();
    let admin = env.token_file("admin-token-0123456789abcdef");
    let tenants = env.path("tenant-tokens");
    std::fs::write(&tenants, "# tenants\nteam-a = team-a-token-0123456789ab\n").unwrap();
    std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    let d = env.start(&[
        "--tcp",
        "127.0.0.1:0",
        "--token-file",
        admin.to_str().unwrap(),
        "--tenant-tokens-file",
        tenants.to_str().unwrap(),
    ]);
    let status: Status = d.client().get_json("/v1/status").unwrap();
    let addr = status.tcp.expect("tcp address in status");
    let team_a = Client::tcp(addr, Some("team-a-token-0123456789ab".to_string()));
    let status: Status = team_a.get_json("/v1/status").unwrap();
    assert_eq!(status.functions, 0);
    let r = team_a.request("GET", "/v1/functions", None).unwrap();
    assert_eq!(r.status, 200);
    let r = team_a.request("GET", "/v1/functions/f", None).unwrap();
    assert_eq!(
        (r.status, r.error_message()),
        (404, "no function named \"f\" (see `torpor ls`)".to_string())
    );
    let r = team_a.request("GET", "/metrics", None).unwrap();
    assert_eq!(r.status, 403, "{}", r.error_message());
    assert!(
        r.error_message().contains("admin token"),
        "{}",
        r.error_message()
    );
    let admin = Client::tcp(addr, Some("admin-token-0123456789abcdef".to_string()));
    assert_eq!(admin.request("GET", "/metrics", None).unwrap().status, 200);
    let r = Client::tcp(addr, Some("team-b-token-0123456789ab".to_string()))
        .request("GET", "/v1/functions", None)
        .unwrap();
    assert_eq!(r.status, 401);
    assert!(d.stop().success());

    // Tenants' tokens alone are enough for TCP; a bad line stops the start, naming it.
    std::fs::write(&tenants, "team-a = team-a-token-0123456789ab\nTeam B = x\n").unwrap();
    let err = env
        .spawn(&[
            "--tcp",
            "127.0.0.1:0",
            "--tenant-tokens-file",
            tenants.to_str().unwrap(),
        ])
        .expect_failure();
    assert!(
        err.contains("line 2 names a tenant that is not a tenant name"),
        "{err}"
    );
    assert!(!err.contains("team-a-token"), "{err}");
}

#[test]
fn bad_startup_settings_are_refused_with_the_reason() {
    let env = Env::new();
    let err = env.spawn(&["--tcp", "127.0.0.1:0"]).expect_failure();
    assert!(
        err.contains("torpord: error: --tcp needs a token: pass --token-file"),
        "{err}"
    );
    assert!(!env.socket().exists(), "nothing bound");

    let token_file = env.token_file("0123456789abcdef0123456789");
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = env
        .spawn(&[
            "--tcp",
            "127.0.0.1:0",
            "--token-file",
            token_file.to_str().unwrap(),
        ])
        .expect_failure();
    assert!(
        err.contains("is readable by group or others (mode 0644)"),
        "{err}"
    );
    assert!(!env.socket().exists(), "nothing bound");

    let config = env.path("torpord.toml");
    std::fs::write(&config, "[queue]\nlenght = 10\n").unwrap();
    let err = env.spawn(&[]).expect_failure();
    assert!(
        err.contains(&format!(
            "{}: queue.lenght is not a known key",
            config.display()
        )),
        "{err}"
    );
    std::fs::write(&config, "[keepalive]\nhibernate_s = \"2m\"\n").unwrap();
    let err = env.spawn(&[]).expect_failure();
    assert!(
        err.contains(
            "keepalive.hibernate_s must be a number of seconds from 0 to 31536000, got \"2m\""
        ),
        "{err}"
    );
}

#[test]
fn config_file_settings_apply_and_flags_override_them() {
    let env = Env::new();
    std::fs::write(
        env.path("torpord.toml"),
        format!(
            "socket = \"{}\"\n[keepalive]\ngpu_release_s = 0.5\nhibernate_s = 1\nevict_s = 2\n\
             [queue]\nlength = 3\ntimeout_s = 0.25\n[restore_server]\nstage_bytes = 0\n[workers]\nallow_unconfined = true\n",
            env.path("from-file.sock").display()
        ),
    )
    .unwrap();
    // `--socket` (given by spawn) wins over the file's socket.
    let d = env.start(&[]);
    let status: Status = d.client().get_json("/v1/status").unwrap();
    assert_eq!(status.socket, env.socket());
    assert!(!env.path("from-file.sock").exists());
    assert_eq!(status.config_file, Some(env.path("torpord.toml")));
    assert_eq!(status.keepalive.gpu_release_s, 0.5);
    assert_eq!(status.keepalive.evict_s, 2.0);
    assert_eq!(status.queue.length, 3);
    assert_eq!(status.queue.timeout_s, 0.25);
}

#[test]
fn restart_keeps_the_registry_and_fails_interrupted_deploys() {
    let env = Env::new();
    let d = env.start(&[]);
    d.registry()
        .transaction(|s| {
            s.insert_function(&function("kept", FunctionState::Ready))?;
            s.insert_function(&function("midway", FunctionState::Deploying))?;
            s.insert_snapshot(&snapshot(
                "base-1",
                SnapshotKind::Base,
                None,
                env.state().join("snapshots/base-1"),
            ))?;
            s.insert_instance(&instance("kept-1", "kept", Stage::Evicted, None))
        })
        .unwrap();
    assert!(d.stop().success());

    let d = env.start(&[]);
    let list: FunctionList = d.client().get_json("/v1/functions").unwrap();
    let states: Vec<_> = list
        .functions
        .iter()
        .map(|f| (f.name.as_str(), f.state))
        .collect();
    assert_eq!(
        states,
        [
            ("kept", FunctionState::Ready),
            ("midway", FunctionState::Failed)
        ]
    );
    assert_eq!(list.functions[0].instances.evicted, 1);
    let status: Status = d.client().get_json("/v1/status").unwrap();
    assert_eq!(status.snapshots.base, 1);
    assert!(
        d.stderr().contains("deploy was interrupted"),
        "{}",
        d.stderr()
    );
}

/// One sample line of the Prometheus text format: `name{labels} value`.
fn parse_sample(line: &str) -> (String, String, f64) {
    let (series, value) = line
        .rsplit_once(' ')
        .unwrap_or_else(|| panic!("no value: {line}"));
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
    };
    let (name, labels) = match series.split_once('{') {
        Some((n, rest)) => {
            let labels = rest
                .strip_suffix('}')
                .unwrap_or_else(|| panic!("labels: {line}"));
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = pair
                    .split_once('=')
                    .unwrap_or_else(|| panic!("label: {line}"));
                assert!(valid_name(k), "label name in {line}");
                assert!(
                    v.starts_with('"') && v.ends_with('"') && v.len() >= 2,
                    "{line}"
                );
            }
            (n, labels)
        }
        None => (series, ""),
    };
    assert!(valid_name(name), "metric name in {line}");
    (name.to_string(), labels.to_string(), value)
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

#[test]
fn metrics_are_prometheus_text_with_every_name() {
    let env = Env::new();
    let d = env.start(&[]);
    d.registry()
        .transaction(|s| {
            s.insert_function(&function("mlp", FunctionState::Ready))?;
            s.insert_instance(&instance("a", "mlp", Stage::Hibernated, None))?;
            s.insert_instance(&instance("b", "mlp", Stage::Hibernated, None))?;
            s.insert_instance(&instance("c", "mlp", Stage::Evicted, None))
        })
        .unwrap();
    let r = d.client().request("GET", "/metrics", None).unwrap();
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{:?}",
        r.header("content-type")
    );
    let text = String::from_utf8(r.body).unwrap();

    let mut typed = BTreeSet::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_string());
        } else if line.starts_with("# HELP ") {
            continue;
        } else {
            assert!(!line.starts_with('#'), "unexpected comment {line}");
            samples.push(parse_sample(line));
        }
    }
    for name in [
        "torpor_invocations_total",
        "torpor_starts_total",
        "torpor_phase_duration_seconds",
        "torpor_instances",
        "torpor_gpu_memory_bytes",
        "torpor_queue_length",
        "torpor_instance_stage_seconds_total",
        "torpor_gpu_memory_byte_seconds_total",
    ] {
        assert!(typed.contains(name), "{name} missing:\n{text}");
    }
    let value = |name: &str, labels: &str| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && l == labels)
            .map(|(_, _, v)| *v)
            .unwrap_or_else(|| panic!("no {name}{{{labels}}} in\n{text}"))
    };
    assert_eq!(value("torpor_instances", "stage=\"warm\""), 0.0);
    assert_eq!(value("torpor_instances", "stage=\"hibernated\""), 2.0);
    assert_eq!(value("torpor_instances", "stage=\"evicted\""), 1.0);
    assert_eq!(value("torpor_gpu_memory_bytes", ""), 0.0);
    assert_eq!(
        value("torpor_starts_total", "function=\"mlp\",kind=\"restored\""),
        0.0
    );
    assert_eq!(
        value(
            "torpor_phase_duration_seconds_count",
            "function=\"mlp\",phase=\"total\""
        ),
        0.0
    );
    assert_eq!(value("torpor_queue_length", "function=\"mlp\""), 0.0);
    // Per stage, starting and hibernating included; the function's total is their sum.
    for stage in ["starting", "warm", "hibernating", "evicted"] {
        let labels = format!("function=\"mlp\",stage=\"{stage}\"");
        assert_eq!(value("torpor_gpu_memory_byte_seconds_total", &labels), 0.0);
        assert_eq!(value("torpor_instance_stage_seconds_total", &labels), 0.0);
    }
}

#[test]
fn json_logs_are_one_object_per_line() {
    let env = Env::new();
    let d = env.start(&["--log-format", "json", "--log-level", "debug"]);
    d.client().get_json::<Status>("/v1/status").unwrap();
    let stderr_path = d.stderr.clone();
    assert!(d.stop().success());
    let text = std::fs::read_to_string(stderr_path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["message"] == "torpord ready"),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l["message"] == "request" && l["path"] == "/v1/status" && l["status"] == 200),
        "{text}"
    );
    assert!(lines
        .iter()
        .all(|l| l["level"].is_string() && l["timestamp"].is_string()));
}
