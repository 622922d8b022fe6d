//! The object tier in the daemon (docs/objstore.md, "torpord"): with `[objstore]` configured,
//! every successful deploy pushes its function snapshot and a function record to the bucket,
//! and a node that does not know a function pulls it from there on `POST
//! /v1/functions/{name}/pull` or on its first invoke, so that any node can serve any function.
//!
//! The transfers are `torpor_objstore`'s `push` and `pull` (the same as `torpor push/pull`:
//! only missing chunks move, each hashed against its name before it is stored), run on the
//! blocking pool against the daemon's chunk store (`<state>/chunks`, the split path's). What
//! this module adds is the function: its record in the bucket, tenancy, registering a pulled
//! function as if it were deployed, retrying failed pushes, and bounding the chunk store.
//!
//! # In the bucket, beside `torpor push`'s layout
//!
//! ```text
//! <prefix>functions/<tenant>/<name>.json   the function record: spec, dir, base key, snapshot id
//! <prefix>function-names/<name>.json       {"tenant": …}: which tenant owns the name (for admin pulls)
//! ```
//!
//! A tenant's token reads `functions/<its tenant>/…` only, so it can pull nothing of another
//! tenant's (the answer is the same 404 as for a function nowhere). The name file exists
//! because function names are node-wide, so cluster-wide: the admin token (and the Unix
//! socket) pull by name alone.
//!
//! # The local chunk store as a cache
//!
//! A push stores the snapshot's files in the chunk store (so a later push or pull of a function
//! on the same base moves only what differs), and a pull commits what it fetched there. The
//! records of snapshots the registry still names are kept; the others (an older deploy's, a
//! removed function's) are only a cache of chunks. After each push and pull, while the store's
//! chunks take more than `cache_bytes`, the least recently written of those records is released
//! and the chunks nothing references any more are deleted (the store's GC).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bucket::{Fetched, PullError, Pulled, Pushed};
use crate::registry::Function;
use crate::tenant::Scope;

/// The daemon's side: push after a deploy, pull on demand, the retry loop.
impl crate::runtime::Runtime {
    /// The most free device memory of this node's GPUs, from NVML (`None`: no NVML, no GPU).
    pub fn gpu_free_bytes(&self) -> Option<u64> {
        let nvml = self
            .nvml
            .get_or_init(|| torpor_cuda::Nvml::load().ok())
            .as_ref()?;
        nvml.gpus().ok()?.iter().map(|g| g.free_memory).max()
    }

    /// The snapshot ids the registry names (kept in the chunk store whatever `cache_bytes`).
    fn registered_snapshots(&self) -> BTreeSet<String> {
        self.registry
            .with(|s| s.snapshots())
            .map(|v| v.into_iter().map(|s| s.id).collect())
            .unwrap_or_default()
    }

