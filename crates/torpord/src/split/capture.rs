//! Capture at a quiet point (docs/split.md): `quiesce {split: true}` → `quiet` listing the
//! segments → one `segment_fd` frame per segment → the daemon imports each fd, copies the memory
//! to the host and stores it in the chunk store (fixed 4 MiB chunks, BLAKE3) → the record
//! (segments + their index) is committed under the snapshot id → `release` → `released` → the
//! worker closes and the transparent snapshot of the now-small process follows.
//!
//! **Read-only segments.** A segment is read-only when
//! - the worker says so (`readonly` in `quiet`): declared read-only data the worker sealed
//!   (`torpor.load(name, buffer=True)`), read-only by declaration; or
//! - at deploy, its hash is the same before and after a warm-up request: the daemon takes the
//!   segments' hashes at a first split quiet right after `ready` (setup and the harness's own
//!   warm-up done), lets the worker `resume`, sends the spec's warm-up request once more, and
//!   captures; a segment the request did not change is taken as read-only. A spec without a
//!   warm-up request gets no such probe: only declared data is read-only;
//! - at hibernation, it was read-only in the function snapshot and its hash is unchanged.
//!
//! A segment taken as read-only is mapped read-only into every instance, so a function that
//! writes to it after all faults (host) or gets a CUDA error (GPU): the warm-up request must
//! exercise the function's writes.

use std::collections::HashMap;
use std::os::fd::OwnedFd;

use serde_json::{Map, Value};
use torpor_device::DeviceError;
use torpor_image::store::{ChunkStore, Recipe, StoreError};

use crate::protocol::{Empty, Quiesce, ToWorker};
use crate::split::index::{self, SegmentEntry, SegmentIndex, INDEX_FORMAT, INDEX_RECIPE};
use crate::split::{fds, lock, DeviceOpenError, Split, StoreOpenError};
use crate::workers::{ConnError, WorkerConn};
use tokio::net::unix::OwnedReadHalf;

/// A segment as `quiet` lists it, with the fd that came for it.
#[derive(Debug)]
pub struct Listed {
    pub va: u64,
    pub size: u64,
    pub backend: String,
    pub ordinal: i32,
    pub order: u64,
    pub first_use: Option<u64>,
    /// The worker sealed it (declared read-only data).
    pub sealed: bool,
    /// It may be taken as read-only when unchanged across the warm-up: every host segment, and
    /// a cuda segment the worker vouches for (`shareable`: PyTorch's allocator has nothing in
    /// it but parameters and buffers, no free block). A cuda segment can hold activations that
    /// a deterministic warm-up rewrites with the same bytes, and its next write would then be
    /// refused (measured on the H100).
    pub shareable: bool,
    /// A request may run before it is mapped (`deferrable` in `quiet`; docs/split.md).
    pub deferrable: bool,
    pub fd: OwnedFd,
}

/// What a capture stored.
#[derive(Debug, Clone)]
pub struct Captured {
    pub segments: Vec<SegmentEntry>,
    /// Bytes of all segments.
    pub bytes: u64,
    /// Bytes written to the store (not there already).
    pub new_bytes: u64,
    /// A concurrent snapshot's stop: what it did not have to copy (crate::split::precopy).
    pub delta: Option<super::precopy::Delta>,
}

fn protocol(what: impl Into<String>) -> ConnError {
    ConnError::Protocol(what.into())
}

/// Sends `quiesce {split: true}` and reads `quiet` and the segments' fds.
pub async fn quiesce(
    conn: &mut WorkerConn,
) -> Result<(Map<String, Value>, Vec<Listed>), ConnError> {
    conn.send(&ToWorker::Quiesce(Quiesce {
        split: Some(true),
        released: None,
    }))
    .await?;
    let quiet = match fds::read_with_fd(&mut conn.rd).await? {
        None => return Err(ConnError::Closed),
        Some((m, None)) if m.get("type").and_then(Value::as_str) == Some("quiet") => m,
        Some((m, _)) => {
            return Err(protocol(format!(
                "expected quiet after quiesce, got {}",
                m.get("type").unwrap_or(&Value::Null)
            )))
        }
    };
    let listed = segment_fds(&mut conn.rd, &quiet).await?;
    Ok((quiet, listed))
}

