//! Platform-loaded data (EDAS; docs/data.md): declared data with `source = "s3://BUCKET/KEY"`,
//! inputs passed by reference (`{"$ref": "s3://BUCKET/KEY"}` in a request) and results written
//! back (`torpor.dump`), all through the node's object store (`[objstore]`, the client and
//! credentials of crate::bucket).
//!
//! # Where the objects are
//!
//! A tenant's data is the objects under `<prefix>data/<tenant>/` of the configured bucket:
//! `s3://BUCKET/KEY` of a function of tenant T is the object `<prefix>data/T/KEY`. BUCKET must
//! be the configured bucket and KEY is checked here as spec.py checks it (no empty, `.` or `..`
//! segment, no backslash or control character, at most 512 bytes), so no key leaves the
//! tenant's space. The snapshots' objects (`chunks/`, `snapshots/`, `functions/`) are never
//! reachable through a data key.
//!
//! # Declared data
//!
//! The objects of a function's `source` entries are fetched on the blocking pool as soon as a
//! start begins (a deploy: before its base boots or is restored; a `cold_start = "boot"`
//! start: before the worker is launched), so the transfer runs while the worker starts. Each
//! goes into a memfd, its length checked against the declared size; a read-only one is then
//! sealed (no write, grow or shrink, by anyone), a writable one is the instance's private copy.
//! After the `load` frame, torpord sends one `data_fd` frame per source entry, the memfd
//! attached (SCM_RIGHTS); the harness serves it to setup() as `/proc/self/fd/N` and closes it
//! before the snapshot.
//!
//! # By reference and write-back
//!
//! [`resolve_refs`] replaces every `{"$ref": "s3://…"}` object of a request by
//! `{"$ref": …, "data": BASE64}` (the harness hands the handler `bytes`); [`dump`] writes what
//! a worker's `dump` frame carries to a writable source entry's object.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use serde_json::Value;
use torpor_objstore::{ObjError, Remote, TransferError};

use crate::bucket::Tier;

/// At most this many bytes of objects by reference per request (they travel base64-encoded in
/// the `invoke` frame, whose maximum is 64 MiB).
pub const MAX_REF_BYTES: u64 = 32 << 20;
/// At most this many references per request.
pub const MAX_REFS: usize = 64;
/// At most this many bytes per `torpor.dump` (it travels base64-encoded in one frame).
pub const MAX_DUMP_BYTES: u64 = 32 << 20;
const MAX_KEY: usize = 512;

/// Why platform-loaded data could not be loaded or written.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{what} is s3://{bucket}/{key}, but this node has no [objstore] in torpord.toml: configure the object store, or declare the data with path")]
    NoObjstore {
        what: String,
        bucket: String,
        key: String,
    },
    #[error("{what} is {uri}, which is not s3://BUCKET/KEY ({reason}); fix it")]
    BadUri {
        what: String,
        uri: String,
        reason: String,
    },
    #[error("{what} names bucket {bucket}, but this node's object store is bucket {configured}: name s3://{configured}/KEY")]
    WrongBucket {
        what: String,
        bucket: String,
        configured: String,
    },
    #[error("{what}: no object {key} in bucket {bucket} (the key s3://{bucket}/{rel} of tenant {tenant}); upload it there or fix the key")]
    Missing {
        what: String,
        bucket: String,
        key: String,
        rel: String,
        tenant: String,
    },
    #[error("{what}: object {key} in bucket {bucket} has {got} bytes, but {declared} are declared (read-only data: exactly; writable: at most); fix size in torpor.toml or replace the object")]
    Size {
        what: String,
        bucket: String,
        key: String,
        got: String,
        declared: u64,
    },
    #[error("{what}: {source}")]
    Store {
        what: String,
        #[source]
        source: Box<TransferError>,
    },
    #[error("{what}: cannot make its memory file: {source}; free memory and try again")]
    Memfd {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the request holds more than {MAX_REFS} $ref objects: pass fewer, or declare the data in torpor.toml")]
    TooManyRefs,
    #[error("the request's $ref objects hold more than {MAX_REF_BYTES} bytes: declare such data in torpor.toml (source = \"s3://…\")")]
    RefsTooLarge,
    #[error("loading data failed: {0}; torpord's log has the cause")]
    Task(String),
}

