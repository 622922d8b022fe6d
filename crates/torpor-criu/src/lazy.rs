//! The `criu lazy-pages` daemon that serves a lazy restore's page faults from the images.
//!
//! Handshake (CRIU's `criu/uffd.c`): the daemon binds `lazy-pages.socket` in its work directory
//! and waits; `criu restore --lazy-pages` run with the same work directory connects to it and
//! sends each restored process's pid and userfaultfd. The daemon then answers faults with pages
//! from the images, and once no fault has come for a while it pushes the remaining pages itself;
//! when every page of every process has been filled (or the processes are gone) it exits.
//!
//! So the daemon must outlive the restore request, and its exit status is the only sign that
//! every page arrived: [`LazyPages::wait`] reaps it and turns a failure into one error.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::locate::{tail, Criu};

/// The socket the daemon listens on, relative to its work directory (CRIU's own name).
pub const LAZY_PAGES_SOCKET: &str = "lazy-pages.socket";

/// How long the daemon may take to start listening before it is given up on.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// A failure of the lazy-pages daemon.
#[derive(Debug, thiserror::Error)]
pub enum LazyPagesError {
    /// The daemon could not be started.
    #[error("cannot start `criu lazy-pages` ({program}): {source}; check the CRIU install (scripts/provision-criu.sh)")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    /// The daemon exited or hung before it listened for the restore.
    #[error("{who} did not start listening ({why}){}; see {log} (check `criu check --feature uffd-noncoop`)", last_words(.stderr))]
    NotListening {
        who: &'static str,
        why: String,
        stderr: String,
        log: PathBuf,
    },
    /// The daemon failed while serving pages: the restored processes may miss memory.
    #[error("{who} failed ({status}) before every page was served{}; the restored processes were killed, see {log}", last_words(.stderr))]
    Failed {
        who: &'static str,
        status: ExitStatus,
        stderr: String,
        log: PathBuf,
    },
    /// `$TORPOR_PAGE_SERVER_BACKGROUND_THREADS` is not a thread count the server takes.
    #[error(
        "{} must be a number from 1 to {}, got {value:?}: set it so or unset it (the default: {})",
        crate::page_server::BACKGROUND_THREADS_ENV,
        crate::page_server::MAX_BACKGROUND_THREADS,
        crate::page_server::DEFAULT_BACKGROUND_THREADS
    )]
    BackgroundThreads { value: String },
    /// Waiting for the daemon failed.
    #[error("cannot wait for `criu lazy-pages`: {source}; see {log}")]
    Wait {
        source: std::io::Error,
        log: PathBuf,
    },
}

fn last_words(stderr: &str) -> String {
    if stderr.trim().is_empty() {
        String::new()
    } else {
        format!(", its last words: {:?}", stderr.trim())
    }
}

/// A running `criu lazy-pages` daemon, a child of this process. [`LazyPages::wait`] reaps it;
/// dropping it unwaited kills and reaps it (only right for a restore that failed: a restored
/// process whose pages are not all served hangs on its next fault).
pub struct LazyPages {
    /// Which daemon it is, for messages.
    who: &'static str,
    /// Torpor's page server only: our end of a socket pair on which the server sends every
    /// userfaultfd it serves, left unread. A descriptor in flight keeps its file open, so a server
    /// that dies does not release the uffds: the restored tasks' faults wait (instead of the
    /// kernel filling the missing pages with zeros, as it does once a uffd's last holder closes
    /// it) until the caller has killed the tree. See [`LazyPages::take_hold`].
    hold: Option<std::os::unix::net::UnixStream>,
    child: Option<Child>,
    /// How the daemon exited, once reaped.
    exited: Option<ExitStatus>,
    stderr: File,
    log: PathBuf,
}

impl Criu {
    /// Starts `criu lazy-pages` on `images_dir` with `work_dir` as its work directory (where its
    /// socket and `log_file` go) and returns once it listens. A restore with
    /// [`RestoreRequest::lazy_pages`](crate::RestoreRequest::lazy_pages) and the same `work_dir`
    /// then connects to it. Use one work directory per restore.
    pub fn start_lazy_pages(
        &self,
        images_dir: &Path,
        work_dir: &Path,
        log_file: &str,
        log_level: i32,
    ) -> Result<LazyPages, LazyPagesError> {
        let mut cmd = self.command();
        cmd.arg("lazy-pages")
            .arg("-D")
            .arg(images_dir)
            .arg("-W")
            .arg(work_dir)
            .arg("-o")
            .arg(log_file)
            .arg(format!("-v{log_level}"));
        spawn_daemon(
            cmd,
            "`criu lazy-pages`",
            work_dir,
            work_dir.join(log_file),
            None,
        )
    }
}

