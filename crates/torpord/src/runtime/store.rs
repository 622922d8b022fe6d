//! The communication store's path between processes (docs/sandboxes.md, "The communication
//! store"): a sandbox's `torpor.put(key, value, shared=True)` copies the value once into a
//! memfd, seals it (no write, no resize) and hands the fd to the daemon (`store_put` +
//! `store_fd`); a `torpor.get(key)` in any sandbox of the same tenant on the node that does not
//! hold the key itself asks the daemon (`store_get`) and maps the very pages read-only (the
//! fd comes back attached to `store_value`): no copy. Workers never share a /dev/shm; the fd
//! is the only way between them, and it passes through the daemon, which scopes keys by tenant.
//!
//! A value is dropped when it is consumed (a get without keep), when its `ttl_s` passes (looked
//! at on every put and get), or with the daemon. Each tenant holds at most [`MAX_KEYS`] keys
//! and [`MAX_BYTES`] bytes.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::sync::lock;

/// Keys a tenant may hold at once.
pub const MAX_KEYS: usize = 4096;
/// Bytes a tenant may hold at once (the memfds' sizes).
pub const MAX_BYTES: u64 = 8 << 30;
/// The longest key.
pub const MAX_KEY: usize = 256;
/// The longest time to live.
pub const MAX_TTL_S: f64 = 86_400.0;

/// Why a value was not stored.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key is empty or too long.
    #[error("store key of {0} bytes: a key is 1 to {MAX_KEY} bytes; use a shorter key")]
    Key(usize),
    /// The time to live is out of range.
    #[error("ttl_s {0} is not in (0, {MAX_TTL_S}]: pass a time to live in seconds within it")]
    Ttl(f64),
    /// The memfd is not sealed against writes and resizing: its sender could change it under
    /// its readers.
    #[error(
        "the value's memfd is not sealed (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): the SDK \
         seals it; send it through torpor.put"
    )]
    NotSealed,
    /// The fd could not be examined.
    #[error("cannot examine the value's fd: {0}")]
    Fd(#[source] std::io::Error),
    /// The tenant holds too much.
    #[error(
        "the tenant's store holds {keys} keys and {bytes} bytes, and this value of {adding} \
         bytes would pass its bound ({MAX_KEYS} keys, {MAX_BYTES} bytes): get (consume) values \
         or give them a shorter ttl_s"
    )]
    Full {
        keys: usize,
        bytes: u64,
        adding: u64,
    },
}

struct Entry {
    fd: OwnedFd,
    meta: Value,
    bytes: u64,
    expires: Instant,
}

/// A value taken from the store: its memfd, what it is, its size.
#[derive(Debug)]
pub struct Taken {
    pub fd: OwnedFd,
    pub meta: Value,
    pub bytes: u64,
}

/// The values of every tenant, by (tenant, key).
#[derive(Default)]
pub struct Store {
    entries: Mutex<HashMap<(String, String), Entry>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store { .. }")
    }
}

/// The size of a memfd whose seals forbid writing and resizing; `NotSealed` otherwise.
fn sealed_size(fd: &OwnedFd) -> Result<u64, StoreError> {
    // SAFETY: fcntl(F_GET_SEALS) on an fd this function borrows for the call; it reads the
    // seals and changes nothing.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::EINVAL) {
            StoreError::NotSealed
        } else {
            StoreError::Fd(e)
        });
    }
    let needed = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals & needed != needed {
        return Err(StoreError::NotSealed);
    }
    let file = std::fs::File::from(fd.try_clone().map_err(StoreError::Fd)?);
    Ok(file.metadata().map_err(StoreError::Fd)?.len())
}

impl Store {
    fn sweep(entries: &mut HashMap<(String, String), Entry>, now: Instant) {
        entries.retain(|_, e| e.expires > now);
    }

