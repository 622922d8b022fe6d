//! The chunk store on real CRIU images: two dumps of one process, stored as two snapshots.
//!
//! Needs root and a CRIU >= 4.1 (`make criu`, scripts/provision-criu.sh, or `TORPOR_CRIU`);
//! without them the test prints `SKIP` with the reason and passes. Run with `--nocapture` to see
//! the dedup measured for page CDC and for fixed-size chunks.

use std::collections::HashSet;
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use torpor_criu::{locate, Criu, CriuError, DumpRequest};
use torpor_image::store::{ChunkStore, Chunking, PageCdc, Recipe, PAGE_SIZE};

const PYTHON: &str = "/usr/bin/python3";
const TIMEOUT: Duration = Duration::from_secs(20);

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

/// tests/fixtures/memory_worker.py in its own PID, mount and network namespaces, started the
/// way torpor-criu's tests start theirs (their launcher closes inherited descriptors).
struct Worker {
    unshare: Child,
    pid: i32,
}

impl Worker {
    fn launch(dir: &Path) -> Worker {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut cmd = Command::new("unshare");
        cmd.args(["--pid", "--fork", "--mount-proc", "--net", PYTHON])
            .arg(crates.join("torpor-criu/tests/fixtures/launch.py"))
            .arg(dir.join("worker.log"))
            .arg(PYTHON)
            .arg(crates.join("torpor-image/tests/fixtures/memory_worker.py"))
            .arg(dir)
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
        wait_for("the worker to be ready", || dir.join("ready").exists());
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        let pid = fs::read_to_string(children)
            .expect("unshare's children are readable")
            .split_whitespace()
            .next()
            .expect("unshare has a child")
            .parse()
            .expect("a pid");
        Worker { unshare, pid }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: kill has no memory effects; the worker may already be gone.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        let _ = self.unshare.wait();
    }
}

fn dump(criu: &Criu, pid: i32, images: &Path) {
    fs::create_dir(images).expect("images dir");
    let request = DumpRequest {
        leave_running: true,
        empty_ns_net: true,
        network_lock_skip: true,
        ..DumpRequest::new(pid, images)
    };
    criu.dump(&request).unwrap_or_else(|e| panic!("{e}"));
}

/// The image files of a dump (CRIU's log left out), sorted.
fn image_files(images: &Path) -> Vec<(String, PathBuf)> {
    let mut files: Vec<(String, PathBuf)> = fs::read_dir(images)
        .expect("images")
        .map(|e| {
            let e = e.expect("entry");
            (e.file_name().to_string_lossy().into_owned(), e.path())
        })
        .filter(|(name, _)| !name.ends_with(".log"))
        .collect();
    files.sort();
    files
}

fn put_dump(store: &ChunkStore, id: &str, images: &Path) -> (Vec<Recipe>, u64, u64) {
    let mut writer = store.writer().expect("writer");
    let recipes: Vec<Recipe> = image_files(images)
        .iter()
        .map(|(name, path)| writer.put_file(path, name).expect("put"))
        .collect();
    let stats = writer.stats();
    writer.commit(id, &recipes).expect("commit");
    (recipes, stats.logical_bytes, stats.new_raw_bytes)
}

fn pages_files(images: &Path) -> Vec<Vec<u8>> {
    image_files(images)
        .into_iter()
        .filter(|(name, _)| matches!(Chunking::for_image_file(name), Chunking::Pages(_)))
        .map(|(_, path)| fs::read(path).expect("pages"))
        .collect()
}

/// The share of the bytes of `second`'s pages that `chunking` finds among `first`'s chunks.
fn dedup_share(chunking: Chunking, first: &[Vec<u8>], second: &[Vec<u8>]) -> (f64, usize) {
    let chunks = |files: &[Vec<u8>]| -> Vec<(blake3::Hash, usize)> {
        files
            .iter()
            .flat_map(|f| {
                chunking
                    .cut(f)
                    .into_iter()
                    .map(|r| (blake3::hash(&f[r.clone()]), r.len()))
            })
            .collect()
    };
    let known: HashSet<blake3::Hash> = chunks(first).into_iter().map(|(h, _)| h).collect();
    let second = chunks(second);
    let total: usize = second.iter().map(|(_, len)| len).sum();
    let found: usize = second
        .iter()
        .filter(|(h, _)| known.contains(h))
        .map(|(_, len)| len)
        .sum();
    (found as f64 / total as f64, second.len())
}

