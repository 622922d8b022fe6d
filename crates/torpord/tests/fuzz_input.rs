//! Fuzzing every parser of untrusted bytes in torpord (issue 13 item 5):
//! - `frames`: the worker protocol's codec on any byte stream (a worker is user code);
//! - `worker_frames`: [`FromWorker::parse`] of a frame's payload;
//! - `spec`: [`FunctionSpec::from_json`] (what spec.py prints for a tenant's torpor.toml);
//! - `config`: [`Config::from_toml`] (torpord.toml);
//! - `daemon_api` and `daemon_workers_socket`: a real torpord process, sent mutated HTTP requests
//!   (every route, names with `..`, `/`, NUL; the bodies of deploy, invoke and stop) on its Unix
//!   socket and mutated frames on its workers' socket; it must answer each request with one JSON
//!   error line (never a 5xx), and still answer at the end.
//!
//! Seeds: real inputs in `tests/fuzz-corpus/<target>/`, mutated (fuzz_support). Properties: never
//! panic, never allocate out of proportion to the input, refuse with a typed one-line error,
//! round-trip where there is a writer. Why proptest, the summary lines and a longer campaign:
//! crates/torpor-image/tests/fuzz_support/mod.rs and docs/fuzzing.md.

#[path = "../../torpor-image/tests/fuzz_support/mod.rs"]
mod fuzz_support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use torpord::config::Config;
use torpord::frames::{self, FrameError, MAX_FRAME};
use torpord::protocol::{FromWorker, ToWorker};
use torpord::spec::FunctionSpec;

use fuzz_support::{campaign, check_alloc, corpus, json_value, mutated, one_line, peak_alloc};

#[global_allocator]
static ALLOC: fuzz_support::Counting = fuzz_support::Counting;

fn seeds(target: &str) -> Vec<Vec<u8>> {
    corpus(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fuzz-corpus")
            .join(target),
    )
}

macro_rules! regressions {
    ($name:literal) => {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz-regressions/",
            $name,
            ".txt"
        )
    };
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime")
        .block_on(f)
}

/// A stream of frames: each seed payload framed, then the whole stream mutated (lengths included).
fn frame_stream() -> impl Strategy<Value = Vec<u8>> {
    let framed: Vec<Vec<u8>> = seeds("frames")
        .into_iter()
        .map(|p| {
            let mut f = (p.len() as u32).to_be_bytes().to_vec();
            f.extend_from_slice(&p);
            f
        })
        .collect();
    let mut streams = framed.clone();
    streams.push(framed.concat());
    mutated(streams)
}

#[test]
fn fuzz_frames() {
    campaign(
        "frames",
        3000,
        regressions!("frames"),
        frame_stream(),
        |bytes| {
            let (out, peak) = peak_alloc(|| {
                block_on(async {
                    let mut r = &bytes[..];
                    let mut frames = 0usize;
                    loop {
                        match frames::read(&mut r).await {
                            Ok(Some(_)) => frames += 1,
                            Ok(None) => return Ok(frames),
                            Err(e) => return Err(e),
                        }
                    }
                })
            });
            check_alloc("frames", bytes.len(), peak)?;
            if let Err(e) = out {
                prop_assert!(!matches!(e, FrameError::Io(_)), "{e}");
                one_line(&e)?;
                one_line(&e.what_happened())?;
            }
            Ok(())
        },
    );
}

/// Frame payloads: mutated real frames, and generated objects under a known `type`.
fn payloads() -> impl Strategy<Value = Vec<u8>> {
    let types = prop::sample::select(
        FromWorker::TYPES
            .split(", ")
            .chain(ToWorker::TYPES.split(", "))
            .map(str::to_string)
            .collect::<Vec<_>>(),
    );
    let generated = (
        types,
        prop::collection::btree_map("[a-z_]{1,12}", json_value(), 0..6),
    )
        .prop_map(|(t, mut m)| {
            m.insert("type".into(), serde_json::Value::String(t));
            serde_json::to_vec(&m).expect("JSON")
        });
    prop_oneof![3 => mutated(seeds("frames")), 1 => generated]
}

#[test]
fn fuzz_worker_frames() {
    campaign(
        "worker_frames",
        4000,
        regressions!("worker_frames"),
        payloads(),
        |bytes| {
            let (parsed, peak) = peak_alloc(|| FromWorker::parse(&bytes));
            check_alloc("worker_frames", bytes.len(), peak)?;
            match parsed {
                Err(e) => one_line(&e)?,
                Ok(frame) => {
                    // What parses writes back as a frame that parses to the same bytes.
                    let once = serde_json::to_vec(&frame).expect("a frame serializes");
                    let again = FromWorker::parse(&once)
                        .map_err(|e| TestCaseError::fail(format!("round trip: {e}")))?;
                    prop_assert_eq!(serde_json::to_vec(&again).expect("JSON"), once);
                    frames::encode(&frame).expect("a parsed frame fits a frame");
                }
            }
            if let Err(e) = ToWorker::parse(&bytes) {
                one_line(&e)?;
            }
            Ok(())
        },
    );
}

