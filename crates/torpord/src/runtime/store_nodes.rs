//! The communication store between nodes (docs/sandboxes.md, "The communication store"):
//! `torpor.put(key, value, shared=True, nodes="all")` is stored on this node as every shared
//! put is (crate::runtime::store) and uploaded by this daemon to the bucket of `[objstore]`,
//! which every node's torpord already shares (crate::bucket::Tier); a get on any node that does
//! not hold the key asks the bucket and hands the value over in a sealed memfd, as a local one.
//! No channel between daemons is added and workers never see the bucket's credentials.
//!
//! A CUDA tensor goes the same way: the daemon holds it in its GPU memory as for a put on the
//! node (crate::runtime::store_gpu), copies it to host memory once sealed and uploads those
//! bytes, marked `gpu` in the record; a get on another node downloads them and copies them up
//! into new memory on the getter's GPU through that GPU's PCIe scheduler (source "bucket"), as
//! for a spilled value. Only a function with a GPU gets it; elsewhere the get is refused and
//! the value stays.
//!
//! Two objects per key, under the daemon's tenant (never the worker's word): the value's bytes,
//! `store/<tenant>/<blake3 of the key>.<put id>.bin`, then its [`Record`],
//! `store/<tenant>/<blake3 of the key>.json`, which names the put id. The record is written
//! last and read first: it is the commit point, so a key is never half visible (a reader that
//! finds a record whose bytes are gone finds nothing). A consuming get deletes the record once
//! the value is ready to hand over (the worker's fd made, a GPU copy done), then the bytes: a
//! get that fails before consumes nothing. A get on the putting node asks the bucket whether its
//! value is still the key's (another node may have consumed or replaced it).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use torpor_objstore::Remote;

use super::store::{
    reply_stored, reply_to, value_frame, Delivered, SealedGpu, StoreError, Taken, TakenHeld,
};
use super::Instance;
use crate::bucket::Tier;
use crate::protocol::{StoreGet, StorePut, ToWorker};

/// The format of [`Record`] this daemon writes and reads.
pub const RECORD_FORMAT: u32 = 1;
/// The largest record read back (the worker's meta is small: kind, dtype, shape).
const MAX_RECORD_BYTES: u64 = 64 << 10;

/// What the bucket says of a value for every node: whose it is, which put, when it expires,
/// and the worker's meta (kind, dtype, shape) as the putter sent it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub format: u32,
    pub tenant: String,
    pub key: String,
    /// The put id: names the object of the bytes.
    pub put: String,
    pub bytes: u64,
    /// Wall-clock expiry, milliseconds since the epoch (the nodes' clocks are compared).
    pub expires_unix_ms: u64,
    pub meta: Value,
    /// Put from a CUDA tensor: a get hands it over on the getter's GPU. Absent for bytes and
    /// arrays, so their records read as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gpu: bool,
}

/// The objects' common stem: the tenant's path component and the key's hash, so a key with `/`
/// or `..` never shapes an object name and one tenant's keys never meet another's.
fn stem(tenant: &str, key: &str) -> String {
    format!(
        "store/{}/{}",
        crate::tenant::path_component(tenant),
        blake3::hash(key.as_bytes()).to_hex()
    )
}

/// The record object of `key` of `tenant`.
pub fn record_name(tenant: &str, key: &str) -> String {
    format!("{}.json", stem(tenant, key))
}

/// The object of put `put`'s bytes.
pub fn data_name(tenant: &str, key: &str, put: &str) -> String {
    format!("{}.{put}.bin", stem(tenant, key))
}

