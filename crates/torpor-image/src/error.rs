//! Every way reading, writing or checking a snapshot can fail.
//!
//! Each message names the cause and the fix in one line, because it is what the user of
//! `torpor snapshot`, `restore`, `inspect` and `verify` reads.

use std::io;
use std::path::PathBuf;

use crate::FormatVersion;

/// Result of this crate's operations.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// A failure while reading, writing or checking a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    // --- format version -------------------------------------------------------------------
    /// The text is not a `MAJOR.MINOR` version.
    #[error("snapshot format version {text:?} is not of the form MAJOR.MINOR: the manifest is corrupt; re-take the snapshot")]
    FormatVersionSyntax { text: String },

    /// Same major version, newer minor version: written by a newer torpor.
    #[error(
        "snapshot format {found} is newer than this torpor supports ({supported}): upgrade torpor"
    )]
    FormatNewer {
        found: FormatVersion,
        supported: FormatVersion,
    },

    /// A major version other than ours: the layout changed incompatibly.
    #[error("snapshot format {found} has a different major version than this torpor supports ({supported}): re-take the snapshot with this torpor (or use a torpor that reads format {found})")]
    FormatMajor {
        found: FormatVersion,
        supported: FormatVersion,
    },

    // --- manifest -------------------------------------------------------------------------
    /// The snapshot directory does not exist.
    #[error("snapshot {dir} does not exist: check the path")]
    SnapshotNotFound { dir: PathBuf },

    /// The snapshot path is not a directory.
    #[error("snapshot {dir} is not a directory: give the directory that `torpor snapshot --out` created")]
    SnapshotNotADirectory { dir: PathBuf },

    /// The directory has no `manifest.json`.
    #[error("{dir} is not a torpor snapshot (no manifest.json) — an interrupted snapshot never has one: check the path or re-take the snapshot")]
    NotASnapshot { dir: PathBuf },

    /// A file the restored tree reopens by path differs from the one the snapshot was taken with.
    #[error("snapshot {dir} cannot be restored on this node: {file} differs from the one it was taken with ({expected}; here: {found}): install the same version of it, or take the snapshot on a node like this one")]
    NotPortable {
        dir: PathBuf,
        file: String,
        expected: String,
        found: String,
    },

    /// `manifest.json` is bigger than any real manifest.
    #[error("manifest {path} is {size} bytes, over the {limit}-byte limit: it is not a torpor manifest; re-take the snapshot")]
    ManifestTooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },

    /// `manifest.json` could not be read.
    #[error("cannot read manifest {path}: {source}: check that it is readable by this user")]
    ManifestRead { path: PathBuf, source: io::Error },

    /// `manifest.json` is not JSON of the expected shape.
    #[error("manifest {path} is not a valid torpor manifest ({source}): it is corrupt; re-take the snapshot")]
    ManifestParse {
        path: PathBuf,
        source: serde_json::Error,
    },

    /// The manifest could not be turned into JSON (not expected to happen).
    #[error(
        "cannot encode the manifest as JSON ({source}): this is a torpor bug; please report it"
    )]
    ManifestEncode { source: serde_json::Error },

    /// A timing is NaN or infinite, which JSON cannot store.
    #[error(
        "timing {phase:?} is {value}, which JSON cannot store: record a finite number of seconds"
    )]
    NonFiniteTiming { phase: String, value: f64 },

    /// A manifest value that a reader found unusable (e.g. a malformed GPU UUID).
    #[error("the snapshot manifest is invalid: {reason}: re-take the snapshot")]
    Invalid { reason: String },

    /// A listed file path could escape the snapshot directory or is malformed.
    #[error("snapshot {dir} lists an unsafe file path {file:?} ({reason}): the manifest is corrupt or was tampered with; re-take the snapshot")]
    UnsafePath {
        dir: PathBuf,
        file: String,
        reason: &'static str,
    },

    /// A file is listed twice.
    #[error("snapshot {dir} lists {file:?} twice: the manifest is corrupt or was tampered with; re-take the snapshot")]
    DuplicatePath { dir: PathBuf, file: String },

    /// A listed hash is not 64 hex digits.
    #[error("snapshot {dir} lists an invalid BLAKE3 hash {hash:?} for {file}: the manifest is corrupt; re-take the snapshot")]
    InvalidHash {
        dir: PathBuf,
        file: String,
        hash: String,
    },

    // --- authentication -------------------------------------------------------------------
    /// A MAC is required and the snapshot has none.
    #[error("snapshot {dir} carries no MAC (manifest.mac), so nothing proves it was written by the holder of the snapshot key {key}: re-take the snapshot (torpord: deploy the function again), or check its hashes only with `torpor verify --unkeyed`")]
    Unsealed { dir: PathBuf, key: PathBuf },

    /// `manifest.mac` is not one torpor writes.
    #[error("snapshot {dir} has a manifest.mac that is not a torpor MAC: it was damaged or forged; re-take the snapshot")]
    SealMalformed { dir: PathBuf },

    /// Sealed, but with another key than the one given.
    #[error("snapshot {dir} was sealed with another key (id {found}), not {key} (id {expected}): use the key that sealed it (`--key`; a daemon's is <state-dir>/snapshot.key), or re-take the snapshot")]
    SealOtherKey {
        dir: PathBuf,
        found: String,
        key: PathBuf,
        expected: String,
    },

    /// The manifest is not the one its writer sealed.
    #[error("snapshot {dir} was changed after its writer sealed it (manifest.json does not match manifest.mac): refused; re-take the snapshot (torpord: deploy the function again)")]
    SealMismatch { dir: PathBuf },

    // --- contents -------------------------------------------------------------------------
    /// A listed file is not there.
    #[error("snapshot {dir} is corrupt: {file} is missing: re-take the snapshot")]
    MissingFile { dir: PathBuf, file: String },

    /// A listed file has another size (typically: truncated by a full disk or an interrupted copy).
    #[error("snapshot {dir} is corrupt: {file} size mismatch (expected {expected} bytes, got {actual}): re-take the snapshot")]
    SizeMismatch {
        dir: PathBuf,
        file: String,
        expected: u64,
        actual: u64,
    },

    /// A listed file has other contents.
    #[error("snapshot {dir} is corrupt: {file} hash mismatch (expected {expected}, got {actual}): re-take the snapshot")]
    HashMismatch {
        dir: PathBuf,
        file: String,
        expected: String,
        actual: String,
    },

    /// A file the manifest does not list (restore would otherwise use unchecked data).
    #[error("snapshot {dir} contains {file}, which its manifest does not list: remove that file or re-take the snapshot")]
    ExtraFile { dir: PathBuf, file: String },

    /// A symlink, FIFO, socket or device inside the snapshot.
    #[error("{dir} contains {file}, a {kind} where only regular files and directories belong: remove it or re-take the snapshot")]
    NotRegularFile {
        dir: PathBuf,
        file: String,
        kind: &'static str,
    },

    /// A file name that JSON cannot carry faithfully.
    #[error("{dir} contains a file whose name is not UTF-8 ({name}): rename or remove it")]
    NonUtf8Name { dir: PathBuf, name: String },

    /// A directory could not be listed.
    #[error("cannot list directory {path}: {source}: check that it is readable by this user")]
    ReadDir { path: PathBuf, source: io::Error },

    /// A file could not be read for hashing.
    #[error("cannot read {path}: {source}: check that it is readable by this user and that the disk is healthy")]
    ReadFile { path: PathBuf, source: io::Error },

    // --- writing --------------------------------------------------------------------------
    /// The output path is taken.
    #[error("{out} already exists: choose another --out or remove it")]
    OutExists { out: PathBuf },

    /// The output path has no final name (`/`, `..`).
    #[error("{out} does not name a new directory: give a path such as ./snapshots/my-snapshot")]
    OutNoName { out: PathBuf },

    /// The output's parent is not a directory.
    #[error("cannot create a snapshot in {parent}: {source}: create that directory first")]
    OutParent { parent: PathBuf, source: io::Error },

    /// This process is already writing a snapshot to the same output.
    #[error("{temp} already exists: this process is already writing a snapshot to the same --out; wait for it or choose another --out")]
    PartialInProgress { temp: PathBuf },

    /// The temporary directory could not be created.
    #[error("cannot create {temp}: {source}: check that the directory is writable and the disk has space")]
    CreateTempDir { temp: PathBuf, source: io::Error },

    /// `manifest.json` could not be written.
    #[error("cannot write {path}: {source}: check that the disk has space and is writable")]
    WriteManifest { path: PathBuf, source: io::Error },

    /// fsync failed: the data may not be on disk.
    #[error("cannot flush {path} to disk: {source}: the disk may be full or failing; check it and re-take the snapshot")]
    Sync { path: PathBuf, source: io::Error },

    /// The dump directory changed after it was hashed.
    #[error("{dir}: {file} changed while the snapshot was being sealed ({detail}): make sure nothing else writes into the snapshot directory and re-take the snapshot")]
    ChangedWhileSealing {
        dir: PathBuf,
        file: String,
        detail: String,
    },

    /// The final rename failed.
    #[error("cannot rename {from} to {to}: {source}: check that both are on the same, writable filesystem")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        source: io::Error,
    },

    /// A partial snapshot directory could not be removed.
    #[error("cannot remove partial snapshot {path}: {source}: remove it by hand")]
    RemovePartial { path: PathBuf, source: io::Error },

    /// `uname(2)` failed (not expected to happen).
    #[error("cannot read the kernel release with uname(2): {source}: this is unexpected; report it with your kernel version")]
    Uname { source: io::Error },
}