impl DataError {
    /// The HTTP status of a request's `$ref` that cannot be loaded.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            DataError::Missing { .. } => StatusCode::NOT_FOUND,
            DataError::BadUri { .. }
            | DataError::WrongBucket { .. }
            | DataError::Size { .. }
            | DataError::TooManyRefs
            | DataError::RefsTooLarge => StatusCode::UNPROCESSABLE_ENTITY,
            DataError::NoObjstore { .. } => StatusCode::SERVICE_UNAVAILABLE,
            DataError::Store { .. } | DataError::Memfd { .. } | DataError::Task(_) => {
                StatusCode::BAD_GATEWAY
            }
        }
    }
}

/// `s3://BUCKET/KEY` split and checked: (bucket, key relative to the tenant's space).
pub fn parse_uri(what: &str, uri: &str) -> Result<(String, String), DataError> {
    let bad = |reason: &str| DataError::BadUri {
        what: what.to_string(),
        uri: uri.to_string(),
        reason: reason.to_string(),
    };
    let rest = uri
        .strip_prefix("s3://")
        .ok_or_else(|| bad("it is not an s3:// URI"))?;
    let (bucket, key) = rest
        .split_once('/')
        .ok_or_else(|| bad("it names no key after the bucket"))?;
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && !bucket.starts_with(['.', '-'])
        && !bucket.ends_with(['.', '-']);
    if !bucket_ok {
        return Err(bad("not a bucket name"));
    }
    if key.is_empty() {
        return Err(bad("it names no key after the bucket"));
    }
    if key.len() > MAX_KEY {
        return Err(bad("its key is longer than 512 bytes"));
    }
    if key.chars().any(|c| c.is_control() || c == '\\') {
        return Err(bad("its key holds a control character or a backslash"));
    }
    if key
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(bad(
            "its key has an empty, '.' or '..' segment; keys stay in the tenant's space",
        ));
    }
    Ok((bucket.to_string(), key.to_string()))
}

/// The object name, below the configured prefix, of tenant `tenant`'s key `key`.
pub fn object_key(tenant: &str, key: &str) -> String {
    format!("data/{tenant}/{key}")
}

/// One object to load: where it is and what it must be.
#[derive(Debug, Clone)]
pub struct Source {
    /// For messages: `declared data "w"` or `the request's $ref s3://…`.
    pub what: String,
    /// The entry's name (declared data).
    pub name: String,
    pub bucket: String,
    /// Relative to the tenant's space.
    pub rel: String,
    pub tenant: String,
    /// The declared size (declared data), or the most bytes allowed (a reference).
    pub size: u64,
    pub exact: bool,
    pub readonly: bool,
}

impl Source {
    fn full_key(&self, remote: &Remote) -> String {
        remote.full_key(&object_key(&self.tenant, &self.rel))
    }
}

/// The `source` entries of a spec's `[[data]]`, in declared order.
pub fn declared_sources(spec: &Value) -> Result<Vec<Source>, DataError> {
    let tenant = crate::tenant::of_spec(spec);
    let mut out = Vec::new();
    for d in spec["data"].as_array().into_iter().flatten() {
        let Some(uri) = d["source"].as_str() else {
            continue;
        };
        let name = d["name"].as_str().unwrap_or_default().to_string();
        let what = format!("declared data {name:?} (source {uri})");
        let (bucket, rel) = parse_uri(&what, uri)?;
        out.push(Source {
            what,
            name,
            bucket,
            rel,
            tenant: tenant.to_string(),
            size: d["size"].as_u64().unwrap_or(0),
            // Read-only data has exactly its declared size; writable data at most that (the
            // size bounds what torpor.dump may write back).
            exact: d["access"].as_str() != Some("writable"),
            readonly: d["access"].as_str() != Some("writable"),
        });
    }
    Ok(out)
}

