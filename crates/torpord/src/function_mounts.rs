//! A function's directory reaches its worker as a mount torpord chose: bound into the worker's
//! mount namespace, at the same path, when the function is loaded (the base worker it is loaded
//! into was started, and snapshotted, before the function was known). CRIU records the bind as
//! an external mount, so no snapshot carries the function's files and every restore binds the
//! directory again. A worker that sees the same directory there already gets no second bind.

use std::path::Path;

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

/// Binds `dir` into the mount namespace of the tree under `init`.
pub async fn bind_function_dir(init: i32, dir: &Path) -> Result<(), BindError> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        torpor_snapshot::mount_ns::bind_into(init, std::slice::from_ref(&dir))
    })
    .await??;
    Ok(())
}
