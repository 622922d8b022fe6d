//! The chunk store on real files: dedup, reference counts, GC (also racing writers),
//! corruption, compression, and the error paths.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use torpor_image::store::{
    ChunkId, ChunkStore, Chunking, Compression, Recipe, StoreError, SEGMENT_CHUNK_BYTES,
};

/// Reproducible bytes that no compressor can shrink (BLAKE3's extendable output).
fn random(len: usize, seed: &str) -> Vec<u8> {
    let mut data = vec![0u8; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut data);
    data
}

fn store() -> (tempfile::TempDir, ChunkStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = ChunkStore::open(&dir.path().join("store")).expect("open");
    (dir, store)
}

/// Every chunk file in the store, with its size.
fn chunk_files(store: &ChunkStore) -> Vec<(PathBuf, u64)> {
    let mut files = Vec::new();
    for fan in fs::read_dir(store.root().join("chunks")).expect("chunks") {
        for entry in fs::read_dir(fan.expect("fan").path()).expect("fan dir") {
            let entry = entry.expect("entry");
            files.push((entry.path(), entry.metadata().expect("meta").len()));
        }
    }
    files.sort();
    files
}

fn ids(recipe: &Recipe) -> HashSet<ChunkId> {
    recipe.chunks.iter().map(|c| c.id).collect()
}

fn read_back(store: &ChunkStore, recipe: &Recipe) -> Vec<u8> {
    let mut buf = vec![0u8; recipe.size as usize];
    store.read_into(recipe, &mut buf).expect("read_into");
    buf
}

#[test]
fn identical_data_under_two_snapshots_is_stored_once() {
    let (_dir, store) = store();
    // Two and a half segment chunks: the last one short.
    let segment = random(2 * SEGMENT_CHUNK_BYTES + 12_345, "weights");

    let mut writer = store.writer().expect("writer");
    let a = writer.put_bytes("seg-0", &segment).expect("put");
    assert_eq!(a.chunks.len(), 3);
    assert_eq!(a.chunks[2].len, 12_345);
    assert_eq!(writer.stats().new_chunks, 3);
    writer
        .commit("base", std::slice::from_ref(&a))
        .expect("commit");
    let after_first = chunk_files(&store);

    let mut writer = store.writer().expect("writer");
    let b = writer.put_bytes("seg-0", &segment).expect("put");
    assert_eq!(writer.stats().new_chunks, 0, "nothing new to write");
    assert_eq!(writer.stats().logical_bytes, segment.len() as u64);
    writer
        .commit("fn-a", std::slice::from_ref(&b))
        .expect("commit");
    assert_eq!(a, b);
    assert_eq!(chunk_files(&store), after_first, "stored once");

    for c in &a.chunks {
        assert_eq!(store.refcount(&c.id).expect("refcount"), 2);
    }
    let usage = store.usage("base").expect("usage");
    let on_disk: u64 = after_first.iter().map(|(_, size)| size).sum();
    assert_eq!(usage.logical, segment.len() as u64);
    assert_eq!(usage.unique, segment.len() as u64);
    assert_eq!(usage.stored, on_disk);
    assert_eq!(usage.exclusive, 0);
    assert_eq!(
        usage.shared_with.into_iter().collect::<Vec<_>>(),
        [("fn-a".to_owned(), segment.len() as u64)]
    );
    assert_eq!(read_back(&store, &b), segment);
    assert_eq!(store.snapshots().expect("list"), ["base", "fn-a"]);
    assert_eq!(store.recipes("fn-a").expect("recipes"), [b]);
}