/// That `src` can be loaded here at all (a `[objstore]`, and its bucket): the tier.
fn check_target<'a>(tier: Option<&'a Tier>, src: &Source) -> Result<&'a Tier, DataError> {
    let Some(tier) = tier else {
        return Err(DataError::NoObjstore {
            what: src.what.clone(),
            bucket: src.bucket.clone(),
            key: src.rel.clone(),
        });
    };
    if tier.config.bucket != src.bucket {
        return Err(DataError::WrongBucket {
            what: src.what.clone(),
            bucket: src.bucket.clone(),
            configured: tier.config.bucket.clone(),
        });
    }
    Ok(tier)
}

fn remote_for(tier: Option<&Tier>, src: &Source) -> Result<Remote, DataError> {
    let tier = check_target(tier, src)?;
    Remote::open(&tier.config.remote()).map_err(|e| DataError::Store {
        what: src.what.clone(),
        source: Box::new(e),
    })
}

fn store_error(src: &Source, remote: &Remote, e: ObjError) -> DataError {
    match e {
        ObjError::TooLarge { .. } => DataError::Size {
            what: src.what.clone(),
            bucket: remote.bucket().to_string(),
            key: src.full_key(remote),
            got: format!("more than {}", src.size),
            declared: src.size,
        },
        e => DataError::Store {
            what: src.what.clone(),
            source: Box::new(TransferError::Remote(Box::new(e))),
        },
    }
}

/// Fetches `src` into `out`; its length.
fn fetch_into(remote: &Remote, src: &Source, out: &mut dyn Write) -> Result<u64, DataError> {
    let key = object_key(&src.tenant, &src.rel);
    let got = remote
        .get_into(&key, out, src.size)
        .map_err(|e| store_error(src, remote, e))?
        .ok_or_else(|| DataError::Missing {
            what: src.what.clone(),
            bucket: remote.bucket().to_string(),
            key: src.full_key(remote),
            rel: src.rel.clone(),
            tenant: src.tenant.clone(),
        })?;
    if src.exact && got != src.size {
        return Err(DataError::Size {
            what: src.what.clone(),
            bucket: remote.bucket().to_string(),
            key: src.full_key(remote),
            got: got.to_string(),
            declared: src.size,
        });
    }
    Ok(got)
}

/// A memfd named after `name` (close-on-exec, sealable).
fn memfd(src: &Source) -> Result<std::fs::File, DataError> {
    let name = std::ffi::CString::new(format!("torpor-data-{}", src.name))
        .unwrap_or_else(|_| c"torpor-data".to_owned());
    // SAFETY: memfd_create with a NUL-terminated name and valid flags; the fd it returns is
    // new and owned by the File below.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(DataError::Memfd {
            what: src.what.clone(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Loads one declared source into a memfd: sealed read-only data (no write, grow or shrink,
/// seals sealed) is handed over as a read-only descriptor; writable data as the memfd itself.
pub fn load_one(tier: Option<&Tier>, src: &Source) -> Result<OwnedFd, DataError> {
    let remote = remote_for(tier, src)?;
    let mut file = memfd(src)?;
    let mut writer = std::io::BufWriter::with_capacity(1 << 20, &mut file);
    fetch_into(&remote, src, &mut writer)?;
    writer.flush().map_err(|e| DataError::Memfd {
        what: src.what.clone(),
        source: e,
    })?;
    drop(writer);
    if !src.readonly {
        // The worker shares this open file (and its offset): hand it over at the start.
        use std::io::Seek;
        file.rewind().map_err(|e| DataError::Memfd {
            what: src.what.clone(),
            source: e,
        })?;
        return Ok(OwnedFd::from(file));
    }
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on an fd `file` owns; F_ADD_SEALS takes an int argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(DataError::Memfd {
            what: src.what.clone(),
            source: std::io::Error::last_os_error(),
        });
    }
    // A read-only descriptor of the same memfd: what the worker gets cannot write even where
    // it reopens /proc/self/fd/N (the seals refuse every write).
    let ro = std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| DataError::Memfd {
            what: src.what.clone(),
            source: e,
        })?;
    Ok(OwnedFd::from(ro))
}

/// The objects of `spec`'s source entries, loaded in parallel (one thread each): (name, fd) in
/// declared order. Blocking.
pub fn load_declared(
    tier: Option<&Tier>,
    sources: &[Source],
) -> Result<Vec<(String, OwnedFd)>, DataError> {
    std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| s.spawn(move || load_one(tier, src)))
            .collect();
        let mut out = Vec::new();
        for (h, src) in handles.into_iter().zip(sources) {
            let fd = h
                .join()
                .map_err(|_| DataError::Task(format!("loading {} panicked", src.what)))??;
            out.push((src.name.clone(), fd));
        }
        Ok(out)
    })
}

