//! The fuzz campaign's harness, shared by every `tests/fuzz_*.rs` of the workspace (torpord's
//! include this file by path): one [`campaign`] per target, inputs made by mutating a seed corpus
//! of real inputs (`tests/fuzz-corpus/<target>/`) or generated from scratch, and a counting
//! allocator that checks no input makes a parser allocate out of proportion to its size.
//!
//! Tool: proptest (a maintained property-testing and fuzzing crate) rather than cargo-fuzz:
//! proptest runs on stable Rust inside `cargo test`, so the bounded campaign is part of
//! `make test` on every machine, shrinks a failure to a small input and keeps it in a committed
//! regressions file that every later run replays first; cargo-fuzz needs nightly and libFuzzer,
//! which `make test` cannot assume. A longer campaign is the same tests with more cases:
//! `PROPTEST_CASES=100000 cargo test -p torpord --test fuzz_input` (docs/fuzzing.md).
//!
//! Each campaign is seeded (the same inputs every run, unless `PROPTEST_RNG_SEED` is set) and
//! prints one summary line `FUZZ {"target": …, "cases": …, "executions": …, "findings": …}`;
//! with `TORPOR_FUZZ_REPORT=FILE` it also appends that line to FILE
//! (bench/reliability/fuzz.py gathers them into bench/results/fuzz.json).

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{
    Config, FileFailurePersistence, RngSeed, TestCaseError, TestError, TestRunner,
};

// ---- allocation accounting -------------------------------------------------------------------

/// The system allocator, counting the bytes live on each thread and their peak.
pub struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    // try_with: during thread teardown the counters may be gone; nothing to count then.
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| {
            if now > peak.get() {
                peak.set(now);
            }
        });
    });
}

// SAFETY: every call is forwarded to the system allocator with the same arguments; the counting
// touches only const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            account(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is System's.
        unsafe { System.dealloc(ptr, layout) };
        account(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is System's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// `f`'s value and the most bytes it had allocated at once on this thread beyond what was live
/// before it.
pub fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    let peak = PEAK.with(Cell::get);
    (out, usize::try_from(peak - base).unwrap_or(0))
}

/// The allocation bound every parser must keep: a fixed allowance plus a multiple of the input.
pub fn check_alloc(target: &str, input_len: usize, peak: usize) -> Result<(), TestCaseError> {
    let bound = (1 << 20) + 64 * input_len;
    prop_assert!(
        peak <= bound,
        "{target}: an input of {input_len} bytes made the parser allocate {peak} bytes at once"
    );
    Ok(())
}

// ---- the campaign ----------------------------------------------------------------------------

/// A target's number of cases: `PROPTEST_CASES` when set, else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seed of a target: `PROPTEST_RNG_SEED` when set, else fixed from its name.
fn seed(target: &str) -> u64 {
    std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            target.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            })
        })
}

/// Runs `test` on `default_cases` inputs of `strategy` (after the inputs in `regressions`, a
/// proptest regressions file that failures are written to), prints the summary line and fails
/// with the smallest failing input.
pub fn campaign<S>(
    target: &'static str,
    default_cases: u32,
    regressions: &'static str,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S: Strategy,
    S::Value: std::fmt::Debug,
{
    let cases = cases(default_cases);
    let seed = seed(target);
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
        // Shrinking is bounded too: a finding is reported within seconds.
        max_shrink_iters: 2048,
        ..Config::default()
    };
    let executions = AtomicU64::new(0);
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |v| {
        executions.fetch_add(1, Ordering::Relaxed);
        test(v)
    });
    let findings = u64::from(result.is_err());
    let line = serde_json::json!({
        "target": target,
        "cases": cases,
        "executions": executions.load(Ordering::Relaxed),
        "findings": findings,
        "seed": seed,
    });
    println!("FUZZ {line}");
    if let Ok(path) = std::env::var("TORPOR_FUZZ_REPORT") {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = appended {
            eprintln!("cannot append to TORPOR_FUZZ_REPORT={path}: {e}");
        }
    }
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, input)) => {
            panic!("{target}: finding: {why}\nminimal input: {input:?}")
        }
        Err(TestError::Abort(why)) => panic!("{target}: campaign aborted: {why}"),
    }
}

