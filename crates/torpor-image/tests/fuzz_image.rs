//! Fuzzing what torpor-image reads back from disk (issue 13 item 5): snapshot manifests
//! (`manifest.json`, which a snapshot's directory holds and `torpor restore` reads from any
//! directory it is given) and the chunk store's records (`refs/<snapshot>.json`). Seeds: the
//! files in `tests/fuzz-corpus/{manifest,record}/`, written from a real SnapshotWriter and a
//! real store (`TORPOR_FUZZ_WRITE_CORPUS=1` rewrites them), mutated (fuzz_support).
//!
//! Properties: never panic; never allocate out of proportion to the input; refuse with a typed
//! error whose message is one line; what parses writes back and parses to itself (round trip);
//! a manifest that parses lists only safe relative paths.
//!
//! Why proptest and how to run a longer campaign: fuzz_support/mod.rs and docs/fuzzing.md.

mod fuzz_support;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use torpor_image::store::ChunkStore;
use torpor_image::{check_relative_path, Host, Manifest, ProcessEntry, SnapshotWriter, Source};

use fuzz_support::{campaign, check_alloc, corpus, mutated, one_line, peak_alloc};

#[global_allocator]
static ALLOC: fuzz_support::Counting = fuzz_support::Counting;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(target)
}

const REGRESSIONS_MANIFEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fuzz-regressions/manifest.txt"
);
const REGRESSIONS_RECORD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fuzz-regressions/record.txt"
);

/// A manifest as a real snapshot writer writes it, of a small real-looking dump.
fn real_manifest(root: &Path) -> Vec<u8> {
    let out = root.join("snap");
    let w = SnapshotWriter::create(&out).expect("writer");
    std::fs::write(w.dir().join("pages-1.img"), vec![7u8; 10_000]).expect("write");
    std::fs::create_dir_all(w.dir().join("sub")).expect("mkdir");
    std::fs::write(w.dir().join("sub/core-1.img"), b"core").expect("write");
    let mut m = Manifest::new(
        "0.1.0",
        Source {
            command: vec!["python3".into(), "-c".into(), "pass".into()],
            root_pid: 4242,
            tree: vec![ProcessEntry {
                pid: 4242,
                ppid: 1,
                ns_pid: vec![4242, 1],
                comm: "python3".into(),
                cmdline: vec!["python3".into()],
                cuda: false,
            }],
            leave_running: true,
        },
        Host::current("4.2.1").expect("uname"),
    );
    m.timings.insert("criu_dump".into(), 0.25);
    w.finish(m, None).expect("finish");
    std::fs::read(out.join("manifest.json")).expect("manifest")
}

/// A record as a real store commits it, and the store.
fn real_record(root: &Path) -> (ChunkStore, Vec<u8>) {
    let store = ChunkStore::open(&root.join("store")).expect("store");
    let mut w = store.writer().expect("writer");
    let a = w
        .put_bytes("pages-1.img", &vec![3u8; 300_000])
        .expect("put");
    let b = w.put_bytes("core-1.img", b"core").expect("put");
    w.commit("seed", &[a, b]).expect("commit");
    let bytes = std::fs::read(root.join("store/refs/seed.json")).expect("record");
    (store, bytes)
}

/// The committed seeds of `target`, after rewriting them from `live` when asked.
fn seeds(target: &str, live: &[u8]) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    if std::env::var_os("TORPOR_FUZZ_WRITE_CORPUS").is_some() {
        std::fs::create_dir_all(&dir).expect("corpus dir");
        std::fs::write(dir.join("real.json"), live).expect("corpus file");
    }
    let mut all = corpus(&dir);
    all.push(live.to_vec());
    all
}

#[test]
fn fuzz_manifest() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let seeds = seeds("manifest", &real_manifest(tmp.path()));
    let origin = Path::new("/snap/manifest.json");
    let dir = Path::new("/snap");
    campaign(
        "manifest",
        3000,
        REGRESSIONS_MANIFEST,
        mutated(seeds),
        |bytes| {
            let (parsed, peak) = peak_alloc(|| Manifest::from_json(&bytes, origin, dir));
            check_alloc("manifest", bytes.len(), peak)?;
            match parsed {
                Err(e) => one_line(&e),
                Ok(m) => {
                    for f in &m.files {
                        prop_assert!(check_relative_path(&f.path).is_ok(), "{:?}", f.path);
                    }
                    let json = m
                        .to_json()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let back = Manifest::from_json(json.as_bytes(), origin, dir)
                        .map_err(|e| TestCaseError::fail(format!("round trip: {e}")))?;
                    prop_assert_eq!(back, m);
                    Ok(())
                }
            }
        },
    );
}

#[test]
fn fuzz_store_record() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (store, live) = real_record(tmp.path());
    let seeds = seeds("record", &live);
    let path = tmp.path().join("store/refs/seed.json");
    campaign(
        "store_record",
        1500,
        REGRESSIONS_RECORD,
        mutated(seeds),
        |bytes| {
            std::fs::write(&path, &bytes).expect("write the record");
            let (read, peak) = peak_alloc(|| store.recipes("seed"));
            check_alloc("store_record", bytes.len(), peak)?;
            match read {
                Err(e) => one_line(&e),
                Ok(recipes) => {
                    // A record that reads back only ever names recipes that hold together; reading
                    // one back is checked chunk by chunk (small ones: the buffer is the caller's).
                    for r in recipes.iter().filter(|r| r.size <= 1 << 20) {
                        prop_assert!(r.validate().is_ok());
                        let mut buf = vec![0u8; r.size as usize];
                        if let Err(e) = store.read_into(r, &mut buf) {
                            one_line(&e)?;
                        }
                    }
                    Ok(())
                }
            }
        },
    );
}
