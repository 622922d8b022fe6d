//! One `criu swrk <fd>` conversation over a `SOCK_SEQPACKET` socket pair.
//!
//! The child inherits exactly one descriptor besides stdio: its end of the pair (stdin and stdout
//! are /dev/null, stderr an anonymous temporary file read back when CRIU dies), plus the
//! descriptors a restore hands to the restored tree (`inherit_fd`), which CRIU finds by number.
//! Everything this crate opens is close-on-exec, and the child additionally marks every other
//! descriptor close-on-exec before `exec`, so descriptors a careless library left inheritable do
//! not leak into CRIU either.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use prost::Message;

use crate::error::{Action, CriuError};
use crate::locate::{tail, Criu};
use crate::proto::{CriuReq, CriuResp, ReqType};

/// A CRIU notification (`criu_notify`): CRIU is at the point an action script named `script`
/// would run (e.g. "setup-namespaces", "post-restore", "orphan-pts-master").
#[derive(Debug)]
pub struct Notification {
    /// The action-script name.
    pub script: String,
    /// The host pid CRIU attached ("setup-namespaces" and "post-restore": the restored root).
    pub pid: Option<i32>,
    /// A descriptor CRIU passed along (the pty master for "orphan-pts-master"); take it to keep it.
    pub fd: Option<OwnedFd>,
    /// The pid of the `criu swrk` process serving the request: killing it is the only way to
    /// stop a restore whose tasks wait for something that will never come (CRIU traces them,
    /// so even SIGKILL to them cannot finish until CRIU is gone).
    pub criu_pid: u32,
}

/// Handler for notifications; an `Err` makes CRIU abort and roll back the operation.
pub type NotifyHandler<'h> = dyn FnMut(&mut Notification) -> Result<(), String> + 'h;

/// Largest number of descriptors accepted with one message (CRIU sends at most one).
const MAX_FDS: usize = 4;

/// Most descriptors one request may pass to CRIU (the pre-exec hook cannot allocate).
pub(crate) const MAX_PASSED: usize = 8;

/// One message from CRIU and the descriptors that came with it.
struct Packet {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

struct Session {
    child: crate::spawn::Spawned,
    sock: OwnedFd,
    stderr: File,
    action: Action,
    log: PathBuf,
}

/// How CRIU's process is started: the descriptors it inherits (at the same numbers) besides its
/// socket, the cgroups it is born in, and whether it runs with a `/run` of its own holding its
/// kernel-feature cache, with the real ids of a dumped tree that is not root's (crate::kerndat).
#[derive(Default)]
pub(crate) struct Start<'a> {
    pub pass: &'a [BorrowedFd<'a>],
    pub cgroup: &'a [PathBuf],
    pub own_run: Option<crate::kerndat::OwnRun>,
}

