//! Signed GET, PUT, HEAD and DELETE of objects: rusty-s3 signs (SigV4, as a presigned URL), ureq sends.

use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rusty_s3::{Bucket, S3Action, UrlStyle};

use crate::config::{Credentials, RemoteConfig};
use crate::error::{ObjError, TransferError};

/// How much of an error answer's body is read (its S3 error code is near its start).
const ERROR_BODY_BYTES: u64 = 64 << 10;

/// How long a signed request stays valid: longer than any one request takes.
const SIGNED_FOR: Duration = Duration::from_secs(15 * 60);
/// A connection that cannot be made in this time is a server that is not there.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A request that moves no byte for this long is a server that went away.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How many times a request is sent when the server answers it with a transient error
/// ([`retryable`]), and the pause before the first retry (doubled before each next one). S3
/// asks clients to retry these (AWS's SDKs: 3 attempts, exponential backoff). A 500 that lasts
/// (a SeaweedFS without a free volume, docs/objstore.md) is the error after the last attempt.
const ATTEMPTS: u32 = 4;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Requests and bytes moved, for reports and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Traffic {
    pub requests: u64,
    /// Of `requests`, those sent again after a transient error.
    pub retries: u64,
    pub bytes_up: u64,
    pub bytes_down: u64,
}

/// A bucket at an endpoint, with the credentials to use it.
#[derive(Debug)]
pub struct Remote {
    bucket: Bucket,
    credentials: rusty_s3::Credentials,
    credentials_file: PathBuf,
    endpoint: String,
    prefix: String,
    range_bytes: u64,
    agent: ureq::Agent,
    requests: AtomicU64,
    retries: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
}

impl Remote {
    /// Opens the bucket `config` names, reading its credentials file.
    pub fn open(config: &RemoteConfig) -> Result<Remote, TransferError> {
        let creds = Credentials::load(&config.credentials_file)?;
        let credentials = match &creds.session_token {
            Some(token) => rusty_s3::Credentials::new_with_token(
                &creds.access_key_id,
                &creds.secret_access_key,
                token,
            ),
            None => rusty_s3::Credentials::new(&creds.access_key_id, &creds.secret_access_key),
        };
        let endpoint_error = |reason: String| ObjError::Endpoint {
            endpoint: config.endpoint.clone(),
            bucket: config.bucket.clone(),
            reason,
        };
        let url = config
            .endpoint
            .parse()
            .map_err(|e: url::ParseError| endpoint_error(e.to_string()))?;
        let style = if config.path_style {
            UrlStyle::Path
        } else {
            UrlStyle::VirtualHost
        };
        let bucket = Bucket::new(url, style, config.bucket.clone(), config.region.clone())
            .map_err(|e| endpoint_error(e.to_string()))?;
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_per_read(Some(STALL_TIMEOUT))
            .timeout_per_write(Some(STALL_TIMEOUT))
            .build()
            .into();
        Ok(Remote {
            bucket,
            credentials,
            credentials_file: config.credentials_file.clone(),
            endpoint: config.endpoint.clone(),
            prefix: config.prefix.clone(),
            range_bytes: config.range_bytes,
            agent,
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
        })
    }

    /// The longest ranged GET a pull sends (`RemoteConfig::range_bytes`).
    pub fn range_bytes(&self) -> u64 {
        self.range_bytes
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        self.bucket.name()
    }

    /// What this remote moved so far.
    pub fn traffic(&self) -> Traffic {
        Traffic {
            requests: self.requests.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            bytes_up: self.bytes_up.load(Ordering::Relaxed),
            bytes_down: self.bytes_down.load(Ordering::Relaxed),
        }
    }

    /// `key` with the configured prefix: the object's full name.
    pub fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Whether object `key` exists.
    pub fn exists(&self, key: &str) -> Result<bool, ObjError> {
        let full = self.full_key(key);
        let url = self
            .bucket
            .head_object(Some(&self.credentials), &full)
            .sign(SIGNED_FOR);
        let resp = self.send("HEAD", &full, || self.agent.head(url.as_str()).call())?;
        match resp.status().as_u16() {
            200..=299 => Ok(true),
            // HEAD has no body, so no S3 error code to tell a missing bucket from a missing key.
            404 => Ok(false),
            status => Err(self.status_error("HEAD", &full, status, String::new())),
        }
    }