#[test]
fn fuzz_spec() {
    let generated = prop::collection::btree_map("[a-z_]{1,14}", json_value(), 0..16)
        .prop_map(|m| serde_json::to_vec(&m).expect("JSON"));
    campaign(
        "spec",
        3000,
        regressions!("spec"),
        prop_oneof![4 => mutated(seeds("spec")), 1 => generated],
        |bytes| {
            let Ok(json) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
                return Ok(());
            };
            let (parsed, peak) = peak_alloc(|| FunctionSpec::from_json(&json));
            check_alloc("spec", bytes.len(), peak)?;
            match parsed {
                Err(e) => one_line(&e),
                Ok(spec) => {
                    let back = FunctionSpec::from_json(&serde_json::to_value(&spec).expect("JSON"))
                        .map_err(|e| TestCaseError::fail(format!("round trip: {e}")))?;
                    prop_assert_eq!(
                        serde_json::to_value(&back).expect("JSON"),
                        serde_json::to_value(&spec).expect("JSON")
                    );
                    Ok(())
                }
            }
        },
    );
}

#[test]
fn fuzz_config() {
    campaign(
        "config",
        2000,
        regressions!("config"),
        mutated(seeds("config")),
        |bytes| {
            let Ok(text) = std::str::from_utf8(&bytes) else {
                return Ok(());
            };
            let path = Path::new("/etc/torpor/torpord.toml");
            let (parsed, peak) = peak_alloc(|| Config::from_toml(path, text));
            check_alloc("config", bytes.len(), peak)?;
            match parsed {
                Err(e) => {
                    // toml's own parse errors quote the line with a caret: the message's first
                    // line names the file and the cause.
                    let text = e.to_string();
                    prop_assert!(text.starts_with("/etc/torpor/torpord.toml"), "{text}");
                }
                Ok(c) => {
                    if let Err(e) = c.validate() {
                        one_line(&e)?;
                    }
                }
            }
            Ok(())
        },
    );
}

// ---- a real daemon ---------------------------------------------------------------------------

struct Daemon {
    child: Child,
    _tmp: tempfile::TempDir,
    socket: PathBuf,
    workers: PathBuf,
    stderr: PathBuf,
}

