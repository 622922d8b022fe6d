//! The segments' part of a live migration between the devices of this node (issue 10 item 3;
//! docs/migration.md; the orchestration is crate::runtime::migrate).
//!
//! - [`Split::migrate_precopy`], while the instance serves: every segment the instance maps from
//!   the restore server is copied into new exportable memory on the target device: sealed
//!   read-only where the segment is read-only, writable otherwise. A read-only segment goes
//!   device to device over the GPUs' peer path where they have one
//!   ([`super::device::SegmentDevice::fill_from_peer`]); a writable one, and any segment
//!   between devices without that path, through host memory, where a writable one's blocks are
//!   also hashed per [`BLOCK`] for the stop.
//! - [`Split::migrate_delta`], in the stop (the worker has unmapped its segments, so nothing
//!   writes them): each writable segment's old memory is hashed again block by block and only
//!   the blocks that changed are copied, into the host copy and from there into the new memory.
//!
//! The old memory is never written: until the new segments are mapped, the instance can be given
//! its old ones back (the daemon keeps its handles on them, the [`Lease`]s).
//!
//! Through host memory a segment is read whole into a host buffer of its size and written from
//! it; on the H200 pair that moved GPT-2-Large's 3.15 GB at 1.2 GB/s (session 22), which is
//! why read-only segments, most of a model's bytes, take the peer path.

use std::sync::Arc;

use super::device::{block_hashes, HostBuffer, Memory};
use super::index::Planned;
use super::precopy::{Delta, BLOCK};
use super::server::{Lease, Leases, OwnMemory};
use super::{DeviceOpenError, Split};

/// Segments copied to the target device, not handed over yet.
pub struct Moving {
    /// The instance's plan with each cuda segment's device set to the target.
    pub plan: Arc<Vec<Planned>>,
    /// The new memory, one lease per plan entry.
    pub leases: Leases,
    /// Per plan entry: for a writable segment its host copy and block hashes.
    copies: Vec<Option<(HostBuffer, Vec<[u8; 32]>)>>,
    /// Bytes copied.
    pub bytes: u64,
    /// Of them, bytes copied device to device (the peer path), not through host memory.
    pub peer_bytes: u64,
}

impl std::fmt::Debug for Moving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Moving")
            .field("segments", &self.leases.len())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// Why the segments could not be moved (nothing of the instance's changed).
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error(transparent)]
    Device(#[from] DeviceOpenError),
    /// The instance's leases and plan disagree (a bug).
    #[error("the instance holds {held} segments but its plan lists {planned}")]
    Mismatch { held: usize, planned: usize },
    /// A segment larger than this machine's address space.
    #[error("the segment at {va:#x} ({size} bytes) is too large for this machine")]
    TooLarge { va: u64, size: u64 },
    /// A copy failed (the driver's code is inside).
    #[error("{what} the segment at {va:#x}: {source}")]
    Copy {
        what: &'static str,
        va: u64,
        #[source]
        source: torpor_device::DeviceError,
    },
}

fn memory_of(lease: &Lease) -> &Arc<Memory> {
    match lease {
        Lease::Own(own) => &own.memory,
        Lease::Shared(copy) => copy.memory(),
    }
}

/// The device ordinal a segment has on `to` (host segments belong to no GPU: they keep theirs).
fn target_ordinal(backend: &str, ordinal: i32, to: i32) -> i32 {
    if backend == "cuda" {
        to
    } else {
        ordinal
    }
}

