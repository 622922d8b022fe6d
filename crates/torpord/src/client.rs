//! A small blocking HTTP/1.1 client for torpord's API, over its Unix socket or TCP: what the
//! `torpor` CLI and the tests use. One request per connection (`Connection: close`).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::api::types::ErrorBody;
use crate::config::{DEFAULT_SOCKET, SOCKET_ENV};

/// The longest status line, header line or chunk-size line accepted.
const MAX_LINE: u64 = 16 * 1024;
/// The most header lines accepted.
const MAX_HEADERS: usize = 100;

/// Why a request got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens at the endpoint.
    #[error("torpord is not running on {endpoint}: start it with `torpor serve`")]
    NotRunning { endpoint: String },
    /// The socket exists but this user may not connect.
    #[error(
        "cannot connect to torpord on {endpoint}: permission denied (the socket is mode 0600: \
         run as the user torpord runs as, e.g. with sudo)"
    )]
    PermissionDenied { endpoint: String },
    /// Any other connection failure.
    #[error("cannot connect to torpord on {endpoint}: {source}")]
    Connect {
        endpoint: String,
        source: std::io::Error,
    },
    /// The connection failed mid-request.
    #[error("talking to torpord on {endpoint}: {source}")]
    Io {
        endpoint: String,
        source: std::io::Error,
    },
    /// The answer is not HTTP/1.1 as expected.
    #[error("torpord on {endpoint} sent a malformed response: {message}")]
    Protocol { endpoint: String, message: String },
    /// An error status, with the daemon's message.
    #[error("torpord answered {status}: {message}")]
    Status { status: u16, message: String },
    /// The body is not the JSON expected.
    #[error("torpord sent JSON this client cannot read: {0}")]
    Json(#[from] serde_json::Error),
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

#[derive(Debug, Clone)]
enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(p) => write!(f, "{}", p.display()),
            Endpoint::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// A client for one daemon.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    token: Option<String>,
    timeout: Option<Duration>,
}

/// The socket clients use by default: `$TORPOR_SOCKET`, else the daemon's default.
pub fn default_socket() -> PathBuf {
    std::env::var_os(SOCKET_ENV)
        .filter(|s| !s.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_SOCKET), PathBuf::from)
}

impl Client {
    /// Talks to the daemon's Unix socket.
    pub fn unix(path: impl AsRef<Path>) -> Self {
        Self {
            endpoint: Endpoint::Unix(path.as_ref().to_path_buf()),
            token: None,
            timeout: None,
        }
    }

    /// Talks to the daemon over TCP, sending `token` as the bearer token if given.
    pub fn tcp(addr: SocketAddr, token: Option<String>) -> Self {
        Self {
            endpoint: Endpoint::Tcp(addr),
            token,
            timeout: None,
        }
    }