    /// Object `key`'s contents, or `None` when there is no such object; refuses one larger
    /// than `limit` bytes.
    pub fn get(&self, key: &str, limit: u64) -> Result<Option<Vec<u8>>, ObjError> {
        let full = self.full_key(key);
        let mut resp = self.send_get(&full, None)?;
        let status = resp.status().as_u16();
        // An error's body is read whole whatever the limit: its S3 code tells a missing bucket
        // from a missing object (cut at a small limit, a missing bucket read as no object).
        let cap = if (200..=299).contains(&status) {
            limit.saturating_add(1)
        } else {
            ERROR_BODY_BYTES
        };
        let mut body = Vec::new();
        let read = resp.body_mut().as_reader().take(cap).read_to_end(&mut body);
        if let Err(e) = read {
            return Err(self.unreachable("GET", &full, ureq::Error::Io(e)));
        }
        self.bytes_down
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        match status {
            200..=299 if body.len() as u64 > limit => Err(ObjError::TooLarge {
                bucket: self.bucket().to_owned(),
                key: full,
                limit,
            }),
            200..=299 => Ok(Some(body)),
            status => self
                .refused("GET", &full, status, &body, true)
                .map(|()| None),
        }
    }

    /// Streams object `key` into `out` and returns its length, or `None` when there is no
    /// such object; refuses one larger than `limit` bytes (`TooLarge`, after `limit + 1` bytes
    /// were written: the caller discards `out`).
    pub fn get_into(
        &self,
        key: &str,
        out: &mut dyn std::io::Write,
        limit: u64,
    ) -> Result<Option<u64>, ObjError> {
        let full = self.full_key(key);
        let mut resp = self.send_get(&full, None)?;
        let status = resp.status().as_u16();
        let reader = resp.body_mut().as_reader();
        if !(200..=299).contains(&status) {
            let mut body = Vec::new();
            let _ = reader.take(ERROR_BODY_BYTES).read_to_end(&mut body);
            return self
                .refused("GET", &full, status, &body, true)
                .map(|()| None);
        }
        let mut body = reader.take(limit.saturating_add(1));
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        loop {
            let k = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.unreachable("GET", &full, ureq::Error::Io(e))),
            };
            out.write_all(&buf[..k]).map_err(|e| ObjError::Local {
                key: full.clone(),
                source: e,
            })?;
            n += k as u64;
        }
        self.bytes_down.fetch_add(n, Ordering::Relaxed);
        if n > limit {
            return Err(ObjError::TooLarge {
                bucket: self.bucket().to_owned(),
                key: full,
                limit,
            });
        }
        Ok(Some(n))
    }

    /// Bytes `start..start + len` of object `key` (an HTTP Range GET), or `None` when there is
    /// no such object. The answer may be shorter than `len` (the object is): the caller checks.
    pub fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Option<Vec<u8>>, ObjError> {
        let mut body = Vec::new();
        Ok(self
            .get_range_into(key, start, len, &mut body)?
            .then_some(body))
    }

    /// [`get_range`](Self::get_range) into `body` (emptied first), so that a caller fetching
    /// many ranges reuses its buffers: a new 32 MiB buffer per GET is a new mapping, and
    /// mapping and unmapping them from many threads at once serialises them in the kernel.
    /// `false`: there is no such object.
    pub fn get_range_into(
        &self,
        key: &str,
        start: u64,
        len: u64,
        body: &mut Vec<u8>,
    ) -> Result<bool, ObjError> {
        let full = self.full_key(key);
        let last = start.saturating_add(len.max(1)) - 1;
        let mut resp = self.send_get(&full, Some((start, last)))?;
        let status = resp.status().as_u16();
        // A server that ignores Range answers 200 with the whole object: read up to the range's
        // end and cut it out.
        let (skip, limit) = match status {
            200 => (start, start.saturating_add(len)),
            _ => (0, len.max(ERROR_BODY_BYTES)),
        };
        let mut reader = resp.body_mut().as_reader().take(limit);
        let read = if status == 206 {
            read_over(&mut reader, body, len as usize)
        } else {
            body.clear();
            reader.read_to_end(body).map(drop)
        };
        if let Err(e) = read {
            return Err(self.unreachable("GET", &full, ureq::Error::Io(e)));
        }
        self.bytes_down
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        match status {
            206 => Ok(true),
            200 => {
                body.drain(..(skip as usize).min(body.len()));
                Ok(true)
            }
            // The range starts past the object's end: an object shorter than its index says.
            416 => {
                body.clear();
                Ok(true)
            }
            status => self
                .refused("GET", &full, status, body, true)
                .map(|()| false),
        }
    }

    /// The objects whose keys start with `prefix` (relative to the configured prefix), as
    /// (key relative to the configured prefix, size), every page of the listing.
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, ObjError> {
        let full = self.full_key(prefix);
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut action = self.bucket.list_objects_v2(Some(&self.credentials));
            action.with_prefix(full.as_str());
            if let Some(t) = &token {
                action.with_continuation_token(t.as_str());
            }
            let url = action.sign(SIGNED_FOR);
            let mut resp = self.send("LIST", &full, || self.agent.get(url.as_str()).call())?;
            let status = resp.status().as_u16();
            let mut body = Vec::new();
            let read = resp
                .body_mut()
                .as_reader()
                .take(64 << 20)
                .read_to_end(&mut body);
            if let Err(e) = read {
                return Err(self.unreachable("LIST", &full, ureq::Error::Io(e)));
            }
            self.bytes_down
                .fetch_add(body.len() as u64, Ordering::Relaxed);
            if !(200..=299).contains(&status) {
                // A listing of nothing is an empty page, never a 404 of the key.
                self.refused("LIST", &full, status, &body, false)?;
            }
            let text = String::from_utf8_lossy(&body);
            let page = rusty_s3::actions::ListObjectsV2::parse_response(&text).map_err(|e| {
                self.status_error("LIST", &full, status, format!("unreadable listing: {e}"))
            })?;
            for c in page.contents {
                if let Some(rel) = c.key.strip_prefix(self.prefix.as_str()) {
                    out.push((rel.to_owned(), c.size.unwrap_or(0)));
                }
            }
            match page.next_continuation_token {
                // A server that hands back the token it was given would list forever.
                Some(t) if token.as_deref() == Some(t.as_str()) => {
                    return Err(self.status_error(
                        "LIST",
                        &full,
                        status,
                        "the listing repeats its continuation token".to_owned(),
                    ))
                }
                Some(t) if !t.is_empty() => token = Some(t),
                _ => return Ok(out),
            }
        }
    }

    /// Writes object `key`.
    pub fn put(&self, key: &str, bytes: &[u8]) -> Result<(), ObjError> {
        let full = self.full_key(key);
        let url = self
            .bucket
            .put_object(Some(&self.credentials), &full)
            .sign(SIGNED_FOR);
        let mut resp = self.send("PUT", &full, || {
            self.bytes_up
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.agent.put(url.as_str()).send(bytes)
        })?;
        self.written("PUT", &full, &mut resp, false)
    }

    /// Deletes object `key`; a key that is not there is no error (S3 answers 204 either way).
    pub fn delete(&self, key: &str) -> Result<(), ObjError> {
        let full = self.full_key(key);
        let url = self
            .bucket
            .delete_object(Some(&self.credentials), &full)
            .sign(SIGNED_FOR);
        let mut resp = self.send("DELETE", &full, || self.agent.delete(url.as_str()).call())?;
        self.written("DELETE", &full, &mut resp, true)
    }

    /// The outcome of a PUT or DELETE of `full` answered `resp` (an error's S3 code read from
    /// its body); `gone_ok`: a 404 of the key, not of the bucket, is done (a DELETE).
    fn written(
        &self,
        op: &'static str,
        full: &str,
        resp: &mut ureq::http::Response<ureq::Body>,
        gone_ok: bool,
    ) -> Result<(), ObjError> {
        let status = resp.status().as_u16();
        if (200..=299).contains(&status) {
            return Ok(());
        }
        let mut body = Vec::new();
        let _ = resp
            .body_mut()
            .as_reader()
            .take(ERROR_BODY_BYTES)
            .read_to_end(&mut body);
        self.refused(op, full, status, &body, gone_ok)
    }

    /// Sends a signed GET of object `full` (key with the prefix), of bytes `first..=last`
    /// when `range` says so, and counts it.
    fn send_get(
        &self,
        full: &str,
        range: Option<(u64, u64)>,
    ) -> Result<ureq::http::Response<ureq::Body>, ObjError> {
        let url = self
            .bucket
            .get_object(Some(&self.credentials), full)
            .sign(SIGNED_FOR);
        let range = range.map(|(first, last)| format!("bytes={first}-{last}"));
        self.send("GET", full, || {
            let request = self.agent.get(url.as_str());
            match &range {
                Some(r) => request.header("Range", r).call(),
                None => request.call(),
            }
        })
    }

    /// Sends `request` (`op` on object `full`) and counts it; a transient error of the server
    /// ([`retryable`]) has it sent again, up to [`ATTEMPTS`] times in all, after a pause that
    /// doubles from [`FIRST_BACKOFF`]. Every request Torpor makes may be sent twice: its PUTs
    /// write content-addressed objects or the same manifest again, the rest only read or delete.
    fn send(
        &self,
        op: &'static str,
        full: &str,
        request: impl Fn() -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<ureq::http::Response<ureq::Body>, ObjError> {
        let (mut pause, mut attempt) = (FIRST_BACKOFF, 1);
        loop {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let mut resp = request().map_err(|e| self.unreachable(op, full, e))?;
            if attempt >= ATTEMPTS || !retryable(resp.status().as_u16()) {
                return Ok(resp);
            }
            // Read the error's body, so that the connection can be used again.
            let _ = std::io::copy(
                &mut resp.body_mut().as_reader().take(ERROR_BODY_BYTES),
                &mut std::io::sink(),
            );
            std::thread::sleep(pause);
            pause *= 2;
            attempt += 1;
            self.retries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What an answer of `status` other than success to `op` on `full` means (its S3 error
    /// code read from `body`): the bucket's absence, or the status; `missing_ok`: a 404 of the
    /// key, not of the bucket, is `Ok` (a GET's missing object, a DELETE's done).
    fn refused(
        &self,
        op: &'static str,
        full: &str,
        status: u16,
        body: &[u8],
        missing_ok: bool,
    ) -> Result<(), ObjError> {
        match (status, s3_code(body).as_str()) {
            (404, "NoSuchBucket") => Err(self.no_bucket()),
            (404, _) if missing_ok => Ok(()),
            (_, code) => Err(self.status_error(op, full, status, code.to_owned())),
        }
    }

    fn status_error(&self, op: &'static str, key: &str, status: u16, code: String) -> ObjError {
        if status == 403 || status == 401 {
            return ObjError::Denied {
                endpoint: self.endpoint.clone(),
                bucket: self.bucket().to_owned(),
                credentials: self.credentials_file.clone(),
                key: key.to_owned(),
                status,
                code: if code.is_empty() {
                    "Forbidden".to_owned()
                } else {
                    code
                },
            };
        }
        ObjError::Status {
            endpoint: self.endpoint.clone(),
            op,
            key: key.to_owned(),
            status,
            code,
        }
    }

    fn no_bucket(&self) -> ObjError {
        ObjError::NoBucket {
            endpoint: self.endpoint.clone(),
            bucket: self.bucket().to_owned(),
        }
    }

    fn unreachable(&self, op: &'static str, key: &str, e: ureq::Error) -> ObjError {
        ObjError::Unreachable {
            endpoint: self.endpoint.clone(),
            op,
            key: key.to_owned(),
            source: Box::new(e),
        }
    }
}

/// Reads at most `len` bytes of `reader` into `body`, over what it held: `body` ends as long as
/// what came. A buffer that went round before, or was made ahead and faulted in
/// (fetch_buffers.rs), is written in place; `read_to_end` would zero its spare room before
/// every read into it, a pass over each byte before the one that fills it.
fn read_over(reader: &mut impl Read, body: &mut Vec<u8>, len: usize) -> std::io::Result<()> {
    if body.capacity() < len {
        *body = Vec::with_capacity(len);
        crate::huge::advise_spare(body);
    }
    // Zeroes only what `body` did not hold yet.
    body.resize(len, 0);
    let mut filled = 0;
    while filled < len {
        match reader.read(&mut body[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                body.truncate(filled);
                return Err(e);
            }
        }
    }
    body.truncate(filled);
    Ok(())
}

/// Statuses an S3 server answers for a transient failure: too many requests (429, and S3's
/// `503 SlowDown`), an internal error (500) and a gateway's or busy server's (502, 503, 504).
fn retryable(status: u16) -> bool {
    matches!(status, 429 | 500 | 502 | 503 | 504)
}

/// The `<Code>` of an S3 error body, or "" when there is none.
fn s3_code(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map(|(code, _)| code.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that gives at most `step` bytes a read, as a socket does.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min(self.step).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn a_range_is_read_over_what_the_buffer_held_and_the_buffer_ends_as_long_as_what_came() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        // A buffer that went round, longer than the range and full of an older range's bytes.
        let mut body = vec![0xAAu8; 20_000];
        let mut reader = Trickle {
            data: &data,
            step: 777,
        };
        read_over(&mut reader, &mut body, 10_000).unwrap();
        assert_eq!(body, data);
        // Shorter than asked (the caller reports it): only what came.
        let mut body = vec![0xAAu8; 64];
        let mut reader = Trickle {
            data: &data[..100],
            step: 30,
        };
        read_over(&mut reader, &mut body, 1_000).unwrap();
        assert_eq!(body, &data[..100]);
        // An empty buffer grows; nothing past `len` is read.
        let mut body = Vec::new();
        let mut reader = Trickle {
            data: &data,
            step: 4096,
        };
        read_over(&mut reader, &mut body, 5_000).unwrap();
        assert_eq!(body, &data[..5_000]);
        assert_eq!(reader.data.len(), 5_000);
    }

    #[test]
    fn error_codes_are_read_from_s3_bodies() {
        let body =
            b"<?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>x</Message></Error>";
        assert_eq!(s3_code(body), "NoSuchBucket");
        assert_eq!(s3_code(b"not xml"), "");
    }

    /// A server on loopback that answers each request, one a connection, with the next of
    /// `answers` (status, body), and records each request's first line.
    fn scripted(
        answers: Vec<(u16, &'static str)>,
    ) -> (String, std::thread::JoinHandle<Vec<String>>) {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for (status, body) in answers {
                let (stream, _) = listener.accept().unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                seen.push(line.trim_end().to_owned());
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    reader.read_line(&mut header).unwrap();
                    if header.trim_end().is_empty() {
                        break;
                    }
                    if let Some(v) = header.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut sent = vec![0u8; length];
                reader.read_exact(&mut sent).unwrap();
                let mut stream = stream;
                write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .unwrap();
            }
            seen
        });
        (endpoint, server)
    }

    fn remote_at(endpoint: &str, dir: &std::path::Path) -> Remote {
        use std::os::unix::fs::PermissionsExt;
        let credentials_file = dir.join("credentials");
        std::fs::write(
            &credentials_file,
            "access_key_id = \"a\"\nsecret_access_key = \"b\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&credentials_file, std::fs::Permissions::from_mode(0o600))
            .unwrap();
        Remote::open(&RemoteConfig {
            endpoint: endpoint.to_owned(),
            bucket: "b".to_owned(),
            region: "us-east-1".to_owned(),
            credentials_file,
            path_style: true,
            prefix: String::new(),
            range_bytes: crate::config::DEFAULT_RANGE_BYTES,
        })
        .unwrap()
    }

    const INTERNAL: &str = "<Error><Code>InternalError</Code></Error>";

    #[test]
    fn transient_errors_are_retried_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let (endpoint, server) = scripted(vec![
            (503, "<Error><Code>SlowDown</Code></Error>"),
            (500, INTERNAL),
            (200, "hello"),
            (500, INTERNAL),
            (200, ""),
        ]);
        let r = remote_at(&endpoint, dir.path());
        assert_eq!(r.get("k", 100).unwrap(), Some(b"hello".to_vec()));
        r.put("p", b"data").unwrap();
        let seen = server.join().unwrap();
        assert!(
            seen[..3].iter().all(|l| l.starts_with("GET /b/k")),
            "{seen:?}"
        );
        assert!(
            seen[3..].iter().all(|l| l.starts_with("PUT /b/p")),
            "{seen:?}"
        );
        let t = r.traffic();
        assert_eq!((t.requests, t.retries, t.bytes_up), (5, 3, 8), "{t:?}");
    }

    #[test]
    fn a_transient_error_that_lasts_is_the_status_after_the_last_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let (endpoint, server) = scripted(vec![(500, INTERNAL); ATTEMPTS as usize]);
        let r = remote_at(&endpoint, dir.path());
        let err = r.put("p", b"data").unwrap_err();
        assert!(matches!(err, ObjError::Status { status: 500, .. }), "{err}");
        assert!(
            err.to_string().contains("500 InternalError to PUT p"),
            "{err}"
        );
        assert_eq!(server.join().unwrap().len(), ATTEMPTS as usize);
        assert_eq!(r.traffic().retries, u64::from(ATTEMPTS) - 1);
    }

    #[test]
    fn other_errors_are_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let (endpoint, server) = scripted(vec![
            (404, "<Error><Code>NoSuchKey</Code></Error>"),
            (403, "<Error><Code>AccessDenied</Code></Error>"),
        ]);
        let r = remote_at(&endpoint, dir.path());
        assert_eq!(r.get("k", 100).unwrap(), None);
        let err = r.get("k", 100).unwrap_err();
        assert!(matches!(err, ObjError::Denied { .. }), "{err}");
        assert_eq!(server.join().unwrap().len(), 2);
        assert_eq!((r.traffic().requests, r.traffic().retries), (2, 0));
    }
}