#[test]
fn gc_after_release_keeps_the_other_snapshot_and_deletes_only_the_unreferenced() {
    let (_dir, store) = store();
    let common = random(SEGMENT_CHUNK_BYTES, "framework");
    let only_a = random(SEGMENT_CHUNK_BYTES + 1, "a");
    let only_b = random(3 * SEGMENT_CHUNK_BYTES / 2, "b");

    let mut writer = store.writer().expect("writer");
    let a = [
        writer.put_bytes("common", &common).expect("put"),
        writer.put_bytes("mine", &only_a).expect("put"),
    ];
    writer.commit("a", &a).expect("commit");
    let mut writer = store.writer().expect("writer");
    let b = [
        writer.put_bytes("common", &common).expect("put"),
        writer.put_bytes("mine", &only_b).expect("put"),
    ];
    writer.commit("b", &b).expect("commit");
    let usage_a = store.usage("a").expect("usage");
    assert!(usage_a.exclusive > only_a.len() as u64, "{usage_a:?}");

    // Releasing alone deletes nothing.
    store.release("a").expect("release");
    assert_eq!(chunk_files(&store).len(), 1 + 2 + 2);
    let report = store.gc().expect("gc");
    assert_eq!(report.snapshots, 1);
    assert_eq!(report.deleted_chunks, 2, "{report:?}");
    assert_eq!(report.freed_bytes, usage_a.exclusive);
    assert_eq!(report.kept_chunks, 3);
    for id in ids(&a[1]) {
        assert!(
            !store.contains(&id),
            "{id} of the released snapshot survived"
        );
    }
    for recipe in &b {
        for id in ids(recipe) {
            assert!(store.contains(&id));
            assert_eq!(store.refcount(&id).expect("refcount"), 1);
        }
    }
    assert_eq!(read_back(&store, &b[0]), common);
    assert_eq!(read_back(&store, &b[1]), only_b);

    // A second GC finds nothing; after the last release, nothing is left.
    assert_eq!(store.gc().expect("gc").deleted_chunks, 0);
    store.release("b").expect("release");
    store.gc().expect("gc");
    assert!(chunk_files(&store).is_empty());
    let err = store.release("b").expect_err("gone");
    assert!(matches!(err, StoreError::UnknownSnapshot { .. }), "{err}");
}

#[test]
fn gc_never_deletes_what_a_writer_is_about_to_commit() {
    let (_dir, store) = store();
    let data = random(2 * SEGMENT_CHUNK_BYTES, "in flight");
    let mut writer = store.writer().expect("writer");
    let recipe = writer.put_bytes("seg", &data).expect("put");

    // Unreferenced but in flight: a GC that does not wait is refused, one that waits blocks.
    assert_eq!(store.try_gc().expect("try_gc"), None);
    let gc_store = store.clone();
    let gc = std::thread::spawn(move || gc_store.gc().expect("gc"));
    for id in ids(&recipe) {
        assert!(store.contains(&id));
    }
    writer
        .commit("s", std::slice::from_ref(&recipe))
        .expect("commit");
    let report = gc.join().expect("gc thread");
    assert_eq!(report.deleted_chunks, 0, "{report:?}");
    assert_eq!(read_back(&store, &recipe), data);

    // An abandoned writer's chunks are garbage once it is gone.
    let mut writer = store.writer().expect("writer");
    let abandoned = writer
        .put_bytes("seg", &random(1000, "abandoned"))
        .expect("put");
    drop(writer);
    let report = store.try_gc().expect("try_gc").expect("no writer left");
    assert_eq!(report.deleted_chunks, 1);
    assert!(!store.contains(&abandoned.chunks[0].id));
    // And committing a recipe whose chunks GC took is refused rather than left dangling.
    let err = store
        .writer()
        .expect("writer")
        .commit("late", &[abandoned])
        .expect_err("dangling");
    assert!(matches!(err, StoreError::MissingChunk { .. }), "{err}");
    assert_eq!(store.snapshots().expect("list"), ["s"]);
}

