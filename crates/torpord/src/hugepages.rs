//! The node's transparent-huge-page mode, which decides how fast CRIU fills a restored
//! instance's memory (docs/split.md, "Huge pages").
//!
//! CRIU restores a process's private memory by writing the image's pages into freshly mapped
//! areas; each first write faults in a page. With THP `always` the kernel backs those areas with
//! 2 MiB pages (one fault per 512 small ones); with `madvise`, the common distribution default,
//! only areas that asked for it at that moment, and CRIU applies a process's own `madvise` bits
//! only after its pages are in (criu/pie/restorer.c, "Finally restore madvise() bits"), so a
//! worker cannot ask for it ahead of time. Measured on the H100 with a 4.9 GB GPT-2-Large
//! snapshot: `torpor restore` 3.0 s with `always` against 4.8 s with `madvise`.
//!
//! The mode is the node's: it applies to every process, and `always` can raise the memory
//! footprint of programs that touch a few bytes of many 2 MiB ranges. So the daemon leaves it as
//! it is unless `restore_server.transparent_hugepage = "always"` says otherwise, says in its log
//! when the mode costs restores time, and reports it as `torpor_node_transparent_hugepage`.
//! A mode it set is put back when it stops gracefully.

use std::path::{Path, PathBuf};

/// Where the kernel shows and takes the mode.
pub const SYSFS_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// `restore_server.transparent_hugepage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ThpPolicy {
    /// The node's mode as the admin set it.
    #[default]
    Leave,
    /// Set `always` while the daemon runs (restores fill memory with huge pages).
    Always,
}

impl ThpPolicy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "leave" => Some(ThpPolicy::Leave),
            "always" => Some(ThpPolicy::Always),
            _ => None,
        }
    }
}

/// The mode could not be set.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot set transparent huge pages to \"always\" in {}: {source}; run torpord as root on a \
     kernel with THP, or set restore_server.transparent_hugepage = \"leave\"",
    path.display()
)]
pub struct ThpError {
    path: PathBuf,
    source: std::io::Error,
}

/// The selected mode in the kernel's `always [madvise] never`; `None` if the file is missing
/// (a kernel without THP) or unreadable.
pub fn node_mode(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    selected(&text)
}

fn selected(text: &str) -> Option<String> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix('[').and_then(|w| w.strip_suffix(']')))
        .map(str::to_owned)
}

/// A mode the daemon changed, to put back at shutdown.
#[derive(Debug)]
pub struct Changed {
    path: PathBuf,
    previous: String,
}

impl Changed {
    /// Writes the previous mode back.
    pub fn restore(self) {
        match std::fs::write(&self.path, &self.previous) {
            Ok(()) => tracing::info!(mode = %self.previous, "transparent huge pages set back"),
            Err(e) => tracing::warn!(
                mode = %self.previous,
                error = %e,
                "cannot set transparent huge pages back"
            ),
        }
    }
}

/// Applies `policy` to the mode in `path`: `Ok(Some(_))` when it changed it.
pub fn apply(policy: ThpPolicy, path: &Path) -> Result<Option<Changed>, ThpError> {
    let current = node_mode(path);
    match policy {
        // Said once the daemon has started (`report`): a start that fails says one line only.
        ThpPolicy::Leave => Ok(None),
        ThpPolicy::Always => {
            if current.as_deref() == Some("always") {
                return Ok(None);
            }
            std::fs::write(path, "always").map_err(|source| ThpError {
                path: path.to_path_buf(),
                source,
            })?;
            let previous = current.unwrap_or_else(|| "madvise".to_string());
            tracing::info!(previous = %previous, "transparent huge pages set to \"always\" for restores");
            Ok(Some(Changed {
                path: path.to_path_buf(),
                previous,
            }))
        }
    }
}

/// Says in the log what the node's mode costs restores, when it is not `always`.
pub fn report(path: &Path) {
    if let Some(mode) = node_mode(path).filter(|m| m != "always") {
        tracing::info!(
            mode,
            "transparent huge pages are not \"always\" on this node: CRIU fills restored \
             memory with 4 KiB pages (on the H100 a GPT-2-Large restore took 4.8 s \
             instead of 3.0 s); set restore_server.transparent_hugepage = \"always\" or \
             the node's mode (docs/split.md, \"Huge pages\")"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_mode_is_the_bracketed_word() {
        assert_eq!(
            selected("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            selected("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(selected("always madvise never"), None);
    }

    #[test]
    fn always_writes_the_file_and_restore_puts_the_old_mode_back() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("enabled");
        std::fs::write(&f, "always [madvise] never\n").unwrap();
        let changed = apply(ThpPolicy::Always, &f).unwrap().expect("changed");
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "always");
        changed.restore();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "madvise");
        std::fs::write(&f, "[always] madvise never\n").unwrap();
        assert!(apply(ThpPolicy::Always, &f).unwrap().is_none());
        assert!(apply(ThpPolicy::Leave, &f).unwrap().is_none());
    }

    #[test]
    fn a_mode_that_cannot_be_written_is_one_error_naming_the_fix() {
        let e = apply(ThpPolicy::Always, Path::new("/nonexistent/enabled"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("transparent_hugepage = \"leave\""), "{e}");
    }
}