/// The declared sources' objects, (name, fd) in declared order, and the seconds the load took.
pub type Loaded = (Vec<(String, OwnedFd)>, f64);

/// A load of a spec's declared sources started on the blocking pool.
pub type Loading = tokio::task::JoinHandle<Result<Loaded, DataError>>;

/// Starts loading `spec`'s source entries (crate docs: in parallel with the start). `Err`: a
/// source that cannot be loaded here at all (a malformed key, no `[objstore]`, another bucket).
/// A start that fails meanwhile drops the handle; the fetch then runs to its end unawaited.
pub fn start_loading(tier: Option<Arc<Tier>>, spec: &Value) -> Result<Option<Loading>, DataError> {
    let sources = declared_sources(spec)?;
    if sources.is_empty() {
        return Ok(None);
    }
    // What needs no request is refused now, before the start spends anything.
    for src in &sources {
        check_target(tier.as_deref(), src)?;
    }
    Ok(Some(tokio::task::spawn_blocking(move || {
        let t = std::time::Instant::now();
        load_declared(tier.as_deref(), &sources).map(|v| (v, t.elapsed().as_secs_f64()))
    })))
}

/// Awaits a load started by [`start_loading`] (nothing, in no time, for `None`).
pub async fn finish_loading(loading: Option<Loading>) -> Result<Loaded, DataError> {
    match loading {
        None => Ok((Vec::new(), 0.0)),
        Some(h) => h.await.map_err(|e| DataError::Task(e.to_string()))?,
    }
}

/// Sends one `data_fd` frame per loaded object, its memfd attached (after `load`).
pub async fn send_fds(
    conn: &mut crate::workers::WorkerConn,
    loaded: &[(String, OwnedFd)],
) -> Result<(), crate::workers::ConnError> {
    use std::os::fd::AsFd;
    for (name, fd) in loaded {
        let frame = crate::protocol::ToWorker::DataFd(crate::protocol::DataFd {
            name: name.clone(),
            fd: true,
        });
        crate::split::fds::send_with_fd(&mut conn.wr, &frame, fd.as_fd()).await?;
    }
    Ok(())
}

/// Whether the raw request body may hold a `$ref` (a cheap test before parsing it).
pub fn may_hold_refs(body: &[u8]) -> bool {
    body.windows(6).any(|w| w == b"\"$ref\"")
}

/// Collects the `$ref` URIs of `v` (objects whose only key is `$ref`, a string).
fn refs_of<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(m) => {
            if m.len() == 1 {
                if let Some(Value::String(uri)) = m.get("$ref") {
                    out.push(uri);
                    return;
                }
            }
            m.values().for_each(|x| refs_of(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| refs_of(x, out)),
        _ => {}
    }
}