/// A new put id: 32 hex digits, random.
fn new_put_id() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact_at(&mut b, 0)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Record {
    /// The record of a put of `bytes` under `key`, living `ttl_s` from `now_ms`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        tenant: &str,
        key: &str,
        put: &str,
        bytes: u64,
        ttl_s: f64,
        now_ms: u64,
        meta: Value,
        gpu: bool,
    ) -> Self {
        Record {
            format: RECORD_FORMAT,
            tenant: tenant.to_owned(),
            key: key.to_owned(),
            put: put.to_owned(),
            bytes,
            expires_unix_ms: now_ms.saturating_add((ttl_s * 1000.0) as u64),
            meta,
            gpu,
        }
    }

    /// The record in `object` if it is `key` of `tenant`'s, as this daemon writes them.
    pub fn parse(object: &[u8], tenant: &str, key: &str) -> Result<Record, String> {
        let r: Record = serde_json::from_slice(object).map_err(|e| e.to_string())?;
        if r.format != RECORD_FORMAT {
            return Err(format!(
                "format {}, this torpord reads {RECORD_FORMAT}",
                r.format
            ));
        }
        if r.tenant != tenant || r.key != key {
            return Err(format!("it names key {:?} of tenant {:?}", r.key, r.tenant));
        }
        if r.put.len() != 32 || !r.put.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(format!("its put id {:?} is not 32 hex digits", r.put));
        }
        if r.bytes > super::store::MAX_BYTES {
            return Err(format!("{} bytes is more than a tenant may hold", r.bytes));
        }
        Ok(r)
    }

    pub fn expired(&self, now_ms: u64) -> bool {
        self.expires_unix_ms <= now_ms
    }
}

fn bucket(what: &'static str) -> impl Fn(torpor_objstore::ObjError) -> StoreError {
    move |e| StoreError::Bucket {
        what,
        line: e.to_string(),
    }
}

fn remote(tier: &Tier, what: &'static str) -> Result<Remote, StoreError> {
    tier.remote().map_err(|e| StoreError::Bucket {
        what,
        line: e.to_string(),
    })
}

/// The record of `key`, if the bucket has one.
fn read_record(remote: &Remote, tenant: &str, key: &str) -> Result<Option<Record>, StoreError> {
    let name = record_name(tenant, key);
    let Some(object) = remote
        .get(&name, MAX_RECORD_BYTES)
        .map_err(bucket("reading the store key's record from the bucket"))?
    else {
        return Ok(None);
    };
    Record::parse(&object, tenant, key)
        .map(Some)
        .map_err(|reason| StoreError::BadObject {
            object: remote.full_key(&name),
            reason,
        })
}

/// Deletes `r`'s objects: the record first (the value is gone for every reader from then on),
/// then the bytes (a failure there leaves an object nobody reads; logged).
fn delete(remote: &Remote, r: &Record) -> Result<(), StoreError> {
    remote
        .delete(&record_name(&r.tenant, &r.key))
        .map_err(bucket("deleting the consumed store value from the bucket"))?;
    if let Err(e) = remote.delete(&data_name(&r.tenant, &r.key, &r.put)) {
        tracing::warn!(key = %r.key, "store: the bytes of a consumed value stay in the bucket: {e}");
    }
    Ok(())
}

/// Puts `data` in the bucket as the value of `key` of `tenant` (`gpu`: from a CUDA tensor), then
/// has `store_here` store it on this node under the new put id: the put is done only when both
/// are; a failure leaves the key as it was, here and in the bucket. Blocking.
#[allow(clippy::too_many_arguments)]
fn publish(
    tier: &Tier,
    tenant: &str,
    key: &str,
    ttl_s: f64,
    meta: &Value,
    gpu: bool,
    data: &[u8],
    store_here: impl FnOnce(String) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let id = new_put_id().map_err(StoreError::Fd)?;
    let r = Record::new(
        tenant,
        key,
        &id,
        data.len() as u64,
        ttl_s,
        now_ms(),
        meta.clone(),
        gpu,
    );
    let what = "uploading the value for every node (the key is unchanged)";
    let remote = remote(tier, what)?;
    let old = read_record(&remote, tenant, key).ok().flatten();
    remote
        .put(&data_name(tenant, key, &id), data)
        .map_err(bucket(what))?;
    let record = serde_json::to_vec(&r).map_err(|e| StoreError::Fd(std::io::Error::other(e)))?;
    if let Err(e) = remote.put(&record_name(tenant, key), &record) {
        let _ = remote.delete(&data_name(tenant, key, &id));
        return Err(bucket(what)(e));
    }
    if let Err(e) = store_here(id) {
        // Refused here (the tenant's bound): not in the bucket either. The value the key held
        // in the bucket before is gone with it, as a put replaces it.
        let _ = delete(&remote, &r);
        return Err(e);
    }
    if let Some(old) = old.filter(|o| o.put != r.put) {
        if let Err(e) = remote.delete(&data_name(tenant, key, &old.put)) {
            tracing::warn!(key = %key, "store: the bytes of a replaced value stay in the bucket: {e}");
        }
    }
    Ok(())
}

