//! Frames that carry a file descriptor on a worker connection (docs/split.md, "Worker
//! frames"): the fd travels as `SCM_RIGHTS` with the frame's first byte (its header).
//!
//! Only the split steps use these; every other frame goes through [`crate::frames`] with plain
//! reads and writes, so the warm path pays nothing for fd passing.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use serde_json::{Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use crate::frames::{self, FrameError, MAX_FRAME};
use crate::workers::ConnError;

/// Room for the control message of two fds: a second one is received (and closed) rather than
/// silently dropped by the kernel.
#[repr(C)]
union Control {
    _header: libc::cmsghdr,
    bytes: [u8; 32],
}

/// One `recvmsg` of at most `buf.len()` bytes, with the fds that came with them.
fn recvmsg_once(fd: i32, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut control = Control { bytes: [0; 32] };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; the fields are set below.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = (&mut control as *mut Control).cast();
    header.msg_controllen = size_of::<Control>() as _;
    // SAFETY: every pointer in the header refers to live, writable buffers of the lengths given.
    let n = unsafe { libc::recvmsg(fd, &mut header, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer and set msg_controllen; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay inside it, and each SCM_RIGHTS payload holds whole ints, each a new
    // descriptor this process now owns.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let payload = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for i in 0..payload / size_of::<libc::c_int>() {
                    let raw = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&header, cmsg);
        }
    }
    Ok((n as usize, fds))
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
        let raw = stream.as_raw_fd();
        let r = stream.try_io(Interest::READABLE, || recvmsg_once(raw, &mut header[got..]));
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
    obj: &Value,
    fd: BorrowedFd<'_>,
) -> Result<(), ConnError> {
    let frame = frames::encode(obj)?;
    let raw_fd = fd.as_raw_fd();
    let sent = loop {
        let stream = wr.as_ref();
        stream.writable().await.map_err(ConnError::Write)?;
        let sock = stream.as_raw_fd();
        match stream.try_io(Interest::WRITABLE, || sendmsg_with_fd(sock, &frame, raw_fd)) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(ConnError::Write(e)),
        }
    };
    // The fd went with the first bytes; the rest follows plainly.
    wr.write_all(&frame[sent..]).await.map_err(ConnError::Write)
}

fn sendmsg_with_fd(sock: i32, message: &[u8], fd: i32) -> io::Result<usize> {
    let mut control = Control { bytes: [0; 32] };
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; the fields are set below.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = (&mut control as *mut Control).cast();
    // SAFETY: CMSG_SPACE only computes a size.
    header.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as _;
    // SAFETY: the control buffer holds at least msg_controllen bytes, so CMSG_FIRSTHDR points
    // inside it, aligned for cmsghdr (the union's alignment).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
    }
    // SAFETY: every pointer in the header refers to live buffers of the lengths given.
    let n = unsafe { libc::sendmsg(sock, &header, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
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