/// Starts `cmd` as a lazy-pages daemon for `work_dir` and waits until it listens.
fn spawn_daemon(
    mut cmd: std::process::Command,
    who: &'static str,
    work_dir: &Path,
    log: PathBuf,
    hold: Option<(
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    )>,
) -> Result<LazyPages, LazyPagesError> {
    let program = PathBuf::from(cmd.get_program());
    let spawn_err = |source| LazyPagesError::Spawn {
        program: program.clone(),
        source,
    };
    let stderr = tempfile::tempfile().map_err(spawn_err)?;
    let child_stderr = stderr.try_clone().map_err(spawn_err)?;
    let socket = work_dir.join(LAZY_PAGES_SOCKET);
    // A socket left by an earlier daemon would make the wait below return at once.
    let _ = std::fs::remove_file(&socket);
    // (ours, theirs): the child's end of the hold socket is its standard input.
    let (hold, stdin) = match hold {
        Some((ours, theirs)) => (Some(ours), Stdio::from(std::os::fd::OwnedFd::from(theirs))),
        None => (None, Stdio::null()),
    };
    cmd.stdin(stdin)
        .stdout(Stdio::null())
        .stderr(Stdio::from(child_stderr));
    // Its own process group, like `criu swrk`: a terminal's Ctrl-C must not cut off the
    // pages of a restored process; torpor decides what to do.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let child = cmd.spawn().map_err(spawn_err)?;
    // The child's copy of its end is in the child now (the Command held ours).
    drop(cmd);
    let mut daemon = LazyPages {
        who,
        hold,
        child: Some(child),
        exited: None,
        stderr,
        log,
    };
    daemon.wait_listening(&socket)?;
    Ok(daemon)
}

/// What a restore asks of Torpor's page server beyond its images (crate::page_server).
#[derive(Debug, Clone, Copy)]
pub struct PageServerOptions<'a> {
    /// The hot set: a profile an earlier restore recorded.
    pub profile_in: Option<&'a Path>,
    /// Where to record this restore's faults, in order.
    pub profile_out: Option<&'a Path>,
    /// Copy what was not faulted in the background (false: faults and the hot set only).
    pub background: bool,
    /// Threads of that background copy (1: serial; at most
    /// [`crate::page_server::MAX_BACKGROUND_THREADS`]). `None`: the restoring process's
    /// `$TORPOR_PAGE_SERVER_BACKGROUND_THREADS`, else
    /// [`crate::page_server::DEFAULT_BACKGROUND_THREADS`].
    pub background_threads: Option<usize>,
}

impl Default for PageServerOptions<'_> {
    fn default() -> Self {
        Self {
            profile_in: None,
            profile_out: None,
            background: true,
            background_threads: None,
        }
    }
}

