//! Live migration of a torpord instance between the GPUs of this node (issue 10 item 3;
//! docs/migration.md): `POST /v1/instances/ID/migrate {"gpu": N}`, `torpor migrate --instance
//! ID --gpu N`.
//!
//! 1. **Checks**, nothing touched: the instance is live, warm, a split worker (it maps segments
//!    the daemon holds), not migrating; the target exists, is not its GPU, is the same model, has
//!    room. Each refusal is one line (4xx).
//! 2. **Pre-copy while it serves** (crate::split::migrate): every segment is copied to new
//!    memory on the target; writable ones are hashed per 2 MiB block.
//! 3. **The stop**: the instance is taken out of routing once its in-flight requests are done
//!    (`Doing::Migrate`; a request that arrives meanwhile waits in the queue, as for any busy
//!    instance). The worker unmaps its segments (`unmap`: it synchronises CUDA first, so nothing
//!    writes them any more); the blocks that changed since the pre-copy are copied; a CUDA
//!    instance's residue (its context and small allocations) is moved by the driver: lock,
//!    checkpoint, restore onto the target with the GPU pairs, unlock; the new segments are handed
//!    over with `map` frames at the same addresses; the instance is routable again, with the same
//!    id, pid and state, now on the target.
//! 4. **Failures** (each step can be forced with `TORPORD_FAULT=migrate:<step>`, crate::journal):
//!    before the residue moved, the old segments (never written, still held) are mapped back;
//!    after, the residue is moved back first. The instance then serves on, on its old GPU, and
//!    the error names the step. Only a worker that stops answering, or a rollback that fails too,
//!    removes the instance (the next request starts another), which the error says.
//! 5. **A daemon that dies in the stop**: the stop's steps are journaled (crate::journal,
//!    `migration_step`). Its worker may have released its segments, whose memory died with the
//!    daemon, so the next daemon removes the instance instead of re-adopting it
//!    (crate::recovery); one that dies in the pre-copy leaves the worker as it was, re-adopted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use torpor_cuda::GpuUuid;

use crate::journal::migration_step as step;
use crate::journal::Journal;
use crate::protocol::{ToWorker, Unmap};
use crate::registry::JournalOp;
use crate::runtime::keepalive::ForwardedReplies;
use crate::runtime::lifecycle::{Doing, State, Transition};
use crate::runtime::process::{CUDA_LOCK_TIMEOUT, QUIET_TIMEOUT};
use crate::runtime::{lock, Instance, Pool, Runtime};
use crate::split::migrate::Moving;
use crate::split::precopy::Delta;
use crate::split::release::InstanceSegments;
use crate::workers;

/// The state directory's folder of placed and migrated instances' placements (`<id>.json`),
/// so that a restarted daemon re-adopts them, and a wake restores them, where they are.
pub const PLACEMENT_DIR: &str = "placement";

/// A migrated instance's placement as kept on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub gpu: u32,
    /// The worker's CUDA ordinal → the daemon's, where they differ (`Instance::gpu_map`).
    pub gpu_map: Vec<(i32, i32)>,
    /// A released standby's pairs not yet passed to the driver (`Instance::owed_gpu_pairs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owed_gpu_pairs: Vec<(torpor_cuda::GpuUuid, torpor_cuda::GpuUuid)>,
}

/// How long a migration waits for the instance's in-flight requests before it gives up.
pub const BUSY_WAIT: Duration = Duration::from_secs(30);

/// The body of `POST /v1/instances/{id}/migrate`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// The target GPU: the daemon's CUDA ordinal (a host-backend device for a CPU function).
    pub gpu: u32,
}

/// What a migration did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Migrated {
    pub instance: String,
    pub function: String,
    pub from: u32,
    pub to: u32,
    /// The device's model ("host" for the host backend).
    pub model: String,
    pub segments: usize,
    /// Bytes of segments moved.
    pub bytes: u64,
    /// Of them, bytes the pre-copy moved device to device over the GPUs' peer path (read-only
    /// segments, where the two GPUs reach each other); the rest went through host memory.
    #[serde(default)]
    pub peer_bytes: u64,
    /// Seconds of the pre-copy (the instance served meanwhile).
    pub precopy_s: f64,
    /// Seconds the instance took no request: from its last request's end to routable again.
    pub stop_s: f64,
    /// Seconds from the request to the end.
    pub total_s: f64,
    /// Blocks (2 MiB) of writable segments that changed during the pre-copy, copied in the stop.
    pub changed_blocks: u64,
    pub changed_bytes: u64,
    /// Whether the driver moved a CUDA residue (a GPU function).
    pub residue_moved: bool,
    /// What NVML showed the worker holding on its GPU once its segments were unmapped: the
    /// residue the driver's checkpoint moved, what its two steps' time grows with (`None`: no
    /// residue, or NVML does not list the worker).
    #[serde(default)]
    pub residue_bytes: Option<u64>,
    /// Where the stop's time went.
    pub stop_phases: StopPhases,
}