#[test]
fn writers_and_gc_racing_lose_nothing_committed() {
    let (_dir, store) = store();
    let shared = random(300_000, "shared");
    let small = Chunking::Fixed { bytes: 16 * 1024 };
    let done = Arc::new(AtomicBool::new(false));
    let collector = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let mut runs = 0u32;
            while !done.load(Ordering::Acquire) {
                store.gc().expect("gc");
                runs += 1;
            }
            runs
        })
    };
    let writers: Vec<_> = (0..3)
        .map(|w| {
            let (store, shared) = (store.clone(), shared.clone());
            std::thread::spawn(move || {
                let mut kept = Vec::new();
                for n in 0..6 {
                    let id = format!("w{w}-{n}");
                    let own = random(100_000 + n * 4097, &id);
                    let mut writer = store.writer().expect("writer");
                    let recipes = [
                        writer
                            .put_bytes_with("shared", &shared, small)
                            .expect("put"),
                        writer.put_bytes_with("own", &own, small).expect("put"),
                    ];
                    writer.commit(&id, &recipes).expect("commit");
                    // Release every other one so that GC has real garbage to take.
                    if n % 2 == 1 {
                        store.release(&id).expect("release");
                    } else {
                        kept.push((id, own, recipes));
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<_> = writers
        .into_iter()
        .flat_map(|w| w.join().expect("writer thread"))
        .collect();
    done.store(true, Ordering::Release);
    let runs = collector.join().expect("gc thread");
    assert!(runs > 0);
    store.gc().expect("final gc");
    assert_eq!(kept.len(), 9);
    for (id, own, recipes) in &kept {
        assert_eq!(read_back(&store, &recipes[0]), shared, "{id}");
        assert_eq!(&read_back(&store, &recipes[1]), own, "{id}");
        assert_eq!(store.recipes(id).expect("recipes"), recipes.to_vec());
    }
    // Exactly the kept snapshots' chunks remain.
    let live: HashSet<ChunkId> = kept
        .iter()
        .flat_map(|(_, _, r)| r.iter().flat_map(ids))
        .collect();
    assert_eq!(chunk_files(&store).len(), live.len());
}

#[test]
fn a_flipped_byte_is_refused_naming_chunk_file_and_snapshot() {
    let (dir, store) = store();
    let store = store.with_compression(Compression::None);
    let image = dir.path().join("pages-1.img");
    let pages = random(200 * 4096, "pages");
    fs::write(&image, &pages).expect("write");
    let mut writer = store.writer().expect("writer");
    let recipe = writer.put_file(&image, "pages-1.img").expect("put");
    assert!(recipe.chunks.len() > 3, "page CDC cuts it");
    writer
        .commit("fn-resnet", std::slice::from_ref(&recipe))
        .expect("commit");

    let victim = recipe.chunks[1].id;
    let path = store.chunk_path(&victim);
    let mut bytes = fs::read(&path).expect("chunk");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&path, &bytes).expect("corrupt it");

    let out = dir.path().join("out");
    fs::create_dir(&out).expect("mkdir");
    let err = store
        .materialise(&recipe, &out.join("pages-1.img"))
        .expect_err("corrupt");
    let text = err.to_string();
    assert!(matches!(err, StoreError::CorruptChunk { .. }), "{text}");
    for needle in [
        victim.to_hex().as_str(),
        "pages-1.img",
        "fn-resnet",
        "re-take",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    assert!(!text.contains('\n'), "one line: {text}");
    assert!(!out.join("pages-1.img").exists(), "no partial output left");
    // Moved aside: the next read says missing, and storing the data again heals the store.
    assert!(store.root().join("corrupt").join(victim.to_hex()).exists());
    let mut buf = vec![0; pages.len()];
    let err = store.read_into(&recipe, &mut buf).expect_err("missing");
    assert!(matches!(err, StoreError::MissingChunk { .. }), "{err}");
    let mut writer = store.writer().expect("writer");
    let again = writer.put_file(&image, "pages-1.img").expect("put");
    assert_eq!(writer.stats().new_chunks, 1);
    writer.commit("fn-resnet-2", &[again]).expect("commit");
    store
        .materialise(&recipe, &out.join("pages-1.img"))
        .expect("healed");
    assert_eq!(fs::read(out.join("pages-1.img")).expect("read"), pages);
}

#[test]
fn zstd_roundtrip_and_incompressible_chunks_stay_raw() {
    let (_dir, store) = store();
    let mut compressible = vec![0u8; 3 * 1024 * 1024];
    compressible[..4096].copy_from_slice(&random(4096, "a page of code"));
    let noise = random(1024 * 1024, "weights");

    let mut writer = store.writer().expect("writer");
    let zipped = writer.put_bytes("zeros", &compressible).expect("put");
    let raw = writer.put_bytes("noise", &noise).expect("put");
    writer
        .commit("z", &[zipped.clone(), raw.clone()])
        .expect("commit");
    let size = |r: &Recipe| {
        fs::metadata(store.chunk_path(&r.chunks[0].id))
            .expect("chunk")
            .len()
    };
    assert!(size(&zipped) < 64 * 1024, "compressed: {}", size(&zipped));
    assert_eq!(size(&raw), noise.len() as u64 + 16, "raw body plus header");
    assert_eq!(read_back(&store, &zipped), compressible);
    assert_eq!(read_back(&store, &raw), noise);

    // Compression off: the same data is stored raw.
    let (_dir2, plain) = self::store();
    let plain = plain.with_compression(Compression::None);
    let mut writer = plain.writer().expect("writer");
    let r = writer.put_bytes("zeros", &compressible).expect("put");
    assert_eq!(
        writer.stats().new_stored_bytes,
        compressible.len() as u64 + 16
    );
    writer
        .commit("p", std::slice::from_ref(&r))
        .expect("commit");
    assert_eq!(read_back(&plain, &r), compressible);
}

#[test]
fn files_materialise_bit_identical_into_a_directory() {
    let (dir, store) = store();
    let src = dir.path().join("dump");
    fs::create_dir_all(src.join("sub")).expect("mkdir");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("pages-1.img", random(300 * 4096, "p")),
        ("core-1.img", b"core".repeat(1000)),
        ("empty.img", Vec::new()),
        ("sub/nested.img", random(777, "n")),
    ];
    let mut writer = store.writer().expect("writer");
    let mut recipes = Vec::new();
    for (name, data) in &files {
        fs::write(src.join(name), data).expect("write");
        recipes.push(writer.put_file(&src.join(name), name).expect("put"));
    }
    assert_eq!(recipes[1].chunks.len(), 1, "small files are one chunk");
    assert!(recipes[2].chunks.is_empty());
    writer.commit("s", &recipes).expect("commit");

    let out = dir.path().join("tmpfs-like");
    fs::create_dir(&out).expect("mkdir");
    store.materialise_all(&recipes, &out).expect("materialise");
    for (name, data) in &files {
        assert_eq!(&fs::read(out.join(name)).expect("read"), data, "{name}");
    }
    let err = store
        .materialise(&recipes[0], &out.join("pages-1.img"))
        .expect_err("exists");
    assert!(matches!(err, StoreError::DestExists { .. }), "{err}");

    // A recipe whose whole hash lies is refused even though every chunk is fine.
    let mut lying = recipes[1].clone();
    lying.blake3 = blake3::hash(b"other").to_hex().to_string();
    let err = store
        .materialise(&lying, &out.join("lying.img"))
        .expect_err("hash");
    assert!(matches!(err, StoreError::WholeHashMismatch { .. }), "{err}");
    assert!(!out.join("lying.img").exists());
    let mut escaping = recipes[1].clone();
    escaping.name = "../escape.img".into();
    assert!(store.materialise_all(&[escaping], &out).is_err());
    let err = store
        .read_into(&recipes[0], &mut [0u8; 10])
        .expect_err("size");
    assert!(matches!(err, StoreError::BufferSize { .. }), "{err}");
}

#[test]
fn bad_ids_duplicates_and_corrupt_records_are_refused() {
    let (_dir, store) = store();
    let mut writer = store.writer().expect("writer");
    let r = writer.put_bytes("a", b"some bytes").expect("put");
    let err = writer
        .commit("../x", std::slice::from_ref(&r))
        .expect_err("id");
    assert!(matches!(err, StoreError::InvalidSnapshotId { .. }), "{err}");

    let writer = store.writer().expect("writer");
    writer
        .commit("one", std::slice::from_ref(&r))
        .expect("commit");
    let writer = store.writer().expect("writer");
    let err = writer
        .commit("one", std::slice::from_ref(&r))
        .expect_err("twice");
    assert!(matches!(err, StoreError::SnapshotExists { .. }), "{err}");
    let writer = store.writer().expect("writer");
    let err = writer
        .commit("two", &[r.clone(), r.clone()])
        .expect_err("dup");
    assert!(matches!(err, StoreError::InvalidRecipe { .. }), "{err}");

    let err = store.usage("x").expect_err("unknown");
    assert!(matches!(err, StoreError::UnknownSnapshot { .. }), "{err}");
    // GC refuses to guess when a record is unreadable, and deletes nothing.
    fs::write(store.root().join("refs/broken.json"), b"{not json").expect("write");
    let err = store.gc().expect_err("corrupt record");
    assert!(matches!(err, StoreError::RecordCorrupt { .. }), "{err}");
    assert!(err.to_string().contains("broken.json"), "{err}");
    assert!(store.contains(&r.chunks[0].id));
}

#[test]
fn an_unusable_store_directory_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("file");
    fs::write(&file, b"").expect("write");
    let err = ChunkStore::open(&file.join("store")).expect_err("under a file");
    assert!(matches!(err, StoreError::Unusable { .. }), "{err}");
    assert!(err.to_string().contains("create that directory"), "{err}");
}

/// A full disk, for real: a 1 MiB tmpfs (needs root and mount(2); skipped otherwise).
#[test]
fn a_full_disk_says_so() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("small");
    fs::create_dir(&mnt).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIP a_full_disk_says_so: cannot mount a tmpfs (needs root)");
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&mnt);
    let store = ChunkStore::open(&mnt.join("store")).expect("open");
    let mut writer = store.writer().expect("writer");
    let err = writer
        .put_bytes("seg", &random(4 * 1024 * 1024, "too big"))
        .expect_err("full");
    assert!(matches!(err, StoreError::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("no space left"), "{err}");
}

#[test]
fn a_chunk_truncated_by_a_crash_is_written_again_and_chunks_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, store) = store();
    let data = random(100_000, "crash");
    let mut writer = store.writer().expect("writer");
    let first = writer.put_bytes("seg", &data).expect("put");
    drop(writer); // died before commit
    let path = store.chunk_path(&first.chunks[0].id);
    assert_eq!(
        fs::metadata(&path).expect("chunk").permissions().mode() & 0o777,
        0o600
    );
    assert_eq!(
        fs::metadata(store.root().join("chunks"))
            .expect("dir")
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
    // What a power loss before the data reached the disk leaves: the name, no contents.
    fs::write(&path, b"").expect("truncate");
    let mut writer = store.writer().expect("writer");
    let again = writer.put_bytes("seg", &data).expect("put");
    assert_eq!(writer.stats().new_chunks, 1, "rewritten, not trusted");
    writer
        .commit("s", std::slice::from_ref(&again))
        .expect("commit");
    assert_eq!(read_back(&store, &again), data);
}

/// A segment large enough to be hashed whole while its chunks are read (>= 16 MiB, chunks read
/// on the read pool, in any order): it reads back exact; a damaged chunk is refused naming it;
/// a recipe whose whole hash is not its contents' is refused though every chunk checks out.
#[test]
fn a_large_segment_is_checked_chunk_by_chunk_and_whole() {
    let (_dir, store) = store();
    let store = store.with_compression(Compression::None);
    let segment = random(6 * SEGMENT_CHUNK_BYTES + 4096, "large");
    let mut writer = store.writer().expect("writer");
    let recipe = writer.put_bytes("seg-large", &segment).expect("put");
    writer
        .commit("fn-large", std::slice::from_ref(&recipe))
        .expect("commit");
    assert_eq!(recipe.chunks.len(), 7);
    assert_eq!(read_back(&store, &recipe), segment);

    // Every chunk is right, the recipe's whole hash is not (a recipe altered on its own).
    let mut altered = recipe.clone();
    altered.blake3 = blake3::hash(b"something else").to_hex().to_string();
    let mut buf = vec![0u8; segment.len()];
    let err = store.read_into(&altered, &mut buf).expect_err("whole");
    assert!(matches!(err, StoreError::WholeHashMismatch { .. }), "{err}");

    // A byte flipped in the last chunk but one.
    let victim = recipe.chunks[5].id;
    let path = store.chunk_path(&victim);
    let mut bytes = fs::read(&path).expect("chunk");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    fs::write(&path, &bytes).expect("corrupt it");
    let err = store.read_into(&recipe, &mut buf).expect_err("corrupt");
    assert!(matches!(err, StoreError::CorruptChunk { .. }), "{err}");
    assert!(
        err.to_string().contains(&victim.to_hex().to_string()),
        "{err}"
    );
}

#[test]
fn commit_many_commits_every_record_after_one_check_or_none() {
    let (_dir, store) = store();
    let key = torpor_image::SnapshotKey::from_bytes([3; 32], Path::new("/nonexistent/key"));
    // A writer that writes its chunks back early stores the same chunks, readable at once.
    let mut w = store.writer().expect("writer").write_back_early();
    let a = w.put_bytes("seg-a", &random(5 << 20, "a")).expect("a");
    let b = w.put_bytes("seg-b", &random(1 << 20, "b")).expect("b");
    assert_eq!(read_back(&store, &a), random(5 << 20, "a"));
    w.commit_many(&[
        torpor_image::store::Commit {
            id: "files",
            recipes: std::slice::from_ref(&a),
            key: None,
        },
        torpor_image::store::Commit {
            id: "segments",
            recipes: std::slice::from_ref(&b),
            key: Some(&key),
        },
    ])
    .expect("commit both");
    let mut ids = store.snapshots().expect("ids");
    ids.sort();
    assert_eq!(ids, ["files", "segments"]);
    assert_eq!(
        store.recipes("files").expect("files"),
        std::slice::from_ref(&a)
    );
    assert_eq!(
        store.sealed_recipes("segments", &key).expect("sealed"),
        std::slice::from_ref(&b)
    );

    // One record that cannot be committed (a chunk a GC took, an id taken): neither is.
    let mut w = store.writer().expect("writer");
    let c = w.put_bytes("seg-c", &random(1 << 20, "c")).expect("c");
    let mut gone = c.clone();
    gone.chunks[0].id = ChunkId::of(b"never stored");
    let err = w
        .commit_many(&[
            torpor_image::store::Commit {
                id: "c",
                recipes: std::slice::from_ref(&c),
                key: None,
            },
            torpor_image::store::Commit {
                id: "gone",
                recipes: std::slice::from_ref(&gone),
                key: None,
            },
        ])
        .expect_err("a missing chunk");
    assert!(matches!(err, StoreError::MissingChunk { .. }), "{err}");
    let w = store.writer().expect("writer");
    let err = w
        .commit_many(&[
            torpor_image::store::Commit {
                id: "c",
                recipes: std::slice::from_ref(&c),
                key: None,
            },
            torpor_image::store::Commit {
                id: "files",
                recipes: std::slice::from_ref(&c),
                key: None,
            },
        ])
        .expect_err("a taken id");
    assert!(matches!(err, StoreError::SnapshotExists { .. }), "{err}");
    let mut ids = store.snapshots().expect("ids");
    ids.sort();
    assert_eq!(ids, ["files", "segments"]);
}

/// A deferred commit: readers find the records at once, each with its pending marker until
/// `finish`; left unfinished (a process killed), `settle` keeps a record whose chunks are all
/// whole and releases one with a damaged chunk (moved aside) or an unreadable record.
#[test]
fn deferred_commits_are_read_at_once_and_settled_from_their_chunks() {
    use torpor_image::store::{Commit, Settled};
    let (_dir, store) = store();
    // A recipe of its own committed deferred as snapshot `name`.
    let put = |name: &str| {
        let mut writer = store.writer().expect("writer");
        let data = random(3 * SEGMENT_CHUNK_BYTES / 2, &format!("deferred-{name}"));
        let recipe = writer.put_bytes(name, &data).expect("put");
        let pending = writer
            .commit_many_deferred(&[Commit {
                id: name,
                recipes: std::slice::from_ref(&recipe),
                key: None,
            }])
            .expect("commit");
        (pending, recipe)
    };
    let (pending, a) = put("a");
    assert_eq!(pending.ids(), ["a"]);
    assert_eq!(store.pending().expect("pending"), ["a"]);
    assert_eq!(
        store.recipes("a").expect("recipes"),
        std::slice::from_ref(&a)
    );
    pending.finish().expect("finish");
    assert!(store.pending().expect("pending").is_empty());

    // Two left pending, as by a process killed before finish.
    let (pending, b) = put("b");
    drop(pending);
    let (pending, c) = put("c");
    drop(pending);
    assert_eq!(store.pending().expect("pending"), ["b", "c"]);
    let victim = store.chunk_path(&c.chunks[1].id);
    let mut raw = fs::read(&victim).expect("chunk");
    *raw.last_mut().expect("bytes") ^= 0xFF;
    fs::write(&victim, raw).expect("write");

    assert_eq!(store.settle("b").expect("settle"), Settled::Committed);
    assert_eq!(
        read_back(&store, &b),
        random(3 * SEGMENT_CHUNK_BYTES / 2, "deferred-b")
    );
    let Settled::Released(why) = store.settle("c").expect("settle") else {
        panic!("a record with a damaged chunk stood");
    };
    assert!(why.contains(&c.chunks[1].id.to_hex()), "{why}");
    assert!(store.pending().expect("pending").is_empty());
    let err = store.recipes("c").expect_err("released");
    assert!(matches!(err, StoreError::UnknownSnapshot { .. }), "{err}");
    assert!(
        !store.contains(&c.chunks[1].id),
        "the damaged chunk was not moved aside"
    );

    // A marker whose record was never written, or is torn: nothing stands.
    fs::write(store.root().join("pending").join("d"), b"").expect("marker");
    fs::write(store.root().join("pending").join("e"), b"").expect("marker");
    fs::write(store.root().join("refs").join("e.json"), b"{\"form").expect("torn record");
    assert!(matches!(
        store.settle("d").expect("settle"),
        Settled::Released(_)
    ));
    assert!(matches!(
        store.settle("e").expect("settle"),
        Settled::Released(_)
    ));
    assert!(store.recipes("e").is_err() && store.pending().expect("pending").is_empty());
    assert_eq!(store.gc().expect("gc").snapshots, 2);
}

/// Where the file system has `O_TMPFILE` (ext4, xfs, btrfs, tmpfs), chunks are made without a
/// name in their own fan-out directory and linked into place, not written into the store's one
/// tmp dir and renamed (which made a pull's writers queue on that directory's lock): with the
/// tmp dir unusable, writers on several threads still store every chunk, each whole and
/// private. Skipped where the file system has no `O_TMPFILE`.
#[test]
fn chunks_are_placed_without_the_shared_tmp_dir() {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let (_dir, store) = store();
    let probe = fs::OpenOptions::new()
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE)
        .open(store.root());
    if probe.is_err() {
        eprintln!("SKIP chunks_are_placed_without_the_shared_tmp_dir: no O_TMPFILE here");
        return;
    }
    // A file where the tmp dir was: nothing can be created in it.
    let tmp = store.root().join("tmp");
    fs::remove_dir(&tmp).expect("rmdir tmp");
    fs::write(&tmp, b"not a directory").expect("tmp file");
    let data: Vec<Vec<u8>> = (0..4).map(|i| random(3 << 20, &format!("t{i}"))).collect();
    let recipes: Vec<Recipe> = std::thread::scope(|s| {
        let handles: Vec<_> = data
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let store = &store;
                s.spawn(move || {
                    let mut w = store.writer().expect("writer");
                    // The same bytes from two threads too: both find the chunk placed.
                    w.put_bytes_with(&format!("f{i}"), d, Chunking::Fixed { bytes: 256 << 10 })
                        .expect("put without the tmp dir")
                })
            })
            .chain((0..2).map(|_| {
                let (store, d) = (&store, &data[0]);
                s.spawn(move || {
                    let mut w = store.writer().expect("writer");
                    w.put_bytes_with("again", d, Chunking::Fixed { bytes: 256 << 10 })
                        .expect("put the same chunks")
                })
            }))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    for (recipe, d) in recipes.iter().zip(data.iter().chain([&data[0], &data[0]])) {
        assert_eq!(&read_back(&store, recipe), d);
    }
    for (path, _) in chunk_files(&store) {
        let mode = fs::metadata(&path).expect("chunk").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", path.display());
    }
    assert_eq!(chunk_files(&store).len(), 4 * 12);
}

