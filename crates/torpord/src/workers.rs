//! The workers' socket (`<state>/workers.sock`): workers connect, the daemon identifies each
//! connection by the peer's host pid (`SO_PEERCRED`), reads its `hello` and hands it to whoever
//! waits for that pid (a deploy step, or an instance being started).
//!
//! A connection nobody claims within [`UNCLAIMED_TTL`] is closed (the worker then exits 0). A
//! connection whose first frame is not a valid `hello` is dropped; so is any worker that breaks
//! the protocol later. Nothing a worker sends can stop the daemon.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::oneshot;

use crate::frames::{self, FrameError};

/// How long a connection may wait to be claimed.
pub const UNCLAIMED_TTL: Duration = Duration::from_secs(30);
/// How long a new connection has to send its `hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The `hello` frame every connection starts with.
#[derive(Debug, Clone)]
pub struct Hello {
    /// The worker's pid in its own namespace (informational; never used to identify it).
    pub pid: i64,
    pub role: String,
    pub function: Option<String>,
    pub resumed: bool,
    /// 2 for a harness that sends `started` and takes `attached` (1 before).
    pub protocol: u64,
    /// It lost its daemon and asks to be re-adopted.
    pub reattach: bool,
    /// With `reattach`: the keyed requests whose outcome it keeps (crate::idempotency).
    pub keys: Vec<crate::protocol::HeldKey>,
}

impl Hello {
    /// The first frame of a connection, which must be a `hello` of a protocol this daemon
    /// speaks.
    fn parse(payload: &[u8]) -> Result<Self, HelloError> {
        use crate::protocol::{FromWorker, PROTOCOL};
        let h = match FromWorker::parse(payload) {
            Ok(FromWorker::Hello(h)) => h,
            Ok(other) => return Err(HelloError::NotHello { got: other.kind() }),
            Err(e) => return Err(HelloError::Unparsable(e)),
        };
        if h.protocol > PROTOCOL {
            return Err(HelloError::Protocol {
                theirs: h.protocol,
                ours: PROTOCOL,
            });
        }
        Ok(Self {
            pid: h.pid,
            role: h.role.as_str().to_string(),
            function: h.function,
            resumed: h.resumed,
            protocol: h.protocol,
            reattach: h.reattach,
            keys: h.keys,
        })
    }
}

/// An identified worker connection.
#[derive(Debug)]
pub struct WorkerConn {
    /// The worker's host pid (`SO_PEERCRED`).
    pub pid: i32,
    pub hello: Hello,
    pub rd: OwnedReadHalf,
    pub wr: OwnedWriteHalf,
}

/// A failure talking to one worker.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("the worker closed its connection (it exited or crashed)")]
    Closed,
    #[error("the worker broke the protocol: {0}")]
    Protocol(String),
    #[error("the worker's frame is malformed: {0}")]
    Frame(#[from] FrameError),
    #[error("writing to the worker failed: {0}")]
    Write(std::io::Error),
    #[error("the worker did not answer within {0:.0} s")]
    Timeout(f64),
}

impl WorkerConn {
    /// Sends one frame.
    pub async fn send<T: serde::Serialize + ?Sized>(&mut self, obj: &T) -> Result<(), ConnError> {
        send(&mut self.wr, obj).await
    }

    /// The next frame; a closed connection is [`ConnError::Closed`].
    pub async fn recv(&mut self) -> Result<Map<String, Value>, ConnError> {
        frames::read(&mut self.rd).await?.ok_or(ConnError::Closed)
    }