/// The steps of a migration's stop, in seconds (the rest of `stop_s` is the wait for the
/// requests in flight and the routing).
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StopPhases {
    /// The worker's `unmap`: its GPU work synced, its context shrunk, the segments released.
    pub unmap_s: f64,
    /// The blocks that changed during the pre-copy, copied.
    pub copy_s: f64,
    /// The driver's lock and checkpoint of the CUDA residue (0 for a CPU function).
    pub residue_checkpoint_s: f64,
    /// The driver's restore of the residue onto the new GPU, and its unlock.
    pub residue_restore_s: f64,
    /// The new segments mapped at their old addresses.
    pub map_s: f64,
    /// Not seconds, and not in this object's JSON: carried to [`Migrated::residue_bytes`].
    #[serde(skip)]
    pub residue_bytes: Option<u64>,
}

/// Why an instance was not migrated. Every variant but [`MigrateError::Lost`] leaves it serving
/// where it was.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(
        "no live instance {id} on this node: GET /v1/functions/NAME lists a function's instances"
    )]
    NoInstance { id: String },
    #[error("instance {id} is not a split worker (it maps no segments from the daemon): only split instances migrate live; a process started by `torpor run` moves with `torpor migrate --pid`")]
    NotSplit { id: String },
    #[error("instance {id} is {state}: only a warm instance migrates (a request brings a gpu_released one back to warm)")]
    NotWarm { id: String, state: String },
    #[error("instance {id} is being migrated already: wait for that migration's answer")]
    Migrating { id: String },
    #[error("instance {id} still had a request in flight after {secs} s: migrate it when its requests are shorter")]
    Busy { id: String, secs: u64 },
    #[error("GPU {gpu} does not exist on this node ({list}): name one of those")]
    NoSuchGpu { gpu: u32, list: String },
    #[error("instance {id} is on GPU {gpu} already: name another GPU")]
    SameGpu { id: String, gpu: u32 },
    #[error("instance {id} is on a {from}, but GPU {gpu} is a {to}: the driver restores only onto the same model; choose a GPU of the same model")]
    GpuModel {
        id: String,
        from: String,
        gpu: u32,
        to: String,
    },
    #[error("GPU {gpu} has {free} MiB free but instance {id} needs {need} MiB: free memory on it or choose another GPU")]
    NoRoom {
        id: String,
        gpu: u32,
        free: u64,
        need: u64,
    },
    #[error("migrating instance {id} to GPU {to} failed at {step}: {message}; it serves on, on GPU {from}")]
    Failed {
        id: String,
        step: &'static str,
        message: String,
        from: u32,
        to: u32,
    },
    #[error("migrating instance {id} failed at {step}: {message}; the instance was removed (the next request starts another)")]
    Lost {
        id: String,
        step: &'static str,
        message: String,
    },
}

impl MigrateError {
    /// The HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        match self {
            MigrateError::NoInstance { .. } => StatusCode::NOT_FOUND,
            MigrateError::NoSuchGpu { .. } => StatusCode::BAD_REQUEST,
            MigrateError::NotSplit { .. }
            | MigrateError::NotWarm { .. }
            | MigrateError::Migrating { .. }
            | MigrateError::Busy { .. }
            | MigrateError::SameGpu { .. }
            | MigrateError::GpuModel { .. }
            | MigrateError::NoRoom { .. } => StatusCode::CONFLICT,
            MigrateError::Failed { .. } | MigrateError::Lost { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }
}

/// A device of this node an instance can be on.
#[derive(Debug, Clone)]
struct NodeDevice {
    ordinal: u32,
    name: String,
    uuid: Option<GpuUuid>,
    /// Bytes free on it, where known (NVML; the host backend's bound).
    free: Option<u64>,
}