/// Uploads the sealed memfd `fd` of `put` for every node, then stores it here ([`publish`]).
/// Blocking.
fn upload(
    tier: &Tier,
    store: &super::store::Store,
    tenant: &str,
    put: &StorePut,
    fd: OwnedFd,
) -> Result<(), StoreError> {
    super::store::check_key_ttl(&put.key, put.ttl_s)?;
    let bytes = super::store::sealed_size(&fd)?;
    let len = usize::try_from(bytes).map_err(|_| StoreError::Full {
        keys: 0,
        bytes: 0,
        adding: bytes,
    })?;
    let mut data = vec![0u8; len];
    std::fs::File::from(fd.try_clone().map_err(StoreError::Fd)?)
        .read_exact_at(&mut data, 0)
        .map_err(StoreError::Fd)?;
    publish(
        tier,
        tenant,
        &put.key,
        put.ttl_s,
        &put.meta,
        false,
        &data,
        |id| store.put(tenant, &put.key, fd, put.meta.clone(), put.ttl_s, Some(id)),
    )
}

/// Uploads a sealed GPU put for every node (its bytes copied to host memory), then stores it
/// here in its GPU memory ([`publish`]). A failure drops the memory. Blocking.
fn upload_gpu(
    tier: &Tier,
    store: &super::store::Store,
    sealed: SealedGpu,
) -> Result<(), StoreError> {
    let too_large = |n| StoreError::Full {
        keys: 0,
        bytes: 0,
        adding: n,
    };
    let len = usize::try_from(sealed.bytes).map_err(|_| too_large(sealed.bytes))?;
    let padded = usize::try_from(sealed.gpu.padded).map_err(|_| too_large(sealed.gpu.padded))?;
    let dev_err = |what| move |source| StoreError::Device { what, source };
    // The device copies whole granules; the bucket gets the value's bytes.
    let device = &sealed.gpu.device;
    let mut buf = device
        .host_buffer(padded)
        .map_err(dev_err("staging the value for the bucket"))?;
    device
        .read_memory(&sealed.gpu.memory, &mut buf)
        .map_err(dev_err("copying the value to host memory for the bucket"))?;
    let (tenant, key, meta) = (
        sealed.tenant.clone(),
        sealed.key.clone(),
        sealed.meta.clone(),
    );
    let ttl_s = sealed.ttl.as_secs_f64();
    publish(tier, &tenant, &key, ttl_s, &meta, true, &buf[..len], |id| {
        store.insert_gpu(sealed, id)
    })
}

/// The bytes of record `r` in a new sealed memfd. `None` when they are gone (another node
/// consumed the value meanwhile). Blocking.
fn download(remote: &Remote, r: &Record) -> Result<Option<OwnedFd>, StoreError> {
    let fd = super::store::new_memfd().map_err(StoreError::Fd)?;
    let mut file = std::fs::File::from(fd.try_clone().map_err(StoreError::Fd)?);
    let name = data_name(&r.tenant, &r.key, &r.put);
    let got = remote
        .get_into(&name, &mut file, r.bytes)
        .map_err(bucket("downloading the store value from the bucket"))?;
    let Some(n) = got else {
        return Ok(None);
    };
    if n != r.bytes {
        return Err(StoreError::BadObject {
            object: remote.full_key(&name),
            reason: format!("{n} bytes where its record says {}", r.bytes),
        });
    }
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: adds seals to the memfd this function made and owns; no mapping of it exists.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(StoreError::Fd(std::io::Error::last_os_error()));
    }
    Ok(Some(fd))
}

/// What a get the bucket decided found: the value (this node's, or downloaded), and for a
/// consuming get the record to delete once the value is ready to hand over.
struct Found {
    taken: Taken,
    consume: Option<(Remote, Record)>,
    downloaded: bool,
}

