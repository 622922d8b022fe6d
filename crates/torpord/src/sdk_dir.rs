//! Where the `torpor` Python package (the SDK and worker harness) is: `$TORPOR_PYTHONPATH`, else
//! beside the running binary (a source tree's `python/`, or an installed wheel's site-packages).
//! Its own module because both the launcher (workers' `PYTHONPATH`) and the split path (the
//! hook library the wheel ships inside the package) ask it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Names the directory holding the `torpor` Python package.
pub const PYTHONPATH_ENV: &str = "TORPOR_PYTHONPATH";

/// Why the `torpor` Python package (which every worker imports) cannot be found. Cloned: the
/// runtime keeps the answer it got at start and hands it to every deploy and boot.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SdkDirError {
    /// `$TORPOR_PYTHONPATH` is set but names no directory holding the package.
    #[error(
        "${PYTHONPATH_ENV}={} holds no torpor/worker.py: point it at the directory that \
         contains the torpor Python package (the repository's python/)",
        dir.display()
    )]
    EnvHasNoPackage { dir: PathBuf },
    /// The running executable cannot be found, so neither can the package beside it.
    #[error("cannot find the running executable ({source}): set ${PYTHONPATH_ENV}")]
    NoExecutable {
        #[source]
        source: Arc<std::io::Error>,
    },
    /// No directory above the executable holds the package.
    #[error(
        "cannot find the torpor Python package near {}: set ${PYTHONPATH_ENV} to the \
         directory that contains torpor/worker.py (the repository's python/)",
        exe.display()
    )]
    NotFound { exe: PathBuf },
}

/// The directory holding the `torpor` Python package, or why there is none.
pub fn python_dir() -> Result<PathBuf, SdkDirError> {
    if let Some(dir) = std::env::var_os(PYTHONPATH_ENV).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        if dir.join("torpor/worker.py").is_file() {
            return Ok(dir);
        }
        return Err(SdkDirError::EnvHasNoPackage { dir });
    }
    let exe = std::env::current_exe().map_err(|e| SdkDirError::NoExecutable {
        source: Arc::new(e),
    })?;
    let exe = exe.canonicalize().unwrap_or(exe);
    for dir in exe.ancestors().skip(1) {
        if let Some(found) = package_dirs(dir)
            .into_iter()
            .find(|d| d.join("torpor/worker.py").is_file())
        {
            return Ok(found);
        }
    }
    Err(SdkDirError::NotFound { exe })
}

/// Where the `torpor` package may be relative to a directory above the executable: `python/` of
/// a source tree (`<repo>/target/release/torpor`), or the site-packages of an installed wheel,
/// which puts the binary in `<prefix>/bin` and the package in
/// `<prefix>/lib/python3.X/{site,dist}-packages` (a virtual environment, /usr/local).
fn package_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.join("python")];
    let Ok(entries) = std::fs::read_dir(dir.join("lib")) else {
        return out;
    };
    let mut pythons: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    pythons.sort();
    for p in pythons {
        out.push(p.join("site-packages"));
        out.push(p.join("dist-packages"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_package_is_found_in_a_source_tree_and_in_site_packages() {
        let root = tempfile::tempdir().unwrap();
        let dirs = package_dirs(root.path());
        assert_eq!(dirs, vec![root.path().join("python")]);
        let site = root.path().join("lib/python3.11/site-packages");
        std::fs::create_dir_all(site.join("torpor")).unwrap();
        std::fs::create_dir_all(root.path().join("lib/pkgconfig")).unwrap();
        let dirs = package_dirs(root.path());
        assert!(dirs.contains(&site), "{dirs:?}");
        assert!(dirs.contains(&root.path().join("lib/python3.11/dist-packages")));
        assert!(!dirs
            .iter()
            .any(|d| d.starts_with(root.path().join("lib/pkgconfig"))));
    }
}