/// Reads the `segment_fd` frames that follow a split `quiet`.
pub async fn segment_fds(
    rd: &mut OwnedReadHalf,
    quiet: &Map<String, Value>,
) -> Result<Vec<Listed>, ConnError> {
    let Some(segments) = quiet.get("segments").and_then(Value::as_array) else {
        return Err(protocol(
            "a split quiet without a segments list; the worker's harness is older than this torpord",
        ));
    };
    let mut out = Vec::with_capacity(segments.len());
    for s in segments {
        let int = |k: &str| s.get(k).and_then(Value::as_u64);
        let (Some(va), Some(size), Some(order)) = (int("va"), int("size"), int("order")) else {
            return Err(protocol(format!(
                "a segment in quiet lacks va, size or order: {s}"
            )));
        };
        let backend = s
            .get("backend")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let frame = fds::read_with_fd(rd).await?.ok_or(ConnError::Closed)?;
        let (m, fd) = frame;
        if m.get("type").and_then(Value::as_str) != Some("segment_fd")
            || m.get("va").and_then(Value::as_u64) != Some(va)
        {
            return Err(protocol(format!(
                "expected segment_fd for {va:#x}, got {}",
                Value::Object(m)
            )));
        }
        let Some(fd) = fd else {
            return Err(protocol(format!(
                "segment_fd for {va:#x} came without an fd (SCM_RIGHTS on its first byte)"
            )));
        };
        out.push(Listed {
            va,
            size,
            backend,
            ordinal: s
                .get("ordinal")
                .and_then(Value::as_i64)
                .and_then(|o| i32::try_from(o).ok())
                .unwrap_or(0),
            order,
            first_use: int("first_use"),
            sealed: s.get("readonly").and_then(Value::as_bool).unwrap_or(false),
            shareable: s.get("backend").and_then(Value::as_str) == Some("host")
                || s.get("shareable").and_then(Value::as_bool) == Some(true),
            deferrable: s.get("deferrable").and_then(Value::as_bool) == Some(true),
            fd,
        });
    }
    Ok(out)
}

/// The whole of segment `l`, read into a host buffer of its device.
fn read_whole(split: &Split, l: &Listed) -> Result<super::device::HostBuffer, CaptureError> {
    let dev = split.device(&l.backend, l.ordinal)?;
    let mut buf = dev
        .host_buffer(l.size as usize)
        .map_err(|source| CaptureError::Buffer {
            va: l.va,
            size: l.size,
            source,
        })?;
    dev.read_fd(l.fd.try_clone().map_err(CaptureError::Dup)?, &mut buf)
        .map_err(|source| CaptureError::Read { va: l.va, source })?;
    Ok(buf)
}

/// The BLAKE3 hash of every listed segment's contents, by VA (blocking: copies every segment).
pub fn hash_all(split: &Split, listed: &[Listed]) -> Result<HashMap<u64, String>, CaptureError> {
    let mut out = HashMap::new();
    for l in listed {
        let dev = split.device(&l.backend, l.ordinal)?;
        // Pageable memory: this copy is thrown away, and pinning costs more than staging.
        let mut buf = vec![0u8; l.size as usize];
        let fd = l.fd.try_clone().map_err(CaptureError::Dup)?;
        dev.read_fd(fd, &mut buf)
            .map_err(|source| CaptureError::Read { va: l.va, source })?;
        let hash = blake3::Hasher::new().update_rayon(&buf).finalize();
        out.insert(l.va, hash.to_hex().to_string());
    }
    Ok(out)
}

