//! Errors of finding and driving CRIU. Each message names the cause and the fix on one line.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;

use crate::locate::Version;

/// The RPC operation that was running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Dump,
    PreDump,
    Restore,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Dump => "dump",
            Action::PreDump => "pre-dump",
            Action::Restore => "restore",
        })
    }
}

/// A failure to find, check or drive CRIU.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// No CRIU anywhere Torpor looks.
    #[error("CRIU not found (looked at: {looked}); run `make criu` or scripts/provision-criu.sh, or set TORPOR_CRIU to a criu >= {need}")]
    NotFound { looked: String, need: Version },

    /// A CRIU was found but it is older than Torpor needs.
    #[error("CRIU {found} at {program} is older than the {need} Torpor needs; run `make criu` or scripts/provision-criu.sh")]
    TooOld {
        program: PathBuf,
        found: Version,
        need: Version,
    },

    /// The CRIU program could not be started.
    #[error("cannot run CRIU at {program}: {source}; check that it exists and is executable, or run scripts/provision-criu.sh")]
    Spawn { program: PathBuf, source: io::Error },

    /// `criu --version` printed no version line.
    #[error("{program} printed no CRIU version ({output:?}); point TORPOR_CRIU at a real criu or run scripts/provision-criu.sh")]
    NoVersion { program: PathBuf, output: String },

    /// `criu check` did not say "Looks good".
    #[error("`criu check` failed for {program} ({status}): {output}; fix the kernel feature it names, or use a newer CRIU")]
    CheckFailed {
        program: PathBuf,
        status: ExitStatus,
        output: String,
    },

    /// The log file name is not a plain name (CRIU writes it inside the images directory).
    #[error("CRIU log file name {name:?} is not a plain file name; pass a name without '/', CRIU writes it inside the images directory")]
    LogFileName { name: String },

    /// A path handed to CRIU is not UTF-8 (the RPC carries strings).
    #[error("path {path:?} is not valid UTF-8, which CRIU's RPC cannot carry; use a UTF-8 path")]
    NonUtf8Path { path: PathBuf },

    /// The images directory cannot be opened.
    #[error(
        "cannot open CRIU images directory {path}: {source}; create it and check its permissions"
    )]
    ImagesDir { path: PathBuf, source: io::Error },

    /// The work directory cannot be opened.
    #[error(
        "cannot open CRIU work directory {path}: {source}; create it and check its permissions"
    )]
    WorkDir { path: PathBuf, source: io::Error },

    /// A restore was asked to hand more descriptors to the restored tree than it can pass.
    #[error("a restore can hand at most {max} descriptors to the restored tree, {count} were given: pass fewer inherit_fds")]
    TooManyInheritedFds { count: usize, max: usize },

    /// A cgroup the restored tree is to be born in cannot be opened ([`crate::RestoreRequest::cgroup`]).
    #[error("cannot open {path} to restore into its cgroup: {source}")]
    Cgroup { path: PathBuf, source: io::Error },

    /// CRIU's kernel-feature cache, which a dump of a tree that runs as another user than root
    /// needs (crate::kerndat), could not be made; `uid` 0 when it was made ahead of restores
    /// ([`crate::Criu::prepare_kernel_cache`]).
    #[error("cannot prepare CRIU's kernel-feature cache{}: {detail}; check that `criu check` passes as root", needed_for(*uid))]
    KernelCache { uid: u32, detail: String },

    /// The socket pair or the stderr capture for `criu swrk` could not be created.
    #[error("cannot set up the channel to CRIU: {source}; check the open-file limit (ulimit -n)")]
    Channel { source: io::Error },

    /// Reading from or writing to CRIU's RPC socket failed.
    #[error("talking to CRIU during {action} failed: {source}; see {log}")]
    Io {
        action: Action,
        source: io::Error,
        log: PathBuf,
    },

    /// CRIU sent bytes that are not a `criu_resp`.
    #[error("CRIU sent an undecodable reply during {action} ({source}); use the CRIU from scripts/provision-criu.sh, see {log}")]
    Decode {
        action: Action,
        source: prost::DecodeError,
        log: PathBuf,
    },

    /// CRIU answered with a reply of another type than the request.
    #[error("CRIU answered a {action} request with reply type {got}; use the CRIU from scripts/provision-criu.sh, see {log}")]
    UnexpectedReply {
        action: Action,
        got: i32,
        log: PathBuf,
    },

    /// CRIU closed the connection without a final reply (it crashed or was killed).
    #[error("CRIU exited ({status}) without answering the {action} request{}; see {log}", stderr_tail(.stderr))]
    Exited {
        action: Action,
        status: ExitStatus,
        stderr: String,
        log: PathBuf,
    },

    /// CRIU reported that the operation failed. `errno` and `message` are CRIU's `cr_errno` and
    /// `cr_errmsg`; CRIU's log names the cause.
    #[error("CRIU {action} failed{}; see {log} for the cause", errno_and_message(.errno, .message))]
    Failed {
        action: Action,
        errno: Option<i32>,
        message: Option<String>,
        log: PathBuf,
    },

    /// A notification handler refused; CRIU rolled the operation back.
    #[error("the {script:?} notification handler failed during {action}: {message}; CRIU undid the {action}, see {log}")]
    NotifyFailed {
        action: Action,
        script: String,
        message: String,
        errno: Option<i32>,
        log: PathBuf,
    },
}

/// Errors CRIU logs that never explain a failure: without CAP_SYS_RESOURCE (containers, VMs)
/// raising RLIMIT_NOFILE fails and CRIU carries on.
const HARMLESS_ERRORS: &[&str] = &["Can't setup RLIMIT_NOFILE"];

