//! Push and pull against a real SeaweedFS (`weed server -s3` on loopback): deduplication in both
//! directions, a corrupted object, wrong credentials and a server that goes away mid-pull.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{Proxy, Seaweed, SECRET_KEY};
use torpor_image::store::{ChunkStore, StoreError};
use torpor_image::{
    Host, Manifest, ProcessEntry, Snapshot, SnapshotKey, SnapshotWriter, Source, Trust,
};
use torpor_objstore::{
    pull, pull_snapshot, pull_snapshot_deferred, push, push_sealed_record, AfterAnswer, ObjError,
    Progress, Remote, RemoteConfig, SealedPart, TransferError, DEFAULT_PARALLEL,
};

/// Pseudo-random pages: incompressible and distinct per seed.
fn pages(seed: &str, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut data);
    data
}

/// A finished snapshot at `parent/name` holding `files`, sealed with `key` when given.
fn snapshot(
    parent: &Path,
    name: &str,
    files: &[(&str, Vec<u8>)],
    key: Option<&SnapshotKey>,
) -> PathBuf {
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
    writer.finish(manifest, key).expect("finish");
    out
}

fn remote(config: &Path) -> Remote {
    Remote::open(&RemoteConfig::load(config).expect("config")).expect("remote")
}

fn quiet(_: Progress) {}

