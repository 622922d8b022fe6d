//! Snapshot manifest and integrity.
//!
//! A snapshot is a directory holding CRIU's image files and `manifest.json`, which describes the
//! snapshot and lists every other file with its size and BLAKE3 hash.
//!
//! - [`SnapshotWriter`] writes one atomically: dump into a hidden directory, hash, write the
//!   manifest last, rename into place. The output never exists without its manifest.
//! - [`Snapshot::open`] reads and validates a manifest (format version rule, safe paths), and
//!   [`Snapshot::verify`] checks every file against it before a restore.
//! - [`SnapshotKey`] seals a snapshot (`manifest.mac`: keyed BLAKE3 of the manifest) so that
//!   [`Snapshot::authenticate`] can tell the key holder's snapshots from anyone else's.
//! - [`render_summary`] is what `torpor inspect` prints.
//! - [`store::ChunkStore`] keeps the contents of snapshots as content-addressed, deduplicated
//!   chunks shared by all of them.

mod auth;
mod error;
mod hash;
mod installer_record;
mod manifest;
mod reopened;
mod snapshot;
pub mod store;
mod summary;
mod time;
mod version;
mod walk;
mod writer;

pub use auth::{KeyError, Seal, SnapshotKey, Trust, MAC_FILE, MAC_SCHEME, SNAPSHOT_KEY_FILE};
pub use error::{ImageError, Result};
pub use manifest::{
    check_relative_path, ArchivedMount, ExternalMount, FileEntry, GpuEntry, GpuSection, Host,
    Manifest, ProcessEntry, SnapshotKind, Source, StdioFile, MANIFEST_FILE, MAX_MANIFEST_BYTES,
};
pub use reopened::{
    check_reopened, hash_cache_path, sha256_file, warm_reopened, HashCache, ReopenedFile, Warmed,
    DEFAULT_HASH_CACHE, MAX_WARM_BYTES, SETTLE,
};
pub use snapshot::{is_restore_artifact, Sealing, Snapshot, VerifyReport};
pub use summary::{human_seconds, human_size, render_store_usage, render_summary};
pub use time::{format_rfc3339_utc, now_rfc3339_utc};
pub use version::FormatVersion;
pub use writer::{flush_snapshot, remove_stale_partials, Durability, SnapshotWriter, HASH_TIMING};