    /// The next frame within `timeout`, which must be of type `kind`.
    pub async fn expect(
        &mut self,
        kind: &str,
        timeout: Duration,
    ) -> Result<Map<String, Value>, ConnError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let msg = loop {
            let msg = tokio::time::timeout_at(deadline, self.recv())
                .await
                .map_err(|_| ConnError::Timeout(timeout.as_secs_f64()))??;
            // A worker announces each handler's start before its result (protocol 2); whoever
            // waits here for the result has no use for it.
            if kind == "result" && msg.get("type").and_then(Value::as_str) == Some("started") {
                continue;
            }
            break msg;
        };
        match msg.get("type").and_then(Value::as_str) {
            Some(t) if t == kind => Ok(msg),
            other => Err(ConnError::Protocol(format!(
                "expected a {kind} frame, got {}",
                other.unwrap_or("a frame without a type")
            ))),
        }
    }

    /// Waits for the connection to end (after `quiet`); any frame instead is a protocol error.
    pub async fn expect_eof(mut self, timeout: Duration) -> Result<(), ConnError> {
        match tokio::time::timeout(timeout, frames::read(&mut self.rd)).await {
            Err(_) => Err(ConnError::Timeout(timeout.as_secs_f64())),
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(m))) => Err(ConnError::Protocol(format!(
                "sent {} after quiet instead of closing its connection",
                m.get("type").unwrap_or(&Value::Null)
            ))),
            Ok(Err(e)) => Err(e.into()),
        }
    }
}

/// Writes one frame to a worker (a [`crate::protocol::ToWorker`], or a test's own object).
pub async fn send<T: serde::Serialize + ?Sized>(
    wr: &mut OwnedWriteHalf,
    obj: &T,
) -> Result<(), ConnError> {
    send_frame(wr, &frames::encode(obj)?).await
}

/// Writes one encoded frame ([`frames::encode`]) to a worker.
pub async fn send_frame(wr: &mut OwnedWriteHalf, frame: &[u8]) -> Result<(), ConnError> {
    wr.write_all(frame).await.map_err(ConnError::Write)
}

#[derive(Default)]
struct Slots {
    waiting: HashMap<i32, oneshot::Sender<WorkerConn>>,
    unclaimed: HashMap<i32, WorkerConn>,
    /// The workers of the instances an earlier daemon left, which this one re-adopts
    /// ([`Hub::expect`]): their hello may come before the claim.
    expected: HashSet<i32>,
    /// This daemon's marker, the environment entry `TORPORD_STATE_DIR=…`
    /// (crate::recovery::owner_entry), once [`Hub::expect`] set it: only a process that
    /// carries it can be a stray worker of this state directory.
    owner: Option<Vec<u8>>,
}

/// Hands identified connections to whoever waits for their pid.
#[derive(Default)]
pub struct Hub {
    slots: Mutex<Slots>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hub { .. }")
    }
}

/// A claim on the next connection from one pid; dropping it gives the claim up.
pub struct Claim {
    hub: Arc<Hub>,
    pid: i32,
    rx: oneshot::Receiver<WorkerConn>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        // A connection arriving from now on is not for this claim.
        self.rx.close();
        let mut slots = self.hub.lock();
        if slots
            .waiting
            .get(&self.pid)
            .is_some_and(|tx| tx.is_closed())
        {
            slots.waiting.remove(&self.pid);
        }
    }
}

impl Claim {
    /// The connection, once it said hello; fails if `pid` dies first or `timeout` passes.
    pub async fn wait(mut self, timeout: Duration) -> Result<WorkerConn, ConnError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                conn = &mut self.rx => {
                    return conn.map_err(|_| ConnError::Closed);
                }
                _ = tick.tick() => {
                    if !alive(self.pid) {
                        // A connection may have arrived just before the exit.
                        if let Ok(conn) = self.rx.try_recv() {
                            return Ok(conn);
                        }
                        return Err(ConnError::Closed);
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Err(ConnError::Timeout(timeout.as_secs_f64()));
                    }
                }
            }
        }
    }
}