    /// Stores `fd` (a sealed memfd) under `key` of `tenant`, replacing what the key held.
    pub fn put(
        &self,
        tenant: &str,
        key: &str,
        fd: OwnedFd,
        meta: Value,
        ttl_s: f64,
    ) -> Result<(), StoreError> {
        if key.is_empty() || key.len() > MAX_KEY {
            return Err(StoreError::Key(key.len()));
        }
        if !(ttl_s > 0.0 && ttl_s <= MAX_TTL_S) {
            return Err(StoreError::Ttl(ttl_s));
        }
        let bytes = sealed_size(&fd)?;
        let now = Instant::now();
        let mut entries = lock(&self.entries);
        Self::sweep(&mut entries, now);
        let id = (tenant.to_string(), key.to_string());
        let (keys, held) = entries
            .iter()
            .filter(|((t, k), _)| t == tenant && *k != id.1)
            .fold((0usize, 0u64), |(n, b), (_, e)| (n + 1, b + e.bytes));
        if keys + 1 > MAX_KEYS || held.saturating_add(bytes) > MAX_BYTES {
            return Err(StoreError::Full {
                keys,
                bytes: held,
                adding: bytes,
            });
        }
        entries.insert(
            id,
            Entry {
                fd,
                meta,
                bytes,
                expires: now + Duration::from_secs_f64(ttl_s),
            },
        );
        Ok(())
    }

    /// The value under `key` of `tenant`, taken out unless `keep` (then a second fd of it).
    pub fn get(&self, tenant: &str, key: &str, keep: bool) -> Result<Option<Taken>, StoreError> {
        let mut entries = lock(&self.entries);
        Self::sweep(&mut entries, Instant::now());
        let id = (tenant.to_string(), key.to_string());
        if keep {
            let Some(e) = entries.get(&id) else {
                return Ok(None);
            };
            return Ok(Some(Taken {
                fd: e.fd.try_clone().map_err(StoreError::Fd)?,
                meta: e.meta.clone(),
                bytes: e.bytes,
            }));
        }
        Ok(entries.remove(&id).map(|e| Taken {
            fd: e.fd,
            meta: e.meta,
            bytes: e.bytes,
        }))
    }

    /// Keys held and their bytes, all tenants.
    pub fn usage(&self) -> (usize, u64) {
        let mut entries = lock(&self.entries);
        Self::sweep(&mut entries, Instant::now());
        (entries.len(), entries.values().map(|e| e.bytes).sum())
    }
}

impl crate::runtime::Runtime {
    /// The tenant whose store a worker of `inst` uses: its pool's spec's.
    fn store_tenant(&self, inst: &crate::runtime::Instance) -> Option<String> {
        self.pool_tenant(&inst.function)
    }

    /// A worker's `store_put` with its memfd: stored, and answered `store_stored`.
    pub(crate) fn store_put(
        self: &std::sync::Arc<Self>,
        inst: &std::sync::Arc<crate::runtime::Instance>,
        put: crate::protocol::StorePut,
        fd: OwnedFd,
    ) {
        let stored = match self.store_tenant(inst) {
            Some(tenant) => self.store.put(&tenant, &put.key, fd, put.meta, put.ttl_s),
            None => Err(StoreError::Fd(std::io::Error::other(
                "the instance has no pool any more",
            ))),
        };
        if let Err(e) = &stored {
            tracing::info!(instance = %inst.id, key = %put.key, error = %e, "store: value refused");
        }
        let reply = crate::protocol::ToWorker::StoreStored(crate::protocol::StoreStored {
            id: put.id,
            ok: stored.is_ok(),
            error: stored.err().map(|e| e.to_string()),
        });
        reply_to(inst, reply, None);
    }