/// Runs one request to completion: sends it, answers notifications through `handler`, and
/// returns CRIU's final reply, which is successful and of the request's type.
pub(crate) fn call(
    criu: &Criu,
    action: Action,
    req: CriuReq,
    log: PathBuf,
    start: Start<'_>,
    handler: &mut NotifyHandler<'_>,
) -> Result<CriuResp, CriuError> {
    let mut session = Session::spawn(criu, action, log, start)?;
    let result = session.converse(req, handler);
    // Closing our end lets a CRIU that is still waiting for us exit; then reap it.
    let Session {
        mut child,
        sock,
        mut stderr,
        action,
        log,
    } = session;
    drop(sock);
    if !matches!(result, Ok(Some(_))) {
        // No successful final reply: whatever CRIU forked and left behind (a restore's helper
        // and half-restored tasks when CRIU was killed) is still in its process group, stopped
        // on a futex for ever and holding CRIU's socket. Killed while CRIU's pid, the group's
        // id, is still held by its unreaped zombie, so that no other group can be hit.
        let pid = child.id() as libc::pid_t;
        if wait_exited_unreaped(pid) {
            // SAFETY: kill(2) of the process group CRIU led (process_group(0) at spawn); its
            // leader is a zombie not yet reaped, so the id names no other group.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
    }
    let status = child.wait();
    match result {
        Ok(Some(resp)) => Ok(resp),
        Ok(None) => Err(CriuError::Exited {
            action,
            status: status.map_err(|source| CriuError::Io {
                action,
                source,
                log: log.clone(),
            })?,
            stderr: read_tail(&mut stderr),
            log,
        }),
        Err(e) => Err(e),
    }
}

impl Session {
    fn spawn(
        criu: &Criu,
        action: Action,
        log: PathBuf,
        start: Start<'_>,
    ) -> Result<Session, CriuError> {
        let Start {
            pass,
            cgroup,
            own_run,
        } = start;
        // Opened here (close-on-exec), written by the child before exec: CRIU is born in the
        // cgroup, and so are the processes it restores.
        let join: Vec<File> = cgroup
            .iter()
            .map(|path| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(|source| CriuError::Cgroup {
                        path: path.clone(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        let join_fds: Vec<RawFd> = join.iter().map(AsRawFd::as_raw_fd).collect();
        let (ours, theirs) = seqpacket_pair().map_err(|source| CriuError::Channel { source })?;
        let stderr = tempfile::tempfile().map_err(|source| CriuError::Channel { source })?;
        let child_stderr = stderr
            .try_clone()
            .map_err(|source| CriuError::Channel { source })?;
        let fd = theirs.as_raw_fd();
        let mut keep = [-1 as RawFd; MAX_PASSED + 1];
        if pass.len() > MAX_PASSED {
            return Err(CriuError::TooManyInheritedFds {
                count: pass.len(),
                max: MAX_PASSED,
            });
        }
        keep[0] = fd;
        for (slot, p) in keep[1..].iter_mut().zip(pass) {
            *slot = p.as_raw_fd();
        }
        let mut cmd = criu.command();
        cmd.arg("swrk").arg(fd.to_string());
        let dev_null = File::options()
            .read(true)
            .write(true)
            .open("/dev/null")
            .map_err(|source| CriuError::Channel { source })?;
        let stdio = crate::spawn::Stdio {
            stdin: dev_null.as_raw_fd(),
            stdout: dev_null.as_raw_fd(),
            stderr: child_stderr.as_raw_fd(),
        };
        let mut hook = move || {
            keep_only_fds(&keep)?;
            join_cgroups(&join_fds)?;
            match &own_run {
                Some(t) => crate::kerndat::enter(t),
                None => Ok(()),
            }
        };
        // Its own process group (`true`): a terminal's Ctrl-C goes to torpor, which finishes or
        // rolls back cleanly, never to CRIU halfway through a dump (its parasite inside the
        // target). Started without copying this process's address space (crate::spawn says
        // why and how).
        // SAFETY: the hook makes raw fcntl/close_range/write/unshare/mount/open/set*id system
        // calls only; it allocates nothing, takes no lock, and reports failures as errnos.
        // `keep` is an array of plain integers moved into it, `join_fds` a vector allocated
        // before and only read, `own_run` prepared before.
        let child =
            unsafe { crate::spawn::spawn(&cmd, stdio, true, &mut hook) }.map_err(|source| {
                CriuError::Spawn {
                    program: criu.program().to_path_buf(),
                    source,
                }
            })?;
        drop(child_stderr);
        drop(theirs);
        drop(join);
        Ok(Session {
            child,
            sock: ours,
            stderr,
            action,
            log,
        })
    }

    /// `Ok(None)`: CRIU closed the connection before its final reply.
    fn converse(
        &mut self,
        req: CriuReq,
        handler: &mut NotifyHandler<'_>,
    ) -> Result<Option<CriuResp>, CriuError> {
        let want = req.r#type;
        self.send(&req)?;
        // A refused notification: CRIU rolls back and then sends its final (failed) reply.
        let mut refused: Option<(String, String)> = None;
        loop {
            let Some(Packet { bytes, mut fds }) = self.recv()? else {
                return Ok(None);
            };
            let resp = CriuResp::decode(bytes.as_slice()).map_err(|source| CriuError::Decode {
                action: self.action,
                source,
                log: self.log.clone(),
            })?;
            if resp.r#type == ReqType::Notify as i32 {
                let notify = resp.notify.unwrap_or_default();
                let criu_pid = self.child.id();
                let mut n = Notification {
                    criu_pid,
                    script: notify.script.unwrap_or_default(),
                    pid: notify.pid,
                    fd: if fds.is_empty() {
                        None
                    } else {
                        Some(fds.remove(0))
                    },
                };
                let outcome = if refused.is_some() {
                    Err("an earlier notification failed".to_string())
                } else {
                    handler(&mut n)
                };
                self.send(&CriuReq {
                    r#type: ReqType::Notify as i32,
                    opts: None,
                    notify_success: Some(outcome.is_ok()),
                })?;
                if let Err(message) = outcome {
                    refused.get_or_insert((n.script, message));
                }
                continue;
            }
            if let Some((script, message)) = refused {
                return Err(CriuError::NotifyFailed {
                    action: self.action,
                    script,
                    message,
                    errno: resp.cr_errno,
                    log: self.log.clone(),
                });
            }
            if resp.r#type != want {
                return Err(CriuError::UnexpectedReply {
                    action: self.action,
                    got: resp.r#type,
                    log: self.log.clone(),
                });
            }
            if !resp.success {
                return Err(CriuError::Failed {
                    action: self.action,
                    errno: resp.cr_errno,
                    // The first error in the log that explains the failure; else CRIU's own
                    // message, which is just the first error it logged.
                    message: crate::error::cause_from_log(&self.log)
                        .or_else(|| resp.cr_errmsg.map(|m| m.trim().to_string())),
                    log: self.log.clone(),
                });
            }
            return Ok(Some(resp));
        }
    }

    fn io_error(&self, source: io::Error) -> CriuError {
        CriuError::Io {
            action: self.action,
            source,
            log: self.log.clone(),
        }
    }

    fn send(&self, req: &CriuReq) -> Result<(), CriuError> {
        let bytes = req.encode_to_vec();
        loop {
            // SAFETY: `bytes` is a live buffer of `bytes.len()` bytes and the socket is open
            // (owned by `self`). MSG_NOSIGNAL turns a dead peer into EPIPE instead of SIGPIPE.
            let n = unsafe {
                libc::send(
                    self.sock.as_raw_fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                return Ok(());
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(self.io_error(err));
            }
        }
    }

    /// One message and the descriptors that came with it; `None` at end of stream, or once
    /// CRIU has exited with nothing pending: a process CRIU forked may hold CRIU's end of the
    /// socket (a restore's tasks, left when CRIU is killed), so its end of stream may never come.
    fn recv(&self) -> Result<Option<Packet>, CriuError> {
        let fd = self.sock.as_raw_fd();
        loop {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, EXIT_CHECK_MS) };
            if n > 0 {
                break;
            }
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(self.io_error(err));
            }
            if exited_unreaped(self.child.id() as libc::pid_t) {
                return Ok(None);
            }
        }
        let len = loop {
            // SAFETY: a zero-length peek with a null buffer is valid; MSG_TRUNC makes the kernel
            // return the real length of the pending packet without copying anything.
            let n = unsafe {
                libc::recv(
                    fd,
                    std::ptr::null_mut(),
                    0,
                    libc::MSG_PEEK | libc::MSG_TRUNC,
                )
            };
            if n >= 0 {
                break n as usize;
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                // The child end is gone and nothing is pending: same as end of stream.
                Some(libc::ECONNRESET) => return Ok(None),
                _ => return Err(self.io_error(err)),
            }
        };
        if len == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; len];
        // u64 elements keep the control buffer aligned for `cmsghdr`.
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
        let mut control = vec![0u64; (space as usize).div_ceil(8)];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; all-zero is a valid empty header that is filled below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() * 8;
        let n = loop {
            // SAFETY: `msg` points at `iov` (covering `buf`) and `control`, all alive and
            // writable for the call; MSG_CMSG_CLOEXEC makes received descriptors close-on-exec.
            let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(self.io_error(err));
            }
        };
        let fds = take_fds(&msg);
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(self.io_error(io::Error::new(
                io::ErrorKind::InvalidData,
                "CRIU's reply was truncated",
            )));
        }
        buf.truncate(n);
        Ok(Some(Packet { bytes: buf, fds }))
    }
}