/// The first error in CRIU's log that explains a failure, without its timestamp and source
/// location: "Can't lookup mount=27 for fd=8 path=/tmp/x". CRIU's `cr_errmsg` is only the first
/// error it logged, which is often a harmless one.
pub(crate) fn cause_from_log(log: &std::path::Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(log)
        .ok()?
        .take(64 << 20)
        .read_to_string(&mut text)
        .ok()?;
    text.lines()
        .filter(|l| l.contains("Error (") && !HARMLESS_ERRORS.iter().any(|h| l.contains(h)))
        .map(|l| match l.split_once("): ") {
            Some((_, msg)) => msg.trim().to_string(),
            None => l.trim().to_string(),
        })
        .next()
}

fn errno_and_message(errno: &Option<i32>, message: &Option<String>) -> String {
    let errno = errno.filter(|e| *e != 0).map(|e| {
        format!(
            "errno {e}: {}",
            io::Error::from_raw_os_error(e)
                .to_string()
                .replace(&format!(" (os error {e})"), "")
        )
    });
    match (errno, message) {
        (None, None) => String::new(),
        (Some(e), None) => format!(" ({e})"),
        (None, Some(m)) => format!(" ({m})"),
        (Some(e), Some(m)) => format!(" ({e}; {m})"),
    }
}

fn stderr_tail(stderr: &str) -> String {
    let line = stderr.lines().rev().find(|l| !l.trim().is_empty());
    match line {
        Some(l) => format!(", its last words: {:?}", l.trim()),
        None => String::new(),
    }
}

impl CriuError {
    /// CRIU's raw errno (`cr_errno`), when CRIU reported one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            CriuError::Failed { errno, .. } | CriuError::NotifyFailed { errno, .. } => *errno,
            _ => None,
        }
    }

    /// The path of CRIU's own log for this operation, when it ran far enough to have one.
    pub fn log(&self) -> Option<&std::path::Path> {
        match self {
            CriuError::Io { log, .. }
            | CriuError::Decode { log, .. }
            | CriuError::UnexpectedReply { log, .. }
            | CriuError::Exited { log, .. }
            | CriuError::Failed { log, .. }
            | CriuError::NotifyFailed { log, .. } => Some(log),
            _ => None,
        }
    }

    /// The same error, naming `log` as CRIU's log (after the caller moved the log elsewhere,
    /// e.g. out of a partial snapshot that is about to be removed). Errors without a log are
    /// returned unchanged.
    pub fn with_log(mut self, log: PathBuf) -> Self {
        match &mut self {
            CriuError::Io { log: l, .. }
            | CriuError::Decode { log: l, .. }
            | CriuError::UnexpectedReply { log: l, .. }
            | CriuError::Exited { log: l, .. }
            | CriuError::Failed { log: l, .. }
            | CriuError::NotifyFailed { log: l, .. } => *l = log,
            _ => {}
        }
        self
    }

    /// Up to `max` "Error" lines from CRIU's log for this operation, in log order, to show the
    /// cause without opening the log. CRIU's `cr_errmsg` is only the *first* error it logged,
    /// which can be a harmless one (e.g. "Can't setup RLIMIT_NOFILE" without CAP_SYS_RESOURCE).
    /// Empty when there is no log or it cannot be read.
    pub fn log_errors(&self, max: usize) -> Vec<String> {
        use std::io::Read;
        let Some(path) = self.log() else {
            return Vec::new();
        };
        let Ok(file) = std::fs::File::open(path) else {
            return Vec::new();
        };
        let mut text = String::new();
        // Debug-level logs of big processes run to megabytes; the errors are what matters.
        if file.take(64 << 20).read_to_string(&mut text).is_err() {
            return Vec::new();
        }
        text.lines()
            .filter(|l| l.contains("Error ("))
            .take(max)
            .map(|l| l.trim().to_string())
            .collect()
    }
}

/// What the kernel-feature cache was made for, in [`CriuError::KernelCache`]'s message.
fn needed_for(uid: u32) -> String {
    match uid {
        0 => " (made ahead, so that restores skip CRIU's probes of the kernel)".to_string(),
        uid => format!(
            ", needed to dump a process tree that runs as uid {uid} (an unprivileged worker)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_names_errno_message_and_log() {
        let e = CriuError::Failed {
            action: Action::Dump,
            errno: Some(libc::ESRCH),
            message: Some("Dumping FAILED".into()),
            log: "/img/dump.log".into(),
        };
        assert_eq!(
            e.to_string(),
            "CRIU dump failed (errno 3: No such process; Dumping FAILED); see /img/dump.log for the cause"
        );
        assert_eq!(e.errno(), Some(libc::ESRCH));
        let moved = e.with_log("/logs/dump-1.log".into());
        assert_eq!(moved.log(), Some(std::path::Path::new("/logs/dump-1.log")));
        assert!(moved
            .to_string()
            .ends_with("see /logs/dump-1.log for the cause"));
        let bare = CriuError::Failed {
            action: Action::Restore,
            errno: Some(0),
            message: None,
            log: "/img/r.log".into(),
        };
        assert_eq!(
            bare.to_string(),
            "CRIU restore failed; see /img/r.log for the cause"
        );
    }

    #[test]
    fn cause_skips_harmless_errors_and_location() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(
            &log,
            "(00.029145) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n\
             (00.030000) Warn  (criu/x.c:1): noise\n\
             (00.034690) Error (criu/files-reg.c:1790): Can't lookup mount=27 for fd=8 path=/tmp/host-file\n\
             (00.034871) Error (criu/cr-dump.c:1975): Dumping FAILED.\n",
        )
        .unwrap();
        assert_eq!(
            cause_from_log(&log).as_deref(),
            Some("Can't lookup mount=27 for fd=8 path=/tmp/host-file")
        );
        assert_eq!(cause_from_log(&dir.path().join("missing.log")), None);
    }
}
