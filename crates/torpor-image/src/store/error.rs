//! Every way storing, reading or collecting chunks can fail.
//!
//! Each message names the cause and the fix in one line: it is what the user of `torpor
//! snapshot`, `restore`, `inspect` and the daemon's logs reads.

use std::io;
use std::path::{Path, PathBuf};

use crate::store::ChunkId;

/// A failure of the chunk store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store directory cannot be created, opened or written.
    #[error("chunk store {root} is unusable ({source}): create that directory on a local filesystem, make it writable by this user, or use another store")]
    Unusable { root: PathBuf, source: io::Error },

    /// `open_existing` of a directory that is not a chunk store.
    #[error("{root} is not a chunk store (it has no chunks/ and refs/ directories): check the store path")]
    NotAStore { root: PathBuf },

    /// The filesystem is full.
    #[error("no space left to write {path}: free disk space, or release unused snapshots and run the store's gc")]
    NoSpace { path: PathBuf },

    /// The store (or an input file) is not accessible to this user.
    #[error("permission denied to {op} {path}: run as the user that owns the store (root by default) or fix the permissions")]
    PermissionDenied { op: &'static str, path: PathBuf },

    /// Any other I/O failure.
    #[error("cannot {op} {path}: {source}: check that the disk is healthy and that nothing else modifies the store")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },

    /// A chunk's contents are not the ones its id names; the file was moved aside.
    #[error("chunk {chunk} of {file} is corrupt ({damage}); snapshots holding it: {snapshots}: re-take them, which stores the chunk again")]
    CorruptChunk {
        chunk: ChunkId,
        file: String,
        /// What is wrong and where the file was moved.
        damage: String,
        snapshots: String,
    },

    /// A chunk file that came from elsewhere (the object tier) does not decode to its id.
    #[error("chunk {chunk} from {origin} is corrupt ({damage}): refused, nothing stored; push the snapshot again from a node whose store holds it intact")]
    ForeignChunkCorrupt {
        chunk: ChunkId,
        origin: String,
        damage: String,
    },

    /// A chunk a recipe needs is not in the store.
    #[error("chunk {chunk} of {file} is missing from the store; snapshots holding it: {snapshots}: re-take them (the store was changed outside torpor or a corrupt chunk was moved aside)")]
    MissingChunk {
        chunk: ChunkId,
        file: String,
        snapshots: String,
    },

    /// The materialised data does not hash to the recipe's whole-file hash.
    #[error("{file} came out of the store with hash {actual}, its recipe says {expected}: the recipe is corrupt; re-take the snapshot")]
    WholeHashMismatch {
        file: String,
        expected: String,
        actual: String,
    },

    /// A record that must be sealed (its snapshot is restored from it) has no MAC.
    #[error("the chunk store record of snapshot {id} carries no MAC, so nothing proves the daemon wrote its segments: deploy the function again")]
    RecordUnsealed { id: String },

    /// A record's MAC does not match it: someone without the key rewrote it.
    #[error("the chunk store record of snapshot {id} was changed after the daemon sealed it (its MAC does not match): refused; deploy the function again")]
    RecordSealMismatch { id: String },

    /// A recipe contradicts itself (its chunks do not add up to its size, bad hash text).
    #[error(
        "recipe of {file} is invalid ({reason}): the store record is corrupt; re-take the snapshot"
    )]
    InvalidRecipe { file: String, reason: String },

    /// `read_into` got a buffer of the wrong size.
    #[error("buffer of {actual} bytes given for {file}, which is {expected} bytes: pass a buffer of exactly the recipe's size")]
    BufferSize {
        file: String,
        expected: u64,
        actual: u64,
    },

    /// `materialise` will not overwrite.
    #[error("{path} already exists: materialise into an empty directory")]
    DestExists { path: PathBuf },

    /// A snapshot id that cannot name a record file.
    #[error("snapshot id {id:?} is not usable in the store ({reason}): use letters, digits, '.', '_' and '-', not starting with '.'")]
    InvalidSnapshotId { id: String, reason: &'static str },

    /// `commit` of an id that is already committed.
    #[error("snapshot {id} is already committed to the store: release it first or use another id")]
    SnapshotExists { id: String },

    /// `release`, `usage` or `recipes` of an id that was never committed.
    #[error("snapshot {id} is not in chunk store {root}: check the id")]
    UnknownSnapshot { id: String, root: PathBuf },

    /// A snapshot's reference record cannot be parsed. GC stops rather than guess.
    #[error("store record {path} is corrupt ({source}): move it away and re-take that snapshot, then run gc again")]
    RecordCorrupt {
        path: PathBuf,
        source: serde_json::Error,
    },

    /// A record could not be encoded (not expected to happen).
    #[error(
        "cannot encode the store record of {id} ({source}): this is a torpor bug; please report it"
    )]
    RecordEncode {
        id: String,
        source: serde_json::Error,
    },
}

/// An I/O error as a store error: a full disk and a refused permission get their own messages.
pub(crate) fn io_error(op: &'static str, path: &Path, source: io::Error) -> StoreError {
    match source.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => StoreError::NoSpace {
            path: path.to_path_buf(),
        },
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => StoreError::PermissionDenied {
            op,
            path: path.to_path_buf(),
        },
        _ => StoreError::Io {
            op,
            path: path.to_path_buf(),
            source,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_picks_the_message() {
        let p = Path::new("/store/chunks/ab/x");
        let full = io_error("write", p, io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(matches!(full, StoreError::NoSpace { .. }));
        assert!(full.to_string().contains("free disk space"), "{full}");
        let denied = io_error("write", p, io::Error::from_raw_os_error(libc::EACCES));
        assert!(
            denied.to_string().starts_with("permission denied to write"),
            "{denied}"
        );
        let other = io_error("read", p, io::Error::from_raw_os_error(libc::EIO));
        assert!(matches!(other, StoreError::Io { .. }), "{other}");
    }
}