/// Takes ownership of the descriptors in `msg`'s SCM_RIGHTS control messages.
fn take_fds(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by a successful recvmsg, so its control buffer holds
    // `msg_controllen` bytes of well-formed cmsghdrs that CMSG_FIRSTHDR/NXTHDR walk within bounds.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is non-null and points into the control buffer (see above).
        let hdr = unsafe { &*cmsg };
        if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN only computes a size.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count =
                (hdr.cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<RawFd>();
            // SAFETY: CMSG_DATA points at `count` descriptors inside this control message.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: `i < count` stays inside the message; the data may be unaligned.
                let raw = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel just installed `raw` in our table for us; nobody else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR; NXTHDR returns null after the last header.
        cmsg = unsafe { libc::CMSG_NXTHDR(msg, cmsg) };
    }
    fds
}

/// How often a wait for CRIU's next message checks whether CRIU is still alive.
const EXIT_CHECK_MS: libc::c_int = 100;

/// Whether the child `pid` has exited; it is left unreaped (its pid stays taken).
fn exited_unreaped(pid: libc::pid_t) -> bool {
    waitid_nowait(pid, libc::WNOHANG)
}

/// Waits until the child `pid` has exited, leaving it unreaped; false if it cannot be waited
/// for (already reaped).
fn wait_exited_unreaped(pid: libc::pid_t) -> bool {
    waitid_nowait(pid, 0)
}

