//! Who wrote a snapshot: a MAC over its manifest, under a key only its writer holds.
//!
//! The manifest's BLAKE3 hashes catch accidents (a flipped bit, a truncated copy), not a writer:
//! anyone who can change a page file can recompute its hash in `manifest.json`. So a snapshot is
//! also *sealed*: `manifest.mac` holds keyed BLAKE3 ([`blake3::keyed_hash`], a MAC when the key is
//! secret) of the exact bytes of `manifest.json`. Every field is covered, including fields a
//! later torpor adds, and every file through its listed hash; only a holder of the key can
//! produce a MAC that [`Snapshot::authenticate`](crate::Snapshot::authenticate) accepts.
//!
//! - The MAC covers the bytes as written, not a re-serialisation: nothing has to be canonical
//!   (JSON number formatting, unknown fields) for a check to be exact.
//! - Inputs are domain-separated (`MAC_CONTEXT`, `KEY_ID_CONTEXT`), so the key id published in
//!   `manifest.mac` is never the MAC of any manifest.
//! - The key is 32 random bytes (getrandom(2)) in a file of mode 0600, created on first use.
//!   A key file that others can read, or owned by another user, is refused: a key anyone can read
//!   proves nothing.
//! - [`Trust::Unkeyed`] is the explicit opt-out: hashes only, integrity against accidents.

use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The usual name of a key file (a torpord's is `<state-dir>/snapshot.key`).
pub const SNAPSHOT_KEY_FILE: &str = "snapshot.key";

/// Name of the MAC file inside a snapshot directory (never listed in the manifest).
pub const MAC_FILE: &str = "manifest.mac";

/// Reads of `manifest.mac` stop here: a real one is about 150 bytes.
const MAX_MAC_BYTES: u64 = 4096;

/// The only scheme written and read: keyed BLAKE3 over `MAC_CONTEXT` + the manifest's bytes.
pub const MAC_SCHEME: &str = "blake3-keyed";

/// Prefix of every MAC input (domain separation from the key id).
const MAC_CONTEXT: &[u8] = b"torpor snapshot manifest v1\0";
/// Prefix of the MAC input of a chunk store record (`refs/<snapshot>.json`).
const RECORD_CONTEXT: &[u8] = b"torpor chunk store record v1\0";
/// Prefix of the MAC input of a snapshot's page profile (its hot set), which travels beside it.
const PROFILE_CONTEXT: &[u8] = b"torpor page profile v1\0";
/// Keyed-hashed to name a key without revealing it.
const KEY_ID_CONTEXT: &[u8] = b"torpor snapshot key id v1\0";

/// Bytes of a key.
const KEY_LEN: usize = 32;
/// Hex digits of a key id.
const KEY_ID_LEN: usize = 16;

/// Why a key could not be loaded or created.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file is missing and `create` was not asked for.
    #[error("snapshot key {path} does not exist: give the key that sealed the snapshots (a daemon's is <state-dir>/snapshot.key)")]
    Missing { path: PathBuf },
    /// Reading, creating or writing the key file failed.
    #[error("cannot {action} the snapshot key {path}: {source}: check that its directory exists and is writable by this user only")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The key file is readable or writable by others, or owned by another user.
    #[error("snapshot key {path} has mode {mode:o} and owner uid {uid}; it must be a regular file of mode 0600 owned by uid {euid} (a key others can read proves nothing): chmod 600 {path}, or remove it to start a new key (snapshots sealed with the old one are then refused)")]
    Exposed {
        path: PathBuf,
        mode: u32,
        uid: u32,
        euid: u32,
    },
    /// The key file does not hold exactly 32 bytes.
    #[error("snapshot key {path} holds {len} bytes, not {KEY_LEN}: it is not a torpor key; remove it to start a new one (snapshots sealed with the old one are then refused)")]
    Malformed { path: PathBuf, len: u64 },
}

/// A secret key that seals snapshots and authenticates them. Its `Debug` never shows the key.
#[derive(Clone)]
pub struct SnapshotKey {
    key: [u8; KEY_LEN],
    id: String,
    path: PathBuf,
}