fn replace_refs(v: &mut Value, loaded: &std::collections::BTreeMap<String, String>) {
    match v {
        Value::Object(m) => {
            if m.len() == 1 {
                if let Some(Value::String(uri)) = m.get("$ref") {
                    if let Some(b64) = loaded.get(uri.as_str()) {
                        m.insert("data".to_string(), Value::String(b64.clone()));
                    }
                    return;
                }
            }
            m.values_mut().for_each(|x| replace_refs(x, loaded));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| replace_refs(x, loaded)),
        _ => {}
    }
}

/// The request `body` with every `{"$ref": "s3://BUCKET/KEY"}` object loaded (from tenant
/// `tenant`'s space) and given its `data` (base64); `None` when it holds no reference (the
/// body then goes on as it came). Blocking.
pub fn resolve_refs(
    tier: Option<&Tier>,
    tenant: &str,
    body: &[u8],
) -> Result<Option<Vec<u8>>, DataError> {
    use base64::Engine as _;
    if !may_hold_refs(body) {
        return Ok(None);
    }
    let Ok(mut v) = serde_json::from_slice::<Value>(body) else {
        return Ok(None);
    };
    let mut uris = Vec::new();
    refs_of(&v, &mut uris);
    if uris.is_empty() {
        return Ok(None);
    }
    let mut uris: Vec<String> = uris.into_iter().map(str::to_string).collect();
    uris.sort();
    uris.dedup();
    if uris.len() > MAX_REFS {
        return Err(DataError::TooManyRefs);
    }
    let sources = uris
        .iter()
        .map(|uri| {
            let what = format!("the request's $ref {uri}");
            let (bucket, rel) = parse_uri(&what, uri)?;
            Ok(Source {
                what,
                name: "ref".to_string(),
                bucket,
                rel,
                tenant: tenant.to_string(),
                size: MAX_REF_BYTES,
                exact: false,
                readonly: true,
            })
        })
        .collect::<Result<Vec<_>, DataError>>()?;
    let fetched: Vec<Vec<u8>> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                s.spawn(move || {
                    let remote = remote_for(tier, src)?;
                    let mut buf = Vec::new();
                    fetch_into(&remote, src, &mut buf).map(|_| buf)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| DataError::Task("a $ref load panicked".into()))?
            })
            .collect::<Result<Vec<_>, DataError>>()
    })?;
    let total: u64 = fetched.iter().map(|b| b.len() as u64).sum();
    if total > MAX_REF_BYTES {
        return Err(DataError::RefsTooLarge);
    }
    let loaded = uris
        .into_iter()
        .zip(fetched)
        .map(|(uri, bytes)| (uri, base64::engine::general_purpose::STANDARD.encode(bytes)))
        .collect();
    replace_refs(&mut v, &loaded);
    Ok(Some(serde_json::to_vec(&v).unwrap_or_default()))
}

/// Why a worker's `dump` was refused (it is logged and counted; the handler does not wait).
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error(
        "torpor.dump({name:?}): function {function} declares no data of that name with a source"
    )]
    Undeclared { function: String, name: String },
    #[error("torpor.dump({name:?}): the data is read-only in torpor.toml; declare it access = \"writable\"")]
    ReadOnly { name: String },
    #[error("torpor.dump({name:?}): {got} bytes, more than the declared size {size}; raise size in torpor.toml")]
    TooLarge { name: String, got: u64, size: u64 },
    #[error("torpor.dump({name:?}): its frame's data is not base64 ({reason}); the harness must send base64")]
    Encoding { name: String, reason: String },
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("torpor.dump({name:?}): writing {key}: {source}")]
    Put {
        name: String,
        key: String,
        #[source]
        source: Box<ObjError>,
    },
}

