//! Where a function snapshot's page profile (its hot set: docs/lazy-pages.md, "Hot set") is
//! kept under the state directory. Apart from the runtime, which records and uses profiles
//! (crate::runtime::page_profile), because the object tier (crate::bucket) writes and reads
//! them too and the runtime uses the object tier: one module for the places, none for the
//! circle.

use std::path::{Path, PathBuf};

/// The directory of the profiles, under the state directory.
pub const PROFILES_DIR: &str = "profiles";

/// Where the profile of snapshot `id` is kept.
pub fn path(state_root: &Path, id: &str) -> PathBuf {
    state_root.join(PROFILES_DIR).join(format!("{id}.pages"))
}

/// The profile of snapshot `id`, if one was recorded and holds a range.
pub fn recorded(state_root: &Path, id: &str) -> Option<PathBuf> {
    let p = path(state_root, id);
    std::fs::metadata(&p)
        .is_ok_and(|m| m.len() > 0)
        .then_some(p)
}

/// Removes the profile of the snapshot in `snapshot_dir` (`<state>/snapshots/<id>`), if any.
pub fn remove_of_dir(snapshot_dir: &Path) {
    let (Some(id), Some(root)) = (
        snapshot_dir.file_name().and_then(|n| n.to_str()),
        snapshot_dir.parent().and_then(Path::parent),
    ) else {
        return;
    };
    let _ = std::fs::remove_file(path(root, id));
}
