//! Optional zstd compression of chunks.
//!
//! Why zstd at level 1: restore speed is what Torpor is for, and zstd decompresses at the same
//! 1–2 GB/s per core whatever the level, while level 1 is its fastest regular level to compress
//! (hundreds of MB/s per core, on the snapshot path, chunks in parallel). Higher levels buy a few
//! percent of space for several times the snapshot time. What compresses here is CRIU's pages
//! (zero-filled and sparsely used pages, code, Python heaps); device buffers of weights are
//! mostly incompressible and stay raw.
//!
//! The compressed form is kept only when it saves at least 1/[`MIN_SAVING_DIVISOR`] of the raw
//! size (a quarter): below that, decompressing on every restore and pull costs more than the
//! bytes saved. What that leaves out is weights: float32 weights drawn from N(0, 0.02) compress
//! to 0.926 of their size at level 1 and decompress at 0.75–0.85 GB/s on one core of the
//! development VM. Under the earlier threshold of 1/16 every segment chunk of an fp32 model was
//! stored zstd'd for 7 % of its bytes: a GPT-2-Large pull on the H100 spent 29 % of its CPU
//! samples in zstd (`bench/results/pull-perf-s29-h100/`), and that node's restore from its
//! store took 3.16/2.94 s against 2.68/2.50 s with the weights raw
//! (`cluster-pull-s29-zstd-{before,after}-h100.json`). CRIU's pages, which compress several
//! times, still do.

/// Compressed chunks must be at least `raw / MIN_SAVING_DIVISOR` bytes smaller than raw.
pub const MIN_SAVING_DIVISOR: usize = 4;

/// Chunks larger than this are compressed only if their first [`SAMPLE_BYTES`] compress.
const SAMPLE_FROM_BYTES: usize = 1 << 20;
const SAMPLE_BYTES: usize = 64 << 10;

/// The zstd level used by [`Compression::default`].
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

/// Whether chunks are compressed when they are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Store every chunk raw.
    None,
    /// Try zstd at this level; keep it only when it pays (see the module documentation).
    Zstd { level: i32 },
}

impl Default for Compression {
    fn default() -> Self {
        Compression::Zstd {
            level: DEFAULT_ZSTD_LEVEL,
        }
    }
}

/// Whether `compressed` bytes are worth storing instead of `raw` bytes.
pub fn worth_it(raw: usize, compressed: usize) -> bool {
    compressed < raw - raw / MIN_SAVING_DIVISOR
}

/// The compressed form of `raw`, when `compression` asks for it and it pays.
pub(crate) fn compress(raw: &[u8], compression: Compression) -> Option<Vec<u8>> {
    let Compression::Zstd { level } = compression else {
        return None;
    };
    if raw.is_empty() {
        return None;
    }
    // Large chunks (device segments, mostly weights) are sampled first: compressing a whole
    // 4 MiB chunk of incompressible data only to throw the result away cost a third of the time
    // of storing a segment. A chunk whose head does not compress is stored raw.
    if raw.len() > SAMPLE_FROM_BYTES {
        let sample = &raw[..SAMPLE_BYTES];
        let pays =
            zstd::bulk::compress(sample, level).is_ok_and(|c| worth_it(sample.len(), c.len()));
        if !pays {
            return None;
        }
    }
    // An error here means zstd could not allocate its context: storing raw is always correct.
    let compressed = zstd::bulk::compress(raw, level).ok()?;
    worth_it(raw.len(), compressed.len()).then_some(compressed)
}

