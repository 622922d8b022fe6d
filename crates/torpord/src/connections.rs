//! Serving the API on one listener with bounded connections (config `[http]`; docs/torpord.md,
//! "Connections"):
//! - a request's headers must arrive within `header_timeout_s` of the connection's opening or of
//!   its previous answer, so a connection that sends nothing, or stays idle between requests,
//!   is closed (hyper's `header_read_timeout`, which restarts for each request of a kept-alive
//!   connection);
//! - at most `max_connections` are open on the listener. Past it, on TCP, the oldest connection
//!   that has not yet sent a request with the right token is closed to make room; when every open
//!   one has, the new connection is closed instead. (The Unix socket's clients are all trusted
//!   through its mode: there the new one is closed.)
//!
//! Each listener has its own bound, so a flood of TCP connections leaves the Unix socket
//! answering; the daemon also raises its open-file limit to the hard limit at start
//! ([`raise_fd_limit`]), so that its bounded listeners and workers stay well inside it.
//!
//! `axum::serve` has neither bound (it sets no timer, so hyper's header timeout never runs), so
//! connections are served here with hyper's HTTP/1 connection builder directly, the same way.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tower_service::Service;

/// Whether a connection has sent a request with the right bearer token; in each request's
/// extensions, so that the token check can mark it ([`ConnAuth::authenticated`]).
#[derive(Debug, Default)]
pub struct ConnAuth(AtomicBool);

impl ConnAuth {
    /// The connection sent the right token: it is closed last under pressure.
    pub fn authenticated(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_authenticated(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Connections open at once.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers.
    pub header_timeout: Duration,
    /// Whether every connection is trusted from the start (the Unix socket: its mode guards it).
    pub trusted: bool,
}

/// A listener whose connections can be served.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept_io(&self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        let (stream, _) = self.accept().await?;
        Ok(stream)
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept_io(&self) -> std::io::Result<Self::Io> {
        let (stream, _) = self.accept().await?;
        Ok(stream)
    }
}

/// One open connection, as the admission sees it.
struct Slot {
    auth: Arc<ConnAuth>,
    close: Arc<Notify>,
}

/// The open connections of a listener, oldest first.
#[derive(Default)]
struct Open {
    next_id: u64,
    slots: BTreeMap<u64, Slot>,
    /// When the cap was last logged (at most one line every 10 s).
    logged: Option<Instant>,
}

/// A connection let in.
struct Admitted {
    id: u64,
    auth: Arc<ConnAuth>,
    close: Arc<Notify>,
}

impl Open {
    /// Tells the oldest untrusted connection to close, to make room; `false`: every open
    /// connection is trusted, so the new one must be closed.
    fn make_room(&mut self, bounds: &Bounds, what: &str) -> bool {
        let victim = self
            .slots
            .iter()
            .find(|(_, s)| !s.auth.is_authenticated())
            .map(|(id, _)| *id);
        if !matches!(self.logged, Some(t) if t.elapsed() < Duration::from_secs(10)) {
            self.logged = Some(Instant::now());
            tracing::warn!(
                listener = %what,
                max_connections = bounds.max_connections,
                "connection limit reached: {} (http.max_connections)",
                if victim.is_none() {
                    "refusing new connections"
                } else {
                    "closing the oldest connections that sent no token"
                }
            );
        }
        match victim.and_then(|id| self.slots.remove(&id)) {
            Some(slot) => {
                slot.close.notify_one();
                true
            }
            None => false,
        }
    }

    /// Records a new connection.
    fn admit(&mut self, bounds: &Bounds) -> Admitted {
        let id = self.next_id;
        self.next_id += 1;
        let auth = Arc::new(ConnAuth(AtomicBool::new(bounds.trusted)));
        let close = Arc::new(Notify::new());
        self.slots.insert(
            id,
            Slot {
                auth: Arc::clone(&auth),
                close: Arc::clone(&close),
            },
        );
        Admitted { id, auth, close }
    }
}

fn lock(open: &Mutex<Open>) -> std::sync::MutexGuard<'_, Open> {
    open.lock().unwrap_or_else(|p| p.into_inner())
}

async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    // An error means the sender is gone, which also means stop.
    let _ = stop.wait_for(|s| *s).await;
}

/// How long, once stopped, the listener waits for one more queued connection before it closes.
const BACKLOG_POLL: Duration = Duration::from_millis(20);

