//! Where the bucket is and how to sign for it. Credentials live in their own file, never in the
//! configuration: the configuration can be shown, copied and committed, the credentials file not.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::ConfigError;

/// The object store: a TOML file such as
///
/// ```toml
/// endpoint = "https://s3.eu-west-1.amazonaws.com"   # any S3-compatible endpoint
/// bucket = "torpor-snapshots"
/// region = "eu-west-1"                              # default us-east-1
/// credentials_file = "/etc/torpor/objstore.credentials"  # relative: to this file's directory
/// path_style = true                                 # default true (SeaweedFS, MinIO); false: virtual-host
/// prefix = "team-a/"                                # optional: every key starts with it
/// range_bytes = 33554432                            # optional: a pull's ranged GETs, at most this long
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteConfig {
    pub endpoint: String,
    pub bucket: String,
    #[serde(default = "default_region")]
    pub region: String,
    pub credentials_file: PathBuf,
    #[serde(default = "default_path_style")]
    pub path_style: bool,
    #[serde(default)]
    pub prefix: String,
    /// A pull coalesces the chunks it lacks in a pack into ranged GETs of at most this many
    /// bytes ([`DEFAULT_RANGE_BYTES`]; [`RANGE_BYTES`] bounds it). Shorter ranges spread a
    /// pull's last requests over more connections; longer ones send fewer requests.
    #[serde(default = "default_range_bytes")]
    pub range_bytes: u64,
}

/// Default of `range_bytes`: 32 MiB, a whole pack (push cuts packs at ~32 MiB).
pub const DEFAULT_RANGE_BYTES: u64 = 32 << 20;
/// The values `range_bytes` takes: 1 MiB to 256 MiB (a range's buffer is held until its chunks
/// are written, `parallel` of them and as many queued).
pub const RANGE_BYTES: std::ops::RangeInclusive<u64> = (1 << 20)..=(256 << 20);

fn default_range_bytes() -> u64 {
    DEFAULT_RANGE_BYTES
}

fn default_region() -> String {
    "us-east-1".to_owned()
}

fn default_path_style() -> bool {
    true
}

/// Names that would put a secret into the configuration file.
const SECRET_KEYS: [&str; 4] = [
    "access_key_id",
    "secret_access_key",
    "session_token",
    "secret",
];

impl RemoteConfig {
    /// Reads and checks the configuration file at `path`.
    pub fn load(path: &Path) -> Result<RemoteConfig, ConfigError> {
        let text = fs::read_to_string(path).map_err(|source| ConfigError::Unreadable {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = RemoteConfig::parse(&text, path)?;
        if config.credentials_file.is_relative() {
            let base = path.parent().unwrap_or(Path::new("."));
            config.credentials_file = base.join(&config.credentials_file);
        }
        Ok(config)
    }

    /// Parses configuration text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<RemoteConfig, ConfigError> {
        if let Ok(table) = text.parse::<toml::Table>() {
            if let Some(key) = SECRET_KEYS.iter().find(|k| table.contains_key(**k)) {
                return Err(ConfigError::SecretInConfig {
                    path: path.to_path_buf(),
                    key,
                });
            }
        }
        let config: RemoteConfig = toml::from_str(text).map_err(|e| ConfigError::Invalid {
            path: path.to_path_buf(),
            reason: e.message().to_owned(),
        })?;
        config.check().map_err(|(_, reason)| ConfigError::Invalid {
            path: path.to_path_buf(),
            reason,
        })?;
        Ok(config)
    }
}

impl RemoteConfig {
    /// Checks the values no type can: the endpoint is an http(s) URL with a host, the bucket is
    /// named, the prefix ends with '/' and does not start with one. The error names the key
    /// and says why (torpord's `[objstore]` section is checked by this too).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let url = url::Url::parse(&self.endpoint)
            .map_err(|e| ("endpoint", format!("endpoint {:?}: {e}", self.endpoint)))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err((
                "endpoint",
                format!(
                    "endpoint {:?} is not an http(s) URL with a host",
                    self.endpoint
                ),
            ));
        }
        if self.bucket.is_empty() {
            return Err(("bucket", "bucket is empty".into()));
        }
        if !(self.prefix.is_empty() || self.prefix.ends_with('/')) || self.prefix.starts_with('/') {
            return Err((
                "prefix",
                format!(
                    "prefix {:?} must end with '/' and not start with one",
                    self.prefix
                ),
            ));
        }
        if !RANGE_BYTES.contains(&self.range_bytes) {
            return Err((
                "range_bytes",
                format!(
                    "range_bytes {} is not within {} to {} (1 to 256 MiB)",
                    self.range_bytes,
                    RANGE_BYTES.start(),
                    RANGE_BYTES.end()
                ),
            ));
        }
        Ok(())
    }
}

