//! Moving the chunks of a set of recipes between the local chunk store and the bucket: what a
//! snapshot's files and a split snapshot's segment record both need.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use torpor_image::store::{ChunkId, ChunkRef, ChunkStore, Recipe, StoreWriter};

use crate::client::Remote;
use crate::error::TransferError;
use crate::{chunk_key, for_each_parallel, Phase, Progress};

/// Each distinct chunk of `recipes` once, with the name of a file that holds it (for errors).
pub(crate) fn distinct(recipes: &[Recipe]) -> Vec<(ChunkRef, &str)> {
    let mut unique: BTreeMap<ChunkId, (ChunkRef, &str)> = BTreeMap::new();
    for r in recipes {
        for c in &r.chunks {
            unique.entry(c.id).or_insert((*c, r.name.as_str()));
        }
    }
    unique.into_values().collect()
}

/// Uploads the chunks of `recipes` the bucket lacks from `store`; returns (distinct, uploaded).
pub(crate) fn upload(
    remote: &Remote,
    store: &ChunkStore,
    recipes: &[Recipe],
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<(u64, u64), TransferError> {
    let chunks = distinct(recipes);
    let total = chunks.len() as u64;
    let ticker = Ticker::start(0, total, progress);
    let uploaded = AtomicU64::new(0);
    for_each_parallel(&chunks, parallel, |(c, file)| {
        let key = chunk_key(&c.id);
        if !remote.exists(&key)? {
            let bytes = store.chunk_file(c, file)?;
            remote.put(&key, &bytes)?;
            uploaded.fetch_add(1, Ordering::Relaxed);
        }
        ticker.tick();
        Ok::<(), TransferError>(())
    })?;
    Ok((total, uploaded.into_inner()))
}

/// Fetches into `store` (through `writer`, whose lock keeps a GC off them until the commit) the
/// chunks of `recipes` it lacks, each checked against its id; `missing` names an absent object.
/// Returns (distinct, fetched).
pub(crate) fn download(
    remote: &Remote,
    store: &ChunkStore,
    writer: &StoreWriter<'_>,
    recipes: &[Recipe],
    parallel: usize,
    progress: &(dyn Fn(Progress) + Sync),
    missing: &(dyn Fn(&str) -> TransferError + Sync),
) -> Result<(u64, u64), TransferError> {
    let chunks = distinct(recipes);
    let total = chunks.len() as u64;
    let wanted: Vec<ChunkRef> = chunks
        .into_iter()
        .map(|(c, _)| c)
        .filter(|c| !store.contains(&c.id))
        .collect();
    let ticker = Ticker::start(total - wanted.len() as u64, total, progress);
    let bucket = remote.bucket().to_owned();
    for_each_parallel(&wanted, parallel, |c| {
        let key = chunk_key(&c.id);
        // Header, and a body of at most the raw length plus zstd's worst-case growth.
        let limit = 16 + c.len + c.len / 64 + 1024;
        let bytes = remote.get(&key, limit)?.ok_or_else(|| missing(&key))?;
        let origin = format!("object {} in bucket {bucket}", remote.full_key(&key));
        writer.put_chunk_file(c, &bytes, &origin)?;
        ticker.tick();
        Ok::<(), TransferError>(())
    })?;
    Ok((total, wanted.len() as u64))
}

/// Counts the chunks done and reports each to `progress`.
struct Ticker<'a> {
    done: AtomicU64,
    total: u64,
    progress: &'a (dyn Fn(Progress) + Sync),
}

impl<'a> Ticker<'a> {
    fn start(done: u64, total: u64, progress: &'a (dyn Fn(Progress) + Sync)) -> Self {
        progress(Progress {
            phase: Phase::Chunks,
            done,
            total,
        });
        Ticker {
            done: AtomicU64::new(done),
            total,
            progress,
        }
    }

    fn tick(&self) {
        let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        (self.progress)(Progress {
            phase: Phase::Chunks,
            done: n,
            total: self.total,
        });
    }
}
