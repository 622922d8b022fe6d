//! Frames that carry a file descriptor on a worker connection (docs/split.md, "Worker
//! frames"): the fd travels as `SCM_RIGHTS` with the frame's first byte (its header).
//!
//! Only the split steps use these; every other frame goes through [`crate::frames`] with plain
//! reads and writes, so the warm path pays nothing for fd passing.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde_json::{Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use torpor_device::fd_passing;

use crate::frames::{self, FrameError, MAX_FRAME};
use crate::workers::ConnError;

/// One `recvmsg` of at most `buf.len()` bytes, with the fds that came with them.
fn recvmsg_once(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    fd_passing::recvmsg_with_fds(sock, buf).map(|r| (r.bytes, r.fds))
}

/// Reads the next frame and the fd that came with its header, if any; `None` at a clean EOF.
pub async fn read_with_fd(
    rd: &mut OwnedReadHalf,
) -> Result<Option<(Map<String, Value>, Option<OwnedFd>)>, ConnError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < header.len() {
        let stream = rd.as_ref();
        stream.readable().await.map_err(FrameError::Io)?;
        let r = stream.try_io(Interest::READABLE, || {
            recvmsg_once(stream.as_fd(), &mut header[got..])
        });
        match r {
            Ok((0, _)) if got == 0 => return Ok(None),
            Ok((0, _)) => return Err(FrameError::Truncated.into()),
            Ok((n, more)) => {
                got += n;
                fds.extend(more);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(FrameError::Io(e).into()),
        }
    }
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong(len).into());
    }
    let mut payload = vec![0u8; len];
    rd.read_exact(&mut payload).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Truncated
        } else {
            FrameError::Io(e)
        }
    })?;
    let msg = match serde_json::from_slice::<Value>(&payload) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err(FrameError::NotJson("not a JSON object".into()).into()),
        Err(e) => return Err(FrameError::NotJson(e.to_string()).into()),
    };
    if fds.len() > 1 {
        return Err(ConnError::Protocol(format!(
            "a {} frame came with {} fds: send exactly one fd per frame",
            msg.get("type").unwrap_or(&Value::Null),
            fds.len()
        )));
    }
    Ok(Some((msg, fds.pop())))
}

/// Sends `obj` as one frame with `fd` attached to its first byte.
pub async fn send_with_fd(
    wr: &mut OwnedWriteHalf,
    obj: &(impl serde::Serialize + ?Sized),
    fd: BorrowedFd<'_>,
) -> Result<(), ConnError> {
    let frame = frames::encode(obj)?;
    let sent = loop {
        let stream = wr.as_ref();
        stream.writable().await.map_err(ConnError::Write)?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            fd_passing::sendmsg_with_fd(stream.as_fd(), &frame, fd, libc::MSG_DONTWAIT)
        });
        match sent {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(ConnError::Write(e)),
        }
    };
    // The fd went with the first bytes; the rest follows plainly.
    wr.write_all(&frame[sent..]).await.map_err(ConnError::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;

    fn inode(fd: BorrowedFd<'_>) -> u64 {
        std::fs::File::from(fd.try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .ino()
    }

    #[test]
    fn a_frame_and_its_fd_arrive_together_and_plain_frames_still_read() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async {
            let (a, b) = tokio::net::UnixStream::pair().unwrap();
            let (_ra, mut wa) = a.into_split();
            let (mut rb, _wb) = b.into_split();
            let file = tempfile::tempfile().unwrap();
            let big = "x".repeat(300_000);
            let send = async {
                send_with_fd(
                    &mut wa,
                    &serde_json::json!({"type": "map", "pad": big}),
                    file.as_fd(),
                )
                .await
                .unwrap();
                crate::workers::send(&mut wa, &serde_json::json!({"type": "mapped"}))
                    .await
                    .unwrap();
            };
            let recv = async {
                let first = read_with_fd(&mut rb).await.unwrap().unwrap();
                let second = read_with_fd(&mut rb).await.unwrap().unwrap();
                (first, second)
            };
            let ((), ((msg, fd), (msg2, fd2))) = tokio::join!(send, recv);
            assert_eq!(msg["type"], "map");
            assert_eq!(msg["pad"].as_str().unwrap().len(), 300_000);
            assert_eq!(inode(fd.unwrap().as_fd()), inode(file.as_fd()));
            assert_eq!(msg2["type"], "mapped");
            assert!(fd2.is_none());
            drop(wa);
            assert!(read_with_fd(&mut rb).await.unwrap().is_none());
        });
    }
}
