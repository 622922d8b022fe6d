//! Dump and restore real processes with the real CRIU (as root).
//!
//! Needs a CRIU >= 4.1: `make criu` (scripts/provision-criu.sh) or `TORPOR_CRIU=/path/to/criu`.
//! Without one, or without root, each test prints `SKIP <test>: <reason>` and passes.
//!
//! The worker (tests/fixtures/worker.py) is launched the way Torpor launches instances: new PID,
//! mount and network namespaces with /proc remounted, inherited descriptors closed, its own
//! session. It is dumped with an empty network namespace and no network lock, and restored with
//! root "/" — the options that let several restores of one snapshot run side by side.

use std::fs::File;
use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use torpor_criu::{
    locate, Action, Criu, CriuError, DumpRequest, RestoreRequest, Version, SETUP_NAMESPACES,
};

const PYTHON: &str = "/usr/bin/python3";
const TIMEOUT: Duration = Duration::from_secs(15);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The CRIU to test with, or `None` after printing why the test is skipped.
fn criu_or_skip(test: &str) -> Option<Criu> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP {test}: CRIU needs root; run the tests as root");
        return None;
    }
    if !Path::new(PYTHON).exists() {
        eprintln!("SKIP {test}: the test worker needs {PYTHON}");
        return None;
    }
    match locate() {
        Ok(criu) => Some(criu),
        Err(e @ CriuError::NotFound { .. }) => {
            eprintln!("SKIP {test}: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        sleep(Duration::from_millis(10));
    }
}

/// A worker in its own PID, mount and network namespaces.
struct Worker {
    /// `unshare`, our child; it waits for the worker.
    unshare: Child,
    /// The worker's host pid (pid 1 in its namespace).
    pid: i32,
    secret: String,
}

impl Worker {
    fn launch(dir: &Path, extra: &[&str]) -> Worker {
        let mut cmd = Command::new("unshare");
        cmd.args(["--pid", "--fork", "--mount-proc", "--net", PYTHON])
            .arg(fixture("launch.py"))
            .arg(dir.join("worker.log"))
            .arg(PYTHON)
            .arg(fixture("worker.py"))
            .arg(dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let unshare = cmd.spawn().expect("unshare starts");
        let ready = dir.join("ready");
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        wait_for("the worker to be ready", || ready.exists());
        let pid = std::fs::read_to_string(&children)
            .expect("unshare's children are readable")
            .split_whitespace()
            .next()
            .expect("unshare has a child")
            .parse()
            .expect("a pid");
        let secret = std::fs::read_to_string(&ready).expect("ready is readable");
        Worker {
            unshare,
            pid,
            secret,
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: kill has no memory effects; the worker may already be gone.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let _ = self.unshare.wait();
    }
}

/// A restored tree, killed when dropped (and reaped when it is our child: rst_sibling).
struct Restored {
    pid: i32,
    our_child: bool,
}

impl Drop for Restored {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid have no memory effects beyond the status integer.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            if self.our_child {
                let mut status = 0;
                libc::waitpid(self.pid, &mut status, 0);
            }
        }
    }
}

fn netns_inode(pid: i32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .expect("the process has a network namespace")
        .ino()
}

/// Asks the instance with host pid `pid` for "<secret> <counter>" through the request files.
fn ping(dir: &Path, pid: i32, n: u32) -> (String, u32) {
    let name = format!("{}-{n}", netns_inode(pid));
    let tmp = dir.join(format!("tmp-{name}"));
    std::fs::write(&tmp, b"").expect("request written");
    std::fs::rename(&tmp, dir.join(format!("req-{name}"))).expect("request published");
    let resp = dir.join(format!("resp-{name}"));
    wait_for("the worker's answer", || resp.exists());
    parse_answer(&std::fs::read_to_string(&resp).expect("answer readable"))
}

fn parse_answer(text: &str) -> (String, u32) {
    let (secret, counter) = text.trim().split_once(' ').expect("'<secret> <counter>'");
    (secret.to_string(), counter.parse().expect("a counter"))
}

fn nspid(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status readable")
        .lines()
        .find(|l| l.starts_with("NSpid:"))
        .expect("NSpid line")
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .join(" ")
}

fn dump_request(pid: i32, images: &Path) -> DumpRequest<'_> {
    DumpRequest {
        empty_ns_net: true,
        network_lock_skip: true,
        ..DumpRequest::new(pid, images)
    }
}

