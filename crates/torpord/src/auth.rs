//! The bearer tokens that guard the TCP listener (the Unix socket is guarded by its mode): the
//! admin token of `token_file`, which sees every tenant, and the tenants' tokens of
//! `tenant_tokens_file`, each of which sees its tenant's functions only (crate::tenant).

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
        let bytes = read_private(path)?;
        let token = bytes.trim_ascii();
        if !is_token(token) {
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

/// The bytes of a file that group and others cannot read.
fn read_private(path: &Path) -> Result<Vec<u8>, TokenError> {
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
    std::fs::read(path).map_err(read_err)
}

/// Long enough, and printable ASCII without spaces (it travels in an HTTP header).
fn is_token(token: &[u8]) -> bool {
    token.len() >= MIN_TOKEN_LEN && token.iter().all(u8::is_ascii_graphic)
}

/// Why a line of the tenant tokens file is refused.
#[derive(Debug, thiserror::Error)]
pub enum TenantLineProblem {
    /// Not `tenant = token`.
    #[error("is not `tenant = token`")]
    NotAnEntry,
    /// The tenant is no tenant name.
    #[error(
        "names a tenant that is not a tenant name (1 to 63 of a-z, 0-9, '_', '.', '-', starting \
         with a letter or digit, as torpor.toml's tenant; not shown, in case it is a token)"
    )]
    BadTenant,
    /// The token is too short or not printable ASCII.
    #[error(
        "holds a token that is not at least {MIN_TOKEN_LEN} printable ASCII characters without \
         spaces (e.g. `openssl rand -hex 32`)"
    )]
    BadToken,
    /// The same token twice: whose would it be?
    #[error("repeats the token of line {0}: give each tenant tokens of its own")]
    DuplicateToken(usize),
    /// The admin token given as a tenant's.
    #[error("holds the admin token of token_file: give tenants tokens of their own")]
    AdminToken,
}

/// Why the tenant tokens file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TenantTokensError {
    /// Unreadable, or readable by others.
    #[error(transparent)]
    File(#[from] TokenError),
    /// One line is wrong.
    #[error("tenant tokens file {path} line {line} {problem}; fix that line (each line is `tenant = token`, `#` starts a comment)")]
    Line {
        path: PathBuf,
        line: usize,
        problem: TenantLineProblem,
    },
    /// No entry at all.
    #[error("tenant tokens file {path} holds no `tenant = token` line: add one per tenant, or drop tenant_tokens_file")]
    Empty { path: PathBuf },
}