/// Clears the instance's `migrating` flag when the migration ends, however it ends.
struct MigratingFlag<'a>(&'a Instance);

impl Drop for MigratingFlag<'_> {
    fn drop(&mut self) {
        self.0.draining.store(false, Ordering::SeqCst);
        self.0.migrating.store(false, Ordering::SeqCst);
    }
}

/// What the stop has to undo when a step fails.
enum Undo {
    /// Nothing changed.
    Nothing,
    /// The worker unmapped its segments: map the old ones back.
    Segments,
    /// ... and the driver moved the residue: move it back, then the segments.
    Residue,
}

impl Runtime {
    /// The live instance `id` and its pool.
    fn find_instance(&self, id: &str) -> Option<(Arc<Pool>, Arc<Instance>)> {
        let pools: Vec<Arc<Pool>> = lock(&self.pools).values().cloned().collect();
        pools.into_iter().find_map(|p| {
            let inst = lock(&p.state)
                .instances
                .iter()
                .find(|(i, _)| i.id == id && !i.is_dead())
                .map(|(i, _)| Arc::clone(i));
            inst.map(|i| (p, i))
        })
    }

    fn placement_path(&self, id: &str) -> Option<std::path::PathBuf> {
        // Ids are the daemon's own (`fn-…-N`); anything else never names a file.
        let safe = !id.is_empty()
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            && !id.starts_with('.');
        safe.then(|| {
            self.config
                .state_dir
                .join(PLACEMENT_DIR)
                .join(format!("{id}.json"))
        })
    }

    /// [`Runtime::save_placement`] on a blocking thread, waited for.
    pub(crate) async fn record_placement(self: &Arc<Self>, inst: &Arc<Instance>) {
        let (rt, inst) = (Arc::clone(self), Arc::clone(inst));
        let _ = tokio::task::spawn_blocking(move || rt.save_placement(&inst)).await;
    }

    /// Writes a placed or migrated instance's placement (best effort: logged; a restart would
    /// then re-adopt it as on GPU 0).
    pub(crate) fn save_placement(&self, inst: &Instance) {
        let Some(path) = self.placement_path(&inst.id) else {
            return;
        };
        let mut gpu_map: Vec<(i32, i32)> =
            lock(&inst.gpu_map).iter().map(|(w, d)| (*w, *d)).collect();
        gpu_map.sort_unstable();
        let placement = Placement {
            gpu: inst.gpu.load(Ordering::SeqCst),
            gpu_map,
            owed_gpu_pairs: lock(&inst.owed_gpu_pairs).clone(),
        };
        let written = (|| -> std::io::Result<()> {
            let dir = path.parent().ok_or(std::io::ErrorKind::NotFound)?;
            std::fs::create_dir_all(dir)?;
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, serde_json::to_vec(&placement)?)?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            tracing::warn!(instance = %inst.id, path = %path.display(), error = %e, "cannot record the migrated instance's placement; a restarted daemon will take it for GPU 0's");
        }
    }

