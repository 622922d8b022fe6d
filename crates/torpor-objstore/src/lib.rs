//! The object tier of the chunk store: snapshots pushed to an S3-compatible bucket and pulled by
//! any node into its local [`ChunkStore`](torpor_image::store::ChunkStore).
//!
//! - [`push`] stores a snapshot directory's files in the local chunk store (content-defined
//!   chunks, so functions on one base share their base pages), then uploads the chunks the bucket
//!   lacks in pack objects, the snapshot's locator, the store record and the manifest, manifest
//!   last.
//! - [`pull`] fetches a snapshot's manifest, record and locator, then only the chunks the local
//!   store lacks, in coalesced ranged GETs of their packs, in parallel (bounded), each checked
//!   against its BLAKE3 id before it is stored; then it commits the record and materialises a
//!   verified snapshot directory.
//!
//! # Layout in the bucket
//!
//! ```text
//! <prefix>packs/<64 hex>.pack             chunk files concatenated (~32 MiB), named by the BLAKE3 of its bytes
//! <prefix>packs/<64 hex>.idx              that pack's index: chunk id -> offset, length (JSON), written after the pack
//! <prefix>chunks/<64 hex>                 one loose chunk file (pushes before packs; still read)
//! <prefix>snapshots/<id>/packs.json       the locator: for each pack holding chunks of <id>, its size and where they lie
//! <prefix>snapshots/<id>/sealed-packs.json  the same for a split snapshot's sealed segment record (sealed.rs)
//! <prefix>snapshots/<id>/record.json      the snapshot's recipes (which chunks make each file)
//! <prefix>snapshots/<id>/manifest.mac     the seal, when the snapshot is sealed
//! <prefix>snapshots/<id>/manifest.json    written last: a snapshot without it is incomplete
//! ```
//!
//! Chunks are named by the hash of their raw contents, so a chunk is uploaded once whichever
//! snapshot, node or function holds it, and an object can never be trusted by its name alone:
//! every fetched chunk is decoded and hashed before it enters a store.
//!
//! # Packs: why, and where the pull finds them
//!
//! CRIU's pages are cut into content-defined chunks of ~30–120 KB; one object per chunk made a
//! pull of GPT-2-Large's snapshot (27 000 chunks) bound by requests, at 4 % of what one large
//! GET moves. A push therefore writes the chunks new to the bucket into packs of ~32 MiB
//! (`PACK_TARGET`), in the order the snapshot's files use them, so a snapshot's
//! chunks lie in long runs; a pull groups the chunks it lacks by pack, coalesces runs less than
//! 1 MiB apart into ranged GETs of at most 32 MiB (the whole pack, without a Range, when it
//! needs all of it), and runs `parallel` of them at once. Chunks stay the unit of deduplication
//! and of verification: packs only change how they travel.
//!
//! The index is kept twice, for the two readers:
//! - **per snapshot** (`snapshots/<id>/packs.json`): the pull reads one object, whatever else the
//!   bucket holds; its size is the snapshot's, not the bucket's. A chunk it does not place is a
//!   loose object (`chunks/<hex>`), which is how snapshots pushed before packs still pull.
//! - **per pack** (`packs/<hash>.idx`, listed with ListObjectsV2): a push must know every chunk
//!   in the bucket, whichever snapshot brought it, to upload only new ones. It lists the pack
//!   indexes and the loose chunks (a few requests per thousand objects) instead of one HEAD per
//!   chunk. An index is written after its pack, so a listed index always has its pack.
//!
//! Neither is trusted: a wrong offset or a corrupted pack yields bytes that fail their chunk's
//! hash, and the pull is refused with nothing committed.
//!
//! # Choice of the S3 client
//!
//! Compared on crates.io (November 2026) for what Torpor needs: GET/PUT/HEAD of objects on any
//! S3-compatible endpoint, path-style addressing (SeaweedFS, MinIO), SigV4, and a build that
//! stays small on a 2-core CI machine.
//!
//! | crate | maintained by | what it brings | fit |
//! |---|---|---|---|
//! | `aws-sdk-s3` 1.x | AWS (awslabs/aws-sdk-rust), weekly releases | the whole S3 API, retries, credential chain | tens of generated-code crates (`aws-smithy-*`, hyper, rustls, aws-lc-rs); the slowest build of the four by far (minutes on 2 cores); tokio-only async |
//! | `object_store` 0.14 (`aws` feature) | Apache Arrow | one API over S3/GCS/Azure/local, retries, multipart | reqwest + hyper + rustls + quick-xml + chrono + futures; moderate build; async (tokio) |
//! | `rust-s3` 0.38 | one maintainer (durch), irregular releases | a convenient bucket API | default features pull native-tls (OpenSSL) and tokio; several feature combinations known not to build |
//! | `rusty-s3` 0.11 | paolobarbolini, regular releases | SigV4 signing and request/response types, no I/O | a handful of small pure-Rust crates (hmac, sha2, url, an XML parser); HTTP is the caller's |
//!
//! Chosen: **`rusty-s3`** for signing, with **`ureq`** 3 (blocking, rustls) for HTTP. The chunk
//! store this talks to is synchronous (file I/O, rayon), the CLI has no async runtime, and the
//! transfers are bounded by a fixed pool of threads; torpord, when it is wired in, calls this
//! from `spawn_blocking` like its other store work. An async SDK would bring a second HTTP stack
//! into the build for no gain here. The cost: no built-in retries or multipart upload. So the
//! client retries a server's transient errors itself (429, 500, 502, 503, 504: up to 4 attempts,
//! backing off from 100 ms; `Traffic::retries` counts them), as S3 asks its clients to. Packs
//! are ~32 MiB (a pack closes once it holds that much; its last chunk may add up to one 4 MiB
//! segment chunk), far under the 5 GiB single-PUT limit, and a failed push or pull is simply run
//! again (both are idempotent and only move what is missing).