thread_local! {
    /// One decompression context per thread, made on its first chunk: a new context a chunk
    /// (its allocation and set-up) was 1.2 % of a pulling daemon's CPU on the H100
    /// (`ZSTD_createDCtx`, bench/results/pull-perf-s31-h100/), with ~27 000 chunks a pull.
    static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Inflates `body` into `out`, which must end up exactly full.
pub(crate) fn decompress_into(body: &[u8], out: &mut [u8]) -> Result<(), String> {
    let written = DECOMPRESSOR.with_borrow_mut(|slot| {
        let decompressor = match slot {
            Some(d) => d,
            None => slot.insert(zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?),
        };
        let written = decompressor.decompress_to_buffer(body, out);
        if written.is_err() {
            // A bad frame: the next chunk gets a context that never saw it.
            *slot = None;
        }
        written.map_err(|e| e.to_string())
    })?;
    if written != out.len() {
        return Err(format!(
            "inflates to {written} bytes, {} expected",
            out.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// float32 weights ~ N(0, 0.02), from a fixed generator: zstd saves ~7 % of them.
    fn gaussian_weights(n: usize) -> Vec<u8> {
        let mut x: u64 = 1;
        let mut uniform = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut out = Vec::with_capacity(n * 4);
        for _ in 0..n {
            let z: f64 = (0..12).map(|_| uniform()).sum::<f64>() - 6.0;
            out.extend_from_slice(&((z * 0.02) as f32).to_le_bytes());
        }
        out
    }

    #[test]
    fn weights_that_compress_only_a_little_are_stored_raw() {
        for len in [96 << 10, 4 << 20] {
            let raw = gaussian_weights(len / 4);
            let zstd = zstd::bulk::compress(&raw, DEFAULT_ZSTD_LEVEL).unwrap();
            // The saving is real but small: not worth a decompression on every restore.
            assert!(
                zstd.len() < raw.len() && zstd.len() * 10 > raw.len() * 8,
                "{} of {}",
                zstd.len(),
                raw.len()
            );
            assert_eq!(compress(&raw, Compression::default()), None, "{len} bytes");
        }
    }

    #[test]
    fn compressible_data_is_compressed_and_comes_back() {
        let raw: Vec<u8> = (0..1 << 20).map(|i| (i / 4096) as u8).collect();
        let compressed = compress(&raw, Compression::default()).expect("pays");
        assert!(compressed.len() < raw.len() / 10, "{}", compressed.len());
        let mut out = vec![0; raw.len()];
        decompress_into(&compressed, &mut out).expect("inflate");
        assert_eq!(out, raw);
        assert_eq!(compress(&raw, Compression::None), None);
        assert_eq!(compress(&[], Compression::default()), None);
    }

    #[test]
    fn incompressible_data_stays_raw() {
        // BLAKE3's extendable output: as good as random for a compressor, and reproducible.
        let mut raw = vec![0u8; 1 << 20];
        blake3::Hasher::new()
            .update(b"seed")
            .finalize_xof()
            .fill(&mut raw);
        assert_eq!(compress(&raw, Compression::default()), None);
    }

    #[test]
    fn a_large_chunk_with_an_incompressible_head_is_not_tried() {
        let mut raw = vec![0u8; 2 << 20];
        blake3::Hasher::new()
            .update(b"head")
            .finalize_xof()
            .fill(&mut raw[..SAMPLE_BYTES]);
        assert_eq!(compress(&raw, Compression::default()), None);
        // The same chunk with a compressible head is compressed whole.
        raw.rotate_left(SAMPLE_BYTES);
        assert!(compress(&raw, Compression::default()).is_some());
    }

    #[test]
    fn the_saving_must_be_worth_it() {
        // A quarter of the raw size at least.
        assert!(worth_it(1600, 1199));
        assert!(!worth_it(1600, 1200));
        assert!(!worth_it(1600, 1499));
        assert!(!worth_it(1600, 1600));
        assert!(!worth_it(10, 10));
    }

    #[test]
    fn a_wrong_length_is_refused() {
        let raw = vec![7u8; 10_000];
        let compressed = compress(&raw, Compression::default()).expect("pays");
        let mut short = vec![0; 9_999];
        assert!(decompress_into(&compressed, &mut short).is_err());
        let mut long = vec![0; 10_001];
        let err = decompress_into(&compressed, &mut long).expect_err("long");
        assert!(err.contains("10000 bytes"), "{err}");
    }

    #[test]
    fn the_threads_context_decodes_chunk_after_chunk_and_after_a_corrupt_one() {
        let a: Vec<u8> = (0..100_000u32).map(|i| (i / 300) as u8).collect();
        let b = vec![3u8; 50_000];
        let (ca, cb) = (
            compress(&a, Compression::default()).expect("pays"),
            compress(&b, Compression::default()).expect("pays"),
        );
        let mut out = vec![0; a.len()];
        decompress_into(&ca, &mut out).unwrap();
        assert_eq!(out, a);
        // Cut mid-frame: refused, and the next chunk on this thread still comes out whole.
        let mut out = vec![0; b.len()];
        assert!(decompress_into(&cb[..cb.len() / 2], &mut out).is_err());
        let mut garbage = ca.clone();
        garbage[ca.len() / 2] ^= 0xff;
        let _ = decompress_into(&garbage, &mut vec![0; a.len()]);
        decompress_into(&cb, &mut out).unwrap();
        assert_eq!(out, b);
        let mut out = vec![0; a.len()];
        decompress_into(&ca, &mut out).unwrap();
        assert_eq!(out, a);
    }
}