/// `src`'s chunk files of a fresh recipe of `len` random bytes: what a pull fetches.
fn foreign_chunks(dir: &Path, len: usize, seed: &str) -> (Recipe, Vec<Vec<u8>>, Vec<u8>) {
    let src = ChunkStore::open(&dir.join(format!("src-{seed}"))).expect("src");
    let data = random(len, seed);
    let mut w = src.writer().expect("writer");
    let recipe = w
        .put_bytes_with("seg", &data, Chunking::Fixed { bytes: 64 << 10 })
        .expect("put");
    w.commit("s", std::slice::from_ref(&recipe))
        .expect("commit");
    let files = recipe
        .chunks
        .iter()
        .map(|c| src.chunk_file(c, "seg").expect("chunk file"))
        .collect();
    (recipe, files, data)
}

/// A pull's writer may hold the chunk files it fetched in memory instead of writing them
/// (`hold_up_to`): every store of that root in the process reads them at once (a restore
/// right after the answer), a deferred commit takes them with the store's lock (no GC
/// meanwhile), and its `finish` writes them, checked, before the syncfs.
#[test]
fn held_chunks_are_read_from_memory_until_the_deferred_commit_writes_them() {
    use torpor_image::store::Commit;
    let (dir, store) = store();
    let (recipe, files, data) = foreign_chunks(dir.path(), 5 * (64 << 10) + 1000, "held");
    let writer = store.writer().expect("writer").hold_up_to(1 << 30);
    let mut scratch = Vec::new();
    for (c, file) in recipe.chunks.iter().zip(&files) {
        let buf = Arc::new(file.clone());
        let put = writer
            .hold_chunk_file(c, &buf, 0..buf.len(), "test", &mut scratch)
            .expect("hold");
        assert!(put.new);
        assert_eq!(put.raw.len() as u64, c.len);
    }
    assert!(chunk_files(&store).is_empty(), "a held chunk was written");
    assert_eq!(store.held_chunks(), recipe.chunks.len());
    // Another store of the same root, as the restore server opens its own.
    let other = ChunkStore::open(store.root()).expect("again");
    assert!(recipe.chunks.iter().all(|c| other.contains(&c.id)));
    assert_eq!(read_back(&other, &recipe), data);
    assert_eq!(
        other.chunk_file(&recipe.chunks[0], "seg").expect("file"),
        files[0]
    );
    let pending = writer
        .commit_many_deferred(&[Commit {
            id: "held",
            recipes: std::slice::from_ref(&recipe),
            key: None,
        }])
        .expect("commit");
    assert_eq!(pending.held_chunks(), recipe.chunks.len());
    assert_eq!(read_back(&store, &recipe), data);
    assert!(
        store.try_gc().expect("gc").is_none(),
        "a GC ran before the held chunks were written"
    );
    pending.finish().expect("finish");
    assert_eq!(store.held_chunks(), 0);
    assert_eq!(chunk_files(&store).len(), recipe.chunks.len());
    assert!(store.pending().expect("pending").is_empty());
    let report = store.try_gc().expect("gc").expect("no writer left");
    assert_eq!(report.deleted_chunks, 0);
    assert_eq!(read_back(&store, &recipe), data);
}