/// The pre-copy of a deploy's segments, from the read-only probe's quiesce (blocking): each
/// segment is read whole, hashed per block, stored, and its whole BLAKE3 hash returned by VA
/// (the probe's `before` hashes, as [`hash_all`] gives them). The capture's stop then copies
/// only the blocks that changed ([`store_all_with`]).
pub fn precopy_listed(
    split: &Split,
    store: &ChunkStore,
    listed: &[Listed],
) -> Result<(HashMap<u64, String>, super::precopy::PreCopy), CaptureError> {
    let began = std::time::Instant::now();
    let mut writer = store
        .writer()
        .map_err(|e| CaptureError::Writer(Box::new(e)))?;
    let mut hashes = HashMap::new();
    let mut segments = Vec::with_capacity(listed.len());
    let mut bytes = 0;
    for l in listed {
        let buf = read_whole(split, l)?;
        let recipe = writer
            .put_bytes(&index::recipe_name(l.va), &buf)
            .map_err(|e| CaptureError::Put {
                va: l.va,
                source: Box::new(e),
            })?;
        hashes.insert(l.va, recipe.blake3.clone());
        bytes += l.size;
        segments.push(super::precopy::CopiedSegment {
            va: l.va,
            size: l.size,
            hashes: super::device::block_hashes(&buf, super::precopy::BLOCK),
            buf,
            recipe: Some(recipe),
        });
    }
    drop(writer);
    Ok((
        hashes,
        super::precopy::PreCopy {
            began,
            seconds: began.elapsed().as_secs_f64(),
            bytes,
            segments,
        },
    ))
}

/// Whether (and why) a segment is read-only (the rule in the module doc): declared by the
/// worker, or shareable and with the same hash as in `earlier` (the probe's hashes before the
/// warm-up at a deploy; the function snapshot's read-only segments at a hibernation).
pub fn read_only_reason(
    l: &Listed,
    hash: &str,
    earlier: &HashMap<u64, String>,
) -> Option<&'static str> {
    if l.sealed {
        Some("declared")
    } else if l.shareable && earlier.get(&l.va).is_some_and(|h| h == hash) {
        Some("unchanged")
    } else {
        None
    }
}

/// Copies every listed segment into the chunk store and commits them, with their index, as the
/// record of `snapshot_id` (blocking); see [`read_only_reason`] for `earlier`. Each segment's
/// bytes also go into the host cache, as an entry of the function's `tenant`
/// ([`crate::tenant::scoped_key`]), so the first restore after a deploy does not read the
/// store.
pub fn store_all(
    split: &Split,
    store: &ChunkStore,
    snapshot_id: &str,
    tenant: &str,
    listed: Vec<Listed>,
    earlier: &HashMap<u64, String>,
) -> Result<Captured, CaptureError> {
    store_all_with(split, store, snapshot_id, tenant, listed, earlier, None)
}