#[test]
fn push_and_pull_against_seaweedfs() {
    let server = Seaweed::start();
    let work = tempfile::tempdir().expect("tempdir");
    let w = work.path();
    server.create_bucket("snaps");
    let config = server.config(w, "snaps", &server.endpoint(), SECRET_KEY);
    let key = SnapshotKey::from_bytes([7; 32], &w.join("snapshot.key"));

    // A "base" and a "function" snapshot sharing the base's pages.
    let base_pages = pages("base", 3 << 20);
    let a = snapshot(
        w,
        "fn-a",
        &[
            ("pages-1.img", base_pages.clone()),
            ("core.img", pages("a", 5000)),
        ],
        Some(&key),
    );
    let b = snapshot(
        w,
        "fn-b",
        &[
            ("pages-1.img", base_pages.clone()),
            ("pages-2.img", pages("b", 1 << 20)),
            ("core.img", pages("b-core", 5000)),
        ],
        Some(&key),
    );
    let node1 = ChunkStore::open(&w.join("node1")).expect("store 1");

    // Push: every chunk uploaded once; a second push uploads none.
    let r = remote(&config);
    let pushed = push(&r, &node1, &a, "fn-a", Trust::Key(&key), 4, &quiet).expect("push a");
    assert!(pushed.chunks > 3, "{pushed:?}");
    assert_eq!(pushed.uploaded, pushed.chunks, "{pushed:?}");
    assert!(!pushed.already_pushed);
    // In packs: a pack and its index, no loose chunk object; the locator names every chunk.
    let listed = r.list("").expect("list");
    let packs: Vec<&String> = listed
        .iter()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("packs/") && k.ends_with(".pack"))
        .collect();
    assert_eq!(packs.len(), 1, "{listed:?}");
    assert!(
        listed
            .iter()
            .any(|(k, _)| *k == packs[0].replace(".pack", ".idx")),
        "{listed:?}"
    );
    assert!(
        listed.iter().all(|(k, _)| !k.starts_with("chunks/")),
        "{listed:?}"
    );
    assert_eq!(located(&r, "fn-a").len() as u64, pushed.chunks);
    let again = push(
        &remote(&config),
        &node1,
        &a,
        "fn-a",
        Trust::Key(&key),
        4,
        &quiet,
    )
    .expect("push a again");
    assert_eq!(again.uploaded, 0, "{again:?}");
    assert!(again.already_pushed);
    assert_eq!(again.traffic.bytes_up, 0, "{again:?}");
    // B shares the base's pages: only its own chunks go up.
    let pushed_b = push(
        &remote(&config),
        &node1,
        &b,
        "fn-b",
        Trust::Key(&key),
        4,
        &quiet,
    )
    .expect("push b");
    assert!(pushed_b.present >= pushed.chunks - 1, "{pushed_b:?}");
    assert_eq!(pushed_b.uploaded, pushed_b.chunks - pushed_b.present);
    assert!(pushed_b.uploaded > 0, "{pushed_b:?}");
    // Only B's new chunks went up, in one new pack: its upload is about their size.
    let b_new: u64 = {
        let a_ids = located(&r, "fn-a");
        located(&r, "fn-b")
            .iter()
            .filter(|(id, _)| !a_ids.iter().any(|(a, _)| a == id))
            .map(|(_, len)| *len)
            .sum()
    };
    let up = pushed_b.traffic.bytes_up;
    assert!(
        up >= b_new && up < b_new + (64 << 10),
        "{pushed_b:?} {b_new}"
    );

    // Another snapshot under a taken id: refused by the bucket before the local store changes,
    // and by a local store that holds other contents under that id.
    let fresh = ChunkStore::open(&w.join("fresh")).expect("fresh store");
    let err = push(
        &remote(&config),
        &fresh,
        &b,
        "fn-a",
        Trust::Key(&key),
        4,
        &quiet,
    )
    .expect_err("conflict");
    assert!(matches!(err, TransferError::Conflict { .. }), "{err}");
    assert!(fresh.snapshots().expect("ids").is_empty());
    let mut other = fresh.writer().expect("writer");
    let recipe = other.put_bytes("core.img", b"other contents").expect("put");
    other.commit("fn-local", &[recipe]).expect("commit");
    let err = push(
        &remote(&config),
        &fresh,
        &b,
        "fn-local",
        Trust::Key(&key),
        4,
        &quiet,
    )
    .expect_err("store differs");
    assert!(matches!(err, TransferError::StoreDiffers { .. }), "{err}");

    // Pull A into an empty store: everything fetched, the snapshot verifies and authenticates.
    let node2 = ChunkStore::open(&w.join("node2")).expect("store 2");
    let r2 = remote(&config);
    let out_a = w.join("pulled-a");
    let pulled = pull(
        &r2,
        &node2,
        "fn-a",
        &out_a,
        Trust::Key(&key),
        DEFAULT_PARALLEL,
        &quiet,
    )
    .expect("pull a");
    assert_eq!(pulled.fetched, pushed.chunks, "{pulled:?}");
    let snap = Snapshot::open(&out_a).expect("open pulled");
    snap.authenticate(Trust::Key(&key)).expect("authentic");
    snap.verify().expect("verify");
    assert_eq!(
        fs::read(out_a.join("pages-1.img")).expect("read"),
        base_pages
    );
    assert_eq!(node2.snapshots().expect("ids"), ["fn-a"]);

    // Pull B into the store that has A: only B's own chunks are fetched (requests counted:
    // manifest, record, seal, locator, then one ranged GET: B's new chunks are one pack).
    let r3 = remote(&config);
    let pulled_b = pull(
        &r3,
        &node2,
        "fn-b",
        &w.join("pulled-b"),
        Trust::Key(&key),
        4,
        &quiet,
    )
    .expect("pull b");
    assert_eq!(pulled_b.fetched, pushed_b.uploaded, "{pulled_b:?}");
    assert_eq!(pulled_b.local, pulled_b.chunks - pulled_b.fetched);
    assert_eq!((pulled_b.ranges, pulled_b.loose), (1, 0), "{pulled_b:?}");
    assert_eq!(r3.traffic().requests, 4 + pulled_b.ranges, "{pulled_b:?}");
    assert!(r3.traffic().bytes_down < 2 << 20, "{pulled_b:?}");
    Snapshot::open(&w.join("pulled-b"))
        .expect("open")
        .verify()
        .expect("verify b");

    // Pulling under another key is refused before anything is written.
    let other = SnapshotKey::from_bytes([8; 32], &w.join("other.key"));
    let err = pull(
        &remote(&config),
        &node2,
        "fn-a",
        &w.join("x"),
        Trust::Key(&other),
        4,
        &quiet,
    )
    .expect_err("other key");
    assert!(matches!(err, TransferError::Image(_)), "{err}");
    assert!(!w.join("x").exists());

    streamed_get(&config);
    server_gone_mid_pull(&server, w, &config, &key);
    files_and_segments_in_one_pipeline(&server, w, &config, &key);
    corrupted_pack_is_refused(w, &config, &key, &node1);
    loose_chunks_of_an_older_push(w, &config, &key);
    wrong_credentials(&server, w);
    unknown_snapshot_and_missing_bucket(&server, w);
}