/// A get of `key` of `tenant` that this node's store missed (`local` None) or found as a value
/// for every node (`local`, taken out unless `keep`): the bucket decides. A value put from a
/// CUDA tensor is refused to a getter without a GPU (`!gpu_ok`) before any download. Blocking.
fn get(
    tier: &Tier,
    store: &super::store::Store,
    tenant: &str,
    key: &str,
    keep: bool,
    local: Option<Taken>,
    gpu_ok: bool,
) -> Result<Option<Found>, StoreError> {
    let remote = remote(tier, "reading the store key from the bucket")?;
    let record = read_record(&remote, tenant, key)?;
    if let Some(t) = local {
        let ours = record
            .as_ref()
            .is_some_and(|r| Some(&r.put) == t.bucket.as_ref());
        if ours && !record.as_ref().is_some_and(|r| r.expired(now_ms())) {
            let consume = record.filter(|_| !keep).map(|r| (remote, r));
            return Ok(Some(Found {
                taken: t,
                consume,
                downloaded: false,
            }));
        }
        // Consumed, replaced or expired elsewhere: this node's copy is stale.
        if keep {
            store.forget(tenant, key, &t);
        }
    }
    let Some(r) = record else {
        return Ok(None);
    };
    if r.expired(now_ms()) {
        delete(&remote, &r)?;
        return Ok(None);
    }
    if r.gpu && !gpu_ok {
        return Err(StoreError::NeedsGpu(key.to_string()));
    }
    let Some(fd) = download(&remote, &r)? else {
        return Ok(None);
    };
    let taken = Taken::downloaded(fd, r.meta.clone(), r.bytes, r.gpu);
    Ok(Some(Found {
        taken,
        consume: (!keep).then_some((remote, r)),
        downloaded: true,
    }))
}

impl super::Runtime {
    /// A worker's `store_put` with `nodes: "all"` and its memfd: uploaded, stored, answered.
    pub(crate) fn store_put_nodes(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        put: StorePut,
        fd: OwnedFd,
    ) {
        let (Some(tier), Some(tenant)) = (self.objstore.clone(), self.store_tenant(inst)) else {
            let e = match self.objstore {
                None => StoreError::NoObjstore,
                Some(_) => {
                    StoreError::Fd(std::io::Error::other("the instance has no pool any more"))
                }
            };
            reply_stored(inst, put.id, &put.key, Err(e));
            return;
        };
        let rt = Arc::clone(self);
        let inst = Arc::clone(inst);
        tokio::spawn(async move {
            let (rt2, put2) = (Arc::clone(&rt), put.clone());
            let stored =
                tokio::task::spawn_blocking(move || upload(&tier, &rt2.store, &tenant, &put2, fd))
                    .await
                    .unwrap_or_else(|e| Err(StoreError::Task(e.to_string())));
            rt.store_metrics();
            reply_stored(&inst, put.id, &put.key, stored);
        });
    }

    /// A GPU put for every node, filled and sealed (`store_written`): uploaded, stored in its
    /// GPU memory, answered `store_stored` (put `id`).
    pub(crate) fn store_publish_gpu(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        id: u64,
        sealed: SealedGpu,
    ) {
        let Some(tier) = self.objstore.clone() else {
            reply_stored(inst, id, &sealed.key, Err(StoreError::NoObjstore));
            return;
        };
        let rt = Arc::clone(self);
        let inst = Arc::clone(inst);
        let key = sealed.key.clone();
        tokio::spawn(async move {
            let rt2 = Arc::clone(&rt);
            let stored = tokio::task::spawn_blocking(move || upload_gpu(&tier, &rt2.store, sealed))
                .await
                .unwrap_or_else(|e| Err(StoreError::Task(e.to_string())));
            rt.store_metrics();
            reply_stored(&inst, id, &key, stored);
        });
    }

    /// What a get found, ready for the worker: a host value's memfd, or a GPU value on the
    /// worker's GPU (crate::runtime::store_gpu); then, for a consuming get, the bucket's copy
    /// deleted. A failure anywhere hands nothing over (a GPU copy made is dropped). Blocking.
    fn store_hand_over(&self, inst: &Instance, found: Found) -> Result<Delivered, StoreError> {
        let Found {
            taken,
            consume,
            downloaded,
        } = found;
        let delivered = match taken {
            Taken {
                held: TakenHeld::Host(fd),
                gpu: false,
                meta,
                bytes,
                ..
            } => Delivered {
                meta,
                bytes,
                fd,
                gpu: None,
            },
            taken => {
                let mut d = self.store_deliver(inst, &taken)?;
                if let (true, Some(g)) = (downloaded, d.gpu.as_mut()) {
                    g.source = "bucket".to_string();
                }
                d
            }
        };
        if let Some((remote, r)) = &consume {
            delete(remote, r)?;
        }
        Ok(delivered)
    }