/// [`store_all`], with what a concurrent snapshot already has (`known`, crate::split::precopy):
/// a segment the instance maps read-only from the restore server keeps its recipe without being
/// read, and a pre-copied one is only hashed block by block, the blocks that changed since the
/// pre-copy copied again ([`super::device::SegmentDevice::refresh_fd`]); every other segment is
/// read whole, as without.
pub fn store_all_with(
    split: &Split,
    store: &ChunkStore,
    snapshot_id: &str,
    tenant: &str,
    listed: Vec<Listed>,
    earlier: &HashMap<u64, String>,
    mut known: Option<super::precopy::Known>,
) -> Result<Captured, CaptureError> {
    let mut writer = store
        .writer()
        .map_err(|e| CaptureError::Writer(Box::new(e)))?;
    let mut recipes: Vec<Recipe> = Vec::with_capacity(listed.len() + 1);
    let mut entries = Vec::with_capacity(listed.len());
    let mut bytes = 0;
    let mut delta = known.as_ref().map(|_| super::precopy::Delta::default());
    for l in listed {
        let name = index::recipe_name(l.va);
        // What a concurrent snapshot knows of this segment already.
        let reuse = known
            .as_mut()
            .map(|k| k.take(&l, store))
            .unwrap_or(super::precopy::Prior::None);
        let (recipe, cached) = match reuse {
            super::precopy::Prior::ReadOnly(recipe) => {
                if let Some(d) = delta.as_mut() {
                    d.read_only_kept += 1;
                    d.read_only_bytes += l.size;
                }
                (recipe, None)
            }
            super::precopy::Prior::Copied(mut pre) => {
                let dev = split.device(&l.backend, l.ordinal)?;
                let fd = l.fd.try_clone().map_err(CaptureError::Dup)?;
                let changed = dev
                    .refresh_fd(fd, super::precopy::BLOCK, &pre.hashes, &mut pre.buf)
                    .map_err(|source| CaptureError::Read { va: l.va, source })?;
                let d = delta.get_or_insert_with(Default::default);
                d.pre_copied += 1;
                d.blocks += pre.hashes.len() as u64;
                d.changed_blocks += changed.len() as u64;
                d.changed_bytes += changed
                    .iter()
                    .map(|&i| {
                        let start = i * super::precopy::BLOCK;
                        (pre.buf.len().min(start + super::precopy::BLOCK) - start) as u64
                    })
                    .sum::<u64>();
                let recipe = match pre.recipe {
                    Some(r) if changed.is_empty() && r.name == name && all_stored(store, &r) => r,
                    _ => writer
                        .put_bytes(&name, &pre.buf)
                        .map_err(|e| CaptureError::Put {
                            va: l.va,
                            source: Box::new(e),
                        })?,
                };
                (recipe, Some(pre.buf))
            }
            super::precopy::Prior::None => {
                let buf = read_whole(split, &l)?;
                let recipe = writer
                    .put_bytes(&name, &buf)
                    .map_err(|e| CaptureError::Put {
                        va: l.va,
                        source: Box::new(e),
                    })?;
                if let Some(d) = delta.as_mut() {
                    d.copied_in_stop += 1;
                    d.changed_bytes += l.size;
                }
                (recipe, Some(buf))
            }
        };
        let why = read_only_reason(&l, &recipe.blake3, earlier);
        let entry = SegmentEntry {
            va: l.va,
            size: l.size,
            backend: l.backend.clone(),
            ordinal: if l.backend == "host" { -1 } else { l.ordinal },
            order: l.order,
            first_use: l.first_use,
            deferrable: l.deferrable,
            readonly: why.is_some(),
            readonly_why: why.unwrap_or("").to_string(),
            recipe: name,
            blake3: recipe.blake3.clone(),
        };
        bytes += l.size;
        if let Some(buf) = cached {
            let inserted = lock(&split.host_cache).insert(
                &crate::tenant::scoped_key(tenant, &entry.blake3),
                std::sync::Arc::new(std::sync::Mutex::new(buf)),
                l.size,
            );
            if inserted.is_none() {
                tracing::debug!(
                    va = l.va,
                    size = l.size,
                    "segment larger than the host cache"
                );
            }
        }
        entries.push(entry);
        recipes.push(recipe);
    }
    split.update_cache_gauges();
    commit_record(split, writer, snapshot_id, entries, recipes, bytes, delta)
}

/// Commits `entries` (their recipes in `recipes`, in the same order) with their index as the
/// record of `snapshot_id`.
fn commit_record(
    split: &Split,
    mut writer: torpor_image::store::StoreWriter<'_>,
    snapshot_id: &str,
    entries: Vec<SegmentEntry>,
    mut recipes: Vec<Recipe>,
    bytes: u64,
    delta: Option<super::precopy::Delta>,
) -> Result<Captured, CaptureError> {
    let idx = SegmentIndex {
        format: INDEX_FORMAT,
        segments: entries.clone(),
    };
    let json = serde_json::to_vec(&idx).map_err(CaptureError::Encode)?;
    let idx_recipe = writer
        .put_bytes(INDEX_RECIPE, &json)
        .map_err(|e| CaptureError::PutIndex(Box::new(e)))?;
    recipes.insert(0, idx_recipe);
    let new_bytes = writer.stats().new_raw_bytes;
    writer
        .commit_sealed(snapshot_id, &recipes, &split.key)
        .map_err(|e| CaptureError::Commit {
            snapshot: snapshot_id.to_string(),
            source: Box::new(e),
        })?;
    Ok(Captured {
        segments: entries,
        bytes,
        new_bytes,
        delta,
    })
}