impl Daemon {
    fn start() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        // The stage area off: nothing is deployed, and no tmpfs is left behind.
        let config = tmp.path().join("torpord.toml");
        std::fs::write(
            &config,
            // No worker starts: no cgroup either (crate::cgroup), which a killed daemon would leave.
            "[restore_server]\nstage_bytes = 0\n[http]\nbody_timeout_s = 5\n[workers]\nallow_unconfined = true\n",
        )
        .expect("config");
        let socket = tmp.path().join("torpord.sock");
        let state = tmp.path().join("state");
        let stderr = tmp.path().join("stderr.log");
        let child = Command::new(env!("CARGO_BIN_EXE_torpord"))
            .arg("--config")
            .arg(&config)
            .arg("--state-dir")
            .arg(&state)
            .arg("--socket")
            .arg(&socket)
            .env_remove("TORPOR_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr"))
            .env(torpord::cgroup::FS_ENV, "/nonexistent")
            .spawn()
            .expect("torpord");
        let d = Self {
            child,
            workers: state.join("workers.sock"),
            _tmp: tmp,
            socket,
            stderr,
        };
        let t = Instant::now();
        while d
            .request(b"GET /v1/status HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .is_err()
        {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "torpord did not start: {}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Sends `raw` and reads the answer until the daemon closes.
    fn request(&self, raw: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut s = UnixStream::connect(&self.socket)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.write_all(raw)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        Ok(out)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while self.child.try_wait().ok().flatten().is_none() {
            if t.elapsed() > Duration::from_secs(15) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A function name as it may appear in a path: real ones, traversal, NUL, encoded slashes, junk.
fn path_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("resnet".to_string()),
        Just("..".to_string()),
        Just("..%2F..%2Fetc%2Fpasswd".to_string()),
        Just("%2e%2e".to_string()),
        Just("a%00b".to_string()),
        Just("%00".to_string()),
        Just("a%2Fb".to_string()),
        Just("%ff%fe".to_string()),
        "[a-z0-9._%-]{0,80}",
        Just("x".repeat(5000)),
    ]
}

/// One request: a route, a name in its path, a (mutated) body.
fn api_request() -> impl Strategy<Value = (usize, String, Vec<u8>)> {
    (0usize..15, path_name(), mutated(seeds("bodies")))
}

fn render((route, name, body): &(usize, String, Vec<u8>)) -> Vec<u8> {
    let (method, path) = match route {
        0 => ("POST", "/v1/functions".to_string()),
        1 => ("POST", format!("/v1/functions/{name}/invoke")),
        2 => ("POST", format!("/v1/functions/{name}/stop")),
        3 => ("GET", format!("/v1/functions/{name}")),
        4 => ("DELETE", format!("/v1/functions/{name}")),
        5 => (
            "GET",
            format!("/v1/functions/{name}/logs?instance={name}&lines=5"),
        ),
        6 => ("GET", format!("/v1/functions/{name}/logs?lines={name}")),
        7 => ("POST", format!("/v1/functions/{name}/pull")),
        8 => ("POST", format!("/v1/functions/{name}/push")),
        9 => ("GET", format!("/v1/functions/{name}/placement")),
        10 => ("POST", "/v1/workflows".to_string()),
        11 => ("POST", format!("/v1/workflows/{name}/invoke")),
        12 => ("DELETE", format!("/v1/workflows/{name}")),
        13 => ("POST", format!("/v1/instances/{name}/migrate")),
        _ => ("PUT", format!("/v1/{name}")),
    };
    let mut raw = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    raw
}

#[test]
fn fuzz_daemon_api() {
    let d = Daemon::start();
    campaign(
        "daemon_api",
        400,
        regressions!("daemon_api"),
        api_request(),
        |req| {
            let answer = d
                .request(&render(&req))
                .map_err(|e| TestCaseError::fail(format!("no answer ({e}): {}", d.log())))?;
            let text = String::from_utf8_lossy(&answer);
            let status: u16 = text
                .get(9..12)
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| TestCaseError::fail(format!("not HTTP: {text:?}")))?;
            let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
            // hyper itself refuses a request line it cannot parse (400, no body, no type).
            if status == 400 && !head.to_ascii_lowercase().contains("content-type") {
                return Ok(());
            }
            // A name that could walk a path or is no name is refused as such (routes 1 to 9
            // take a function name; the workflow and instance routes refuse it their own way,
            // checked by the rules below: no 5xx, one JSON error line).
            let (route, name, _) = &req;
            let walks = name.starts_with('.')
                || name.starts_with("%2e")
                || ["%2F", "%2f", "%00", "%ff"]
                    .iter()
                    .any(|t| name.contains(t));
            if (1..=9).contains(route) && walks {
                prop_assert!(
                    status == 400 && body.contains("not a function name"),
                    "{name:?} on route {route}: {text}"
                );
            }
            prop_assert!(status < 500, "{status}: {text}");
            if status >= 400 {
                let v: serde_json::Value = serde_json::from_str(body).map_err(|e| {
                    TestCaseError::fail(format!("{status} not JSON ({e}): {body:?}"))
                })?;
                let msg = v["error"].as_str().unwrap_or_default();
                prop_assert!(!msg.is_empty() && !msg.contains('\n'), "{status}: {body}");
            }
            Ok(())
        },
    );
    assert_still_serving(&d);
}

/// After a campaign: the daemon still answers its API and never panicked.
fn assert_still_serving(d: &Daemon) {
    let status = d
        .request(b"GET /v1/status HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .expect("torpord still answers");
    assert!(status.starts_with(b"HTTP/1.1 200"), "{}", d.log());
    assert!(!d.log().contains("panicked"), "{}", d.log());
}

#[test]
fn fuzz_daemon_workers_socket() {
    let d = Daemon::start();
    campaign(
        "daemon_workers_socket",
        300,
        regressions!("daemon_workers_socket"),
        frame_stream(),
        |bytes| {
            let mut s = UnixStream::connect(&d.workers)
                .map_err(|e| TestCaseError::fail(format!("workers socket ({e}): {}", d.log())))?;
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .expect("timeout");
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            Ok(())
        },
    );
    assert_still_serving(&d);
}

/// The frame codec reads a payload as it arrives: a worker that announces a frame of
/// [`MAX_FRAME`] bytes and sends ten makes it hold ten, not 64 MiB (found by `fuzz_frames`).
#[test]
fn a_frame_header_alone_does_not_allocate_its_length() {
    let mut stream = (MAX_FRAME as u32).to_be_bytes().to_vec();
    stream.extend_from_slice(b"0123456789");
    let (out, peak) = peak_alloc(|| block_on(async { frames::read(&mut &stream[..]).await }));
    assert!(matches!(out, Err(FrameError::Truncated)), "{out:?}");
    assert!(peak < 1 << 20, "{peak} bytes for a 14-byte stream");
}