/// Serves `app` on `listener` within `bounds` until `stop` turns true; then serves one request
/// on each connection still queued in the listener's backlog (its client has connected and may
/// have sent its request: closing the listener would reset it unanswered), closes the listener,
/// lets each connection finish its request in flight (idle ones close at once) and returns
/// when all are closed. `what` names the listener in logs.
pub async fn serve<L: Accept>(
    listener: L,
    app: Router,
    bounds: Bounds,
    mut stop: watch::Receiver<bool>,
    what: String,
) {
    let open = Arc::new(Mutex::new(Open::default()));
    // One permit per open connection, given back once its socket is closed: so the listener
    // never holds more than max_connections sockets (plus the one being admitted).
    let permits = Arc::new(Semaphore::new(bounds.max_connections));
    let mut tasks = tokio::task::JoinSet::new();
    let mut accept_error_logged: Option<Instant> = None;
    // Records an accepted connection and returns the task that serves it.
    let admit = |io, permit, stop, keep_alive| {
        let admitted = lock(&open).admit(&bounds);
        serve_connection(
            io,
            app.clone(),
            admitted,
            permit,
            bounds.header_timeout,
            stop,
            Arc::clone(&open),
            keep_alive,
        )
    };
    loop {
        let accepted = tokio::select! {
            r = listener.accept_io() => r,
            () = until_stopped(&mut stop) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let io = match accepted {
            Ok(io) => io,
            Err(e) => {
                // E.g. out of file descriptors: the connection waits in the backlog meanwhile.
                if !matches!(accept_error_logged, Some(t) if t.elapsed() < Duration::from_secs(10))
                {
                    accept_error_logged = Some(Instant::now());
                    tracing::warn!(listener = %what, error = %e, "cannot accept a connection; retrying");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if !lock(&open).make_room(&bounds, &what) {
                    continue; // `io` is dropped: closed
                }
                // The connection told to close gives its permit back as its socket closes.
                let wait = Arc::clone(&permits).acquire_owned();
                match tokio::time::timeout(Duration::from_secs(1), wait).await {
                    Ok(Ok(p)) => p,
                    _ => continue,
                }
            }
        };
        tasks.spawn(admit(io, permit, stop.clone(), true));
    }
    // Stopped: the queued connections get one request each, on a stop signal of their own that
    // never fires (their keep-alive is off, so each closes after its answer).
    let (_never_tx, never) = watch::channel(false);
    while let Ok(Ok(io)) = tokio::time::timeout(BACKLOG_POLL, listener.accept_io()).await {
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            continue; // over the bound: closed, as while running
        };
        tasks.spawn(admit(io, permit, never.clone(), false));
    }
    drop(listener);
    while tasks.join_next().await.is_some() {}
}

/// Serves one connection until it closes, `stop` turns true (then after its request in flight)
/// or the admission closes it; `keep_alive: false` closes it after its first answer.
#[allow(clippy::too_many_arguments)]
async fn serve_connection<Io: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: Io,
    app: Router,
    admitted: Admitted,
    permit: OwnedSemaphorePermit,
    header_timeout: Duration,
    mut stop: watch::Receiver<bool>,
    open: Arc<Mutex<Open>>,
    keep_alive: bool,
) {
    let auth = Arc::clone(&admitted.auth);
    // Set when the first request's head has been read: a stop before that must not close the
    // connection (hyper closes a connection with nothing read at once), since its client has
    // connected and is sending a request it would then never see answered.
    let first_request = Arc::new(Notify::new());
    let started = Arc::new(AtomicBool::new(false));
    let (seen, on_first) = (Arc::clone(&started), Arc::clone(&first_request));
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        if !seen.swap(true, Ordering::SeqCst) {
            on_first.notify_one();
        }
        req.extensions_mut().insert(Arc::clone(&auth));
        let mut app = app.clone();
        async move { app.call(req).await }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(keep_alive);
    {
        let conn = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(conn);
        let mut stopping = false;
        // Stopped before its first request: it gets until the header timeout to send one.
        let mut awaiting_first = false;
        let first_deadline = tokio::time::sleep(header_timeout);
        tokio::pin!(first_deadline);
        loop {
            tokio::select! {
                _ = conn.as_mut() => break,
                // Closed to make room (dropping the connection closes the socket).
                () = admitted.close.notified() => break,
                () = until_stopped(&mut stop), if !stopping => {
                    stopping = true;
                    if started.load(Ordering::SeqCst) {
                        conn.as_mut().graceful_shutdown();
                    } else {
                        awaiting_first = true;
                    }
                }
                () = first_request.notified(), if awaiting_first => {
                    awaiting_first = false;
                    conn.as_mut().graceful_shutdown();
                }
                () = &mut first_deadline, if awaiting_first => {
                    awaiting_first = false;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    } // the socket is closed here, before the permit goes back
    lock(&open).slots.remove(&admitted.id);
    drop(permit);
}

/// Raises the soft limit of open files to the hard limit, so that the daemon's bounded
/// listeners, its workers' connections and its files fit (the usual soft limit, 1024, is
/// below two listeners' default caps). A failure is only logged.
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur >= lim.rlim_max {
        return;
    }
    let old = lim.rlim_cur;
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads the struct we own; raising the soft limit up to the hard one is
    // always allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        tracing::warn!(
            soft = old,
            hard = lim.rlim_max,
            error = %std::io::Error::last_os_error(),
            "cannot raise the open-file limit"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds(max: usize, trusted: bool) -> Bounds {
        Bounds {
            max_connections: max,
            header_timeout: Duration::from_secs(1),
            trusted,
        }
    }

    #[test]
    fn the_oldest_connection_without_a_token_goes_first() {
        let mut open = Open::default();
        let b = bounds(3, false);
        let first = open.admit(&b);
        let second = open.admit(&b);
        let third = open.admit(&b);
        first.auth.authenticated();
        // Full: the oldest unauthenticated one (the second) is told to close.
        assert!(open.make_room(&b, "t"));
        let fourth = open.admit(&b);
        assert_eq!(
            open.slots.keys().copied().collect::<Vec<_>>(),
            vec![first.id, third.id, fourth.id]
        );
        let notified = second.close.notified();
        tokio::pin!(notified);
        assert!(futures_util::FutureExt::now_or_never(notified.as_mut()).is_some());
        // When all are authenticated, there is no room: the new one is refused.
        third.auth.authenticated();
        fourth.auth.authenticated();
        assert!(!open.make_room(&b, "t"));
        assert_eq!(open.slots.len(), 3);
    }

    #[test]
    fn trusted_listeners_refuse_past_the_cap() {
        let mut open = Open::default();
        let b = bounds(2, true);
        open.admit(&b);
        open.admit(&b);
        assert!(!open.make_room(&b, "u"));
    }
}
