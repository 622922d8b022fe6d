//! The frame codec of the worker protocol (docs/torpord.md), the Rust side of
//! python/torpor/frames.py: a 4-byte big-endian length, then that many bytes of UTF-8 JSON
//! holding one object, at most [`MAX_FRAME`] bytes.

use serde_json::{Map, Value};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The longest payload accepted or sent.
pub const MAX_FRAME: usize = 64 << 20;

/// What a payload's buffer starts with before its bytes arrive.
const INITIAL_PAYLOAD: usize = 64 << 10;

/// A frame that breaks the codec's rules; the connection it came on is dropped.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes is over the {MAX_FRAME}-byte maximum")]
    TooLong(usize),
    #[error("connection closed inside a frame")]
    Truncated,
    #[error("frame is not a JSON object: {0}")]
    NotJson(String),
    #[error("reading from the worker failed: {0}")]
    Io(#[from] std::io::Error),
}

impl FrameError {
    /// What happened to a worker whose frame failed this way, for the reason it was removed: a
    /// broken connection is the worker's death, not its mistake.
    pub fn what_happened(&self) -> String {
        match self {
            FrameError::Io(e) => {
                format!("its connection broke ({e}): the worker exited or was killed")
            }
            FrameError::Truncated => {
                "its connection closed in the middle of a frame: the worker exited or was killed"
                    .to_string()
            }
            other => format!("it sent a malformed frame ({other})"),
        }
    }
}

/// One frame (header and payload) holding `obj`. Fails only for a payload over [`MAX_FRAME`].
pub fn encode<T: serde::Serialize + ?Sized>(obj: &T) -> Result<Vec<u8>, FrameError> {
    let payload = serde_json::to_vec(obj).map_err(|e| FrameError::NotJson(e.to_string()))?;
    if payload.len() > MAX_FRAME {
        return Err(FrameError::TooLong(payload.len()));
    }
    let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLong(payload.len()))?;
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// The next frame's object, or `None` when the peer closed the connection between frames.
pub async fn read<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<Option<Map<String, Value>>, FrameError> {
    match read_payload(r).await? {
        Some(payload) => parse(&payload).map(Some),
        None => Ok(None),
    }
}

/// The next frame's payload, unparsed (for frames whose values must pass through as sent), or
/// `None` when the peer closed the connection between frames.
pub async fn read_payload<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        let n = r.read(&mut header[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(FrameError::Truncated)
            };
        }
        got += n;
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong(len));
    }
    // Grown as the bytes arrive, not allocated at the announced length: a worker that announces
    // a 64 MiB frame and sends ten bytes holds ten (found by tests/fuzz_input.rs).
    let mut payload = Vec::with_capacity(len.min(INITIAL_PAYLOAD));
    let got = r.take(len as u64).read_to_end(&mut payload).await?;
    if got < len {
        return Err(FrameError::Truncated);
    }
    Ok(Some(payload))
}

/// The object in one frame's payload.
pub fn parse(payload: &[u8]) -> Result<Map<String, Value>, FrameError> {
    match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(FrameError::NotJson(format!(
            "a JSON {} instead of an object",
            match other {
                Value::Array(_) => "array",
                Value::String(_) => "string",
                Value::Number(_) => "number",
                Value::Bool(_) => "boolean",
                _ => "null",
            }
        ))),
        Err(e) => Err(FrameError::NotJson(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_is_not_called_a_malformed_frame() {
        let reset = FrameError::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(reset.what_happened().contains("exited or was killed"));
        assert!(!reset.what_happened().contains("malformed"));
        assert!(!FrameError::Truncated.what_happened().contains("malformed"));
        assert!(FrameError::NotJson("x".into())
            .what_happened()
            .starts_with("it sent a malformed frame"));
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn round_trip_and_errors() {
        let frame = encode(&serde_json::json!({"type": "hello", "pid": 1})).unwrap();
        assert_eq!(&frame[..4], &((frame.len() - 4) as u32).to_be_bytes());
        let mut two = frame.clone();
        two.extend_from_slice(&frame);
        let mut r = &two[..];
        block_on(async {
            assert_eq!(read(&mut r).await.unwrap().unwrap()["type"], "hello");
            assert!(read(&mut r).await.unwrap().is_some());
            assert!(read(&mut r).await.unwrap().is_none());
            let mut r = &frame[..frame.len() - 1];
            assert!(matches!(read(&mut r).await, Err(FrameError::Truncated)));
            let mut r = &[0u8, 0][..];
            assert!(matches!(read(&mut r).await, Err(FrameError::Truncated)));
            let long = ((MAX_FRAME + 1) as u32).to_be_bytes();
            let mut r = &long[..];
            assert!(matches!(read(&mut r).await, Err(FrameError::TooLong(_))));
            let mut bad = 3u32.to_be_bytes().to_vec();
            bad.extend_from_slice(b"[1]");
            let mut r = &bad[..];
            assert!(matches!(read(&mut r).await, Err(FrameError::NotJson(_))));
            let mut bad = 3u32.to_be_bytes().to_vec();
            bad.extend_from_slice(b"NaN");
            let mut r = &bad[..];
            assert!(matches!(read(&mut r).await, Err(FrameError::NotJson(_))));
        });
    }
}
