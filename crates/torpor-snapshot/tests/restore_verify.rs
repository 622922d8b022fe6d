//! `RestoreOptions::verify` with the real CRIU (as root): `Verify::Hashes` refuses a snapshot
//! with a changed byte, `Verify::SizesOnly` (for a staged copy hashed when it was made) restores
//! it, and still refuses a file of another size.
//!
//! Without root or a CRIU >= 4.1 (`make criu`), the test prints `SKIP <test>: <reason>` and
//! passes.

use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use torpor_snapshot::restore::{restore, RestoreError, RestoreOptions, Verify};
use torpor_snapshot::snapshot::{snapshot, SnapshotOptions};

const PYTHON: &str = "/usr/bin/python3";
const TIMEOUT: Duration = Duration::from_secs(60);

/// Pid 1 of new PID, mount and network namespaces, as `torpor run` makes it (inherited fds
/// closed, stdio on /dev/null, its own session); it sleeps.
const TREE: &str = r#"
import os, time
os.closerange(3, 65536)
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
os.setsid()
while True:
    time.sleep(0.05)
"#;

fn skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP {test}: CRIU needs root; run the tests as root");
        return true;
    }
    if !Path::new(PYTHON).exists() {
        eprintln!("SKIP {test}: the test tree needs {PYTHON}");
        return true;
    }
    if let Err(e) = torpor_criu::locate() {
        eprintln!("SKIP {test}: {e}");
        return true;
    }
    false
}

fn kill(pid: i32) {
    // SAFETY: kill(2) only sends a signal to a tree this test started or restored.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

#[test]
fn hashes_refuse_a_changed_byte_and_sizes_only_restores_it() {
    if skip("hashes_refuse_a_changed_byte_and_sizes_only_restores_it") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut unshare = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            "--net",
            PYTHON,
            "-c",
            TREE,
        ])
        .stdin(Stdio::null())
        .spawn()
        .expect("unshare runs");
    let parent = unshare.id() as i32;
    let start = Instant::now();
    let pid: i32 = loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        if let Some(p) = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
        {
            break p;
        }
        assert!(start.elapsed() < TIMEOUT, "the tree's pid 1 did not start");
        sleep(Duration::from_millis(10));
    };
    // Past the setup (setsid), so the tree is dumpable as a whole.
    sleep(Duration::from_millis(300));
    let snap = dir.path().join("snap");
    snapshot(&SnapshotOptions {
        pid,
        out: &snap,
        leave_running: false,
        lock_timeout: Duration::from_secs(10),
        log_dir: dir.path(),
    })
    .expect("snapshot");
    let _ = unshare.wait();

    // A changed byte in a file CRIU does not read at restore (its dump log): only a hash sees it.
    let log = snap.join("dump.log");
    let mut bytes = std::fs::read(&log).expect("the snapshot keeps CRIU's dump log");
    bytes[0] ^= 0xff;
    std::fs::write(&log, &bytes).expect("write");
    let opts = |verify| RestoreOptions {
        dir: &snap,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio: None,
        verify,
        resume_gpu: true,
    };
    let err = restore(&opts(Verify::Hashes)).err().expect("refused");
    assert!(matches!(err, RestoreError::Image(_)), "{err}");
    assert!(err.to_string().contains("hash mismatch"), "{err}");
    assert_eq!(Verify::default(), Verify::Hashes);

    let restored = restore(&opts(Verify::SizesOnly)).expect("restored with sizes checked only");
    let verify = restored
        .phases
        .0
        .iter()
        .find(|(name, _)| name == "verify")
        .map(|(_, s)| *s);
    assert!(verify.is_some(), "{:?}", restored.phases.0);
    kill(restored.pid);

    // Sizes are still checked.
    bytes.push(b'\n');
    std::fs::write(&log, &bytes).expect("write");
    let err = restore(&opts(Verify::SizesOnly)).err().expect("refused");
    assert!(err.to_string().contains("size"), "{err}");
}