    /// Fails a request whose connection is silent for longer than `timeout` (default: wait).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    fn io_err(&self, source: std::io::Error) -> ClientError {
        ClientError::Io {
            endpoint: self.endpoint.to_string(),
            source,
        }
    }

    fn protocol(&self, message: impl Into<String>) -> ClientError {
        ClientError::Protocol {
            endpoint: self.endpoint.to_string(),
            message: message.into(),
        }
    }

    fn connect(&self) -> Result<Box<dyn Stream>, ClientError> {
        let endpoint = self.endpoint.to_string();
        let connected: std::io::Result<Box<dyn Stream>> = match &self.endpoint {
            Endpoint::Unix(p) => UnixStream::connect(p).and_then(|s| {
                s.set_read_timeout(self.timeout)?;
                s.set_write_timeout(self.timeout)?;
                Ok(Box::new(s) as Box<dyn Stream>)
            }),
            Endpoint::Tcp(a) => TcpStream::connect(a).and_then(|s| {
                s.set_read_timeout(self.timeout)?;
                s.set_write_timeout(self.timeout)?;
                s.set_nodelay(true)?;
                Ok(Box::new(s) as Box<dyn Stream>)
            }),
        };
        connected.map_err(|source| match source.kind() {
            ErrorKind::NotFound | ErrorKind::ConnectionRefused => {
                ClientError::NotRunning { endpoint }
            }
            ErrorKind::PermissionDenied => ClientError::PermissionDenied { endpoint },
            _ => ClientError::Connect { endpoint, source },
        })
    }

    /// Sends a request and returns the status and headers, with the body still to read.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<StreamingResponse, ClientError> {
        self.send_with(method, path, body, &[])
    }

    /// [`send`](Self::send) with more request headers (name, value); a value with a line
    /// break is refused.
    pub fn send_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> Result<StreamingResponse, ClientError> {
        let mut head =
            format!("{method} {path} HTTP/1.1\r\nHost: torpord\r\nConnection: close\r\n");
        if let Some(token) = &self.token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        for (name, value) in headers {
            if value.contains(['\r', '\n']) || name.contains(['\r', '\n', ':']) {
                return Err(self.protocol(format!("header {name:?} cannot hold a line break")));
            }
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        let mut stream = self.connect()?;
        if let Some(body) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        head.push_str("\r\n");
        stream
            .write_all(head.as_bytes())
            .and_then(|()| stream.write_all(body.unwrap_or_default()))
            .and_then(|()| stream.flush())
            .map_err(|e| self.io_err(e))?;

        let mut reader = BufReader::new(stream);
        let status_line = read_line(&mut reader).map_err(|e| self.io_err(e))?;
        let status = parse_status(&status_line)
            .ok_or_else(|| self.protocol(format!("bad status line {status_line:?}")))?;
        let mut headers = Vec::new();
        loop {
            let line = read_line(&mut reader).map_err(|e| self.io_err(e))?;
            if line.is_empty() {
                break;
            }
            if headers.len() == MAX_HEADERS {
                return Err(self.protocol("too many headers"));
            }
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| self.protocol(format!("bad header line {line:?}")))?;
            headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let mode = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
        {
            BodyMode::Chunked {
                remaining: 0,
                done: false,
            }
        } else if let Some(len) = header("content-length") {
            let len = len
                .parse()
                .map_err(|_| self.protocol(format!("bad Content-Length {len:?}")))?;
            BodyMode::Length(len)
        } else {
            BodyMode::UntilClose
        };
        Ok(StreamingResponse {
            status,
            headers,
            body: Body {
                inner: reader,
                mode,
            },
            endpoint: self.endpoint.to_string(),
        })
    }

    /// Sends a request and reads the whole answer, whatever its status.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<Response, ClientError> {
        self.send(method, path, body)?.read_all()
    }

    /// `GET path`, expecting 2xx and a JSON body of type `T`.
    pub fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        self.request("GET", path, None)?.ok_json()
    }
}

fn read_line(reader: &mut impl BufRead) -> std::io::Result<String> {
    let mut line = String::new();
    let n = reader.take(MAX_LINE).read_line(&mut line)?;
    if n == 0 {
        return Err(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            "connection closed before the answer ended",
        ));
    }
    if !line.ends_with('\n') {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "line too long or truncated",
        ));
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

fn parse_status(line: &str) -> Option<u16> {
    let rest = line.strip_prefix("HTTP/1.")?;
    let mut parts = rest.splitn(3, ' ');
    let _minor = parts.next()?;
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    code.parse().ok()
}

enum BodyMode {
    Length(u64),
    Chunked { remaining: u64, done: bool },
    UntilClose,
}