/// The connection dies in the middle of the pull, after the first ranged GET and before the
/// last ended: the pull fails with one line, commits nothing and writes no directory; the
/// chunks it fetched before are verified, stored and reused by the next pull.
fn server_gone_mid_pull(server: &Seaweed, w: &Path, config: &Path, key: &SnapshotKey) {
    let proxy = Proxy::start(server.s3_port);
    let via_proxy = server.config(
        w,
        "snaps-proxied",
        &format!("http://127.0.0.1:{}", proxy.port),
        SECRET_KEY,
    );
    // Same bucket, reached through the proxy.
    let text = fs::read_to_string(&via_proxy)
        .expect("read")
        .replace("bucket = \"snaps-proxied\"", "bucket = \"snaps\"");
    fs::write(&via_proxy, text).expect("write");
    // What a whole pull of B takes through the proxy, into a store of its own; B's chunks are
    // two ranged GETs (its base pages, ~3 MiB in A's pack, and its own ~1 MiB), one at a time.
    let probe = ChunkStore::open(&w.join("node3-probe")).expect("probe store");
    let whole = pull(
        &remote(&via_proxy),
        &probe,
        "fn-b",
        &w.join("pulled-probe"),
        Trust::Key(key),
        1,
        &quiet,
    )
    .expect("pull through the proxy");
    assert_eq!((whole.ranges, whole.loose), (2, 0), "{whole:?}");
    let all = proxy.down_bytes();
    // Cut 200 KiB before the end: inside the last GET, after the first one.
    proxy.cut_after(all - (200 << 10));
    let node3 = ChunkStore::open(&w.join("node3")).expect("store 3");
    let out = w.join("pulled-gone");
    let err = pull(
        &remote(&via_proxy),
        &node3,
        "fn-b",
        &out,
        Trust::Key(key),
        1,
        &quiet,
    )
    .expect_err("server gone");
    assert!(
        matches!(&err, TransferError::Remote(e) if matches!(**e, ObjError::Unreachable { .. })),
        "{err}"
    );
    let line = err.to_string();
    assert!(
        !line.contains('\n') && line.contains("cannot reach"),
        "{line}"
    );
    assert!(!out.exists());
    assert!(node3.snapshots().expect("ids").is_empty());
    assert!(fs::read_dir(w).expect("ls").all(|e| !e
        .expect("entry")
        .file_name()
        .to_string_lossy()
        .contains(".pull-")));
    // Once the server is back, the pull completes, fetching only what it lacked.
    let again = pull(
        &remote(config),
        &node3,
        "fn-b",
        &out,
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("pull after");
    assert!(again.local >= 2, "{again:?}");
    assert_eq!(again.fetched + again.local, again.chunks);
    Snapshot::open(&out)
        .expect("open")
        .verify()
        .expect("verify");
    // A then needs only its own core.img, a few KiB of a ~3 MiB pack: one ranged GET of it.
    let r = remote(config);
    let pulled_a = pull(
        &r,
        &node3,
        "fn-a",
        &w.join("pulled-a3"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("pull a into node3");
    assert_eq!(
        (pulled_a.fetched, pulled_a.ranges, pulled_a.loose),
        (1, 1, 0),
        "{pulled_a:?}"
    );
    assert!(r.traffic().bytes_down < 512 << 10, "{pulled_a:?}");
    Snapshot::open(&w.join("pulled-a3"))
        .expect("open")
        .verify()
        .expect("verify a3");
}

/// The chunks the locator of `id` places: (chunk id, length of its chunk file).
fn located(r: &Remote, id: &str) -> Vec<(String, u64)> {
    let bytes = r
        .get(&format!("snapshots/{id}/packs.json"), 64 << 20)
        .expect("get locator")
        .expect("a locator");
    let locator: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    let mut out = Vec::new();
    for (_, p) in locator["packs"].as_object().expect("packs") {
        for c in p["chunks"].as_array().expect("chunks") {
            out.push((
                c[0].as_str().expect("id").to_owned(),
                c[2].as_u64().expect("len"),
            ));
        }
    }
    out
}

/// (pack name, offset, length) of `chunk` in the locator of `id`.
fn place_of(r: &Remote, id: &str, chunk: &str) -> (String, u64, u64) {
    let bytes = r
        .get(&format!("snapshots/{id}/packs.json"), 64 << 20)
        .expect("get locator")
        .expect("a locator");
    let locator: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    for (name, p) in locator["packs"].as_object().expect("packs") {
        for c in p["chunks"].as_array().expect("chunks") {
            if c[0].as_str() == Some(chunk) {
                return (
                    name.clone(),
                    c[1].as_u64().expect("offset"),
                    c[2].as_u64().expect("len"),
                );
            }
        }
    }
    panic!("{chunk} not in the locator of {id}");
}

/// A byte flipped inside a pack: the pull that fetches that range is refused with one line
/// naming the pack; nothing of the chunk is stored, nothing committed, no directory written.
fn corrupted_pack_is_refused(w: &Path, config: &Path, key: &SnapshotKey, node1: &ChunkStore) {
    let recipes = node1.recipes("fn-a").expect("recipes");
    let victim = recipes
        .iter()
        .find(|r| r.name == "core.img")
        .expect("core.img")
        .chunks[0];
    let r = remote(config);
    let (pack, offset, len) = place_of(&r, "fn-a", &victim.id.to_hex());
    let object = format!("packs/{pack}.pack");
    let good = r.get(&object, 1 << 30).expect("get pack").expect("pack");
    let mut bad = good.clone();
    bad[(offset + len - 1) as usize] ^= 0x55;
    r.put(&object, &bad).expect("overwrite");
    let node4 = ChunkStore::open(&w.join("node4")).expect("store 4");
    let err = pull(
        &r,
        &node4,
        "fn-a",
        &w.join("pulled-bad"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect_err("corrupt");
    assert!(
        matches!(
            err,
            TransferError::Store(StoreError::ForeignChunkCorrupt { .. })
        ),
        "{err}"
    );
    let line = err.to_string();
    assert!(line.contains(&object) && !line.contains('\n'), "{line}");
    assert!(!node4.contains(&victim.id));
    assert!(node4.snapshots().expect("ids").is_empty());
    assert!(!w.join("pulled-bad").exists());
    // A pack cut short is refused too, naming the pack.
    r.put(&object, &good[..offset as usize]).expect("truncate");
    let err = pull(
        &r,
        &node4,
        "fn-a",
        &w.join("pulled-bad"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect_err("short");
    assert!(matches!(err, TransferError::CorruptObject { .. }), "{err}");
    assert!(err.to_string().contains(&object), "{err}");
    assert!(!node4.contains(&victim.id));
    assert!(node4.snapshots().expect("ids").is_empty());
    assert!(!w.join("pulled-bad").exists());
    // Put it back for the later checks (a push does not repair it: the index lists the chunk).
    r.put(&object, &good).expect("restore pack");
}

/// A snapshot pushed before packs (every chunk a loose `chunks/<hex>` object, no locator)
/// still pulls, and a later push counts its loose chunks as present.
fn loose_chunks_of_an_older_push(w: &Path, config: &Path, key: &SnapshotKey) {
    // Push C under a scratch prefix of the bucket, then lay it out at the top as the pushes
    // before packs did.
    let scratch_config = w.join("scratch.toml");
    let text = fs::read_to_string(config).expect("read");
    fs::write(&scratch_config, format!("{text}prefix = \"scratch/\"\n")).expect("write");
    let scratch = remote(&scratch_config);
    let old_pages = pages("old", 2 << 20);
    let c = snapshot(
        w,
        "fn-c",
        &[
            ("pages-1.img", old_pages.clone()),
            ("core.img", vec![5; 100]),
        ],
        Some(key),
    );
    let node7 = ChunkStore::open(&w.join("node7")).expect("store 7");
    push(&scratch, &node7, &c, "fn-c", Trust::Key(key), 4, &quiet).expect("push c");
    let r = remote(config);
    let recipes = node7.recipes("fn-c").expect("recipes");
    let mut loose = 0;
    for recipe in &recipes {
        for chunk in &recipe.chunks {
            let bytes = node7.chunk_file(chunk, &recipe.name).expect("chunk file");
            r.put(&format!("chunks/{}", chunk.id), &bytes).expect("put");
            loose += 1;
        }
    }
    for file in ["record.json", "manifest.mac", "manifest.json"] {
        let object = format!("snapshots/fn-c/{file}");
        let bytes = scratch.get(&object, 1 << 30).expect("get").expect(file);
        r.put(&object, &bytes).expect("put");
    }

    let node8 = ChunkStore::open(&w.join("node8")).expect("store 8");
    let out = w.join("pulled-c");
    let pulled = pull(
        &remote(config),
        &node8,
        "fn-c",
        &out,
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("pull old");
    assert_eq!(
        (pulled.loose, pulled.ranges),
        (pulled.fetched, 0),
        "{pulled:?}"
    );
    assert!(pulled.fetched >= 2 && pulled.fetched <= loose, "{pulled:?}");
    let snap = Snapshot::open(&out).expect("open");
    snap.authenticate(Trust::Key(key)).expect("authentic");
    snap.verify().expect("verify");
    assert!(fs::read(out.join("pages-1.img")).expect("read") == old_pages);
    // A loose chunk overwritten in the bucket is refused with its key, nothing committed.
    let victim = recipes
        .iter()
        .find(|r| r.name == "core.img")
        .expect("core.img")
        .chunks[0];
    let object = format!("chunks/{}", victim.id);
    let good = node7.chunk_file(&victim, "core.img").expect("chunk file");
    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0x55;
    r.put(&object, &bad).expect("overwrite");
    let node10 = ChunkStore::open(&w.join("node10")).expect("store 10");
    let err = pull(
        &r,
        &node10,
        "fn-c",
        &w.join("pulled-c-bad"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect_err("corrupt loose chunk");
    assert!(
        matches!(
            err,
            TransferError::Store(StoreError::ForeignChunkCorrupt { .. })
        ),
        "{err}"
    );
    assert!(err.to_string().contains(&object), "{err}");
    assert!(!node10.contains(&victim.id));
    assert!(node10.snapshots().expect("ids").is_empty());
    assert!(!w.join("pulled-c-bad").exists());
    r.put(&object, &good).expect("restore object");

    // D shares C's pages: the loose chunks count as present, only D's own go up, in a pack.
    let d = snapshot(
        w,
        "fn-d",
        &[("pages-1.img", old_pages), ("core.img", vec![6; 100])],
        Some(key),
    );
    let pushed_d = push(&r, &node7, &d, "fn-d", Trust::Key(key), 4, &quiet).expect("push d");
    assert_eq!(pushed_d.uploaded, 1, "{pushed_d:?}");
    assert_eq!(pushed_d.present, pushed_d.chunks - 1, "{pushed_d:?}");
    // Pulled where C is: only D's core.img, from its pack.
    let pulled_d = pull(
        &remote(config),
        &node8,
        "fn-d",
        &w.join("pulled-d"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("pull d");
    assert_eq!(
        (pulled_d.fetched, pulled_d.ranges, pulled_d.loose),
        (1, 1, 0),
        "{pulled_d:?}"
    );
    // Pulled into an empty store: C's chunks loose, D's own from its pack.
    let node9 = ChunkStore::open(&w.join("node9")).expect("store 9");
    let pulled_d = pull(
        &remote(config),
        &node9,
        "fn-d",
        &w.join("pulled-d2"),
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("pull d fresh");
    assert_eq!(pulled_d.fetched, pulled_d.chunks, "{pulled_d:?}");
    assert_eq!(pulled_d.loose, pulled_d.chunks - 1, "{pulled_d:?}");
    assert_eq!(pulled_d.ranges, 1, "{pulled_d:?}");
    Snapshot::open(&w.join("pulled-d2"))
        .expect("open")
        .verify()
        .expect("verify d");
}

fn wrong_credentials(server: &Seaweed, w: &Path) {
    let bad = server.config(w, "snaps-bad", &server.endpoint(), "not-the-secret");
    let text = fs::read_to_string(&bad)
        .expect("read")
        .replace("bucket = \"snaps-bad\"", "bucket = \"snaps\"");
    fs::write(&bad, text).expect("write");
    let node = ChunkStore::open(&w.join("node5")).expect("store 5");
    let err = pull(
        &remote(&bad),
        &node,
        "fn-a",
        &w.join("p5"),
        Trust::Unkeyed,
        4,
        &quiet,
    )
    .expect_err("denied");
    assert!(
        matches!(&err, TransferError::Remote(e) if matches!(**e, ObjError::Denied { .. })),
        "{err}"
    );
    let line = err.to_string();
    assert!(
        line.contains("refused the credentials") && line.contains("snaps-bad.credentials"),
        "{line}"
    );
}

fn unknown_snapshot_and_missing_bucket(server: &Seaweed, w: &Path) {
    let config = server.config(w, "snaps", &server.endpoint(), SECRET_KEY);
    let node = ChunkStore::open(&w.join("node6")).expect("store 6");
    let err = pull(
        &remote(&config),
        &node,
        "nope",
        &w.join("p6"),
        Trust::Unkeyed,
        4,
        &quiet,
    )
    .expect_err("unknown");
    assert!(matches!(err, TransferError::NotInBucket { .. }), "{err}");
    let none = server.config(w, "no-such-bucket", &server.endpoint(), SECRET_KEY);
    let err = pull(
        &remote(&none),
        &node,
        "fn-a",
        &w.join("p7"),
        Trust::Unkeyed,
        4,
        &quiet,
    )
    .expect_err("no bucket");
    assert!(
        matches!(&err, TransferError::Remote(e) if matches!(**e, ObjError::NoBucket { .. })),
        "{err}"
    );
    // Every kind of GET, a listing and a delete tell a missing bucket from a missing object.
    let (gone, there) = (remote(&none), remote(&config));
    let no_bucket = |r: Result<(), ObjError>, what: &str| {
        let e = r.expect_err(what);
        assert!(matches!(e, ObjError::NoBucket { .. }), "{what}: {e}");
        assert!(
            e.to_string().contains("no-such-bucket does not exist"),
            "{e}"
        );
    };
    no_bucket(gone.get("k", 10).map(drop), "get");
    no_bucket(
        gone.get_into("k", &mut Vec::new(), 10).map(drop),
        "get_into",
    );
    no_bucket(gone.get_range("k", 0, 10).map(drop), "get_range");
    no_bucket(gone.list("").map(drop), "list");
    no_bucket(gone.delete("k"), "delete");
    assert_eq!(there.get("nowhere", 10).expect("missing"), None);
}

/// `get_into` (torpord's platform-loaded data): an object streams into the writer with its
/// length; a missing one is `None`; one over the limit is `TooLarge` after limit + 1 bytes.
fn streamed_get(config: &Path) {
    let r = remote(config);
    let data = pages("streamed", (3 << 20) + 17);
    r.put("data/t/obj.bin", &data).expect("put");
    let mut out = Vec::new();
    let n = r
        .get_into("data/t/obj.bin", &mut out, data.len() as u64)
        .expect("get_into");
    assert_eq!((n, out.len()), (Some(data.len() as u64), data.len()));
    assert!(out == data);
    let mut none = Vec::new();
    assert_eq!(
        r.get_into("data/t/nowhere.bin", &mut none, 10)
            .expect("missing"),
        None
    );
    let mut short = Vec::new();
    let err = r
        .get_into("data/t/obj.bin", &mut short, 1000)
        .expect_err("too large");
    assert!(
        matches!(err, ObjError::TooLarge { limit: 1000, .. }),
        "{err}"
    );
    assert_eq!(short.len(), 1001);
    // Ranged GETs: the bytes asked for; past the end, what there is.
    let part = r
        .get_range("data/t/obj.bin", 1000, 5000)
        .expect("range")
        .expect("object");
    assert!(part == data[1000..6000]);
    let end = data.len() as u64;
    let tail = r
        .get_range("data/t/obj.bin", end - 10, 100)
        .expect("tail")
        .expect("object");
    assert!(tail == data[data.len() - 10..]);
    let past = r
        .get_range("data/t/obj.bin", end + 10, 100)
        .expect("past")
        .expect("object");
    assert!(past.is_empty());
    assert_eq!(
        r.get_range("data/t/nowhere.bin", 0, 10).expect("none"),
        None
    );
    // Listings go past a page (1 000 keys): every key once, relative to the prefix.
    let keys: Vec<String> = (0..1100).map(|i| format!("list-test/{i:05}")).collect();
    put_all_parallel(&keys, |k| r.put(k, b"x").expect("put"));
    let before = r.traffic().requests;
    let mut listed: Vec<String> = r
        .list("list-test/")
        .expect("list")
        .into_iter()
        .map(|(k, size)| {
            assert_eq!(size, 1, "{k}");
            k
        })
        .collect();
    assert_eq!(r.traffic().requests - before, 2, "two pages");
    listed.sort();
    assert_eq!(listed, keys);
    assert!(r.list("list-nothing/").expect("empty").is_empty());
}

/// Runs `f` on every item, 16 threads at once.
fn put_all_parallel(items: &[String], f: impl Fn(&String) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                f(item);
            });
        }
    });
}

/// A snapshot's files and its sealed segment record pulled together (`pull_snapshot`, as
/// torpord pulls a split snapshot): both records committed, every chunk fetched once. Then the
/// errors of the pipeline: a segment chunk whose bytes do not match its id, and the server
/// gone in the middle of the segments, each fail the whole pull in one line, with neither
/// record committed and no directory, while the files' chunks fetched stay in the store for the
/// next pull.
fn files_and_segments_in_one_pipeline(
    server: &Seaweed,
    w: &Path,
    config: &Path,
    key: &SnapshotKey,
) {
    // Node 1: the files of fn-s and a sealed record of its segments (4 MiB chunks, as the
    // split path's), pushed.
    let node1 = ChunkStore::open(&w.join("seg-node1")).expect("store");
    let files = snapshot(
        w,
        "fn-s",
        &[
            ("pages-1.img", pages("s-pages", 2 << 20)),
            ("core.img", pages("s-core", 5000)),
        ],
        Some(key),
    );
    let segments = pages("s-segments", 12 << 20);
    let mut writer = node1.writer().expect("writer");
    let recipe = writer.put_bytes("segment-0", &segments).expect("put");
    writer
        .commit_sealed("fn-s-1", std::slice::from_ref(&recipe), key)
        .expect("commit sealed");
    let r = remote(config);
    push(
        &r,
        &node1,
        &files,
        "fn-s-1.files",
        Trust::Key(key),
        4,
        &quiet,
    )
    .expect("push files");
    let up = push_sealed_record(&r, &node1, "fn-s-1", key, 4, &quiet).expect("push sealed");
    assert_eq!(up.moved, 3, "{up:?}");
    let part = SealedPart { id: "fn-s-1", key };

    // A fresh node pulls both at once.
    let node2 = ChunkStore::open(&w.join("seg-node2")).expect("store 2");
    let out = w.join("pulled-s");
    let got = pull_snapshot(
        &remote(config),
        &node2,
        "fn-s-1.files",
        &out,
        Trust::Key(key),
        Some(part),
        DEFAULT_PARALLEL,
        &quiet,
    )
    .expect("pull files and segments");
    let sealed = got.sealed.expect("the sealed record came");
    assert_eq!((sealed.chunks, sealed.moved), (3, 3), "{got:?}");
    assert_eq!(got.files.fetched, got.files.chunks, "{got:?}");
    let t = got.files.timings;
    assert!(
        t.files_fetch_s > 0.0 && t.segments_fetch_s > 0.0 && t.fetch_s >= t.files_fetch_s,
        "{t:?}"
    );
    assert_eq!(
        node2.sealed_recipes("fn-s-1", key).expect("sealed record"),
        std::slice::from_ref(&recipe)
    );
    let mut ids = node2.snapshots().expect("ids");
    ids.sort();
    assert_eq!(ids, ["fn-s-1", "fn-s-1.files"]);
    let mut back = vec![0u8; segments.len()];
    node2.read_into(&recipe, &mut back).expect("read segment");
    assert!(back == segments);
    Snapshot::open(&out)
        .expect("open")
        .verify()
        .expect("verify");
    held_until_after_the_answer(config, w, key, part, &recipe, &segments);
    // A snapshot without a sealed record pulls as its files alone.
    let plain = pull_snapshot(
        &remote(config),
        &node2,
        "fn-a",
        &w.join("pulled-s-plain"),
        Trust::Key(key),
        Some(SealedPart { id: "fn-a", key }),
        4,
        &quiet,
    )
    .expect("pull without a sealed record");
    assert!(plain.sealed.is_none(), "{plain:?}");

    // A segment chunk whose bytes do not match its id: the last byte of its range in the pack.
    let victim = recipe.chunks[1];
    let (pack, offset, len) = place_of_in(&r, "fn-s-1/sealed-packs.json", &victim.id.to_hex());
    let object = format!("packs/{pack}.pack");
    let good = r.get(&object, 1 << 30).expect("get pack").expect("pack");
    let mut bad = good.clone();
    bad[(offset + len - 1) as usize] ^= 0x55;
    r.put(&object, &bad).expect("overwrite");
    let node3 = ChunkStore::open(&w.join("seg-node3")).expect("store 3");
    let out3 = w.join("pulled-s-bad");
    let err = pull_snapshot(
        &remote(config),
        &node3,
        "fn-s-1.files",
        &out3,
        Trust::Key(key),
        Some(part),
        4,
        &quiet,
    )
    .expect_err("a corrupt segment chunk");
    assert!(
        matches!(
            err,
            TransferError::Store(StoreError::ForeignChunkCorrupt { .. })
        ),
        "{err}"
    );
    let line = err.to_string();
    assert!(line.contains(&object) && !line.contains('\n'), "{line}");
    assert!(!node3.contains(&victim.id));
    assert!(
        node3.snapshots().expect("ids").is_empty(),
        "nothing committed"
    );
    assert!(!out3.exists());
    no_aside_left(w);
    // The files' chunks came and stay (verified, unreferenced): the next pull reuses them.
    let pages_chunk = node1.recipes("fn-s-1.files").expect("recipes")[0].chunks[0];
    assert!(node3.contains(&pages_chunk.id));
    r.put(&object, &good).expect("restore pack");

    // The server gone in the middle of the segments (they come after the files).
    let node4 = ChunkStore::open(&w.join("seg-node4")).expect("store 4");
    let proxy = Proxy::start(server.s3_port);
    let via_proxy = server.config(
        w,
        "snaps-proxied-s2",
        &format!("http://127.0.0.1:{}", proxy.port),
        SECRET_KEY,
    );
    let text = fs::read_to_string(&via_proxy)
        .expect("read")
        .replace("bucket = \"snaps-proxied-s2\"", "bucket = \"snaps\"");
    fs::write(&via_proxy, text).expect("write");
    // The files are ~2 MiB, the segments one range of 12 MiB, fetched one after the other
    // (one fetcher): cut 6 MiB in, inside the segments.
    proxy.cut_after(6 << 20);
    let out4 = w.join("pulled-s-gone");
    let err = pull_snapshot(
        &remote(&via_proxy),
        &node4,
        "fn-s-1.files",
        &out4,
        Trust::Key(key),
        Some(part),
        1,
        &quiet,
    )
    .expect_err("server gone");
    assert!(
        matches!(&err, TransferError::Remote(e) if matches!(**e, ObjError::Unreachable { .. })),
        "{err}"
    );
    assert!(!err.to_string().contains('\n'), "{err}");
    assert!(
        node4.snapshots().expect("ids").is_empty(),
        "nothing committed"
    );
    assert!(!out4.exists());
    no_aside_left(w);
    assert!(
        node4.contains(&pages_chunk.id),
        "the files' chunks came first and stay"
    );
    // With the server back, the pull completes, fetching only what it lacked.
    let again = pull_snapshot(
        &remote(config),
        &node4,
        "fn-s-1.files",
        &out4,
        Trust::Key(key),
        Some(part),
        4,
        &quiet,
    )
    .expect("pull after");
    assert_eq!(again.files.fetched, 0, "{again:?}");
    assert_eq!(again.sealed.expect("sealed").moved, 3, "{again:?}");
    Snapshot::open(&out4)
        .expect("open")
        .verify()
        .expect("verify");
    let mut ids = node4.snapshots().expect("ids");
    ids.sort();
    assert_eq!(ids, ["fn-s-1", "fn-s-1.files"]);
}

/// A pull that answers before its chunk files are written (`pull_snapshot_deferred` with
/// `hold_bytes`): at its answer no chunk file is in the store, yet the directory verifies, the
/// store (and another `ChunkStore` of its root, as the restore server's) reads every segment
/// from memory and says it has every chunk; `finish` writes them all, then nothing is held.
/// With `hold_bytes` 0 every chunk is written before the answer, as before.
fn held_until_after_the_answer(
    config: &Path,
    w: &Path,
    key: &SnapshotKey,
    part: SealedPart<'_>,
    recipe: &torpor_image::store::Recipe,
    segments: &[u8],
) {
    let chunk_files = |store: &ChunkStore| walk_files(&store.root().join("chunks"));
    for (name, hold_bytes) in [("held", 1u64 << 30), ("unheld", 0)] {
        let store = ChunkStore::open(&w.join(format!("seg-node-{name}"))).expect("store");
        let out = w.join(format!("pulled-s-{name}"));
        let (got, pending) = pull_snapshot_deferred(
            &remote(config),
            &store,
            "fn-s-1.files",
            &out,
            Trust::Key(key),
            Some(part),
            4,
            AfterAnswer {
                early_write_back: false,
                hold_bytes,
            },
            &quiet,
            None,
        )
        .expect("deferred pull");
        let pending = pending.expect("records committed");
        let total = (got.files.chunks + got.sealed.expect("sealed").chunks) as usize;
        Snapshot::open(&out)
            .expect("open")
            .verify()
            .expect("verify");
        let other = ChunkStore::open(store.root()).expect("another store of the root");
        let mut back = vec![0u8; segments.len()];
        other.read_into(recipe, &mut back).expect("read segment");
        assert!(back == segments);
        if hold_bytes > 0 {
            assert_eq!(
                chunk_files(&store),
                0,
                "a chunk file was written before the answer"
            );
            assert_eq!(pending.held_chunks(), total);
            assert!(recipe.chunks.iter().all(|c| other.contains(&c.id)));
        } else {
            assert_eq!(chunk_files(&store), total);
            assert_eq!(pending.held_chunks(), 0);
        }
        pending.finish().expect("finish");
        assert_eq!(store.held_chunks(), 0);
        assert_eq!(chunk_files(&store), total);
        let mut back = vec![0u8; segments.len()];
        store.read_into(recipe, &mut back).expect("read segment");
        assert!(back == segments);
    }
}

/// Regular files under `dir`, at any depth.
fn walk_files(dir: &Path) -> usize {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => walk_files(&e.path()),
                    Ok(t) if t.is_file() => 1,
                    _ => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}

/// No directory a pull writes aside (`.<name>.pull-<pid>`) is left in `dir`.
fn no_aside_left(dir: &Path) {
    assert!(fs::read_dir(dir).expect("ls").all(|e| !e
        .expect("entry")
        .file_name()
        .to_string_lossy()
        .contains(".pull-")));
}

/// (pack name, offset, length) of `chunk` in the locator object `snapshots/<locator>`.
fn place_of_in(r: &Remote, locator: &str, chunk: &str) -> (String, u64, u64) {
    let bytes = r
        .get(&format!("snapshots/{locator}"), 64 << 20)
        .expect("get locator")
        .expect("a locator");
    let locator: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    for (name, p) in locator["packs"].as_object().expect("packs") {
        for c in p["chunks"].as_array().expect("chunks") {
            if c[0].as_str() == Some(chunk) {
                return (
                    name.clone(),
                    c[1].as_u64().expect("offset"),
                    c[2].as_u64().expect("len"),
                );
            }
        }
    }
    panic!("{chunk} not in {locator}");
}
