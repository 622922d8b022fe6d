//! A function's directory reaches its worker as a mount torpord chose: bound into the worker's
//! mount namespace, at the same path, when the function is loaded (the base worker it is loaded
//! into was started, and snapshotted, before the function was known). CRIU records the bind as
//! an external mount, so no snapshot carries the function's files and every restore binds the
//! directory again. A worker that sees the same directory there already gets no second bind.

use std::path::Path;

/// Binds `dir` into the mount namespace of the tree under `init`.
pub async fn bind_function_dir(init: i32, dir: &Path) -> Result<(), String> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        torpor_snapshot::mount_ns::bind_into(init, std::slice::from_ref(&dir))
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|e| format!("binding the function directory failed: {e}"))?
}
