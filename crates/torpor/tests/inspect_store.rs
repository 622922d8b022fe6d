//! `torpor inspect --store`: the snapshot's sizes in a real chunk store.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use torpor_image::store::ChunkStore;
use torpor_image::{Host, Manifest, ProcessEntry, SnapshotWriter, Source};

const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");

fn torpor(args: &[&str]) -> Output {
    Command::new(TORPOR)
        .args(args)
        .output()
        .expect("torpor runs")
}

/// A finished snapshot at `parent/name` holding `files`, also committed to `store` as `name`.
fn snapshot(parent: &Path, name: &str, files: &[(&str, Vec<u8>)], store: &ChunkStore) -> PathBuf {
    let out = parent.join(name);
    let writer = SnapshotWriter::create(&out).expect("create");
    for (rel, data) in files {
        fs::write(writer.dir().join(rel), data).expect("write");
    }
    let manifest = Manifest::new(
        "0.1.0",
        Source {
            command: vec!["python3".into()],
            root_pid: 10,
            tree: vec![ProcessEntry {
                pid: 10,
                ppid: 1,
                ns_pid: vec![10, 1],
                comm: "python3".into(),
                cmdline: vec!["python3".into()],
                cuda: false,
            }],
            leave_running: true,
        },
        Host::current("4.1.1").expect("uname"),
    );
    writer.finish(manifest, None).expect("finish");
    let mut store_writer = store.writer().expect("writer");
    let recipes: Vec<_> = files
        .iter()
        .map(|(rel, _)| store_writer.put_file(&out.join(rel), rel).expect("put"))
        .collect();
    store_writer.commit(name, &recipes).expect("commit");
    out
}

fn pages(seed: &str, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut data);
    data
}

#[test]
fn inspect_shows_logical_stored_and_shared_sizes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = ChunkStore::open(&tmp.path().join("store")).expect("store");
    let framework = pages("framework", 2_000_000);
    let base = snapshot(
        tmp.path(),
        "base",
        &[
            ("pages-1.img", framework.clone()),
            ("core-1.img", b"base".to_vec()),
        ],
        &store,
    );
    let mut function = framework.clone();
    function.extend_from_slice(&pages("function", 500_000));
    let func = snapshot(
        tmp.path(),
        "fn-a",
        &[("pages-1.img", function), ("core-1.img", b"fn".to_vec())],
        &store,
    );

    let root = store.root().to_str().expect("utf-8");
    let out = torpor(&["inspect", func.to_str().expect("utf-8"), "--store", root]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("files     2, 2.50 MB"), "{text}");
    assert!(
        text.contains(&format!("store     {root} (as fn-a)")),
        "{text}"
    );
    assert!(
        text.contains("  logical 2.50 MB in 2 files and segments"),
        "{text}"
    );
    // Page CDC finds the framework's pages in the base snapshot (all but its last chunk,
    // which now continues into the function's pages).
    let shared = text
        .lines()
        .find_map(|l| l.strip_prefix("  shared  ")?.strip_suffix(" MB with base"))
        .unwrap_or_else(|| panic!("no sharing with base in:\n{text}"));
    let shared: f64 = shared.parse().expect("a size");
    assert!((1.8..=2.0).contains(&shared), "{shared} MB shared:\n{text}");

    let out = torpor(&[
        "inspect",
        func.to_str().expect("utf-8"),
        "--store",
        root,
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["store"]["snapshot"], "fn-a");
    assert_eq!(
        json["manifest"]["files"].as_array().expect("files").len(),
        2
    );
    assert!(
        json["store"]["shared_with"]["base"]
            .as_u64()
            .expect("bytes")
            > 1_800_000
    );

    // Errors: one line naming the cause and the fix.
    let out = torpor(&[
        "inspect",
        base.to_str().expect("utf-8"),
        "--store",
        root,
        "--store-id",
        "nope",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("snapshot nope is not in chunk store"), "{err}");
    let not_a_store = tmp.path().to_str().expect("utf-8");
    let out = torpor(&[
        "inspect",
        base.to_str().expect("utf-8"),
        "--store",
        not_a_store,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a chunk store"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
