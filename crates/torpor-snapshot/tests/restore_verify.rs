//! `RestoreOptions::verify` with the real CRIU (as root): `Verify::Hashes` refuses a snapshot
//! with a changed byte, `Verify::SizesOnly` (for a staged copy hashed when it was made) restores
//! it, and still refuses a file of another size. `RestoreOptions::trust`: a sealed snapshot
//! restores under its key; one rewritten by another writer (page changed and its hash
//! recomputed, or a field no hash covers changed), one without a MAC and one sealed by another
//! key are refused before CRIU runs.
//!
//! Without root or a CRIU >= 4.1 (`make criu`), the test prints `SKIP <test>: <reason>` and
//! passes.

use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use torpor_image::{ImageError, Snapshot, SnapshotKey, Trust, MAC_FILE, MANIFEST_FILE};
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

/// Starts the sleeping tree and snapshots it (kill mode) into `dir/snap`, sealed with `key`.
fn snapshot_tree(dir: &Path, key: Option<&SnapshotKey>) -> std::path::PathBuf {
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
    let snap = dir.join("snap");
    snapshot(&SnapshotOptions {
        pid,
        out: &snap,
        leave_running: false,
        lock_timeout: Duration::from_secs(10),
        log_dir: dir,
        key,
        state_dir: None,
        pre_dump_rounds: 0,
        durability: torpor_image::Durability::Synced,
        gpu_released: None,
    })
    .expect("snapshot");
    let _ = unshare.wait();
    snap
}

/// A detached restore of `snap` with its log in `log_dir`, checked as `verify` and `trust` say.
fn detached<'a>(
    snap: &'a Path,
    log_dir: &'a Path,
    verify: Verify,
    trust: Trust<'a>,
) -> RestoreOptions<'a> {
    RestoreOptions {
        dir: snap,
        detach: true,
        gpu_map: &[],
        log_dir,
        stdio: None,
        verify,
        trust,
        resume_gpu: true,
        cgroup: &[],
        external_sources: &[],
        gpu_restore_slots: None,
        gpu_lane: 0,
        gpu_alone: false,
    }
}

#[test]
fn hashes_refuse_a_changed_byte_and_sizes_only_restores_it() {
    if skip("hashes_refuse_a_changed_byte_and_sizes_only_restores_it") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let snap = snapshot_tree(dir.path(), None);

    // A changed byte in a file CRIU does not read at restore (its dump log): only a hash sees it.
    let log = snap.join("dump.log");
    let mut bytes = std::fs::read(&log).expect("the snapshot keeps CRIU's dump log");
    bytes[0] ^= 0xff;
    std::fs::write(&log, &bytes).expect("write");
    let opts = |verify| detached(&snap, dir.path(), verify, Trust::Unkeyed);
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

/// An edit of a manifest (as JSON), and what it changes.
type Edit = (&'static str, fn(&mut serde_json::Value));

/// Edits `snap`'s manifest as a writer without the key would: as JSON, written back whole.
fn rewrite_manifest(snap: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = snap.join(MANIFEST_FILE);
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    edit(&mut doc);
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).expect("encode")).expect("write");
}

#[test]
fn only_the_key_holders_unchanged_snapshot_restores() {
    if skip("only_the_key_holders_unchanged_snapshot_restores") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let key = SnapshotKey::load_or_create(&dir.path().join("snapshot.key")).expect("key");
    let snap = snapshot_tree(dir.path(), Some(&key));
    assert!(
        snap.join(MAC_FILE).is_file(),
        "a sealed snapshot has {MAC_FILE}"
    );
    let pristine = dir.path().join("pristine");
    let copy = |from: &Path, to: &Path| {
        let _ = std::fs::remove_dir_all(to);
        let status = Command::new("cp").arg("-a").arg(from).arg(to).status();
        assert!(status.expect("cp").success());
    };
    copy(&snap, &pristine);
    let opts = |verify, trust| detached(&snap, dir.path(), verify, trust);
    let restored = restore(&opts(Verify::Hashes, Trust::Key(&key))).expect("sealed, restores");
    kill(restored.pid);

    // The attack: a page file rewritten (same size) and its hash recomputed in the manifest.
    // The hashes agree, so only the MAC can tell, and it refuses under either verify mode.
    let pages = std::fs::read_dir(&snap)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("pages-"))
        })
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("a pages file");
    let mut bytes = std::fs::read(&pages).expect("read");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&pages, &bytes).expect("write");
    let name = pages
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let hash = blake3::hash(&bytes).to_hex().to_string();
    rewrite_manifest(&snap, |doc| {
        for file in doc["files"].as_array_mut().expect("files") {
            if file["path"] == name.as_str() {
                file["blake3"] = hash.clone().into();
            }
        }
    });
    Snapshot::open(&snap)
        .expect("open")
        .verify()
        .expect("the recomputed hashes agree: integrity alone cannot see the forgery");
    for verify in [Verify::Hashes, Verify::SizesOnly] {
        let err = restore(&opts(verify, Trust::Key(&key)))
            .err()
            .expect("refused");
        assert!(
            matches!(err, RestoreError::Image(ImageError::SealMismatch { .. })),
            "{err}"
        );
        let line = err.to_string();
        assert!(
            !line.contains('\n') && line.contains("changed after"),
            "{line}"
        );
        assert!(line.contains(&snap.display().to_string()), "{line}");
    }

    // Fields no file hash covers: each change is refused as well.
    let edits: [Edit; 5] = [
        ("criu_version", |d| d["host"]["criu_version"] = "9.9".into()),
        ("host.kernel", |d| d["host"]["kernel"] = "0.0.0".into()),
        (
            "stdio_files",
            |d| {
                d["stdio_files"] = serde_json::json!([{"path": "/etc/shadow", "key": "etc/shadow"}])
            },
        ),
        ("external_mounts", |d| {
            d["external_mounts"] = serde_json::json!([{"key": "x", "path": "/"}])
        }),
        ("source.root_pid", |d| d["source"]["root_pid"] = 1.into()),
    ];
    for (what, edit) in edits {
        copy(&pristine, &snap);
        rewrite_manifest(&snap, edit);
        let err = restore(&opts(Verify::Hashes, Trust::Key(&key)))
            .err()
            .unwrap_or_else(|| panic!("a changed {what} was restored"));
        assert!(
            matches!(err, RestoreError::Image(ImageError::SealMismatch { .. })),
            "{what}: {err}"
        );
    }

    // No MAC at all (removed, or an unkeyed snapshot): refused when a key is required.
    copy(&pristine, &snap);
    std::fs::remove_file(snap.join(MAC_FILE)).expect("rm");
    let err = restore(&opts(Verify::Hashes, Trust::Key(&key)))
        .err()
        .expect("refused");
    assert!(
        matches!(err, RestoreError::Image(ImageError::Unsealed { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("no MAC"), "{err}");

    // Sealed by another key (another daemon's, or another user's): refused, naming both ids.
    copy(&pristine, &snap);
    let other = SnapshotKey::load_or_create(&dir.path().join("other.key")).expect("key");
    let err = restore(&opts(Verify::Hashes, Trust::Key(&other)))
        .err()
        .expect("refused");
    assert!(
        matches!(err, RestoreError::Image(ImageError::SealOtherKey { .. })),
        "{err}"
    );
    assert!(
        err.to_string().contains(key.id()) && err.to_string().contains(other.id()),
        "{err}"
    );
}