mod chunks;
mod client;
mod config;
mod error;
mod fetch_buffers;
mod huge;
mod inline_files;
mod landed_hash;
mod profile;
mod pull;
mod push;
mod sealed;

pub use chunks::PipelineTimes;
pub use client::{Remote, Traffic};
pub use config::{Credentials, RemoteConfig, DEFAULT_RANGE_BYTES, RANGE_BYTES};
pub use error::{ConfigError, ObjError, TransferError};
pub use profile::{
    open_profile, pull_profile, push_profile, seal_profile, MAX_PROFILE_BYTES, PROFILE_OBJECT,
};
pub use pull::{
    pull, pull_snapshot, pull_snapshot_deferred, AfterAnswer, InlineStats, PullReport, PullTimings,
    SealedPart, SealedSink, SnapshotPull,
};
pub use push::{push, PushReport};
pub use sealed::{
    pull_sealed_record, push_sealed_record, SealedRecordReport, SEALED_RECORD_OBJECT,
};

/// Concurrent requests of a push or pull unless told otherwise.
pub const DEFAULT_PARALLEL: usize = 8;

/// What a push or pull reports while it runs: a phase and how far it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub phase: Phase,
    pub done: u64,
    pub total: u64,
}

/// The phases of a push or pull.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Storing the snapshot's files in the local chunk store (push).
    Storing,
    /// Uploading chunks (push) or downloading them (pull).
    Chunks,
    /// Writing the snapshot directory (pull).
    Materialising,
}

impl Phase {
    /// Lowercase words for a progress line.
    pub fn describe(self) -> &'static str {
        match self {
            Phase::Storing => "storing in the local chunk store",
            Phase::Chunks => "transferring chunks",
            Phase::Materialising => "writing and verifying the snapshot",
        }
    }
}

/// `snapshots/<id>/<file>`, relative to the bucket's prefix.
pub(crate) fn snapshot_key(id: &str, file: &str) -> String {
    format!("snapshots/{id}/{file}")
}

/// `chunks/<hex>`, relative to the bucket's prefix.
pub(crate) fn chunk_key(id: &torpor_image::store::ChunkId) -> String {
    format!("chunks/{}", id.to_hex())
}

/// The record object: the recipes of one snapshot.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct RemoteRecord {
    pub format: u32,
    pub snapshot: String,
    pub recipes: Vec<torpor_image::store::Recipe>,
}

pub(crate) const RECORD_FORMAT: u32 = 1;
pub(crate) const RECORD_OBJECT: &str = "record.json";
/// The locator of a snapshot's chunks in packs, under `snapshots/<id>/`.
pub(crate) const LOCATOR_OBJECT: &str = "packs.json";
/// Records larger than this are refused (a snapshot of millions of chunks is ~100 MiB).
pub(crate) const MAX_RECORD_BYTES: u64 = 256 << 20;

/// Runs `work` on every item with at most `parallel` threads; stops handing out items after the
/// first error, which it returns.
pub(crate) fn for_each_parallel<T: Sync, E: Send>(
    items: &[T],
    parallel: usize,
    work: impl Fn(&T) -> Result<(), E> + Sync,
) -> Result<(), E> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first: Mutex<Option<E>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..parallel.clamp(1, 64).min(items.len().max(1)) {
            s.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    if let Err(e) = work(item) {
                        failed.store(true, Ordering::Relaxed);
                        let mut slot = first.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_runs_everything_or_stops_at_the_first_error() {
        let items: Vec<u32> = (0..100).collect();
        let sum = std::sync::atomic::AtomicU32::new(0);
        for_each_parallel(&items, 4, |i| {
            sum.fetch_add(*i, std::sync::atomic::Ordering::Relaxed);
            Ok::<(), String>(())
        })
        .expect("ok");
        assert_eq!(sum.into_inner(), 4950);
        let err = for_each_parallel(&items, 4, |i| if *i == 7 { Err(*i) } else { Ok(()) });
        assert_eq!(err, Err(7));
        for_each_parallel(&[] as &[u32], 4, |_| Err::<(), ()>(())).expect("empty");
    }
}