/// Whether `pid` exists and has not exited.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// When `pid` started, in clock ticks after boot (`/proc/PID/stat` field 22): with the pid, it
/// names one process, never a later one that reused the pid.
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start at field 3, the state.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Before the hub serves, at start-up: the workers of the instances to re-adopt (their
    /// hello, reattach or resumed, may come before their claim). Any other worker that says
    /// hello as a restored or re-attaching instance while nobody waits for it is a stray and
    /// is killed ([`Hub::deliver`]).
    /// `owner`: the marker entry of this daemon's processes (crate::recovery::owner_entry).
    pub fn expect(&self, owner: Vec<u8>, workers: impl IntoIterator<Item = i32>) {
        let mut slots = self.lock();
        slots.owner = Some(owner);
        slots.expected.extend(workers);
    }

    /// Claims the next connection from host pid `pid` (one that already arrived, if any).
    pub fn claim(self: &Arc<Self>, pid: i32) -> Claim {
        let (tx, rx) = oneshot::channel();
        let mut slots = self.lock();
        slots.expected.remove(&pid);
        match slots.unclaimed.remove(&pid) {
            Some(conn) => {
                let _ = tx.send(conn);
            }
            None => {
                slots.waiting.insert(pid, tx);
            }
        }
        Claim {
            hub: Arc::clone(self),
            pid,
            rx,
        }
    }

    fn deliver(self: &Arc<Self>, conn: WorkerConn) {
        let pid = conn.pid;
        let mut slots = self.lock();
        let conn = match slots.waiting.remove(&pid) {
            Some(tx) => match tx.send(conn) {
                Ok(()) => return,
                Err(conn) => conn,
            },
            None => conn,
        };
        // Every restored worker this daemon wakes, and every instance it re-adopts, is claimed
        // before its SIGUSR2 or expected (Hub::expect). A worker that says hello as restored or
        // re-attaching with neither is of an instance this daemon does not hold: a restore an
        // earlier daemon of this state directory had in flight when it was killed, which
        // finished after this daemon's start-up sweep (the sweep kills only what exists when it
        // lists /proc), and whose worker was woken and then lost that daemon. Nothing would
        // ever claim it, and it would wait in its reconnect loop for reattach_s, holding its
        // memory (and GPU) outside every account. Killed here, when it shows itself, which
        // needs no second sweep racing this daemon's own restores.
        // Only a process that carries this daemon's marker (its workers and what CRIU restores
        // of them do): anything else that can reach the socket (root) is no worker of ours.
        let stray = (conn.hello.resumed || conn.hello.reattach)
            && !slots.expected.contains(&pid)
            && slots
                .owner
                .as_deref()
                .is_some_and(|owner| is_marked(pid, owner));
        if stray {
            let owner = slots.owner.clone().unwrap_or_default();
            drop(slots);
            kill_stray(conn, &owner);
            return;
        }
        slots.unclaimed.insert(pid, conn);
        drop(slots);
        let hub = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(UNCLAIMED_TTL).await;
            if hub.lock().unclaimed.remove(&pid).is_some() {
                tracing::warn!(pid, "closed a worker connection nobody claimed");
            }
        });
    }

    /// Accepts workers until the listener fails.
    pub async fn serve(self: Arc<Self>, listener: UnixListener) {
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::error!(error = %e, "accepting a worker connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let hub = Arc::clone(&self);
            tokio::spawn(async move {
                match handshake(stream).await {
                    Ok(conn) => {
                        tracing::debug!(pid = conn.pid, role = %conn.hello.role, resumed = conn.hello.resumed, "worker connected");
                        hub.deliver(conn);
                    }
                    Err(e) => tracing::warn!(error = %e, "dropped a worker connection"),
                }
            });
        }
    }
}

