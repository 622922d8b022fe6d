//! Every way talking to the object store can fail. Each message is one line naming the cause and
//! the fix: it is what `torpor push` and `torpor pull` print.

use std::io;
use std::path::PathBuf;

use torpor_image::store::StoreError;
use torpor_image::ImageError;

/// The configuration or the credentials file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the object store configuration {path}: {source}: check the path")]
    Unreadable { path: PathBuf, source: io::Error },

    #[error("object store configuration {path}: {reason}: fix that line (keys: endpoint, bucket, region, credentials_file, path_style, prefix)")]
    Invalid { path: PathBuf, reason: String },

    #[error("object store configuration {path} holds {key}: credentials never go in the configuration; move them to the file named by credentials_file (mode 0600)")]
    SecretInConfig { path: PathBuf, key: &'static str },

    #[error("cannot read the object store credentials file {path}: {source}: create it (access_key_id and secret_access_key, mode 0600) or fix credentials_file")]
    CredentialsUnreadable { path: PathBuf, source: io::Error },

    #[error("object store credentials file {path} has mode {mode:o}, readable by others: chmod 600 it (and rotate the key if others could read it)")]
    CredentialsOpen { path: PathBuf, mode: u32 },

    #[error("object store credentials file {path} is invalid ({reason}): it holds access_key_id = \"…\" and secret_access_key = \"…\" (TOML)")]
    CredentialsInvalid { path: PathBuf, reason: String },
}

/// One request to the object store failed.
#[derive(Debug, thiserror::Error)]
pub enum ObjError {
    #[error("the object store at {endpoint} refused the credentials from {credentials} ({status} {code}) for {key}: check access_key_id and secret_access_key there, and that the key may use bucket {bucket}")]
    Denied {
        endpoint: String,
        bucket: String,
        credentials: PathBuf,
        key: String,
        status: u16,
        code: String,
    },

    #[error("bucket {bucket} does not exist at {endpoint}: create it, or fix bucket in the configuration")]
    NoBucket { endpoint: String, bucket: String },

    #[error("the object store at {endpoint} answered {status} {code} to {op} {key}: check the server's logs; run the command again once it is healthy")]
    Status {
        endpoint: String,
        op: &'static str,
        key: String,
        status: u16,
        code: String,
    },

    #[error("cannot reach the object store at {endpoint} ({source}) during {op} {key}: check endpoint in the configuration and that the server runs; run the command again")]
    Unreachable {
        endpoint: String,
        op: &'static str,
        key: String,
        source: Box<ureq::Error>,
    },

    #[error("object {key} in bucket {bucket} is larger than {limit} bytes: refused; it is not an object torpor wrote, delete it")]
    TooLarge {
        bucket: String,
        key: String,
        limit: u64,
    },

    #[error(
        "cannot store object {key} on this node: {source}; free memory or disk space and try again"
    )]
    Local {
        key: String,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid object store endpoint {endpoint} for bucket {bucket} ({reason}): fix endpoint or set path_style = true")]
    Endpoint {
        endpoint: String,
        bucket: String,
        reason: String,
    },
}

/// A push or pull failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Boxed: a request error is large, and the others are passed around often.
    #[error(transparent)]
    Remote(Box<ObjError>),

    #[error(transparent)]
    Store(#[from] StoreError),

    #[error(transparent)]
    Image(#[from] ImageError),

    #[error("snapshot {id} is not in bucket {bucket} (no {key}): push it first, or check the id and the prefix")]
    NotInBucket {
        id: String,
        bucket: String,
        key: String,
    },

    #[error("object {key} is missing from bucket {bucket} though snapshot {id} lists it: push {id} again from a node that has it")]
    MissingObject {
        id: String,
        bucket: String,
        key: String,
    },

    #[error("object {key} in bucket {bucket} is corrupt ({reason}): refused; push the snapshot again from a node that has it intact")]
    CorruptObject {
        bucket: String,
        key: String,
        reason: String,
    },

    #[error("snapshot {id} is already in bucket {bucket} with another manifest: push under another --id, or delete snapshots/{id}/ from the bucket first")]
    Conflict { id: String, bucket: String },

    #[error("snapshot {id} in chunk store {store} holds other contents than {dir} ({file} differs): push under another --id, or release it from the store")]
    StoreDiffers {
        id: String,
        store: PathBuf,
        dir: PathBuf,
        file: String,
    },

    #[error("{path} already exists: pull into a new directory")]
    OutExists { path: PathBuf },

    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl From<ObjError> for TransferError {
    fn from(e: ObjError) -> TransferError {
        TransferError::Remote(Box::new(e))
    }
}