impl fmt::Debug for SnapshotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotKey")
            .field("id", &self.id)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SnapshotKey {
    /// Loads the key at `path`, creating it (mode 0600, 32 random bytes) if it does not exist.
    pub fn load_or_create(path: &Path) -> Result<SnapshotKey, KeyError> {
        match Self::load(path) {
            Err(KeyError::Missing { .. }) => Self::create(path),
            other => other,
        }
    }

    /// Loads the key at `path`; refuses one others can read or write, or that is not 32 bytes.
    pub fn load(path: &Path) -> Result<SnapshotKey, KeyError> {
        let io_err = |action| key_io_error(action, path);
        let file = match File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(KeyError::Missing {
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err("open")(e)),
        };
        let meta = file.metadata().map_err(io_err("read"))?;
        // SAFETY: geteuid(2) cannot fail and has no side effects.
        let euid = unsafe { libc::geteuid() };
        if !meta.is_file() || meta.mode() & 0o077 != 0 || meta.uid() != euid {
            return Err(KeyError::Exposed {
                path: path.to_path_buf(),
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                euid,
            });
        }
        let mut key = [0u8; KEY_LEN];
        let mut bytes = Vec::with_capacity(KEY_LEN + 1);
        file.take(KEY_LEN as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io_err("read"))?;
        if bytes.len() != KEY_LEN {
            return Err(KeyError::Malformed {
                path: path.to_path_buf(),
                len: meta.len(),
            });
        }
        key.copy_from_slice(&bytes);
        Ok(Self::from_bytes(key, path))
    }

    /// Creates a new random key at `path` (mode 0600; fails if the file appears meanwhile).
    fn create(path: &Path) -> Result<SnapshotKey, KeyError> {
        let io_err = |action| key_io_error(action, path);
        let key = random_key().map_err(io_err("generate"))?;
        // Written aside and linked into place: the key file never exists half-written, and two
        // processes creating it at once agree on the one that won.
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let written = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&key)?;
                f.sync_all()
            })
            .map_err(io_err("create"));
        let linked = written.and_then(|()| match fs::hard_link(&tmp, path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(io_err("create")(e)),
        });
        let _ = fs::remove_file(&tmp);
        if linked? {
            if let Some(dir) = path.parent() {
                let _ = File::open(dir).and_then(|d| d.sync_all());
            }
            Ok(Self::from_bytes(key, path))
        } else {
            Self::load(path)
        }
    }

    /// A key from its bytes (`path` names it in messages only).
    pub fn from_bytes(key: [u8; KEY_LEN], path: &Path) -> SnapshotKey {
        let id = blake3::keyed_hash(&key, KEY_ID_CONTEXT).to_hex()[..KEY_ID_LEN].to_owned();
        SnapshotKey {
            key,
            id,
            path: path.to_path_buf(),
        }
    }

    /// A public name for the key (16 hex digits), recorded in each MAC it makes.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The file the key came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The MAC of a manifest's exact bytes.
    pub fn mac(&self, manifest: &[u8]) -> blake3::Hash {
        self.mac_in(MAC_CONTEXT, manifest)
    }

    /// The MAC of a chunk store record's bytes (without its MAC): the segments of a split
    /// snapshot and their index are trusted for restores through it.
    pub(crate) fn record_mac(&self, record: &[u8]) -> blake3::Hash {
        self.mac_in(RECORD_CONTEXT, record)
    }

    /// The MAC of snapshot `id`'s page profile: the id is covered (a snapshot id holds no NUL),
    /// so a profile cannot be moved to another snapshot.
    pub fn profile_mac(&self, id: &str, profile: &[u8]) -> blake3::Hash {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(PROFILE_CONTEXT);
        hasher.update(id.as_bytes());
        hasher.update(b"\0");
        hasher.update(profile);
        hasher.finalize()
    }

    fn mac_in(&self, context: &[u8], bytes: &[u8]) -> blake3::Hash {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(context);
        hasher.update(bytes);
        hasher.finalize()
    }

    /// The contents of `manifest.mac` for a manifest's exact bytes.
    pub fn seal(&self, manifest: &[u8]) -> Seal {
        Seal {
            scheme: MAC_SCHEME.to_owned(),
            key_id: self.id.clone(),
            mac: self.mac(manifest).to_hex().to_string(),
        }
    }
}

/// A `map_err` for an I/O failure while `action`ing the key file at `path`.
fn key_io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> KeyError {
    let path = path.to_path_buf();
    move |source| KeyError::Io {
        action,
        path,
        source,
    }
}