/// Starts Torpor's page server (crate::page_server) in `work_dir` for the images in
/// `images_dir`: `exe` (a torpor binary, the caller's own) run with
/// [`crate::page_server::SUBCOMMAND`]. The same handshake, so the same [`LazyPages`] handle.
pub fn start_page_server(
    exe: &Path,
    images_dir: &Path,
    work_dir: &Path,
    opts: &PageServerOptions<'_>,
) -> Result<LazyPages, LazyPagesError> {
    // The restoring process's setting is checked here, so that a bad one is this one line
    // rather than the server's exit.
    let threads = match opts.background_threads {
        Some(n) => Some(n),
        None => match std::env::var(crate::page_server::BACKGROUND_THREADS_ENV) {
            Ok(v) => Some(
                crate::page_server::parse_background_threads(&v)
                    .ok_or(LazyPagesError::BackgroundThreads { value: v })?,
            ),
            Err(_) => None,
        },
    };
    let spawn_err = |source| LazyPagesError::Spawn {
        program: exe.to_path_buf(),
        source,
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(spawn_err)?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg(crate::page_server::SUBCOMMAND)
        .arg(images_dir)
        .arg(work_dir)
        .arg(format!(
            "{}{}",
            crate::page_server::HOLD_FD_ARG,
            crate::page_server::HOLD_FD
        ));
    // Set on the server's own environment (a daemon runs many restores at once), each over
    // whatever the restoring process's environment says.
    if let Some(p) = opts.profile_in {
        cmd.env(crate::page_server::PROFILE_IN_ENV, p);
    }
    if let Some(p) = opts.profile_out {
        cmd.env(crate::page_server::PROFILE_OUT_ENV, p);
    }
    if !opts.background {
        cmd.env(crate::page_server::BACKGROUND_ENV, "off");
    }
    if let Some(n) = threads {
        cmd.env(crate::page_server::BACKGROUND_THREADS_ENV, n.to_string());
    }
    // The server's end of the pair is its standard input (page_server::HOLD_FD says why).
    spawn_daemon(
        cmd,
        "torpor's page server",
        work_dir,
        work_dir.join("page-server.log"),
        Some((ours, theirs)),
    )
}

impl LazyPages {
    /// The daemon's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// The socket that keeps the restored tasks' userfaultfds open (Torpor's page server only;
    /// `None` for CRIU's daemon or once taken). Hold it until the outcome is known: after a
    /// failure, kill every task of the tree first and only then drop it, so that no task ever
    /// runs on pages the kernel filled with zeros.
    pub fn take_hold(&mut self) -> Option<std::os::unix::net::UnixStream> {
        self.hold.take()
    }

    /// CRIU's log of the daemon.
    pub fn log(&self) -> &Path {
        &self.log
    }

    fn wait_listening(&mut self, socket: &Path) -> Result<(), LazyPagesError> {
        let start = Instant::now();
        // Short steps: the server listens a few milliseconds after its start, and each step
        // overshot is the restore's (doubling to 10 ms cost up to 6 ms a cold start).
        let mut delay = Duration::from_micros(100);
        loop {
            if socket.exists() {
                return Ok(());
            }
            let child = self.child.as_mut().expect("running until waited");
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return Err(LazyPagesError::NotListening {
                        who: self.who,
                        why: format!("it exited, {status}"),
                        stderr: self.stderr_tail(),
                        log: self.log.clone(),
                    });
                }
                Ok(None) => {}
                Err(source) => {
                    return Err(LazyPagesError::Wait {
                        source,
                        log: self.log.clone(),
                    })
                }
            }
            if start.elapsed() > LISTEN_TIMEOUT {
                return Err(LazyPagesError::NotListening {
                    who: self.who,
                    why: format!("no socket after {} s", LISTEN_TIMEOUT.as_secs()),
                    stderr: self.stderr_tail(),
                    log: self.log.clone(),
                });
            }
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_micros(500));
        }
    }

    /// Waits until the daemon has served every page and exited, and reaps it. A non-zero exit
    /// means some page may not have arrived.
    pub fn wait(mut self) -> Result<(), LazyPagesError> {
        if let Some(mut child) = self.child.take() {
            let status = child.wait().map_err(|source| LazyPagesError::Wait {
                source,
                log: self.log.clone(),
            })?;
            self.exited = Some(status);
        }
        self.outcome()
    }

    /// Without blocking: `Ok(true)` once the daemon has exited successfully, `Ok(false)` while
    /// it runs, the error once it has failed (watch it while the restore runs: a restored task
    /// whose fault nobody serves blocks CRIU's restore for ever).
    pub fn try_wait(&mut self) -> Result<bool, LazyPagesError> {
        if let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    self.exited = Some(status);
                }
                Ok(None) => return Ok(false),
                Err(source) => {
                    return Err(LazyPagesError::Wait {
                        source,
                        log: self.log.clone(),
                    })
                }
            }
        }
        self.outcome()?;
        // Every page is in: the uffds may go now, and must. Held open with nobody reading them,
        // a restored task's munmap of registered memory waits for ever for its UNMAP event to be
        // read (userfaultfd_unmap_complete): the driver's restore thread did, on the H100.
        self.hold = None;
        Ok(true)
    }

    fn outcome(&mut self) -> Result<(), LazyPagesError> {
        match self.exited {
            Some(status) if !status.success() => Err(LazyPagesError::Failed {
                who: self.who,
                status,
                stderr: self.stderr_tail(),
                log: self.log.clone(),
            }),
            _ => Ok(()),
        }
    }

    /// Kills and reaps the daemon (after a failed restore, when nothing waits for pages).
    pub fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The daemon's last words on stderr, else the first error in its log.
    fn stderr_tail(&mut self) -> String {
        let mut text = String::new();
        if self.stderr.seek(SeekFrom::Start(0)).is_ok() {
            let _ = (&mut self.stderr).take(64 * 1024).read_to_string(&mut text);
        }
        let words = tail(&text, 2);
        if words.trim().is_empty() {
            crate::error::cause_from_log(&self.log).unwrap_or_default()
        } else {
            words
        }
    }
}

impl Drop for LazyPages {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for `criu` whose `lazy-pages` runs `script` (in `sh`).
    fn fake(script: &str) -> Criu {
        Criu::unchecked("/bin/sh", vec!["-c".into(), script.into(), "criu".into()])
    }

    #[test]
    fn a_daemon_that_exits_before_listening_is_named_with_its_last_words() {
        let dir = tempfile::tempdir().unwrap();
        let err = fake("echo 'uffd: permission denied' >&2; exit 3")
            .start_lazy_pages(dir.path(), dir.path(), "lazy.log", 2)
            .err()
            .expect("must fail");
        let text = err.to_string();
        assert!(matches!(err, LazyPagesError::NotListening { .. }), "{text}");
        assert!(text.contains("uffd: permission denied"), "{text}");
        assert!(text.contains("exit status: 3"), "{text}");
    }

    #[test]
    fn a_daemon_that_fails_after_listening_is_one_error_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        // Arguments: lazy-pages -D IMAGES -W WORK ...; listen, then fail.
        let daemon = fake(
            ": > \"$5/lazy-pages.socket\"; sleep 0.2; echo 'failed reading pages' >&2; exit 1",
        )
        .start_lazy_pages(dir.path(), dir.path(), "lazy.log", 2)
        .expect("listens");
        let pid = daemon.pid().expect("running") as i32;
        let err = daemon.wait().expect_err("must fail");
        let text = err.to_string();
        assert!(text.contains("failed reading pages"), "{text}");
        // SAFETY: kill with signal 0 only checks whether the pid exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0;
        assert!(gone, "the daemon was not reaped");
    }
}