/// An access key and its secret, read from the credentials file:
///
/// ```toml
/// access_key_id = "AKIA…"
/// secret_access_key = "…"
/// session_token = "…"   # optional
/// ```
///
/// The file must be a regular file readable by its owner only (mode 0600 or stricter).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    #[serde(default)]
    pub session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret, not even in a debug log.
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    /// Reads the credentials file at `path`.
    pub fn load(path: &Path) -> Result<Credentials, ConfigError> {
        let unreadable = |source| ConfigError::CredentialsUnreadable {
            path: path.to_path_buf(),
            source,
        };
        let meta = fs::metadata(path).map_err(unreadable)?;
        if !meta.is_file() {
            return Err(unreadable(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(ConfigError::CredentialsOpen {
                path: path.to_path_buf(),
                mode: meta.mode() & 0o777,
            });
        }
        let text = fs::read_to_string(path).map_err(unreadable)?;
        let creds: Credentials =
            toml::from_str(&text).map_err(|e| ConfigError::CredentialsInvalid {
                path: path.to_path_buf(),
                reason: e.message().to_owned(),
            })?;
        if creds.access_key_id.is_empty() || creds.secret_access_key.is_empty() {
            return Err(ConfigError::CredentialsInvalid {
                path: path.to_path_buf(),
                reason: "access_key_id or secret_access_key is empty".into(),
            });
        }
        Ok(creds)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn config_parses_defaults_and_refuses_secrets() {
        let p = Path::new("objstore.toml");
        let c = RemoteConfig::parse(
            "endpoint = \"http://127.0.0.1:8333\"\nbucket = \"b\"\ncredentials_file = \"c\"\n",
            p,
        )
        .expect("parse");
        assert_eq!(c.region, "us-east-1");
        assert!(c.path_style);
        assert_eq!(c.prefix, "");
        assert_eq!(c.range_bytes, DEFAULT_RANGE_BYTES);
        let err = RemoteConfig::parse(
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nsecret_access_key = \"x\"\n",
            p,
        )
        .expect_err("secret");
        assert!(matches!(err, ConfigError::SecretInConfig { .. }), "{err}");
        assert!(err.to_string().contains("credentials_file"), "{err}");
        for bad in [
            "endpoint = \"ftp://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\n",
            "endpoint = \"http://h\"\nbucket = \"\"\ncredentials_file = \"c\"\n",
            "endpoint = \"http://h\"\nbucket = \"b\"\n",
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nprefix = \"a\"\n",
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nbogus = 1\n",
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nrange_bytes = 4096\n",
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nrange_bytes = 1073741824\n",
        ] {
            let err = RemoteConfig::parse(bad, p).expect_err(bad);
            assert!(err.to_string().contains("objstore.toml"), "{err}");
        }
        let short = "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nrange_bytes = 4096\n";
        let err = RemoteConfig::parse(short, p)
            .expect_err("short range")
            .to_string();
        assert!(err.contains("range_bytes 4096 is not within"), "{err}");
        let c = RemoteConfig::parse(
            "endpoint = \"http://h\"\nbucket = \"b\"\ncredentials_file = \"c\"\nrange_bytes = 8388608\n",
            p,
        )
        .expect("8 MiB ranges");
        assert_eq!(c.range_bytes, 8 << 20);
    }

    #[test]
    fn credentials_file_missing_open_or_bad_is_one_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("creds");
        let err = Credentials::load(&path).expect_err("missing");
        assert!(
            matches!(err, ConfigError::CredentialsUnreadable { .. }),
            "{err}"
        );
        assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
        fs::write(&path, "access_key_id = \"a\"\nsecret_access_key = \"s\"\n").expect("write");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
        let err = Credentials::load(&path).expect_err("open");
        assert!(err.to_string().contains("chmod 600"), "{err}");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).expect("chmod");
        let creds = Credentials::load(&path).expect("load");
        assert_eq!(creds.access_key_id, "a");
        assert!(!format!("{creds:?}").contains("secret_access_key"));
        fs::write(&path, "access_key_id = 1\n").expect("write");
        let err = Credentials::load(&path).expect_err("bad");
        assert!(
            matches!(err, ConfigError::CredentialsInvalid { .. }),
            "{err}"
        );
    }
}