    /// Pushes function `name`'s current deploy; on failure it is retried later. Returns the
    /// deploy answer's `pushed` value: the report, or the error line.
    pub async fn push_function(self: &Arc<Self>, name: &str) -> Result<Pushed, String> {
        let Some(tier) = self.objstore.clone() else {
            return Err("no [objstore] in torpord.toml: nothing to push to".into());
        };
        let rt = Arc::clone(self);
        let n = name.to_owned();
        let t2 = Arc::clone(&tier);
        let done = tokio::task::spawn_blocking(move || {
            let tier = t2;
            let f = rt
                .registry
                .with(|s| s.function(&n))
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("no function named {n:?}"))?;
            let id = f
                .snapshot
                .clone()
                .ok_or_else(|| format!("function {n:?} has no snapshot"))?;
            let snap = rt
                .registry
                .with(|s| s.snapshot(&id))
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("snapshot {id} is not in the registry"))?;
            let store = rt
                .split
                .store_for(crate::tenant::of_spec(&f.spec))
                .map_err(|e| e.to_string())?;
            let pushed = tier
                .push(&store, &rt.snapshot_key, &f, &snap.path, &rt.state_root)
                .map_err(|e| e.to_string())?;
            if let Err(e) = tier.trim(&store, &rt.registered_snapshots()) {
                tracing::warn!(error = %e, "cannot trim the chunk store to objstore.cache_bytes");
            }
            Ok::<_, String>(pushed)
        })
        .await
        .map_err(|e| format!("the push task failed: {e}"))
        .and_then(|r| r);
        match &done {
            Ok(p) => {
                tier.done(name);
                tracing::info!(function = %name, snapshot = %p.snapshot, uploaded_chunks = p.uploaded_chunks, uploaded_bytes = p.uploaded_bytes, profile_bytes = p.profile_bytes, seconds = p.seconds, "pushed to the object store");
            }
            Err(e) => {
                tier.failed(name, e);
                tracing::warn!(function = %name, error = %e, "push to the object store failed: the deploy stands; it is tried again later (or POST /v1/functions/{{name}}/push)");
            }
        }
        done
    }

    /// Pulls function `name` from the bucket and registers it as if it were deployed here;
    /// a function this node knows already is not pulled (`pulled_bytes` 0). `scope` limits
    /// the records read to the caller's tenant.
    pub async fn pull_function(
        self: &Arc<Self>,
        scope: &Scope,
        name: &str,
    ) -> Result<Pulled, PullError> {
        let t = Instant::now();
        let Some(tier) = self.objstore.clone() else {
            return Err(PullError::NotInBucket {
                name: name.to_owned(),
                bucket: "(none: torpord.toml has no [objstore])".into(),
                tenant: String::new(),
            });
        };
        // One at a time per function, as deploys are: a deploy, a pull and an invoke's pull of
        // one name never interleave.
        let _lock = self.deploy_locks.function(name).await;
        let known = |rt: &Arc<Self>, n: &str| -> Option<Function> {
            rt.registry.with(|s| s.function(n)).ok().flatten()
        };
        if let Some(f) = known(self, name) {
            if scope.sees_spec(&f.spec) {
                return Ok(Pulled {
                    function: name.to_owned(),
                    pulled_bytes: 0,
                    pulled_chunks: 0,
                    profile_bytes: 0,
                    seconds: t.elapsed().as_secs_f64(),
                    phases: None,
                });
            }
            // Another tenant's function holds the name here: as if the bucket had none.
            return Err(PullError::NotInBucket {
                name: name.to_owned(),
                bucket: tier.config.bucket.clone(),
                tenant: String::new(),
            });
        }
        let rt = Arc::clone(self);
        let (scope2, n) = (scope.clone(), name.to_owned());
        let tier2 = Arc::clone(&tier);
        let fetched = tokio::task::spawn_blocking(move || {
            let tier = tier2;
            let stores = |tenant: &str| {
                rt.split
                    .store_for(tenant)
                    .map_err(|e| PullError::StoreOpen(e.to_string()))
            };
            let snapshots = rt.snapshots_dir();
            let dirs = (snapshots.as_path(), rt.state_root.as_path());
            let fetched = tier.fetch(
                &stores,
                &rt.snapshot_key,
                &scope2,
                &n,
                dirs,
                Some(&rt.split),
            )?;
            let store = stores(&fetched.record.tenant)?;
            Ok::<_, PullError>((fetched, store))
        })
        .await
        .map_err(|e| PullError::StoreOpen(format!("the pull task failed: {e}")))??;
        let (mut fetched, store) = fetched;
        let pending = fetched.pending.take();
        let registering = Instant::now();
        let registered = self.register_pulled(&fetched).await;
        // Off the first start's path: the chunk files held in memory written into the store,
        // the records' syncfs, then the store trimmed to objstore.cache_bytes (its GC waits
        // for the writes: the pull's lock). The directory is verified and the held chunks
        // are read from memory meanwhile; the bucket keeps the durable copy, and a daemon
        // killed before this ends settles the records at its next start (settle_pulls).
        let rt = Arc::clone(self);
        let snapshot = fetched.record.snapshot.clone();
        tokio::spawn(async move {
            crate::journal::delay("pull-commit").await;
            let t = Instant::now();
            let ids = pending.as_ref().map(|p| p.ids().join(", "));
            let held = pending.as_ref().map_or(0, |p| p.held_chunks());
            let mut keep = rt.registered_snapshots();
            keep.insert(snapshot);
            let done = tokio::task::spawn_blocking(move || {
                crate::bucket::finish_pending(pending);
                let durable = t.elapsed().as_secs_f64();
                if let Err(e) = tier.trim(&store, &keep) {
                    tracing::warn!(error = %e, "cannot trim the chunk store to objstore.cache_bytes");
                }
                durable
            })
            .await;
            if let (Ok(seconds), Some(ids)) = (done, ids) {
                tracing::info!(snapshots = %ids, held_chunks = held, seconds, "a pull's records are durable");
            }
        });
        registered.map_err(|e| {
            crate::runtime::remove_snapshot_dir(&fetched.snapshot_dir);
            PullError::StoreOpen(e)
        })?;
        let mut phases = fetched.phases;
        phases.register_s += registering.elapsed().as_secs_f64();
        let pulled = Pulled {
            function: name.to_owned(),
            pulled_bytes: fetched.pulled_bytes,
            pulled_chunks: fetched.pulled_chunks,
            profile_bytes: fetched.profile_bytes,
            seconds: t.elapsed().as_secs_f64(),
            phases: Some(phases),
        };
        let theirs = &fetched.record.state_dir;
        if !theirs.as_os_str().is_empty() && *theirs != self.state_root {
            // Restores bind this node's state directory where the worker had the other's
            // (torpor_snapshot::mounts::STATE_DIR_KEY); a snapshot taken before that key
            // existed still reconnects by the old path and boots instead.
            tracing::info!(function = %name, theirs = %theirs.display(), ours = %self.state_root.display(), "the function was snapshotted by a torpord with another state_dir: restores bind this one in its place");
        }
        tracing::info!(function = %name, snapshot = %fetched.record.snapshot, pulled_bytes = pulled.pulled_bytes, pulled_chunks = pulled.pulled_chunks, profile_bytes = pulled.profile_bytes, seconds = pulled.seconds, "pulled from the object store");
        Ok(pulled)
    }

    /// Records a pulled function as ready on its snapshot, stages the snapshot and starts its
    /// standbys, as a deploy's end does.
    async fn register_pulled(self: &Arc<Self>, f: &Fetched) -> Result<(), String> {
        let r = &f.record;
        let now = crate::registry::now_ms();
        let function = Function {
            name: r.name.clone(),
            dir: r.dir.clone(),
            spec: r.spec.clone(),
            base_key: r.base_key.clone(),
            snapshot: Some(r.snapshot.clone()),
            state: crate::registry::FunctionState::Ready,
            created: now,
            updated: now,
        };
        let snapshot = crate::registry::Snapshot {
            id: r.snapshot.clone(),
            kind: crate::registry::SnapshotKind::Function,
            bytes: crate::runtime::process::dir_bytes(&f.snapshot_dir),
            path: f.snapshot_dir.clone(),
            function: Some(r.name.clone()),
            base_key: Some(r.base_key.clone()),
            created: now,
        };
        let registry = Arc::clone(&self.registry);
        tokio::task::spawn_blocking(move || {
            registry.transaction(|s| {
                // The row and its snapshot point at each other: the function first, without.
                s.insert_function(&Function {
                    snapshot: None,
                    ..function.clone()
                })?;
                s.insert_snapshot(&snapshot)?;
                s.update_function(&function)?;
                Ok::<_, crate::registry::RegistryError>(())
            })
        })
        .await
        .map_err(|e| format!("the registry task failed: {e}"))?
        .map_err(|e| e.to_string())?;
        if self.staging.dir().is_some() {
            // In the background, not before the pull answers as a deploy does: the copy took
            // 0.8-0.9 s of GPT-2-Large's pull on the H100 (session 20, docs/cluster.md), while
            // a restore that comes first reads the disk copy the pull has just written (in
            // the page cache); restores take only a ready staged copy.
            let (staging, dir) = (Arc::clone(&self.staging), f.snapshot_dir.clone());
            let function = r.name.clone();
            tokio::spawn(async move {
                match tokio::task::spawn_blocking(move || staging.stage(&dir)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(function = %function, error = %e, "staging the pulled snapshot failed: its restores read the disk copy")
                    }
                    Err(e) => {
                        tracing::error!(function = %function, error = %e, "staging task failed")
                    }
                }
            });
        }
        self.deployed(&r.name, &r.spec, &r.snapshot, &f.snapshot_dir);
        self.forget_sandbox_routes();
        self.keep_standbys(&r.name, &r.spec).await;
        Ok(())
    }

    /// At start, before the API serves: the records of pulls whose syncfs never ran (the
    /// daemon died after the pull answered) are settled from their chunks
    /// ([`torpor_image::store::ChunkStore::settle`]). One that is released takes its function
    /// with it (registry rows, snapshot directory), so that the next invoke pulls it again
    /// instead of restoring from a snapshot that did not reach the disk whole. Blocking.
    pub fn settle_pulls(&self) {
        let functions = self.registry.with(|s| s.functions()).unwrap_or_default();
        let mut tenants: BTreeSet<String> = functions
            .iter()
            .map(|f| crate::tenant::of_spec(&f.spec).to_string())
            .collect();
        tenants.insert(crate::tenant::DEFAULT_TENANT.to_string());
        for tenant in tenants {
            let Ok(store) = self.split.store_for(&tenant) else {
                continue;
            };
            let ids = match store.pending() {
                Ok(ids) => ids,
                Err(e) => {
                    tracing::warn!(store = %store.root().display(), error = %e, "cannot list the pulls left pending");
                    continue;
                }
            };
            for id in ids {
                // The function on that snapshot (its files' record or its segments').
                let snapshot = id.strip_suffix(".files").unwrap_or(&id);
                let owner = functions
                    .iter()
                    .find(|f| f.snapshot.as_deref() == Some(snapshot));
                let why = match store.settle(&id) {
                    Ok(torpor_image::store::Settled::Committed) => {
                        // The directory was written from these chunks without a syncfs too:
                        // hashed against its manifest before it is restored from again.
                        let dir = owner.and_then(|_| {
                            self.registry.with(|s| s.snapshot(snapshot)).ok().flatten()
                        });
                        let checked = match dir {
                            Some(d) if id.ends_with(".files") => {
                                torpor_image::Snapshot::open(&d.path)
                                    .and_then(|s| s.verify())
                                    .map(|_| ())
                            }
                            _ => Ok(()),
                        };
                        match checked {
                            Ok(()) => {
                                tracing::info!(snapshot = %id, "a pull left pending by a dead daemon: every chunk is whole, its record stands");
                                continue;
                            }
                            Err(e) => format!("its snapshot directory does not verify: {e}"),
                        }
                    }
                    Ok(torpor_image::store::Settled::Released(why)) => why,
                    Err(e) => e.to_string(),
                };
                tracing::warn!(snapshot = %id, function = owner.map(|f| f.name.as_str()), reason = %why, "a pull left pending by a dead daemon did not reach the disk whole: released, its function is pulled again on its next invoke");
                let Some(f) = owner else { continue };
                match self.registry.with(|s| s.delete_function(&f.name)) {
                    Ok(snapshots) => {
                        for s in snapshots.unwrap_or_default() {
                            self.staging.remove(&s.path);
                            crate::runtime::remove_snapshot_dir(&s.path);
                        }
                    }
                    Err(e) => {
                        tracing::error!(function = %f.name, error = %e, "cannot remove a function whose pull did not reach the disk: delete it and pull it again")
                    }
                }
            }
        }
    }

    /// At start, and then every few seconds: the pushes that failed are tried again when due.
    /// At start every ready function whose record in the bucket does not name its current
    /// snapshot is pushed (a deploy whose push failed before a restart).
    pub fn spawn_push_retries(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        let tier = self.objstore.clone()?;
        let rt = Arc::clone(self);
        Some(tokio::spawn(async move {
            let (rt2, t2) = (Arc::clone(&rt), Arc::clone(&tier));
            let stale = tokio::task::spawn_blocking(move || {
                let functions = rt2.registry.with(|s| s.functions()).unwrap_or_default();
                functions
                    .into_iter()
                    .filter(|f| f.state == crate::registry::FunctionState::Ready)
                    .filter(|f| {
                        let scope = Scope::Tenant(crate::tenant::of_spec(&f.spec).to_string());
                        !matches!(t2.record(&scope, &f.name), Ok(r) if Some(&r.snapshot) == f.snapshot.as_ref())
                    })
                    .map(|f| f.name)
                    .collect::<Vec<_>>()
            })
            .await
            .unwrap_or_default();
            for name in stale {
                let _ = rt.push_function(&name).await;
            }
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                for name in tier.due() {
                    let exists = rt.registry.with(|s| s.function(&name)).ok().flatten();
                    match exists {
                        Some(f) if f.state == crate::registry::FunctionState::Ready => {
                            let _ = rt.push_function(&name).await;
                        }
                        _ => tier.done(&name),
                    }
                }
            }
        }))
    }
}