    /// A worker's `store_get` that the bucket decides ([`get`]): answered `store_value`. A
    /// value of this node's taken out for it goes back when the get fails (the bucket cannot be
    /// asked, the copy onto the worker's GPU fails).
    pub(crate) fn store_get_nodes(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        get_frame: StoreGet,
        tier: Arc<Tier>,
        tenant: String,
        local: Option<Taken>,
    ) {
        let rt = Arc::clone(self);
        let inst = Arc::clone(inst);
        let gpu_ok = self.pool_gpus(&inst.function);
        tokio::spawn(async move {
            let (rt2, inst2) = (Arc::clone(&rt), Arc::clone(&inst));
            let (key, keep) = (get_frame.key.clone(), get_frame.keep);
            let found = tokio::task::spawn_blocking(move || {
                // Another handle of the local value, to put back if the get fails.
                let back = local
                    .as_ref()
                    .filter(|_| !keep)
                    .and_then(|t| t.duplicate().ok());
                let delivered = get(&tier, &rt2.store, &tenant, &key, keep, local, gpu_ok)
                    .and_then(|found| found.map(|f| rt2.store_hand_over(&inst2, f)).transpose());
                if let (Err(e), Some(t)) = (&delivered, back) {
                    let kept = rt2.store.put_back(&tenant, &key, t);
                    tracing::warn!(key = %key, kept, "store: a get through the bucket failed: {e}");
                }
                delivered
            })
            .await
            .unwrap_or_else(|e| Err(StoreError::Task(e.to_string())));
            rt.store_metrics();
            let (value, fd) = value_frame(get_frame.id, found);
            reply_to(&inst, ToWorker::StoreValue(value), fd);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_are_the_tenants_and_never_carry_the_key() {
        let a = record_name("team-a", "../../etc/x");
        assert!(
            a.starts_with("store/team-a/") && a.ends_with(".json"),
            "{a}"
        );
        assert!(!a.contains("..") && a.matches('/').count() == 2, "{a}");
        assert_ne!(a, record_name("team-b", "../../etc/x"));
        assert_ne!(a, record_name("team-a", "../../etc/y"));
        // A tenant name that is no path component is hashed, never used as one.
        let odd = record_name("../x", "k");
        assert!(
            odd.starts_with("store/not-a-tenant-") && odd.matches('/').count() == 2,
            "{odd}"
        );
        let d = data_name("team-a", "k", "00ff");
        assert_eq!(d, format!("{}.00ff.bin", stem("team-a", "k")));
        assert_eq!(
            record_name("team-a", "k"),
            format!("{}.json", stem("team-a", "k"))
        );
    }

    #[test]
    fn a_record_round_trips_and_one_for_another_key_or_tenant_is_refused() {
        let meta = serde_json::json!({"kind": "ndarray", "dtype": "<f4", "shape": [3, 4]});
        let put = "0123456789abcdef0123456789abcdef";
        let r = Record::new("team-a", "k/1", put, 48, 2.5, 1_000, meta, false);
        assert_eq!(r.expires_unix_ms, 3_500);
        let bytes = serde_json::to_vec(&r).unwrap();
        assert_eq!(Record::parse(&bytes, "team-a", "k/1").unwrap(), r);
        assert!(Record::parse(&bytes, "team-b", "k/1")
            .unwrap_err()
            .contains("tenant"));
        assert!(Record::parse(&bytes, "team-a", "k/2")
            .unwrap_err()
            .contains("key"));
        assert!(!r.expired(3_499) && r.expired(3_500));
        let mut bad = r.clone();
        bad.put = "../x".into();
        let e = Record::parse(&serde_json::to_vec(&bad).unwrap(), "team-a", "k/1").unwrap_err();
        assert!(e.contains("put id"), "{e}");
        let mut v: Value = serde_json::to_value(&r).unwrap();
        v["format"] = 2.into();
        let e = Record::parse(&serde_json::to_vec(&v).unwrap(), "team-a", "k/1").unwrap_err();
        assert!(e.contains("format 2"), "{e}");
        v["format"] = 1.into();
        v["extra"] = 1.into();
        assert!(Record::parse(&serde_json::to_vec(&v).unwrap(), "team-a", "k/1").is_err());
        assert_eq!(new_put_id().unwrap().len(), 32);
        assert_ne!(new_put_id().unwrap(), new_put_id().unwrap());
    }
}