fn restore_request<'a>(images: &'a Path, log: &'a str) -> RestoreRequest<'a> {
    RestoreRequest {
        log_file: log,
        root: Some(Path::new("/")),
        empty_ns_net: true,
        network_lock_skip: true,
        ..RestoreRequest::new(images)
    }
}

fn images_dir(dir: &Path) -> PathBuf {
    let images = dir.join("images");
    std::fs::create_dir(&images).expect("images dir created");
    images
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

fn explain(e: &CriuError) -> String {
    match e.log() {
        Some(log) => format!("{e}\n--- {}:\n{}", log.display(), log_tail(log)),
        None => e.to_string(),
    }
}

#[test]
fn check_says_looks_good() {
    let Some(criu) = criu_or_skip("check_says_looks_good") else {
        return;
    };
    criu.check().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn dump_then_restore_twice_side_by_side() {
    let Some(criu) = criu_or_skip("dump_then_restore_twice_side_by_side") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let mut worker = Worker::launch(dir, &[]);
    assert_eq!(ping(dir, worker.pid, 1), (worker.secret.clone(), 1));

    criu.dump(&dump_request(worker.pid, &images))
        .unwrap_or_else(|e| panic!("{}", explain(&e)));
    // Not leave_running: CRIU killed the worker, so unshare exits.
    worker.unshare.wait().expect("unshare exits after the dump");

    let mut setup_ns_pids = Vec::new();
    let first = criu
        .restore_with(
            &RestoreRequest {
                rst_sibling: true,
                ..restore_request(&images, "restore-1.log")
            },
            &mut |n| {
                if n.script == SETUP_NAMESPACES {
                    setup_ns_pids.push(n.pid);
                }
                Ok(())
            },
        )
        .unwrap_or_else(|e| panic!("{}", explain(&e)));
    let first = Restored {
        pid: first,
        our_child: true,
    };
    let second = criu
        .restore(&restore_request(&images, "restore-2.log"))
        .unwrap_or_else(|e| panic!("{}", explain(&e)));
    let second = Restored {
        pid: second,
        our_child: false,
    };

    assert_eq!(setup_ns_pids, vec![Some(first.pid)]);
    assert_ne!(first.pid, second.pid);
    // Each is pid 1 of its own PID namespace, with its own network namespace.
    assert_eq!(nspid(first.pid), format!("{} 1", first.pid));
    assert_eq!(nspid(second.pid), format!("{} 1", second.pid));
    assert_ne!(netns_inode(first.pid), netns_inode(second.pid));
    // Both carry the dumped memory: the same secret, the counter going on from 1.
    assert_eq!(ping(dir, first.pid, 2), (worker.secret.clone(), 2));
    assert_eq!(ping(dir, second.pid, 2), (worker.secret.clone(), 2));
    assert_eq!(ping(dir, first.pid, 3), (worker.secret.clone(), 3));
}

#[test]
fn a_dump_and_a_restore_with_a_private_run_skip_crius_kernel_probes_and_write_nothing_in_the_hosts()
{
    let test =
        "a_dump_and_a_restore_with_a_private_run_skip_crius_kernel_probes_and_write_nothing_in_the_hosts";
    let Some(criu) = criu_or_skip(test) else {
        return;
    };
    let host_cache = Path::new("/run/criu.kdat");
    let host_had_one = host_cache.exists();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let mut worker = Worker::launch(dir, &[]);
    assert_eq!(ping(dir, worker.pid, 1), (worker.secret.clone(), 1));
    criu.prepare_kernel_cache()
        .unwrap_or_else(|e| panic!("{e}"));
    // A root tree: its dump gets the private /run only when asked (DumpRequest::private_run).
    criu.dump(&DumpRequest {
        private_run: true,
        log_level: 4,
        log_file: "dump-private-run.log",
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));
    worker.unshare.wait().expect("unshare exits after the dump");
    let dump_log = std::fs::read_to_string(images.join("dump-private-run.log")).expect("log");
    assert!(
        dump_log.contains("Loaded kdat cache from /run/criu.kdat"),
        "CRIU probed the kernel in the dump:\n{}",
        log_tail(&images.join("dump-private-run.log"))
    );
    // One restore at log level 4, detached, and its log.
    let restore = |private_run: bool, log: &str| {
        let pid = criu
            .restore(&RestoreRequest {
                private_run,
                log_level: 4,
                ..restore_request(&images, log)
            })
            .unwrap_or_else(|e| panic!("{}", explain(&e)));
        let text = std::fs::read_to_string(images.join(log)).expect("log");
        let restored = Restored {
            pid,
            our_child: false,
        };
        (restored, text)
    };
    let (restored, log) = restore(true, "restore-private-run.log");
    assert!(
        log.contains("Loaded kdat cache from /run/criu.kdat"),
        "CRIU probed the kernel again:\n{}",
        log_tail(&images.join("restore-private-run.log"))
    );
    assert_eq!(ping(dir, restored.pid, 2), (worker.secret.clone(), 2));
    // The cache lived in CRIU's own /run: the host's got no file.
    assert_eq!(host_cache.exists(), host_had_one);
    if !host_had_one {
        // Without private_run CRIU sees the host's /run, which holds no cache here.
        drop(restored);
        let (_plain, log) = restore(false, "restore-plain.log");
        assert!(
            !log.contains("Loaded kdat cache"),
            "{}",
            log_tail(&images.join("restore-plain.log"))
        );
    }
}

#[test]
fn failed_dump_reports_errno_and_log_and_leaves_the_process_running() {
    let test = "failed_dump_reports_errno_and_log_and_leaves_the_process_running";
    let Some(criu) = criu_or_skip(test) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    // A Unix socket connected to a peer outside the dumped tree: CRIU refuses it without
    // ext_unix_sk.
    let ext = dir.join("ext.sock");
    let listener = UnixListener::bind(&ext).expect("listener");
    let ext_arg = ext.to_str().expect("utf-8 temp path");
    let worker = Worker::launch(dir, &["--connect", ext_arg]);
    let (_peer, _) = listener.accept().expect("the worker connects");
    assert_eq!(ping(dir, worker.pid, 1), (worker.secret.clone(), 1));

    let err = criu
        .dump(&dump_request(worker.pid, &images))
        .expect_err("CRIU must refuse the external Unix socket");
    let log = images.join("dump.log");
    match &err {
        CriuError::Failed {
            action: Action::Dump,
            log: l,
            ..
        } => assert_eq!(l, &log),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(
        err.to_string().contains(&log.display().to_string()),
        "{err}"
    );
    let errors = err.log_errors(10);
    assert!(
        errors.iter().any(|l| l.contains("unix")),
        "CRIU's log names the Unix socket: {errors:?}\n{}",
        log_tail(&log)
    );
    eprintln!("failed dump: {err}\n  log errors: {errors:#?}");

    // Still running and answering, memory intact.
    assert_eq!(ping(dir, worker.pid, 2), (worker.secret.clone(), 2));
}

#[test]
fn dump_of_a_missing_process_fails_with_log() {
    let Some(criu) = criu_or_skip("dump_of_a_missing_process_fails_with_log") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(tmp.path());
    let mut gone = Command::new("true").spawn().expect("true runs");
    let pid = gone.id() as i32;
    gone.wait().expect("true exits");
    let err = criu
        .dump(&DumpRequest::new(pid, &images))
        .expect_err("there is nothing to dump");
    assert!(
        matches!(
            err,
            CriuError::Failed {
                action: Action::Dump,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(images.join("dump.log").exists());
    eprintln!("missing pid: {err}");
}

/// Reads one line from 127.0.0.1:`port` inside the network namespace of `pid`.
fn tcp_ping_in_netns(pid: i32, port: u16) -> io::Result<(String, u32)> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::spawn(move || {
        // SAFETY: setns changes only this short-lived thread's network namespace.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut line = String::new();
        stream.read_to_string(&mut line)?;
        Ok(parse_answer(&line))
    })
    .join()
    .expect("the helper thread does not panic")
}

fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor)
}

#[test]
fn tcp_listener_restores_and_is_reachable_once_loopback_is_up() {
    let test = "tcp_listener_restores_and_is_reachable_once_loopback_is_up";
    let Some(criu) = criu_or_skip(test) else {
        return;
    };
    if criu.version() < Version::new(4, 2, 0) && kernel_version() >= (6, 16) {
        eprintln!(
            "SKIP {test}: CRIU {} cannot dump INET sockets on Linux >= 6.16 (fixed in CRIU 4.2); \
             provision one with TORPOR_CRIU_SUITE=sid scripts/provision-criu.sh --force",
            criu.version()
        );
        return;
    }
    const PORT: u16 = 7777;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let worker = Worker::launch(dir, &["--tcp", &PORT.to_string()]);
    let secret = worker.secret.clone();
    assert_eq!(
        tcp_ping_in_netns(worker.pid, PORT).expect("the worker answers"),
        (secret.clone(), 1)
    );
    criu.dump(&DumpRequest {
        leave_running: true,
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));
    // leave_running: the original goes on.
    assert_eq!(
        tcp_ping_in_netns(worker.pid, PORT).expect("the original still answers"),
        (secret.clone(), 2)
    );

    // Without loopback_up the listener is restored but lo is down: unreachable.
    let plain = Restored {
        pid: criu
            .restore(&RestoreRequest {
                rst_sibling: true,
                ..restore_request(&images, "restore-plain.log")
            })
            .unwrap_or_else(|e| panic!("{}", explain(&e))),
        our_child: true,
    };
    let err = tcp_ping_in_netns(plain.pid, PORT).expect_err("lo is down after restore");
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");

    // With loopback_up, lo comes up in setup-namespaces and the restored listener answers.
    let up = Restored {
        pid: criu
            .restore(&RestoreRequest {
                rst_sibling: true,
                loopback_up: true,
                ..restore_request(&images, "restore-up.log")
            })
            .unwrap_or_else(|e| panic!("{}", explain(&e))),
        our_child: true,
    };
    assert_eq!(
        tcp_ping_in_netns(up.pid, PORT).expect("the restored listener answers"),
        (secret.clone(), 2)
    );
    // Bringing lo up later works too (set_loopback_up is what loopback_up calls).
    torpor_criu::set_loopback_up(plain.pid).expect("lo comes up");
    assert_eq!(
        tcp_ping_in_netns(plain.pid, PORT).expect("now reachable"),
        (secret, 2)
    );
}

#[test]
fn a_refused_notification_aborts_the_restore() {
    let Some(criu) = criu_or_skip("a_refused_notification_aborts_the_restore") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let worker = Worker::launch(dir, &[]);
    criu.dump(&DumpRequest {
        leave_running: true,
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));
    let mut restored_pid = None;
    let err = criu
        .restore_with(
            &RestoreRequest {
                rst_sibling: true,
                ..restore_request(&images, "restore-refused.log")
            },
            &mut |n| {
                if n.script == SETUP_NAMESPACES {
                    restored_pid = n.pid;
                    return Err("refused by the test".to_string());
                }
                Ok(())
            },
        )
        .expect_err("the handler refused");
    match &err {
        CriuError::NotifyFailed {
            action: Action::Restore,
            script,
            message,
            ..
        } => {
            assert_eq!(script, SETUP_NAMESPACES);
            assert_eq!(message, "refused by the test");
        }
        other => panic!("expected NotifyFailed, got {other:?}"),
    }
    // CRIU killed what it had started, and restore_with reaped it (our child via rst_sibling).
    let pid = restored_pid.expect("setup-namespaces carried the pid");
    // SAFETY: signal 0 only checks for existence; waitpid writes only the status integer.
    let (alive, waited) = unsafe {
        (
            libc::kill(pid, 0),
            libc::waitpid(pid, &mut 0, libc::WNOHANG),
        )
    };
    assert_eq!(alive, -1, "the refused restore's root is gone");
    assert_eq!(waited, -1, "and reaped already (no zombie)");
    // The original is untouched.
    assert_eq!(ping(dir, worker.pid, 1), (worker.secret.clone(), 1));
}

#[test]
fn external_mounts_are_wired_through() {
    let Some(criu) = criu_or_skip("external_mounts_are_wired_through") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let worker = Worker::launch(dir, &[]);
    // The worker's /proc, declared external at dump, must be mapped back at restore.
    criu.dump(&DumpRequest {
        leave_running: true,
        external: vec!["mnt[/proc]:proc".to_string()],
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));
    let err = criu
        .restore(&RestoreRequest {
            rst_sibling: true,
            ..restore_request(&images, "restore-unmapped.log")
        })
        .expect_err("an unmapped external mount cannot be restored");
    let errors = err.log_errors(10);
    assert!(
        errors.iter().any(|l| l.contains("No mapping")),
        "{err}: {errors:?}"
    );
    let restored = Restored {
        pid: criu
            .restore(&RestoreRequest {
                rst_sibling: true,
                external: vec!["mnt[proc]:/proc".to_string()],
                ..restore_request(&images, "restore-mapped.log")
            })
            .unwrap_or_else(|e| panic!("{}", explain(&e))),
        our_child: true,
    };
    assert_eq!(nspid(restored.pid), format!("{} 1", restored.pid));
}

fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("readable")
        .map(|e| {
            let e = e.expect("entry");
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).expect("readable file"))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn restore_with_a_work_dir_leaves_the_images_untouched() {
    let Some(criu) = criu_or_skip("restore_with_a_work_dir_leaves_the_images_untouched") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let work = dir.join("work");
    std::fs::create_dir(&work).expect("work dir");
    let worker = Worker::launch(dir, &[]);
    criu.dump(&DumpRequest {
        leave_running: true,
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));
    let before = listing(&images);
    let restored = Restored {
        pid: criu
            .restore(&RestoreRequest {
                rst_sibling: true,
                work_dir: Some(&work),
                ..restore_request(&images, "restore.log")
            })
            .unwrap_or_else(|e| panic!("{}", explain(&e))),
        our_child: true,
    };
    assert_eq!(ping(dir, restored.pid, 1), (worker.secret.clone(), 1));
    let after = listing(&images);
    let names = |l: &[(String, Vec<u8>)]| l.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&after),
        names(&before),
        "files appeared in the images dir"
    );
    assert!(after == before, "image contents changed");
    let mut in_work = names(&listing(&work));
    in_work.sort();
    eprintln!("work dir after restore: {in_work:?}");
    assert!(in_work.contains(&"restore.log".to_string()));
}

#[test]
fn the_images_name_the_file_pages_a_restore_reads() {
    let Some(criu) = criu_or_skip("the_images_name_the_file_pages_a_restore_reads") else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let images = images_dir(dir);
    let worker = Worker::launch(dir, &[]);
    criu.dump(&DumpRequest {
        leave_running: true,
        ..dump_request(worker.pid, &images)
    })
    .unwrap_or_else(|e| panic!("{}", explain(&e)));

    let files = torpor_criu::images::private_file_pages(&images).expect("images read");
    // Every dynamically linked process has written pages of libc (its relocated data), which
    // CRIU saves and writes back over the file's.
    let libc = files
        .iter()
        .find(|f| f.path.contains("libc.so"))
        .unwrap_or_else(|| {
            panic!(
                "libc among {:?}",
                files.iter().map(|f| &f.path).collect::<Vec<_>>()
            )
        });
    assert!(!libc.ranges.is_empty());
    for f in &files {
        eprintln!("{}: {:?}", f.path, f.ranges);
        let size = std::fs::metadata(&f.path)
            .unwrap_or_else(|e| panic!("{}: {e}", f.path))
            .len();
        assert!(f.path.starts_with('/'), "{}", f.path);
        for pair in f.ranges.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 < pair[1].0,
                "{}: {:?}",
                f.path,
                f.ranges
            );
        }
        for &(offset, len) in &f.ranges {
            assert!(len > 0 && len % 4096 == 0, "{}: {:?}", f.path, f.ranges);
            // A mapping may reach past the end of its file (its last page); never by a page.
            assert!(offset < size, "{}: {offset:#x} past {size}", f.path);
        }
    }
}
