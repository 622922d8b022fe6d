//! Writing, opening and verifying real snapshot directories.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use torpor_image::{
    flush_snapshot, remove_stale_partials, render_summary, Durability, FormatVersion, Host,
    ImageError, Manifest, ProcessEntry, Sealing, Snapshot, SnapshotKey, SnapshotWriter, Source,
    Trust, HASH_TIMING, MAC_FILE, MANIFEST_FILE,
};

fn manifest() -> Manifest {
    let mut m = Manifest::new(
        "0.1.0",
        Source {
            command: vec!["sleep".into(), "1000".into()],
            root_pid: 4242,
            tree: vec![ProcessEntry {
                pid: 4242,
                ppid: 1,
                ns_pid: vec![4242, 1],
                comm: "sleep".into(),
                cmdline: vec!["sleep".into(), "1000".into()],
                cuda: false,
            }],
            leave_running: false,
        },
        Host::current("4.1.1").expect("uname"),
    );
    m.timings.insert("criu_dump".into(), 0.25);
    m.stop_time_s = 0.3;
    m
}

/// Files like CRIU's: small images, a multi-megabyte pages file, an empty file, a nested one, a log.
fn fill_dump(dir: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let pages: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
    let files = vec![
        ("inventory.img", b"inventory".to_vec()),
        ("core-1.img", vec![7u8; 3000]),
        ("pages-1.img", pages),
        ("empty.img", Vec::new()),
        ("sub/dir/nested.img", b"nested".to_vec()),
        ("dump.log", b"(00.000) dumping\n".to_vec()),
    ];
    for (rel, data) in &files {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, data).expect("write");
    }
    files
}

/// A finished snapshot at `<tmp>/snap`.
fn snapshot() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("snap");
    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    writer.finish(manifest(), None).expect("finish");
    (root, out)
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn rewrite_manifest(snap: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = snap.join(MANIFEST_FILE);
    let mut value: serde_json::Value =
        serde_json::from_slice(&fs::read(&path).expect("read")).expect("json");
    f(&mut value);
    fs::write(&path, serde_json::to_vec_pretty(&value).expect("encode")).expect("write");
}

#[test]
fn written_snapshot_opens_and_verifies() {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("snap");
    let writer = SnapshotWriter::create(&out).expect("create");
    assert!(!out.exists());
    assert!(names_in(root.path())[0].starts_with(".snap.partial-"));
    let mode = fs::metadata(writer.dir())
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o777,
        0o700,
        "process memory must not be world-readable"
    );
    let files = fill_dump(writer.dir());
    let written = writer.finish(manifest(), None).expect("finish");

    // Only the final directory is left, and it holds the manifest.
    assert_eq!(names_in(root.path()), ["snap"]);
    assert!(out.join(MANIFEST_FILE).is_file());
    assert!(!out.join("manifest.json.tmp").exists());

    // Every file is listed, sorted, with its size and BLAKE3.
    let mut expected: Vec<_> = files
        .iter()
        .map(|(rel, data)| (rel.to_string(), data))
        .collect();
    expected.sort();
    assert_eq!(written.files.len(), expected.len());
    for (entry, (rel, data)) in written.files.iter().zip(&expected) {
        assert_eq!(&entry.path, rel);
        assert_eq!(entry.size, data.len() as u64);
        assert_eq!(entry.blake3, blake3::hash(data).to_hex().as_str());
    }

    let hashing = written.timings[HASH_TIMING];
    assert!((0.0..60.0).contains(&hashing), "{hashing}");
    assert_eq!(written.timings["criu_dump"], 0.25, "caller's timings kept");

    let snap = Snapshot::open(&out).expect("open");
    assert_eq!(snap.manifest(), &written);
    assert_eq!(snap.manifest().format_version, FormatVersion::CURRENT);
    let report = snap.verify().expect("verify");
    assert_eq!(report.files, files.len());
    assert_eq!(report.bytes, written.total_size());
    assert!(report.hashed && report.ignored.is_empty());
    assert!(!snap.size_check_only().expect("sizes").hashed);

    let summary = render_summary(snap.manifest(), snap.dir());
    assert!(summary.contains("files     6, 5.00 MB"), "{summary}");
    assert!(summary.contains("pages-1.img"), "{summary}");
}

