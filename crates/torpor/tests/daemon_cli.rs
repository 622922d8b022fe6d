//! `torpor serve`, `torpor ls` and `torpor status` against the real daemon.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use torpord::registry::{Function, FunctionState, Instance, Registry, Stage};

const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");

fn torpor(args: &[&str], socket: Option<&Path>) -> Output {
    let mut cmd = Command::new(TORPOR);
    cmd.args(args).env_remove("TORPOR_SOCKET");
    if let Some(s) = socket {
        cmd.env("TORPOR_SOCKET", s);
    }
    cmd.output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &Path) -> Serve {
    let config = dir.join("torpord.toml");
    std::fs::write(&config, "").unwrap();
    let socket = dir.join("torpord.sock");
    let mut child = Serve(
        Command::new(TORPOR)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(&socket)
            .env_remove("TORPOR_SOCKET")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(child.0.try_wait().unwrap().is_none(), "torpor serve exited");
        assert!(Instant::now() < deadline, "torpor serve did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn ls_and_status_talk_to_torpor_serve() {
    let tmp = tempfile::tempdir().unwrap();
    let mut daemon = serve(tmp.path());
    let socket = tmp.path().join("torpord.sock");
    let sock = socket.to_str().unwrap();

    let out = torpor(&["status", "--socket", sock], None);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("torpord {} (pid ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains("tcp         off"), "{text}");
    assert!(text.contains("functions   0"), "{text}");

    // $TORPOR_SOCKET stands in for --socket.
    let out = torpor(&["status", "--json"], Some(&socket));
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["socket"], sock);
    assert_eq!(json["instances"]["warm"], 0);

    let out = torpor(&["ls", "--socket", sock], None);
    assert_eq!(stdout(&out), "no functions deployed\n");

    let registry = Registry::open(&tmp.path().join("state/registry.db")).unwrap();
    registry
        .transaction(|s| {
            s.insert_function(&Function {
                name: "cpu-mlp".to_string(),
                dir: tmp.path().join("fn"),
                spec: serde_json::json!({"name": "cpu-mlp"}),
                base_key: "python3||cpu".to_string(),
                snapshot: None,
                state: FunctionState::Ready,
                created: torpord::registry::now_ms(),
                updated: torpord::registry::now_ms(),
            })?;
            s.insert_instance(&Instance {
                id: "cpu-mlp-1".to_string(),
                function: "cpu-mlp".to_string(),
                pid: None,
                stage: Stage::Hibernated,
                snapshot: None,
                started: 0,
                last_used: 0,
            })
        })
        .unwrap();
    let out = torpor(&["ls", "--socket", sock], None);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("NAME     STATE  INSTANCES     UPDATED"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("cpu-mlp  ready  1 hibernated  "),
        "{text}"
    );
    assert!(lines[1].ends_with(" ago"), "{text}");

    let out = torpor(&["ls", "--json", "--socket", sock], None);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["functions"][0]["name"], "cpu-mlp");
    assert_eq!(json["functions"][0]["instances"]["hibernated"], 1);

    // SIGTERM: torpor serve exits 0 and takes its socket with it.
    let pid = i32::try_from(daemon.0.id()).unwrap();
    // SAFETY: kill(2) on the pid of our own child, not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(daemon.0.wait().unwrap().success());
    assert!(!socket.exists());
}

#[test]
fn a_missing_daemon_is_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let socket = tmp.path().join("none.sock");
    for cmd in ["ls", "status"] {
        let out = torpor(&[cmd], Some(&socket));
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            format!(
                "torpor: error: torpord is not running on {}: start it with `torpor serve`\n",
                socket.display()
            )
        );
    }
}

#[test]
fn serve_refuses_tcp_without_a_token() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("torpord.toml");
    std::fs::write(&config, "").unwrap();
    let out = Command::new(TORPOR)
        .args(["serve", "--tcp", "127.0.0.1:0", "--config"])
        .arg(&config)
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--socket")
        .arg(tmp.path().join("s.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "torpor: error: --tcp needs a token: pass --token-file (the admin token) or --tenant-tokens-file\n"
    );
}
