//! Sending a file descriptor to another process over a Unix socket (`SCM_RIGHTS`), with a small
//! message beside it: how device memory travels between the daemon and a worker.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A descriptor that could not be sent or received.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FdPassingError {
    /// `send_fd` was given no message bytes (a stream socket cannot carry a descriptor alone).
    #[error("an fd must travel with at least one byte of message: give a non-empty message")]
    EmptyMessage,

    /// The peer closed the connection before the whole message came.
    #[error(
        "the peer closed the socket after {received} of {expected} message bytes: it exited or \
         gave up; read its log"
    )]
    Closed { received: usize, expected: usize },

    /// A message came without a descriptor.
    #[error(
        "the peer sent {bytes} message bytes but no fd: it must send the fd with the first \
         bytes of the message (send_fd)"
    )]
    NoFd { bytes: usize },

    /// More than one descriptor came; all were closed.
    #[error("the peer sent more than one fd: send exactly one fd per message")]
    TooManyFds,

    /// The system call failed.
    #[error("{call} on the fd-passing socket failed: {source}; check that the peer is alive")]
    Io {
        call: &'static str,
        #[source]
        source: io::Error,
    },
}

/// Room for the control message of one descriptor, aligned as `cmsghdr` needs.
#[repr(C)]
union ControlBuffer {
    header: libc::cmsghdr,
    // CMSG_SPACE(sizeof(int)) is at most 24 bytes on 64-bit Linux; two ints' worth lets the
    // kernel deliver a second descriptor (which is then closed) rather than drop it silently.
    bytes: [u8; 32],
}

/// Sends `fd` and `message` (at least one byte) on the connected stream socket `socket`. The
/// receiver gets its own copy of the descriptor; `fd` stays open here.
pub fn send_fd(
    socket: impl AsFd,
    fd: BorrowedFd<'_>,
    message: &[u8],
) -> Result<(), FdPassingError> {
    if message.is_empty() {
        return Err(FdPassingError::EmptyMessage);
    }
    let mut sent = loop {
        match sendmsg_with_fd(socket.as_fd(), message, fd, 0) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(FdPassingError::Io {
                    call: "sendmsg",
                    source,
                })
            }
        }
    };
    // The descriptor went with the first bytes; the rest of the message follows plainly.
    while sent < message.len() {
        let rest = &message[sent..];
        // SAFETY: `rest` is a live buffer of the length given.
        let n = unsafe {
            libc::send(
                socket.as_fd().as_raw_fd(),
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let source = io::Error::last_os_error();
            if source.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(FdPassingError::Io {
                call: "send",
                source,
            });
        }
        sent += n as usize;
    }
    Ok(())
}

/// Receives one descriptor sent by [`send_fd`] and fills all of `message` with the bytes sent
/// beside it. The descriptor is close-on-exec.
pub fn recv_fd(socket: impl AsFd, message: &mut [u8]) -> Result<OwnedFd, FdPassingError> {
    if message.is_empty() {
        return Err(FdPassingError::EmptyMessage);
    }
    let expected = message.len();
    let Received {
        bytes: received,
        mut fds,
        truncated,
    } = loop {
        match recvmsg_with_fds(socket.as_fd(), message) {
            Ok(r) => break r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(FdPassingError::Io {
                    call: "recvmsg",
                    source,
                })
            }
        }
    };
    if received == 0 {
        return Err(FdPassingError::Closed {
            received: 0,
            expected,
        });
    }
    if truncated || fds.len() > 1 {
        return Err(FdPassingError::TooManyFds);
    }
    let Some(fd) = fds.pop() else {
        return Err(FdPassingError::NoFd { bytes: received });
    };

    let mut filled = received;
    while filled < expected {
        let rest = &mut message[filled..];
        // SAFETY: `rest` is a live, writable buffer of the length given.
        let n = unsafe {
            libc::recv(
                socket.as_fd().as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                0,
            )
        };
        match n {
            0 => {
                return Err(FdPassingError::Closed {
                    received: filled,
                    expected,
                })
            }
            n if n > 0 => filled += n as usize,
            _ => {
                let source = io::Error::last_os_error();
                if source.kind() != io::ErrorKind::Interrupted {
                    return Err(FdPassingError::Io {
                        call: "recv",
                        source,
                    });
                }
            }
        }
    }
    Ok(fd)
}