#[test]
fn logs_and_stats_that_criu_writes_at_restore_are_accepted() {
    let (_root, out) = snapshot();
    fs::write(out.join("restore.log"), b"restoring").expect("write");
    fs::write(out.join("stats-restore"), b"stats").expect("write");
    let report = Snapshot::open(&out)
        .expect("open")
        .verify()
        .expect("verify");
    assert_eq!(report.ignored, ["restore.log", "stats-restore"]);
}

#[test]
fn verify_catches_a_flipped_byte() {
    let (_root, out) = snapshot();
    let path = out.join("pages-1.img");
    let mut data = fs::read(&path).expect("read");
    data[4_000_000] ^= 0x01;
    fs::write(&path, &data).expect("write");
    let snap = Snapshot::open(&out).expect("open");
    // Same size: the cheap check cannot see it, the full one must.
    snap.size_check_only().expect("sizes unchanged");
    match snap.verify() {
        Err(err @ ImageError::HashMismatch { .. }) => {
            let text = err.to_string();
            let expected_hash = &snap
                .manifest()
                .files
                .iter()
                .find(|f| f.path == "pages-1.img")
                .expect("listed")
                .blake3;
            assert_eq!(
                text,
                format!(
                    "snapshot {} is corrupt: pages-1.img hash mismatch (expected {expected_hash}, got {}): re-take the snapshot",
                    out.display(),
                    blake3::hash(&data).to_hex()
                )
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn verify_catches_a_flipped_byte_in_a_small_file() {
    let (_root, out) = snapshot();
    let path = out.join("sub/dir/nested.img");
    fs::write(&path, b"nestee").expect("write");
    match Snapshot::open(&out).expect("open").verify() {
        Err(ImageError::HashMismatch { file, .. }) => assert_eq!(file, "sub/dir/nested.img"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn verify_catches_a_truncated_file() {
    let (_root, out) = snapshot();
    let file = fs::OpenOptions::new()
        .write(true)
        .open(out.join("core-1.img"))
        .expect("open");
    file.set_len(1000).expect("truncate");
    let snap = Snapshot::open(&out).expect("open");
    for result in [snap.size_check_only(), snap.verify()] {
        match result {
            Err(err @ ImageError::SizeMismatch { .. }) => {
                let text = err.to_string();
                assert!(
                    text.contains("core-1.img size mismatch (expected 3000 bytes, got 1000)"),
                    "{text}"
                );
                assert!(text.ends_with("re-take the snapshot"), "{text}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn verify_catches_a_missing_file() {
    let (_root, out) = snapshot();
    fs::remove_file(out.join("sub/dir/nested.img")).expect("rm");
    match Snapshot::open(&out).expect("open").verify() {
        Err(ImageError::MissingFile { file, .. }) => assert_eq!(file, "sub/dir/nested.img"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn verify_catches_an_extra_file() {
    for extra in ["evil.img", "sub/extra.log", "stats-dump2"] {
        let (_root, out) = snapshot();
        fs::write(out.join(extra), b"unlisted").expect("write");
        let snap = Snapshot::open(&out).expect("open");
        for result in [snap.size_check_only(), snap.verify()] {
            match result {
                Err(ImageError::ExtraFile { file, .. }) => assert_eq!(file, extra),
                other => panic!("{extra}: {other:?}"),
            }
        }
    }
}

#[test]
fn verify_refuses_a_symlink_in_place_of_a_file() {
    let (_root, out) = snapshot();
    let target = out.join("inventory.img");
    let copy = out.with_extension("outside");
    fs::copy(&target, &copy).expect("copy");
    fs::remove_file(&target).expect("rm");
    std::os::unix::fs::symlink(&copy, &target).expect("symlink");
    match Snapshot::open(&out).expect("open").verify() {
        Err(ImageError::NotRegularFile { file, kind, .. }) => {
            assert_eq!((file.as_str(), kind), ("inventory.img", "symlink"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn open_refuses_a_tampered_path() {
    for bad in ["../x", "/etc/passwd", "sub/../../x"] {
        let (_root, out) = snapshot();
        rewrite_manifest(&out, |v| v["files"][0]["path"] = bad.into());
        match Snapshot::open(&out) {
            Err(err @ ImageError::UnsafePath { .. }) => {
                let text = err.to_string();
                assert!(text.contains(&format!("{bad:?}")), "{text}");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn open_applies_the_version_rule() {
    let (_root, out) = snapshot();
    rewrite_manifest(&out, |v| v["format_version"] = "1.2".into());
    let err = Snapshot::open(&out).expect_err("newer minor");
    assert_eq!(
        err.to_string(),
        "snapshot format 1.2 is newer than this torpor supports (1.1): upgrade torpor"
    );
    rewrite_manifest(&out, |v| v["format_version"] = "2.0".into());
    assert!(matches!(
        Snapshot::open(&out),
        Err(ImageError::FormatMajor { .. })
    ));
    // A field this version does not know is fine at an accepted version.
    rewrite_manifest(&out, |v| {
        v["format_version"] = "1.0".into();
        v["segments"] = serde_json::json!([]);
    });
    Snapshot::open(&out)
        .expect("unknown field accepted")
        .verify()
        .expect("verify");
}

#[test]
fn open_explains_a_directory_without_manifest() {
    let root = tempfile::tempdir().expect("tempdir");
    let err = Snapshot::open(root.path()).expect_err("no manifest");
    assert_eq!(
        err.to_string(),
        format!(
            "{} is not a torpor snapshot (no manifest.json) — an interrupted snapshot never has one: check the path or re-take the snapshot",
            root.path().display()
        )
    );
    let missing = root.path().join("nope");
    assert!(matches!(
        Snapshot::open(&missing),
        Err(ImageError::SnapshotNotFound { .. })
    ));
    fs::write(&missing, b"").expect("write");
    assert!(matches!(
        Snapshot::open(&missing),
        Err(ImageError::SnapshotNotADirectory { .. })
    ));
    fs::create_dir(root.path().join("m")).expect("mkdir");
    fs::create_dir(root.path().join("m").join(MANIFEST_FILE)).expect("mkdir");
    assert!(matches!(
        Snapshot::open(&root.path().join("m")),
        Err(ImageError::ManifestRead { .. })
    ));
}

#[test]
fn drop_and_abort_leave_nothing_behind() {
    let root = tempfile::tempdir().expect("tempdir");
    let writer = SnapshotWriter::create(&root.path().join("a")).expect("create");
    fill_dump(writer.dir());
    drop(writer);
    assert!(names_in(root.path()).is_empty());

    let writer = SnapshotWriter::create(&root.path().join("b")).expect("create");
    fill_dump(writer.dir());
    writer.abort().expect("abort");
    assert!(names_in(root.path()).is_empty());
}

#[test]
fn failed_finish_leaves_nothing_behind() {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("snap");

    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    let mut bad = manifest();
    bad.timings.insert("hash".into(), f64::NAN);
    assert!(matches!(
        writer.finish(bad, None),
        Err(ImageError::NonFiniteTiming { .. })
    ));
    assert!(names_in(root.path()).is_empty());

    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    std::os::unix::fs::symlink("/etc/hostname", writer.dir().join("link.img")).expect("symlink");
    assert!(matches!(
        writer.finish(manifest(), None),
        Err(ImageError::NotRegularFile { .. })
    ));
    assert!(names_in(root.path()).is_empty());
}

#[test]
fn writer_refuses_an_existing_out() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("dir");
    let file = root.path().join("file");
    fs::create_dir(&dir).expect("mkdir");
    fs::write(&file, b"x").expect("write");
    for out in [&dir, &file] {
        let err = SnapshotWriter::create(out).expect_err("exists");
        assert_eq!(
            err.to_string(),
            format!(
                "{} already exists: choose another --out or remove it",
                out.display()
            )
        );
    }
    assert_eq!(names_in(root.path()), ["dir", "file"]);
}

#[test]
fn out_created_meanwhile_is_never_replaced() {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("snap");
    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    // An empty directory: plain rename(2) would silently replace it.
    fs::create_dir(&out).expect("mkdir");
    assert!(matches!(
        writer.finish(manifest(), None),
        Err(ImageError::OutExists { .. })
    ));
    assert_eq!(names_in(root.path()), ["snap"]);
    assert!(names_in(&out).is_empty());
}

#[test]
fn final_dir_never_exists_without_its_manifest() {
    for round in 0..5 {
        let root = tempfile::tempdir().expect("tempdir");
        let out = root.path().join("snap");
        let writer = SnapshotWriter::create(&out).expect("create");
        for i in 0..200 {
            fs::write(
                writer.dir().join(format!("pages-{i}.img")),
                vec![i as u8; 4096],
            )
            .expect("write");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (stop, out) = (Arc::clone(&stop), out.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Acquire) {
                    if out.exists() {
                        assert!(
                            out.join(MANIFEST_FILE).is_file(),
                            "round {round}: {} without manifest",
                            out.display()
                        );
                        seen += 1;
                    }
                }
                seen
            })
        };
        writer.finish(manifest(), None).expect("finish");
        stop.store(true, Ordering::Release);
        watcher.join().expect("watcher");
        assert!(Snapshot::open(&out)
            .expect("open")
            .size_check_only()
            .is_ok());
    }
}

#[test]
fn stale_partials_of_dead_processes_are_removed() {
    let root = tempfile::tempdir().expect("tempdir");
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let dead_pid = child.id();
    child.wait().expect("wait");
    let own_pid = std::process::id();

    let dead = root.path().join(format!(".old.partial-{dead_pid}"));
    fs::create_dir(&dead).expect("mkdir");
    fs::write(dead.join("pages-1.img"), b"leftover").expect("write");
    let keep = [
        format!(".mine.partial-{own_pid}"),  // ours: in progress
        ".init.partial-1".to_owned(),        // pid 1 is alive
        format!("plain.partial-{dead_pid}"), // not hidden: not a torpor name
        ".x.partial-abc".to_owned(),
        "snapshot".to_owned(),
    ];
    for name in &keep {
        fs::create_dir(root.path().join(name)).expect("mkdir");
    }
    // A symlink named like a partial is never followed or removed.
    let link = format!(".link.partial-{dead_pid}");
    std::os::unix::fs::symlink(root.path().join("snapshot"), root.path().join(&link))
        .expect("symlink");

    let removed = remove_stale_partials(root.path()).expect("clean");
    assert_eq!(removed, [dead]);
    let mut expected: Vec<String> = keep.to_vec();
    expected.push(link);
    expected.sort();
    assert_eq!(names_in(root.path()), expected);
    assert!(remove_stale_partials(root.path())
        .expect("again")
        .is_empty());
}

fn key(byte: u8) -> SnapshotKey {
    SnapshotKey::from_bytes([byte; 32], Path::new("test.key"))
}

/// A snapshot at `<tmp>/snap` sealed with `key(1)`.
fn sealed_snapshot() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("snap");
    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    writer.finish(manifest(), Some(&key(1))).expect("finish");
    (root, out)
}

#[test]
fn a_sealed_snapshot_authenticates_under_its_key_only() {
    let (_root, out) = sealed_snapshot();
    assert!(out.join(MAC_FILE).is_file());
    assert!(!out.join("manifest.mac.tmp").exists());
    let snap = Snapshot::open(&out).expect("open");
    assert!(matches!(snap.sealing(), Sealing::Sealed(s) if s.key_id == key(1).id()));
    assert!(
        !snap.manifest().files.iter().any(|f| f.path == MAC_FILE),
        "the MAC is never listed"
    );
    snap.authenticate(Trust::Key(&key(1))).expect("authentic");
    snap.verify().expect("the MAC is no unlisted file");
    snap.authenticate(Trust::Unkeyed)
        .expect("unkeyed checks nothing");
    let err = snap
        .authenticate(Trust::Key(&key(2)))
        .expect_err("other key");
    assert!(matches!(err, ImageError::SealOtherKey { .. }), "{err}");
}

#[test]
fn any_change_to_the_manifest_breaks_the_seal() {
    let (_root, out) = sealed_snapshot();
    let pristine = fs::read(out.join(MANIFEST_FILE)).expect("read");
    // A page rewritten with its hash recomputed; fields no file hash covers; an unknown field;
    // even whitespace. Each is a manifest its writer did not seal.
    let edits: [fn(&mut serde_json::Value); 8] = [
        |v| v["files"][2]["blake3"] = blake3::hash(b"planted").to_hex().as_str().into(),
        |v| v["host"]["criu_version"] = "9.9".into(),
        |v| v["host"]["kernel"] = "0.0".into(),
        |v| v["stdio_files"] = serde_json::json!([{"path": "/etc/shadow", "key": "etc/shadow"}]),
        |v| v["external_mounts"] = serde_json::json!([{"key": "k", "path": "/"}]),
        |v| v["source"]["root_pid"] = 1.into(),
        |v| v["source"]["tree"] = serde_json::json!([]),
        |v| v["added_later"] = true.into(),
    ];
    for (i, edit) in edits.iter().enumerate() {
        fs::write(out.join(MANIFEST_FILE), &pristine).expect("restore");
        rewrite_manifest(&out, edit);
        let snap = Snapshot::open(&out).expect("still a well-formed manifest");
        let err = snap
            .authenticate(Trust::Key(&key(1)))
            .expect_err(&format!("edit {i} accepted"));
        assert!(matches!(err, ImageError::SealMismatch { .. }), "{i}: {err}");
        let line = err.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains(&out.display().to_string()), "{line}");
    }
    let mut spaced = pristine.clone();
    spaced.push(b' ');
    fs::write(out.join(MANIFEST_FILE), &spaced).expect("write");
    let err = Snapshot::open(&out)
        .expect("open")
        .authenticate(Trust::Key(&key(1)))
        .expect_err("whitespace");
    assert!(matches!(err, ImageError::SealMismatch { .. }), "{err}");
    fs::write(out.join(MANIFEST_FILE), &pristine).expect("write");
    Snapshot::open(&out)
        .expect("open")
        .authenticate(Trust::Key(&key(1)))
        .expect("the original manifest is authentic again");
}

#[test]
fn a_missing_or_forged_mac_is_refused_when_a_key_is_required() {
    let (_root, out) = sealed_snapshot();
    let mac = fs::read(out.join(MAC_FILE)).expect("read");
    fs::remove_file(out.join(MAC_FILE)).expect("rm");
    let snap = Snapshot::open(&out).expect("open");
    assert_eq!(snap.sealing(), &Sealing::Unsealed);
    let err = snap
        .authenticate(Trust::Key(&key(1)))
        .expect_err("unsealed");
    assert!(matches!(err, ImageError::Unsealed { .. }), "{err}");
    assert!(err.to_string().contains("--unkeyed"), "{err}");
    snap.authenticate(Trust::Unkeyed).expect("unkeyed");

    fs::write(out.join(MAC_FILE), b"garbage").expect("write");
    let snap = Snapshot::open(&out).expect("open");
    assert_eq!(snap.sealing(), &Sealing::Malformed);
    let err = snap
        .authenticate(Trust::Key(&key(1)))
        .expect_err("malformed");
    assert!(matches!(err, ImageError::SealMalformed { .. }), "{err}");

    // The right key id with a MAC made without the key.
    let text = String::from_utf8(mac).expect("utf8");
    let seal: serde_json::Value = serde_json::from_str(&text).expect("json");
    let forged = text.replace(
        seal["mac"].as_str().expect("mac"),
        blake3::hash(&fs::read(out.join(MANIFEST_FILE)).expect("read"))
            .to_hex()
            .as_str(),
    );
    fs::write(out.join(MAC_FILE), forged).expect("write");
    let err = Snapshot::open(&out)
        .expect("open")
        .authenticate(Trust::Key(&key(1)))
        .expect_err("forged");
    assert!(matches!(err, ImageError::SealMismatch { .. }), "{err}");

    // A manifest listing the MAC file is malformed, not a way to smuggle it in.
    rewrite_manifest(&out, |v| v["files"][0]["path"] = MAC_FILE.into());
    assert!(matches!(
        Snapshot::open(&out),
        Err(ImageError::UnsafePath { .. })
    ));
}

#[test]
fn a_deferred_snapshot_is_sealed_like_a_synced_one_and_flushed_later() {
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("hib");
    let writer = SnapshotWriter::create(&out).expect("create");
    let files = fill_dump(writer.dir());
    let key = key(9);
    let written = writer
        .finish_with(manifest(), Some(&key), Durability::Deferred)
        .expect("finish");
    // In place, complete and sealed before any flush: what a restore verifies is the same.
    assert_eq!(written.files.len(), files.len());
    let snap = Snapshot::open(&out).expect("open");
    snap.authenticate(Trust::Key(&key))
        .expect("sealed by the key");
    snap.verify().expect("every file's hash");
    assert!(flush_snapshot(&out).expect("flush") >= 0.0);
    snap.verify().expect("still verifies after the flush");
    // A snapshot woken and discarded before its flush ran: nothing to flush, no error.
    fs::remove_dir_all(&out).expect("rm");
    flush_snapshot(&out).expect("a snapshot already gone");
}

#[test]
fn a_deferred_snapshot_torn_by_a_crash_is_refused_by_its_hashes() {
    // What a machine crash before the flush can leave: a file short of its bytes.
    let root = tempfile::tempdir().expect("tempdir");
    let out = root.path().join("hib");
    let writer = SnapshotWriter::create(&out).expect("create");
    fill_dump(writer.dir());
    writer
        .finish_with(manifest(), None, Durability::Deferred)
        .expect("finish");
    let pages = out.join("pages-1.img");
    let len = fs::metadata(&pages).expect("stat").len();
    fs::OpenOptions::new()
        .write(true)
        .open(&pages)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let snap = Snapshot::open(&out).expect("open");
    let err = snap.verify().expect_err("torn");
    assert!(err.to_string().contains("pages-1.img"), "{err}");
}

#[test]
fn verify_hashed_compares_given_hashes_and_hashes_the_files_it_is_not_given() {
    let (_root, out) = snapshot();
    let snap = Snapshot::open(&out).expect("open");
    let right = |rel: &str| Some(blake3::hash(&fs::read(out.join(rel)).expect("read")));
    let report = snap.verify_hashed(&right).expect("the files' own hashes");
    assert!(report.hashed);
    assert_eq!(report.files, snap.manifest().files.len());

    // A hash that is not the manifest's is a mismatch naming the file, as verify's is.
    let wrong = |rel: &str| {
        if rel == "pages-1.img" {
            Some(blake3::hash(b"not these pages"))
        } else {
            right(rel)
        }
    };
    match snap.verify_hashed(&wrong) {
        Err(ImageError::HashMismatch { file, actual, .. }) => {
            assert_eq!(file, "pages-1.img");
            assert_eq!(
                actual,
                blake3::hash(b"not these pages").to_hex().to_string()
            );
        }
        other => panic!("{other:?}"),
    }

    // No hash given: the file is read and hashed, so a flipped byte is still caught.
    let path = out.join("core-1.img");
    let mut data = fs::read(&path).expect("read");
    data[10] ^= 0x01;
    fs::write(&path, &data).expect("write");
    let none_for_core = |rel: &str| {
        if rel == "core-1.img" {
            None
        } else {
            right(rel)
        }
    };
    match snap.verify_hashed(&none_for_core) {
        Err(ImageError::HashMismatch { file, .. }) => assert_eq!(file, "core-1.img"),
        other => panic!("{other:?}"),
    }
    // The listing is still checked: a missing file is named before any hash.
    fs::remove_file(out.join("sub/dir/nested.img")).expect("remove");
    match snap.verify_hashed(&right) {
        Err(ImageError::MissingFile { file, .. }) => assert_eq!(file, "sub/dir/nested.img"),
        other => panic!("{other:?}"),
    }
}
