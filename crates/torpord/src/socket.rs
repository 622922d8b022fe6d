//! Binding the API's Unix socket: mode 0600 from the first moment it is reachable, a stale
//! socket left by a crashed daemon replaced, a live one never.

use std::fs::DirBuilder;
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Why the socket cannot be bound.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket's directory cannot be created.
    #[error("cannot create socket directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A daemon answers on the socket.
    #[error(
        "another torpord is already listening on {path}: stop it, or pass --socket to use \
         another path"
    )]
    InUse { path: PathBuf },
    /// Something other than a socket is at the path.
    #[error("{path} exists and is not a socket: remove it, or pass --socket to use another path")]
    NotASocket { path: PathBuf },
    /// What is at the path cannot be examined or removed.
    #[error("cannot replace stale socket {path}: {source}")]
    Stale {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Binding, restricting or moving the socket into place failed.
    #[error("cannot bind socket {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A bound API socket. Dropping it removes the socket file, if it is still this one.
#[derive(Debug)]
pub struct BoundSocket {
    path: PathBuf,
    listener: Option<UnixListener>,
    /// (device, inode) of the socket file, so only our own file is removed.
    id: (u64, u64),
}

impl BoundSocket {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the listener out (once); the file is still removed when `self` drops.
    pub fn take_listener(&mut self) -> Option<UnixListener> {
        self.listener.take()
    }

    /// Removes the socket file, if it is still this one: from then on a client's connect fails
    /// at once (ENOENT, nothing sent) while the listener still serves what is in its backlog.
    pub fn unlink(&self) {
        if let Ok(meta) = std::fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.id {
                // Nothing to do if it is already gone.
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// Binds a listening socket at `path` with mode 0600, creating its directory if needed.
///
/// The socket is bound under a temporary name in the same directory, restricted to 0600 and
/// then renamed into place, so it is never reachable with a looser mode.
pub fn bind(path: &Path) -> Result<BoundSocket, SocketError> {
    bind_with_mode(path, 0o600)
}

/// [`bind`] with another mode: the workers socket is 0666 (every worker's user connects to it),
/// in a directory of the state directory (0700) that only workers' mount namespaces expose.
pub fn bind_with_mode(path: &Path, mode: u32) -> Result<BoundSocket, SocketError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&dir)
        .map_err(|source| SocketError::CreateDir {
            path: dir.clone(),
            source,
        })?;
    remove_if_stale(path)?;

    let bind_err = |source| SocketError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let tmp = dir.join(format!(".{}.tmp", std::process::id()));
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = UnixListener::bind(&tmp).map_err(bind_err)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| std::fs::symlink_metadata(path));
    match placed {
        Ok(meta) => Ok(BoundSocket {
            path: path.to_path_buf(),
            listener: Some(listener),
            id: (meta.dev(), meta.ino()),
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(bind_err(e))
        }
    }
}

/// Removes a socket at `path` that nobody listens on; refuses a live one or a non-socket.
fn remove_if_stale(path: &Path) -> Result<(), SocketError> {
    let stale_err = |source| SocketError::Stale {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(stale_err(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(SocketError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(SocketError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            tracing::info!(socket = %path.display(), "removing stale socket left by an earlier torpord");
            std::fs::remove_file(path).map_err(stale_err)
        }
        Err(e) => Err(stale_err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_0600_and_removes_its_file_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("sub/d.sock");
        let sock = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        UnixStream::connect(&path).unwrap();
        let err = bind(&path).unwrap_err();
        assert!(matches!(err, SocketError::InUse { .. }), "{err}");
        drop(sock);
        assert!(!path.exists());
    }

    #[test]
    fn replaces_a_stale_socket_but_not_a_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("d.sock");
        drop(UnixListener::bind(&path).unwrap()); // leaves the file, nobody listening
        assert!(path.exists());
        let sock = bind(&path).unwrap();
        UnixStream::connect(sock.path()).unwrap();
        drop(sock);

        std::fs::write(&path, b"not a socket").unwrap();
        let err = bind(&path).unwrap_err();
        assert!(matches!(err, SocketError::NotASocket { .. }), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    }
}