    /// The placement recorded for instance `id` (a placed cold start's, a migration's), if any.
    /// A hibernated instance keeps its id and its file, so its wake finds it here too.
    pub(crate) fn placement_of(&self, id: &str) -> Option<Placement> {
        let path = self.placement_path(id)?;
        let bytes = std::fs::read(&path).ok()?;
        match serde_json::from_slice::<Placement>(&bytes) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(instance = id, path = %path.display(), error = %e, "an unreadable placement file; the instance is taken for GPU 0's");
                None
            }
        }
    }

    /// The device instance `id` is on: a live one's, else one in flight's (listed from its
    /// adoption, in no pool until its start ends), else (hibernated) the one its placement
    /// file names, else the deploy's (0).
    pub fn device_of(&self, id: &str) -> u32 {
        match self.find_instance(id) {
            Some((_, inst)) => inst.gpu.load(Ordering::SeqCst),
            None => self
                .placing
                .device_of(id)
                .or_else(|| self.placement_of(id).map(|p| p.gpu))
                .unwrap_or(0),
        }
    }

    /// Applies a recorded placement to an instance re-adopted or woken under its id.
    pub(crate) fn apply_placement(inst: &Instance, p: &Placement) {
        inst.gpu.store(p.gpu, Ordering::SeqCst);
        *lock(&inst.gpu_map) = p.gpu_map.iter().copied().collect();
        lock(&inst.owed_gpu_pairs).clone_from(&p.owed_gpu_pairs);
    }

    /// Applies the placement recorded for a re-adopted instance.
    pub(crate) fn load_placement(&self, inst: &Instance) {
        if let Some(p) = self.placement_of(&inst.id) {
            Self::apply_placement(inst, &p);
        }
    }

    /// At startup, before the re-adoption: removes the placement files of instances that are
    /// neither among `live` (the ids of the rows being re-adopted) nor hibernated (a wake keeps
    /// the id and restores where the hibernation was taken), such as one the journal's replay
    /// removed in a migration's stop (crate::recovery), so that none outlives its instance.
    pub(crate) fn sweep_placements(&self, live: &[&str]) {
        let dir = self.config.state_dir.join(PLACEMENT_DIR);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let sleeping: Vec<String> = match self.registry.with(|s| s.instances()) {
            Ok(rows) => rows
                .into_iter()
                .filter(|r| !r.stage.has_process())
                .map(|r| r.id)
                .collect(),
            Err(e) => {
                // Kept rather than lose a sleeper's: a file too many costs nothing.
                tracing::warn!(error = %e, "cannot list the hibernated instances; the placement files are kept");
                return;
            }
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name.strip_suffix(".json").unwrap_or(&name);
            if !live.contains(&id) && !sleeping.iter().any(|s| s == id) {
                let _ = std::fs::remove_file(e.path());
                tracing::info!(
                    instance = id,
                    "removed the placement file of an instance that is gone"
                );
            }
        }
    }

    /// Forgets the placement of an instance that is gone.
    pub(crate) fn forget_placement(&self, id: &str) {
        if let Some(path) = self.placement_path(id) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// The function of live instance `id`.
    pub fn instance_function(&self, id: &str) -> Option<String> {
        self.find_instance(id).map(|(_, i)| i.function.clone())
    }

    /// The devices an instance of a function can be on: the GPUs the driver sees for a GPU
    /// function (where it loads), else the host backend's devices.
    fn node_devices(&self, gpu: bool) -> Vec<NodeDevice> {
        if gpu {
            if let Ok(Ok(devices)) = self.cuda().map(|d| d.devices()) {
                let nvml = self
                    .nvml
                    .get_or_init(|| torpor_cuda::Nvml::load().ok())
                    .as_ref()
                    .and_then(|n| n.gpus().ok())
                    .unwrap_or_default();
                return devices
                    .into_iter()
                    .filter_map(|d| {
                        Some(NodeDevice {
                            ordinal: u32::try_from(d.ordinal).ok()?,
                            free: nvml
                                .iter()
                                .find(|g| g.uuid == d.uuid)
                                .map(|g| g.free_memory),
                            name: d.name,
                            uuid: Some(d.uuid),
                        })
                    })
                    .collect();
            }
        }
        let r = &self.config.restore_server;
        (0..r.host_devices)
            .map(|ordinal| NodeDevice {
                ordinal,
                name: "host".to_string(),
                uuid: None,
                free: (r.host_device_bytes > 0).then(|| {
                    r.host_device_bytes
                        .saturating_sub(self.device_bytes(ordinal))
                }),
            })
            .collect()
    }

    /// Bytes of segments the live instances on device `ordinal` map.
    fn device_bytes(&self, ordinal: u32) -> u64 {
        let pools: Vec<Arc<Pool>> = lock(&self.pools).values().cloned().collect();
        pools
            .iter()
            .map(|p| {
                lock(&p.state)
                    .instances
                    .iter()
                    .filter(|(i, _)| !i.is_dead() && i.gpu.load(Ordering::SeqCst) == ordinal)
                    .map(|(i, _)| lock(&i.segments).bytes())
                    .sum::<u64>()
            })
            .sum()
    }

    /// Sets `torpor_device_instances{device}` and `torpor_device_segment_bytes{device}`.
    pub(crate) fn update_placement_gauges(&self) {
        let pools: Vec<Arc<Pool>> = lock(&self.pools).values().cloned().collect();
        let mut per: std::collections::BTreeMap<u32, (i64, u64)> = Default::default();
        for p in &pools {
            for (i, _) in lock(&p.state)
                .instances
                .iter()
                .filter(|(i, _)| !i.is_dead())
            {
                let e = per.entry(i.gpu.load(Ordering::SeqCst)).or_default();
                e.0 += 1;
                e.1 += lock(&i.segments).bytes();
            }
        }
        let seen = self.metrics.devices_seen(per.keys().copied());
        for d in seen {
            let (n, bytes) = per.get(&d).copied().unwrap_or_default();
            let label = d.to_string();
            self.metrics
                .device_instances
                .with_label_values(&[&label])
                .set(n);
            self.metrics
                .device_segment_bytes
                .with_label_values(&[&label])
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// Moves instance `id` to GPU `gpu` of this node, live; see the module doc.
    pub async fn migrate_instance(
        self: &Arc<Self>,
        id: &str,
        gpu: u32,
    ) -> Result<Migrated, MigrateError> {
        let t0 = Instant::now();
        let Some((pool, inst)) = self.find_instance(id) else {
            return Err(MigrateError::NoInstance { id: id.to_string() });
        };
        let id = inst.id.clone();
        if inst.migrating.swap(true, Ordering::SeqCst) {
            return Err(MigrateError::Migrating { id });
        }
        let _flag = MigratingFlag(&inst);
        let state = inst.state();
        if state != State::Warm {
            return Err(MigrateError::NotWarm {
                id,
                state: state.to_string(),
            });
        }
        let Some((plan, leases)) = lock(&inst.segments).leases().filter(|(p, _)| !p.is_empty())
        else {
            return Err(MigrateError::NotSplit { id });
        };
        let gpu_fn = lock(&pool.state).info.gpu;
        let rt = Arc::clone(self);
        let devices = tokio::task::spawn_blocking(move || rt.node_devices(gpu_fn))
            .await
            .unwrap_or_default();
        let from = inst.gpu.load(Ordering::SeqCst);
        let Some(target) = devices.iter().find(|d| d.ordinal == gpu).cloned() else {
            return Err(MigrateError::NoSuchGpu {
                gpu,
                list: match devices.len() {
                    0 => "none".to_string(),
                    n => format!(
                        "{n} device(s): {}",
                        devices
                            .iter()
                            .map(|d| format!("{} ({})", d.ordinal, d.name))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                },
            });
        };
        if gpu == from {
            return Err(MigrateError::SameGpu { id, gpu });
        }
        let source = devices.iter().find(|d| d.ordinal == from).cloned();
        if let Some(s) = &source {
            if s.name != target.name {
                return Err(MigrateError::GpuModel {
                    id,
                    from: s.name.clone(),
                    gpu,
                    to: target.name.clone(),
                });
            }
        }
        // What it needs there: its segments, and on a GPU what its processes hold (NVML).
        let mut need: u64 = plan.iter().map(|(e, _)| e.size).sum();
        if gpu_fn && target.uuid.is_some() {
            need += self
                .gpu_memory_by_pid()
                .and_then(|m| m.get(&inst.worker_pid).copied())
                .unwrap_or(0);
        }
        if let Some(free) = target.free {
            if free < need {
                return Err(MigrateError::NoRoom {
                    id,
                    gpu,
                    free: free >> 20,
                    need: need.div_ceil(1 << 20),
                });
            }
        }
        let failed = |step: &'static str, message: String| MigrateError::Failed {
            id: inst.id.clone(),
            step,
            message,
            from,
            to: gpu,
        };

        // 2. Pre-copy, while it serves.
        let p0 = Instant::now();
        if crate::journal::fault("migrate:precopy") {
            return Err(failed("pre-copy", "forced by TORPORD_FAULT".to_string()));
        }
        let moving = {
            let (split, plan, leases) =
                (Arc::clone(&self.split), Arc::clone(&plan), leases.clone());
            let to = i32::try_from(gpu).unwrap_or(i32::MAX);
            let peer = self.config.restore_server.peer_copy;
            tokio::task::spawn_blocking(move || split.migrate_precopy(&plan, &leases, to, peer))
                .await
                .map_err(|e| failed("pre-copy", e.to_string()))?
                .map_err(|e| failed("pre-copy", e.to_string()))?
        };
        let precopy_s = p0.elapsed().as_secs_f64();
        let peer_bytes = moving.peer_bytes;
        tracing::info!(instance = %inst.id, function = %inst.function, from, to = gpu, bytes = moving.bytes, peer_bytes, precopy_s, "migration: segments pre-copied while the instance serves");
        // A test's window for writes after the pre-copy read the segments (the stop must catch them).
        crate::journal::delay("migrate-precopy").await;

        // 3. The stop.
        let stop = self.begin_stop(&pool, &inst).await?;
        crate::journal::delay("migrate-stop").await;
        // The driver takes a pair for every GPU the process sees (the worker sees the daemon's):
        // the two swap, the others stay. The same pairs move it back.
        let pairs = match (source.and_then(|s| s.uuid), target.uuid) {
            (Some(a), Some(b)) if gpu_fn => Some(
                devices
                    .iter()
                    .filter_map(|d| d.uuid)
                    .map(|u| {
                        if u == a {
                            (a, b)
                        } else if u == b {
                            (b, a)
                        } else {
                            (u, u)
                        }
                    })
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        };
        // Recorded before the worker unmaps anything: a daemon that dies in the stop leaves a
        // worker without its segments, which the next daemon must not take back (crate::recovery).
        let journal =
            Journal::begin(&self.registry, JournalOp::Migrate, &inst.id, step::UNMAP).await;
        let moved = self
            .migrate_stop(&inst, &plan, leases, moving, pairs, &journal)
            .await;
        journal.end().await;
        // Routable again, moved or not (a removed instance stays gone).
        let _ = self.step(&inst.function, &mut lock(&inst.keep), Transition::Abort);
        inst.draining.store(false, Ordering::SeqCst);
        pool.changed.notify_waiters();
        let stop_s = stop.elapsed().as_secs_f64();
        let (delta, residue_moved, stop_phases) = moved.map_err(|(step, message, lost)| {
            if lost {
                MigrateError::Lost {
                    id: inst.id.clone(),
                    step,
                    message,
                }
            } else {
                failed(step, message)
            }
        })?;
        inst.gpu.store(gpu, Ordering::SeqCst);
        if residue_moved {
            inst.swap_gpus(
                i32::try_from(from).unwrap_or(0),
                i32::try_from(gpu).unwrap_or(0),
            );
        }
        self.record_placement(&inst).await;
        self.update_placement_gauges();
        self.metrics
            .observe_phase(&inst.function, "migration_stop", stop_s);
        let out = Migrated {
            instance: inst.id.clone(),
            function: inst.function.clone(),
            from,
            to: gpu,
            model: target.name,
            segments: plan.len(),
            bytes: plan.iter().map(|(e, _)| e.size).sum(),
            peer_bytes,
            precopy_s,
            stop_s,
            total_s: t0.elapsed().as_secs_f64(),
            changed_blocks: delta.changed_blocks,
            changed_bytes: delta.changed_bytes,
            residue_moved,
            residue_bytes: stop_phases.residue_bytes,
            stop_phases,
        };
        tracing::info!(instance = %out.instance, function = %out.function, from, to = gpu, stop_s, precopy_s, changed_blocks = out.changed_blocks, residue_moved, residue_bytes = ?out.residue_bytes, phases = ?out.stop_phases, "instance migrated");
        Ok(out)
    }

    /// Takes the instance out of routing (new requests wait: `draining`), then, once no
    /// request of it is in flight, begins the stop (`Begin(Migrate)`); returns the stop's start
    /// (when routing to it ended).
    async fn begin_stop(
        &self,
        pool: &Arc<Pool>,
        inst: &Arc<Instance>,
    ) -> Result<Instant, MigrateError> {
        let began = Instant::now();
        inst.draining.store(true, Ordering::SeqCst);
        let result = self.drained(pool, inst).await;
        if result.is_err() {
            inst.draining.store(false, Ordering::SeqCst);
            pool.changed.notify_waiters();
        }
        result.map(|()| began)
    }

    /// Waits until no request of the instance is in flight and begins its stop.
    async fn drained(&self, pool: &Arc<Pool>, inst: &Arc<Instance>) -> Result<(), MigrateError> {
        let deadline = tokio::time::Instant::now() + BUSY_WAIT;
        loop {
            let notified = pool.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = lock(&pool.state);
                let Some(n) = st
                    .instances
                    .iter()
                    .find(|(i, _)| Arc::ptr_eq(i, inst))
                    .map(|(_, n)| *n)
                else {
                    return Err(MigrateError::NoInstance {
                        id: inst.id.clone(),
                    });
                };
                if n == 0 {
                    let mut k = lock(&inst.keep);
                    let from = k.state;
                    return match self.step(
                        &inst.function,
                        &mut k,
                        Transition::Begin(Doing::Migrate),
                    ) {
                        Ok(_) => Ok(()),
                        Err(_) => Err(MigrateError::NotWarm {
                            id: inst.id.clone(),
                            state: from.to_string(),
                        }),
                    };
                }
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(MigrateError::Busy {
                    id: inst.id.clone(),
                    secs: BUSY_WAIT.as_secs(),
                });
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            let _ = tokio::time::timeout(wait, notified).await;
        }
    }

    /// The stop's steps (see the module doc); on failure (the step, the message, whether the
    /// instance was lost) after undoing what was done.
    async fn migrate_stop(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        plan: &Arc<Vec<crate::split::index::Planned>>,
        old: crate::split::server::Leases,
        moving: Moving,
        pairs: Option<Vec<(GpuUuid, GpuUuid)>>,
        journal: &Journal,
    ) -> Result<(Delta, bool, StopPhases), (&'static str, String, bool)> {
        let mut undo = Undo::Nothing;
        let mut phases = StopPhases::default();
        let forced = |step: &'static str| (step, "forced by TORPORD_FAULT".to_string(), false);
        let result: Result<(Delta, bool, Moving), (&'static str, String, bool)> = async {
            if crate::journal::fault("migrate:unmap") {
                return Err(forced("unmap"));
            }
            let t = Instant::now();
            // The driver checkpoints the context below: the worker starts no CUDA work of its
            // own from here (keepalive.rs, `quiet_gpu`); a failure removed the instance.
            self.quiet_gpu(inst)
                .await
                .map_err(|e| ("unmap", e.to_string(), true))?;
            self.unmap_for_migration(inst, plan)
                .await
                .map_err(|(m, lost)| ("unmap", m, lost))?;
            phases.unmap_s = t.elapsed().as_secs_f64();
            undo = Undo::Segments;
            journal.step(step::COPY, None).await;
            if crate::journal::fault("migrate:copy") {
                return Err(forced("copy"));
            }
            let t = Instant::now();
            let (split, plan2, old2) = (Arc::clone(&self.split), Arc::clone(plan), old.clone());
            let mut moving = moving;
            let (delta, moving) = tokio::task::spawn_blocking(move || {
                let d = split.migrate_delta(&plan2, &old2, &mut moving);
                (d, moving)
            })
            .await
            .map_err(|e| ("copy", e.to_string(), false))?;
            let delta = delta.map_err(|e| ("copy", e.to_string(), false))?;
            phases.copy_s = t.elapsed().as_secs_f64();
            if crate::journal::fault("migrate:residue") {
                return Err(forced("residue"));
            }
            let residue_moved = match &pairs {
                Some(pairs) => {
                    phases.residue_bytes = self
                        .gpu_memory_by_pid()
                        .and_then(|by_pid| by_pid.get(&inst.worker_pid).copied());
                    journal.step(step::RESIDUE, None).await;
                    (phases.residue_checkpoint_s, phases.residue_restore_s) = self
                        .move_residue(inst.worker_pid, pairs.clone())
                        .await
                        .map_err(|e| ("residue", e, false))?;
                    undo = Undo::Residue;
                    true
                }
                None => false,
            };
            if crate::journal::fault("migrate:map") {
                return Err(forced("map"));
            }
            Ok((delta, residue_moved, moving))
        }
        .await;
        let (delta, residue_moved, moving) = match result {
            Ok(r) => r,
            Err((step, message, true)) => return Err((step, message, true)),
            Err((step, message, false)) => {
                // Undo, newest first; the old segments were never written.
                if matches!(undo, Undo::Residue) {
                    if let Some(pairs) = &pairs {
                        if let Err(e) = self.move_residue(inst.worker_pid, pairs.clone()).await {
                            let why = format!(
                                "{message}, and moving the CUDA state back failed too ({e})"
                            );
                            self.remove_instance(inst, &why, true);
                            return Err((step, why, true));
                        }
                    }
                }
                if !matches!(undo, Undo::Nothing) {
                    if let Err(e) = self.map_segments_back(inst, None).await {
                        // map_segments_back removed it.
                        return Err((
                            step,
                            format!(
                                "{message}, and mapping its old segments back failed too ({e})"
                            ),
                            true,
                        ));
                    }
                }
                return Err((step, message, false));
            }
        };
        // Hand the new memory over; the old goes with its last handle.
        *lock(&inst.segments) = InstanceSegments::held(Arc::clone(&moving.plan), moving.leases);
        drop(old);
        journal.step(step::MAP, None).await;
        let t = Instant::now();
        if let Err(e) = self.map_segments_back(inst, None).await {
            return Err(("map", e.to_string(), true));
        }
        phases.map_s = t.elapsed().as_secs_f64();
        Ok((delta, residue_moved, phases))
    }

    /// `unmap` of every segment the daemon handed over; the daemon keeps its handles (the old
    /// memory). On a refusal the segments the worker released are mapped back. The error says
    /// whether the instance was lost (no answer: removed).
    async fn unmap_for_migration(
        self: &Arc<Self>,
        inst: &Arc<Instance>,
        plan: &[crate::split::index::Planned],
    ) -> Result<(), (String, bool)> {
        let mut replies = ForwardedReplies::new(inst).map_err(|e| (e.to_string(), true))?;
        {
            let vas: Vec<u64> = plan.iter().map(|(e, _)| e.va).collect();
            let mut wr = inst.writer.lock().await;
            if let Err(e) = workers::send(&mut wr, &ToWorker::Unmap(Unmap { vas })).await {
                drop(wr);
                let m = format!("sending unmap: {e}");
                self.remove_instance(inst, &m, true);
                return Err((m, true));
            }
        }
        let answer = match tokio::time::timeout(QUIET_TIMEOUT, replies.rx.recv()).await {
            Ok(Some(m))
                if m.get("type").and_then(serde_json::Value::as_str) == Some("unmapped") =>
            {
                m
            }
            other => {
                let m = match other {
                    Ok(Some(m)) => format!(
                        "the worker answered unmap with {}",
                        serde_json::Value::Object(m)
                    ),
                    Ok(None) => inst.reason(),
                    Err(_) => format!("no answer to unmap within {} s", QUIET_TIMEOUT.as_secs()),
                };
                drop(replies);
                self.remove_instance(inst, &m, true);
                return Err((m, true));
            }
        };
        drop(replies);
        if let Some((message, released)) = crate::runtime::keepalive::unmap_refused(&answer) {
            if let Err(e) = self.map_segments_back(inst, Some(&released)).await {
                return Err((
                    format!("the worker refused unmap ({message}), and mapping back failed ({e})"),
                    true,
                ));
            }
            return Err((format!("the worker refused unmap: {message}"), false));
        }
        Ok(())
    }

    /// The driver moves a process's CUDA state by `pairs` (old UUID → new, one per GPU it sees):
    /// lock, checkpoint, restore with the pairs, unlock; a failure puts it back where it was.
    /// Returns the seconds of the lock and checkpoint, and of the restore and unlock.
    async fn move_residue(
        &self,
        pid: i32,
        pairs: Vec<(GpuUuid, GpuUuid)>,
    ) -> Result<(f64, f64), String> {
        let driver = self.cuda().map_err(|e| e.to_string())?;
        tokio::task::spawn_blocking(move || {
            let mut tasks = torpor_snapshot::gpu_tasks::GpuTasks::new(&driver, vec![pid]);
            let t = Instant::now();
            let mut checkpoint_s = 0.0;
            let moved = tasks
                .lock_all(CUDA_LOCK_TIMEOUT)
                .and_then(|()| tasks.checkpoint_all())
                .and_then(|()| {
                    checkpoint_s = t.elapsed().as_secs_f64();
                    tasks.restore_all(&pairs)
                })
                .and_then(|()| tasks.unlock_all())
                .map(|()| (checkpoint_s, t.elapsed().as_secs_f64() - checkpoint_s));
            moved.map_err(|e| match tasks.rollback() {
                Ok(()) => e.to_string(),
                Err(r) => format!("{e}, and putting it back failed ({r})"),
            })
        })
        .await
        .map_err(|e| e.to_string())?
    }
}
