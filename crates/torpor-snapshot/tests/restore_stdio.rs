//! `RestoreOptions::stdio` with the real CRIU (as root): a restored tree writes its stdout and
//! stderr to the new file, from every process that had them, and never to the old one.
//!
//! Without root or a CRIU >= 4.1 (`make criu`), each test prints `SKIP <test>: <reason>` and
//! passes.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use torpor_snapshot::restore::{restore, RestoreError, RestoreOptions, Verify};
use torpor_snapshot::snapshot::{snapshot, SnapshotOptions};

const PYTHON: &str = "/usr/bin/python3";
const TIMEOUT: Duration = Duration::from_secs(60);

/// Pid 1 of new PID, mount and network namespaces, as `torpor run` makes it: inherited fds
/// closed, stdin /dev/null, stdout and stderr appended to argv[1] (or /dev/null), its own
/// session. It forks a child; the parent prints "parent N" on stdout, the child "child N" on
/// stderr, so both processes and both descriptors hold the log.
const TREE: &str = r#"
import os, sys, time
os.closerange(3, 65536)
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
os.dup2(out, 1)
os.dup2(out, 2)
os.close(out)
os.close(null)
os.setsid()
name, stream = ("child", sys.stderr) if os.fork() == 0 else ("parent", sys.stdout)
n = 0
while True:
    n += 1
    stream.write("%s %d\n" % (name, n))
    stream.flush()
    time.sleep(0.02)
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

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        sleep(Duration::from_millis(10));
    }
}

/// The tree's `unshare` (our child) and the host pid of its pid 1.
fn launch(log: &Path) -> (Child, i32) {
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
        .arg(log)
        .stdin(Stdio::null())
        .spawn()
        .expect("unshare runs");
    let parent = unshare.id() as i32;
    let mut pid = None;
    wait_for("the tree's pid 1 and its child", || {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        pid = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok());
        pid.is_some_and(|p: i32| {
            !std::fs::read_to_string(format!("/proc/{p}/task/{p}/children"))
                .unwrap_or_default()
                .trim()
                .is_empty()
        })
    });
    if let Some(status) = unshare.try_wait().expect("try_wait") {
        panic!("unshare exited at once: {status}");
    }
    (unshare, pid.expect("pid"))
}