/// The record of `snapshot_id` for an instance whose GPU is released (crate::split::release):
/// the daemon gave its segments back at `unmap`, so they are not read from the worker but
/// taken from what the release kept: `saved[i]`, the contents of `plan[i]` copied then, or,
/// for `None`, `plan[i]`'s recipe (a read-only segment, or one never handed over: a standby's).
/// A segment stays read-only when it was and its contents are the same. Blocking.
pub fn store_released(
    split: &Split,
    store: &ChunkStore,
    snapshot_id: &str,
    plan: &[index::Planned],
    saved: &[Option<super::device::HostBuffer>],
) -> Result<Captured, CaptureError> {
    if plan.len() != saved.len() {
        return Err(CaptureError::Released {
            saved: saved.len(),
            planned: plan.len(),
        });
    }
    let mut writer = store
        .writer()
        .map_err(|e| CaptureError::Writer(Box::new(e)))?;
    let mut recipes: Vec<Recipe> = Vec::with_capacity(plan.len() + 1);
    let mut entries = Vec::with_capacity(plan.len());
    let mut bytes = 0;
    let mut delta = super::precopy::Delta::default();
    for ((e, recipe), buf) in plan.iter().zip(saved) {
        let recipe = match buf {
            Some(buf) => {
                delta.changed_bytes += e.size;
                writer
                    .put_bytes(&index::recipe_name(e.va), buf)
                    .map_err(|source| CaptureError::Put {
                        va: e.va,
                        source: Box::new(source),
                    })?
            }
            None if all_stored(store, recipe) => {
                delta.read_only_kept += 1;
                delta.read_only_bytes += e.size;
                recipe.clone()
            }
            None => return Err(CaptureError::NotStored { va: e.va }),
        };
        let readonly = e.readonly && recipe.blake3 == e.blake3;
        entries.push(SegmentEntry {
            recipe: recipe.name.clone(),
            blake3: recipe.blake3.clone(),
            readonly,
            readonly_why: if readonly {
                e.readonly_why.clone()
            } else {
                String::new()
            },
            ..e.clone()
        });
        bytes += e.size;
        recipes.push(recipe);
    }
    commit_record(
        split,
        writer,
        snapshot_id,
        entries,
        recipes,
        bytes,
        Some(delta),
    )
}

/// Every chunk of `recipe` is in `store` (checked under a writer, which holds GC off until its
/// commit, so they stay).
pub(crate) fn all_stored(store: &torpor_image::store::ChunkStore, recipe: &Recipe) -> bool {
    recipe.chunks.iter().all(|c| store.contains(&c.id))
}