/// What one [`recvmsg_with_fds`] read.
#[derive(Debug)]
pub struct Received {
    /// Message bytes read (0: the peer closed the connection).
    pub bytes: usize,
    /// The descriptors that came with them, close-on-exec, now owned here.
    pub fds: Vec<OwnedFd>,
    /// The kernel had more control data than fits (more descriptors, which it closed).
    pub truncated: bool,
}

/// One `sendmsg` of `message` with `fd` attached to its first byte, `MSG_NOSIGNAL` plus `flags`
/// (e.g. `MSG_DONTWAIT` on a socket an event loop polls). Returns the bytes sent; the caller
/// sends the rest plainly. [`send_fd`] is this with the rest and the retries done.
pub fn sendmsg_with_fd(
    socket: BorrowedFd<'_>,
    message: &[u8],
    fd: BorrowedFd<'_>,
    flags: libc::c_int,
) -> io::Result<usize> {
    let mut control = ControlBuffer { bytes: [0; 32] };
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; the fields are set below.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = (&mut control as *mut ControlBuffer).cast();
    // SAFETY: CMSG_SPACE only computes a size.
    header.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as _;
    // SAFETY: the header points to a control buffer of at least msg_controllen bytes, so
    // CMSG_FIRSTHDR returns a pointer inside it, aligned for cmsghdr (the union's alignment).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    // SAFETY: every pointer in the header refers to live buffers of the lengths given.
    let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &header, libc::MSG_NOSIGNAL | flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// One `recvmsg` of at most `buf.len()` bytes, with every descriptor that came with them
/// (close-on-exec). [`recv_fd`] is this with the checks and the rest of the message done.
pub fn recvmsg_with_fds(socket: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut control = ControlBuffer { bytes: [0; 32] };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty header; the fields are set below.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = (&mut control as *mut ControlBuffer).cast();
    header.msg_controllen = size_of::<ControlBuffer>() as _;
    // SAFETY: every pointer in the header refers to live, writable buffers of the lengths given.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut header, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled the control buffer and set msg_controllen; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay within it, and each SCM_RIGHTS payload holds whole ints, each a new
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
    Ok(Received {
        bytes: n as usize,
        fds,
        truncated: header.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    fn inode(fd: BorrowedFd<'_>) -> u64 {
        let file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
        std::os::unix::fs::MetadataExt::ino(&file.metadata().unwrap())
    }

    #[test]
    fn an_fd_and_its_message_arrive_together() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        let message: Vec<u8> = (0..=255).cycle().take(100_000).collect();
        let sender = {
            let message = message.clone();
            let file = file.try_clone().unwrap();
            std::thread::spawn(move || send_fd(&a, file.as_fd(), &message).unwrap())
        };
        let mut got = vec![0; message.len()];
        let fd = recv_fd(&b, &mut got).unwrap();
        sender.join().unwrap();
        assert_eq!(got, message);
        assert_eq!(inode(fd.as_fd()), inode(file.as_fd()));
        assert_ne!(fd.as_raw_fd(), file.as_raw_fd());
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }

    #[test]
    fn a_message_without_an_fd_or_a_closed_peer_is_an_error() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(b"plain").unwrap();
        let mut got = [0; 5];
        let err = recv_fd(&b, &mut got).unwrap_err();
        assert!(matches!(err, FdPassingError::NoFd { bytes: 5 }), "{err:?}");
        assert!(err.to_string().contains("but no fd"), "{err}");

        drop(a);
        let err = recv_fd(&b, &mut got).unwrap_err();
        assert!(
            matches!(
                err,
                FdPassingError::Closed {
                    received: 0,
                    expected: 5
                }
            ),
            "{err:?}"
        );

        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        send_fd(&a, file.as_fd(), b"abc").unwrap();
        drop(a);
        let mut longer = [0; 8];
        let err = recv_fd(&b, &mut longer).unwrap_err();
        assert!(
            matches!(
                err,
                FdPassingError::Closed {
                    received: 3,
                    expected: 8
                }
            ),
            "{err:?}"
        );
        assert!(matches!(
            send_fd(&b, file.as_fd(), b""),
            Err(FdPassingError::EmptyMessage)
        ));
    }
}