/// 32 bytes from the kernel's CSPRNG.
fn random_key() -> io::Result<[u8; KEY_LEN]> {
    let mut key = [0u8; KEY_LEN];
    let mut filled = 0;
    while filled < KEY_LEN {
        // SAFETY: the pointer and length describe the unfilled tail of `key`, which is writable
        // and outlives the call; getrandom(2) writes at most that many bytes.
        let n = unsafe { libc::getrandom(key[filled..].as_mut_ptr().cast(), KEY_LEN - filled, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(key)
}

/// How a snapshot must prove who wrote it before it is used.
#[derive(Debug, Clone, Copy)]
pub enum Trust<'a> {
    /// Its `manifest.mac` must be a valid MAC of its manifest under this key.
    Key(&'a SnapshotKey),
    /// No MAC is checked (there may be none): the listed hashes only, which anyone able to write
    /// the snapshot can recompute. Integrity against accidents, not against a writer.
    Unkeyed,
}

/// `manifest.mac`: which key sealed the manifest, and the MAC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    /// Always [`MAC_SCHEME`].
    pub scheme: String,
    /// [`SnapshotKey::id`] of the key that sealed it.
    pub key_id: String,
    /// Lowercase hex of [`SnapshotKey::mac`].
    pub mac: String,
}

impl Seal {
    /// As stored: one line of JSON.
    pub fn to_json(&self) -> String {
        // A struct of three strings always encodes.
        let mut json = serde_json::to_string(self).unwrap_or_default();
        json.push('\n');
        json
    }

    /// Parses `manifest.mac`; `None` when it is not one (the caller names the snapshot).
    pub fn from_json(bytes: &[u8]) -> Option<Seal> {
        if bytes.len() as u64 > MAX_MAC_BYTES {
            return None;
        }
        let seal: Seal = serde_json::from_slice(bytes).ok()?;
        let hex_ok = |s: &str, len| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        (seal.scheme == MAC_SCHEME && hex_ok(&seal.key_id, KEY_ID_LEN) && hex_ok(&seal.mac, 64))
            .then_some(seal)
    }

    /// Whether this is `key`'s MAC of `manifest` (compared in constant time).
    pub fn matches(&self, key: &SnapshotKey, manifest: &[u8]) -> bool {
        blake3::Hash::from_hex(&self.mac).is_ok_and(|mac| mac == key.mac(manifest))
    }
}

/// Reads `dir/manifest.mac` if there is one, capped, without following a symlink.
pub(crate) fn read_seal_bytes(dir: &Path) -> io::Result<Option<Vec<u8>>> {
    let path = dir.join(MAC_FILE);
    let file = match File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a regular file",
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_MAC_BYTES + 1).read_to_end(&mut bytes)?;
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_is_created_once_with_mode_0600_and_loaded_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("snapshot.key");
        let key = SnapshotKey::load_or_create(&path).unwrap();
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(meta.len(), KEY_LEN as u64);
        let again = SnapshotKey::load_or_create(&path).unwrap();
        assert_eq!(again.id(), key.id());
        assert_eq!(again.mac(b"m"), key.mac(b"m"));
        // No temporary file is left beside it.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        // Another key is another id and other MACs.
        let other = SnapshotKey::load_or_create(&dir.path().join("other.key")).unwrap();
        assert_ne!(other.id(), key.id());
        assert_ne!(other.mac(b"m"), key.mac(b"m"));
        assert!(!format!("{key:?}").contains(&format!("{:?}", key.key)));
    }

    #[test]
    fn exposed_short_and_missing_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("snapshot.key");
        assert!(matches!(
            SnapshotKey::load(&path),
            Err(KeyError::Missing { .. })
        ));
        SnapshotKey::load_or_create(&path).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let err = SnapshotKey::load(&path).unwrap_err();
        assert!(
            matches!(err, KeyError::Exposed { mode: 0o644, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("chmod 600"), "{err}");
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(&path, b"short").unwrap();
        let err = SnapshotKey::load_or_create(&path).unwrap_err();
        assert!(matches!(err, KeyError::Malformed { len: 5, .. }), "{err}");
        let link = dir.path().join("link.key");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(matches!(SnapshotKey::load(&link), Err(KeyError::Io { .. })));
    }

    #[test]
    fn a_seal_matches_only_its_manifest_and_key() {
        let key = SnapshotKey::from_bytes([7; KEY_LEN], Path::new("k"));
        let other = SnapshotKey::from_bytes([8; KEY_LEN], Path::new("o"));
        let seal = key.seal(b"{\"a\": 1}\n");
        let back = Seal::from_json(seal.to_json().as_bytes()).unwrap();
        assert_eq!(back, seal);
        assert_eq!(back.key_id, key.id());
        assert!(back.matches(&key, b"{\"a\": 1}\n"));
        assert!(!back.matches(&key, b"{\"a\": 2}\n"));
        assert!(!back.matches(&other, b"{\"a\": 1}\n"));
        // The published key id is no manifest's MAC.
        assert_ne!(&key.mac(KEY_ID_CONTEXT).to_hex()[..KEY_ID_LEN], key.id());
        for bad in [
            &b"not json"[..],
            br#"{"scheme":"hmac","key_id":"0123456789abcdef","mac":"00"}"#,
            br#"{"scheme":"blake3-keyed","key_id":"xyz","mac":"00"}"#,
        ] {
            assert_eq!(Seal::from_json(bad), None);
        }
    }

    #[test]
    fn a_profile_mac_is_bound_to_its_key_snapshot_and_purpose() {
        let key = SnapshotKey::from_bytes([7; KEY_LEN], Path::new("k"));
        let other = SnapshotKey::from_bytes([8; KEY_LEN], Path::new("o"));
        let profile = b"0x1000 0x3000\n";
        let mac = key.profile_mac("fn-a-1", profile);
        assert_eq!(mac, key.profile_mac("fn-a-1", profile));
        assert_ne!(mac, key.profile_mac("fn-a-1", b"0x1000 0x4000\n"));
        assert_ne!(mac, key.profile_mac("fn-a-2", profile));
        assert_ne!(mac, other.profile_mac("fn-a-1", profile));
        // The id and the profile cannot trade bytes.
        assert_ne!(
            key.profile_mac("fn-a-1", b"x"),
            key.profile_mac("fn-a-1x", b"")
        );
        // Domain-separated from the other MACs the key makes over the same bytes.
        let mut input = b"fn-a-1\0".to_vec();
        input.extend_from_slice(profile);
        assert_ne!(mac, key.mac(&input));
        assert_ne!(mac, key.record_mac(&input));
    }
}