// ---- inputs ----------------------------------------------------------------------------------

/// The files of a corpus directory, sorted by name (so the campaign is the same every run).
pub fn corpus(dir: &Path) -> Vec<Vec<u8>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("a corpus entry").path())
        .collect();
    paths.sort();
    let files: Vec<Vec<u8>> = paths
        .iter()
        .map(|p| std::fs::read(p).expect("a corpus file"))
        .collect();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files
}

/// Fragments that break parsers: traversal, NUL, huge and odd numbers, deep nesting, quotes.
const TOKENS: &[&[u8]] = &[
    b"..",
    b"../../etc/passwd",
    b"/",
    b"\0",
    b"\\u0000",
    b"-1",
    b"1e999",
    b"-1e999",
    b"NaN",
    b"18446744073709551616",
    b"9223372036854775808",
    b"-9223372036854775809",
    b"0.0000000000000000000000000001",
    b"null",
    b"true",
    b"\"\"",
    b"[]",
    b"{}",
    b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    b"{\"a\":{\"a\":{\"a\":{\"a\":{\"a\":",
    b"\"",
    b"\\",
    b"\xff\xfe",
    b"\xf0\x9f\x92\xa9",
    b"=",
    b"[[",
    b"]]",
    b"\n",
    b"'''",
    b"\"\"\"",
];

/// One change to an input; positions are fractions of its length.
#[derive(Debug, Clone)]
pub enum Mutation {
    FlipBit(prop::sample::Index, u8),
    SetByte(prop::sample::Index, u8),
    Insert(prop::sample::Index, Vec<u8>),
    Token(prop::sample::Index, prop::sample::Index),
    Delete(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
    Repeat(prop::sample::Index, u8, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    use prop::sample::Index;
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::SetByte(i, b)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, t)| Mutation::Token(i, t)),
        (any::<Index>(), 1u8..32).prop_map(|(i, n)| Mutation::Delete(i, n)),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), 1u8..32, 2u8..64).prop_map(|(i, n, k)| Mutation::Repeat(i, n, k)),
    ]
}

/// `input` with `mutations` applied in order.
pub fn apply(mut input: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = input.len();
        let at = |i: &prop::sample::Index| if len == 0 { 0 } else { i.index(len + 1) };
        match m {
            Mutation::FlipBit(i, b) if len > 0 => input[i.index(len)] ^= 1 << b,
            Mutation::SetByte(i, v) if len > 0 => input[i.index(len)] = *v,
            Mutation::Insert(i, v) => {
                let p = at(i);
                input.splice(p..p, v.iter().copied());
            }
            Mutation::Token(i, t) => {
                let p = at(i);
                input.splice(p..p, TOKENS[t.index(TOKENS.len())].iter().copied());
            }
            Mutation::Delete(i, n) => {
                let p = at(i).min(len);
                let end = (p + usize::from(*n)).min(len);
                input.drain(p..end);
            }
            Mutation::Truncate(i) => input.truncate(at(i)),
            Mutation::Repeat(i, n, k) => {
                let p = at(i).min(len);
                let end = (p + usize::from(*n)).min(len);
                let piece = input[p..end].to_vec();
                for _ in 1..*k {
                    input.splice(end..end, piece.iter().copied());
                }
            }
            _ => {}
        }
    }
    input
}

/// Inputs from `seeds`: one of them with up to 8 mutations (most cases), or bytes from scratch.
pub fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    prop_oneof![
        8 => (0..n, prop::collection::vec(mutation(), 0..8))
            .prop_map(move |(i, m)| apply(seeds[i].clone(), &m)),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

/// Any JSON value (nested up to 4 levels, strings with the tokens above among them).
pub fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
        prop::sample::select(TOKENS)
            .prop_map(|t| Value::String(String::from_utf8_lossy(t).into_owned())),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z_]{0,10}", inner, 0..8)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A refusal is one non-empty line (the error type's Display), as every error of the project is.
pub fn one_line(e: &impl std::fmt::Display) -> Result<(), TestCaseError> {
    let text = e.to_string();
    prop_assert!(
        !text.is_empty() && !text.contains('\n'),
        "not one line: {text:?}"
    );
    Ok(())
}