/// A response body being read: it decodes `Content-Length` and chunked bodies. Wrap it in a
/// `BufReader` to read NDJSON line by line.
pub struct Body {
    inner: BufReader<Box<dyn Stream>>,
    mode: BodyMode,
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Body { inner, mode } = self;
        let eof = || std::io::Error::new(ErrorKind::UnexpectedEof, "body ended early");
        match mode {
            BodyMode::UntilClose => inner.read(buf),
            BodyMode::Length(remaining) => {
                if *remaining == 0 || buf.is_empty() {
                    return Ok(0);
                }
                let max = buf
                    .len()
                    .min(usize::try_from(*remaining).unwrap_or(usize::MAX));
                let n = inner.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(eof());
                }
                *remaining -= n as u64;
                Ok(n)
            }
            BodyMode::Chunked { remaining, done } => {
                if *done || buf.is_empty() {
                    return Ok(0);
                }
                if *remaining == 0 {
                    let line = read_line(inner)?;
                    let size = line.split(';').next().unwrap_or_default().trim();
                    let size = u64::from_str_radix(size, 16).map_err(|_| {
                        std::io::Error::new(
                            ErrorKind::InvalidData,
                            format!("bad chunk size {line:?}"),
                        )
                    })?;
                    if size == 0 {
                        // Trailers, up to the empty line.
                        while !read_line(inner)?.is_empty() {}
                        *done = true;
                        return Ok(0);
                    }
                    *remaining = size;
                }
                let max = buf
                    .len()
                    .min(usize::try_from(*remaining).unwrap_or(usize::MAX));
                let n = inner.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(eof());
                }
                *remaining -= n as u64;
                if *remaining == 0 && !read_line(inner)?.is_empty() {
                    return Err(std::io::Error::new(
                        ErrorKind::InvalidData,
                        "chunk not followed by CRLF",
                    ));
                }
                Ok(n)
            }
        }
    }
}

/// Status and headers of an answer whose body is still to be read.
pub struct StreamingResponse {
    pub status: u16,
    /// Header names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: Body,
    endpoint: String,
}

impl StreamingResponse {
    /// Reads the rest of the body.
    pub fn read_all(mut self) -> Result<Response, ClientError> {
        let mut body = Vec::new();
        self.body
            .read_to_end(&mut body)
            .map_err(|source| ClientError::Io {
                endpoint: self.endpoint.clone(),
                source,
            })?;
        Ok(Response {
            status: self.status,
            headers: self.headers,
            body,
        })
    }
}

/// A whole answer.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The first header called `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON of type `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, ClientError> {
        Ok(serde_json::from_slice(&self.body)?)
    }

    /// The message of an error answer: its `error` field, else its body as text.
    pub fn error_message(&self) -> String {
        match serde_json::from_slice::<ErrorBody>(&self.body) {
            Ok(e) => e.error,
            Err(_) => String::from_utf8_lossy(&self.body).trim().to_string(),
        }
    }

    /// `Err(ClientError::Status)` unless the status is 2xx.
    pub fn ok(self) -> Result<Self, ClientError> {
        if (200..300).contains(&self.status) {
            Ok(self)
        } else {
            Err(ClientError::Status {
                status: self.status,
                message: self.error_message(),
            })
        }
    }

    /// The body of a 2xx answer as JSON of type `T`.
    pub fn ok_json<T: DeserializeOwned>(self) -> Result<T, ClientError> {
        self.ok()?.json()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(mode: BodyMode, bytes: &'static [u8]) -> Body {
        Body {
            inner: BufReader::new(Box::new(std::io::Cursor::new(bytes.to_vec())) as Box<dyn Stream>),
            mode,
        }
    }

    #[test]
    fn decodes_chunked_bodies() {
        let mut b = body(
            BodyMode::Chunked {
                remaining: 0,
                done: false,
            },
            b"5\r\n{\"a\":\r\n3;ext=1\r\n 1}\r\n0\r\nX-Trailer: t\r\n\r\n",
        );
        let mut out = String::new();
        b.read_to_string(&mut out).unwrap();
        assert_eq!(out, "{\"a\": 1}");
    }

    #[test]
    fn a_short_body_is_an_error() {
        let mut b = body(BodyMode::Length(10), b"abc");
        let mut out = Vec::new();
        let e = b.read_to_end(&mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
        let mut b = body(
            BodyMode::Chunked {
                remaining: 0,
                done: false,
            },
            b"zz\r\n",
        );
        assert!(b.read_to_end(&mut out).is_err());
    }

    #[test]
    fn status_lines() {
        assert_eq!(parse_status("HTTP/1.1 200 OK"), Some(200));
        assert_eq!(parse_status("HTTP/1.1 404"), Some(404));
        assert_eq!(parse_status("HTTP/2 200 OK"), None);
        assert_eq!(parse_status("garbage"), None);
    }

    #[test]
    fn nothing_listening_is_not_running() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("none.sock");
        let e = Client::unix(&sock)
            .request("GET", "/v1/status", None)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "torpord is not running on {}: start it with `torpor serve`",
                sock.display()
            )
        );
    }
}