/// Past its `hold_up_to` a writer writes chunks as before; a writer dropped without a commit
/// (a failed pull) still writes the ones it held, verified, for the next pull; a damaged
/// chunk file is refused and nothing of it held.
#[test]
fn held_chunks_stop_at_the_bound_and_a_dropped_writer_writes_them() {
    let (dir, store) = store();
    let (recipe, files, data) = foreign_chunks(dir.path(), 4 * (64 << 10), "bound");
    let writer = store
        .writer()
        .expect("writer")
        .hold_up_to(files[0].len() as u64);
    let mut scratch = Vec::new();
    let mut bad = files[1].clone();
    *bad.last_mut().expect("bytes") ^= 1;
    let bad = Arc::new(bad);
    let err = writer
        .hold_chunk_file(
            &recipe.chunks[1],
            &bad,
            0..bad.len(),
            "s3://b/k",
            &mut scratch,
        )
        .expect_err("damaged");
    assert!(
        matches!(err, StoreError::ForeignChunkCorrupt { .. })
            && err.to_string().contains("s3://b/k"),
        "{err}"
    );
    assert_eq!(store.held_chunks(), 0);
    for (c, file) in recipe.chunks.iter().zip(&files) {
        let buf = Arc::new(file.clone());
        writer
            .hold_chunk_file(c, &buf, 0..buf.len(), "test", &mut scratch)
            .expect("hold");
    }
    assert_eq!(store.held_chunks(), 1, "held past the bound");
    assert_eq!(chunk_files(&store).len(), recipe.chunks.len() - 1);
    drop(writer);
    assert_eq!(store.held_chunks(), 0);
    assert_eq!(chunk_files(&store).len(), recipe.chunks.len());
    let mut w = store.writer().expect("writer");
    let again = w
        .put_bytes_with("seg", &data, Chunking::Fixed { bytes: 64 << 10 })
        .expect("put");
    assert_eq!(
        w.stats().new_chunks,
        0,
        "the dropped writer's chunks were not kept"
    );
    w.commit("s", std::slice::from_ref(&again)).expect("commit");
}

