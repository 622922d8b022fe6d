//! The worker's side of a segment hand-over, played by the split path's unit tests: a socket
//! pair, the daemon's `planned` and `send_maps` on one end, a stand-in worker answering every
//! `map` frame with `mapped` on the other.

use std::os::fd::{AsRawFd, OwnedFd};

use serde_json::{json, Value};
use tokio::net::UnixStream;

use crate::split::fds;
use crate::split::release::InstanceSegments;
use crate::split::server::{Restoring, SegmentsError};

/// Hands the segments over as torpord does (`planned`, then `send_maps`) to a worker that
/// answers every `map` (at most `frames` of them; fewer come after an error, when the daemon's
/// end closes); `sent` is told of each VA as its frame goes out. Returns the instance's
/// segments (or the error) and the frames the worker got, in order, with their fds.
pub(crate) async fn hand_over(
    restoring: Restoring,
    frames: usize,
    sent: impl Fn(u64) + Send,
) -> (
    Result<InstanceSegments, SegmentsError>,
    Vec<(Value, OwnedFd)>,
) {
    let (daemon, worker_end) = UnixStream::pair().unwrap();
    let (_drd, dwr) = daemon.into_split();
    let writer = tokio::sync::Mutex::new(dwr);
    let (mut rd, mut wr) = worker_end.into_split();
    let send = async move {
        let handing = restoring.planned().await?;
        let mut segments = InstanceSegments::handing(handing.plan());
        handing
            .send_maps(&writer, |va, lease| {
                sent(va);
                segments.push(va, lease);
            })
            .await?;
        // The worker's end then sees the end of the frames.
        drop(writer);
        Ok(segments)
    };
    let worker = async {
        let mut out = Vec::new();
        while out.len() < frames {
            let Some((frame, fd)) = fds::read_with_fd(&mut rd).await.unwrap() else {
                break;
            };
            assert_eq!(frame["type"], "map");
            let va = frame["va"].as_u64().unwrap();
            crate::workers::send(&mut wr, &json!({"type": "mapped", "va": va, "ok": true}))
                .await
                .unwrap();
            out.push((Value::Object(frame), fd.expect("a map frame carries an fd")));
        }
        out
    };
    tokio::join!(send, worker)
}

/// The first `len` bytes of the memory behind `fd` (a segment's memfd).
pub(crate) fn read_fd(fd: &OwnedFd, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: pread into a buffer of `len` bytes from an open fd.
    let n = unsafe { libc::pread(fd.as_raw_fd(), out.as_mut_ptr().cast(), len, 0) };
    assert_eq!(n, len as isize);
    out
}