/// The tokens the TCP listener takes, and whose scope each gives.
pub struct Tokens {
    /// `token_file`: every tenant.
    admin: Option<Token>,
    /// `tenant_tokens_file`: (tenant, token), in file order; a tenant may have several (to
    /// rotate them).
    tenants: Vec<(String, Token)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens")
            .field("admin", &self.admin.is_some())
            .field(
                "tenants",
                &self.tenants.iter().map(|(t, _)| t).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Tokens {
    /// The admin token alone (the single `token_file` of before tenants).
    pub fn admin_only(admin: Token) -> Self {
        Self {
            admin: Some(admin),
            tenants: Vec::new(),
        }
    }

    /// Reads `token_file` (`admin`) and `tenant_tokens_file` (`tenants`): lines of `tenant =
    /// token`, blank lines and `#` comments ignored; the file must not be readable by group or
    /// others; every token distinct (the admin's included).
    pub fn load(admin: Option<&Path>, tenants: Option<&Path>) -> Result<Self, TenantTokensError> {
        let admin = admin.map(Token::load).transpose()?;
        let mut entries: Vec<(String, Token, usize)> = Vec::new();
        if let Some(path) = tenants {
            let bytes = read_private(path)?;
            let bad = |line: usize, problem| TenantTokensError::Line {
                path: path.to_path_buf(),
                line,
                problem,
            };
            for (i, raw) in bytes.split(|b| *b == b'\n').enumerate() {
                let line = i + 1;
                let text = raw.trim_ascii();
                if text.is_empty() || text.starts_with(b"#") {
                    continue;
                }
                let Some(eq) = text.iter().position(|b| *b == b'=') else {
                    return Err(bad(line, TenantLineProblem::NotAnEntry));
                };
                let (tenant, token) = (text[..eq].trim_ascii(), text[eq + 1..].trim_ascii());
                let tenant = String::from_utf8_lossy(tenant).into_owned();
                if !crate::tenant::is_tenant_name(&tenant) {
                    return Err(bad(line, TenantLineProblem::BadTenant));
                }
                if !is_token(token) {
                    return Err(bad(line, TenantLineProblem::BadToken));
                }
                if let Some((_, _, first)) = entries.iter().find(|(_, t, _)| t.0 == token) {
                    return Err(bad(line, TenantLineProblem::DuplicateToken(*first)));
                }
                if admin.as_ref().is_some_and(|a| a.0 == token) {
                    return Err(bad(line, TenantLineProblem::AdminToken));
                }
                entries.push((tenant, Token(token.to_vec()), line));
            }
            if entries.is_empty() {
                return Err(TenantTokensError::Empty {
                    path: path.to_path_buf(),
                });
            }
        }
        Ok(Self {
            admin,
            tenants: entries.into_iter().map(|(t, k, _)| (t, k)).collect(),
        })
    }

    /// The scope an `Authorization` header value gives, if it is `Bearer <one of the tokens>`.
    /// Every token is compared, each in constant time, whichever matches: only the lengths of
    /// the tokens can show in the timing.
    pub fn scope(&self, authorization: &[u8]) -> Option<crate::tenant::Scope> {
        let given = strip_bearer(authorization)?;
        let mut found = None;
        if let Some(admin) = &self.admin {
            if bool::from(given.ct_eq(&admin.0)) {
                found = Some(crate::tenant::Scope::All);
            }
        }
        for (tenant, token) in &self.tenants {
            if bool::from(given.ct_eq(&token.0)) {
                found = Some(crate::tenant::Scope::Tenant(tenant.clone()));
            }
        }
        found
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

    fn write_tenants(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let path = dir.join("tenants");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn each_tenant_token_gives_its_tenant_and_the_admin_token_all() {
        use crate::tenant::Scope;
        let tmp = tempfile::tempdir().unwrap();
        let admin = write_token(tmp.path(), "admin-0123456789abcdef\n", 0o600);
        let tenants = write_tenants(
            tmp.path(),
            "# tenants\n\na = aaaaaaaaaaaaaaaa1\n  b=bbbbbbbbbbbbbbbb2  \na = aaaaaaaaaaaaaaaa3\n",
            0o600,
        );
        let t = Tokens::load(Some(&admin), Some(&tenants)).unwrap();
        assert_eq!(t.scope(b"Bearer admin-0123456789abcdef"), Some(Scope::All));
        assert_eq!(
            t.scope(b"Bearer aaaaaaaaaaaaaaaa1"),
            Some(Scope::Tenant("a".into()))
        );
        assert_eq!(
            t.scope(b"bearer aaaaaaaaaaaaaaaa3"),
            Some(Scope::Tenant("a".into()))
        );
        assert_eq!(
            t.scope(b"Bearer bbbbbbbbbbbbbbbb2"),
            Some(Scope::Tenant("b".into()))
        );
        assert_eq!(t.scope(b"Bearer bbbbbbbbbbbbbbbb"), None);
        assert_eq!(t.scope(b"Bearer a = aaaaaaaaaaaaaaaa1"), None);
        assert_eq!(t.scope(b""), None);
        assert!(!format!("{t:?}").contains("aaaa"), "{t:?}");
        // Without an admin token, tenants only.
        let t = Tokens::load(None, Some(&tenants)).unwrap();
        assert_eq!(t.scope(b"Bearer admin-0123456789abcdef"), None);
        assert_eq!(
            t.scope(b"Bearer bbbbbbbbbbbbbbbb2"),
            Some(Scope::Tenant("b".into()))
        );
    }

    #[test]
    fn a_bad_tenant_tokens_file_is_refused_naming_its_line() {
        let tmp = tempfile::tempdir().unwrap();
        let admin = write_token(tmp.path(), "admin-0123456789abcdef", 0o600);
        let load = |text: &str, mode: u32| {
            let p = write_tenants(tmp.path(), text, mode);
            Tokens::load(Some(&admin), Some(&p))
                .map(|_| ())
                .unwrap_err()
        };
        let e = load("a = aaaaaaaaaaaaaaaa1\n", 0o640);
        assert!(
            matches!(e, TenantTokensError::File(TokenError::Exposed { .. })),
            "{e}"
        );
        for (text, line, want) in [
            ("a aaaaaaaaaaaaaaaa1\n", 1, "is not `tenant = token`"),
            ("\nA = aaaaaaaaaaaaaaaa1\n", 2, "not a tenant name"),
            ("../x = aaaaaaaaaaaaaaaa1\n", 1, "not a tenant name"),
            ("a = short\n", 1, "at least 16"),
            ("a = aaaa aaaaaaaaaaaa1\n", 1, "at least 16"),
            (
                "a = aaaaaaaaaaaaaaaa1\nb = aaaaaaaaaaaaaaaa1\n",
                2,
                "repeats the token of line 1",
            ),
            ("a = admin-0123456789abcdef\n", 1, "admin token"),
        ] {
            let e = load(text, 0o600);
            let msg = e.to_string();
            assert!(
                matches!(e, TenantTokensError::Line { line: l, .. } if l == line),
                "{text:?}: {msg}"
            );
            assert!(msg.contains(want) && !msg.contains('\n'), "{text:?}: {msg}");
            assert!(
                !msg.contains("aaaaaaaaaaaaaaaa1"),
                "a token in an error: {msg}"
            );
        }
        let e = load("# nothing\n\n", 0o600);
        assert!(matches!(e, TenantTokensError::Empty { .. }), "{e}");
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