    /// A worker's `store_get`: answered `store_value`, with the memfd when found.
    pub(crate) fn store_get(
        self: &std::sync::Arc<Self>,
        inst: &std::sync::Arc<crate::runtime::Instance>,
        get: crate::protocol::StoreGet,
    ) {
        let found = match self.store_tenant(inst) {
            Some(tenant) => self.store.get(&tenant, &get.key, get.keep),
            None => Ok(None),
        };
        let (value, fd) = match found {
            Ok(Some(t)) => (
                crate::protocol::StoreValue {
                    id: get.id,
                    found: true,
                    meta: Some(t.meta),
                    bytes: Some(t.bytes),
                    fd: Some(true),
                    error: None,
                },
                Some(t.fd),
            ),
            Ok(None) => (
                crate::protocol::StoreValue {
                    id: get.id,
                    found: false,
                    meta: None,
                    bytes: None,
                    fd: None,
                    error: None,
                },
                None,
            ),
            Err(e) => (
                crate::protocol::StoreValue {
                    id: get.id,
                    found: false,
                    meta: None,
                    bytes: None,
                    fd: None,
                    error: Some(e.to_string()),
                },
                None,
            ),
        };
        reply_to(inst, crate::protocol::ToWorker::StoreValue(value), fd);
    }
}

/// Sends `frame` (with `fd` attached) to `inst`'s worker, in a task of its own: the reader that
/// calls this must not wait for the writer, which a request's send may hold.
fn reply_to(
    inst: &std::sync::Arc<crate::runtime::Instance>,
    frame: crate::protocol::ToWorker,
    fd: Option<OwnedFd>,
) {
    let inst = std::sync::Arc::clone(inst);
    tokio::spawn(async move {
        let mut wr = inst.writer.lock().await;
        let sent = match &fd {
            Some(fd) => {
                use std::os::fd::AsFd;
                crate::split::fds::send_with_fd(&mut wr, &frame, fd.as_fd()).await
            }
            None => crate::workers::send(&mut wr, &frame).await,
        };
        if let Err(e) = sent {
            tracing::debug!(instance = %inst.id, error = %e, "store: the answer was not sent");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn memfd(data: &[u8], seal: bool) -> OwnedFd {
        let name = std::ffi::CString::new("torpor-store-test").unwrap();
        // SAFETY: memfd_create with a valid NUL-terminated name; the fd returned is owned here.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(raw >= 0);
        // SAFETY: raw is a fresh fd this test owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let mut f = std::fs::File::from(fd.try_clone().unwrap());
        f.write_all(data).unwrap();
        if seal {
            let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            // SAFETY: adds seals to the fd this test owns.
            let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
            assert_eq!(r, 0);
        }
        fd
    }

    #[test]
    fn a_value_is_taken_once_and_is_its_tenants_only() {
        let s = Store::default();
        s.put(
            "a",
            "k",
            memfd(b"hello", true),
            serde_json::json!({"kind": "bytes"}),
            60.0,
        )
        .unwrap();
        assert!(s.get("b", "k", false).unwrap().is_none());
        let kept = s.get("a", "k", true).unwrap().unwrap();
        assert_eq!(kept.bytes, 5);
        let taken = s.get("a", "k", false).unwrap().unwrap();
        assert_eq!(taken.meta["kind"], "bytes");
        assert!(s.get("a", "k", false).unwrap().is_none());
        assert_eq!(s.usage(), (0, 0));
    }

    #[test]
    fn an_unsealed_fd_a_bad_key_or_ttl_are_refused_and_a_value_expires() {
        let s = Store::default();
        let e = s
            .put("a", "k", memfd(b"x", false), Value::Null, 60.0)
            .unwrap_err();
        assert!(matches!(e, StoreError::NotSealed), "{e}");
        let e = s
            .put("a", "", memfd(b"x", true), Value::Null, 60.0)
            .unwrap_err();
        assert!(matches!(e, StoreError::Key(0)));
        let e = s
            .put("a", "k", memfd(b"x", true), Value::Null, 0.0)
            .unwrap_err();
        assert!(matches!(e, StoreError::Ttl(_)));
        s.put("a", "k", memfd(b"x", true), Value::Null, 0.05)
            .unwrap();
        std::thread::sleep(Duration::from_millis(80));
        assert!(s.get("a", "k", false).unwrap().is_none());
    }
}
