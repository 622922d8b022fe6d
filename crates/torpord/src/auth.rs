//! The bearer token that guards the TCP listener. (The Unix socket is guarded by its mode.)

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use subtle::ConstantTimeEq;

/// Fewer bytes than this is too easy to guess.
pub const MIN_TOKEN_LEN: usize = 16;

/// Why the token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read.
    #[error("cannot read token file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Others may read the token.
    #[error(
        "token file {path} is readable by group or others (mode {mode:04o}): chmod 600 {path}"
    )]
    Exposed { path: PathBuf, mode: u32 },
    /// Too short, or not printable ASCII (it travels in an HTTP header).
    #[error(
        "token file {path} must hold one token of at least {MIN_TOKEN_LEN} printable ASCII \
         characters (e.g. `openssl rand -hex 32 > {path}`)"
    )]
    Invalid { path: PathBuf },
}

/// A bearer token. Its `Debug` does not show it.
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// Reads the token from `path`: one line, surrounding whitespace ignored; the file must
    /// not be readable by group or others.
    pub fn load(path: &Path) -> Result<Self, TokenError> {
        let read_err = |source| TokenError::Read {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read_err)?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TokenError::Exposed {
                path: path.to_path_buf(),
                mode,
            });
        }
        let bytes = std::fs::read(path).map_err(read_err)?;
        let token = bytes.trim_ascii();
        if token.len() < MIN_TOKEN_LEN || !token.iter().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Invalid {
                path: path.to_path_buf(),
            });
        }
        Ok(Self(token.to_vec()))
    }

    /// Whether an `Authorization` header value is `Bearer <this token>`, compared in constant
    /// time (only the length of a wrong token can show in the timing).
    pub fn accepts(&self, authorization: &[u8]) -> bool {
        let Some(given) = strip_bearer(authorization) else {
            return false;
        };
        given.ct_eq(&self.0).into()
    }
}

fn strip_bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii_start();
    (token.len() < rest.len()).then_some(token.trim_ascii_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_token(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let path = dir.join("token");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn accepts_only_the_right_bearer_token() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Token::load(&write_token(tmp.path(), "0123456789abcdef0123\n", 0o600)).unwrap();
        assert!(t.accepts(b"Bearer 0123456789abcdef0123"));
        assert!(t.accepts(b"bearer 0123456789abcdef0123"));
        assert!(!t.accepts(b"Bearer 0123456789abcdef012"));
        assert!(!t.accepts(b"Bearer 0123456789abcdef01234"));
        assert!(!t.accepts(b"Bearer0123456789abcdef0123"));
        assert!(!t.accepts(b"Basic 0123456789abcdef0123"));
        assert!(!t.accepts(b""));
        assert_eq!(format!("{t:?}"), "Token(..)");
    }

    #[test]
    fn refuses_exposed_short_or_odd_tokens() {
        let tmp = tempfile::tempdir().unwrap();
        let e = Token::load(&write_token(tmp.path(), "0123456789abcdef0123", 0o644)).unwrap_err();
        assert!(matches!(e, TokenError::Exposed { mode: 0o644, .. }), "{e}");
        let e = Token::load(&write_token(tmp.path(), "short", 0o600)).unwrap_err();
        assert!(matches!(e, TokenError::Invalid { .. }), "{e}");
        let e = Token::load(&write_token(tmp.path(), "0123456789 abcdef0123", 0o600)).unwrap_err();
        assert!(matches!(e, TokenError::Invalid { .. }), "{e}");
        let e = Token::load(&tmp.path().join("missing")).unwrap_err();
        assert!(matches!(e, TokenError::Read { .. }), "{e}");
    }
}