/// Why hashing or storing a worker's segments failed (at a deploy or a hibernation; the
/// worker's own memory is untouched, and a capture that fails commits no record).
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The chunk store cannot be opened.
    #[error(transparent)]
    Store(#[from] StoreOpenError),
    /// The device holding a segment cannot be opened.
    #[error(transparent)]
    Device(#[from] DeviceOpenError),
    /// The segment's fd cannot be duplicated (out of fds?).
    #[error("dup of a segment fd: {0}")]
    Dup(#[source] std::io::Error),
    /// No host buffer for a segment's copy.
    #[error("cannot allocate a host buffer of {size} bytes for the segment at {va:#x}: {source}")]
    Buffer {
        va: u64,
        size: u64,
        #[source]
        source: DeviceError,
    },
    /// Copying a segment's memory to the host failed (the driver's code is inside).
    #[error("reading the segment at {va:#x}: {source}")]
    Read {
        va: u64,
        #[source]
        source: DeviceError,
    },
    /// The store cannot take writes.
    #[error("cannot write to the chunk store: {0}")]
    Writer(#[source] Box<StoreError>),
    /// Storing a segment failed (a full disk, say).
    #[error("storing the segment at {va:#x}: {source}")]
    Put {
        va: u64,
        #[source]
        source: Box<StoreError>,
    },
    /// The index cannot be encoded.
    #[error("cannot encode the segments index: {0}")]
    Encode(#[source] serde_json::Error),
    /// Storing the index failed.
    #[error("storing the segments index: {0}")]
    PutIndex(#[source] Box<StoreError>),
    /// The record could not be committed.
    #[error("committing the segments of {snapshot}: {source}")]
    Commit {
        snapshot: String,
        #[source]
        source: Box<StoreError>,
    },
    /// A released instance's saved segments and its plan disagree (a bug).
    #[error("the instance saved {saved} segments at its GPU release but its plan lists {planned}")]
    Released { saved: usize, planned: usize },
    /// A released segment's recipe has chunks the store no longer holds.
    #[error("the segment at {va:#x} was released with its contents in the chunk store, which no longer holds them all")]
    NotStored { va: u64 },
}

/// Sends `release` and reads `released`; returns the bytes the worker released.
pub async fn release(
    conn: &mut WorkerConn,
    timeout: std::time::Duration,
) -> Result<u64, ConnError> {
    conn.send(&ToWorker::Release(Empty {})).await?;
    let msg = conn.expect("released", timeout).await?;
    Ok(msg.get("bytes").and_then(Value::as_u64).unwrap_or(0))
}

/// As [`release`], on the halves of an instance's connection (hibernation).
pub async fn release_halves(
    wr: &mut tokio::net::unix::OwnedWriteHalf,
    rd: &mut OwnedReadHalf,
    timeout: std::time::Duration,
) -> Result<u64, ConnError> {
    crate::workers::send(wr, &ToWorker::Release(Empty {})).await?;
    let msg = tokio::time::timeout(timeout, crate::frames::read(rd))
        .await
        .map_err(|_| ConnError::Timeout(timeout.as_secs_f64()))??
        .ok_or(ConnError::Closed)?;
    if msg.get("type").and_then(Value::as_str) != Some("released") {
        return Err(protocol(format!(
            "expected released, got {}",
            msg.get("type").unwrap_or(&Value::Null)
        )));
    }
    Ok(msg.get("bytes").and_then(Value::as_u64).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(sealed: bool, shareable: bool) -> Listed {
        Listed {
            va: 0x7000_0000,
            size: 4096,
            backend: if shareable { "host" } else { "cuda" }.to_string(),
            ordinal: 0,
            order: 0,
            first_use: None,
            sealed,
            shareable,
            deferrable: false,
            fd: std::fs::File::open("/dev/null").expect("/dev/null").into(),
        }
    }

    #[test]
    fn only_declared_or_shareable_and_unchanged_segments_are_read_only() {
        let earlier = HashMap::from([(0x7000_0000, "h1".to_string())]);
        let none = HashMap::new();
        assert_eq!(
            read_only_reason(&listed(true, false), "h2", &none),
            Some("declared")
        );
        assert_eq!(
            read_only_reason(&listed(false, true), "h1", &earlier),
            Some("unchanged")
        );
        assert_eq!(read_only_reason(&listed(false, true), "h2", &earlier), None);
        assert_eq!(read_only_reason(&listed(false, true), "h1", &none), None);
        // Unchanged, but the worker did not vouch for it (a cuda segment that may hold
        // activations a deterministic warm-up rewrote with the same bytes).
        assert_eq!(
            read_only_reason(&listed(false, false), "h1", &earlier),
            None
        );
    }
}
