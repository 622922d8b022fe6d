//! The markers of instances whose lazy pages their page server is still serving
//! (`<state>/pages-pending/<instance id>`): a daemon that dies leaves them for the next one,
//! which kills such instances instead of re-adopting them (crate::recovery::drop_pages_pending).

use std::path::Path;

/// Their directory, under the state directory.
pub const DIR: &str = "pages-pending";

/// Marks instance `id` as having pages its page server has not served yet: created before the
/// instance's registry row (so no row of a lazily restored instance is ever without it until
/// its pages are in), removed by [`served`].
pub fn mark(root: &Path, id: &str) -> std::io::Result<()> {
    let dir = root.join(DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(id), b"")
}

/// Every page of instance `id` is in (or the instance is gone): its marker goes.
pub fn served(root: &Path, id: &str) {
    let _ = std::fs::remove_file(root.join(DIR).join(id));
}