/// Two writers using one chunk: the second finds it held by the first and holds nothing; its
/// own commit still writes it (its record must not wait on another writer's finish), and
/// whichever writes first, the other skips it.
#[test]
fn a_chunk_held_by_another_writer_is_written_by_the_commit_that_uses_it() {
    let (dir, store) = store();
    let (recipe, files, data) = foreign_chunks(dir.path(), 3 * (64 << 10), "shared");
    let first = store.writer().expect("first").hold_up_to(1 << 30);
    let second = store.writer().expect("second").hold_up_to(1 << 30);
    let mut scratch = Vec::new();
    for (c, file) in recipe.chunks.iter().zip(&files) {
        let buf = Arc::new(file.clone());
        assert!(
            first
                .hold_chunk_file(c, &buf, 0..buf.len(), "a", &mut scratch)
                .expect("hold")
                .new
        );
        assert!(
            !second
                .hold_chunk_file(c, &buf, 0..buf.len(), "b", &mut scratch)
                .expect("hold")
                .new
        );
    }
    second
        .commit("second", std::slice::from_ref(&recipe))
        .expect("commit");
    assert_eq!(chunk_files(&store).len(), recipe.chunks.len());
    assert_eq!(store.held_chunks(), 0);
    first
        .commit("first", std::slice::from_ref(&recipe))
        .expect("commit");
    assert_eq!(read_back(&store, &recipe), data);
}
