//! A function's directory reaches its worker as a mount torpord chose: bound into the worker's
//! mount namespace, at the same path, when the function is loaded (the base worker it is loaded
//! into was started, and snapshotted, before the function was known). CRIU records the bind as
//! an external mount, so no snapshot carries the function's files and every restore binds the
//! directory again. A worker that sees the same directory there already gets no second bind.
//!
//! An unprivileged worker's bind is read-only, and the way to it is made traversable for its
//! user (a directory others cannot enter on the way, `/root` say, gets an empty tmpfs in which
//! the rest of the path is made: torpor_snapshot::mount_ns::BindOptions::veil).

use std::path::{Path, PathBuf};

use torpor_snapshot::launch::User;

/// Why a function's directory could not be bound into its worker's mount namespace.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The bind itself failed (the message names the mount step and its errno).
    #[error(transparent)]
    Mount(#[from] torpor_snapshot::mount_ns::MountNsError),
    /// The blocking task doing the bind did not finish (it panicked, or the daemon is stopping).
    #[error("binding the function directory failed: the task doing it ended ({0}); torpord's log has the cause")]
    Task(#[from] tokio::task::JoinError),
}

/// Binds `dir` into the mount namespace of the tree under `init`; `unprivileged`: its worker
/// runs as a user of its tenant's (read-only, the way made traversable).
pub async fn bind_function_dir(init: i32, dir: &Path, unprivileged: bool) -> Result<(), BindError> {
    let dir = dir.to_path_buf();
    let how = torpor_snapshot::mount_ns::BindOptions {
        read_only: unprivileged,
        veil: unprivileged,
    };
    tokio::task::spawn_blocking(move || {
        torpor_snapshot::mount_ns::bind_into(init, std::slice::from_ref(&dir), how)
    })
    .await??;
    Ok(())
}

/// A function's directory its workers' user could not read.
#[derive(Debug, thiserror::Error)]
#[error(
    "the function directory {} (mode {mode:o}, owner {owner}:{group}) cannot be read by its \
     workers, which run as uid {uid} (workers.unprivileged): make it readable and searchable by \
     others (chmod o+rX), or give it to that uid or gid",
    dir.display()
)]
pub struct UnreadableError {
    dir: PathBuf,
    mode: u32,
    owner: u32,
    group: u32,
    uid: u32,
}

/// Refuses a function directory `user` can neither list nor enter (only the directory itself is
/// checked: the way to it is made traversable in the worker's mount namespace, and the files
/// under it are the function's business). `None`: root reads anything.
pub fn check_readable(dir: &Path, user: Option<User>) -> Result<(), UnreadableError> {
    use std::os::unix::fs::MetadataExt;
    let (Some(user), Ok(meta)) = (user, std::fs::metadata(dir)) else {
        return Ok(());
    };
    let mode = meta.mode() & 0o7777;
    let bits = if meta.uid() == user.uid {
        mode >> 6
    } else if meta.gid() == user.gid {
        mode >> 3
    } else {
        mode
    };
    if bits & 0o5 == 0o5 {
        return Ok(());
    }
    Err(UnreadableError {
        dir: dir.to_path_buf(),
        mode,
        owner: meta.uid(),
        group: meta.gid(),
        uid: user.uid,
    })
}