fn kill(pid: i32) {
    // SAFETY: kill(2) only sends a signal to a tree this test started or restored.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn a_restored_tree_writes_to_the_new_file_and_not_the_old_one() {
    if skip("a_restored_tree_writes_to_the_new_file_and_not_the_old_one") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let old = dir.path().join("old.log");
    let (mut unshare, pid) = launch(&old);
    wait_for("both processes to write the old log", || {
        let t = read(&old);
        t.contains("parent 2") && t.contains("child 2")
    });
    let snap = dir.path().join("snap");
    snapshot(&SnapshotOptions {
        pid,
        out: &snap,
        leave_running: false,
        lock_timeout: Duration::from_secs(10),
        log_dir: dir.path(),
        key: None,
        state_dir: None,
        pre_dump_rounds: 0,
        durability: torpor_image::Durability::Synced,
        gpu_released: None,
    })
    .expect("snapshot");
    let _ = unshare.wait();

    let manifest = torpor_image::Snapshot::open(&snap)
        .expect("open")
        .into_manifest();
    let old_path = old.to_str().expect("utf-8");
    assert_eq!(
        manifest.stdio_files,
        vec![torpor_image::StdioFile {
            path: old_path.to_string(),
            key: old_path.trim_start_matches('/').to_string(),
        }]
    );

    // A path below a regular file cannot be created: one line naming it, nothing restored.
    let file = dir.path().join("file");
    std::fs::write(&file, "").expect("write");
    let bad = file.join("x.log");
    let err = restore(&RestoreOptions {
        dir: &snap,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio: Some(&bad),
        verify: Verify::default(),
        trust: torpor_image::Trust::Unkeyed,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    })
    .err()
    .expect("refused");
    let msg = err.to_string();
    assert!(matches!(err, RestoreError::StdioOpen { .. }), "{msg}");
    assert!(
        msg.contains(bad.to_str().expect("utf-8")) && msg.contains("--log"),
        "{msg}"
    );
    assert_eq!(msg.lines().count(), 1, "{msg}");

    let before = read(&old);
    // The restore never needs the old file: CRIU is handed the new one instead of reopening it.
    std::fs::remove_file(&old).expect("remove the old log");
    let new = dir.path().join("logs/new.log");
    let restored = restore(&RestoreOptions {
        dir: &snap,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio: Some(&new),
        verify: Verify::default(),
        trust: torpor_image::Trust::Unkeyed,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    })
    .expect("restore");
    // Both processes write on, each through its own descriptor, to the new file only.
    let (last_parent, last_child) = (
        before.lines().filter(|l| l.starts_with("parent")).count(),
        before.lines().filter(|l| l.starts_with("child")).count(),
    );
    wait_for("both restored processes to write the new log", || {
        let t = read(&new);
        t.contains(&format!("parent {}\n", last_parent + 2))
            && t.contains(&format!("child {}\n", last_child + 2))
    });
    let fd1 = std::fs::read_link(format!("/proc/{}/fd/1", restored.pid)).expect("fd 1");
    assert_eq!(fd1, new);

    // The new file was opened outside the tree's mount namespace: a snapshot of the restored
    // tree records it as an external file, and its restores hand a file in again.
    let snap2 = dir.path().join("snap2");
    snapshot(&SnapshotOptions {
        pid: restored.pid,
        out: &snap2,
        leave_running: false,
        lock_timeout: Duration::from_secs(10),
        log_dir: dir.path(),
        key: None,
        state_dir: None,
        pre_dump_rounds: 0,
        durability: torpor_image::Durability::Synced,
        gpu_released: None,
    })
    .expect("snapshot of the restored tree");
    let stdio2 = torpor_image::Snapshot::open(&snap2)
        .expect("open")
        .into_manifest()
        .stdio_files;
    assert_eq!(stdio2.len(), 1, "{stdio2:?}");
    assert!(stdio2[0].is_external(), "{stdio2:?}");
    assert_eq!(Path::new(&stdio2[0].path), new);
    let newer = dir.path().join("newer.log");
    let again = restore(&RestoreOptions {
        dir: &snap2,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio: Some(&newer),
        verify: Verify::default(),
        trust: torpor_image::Trust::Unkeyed,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    })
    .expect("restore of the second snapshot");
    wait_for("the twice-restored tree to write the newer log", || {
        let t = read(&newer);
        t.contains("parent") && t.contains("child")
    });
    kill(again.pid);
    // Without a new file, the recorded one is handed in: the copy appends where it wrote.
    let size = std::fs::metadata(&new).expect("new log").len();
    let same = restore(&RestoreOptions {
        dir: &snap2,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio: None,
        verify: Verify::default(),
        trust: torpor_image::Trust::Unkeyed,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    })
    .expect("restore onto the recorded file");
    wait_for("the copy to append to the recorded log", || {
        std::fs::metadata(&new).is_ok_and(|m| m.len() > size)
    });
    kill(same.pid);
    assert!(!old.exists(), "the restored tree recreated the old log");
    // The new file holds nothing of what was surely written before the snapshot: lines 1 and 2
    // of each process, which the snapshot waited for. (Not "nothing before the old file's last
    // line": a snapshot dumps with the tree left running and kills it only once the image is
    // written and verified, so the source goes on writing lines the restored copy writes again;
    // seen in CI under load.)
    let text = read(&new);
    let numbers = |who: &str| -> Vec<usize> {
        text.lines()
            .filter_map(|l| l.strip_prefix(who)?.trim().parse().ok())
            .collect()
    };
    let (parents, children) = (numbers("parent"), numbers("child"));
    assert!(
        !parents.is_empty() && !children.is_empty(),
        "new log {text:?}"
    );
    assert!(
        parents.iter().chain(&children).all(|&n| n > 2),
        "new log {text:?} after {before:?}"
    );
}

#[test]
fn log_is_refused_for_a_snapshot_without_stdio_files() {
    if skip("log_is_refused_for_a_snapshot_without_stdio_files") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let devnull = Path::new("/dev/null");
    let (mut unshare, pid) = launch(devnull);
    let snap = dir.path().join("snap");
    snapshot(&SnapshotOptions {
        pid,
        out: &snap,
        leave_running: false,
        lock_timeout: Duration::from_secs(10),
        log_dir: dir.path(),
        key: None,
        state_dir: None,
        pre_dump_rounds: 0,
        durability: torpor_image::Durability::Synced,
        gpu_released: None,
    })
    .expect("snapshot");
    let _ = unshare.wait();
    // Stdio on /dev/null: nothing to redirect, so --log cannot be honoured.
    let new = dir.path().join("new.log");
    let opts = |stdio| RestoreOptions {
        dir: &snap,
        detach: true,
        gpu_map: &[],
        log_dir: dir.path(),
        stdio,
        verify: Verify::default(),
        trust: torpor_image::Trust::Unkeyed,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    };
    let err = restore(&opts(Some(&new))).err().expect("refused");
    assert!(matches!(err, RestoreError::StdioUnknown), "{err}");
    assert!(err.to_string().contains("restore without --log"), "{err}");
    assert!(!new.exists());
}