/// Kills the tree of a stray worker (see [`Hub::deliver`]): its parent when that is the init
/// of its PID namespace and carries this daemon's marker `owner` (the whole namespace goes
/// with it), else the worker alone. The connection closes with `conn`.
fn kill_stray(conn: WorkerConn, owner: &[u8]) {
    let worker = conn.pid;
    let init = parent_of(worker).filter(|&p| p > 1 && is_namespace_init(p) && is_marked(p, owner));
    let target = init.unwrap_or(worker);
    // SAFETY: kill(2) only sends a signal, to a process that connected to this daemon's
    // workers socket (in its state directory) as a worker, or to the init of its namespace.
    unsafe { libc::kill(target, libc::SIGKILL) };
    tracing::warn!(
        worker,
        init,
        function = conn.hello.function.as_deref().unwrap_or(""),
        reattach = conn.hello.reattach,
        "killed a worker of an instance this torpord does not hold: a restore an earlier torpord had in flight when it stopped finished after this one started"
    );
}

/// Whether the environment of `pid` holds the entry `owner` (`KEY=VALUE`, whole).
fn is_marked(pid: i32, owner: &[u8]) -> bool {
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|entry| entry == owner))
}

/// The parent of `pid` (`/proc/PID/stat` field 4).
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is PID 1 of a PID namespace below this one (`NSpid` ends in 1).
fn is_namespace_init(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("NSpid:")).map(|ids| {
                let ids: Vec<&str> = ids.split_whitespace().collect();
                ids.len() > 1 && ids.last() == Some(&"1")
            })
        })
        .unwrap_or(false)
}

fn peer_pid(stream: &UnixStream) -> std::io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is a live ucred.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid)
}

async fn handshake(stream: UnixStream) -> Result<WorkerConn, HandshakeError> {
    let pid = peer_pid(&stream).map_err(HandshakeError::PeerCred)?;
    let (mut rd, wr) = stream.into_split();
    let first = tokio::time::timeout(HELLO_TIMEOUT, frames::read_payload(&mut rd))
        .await
        .map_err(|_| HandshakeError::NoHello { pid })?
        .map_err(|source| HandshakeError::Frame { pid, source })?
        .ok_or(HandshakeError::Closed { pid })?;
    let hello = Hello::parse(&first).map_err(|source| HandshakeError::Hello { pid, source })?;
    Ok(WorkerConn { pid, hello, rd, wr })
}

/// Why a connection's first frame is not a `hello` this daemon takes.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// Another frame came first.
    #[error("first frame must be hello, got type {got:?}")]
    NotHello { got: &'static str },
    /// The first frame is not a worker frame at all.
    #[error("first frame must be hello, got {0}")]
    Unparsable(#[source] crate::protocol::ProtocolError),
    /// The worker's harness is newer than this daemon.
    #[error(
        "it speaks worker protocol {theirs}, this torpord at most {ours}: upgrade torpord \
         to the version of the torpor package the worker runs"
    )]
    Protocol { theirs: u64, ours: u64 },
}

/// Why a new connection on the workers socket was dropped before it could be claimed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The peer's pid (how the daemon tells its workers apart) cannot be read.
    #[error("SO_PEERCRED failed: {0}")]
    PeerCred(#[source] std::io::Error),
    /// Nothing arrived in time.
    #[error("worker pid {pid} sent no hello within {HELLO_TIMEOUT:?}")]
    NoHello { pid: i32 },
    /// The first frame could not be read.
    #[error("worker pid {pid}: {source}")]
    Frame {
        pid: i32,
        #[source]
        source: FrameError,
    },
    /// The peer closed before its `hello`.
    #[error("worker pid {pid} closed before its hello")]
    Closed { pid: i32 },
    /// The first frame is not a `hello` this daemon takes.
    #[error("worker pid {pid}: {source}")]
    Hello {
        pid: i32,
        #[source]
        source: HelloError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_start_names_one_process() {
        let me = std::process::id() as i32;
        let start = process_start(me).expect("our own start time");
        assert_eq!(process_start(me), Some(start));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let other = process_start(child.id() as i32).expect("the child's start time");
        assert!(other >= start, "a child starts after its parent");
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            process_start(child.id() as i32),
            None,
            "a reaped process has none"
        );
    }
}