/// Writes what a worker's `dump` frame carries (`data`, base64) to the object of `spec`'s
/// writable source entry `name`; returns the object's full key. Blocking.
pub fn dump(
    tier: Option<&Tier>,
    spec: &Value,
    name: &str,
    data_b64: &str,
) -> Result<String, DumpError> {
    use base64::Engine as _;
    let function = spec["name"].as_str().unwrap_or_default().to_string();
    let src = declared_sources(spec)?
        .into_iter()
        .find(|s| s.name == name)
        .ok_or_else(|| DumpError::Undeclared {
            function,
            name: name.to_string(),
        })?;
    if src.readonly {
        return Err(DumpError::ReadOnly {
            name: name.to_string(),
        });
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data_b64)
        .map_err(|e| DumpError::Encoding {
            name: name.to_string(),
            reason: e.to_string(),
        })?;
    if bytes.len() as u64 > src.size {
        return Err(DumpError::TooLarge {
            name: name.to_string(),
            got: bytes.len() as u64,
            size: src.size,
        });
    }
    let remote = remote_for(tier, &src)?;
    let key = object_key(&src.tenant, &src.rel);
    remote.put(&key, &bytes).map_err(|e| DumpError::Put {
        name: name.to_string(),
        key: remote.full_key(&key),
        source: Box::new(e),
    })?;
    Ok(remote.full_key(&key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_stay_in_the_tenants_space() {
        let ok = parse_uri("x", "s3://torpor-data/a/b.bin").unwrap();
        assert_eq!(ok, ("torpor-data".to_string(), "a/b.bin".to_string()));
        assert_eq!(object_key("team-a", &ok.1), "data/team-a/a/b.bin");
        for bad in [
            "s3://torpor-data/../functions/x.json",
            "s3://torpor-data/a/./b",
            "s3://torpor-data//b",
            "s3://torpor-data/a/",
            "s3://torpor-data/",
            "s3://torpor-data",
            "s3://Bad_Bucket/k",
            "http://torpor-data/k",
            "s3://torpor-data/a\\..\\b",
            "s3://torpor-data/a\nb",
        ] {
            let e = parse_uri("declared data \"w\"", bad)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("declared data \"w\" is "), "{bad}: {e}");
        }
        let long = format!("s3://b-b/{}", "k".repeat(513));
        assert!(parse_uri("x", &long).is_err());
    }

    #[test]
    fn refs_are_found_anywhere_and_only_as_lone_keys() {
        let v: Value = serde_json::json!({
            "a": {"$ref": "s3://b-b/x"},
            "b": [1, {"$ref": "s3://b-b/y"}, {"$ref": "s3://b-b/z", "other": 1}],
            "c": {"d": {"$ref": 3}}
        });
        let mut out = Vec::new();
        refs_of(&v, &mut out);
        assert_eq!(out, vec!["s3://b-b/x", "s3://b-b/y"]);
        let mut v2 = v.clone();
        let loaded = [("s3://b-b/x".to_string(), "QQ==".to_string())]
            .into_iter()
            .collect();
        replace_refs(&mut v2, &loaded);
        assert_eq!(v2["a"]["data"], "QQ==");
        assert!(v2["b"][1].get("data").is_none());
        assert!(!may_hold_refs(br#"{"x": "a $ref"}"#));
        assert!(may_hold_refs(br#"{"x": {"$ref": "s3://b-b/k"}}"#));
    }

    #[test]
    fn without_an_objstore_a_source_is_one_error_naming_it() {
        let spec = serde_json::json!({"name": "f", "tenant": "default", "data": [
            {"name": "w", "path": "", "abs_path": "", "size": 3, "access": "read-only",
             "source": "s3://torpor-data/w.bin"}]});
        let srcs = declared_sources(&spec).unwrap();
        let e = load_declared(None, &srcs).unwrap_err().to_string();
        assert!(
            e.contains("declared data \"w\" (source s3://torpor-data/w.bin)")
                && e.contains("no [objstore]"),
            "{e}"
        );
        let e = dump(None, &spec, "w", "").unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
        let e = dump(None, &spec, "nope", "").unwrap_err().to_string();
        assert!(e.contains("declares no data"), "{e}");
    }
}
