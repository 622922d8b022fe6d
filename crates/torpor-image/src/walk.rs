//! Listing the regular files under a snapshot directory, without following symlinks.

use std::fs::{self, FileType};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use crate::error::{ImageError, Result};

/// One regular file under the walked root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WalkedFile {
    /// Path relative to the root, `/`-separated.
    pub rel: String,
    pub size: u64,
}

/// What is under a root: its regular files (sorted by path) and its directories (the root first).
#[derive(Debug, Default)]
pub(crate) struct Tree {
    pub files: Vec<WalkedFile>,
    pub dirs: Vec<PathBuf>,
}

/// Lists everything under `root`. A symlink, FIFO, socket or device anywhere is an error, so a
/// listed path can never lead outside `root` and reading a listed file can never block.
pub(crate) fn walk(root: &Path) -> Result<Tree> {
    let mut tree = Tree::default();
    // (absolute directory, its path relative to root, "" for the root)
    let mut pending = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel_dir)) = pending.pop() {
        let read_dir_error = |source| ImageError::ReadDir {
            path: dir.clone(),
            source,
        };
        for entry in fs::read_dir(&dir).map_err(read_dir_error)? {
            let entry = entry.map_err(read_dir_error)?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                return Err(ImageError::NonUtf8Name {
                    dir: root.to_path_buf(),
                    name: entry.path().to_string_lossy().into_owned(),
                });
            };
            let rel = if rel_dir.is_empty() {
                name.to_owned()
            } else {
                format!("{rel_dir}/{name}")
            };
            // DirEntry::metadata does not follow symlinks.
            let meta = entry.metadata().map_err(read_dir_error)?;
            let file_type = meta.file_type();
            if file_type.is_dir() {
                pending.push((entry.path(), rel));
            } else if file_type.is_file() {
                tree.files.push(WalkedFile {
                    rel,
                    size: meta.len(),
                });
            } else {
                return Err(ImageError::NotRegularFile {
                    dir: root.to_path_buf(),
                    file: rel,
                    kind: kind_name(file_type),
                });
            }
        }
        tree.dirs.push(dir);
    }
    tree.files.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(tree)
}

fn kind_name(file_type: FileType) -> &'static str {
    if file_type.is_symlink() {
        "symlink"
    } else if file_type.is_fifo() {
        "FIFO"
    } else if file_type.is_socket() {
        "socket"
    } else if file_type.is_block_device() {
        "block device"
    } else if file_type.is_char_device() {
        "character device"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_nested_files_sorted_and_refuses_symlinks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        fs::create_dir_all(root.join("b/c")).expect("mkdir");
        fs::create_dir(root.join("empty")).expect("mkdir");
        fs::write(root.join("z.img"), b"zz").expect("write");
        fs::write(root.join("b/c/deep.img"), b"deep!").expect("write");
        fs::write(root.join("a.img"), b"").expect("write");
        let tree = walk(root).expect("walk");
        let files: Vec<(&str, u64)> = tree
            .files
            .iter()
            .map(|f| (f.rel.as_str(), f.size))
            .collect();
        assert_eq!(files, [("a.img", 0), ("b/c/deep.img", 5), ("z.img", 2)]);
        assert_eq!(tree.dirs.len(), 4);
        assert_eq!(tree.dirs[0], root);

        std::os::unix::fs::symlink("/etc/passwd", root.join("b/link")).expect("symlink");
        match walk(root) {
            Err(ImageError::NotRegularFile { file, kind, .. }) => {
                assert_eq!((file.as_str(), kind), ("b/link", "symlink"));
            }
            other => panic!("{other:?}"),
        }
    }
}
