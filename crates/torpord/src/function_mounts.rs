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

/// A function's directory, or one of its declared data files, its workers' user could not read.
#[derive(Debug, thiserror::Error)]
#[error(
    "{what} {} (mode {mode:o}, owner {owner}:{group}) cannot be read by its workers, which run as \
     uid {uid} (workers.unprivileged): make it readable by others (chmod o+r{x}; a umask of 077 \
     leaves new files unreadable), or give it to that uid or gid",
    path.display(),
    x = if *.dir { "X" } else { "" }
)]
pub struct UnreadableError {
    what: String,
    path: PathBuf,
    dir: bool,
    mode: u32,
    owner: u32,
    group: u32,
    uid: u32,
}

/// Refuses a function whose directory `user` can neither list nor enter, or one of whose declared
/// data files (`data`: name and path) `user` cannot read: the worker would fail later, in its
/// setup, with an error that names neither the cause nor the fix (safetensors says "No such file
/// or directory" for any file it cannot open). The way to the directory is made traversable in
/// the worker's mount namespace; other files under it are the function's business. `None`: root
/// reads anything.
pub fn check_readable(
    dir: &Path,
    data: &[(String, PathBuf)],
    user: Option<User>,
) -> Result<(), UnreadableError> {
    let Some(user) = user else {
        return Ok(());
    };
    check_one(dir, "the function directory".to_string(), true, user)?;
    for (name, path) in data {
        check_one(
            path,
            format!("the data {name:?} of the function,"),
            false,
            user,
        )?;
    }
    Ok(())
}

fn check_one(path: &Path, what: String, dir: bool, user: User) -> Result<(), UnreadableError> {
    use std::os::unix::fs::MetadataExt;
    // A path that cannot be read at all is the spec check's to report, not this one's.
    let Ok(meta) = std::fs::metadata(path) else {
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
    let needed = if dir { 0o5 } else { 0o4 };
    if bits & needed == needed {
        return Ok(());
    }
    Err(UnreadableError {
        what,
        path: path.to_path_buf(),
        dir,
        mode,
        owner: meta.uid(),
        group: meta.gid(),
        uid: user.uid,
    })
}