#[test]
fn two_dumps_of_one_process_dedup_and_materialise_bit_identical() {
    let test = "two_dumps_of_one_process_dedup_and_materialise_bit_identical";
    let Some(criu) = criu_or_skip(test) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let worker = Worker::launch(dir);
    dump(&criu, worker.pid, &dir.join("dump-1"));
    fs::write(dir.join("mutate"), b"").expect("ask for a change");
    wait_for("the worker to change", || dir.join("mutated").exists());
    dump(&criu, worker.pid, &dir.join("dump-2"));
    drop(worker);

    let store = ChunkStore::open(&dir.join("store")).expect("open");
    let (_, logical_1, new_1) = put_dump(&store, "dump-1", &dir.join("dump-1"));
    let (recipes_2, logical_2, new_2) = put_dump(&store, "dump-2", &dir.join("dump-2"));
    // An empty store has nothing to share with but the first dump's own repeats: a few
    // identical small image files (seen once: 161 bytes of 54 MB).
    assert!(
        new_1 <= logical_1 && new_1 as f64 >= 0.99 * logical_1 as f64,
        "the first dump has nothing to share with but itself: {new_1} of {logical_1} bytes new"
    );

    // Measured dedup of the pages, for the chosen chunking and for fixed-size chunks.
    let (pages_1, pages_2) = (
        pages_files(&dir.join("dump-1")),
        pages_files(&dir.join("dump-2")),
    );
    let pages_bytes: usize = pages_2.iter().map(Vec::len).sum();
    assert!(
        pages_bytes > 16 << 20,
        "the worker's 16 MiB are in the dump"
    );
    let cdc = Chunking::Pages(PageCdc::default());
    let (cdc_share, cdc_chunks) = dedup_share(cdc, &pages_1, &pages_2);
    eprintln!(
        "dump-2: {:.1} MB of pages; {:.1} MB in all, {:.1} MB new to the store",
        pages_bytes as f64 / 1e6,
        logical_2 as f64 / 1e6,
        new_2 as f64 / 1e6
    );
    eprintln!(
        "  page CDC (default)  {:5.1}% of the pages shared, {cdc_chunks} chunks",
        cdc_share * 100.0
    );
    for pages in [1, 16, 1024] {
        let fixed = Chunking::Fixed {
            bytes: pages * PAGE_SIZE,
        };
        let (share, chunks) = dedup_share(fixed, &pages_1, &pages_2);
        eprintln!(
            "  fixed {:>5} KiB     {:5.1}% of the pages shared, {chunks} chunks",
            pages * 4,
            share * 100.0
        );
    }
    for (min, avg, max) in [(1, 4, 16), (4, 16, 64), (16, 64, 256)] {
        let other = Chunking::Pages(PageCdc {
            min_pages: min,
            avg_pages: avg,
            max_pages: max,
        });
        let (share, chunks) = dedup_share(other, &pages_1, &pages_2);
        eprintln!(
            "  page CDC {min}/{avg}/{max}    {:5.1}% of the pages shared, {chunks} chunks",
            share * 100.0
        );
    }
    // The worker changed 40 scattered pages, added 515 and grew its heap: most of its memory
    // is unchanged (81% of the pages are identical, measured page by page).
    assert!(
        cdc_share > 0.5,
        "page CDC found only {:.1}% shared",
        cdc_share * 100.0
    );
    let (fixed_share, _) = dedup_share(Chunking::Fixed { bytes: 64 * 1024 }, &pages_1, &pages_2);
    assert!(
        cdc_share > fixed_share,
        "CDC {cdc_share} vs fixed {fixed_share}"
    );
    assert!(new_2 < logical_2 / 2, "{new_2} of {logical_2} bytes new");

    let usage = store.usage("dump-2").expect("usage");
    assert_eq!(usage.logical, logical_2);
    assert!(
        usage.shared_with["dump-1"] > (16 << 20) * 8 / 10,
        "{usage:?}"
    );
    eprintln!("  usage of dump-2: {usage:?}");
    let first = store.usage("dump-1").expect("usage");
    eprintln!(
        "  dump-1 alone: {:.1} MB logical, {:.1} MB stored with zstd",
        first.logical as f64 / 1e6,
        first.stored as f64 / 1e6
    );

    // Bit-identical materialisation of every file of the second dump.
    let out = dir.join("materialised");
    fs::create_dir(&out).expect("mkdir");
    store
        .materialise_all(&recipes_2, &out)
        .expect("materialise");
    for (name, path) in image_files(&dir.join("dump-2")) {
        assert_eq!(
            fs::read(out.join(&name)).expect("materialised"),
            fs::read(path).expect("original"),
            "{name}"
        );
    }
}