fn waitid_nowait(pid: libc::pid_t, flags: libc::c_int) -> bool {
    loop {
        // SAFETY: siginfo_t is plain data, zeroed as waitid(2) with WNOHANG requires.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid siginfo_t; WNOWAIT leaves it unreaped.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT | flags,
            )
        };
        if rc == 0 {
            // SAFETY: waitid filled `info` (si_pid 0: WNOHANG and the child still runs).
            return unsafe { info.si_pid() } == pid;
        }
        if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return false;
        }
    }
}

fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded, so both descriptors are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In the forked child: mark every descriptor above stderr close-on-exec, then let those in
/// `keep` (negative entries are unused slots) survive exec. Only async-signal-safe system calls.
fn keep_only_fds(keep: &[RawFd]) -> io::Result<()> {
    // Best effort (close_range with CLOEXEC needs Linux 5.11): everything this crate opens is
    // close-on-exec already, this only guards against other code's inheritable descriptors.
    // SAFETY: close_range only changes descriptor flags.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
        )
    };
    for &fd in keep.iter().filter(|&&fd| fd >= 0) {
        // SAFETY: fcntl on a descriptor number has no memory effects.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Moves the calling process into the cgroups whose `cgroup.procs` files are open at `fds`.
fn join_cgroups(fds: &[RawFd]) -> io::Result<()> {
    for &fd in fds {
        // SAFETY: write(2) of a 1-byte static buffer to a descriptor the parent opened.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn read_tail(file: &mut File) -> String {
    let mut text = String::new();
    if file.seek(SeekFrom::Start(0)).is_ok() {
        // Cap what is read: CRIU's stderr is short unless something is badly wrong.
        let _ = file.take(64 * 1024).read_to_string(&mut text);
    }
    tail(&text, 3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::CriuOpts;
    use std::os::fd::AsFd;

    /// A stand-in for `criu swrk` that records which descriptors it inherited, then exits
    /// without answering.
    const RECORD_FDS: &str = r#"
import os, sys
out, fd = sys.argv[1], sys.argv[3]
fds = []
for name in os.listdir("/proc/self/fd"):
    try:
        os.readlink("/proc/self/fd/" + name)  # the listing's own descriptor is closed by now
    except OSError:
        continue
    fds.append(int(name))
sys.stderr.write("inherited %s\n" % sorted(fds))
open(out, "w").write(" ".join(map(str, sorted(fds))) + " socket=" + fd)
"#;

    #[test]
    fn child_inherits_only_stdio_and_its_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("fds");
        let criu = Criu::unchecked(
            "/usr/bin/python3",
            vec!["-c".into(), RECORD_FDS.into(), out.clone().into()],
        );
        // A descriptor some careless code left inheritable (dup does not set close-on-exec).
        let file = File::open("/dev/null").expect("open");
        // SAFETY: dup of an open descriptor; the result is checked and owned right away.
        let leaked = unsafe { libc::dup(file.as_raw_fd()) };
        assert!(leaked >= 0);
        // SAFETY: `leaked` is a fresh descriptor nobody else owns.
        let leaked = unsafe { OwnedFd::from_raw_fd(leaked) };

        let req = CriuReq {
            r#type: ReqType::Dump as i32,
            opts: Some(CriuOpts::default()),
            notify_success: None,
        };
        let log = dir.path().join("dump.log");
        let err = call(
            &criu,
            Action::Dump,
            req,
            log.clone(),
            Start::default(),
            &mut |_| Ok(()),
        )
        .expect_err("the stand-in never answers");
        match &err {
            CriuError::Exited { stderr, log: l, .. } => {
                assert!(stderr.contains("inherited"), "{stderr:?}");
                assert_eq!(l, &log);
            }
            other => panic!("expected Exited, got {other:?}"),
        }
        let text = std::fs::read_to_string(&out).expect("the stand-in ran");
        let (fds, socket) = text.split_once(" socket=").expect("format");
        let socket: i32 = socket.parse().expect("fd number");
        let fds: Vec<i32> = fds.split(' ').map(|f| f.parse().expect("fd")).collect();
        assert_eq!(
            fds,
            vec![0, 1, 2, socket],
            "leaked fd was {}",
            leaked.as_raw_fd()
        );
        assert!(err.to_string().contains("without answering"), "{err}");
    }

    #[test]
    fn passed_descriptors_are_inherited_at_their_numbers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("fds");
        let criu = Criu::unchecked(
            "/usr/bin/python3",
            vec!["-c".into(), RECORD_FDS.into(), out.clone().into()],
        );
        // Close-on-exec, as every File std opens: passing it must clear that in the child.
        let file = File::open("/dev/null").expect("open");
        let req = CriuReq {
            r#type: ReqType::Restore as i32,
            opts: Some(CriuOpts::default()),
            notify_success: None,
        };
        let log = dir.path().join("restore.log");
        call(
            &criu,
            Action::Restore,
            req,
            log,
            Start {
                pass: &[file.as_fd()],
                ..Start::default()
            },
            &mut |_| Ok(()),
        )
        .expect_err("the stand-in never answers");
        let text = std::fs::read_to_string(&out).expect("the stand-in ran");
        let (fds, socket) = text.split_once(" socket=").expect("format");
        let socket: i32 = socket.parse().expect("fd number");
        let fds: Vec<i32> = fds.split(' ').map(|f| f.parse().expect("fd")).collect();
        let mut want = vec![0, 1, 2, socket, file.as_raw_fd()];
        want.sort();
        assert_eq!(fds, want);
    }
}