impl Split {
    /// Copies every segment of `plan` (held by `leases`) to device `to` (blocking; see the
    /// module doc); `peer`: read-only segments device to device where the pair can.
    pub fn migrate_precopy(
        &self,
        plan: &[Planned],
        leases: &[Lease],
        to: i32,
        peer: bool,
    ) -> Result<Moving, MoveError> {
        if plan.len() != leases.len() {
            return Err(MoveError::Mismatch {
                held: leases.len(),
                planned: plan.len(),
            });
        }
        let mut new_plan = Vec::with_capacity(plan.len());
        let mut new_leases = Vec::with_capacity(plan.len());
        let mut copies = Vec::with_capacity(plan.len());
        let (mut bytes, mut peer_bytes) = (0, 0);
        for ((e, recipe), lease) in plan.iter().zip(leases) {
            let size = usize::try_from(e.size).map_err(|_| MoveError::TooLarge {
                va: e.va,
                size: e.size,
            })?;
            let src = self.device(&e.backend, e.ordinal)?;
            let ordinal = target_ordinal(&e.backend, e.ordinal, to);
            let dst = self.device(&e.backend, ordinal)?;
            let mut entry = e.clone();
            entry.ordinal = ordinal;
            // A read-only segment needs no host copy (nothing writes it, so the stop copies
            // nothing of it): device to device where the pair has a path.
            if peer && e.readonly && ordinal != e.ordinal {
                let peer = dst
                    .fill_from_peer(src.as_ref(), memory_of(lease), size, true)
                    .map_err(|source| MoveError::Copy {
                        what: "copying device to device",
                        va: e.va,
                        source,
                    })?;
                if let Some(memory) = peer {
                    bytes += e.size;
                    peer_bytes += e.size;
                    copies.push(None);
                    new_leases.push(Lease::Own(OwnMemory {
                        memory: Arc::new(memory),
                    }));
                    new_plan.push((entry, recipe.clone()));
                    continue;
                }
            }
            let mut buf = src.host_buffer(size).map_err(|source| MoveError::Copy {
                what: "host memory for",
                va: e.va,
                source,
            })?;
            src.read_memory(memory_of(lease), &mut buf)
                .map_err(|source| MoveError::Copy {
                    what: "reading",
                    va: e.va,
                    source,
                })?;
            let memory =
                dst.fill_from_bytes(&buf, e.readonly)
                    .map_err(|source| MoveError::Copy {
                        what: "filling the target's copy of",
                        va: e.va,
                        source,
                    })?;
            bytes += e.size;
            copies.push((!e.readonly).then(|| {
                let hashes = block_hashes(&buf, BLOCK);
                (buf, hashes)
            }));
            new_leases.push(Lease::Own(OwnMemory {
                memory: Arc::new(memory),
            }));
            new_plan.push((entry, recipe.clone()));
        }
        Ok(Moving {
            plan: Arc::new(new_plan),
            leases: new_leases,
            copies,
            bytes,
            peer_bytes,
        })
    }

    /// Copies what changed in each writable segment since [`Split::migrate_precopy`] from its
    /// old memory (`old[i]` holds `plan[i]`) to the new (blocking; the worker has unmapped the
    /// segments).
    pub fn migrate_delta(
        &self,
        plan: &[Planned],
        old: &[Lease],
        moving: &mut Moving,
    ) -> Result<Delta, MoveError> {
        let mut delta = Delta::default();
        let targets: Vec<i32> = moving.plan.iter().map(|(t, _)| t.ordinal).collect();
        for ((((e, _), lease), (copy, new)), target) in plan
            .iter()
            .zip(old)
            .zip(moving.copies.iter_mut().zip(&moving.leases))
            .zip(targets)
        {
            let Some((buf, hashes)) = copy.as_mut() else {
                delta.read_only_kept += 1;
                delta.read_only_bytes += e.size;
                continue;
            };
            let src = self.device(&e.backend, e.ordinal)?;
            let changed = src
                .refresh_memory(memory_of(lease), BLOCK, hashes, buf)
                .map_err(|source| MoveError::Copy {
                    what: "hashing",
                    va: e.va,
                    source,
                })?;
            let dst = self.device(&e.backend, target)?;
            dst.write_blocks(memory_of(new), buf, BLOCK, &changed)
                .map_err(|source| MoveError::Copy {
                    what: "writing the changed blocks of",
                    va: e.va,
                    source,
                })?;
            delta.pre_copied += 1;
            delta.blocks += hashes.len() as u64;
            delta.changed_blocks += changed.len() as u64;
            delta.changed_bytes += changed
                .iter()
                .map(|&i| {
                    let start = i * BLOCK;
                    (buf.len().min(start + BLOCK) - start) as u64
                })
                .sum::<u64>();
        }
        Ok(delta)
    }
}
