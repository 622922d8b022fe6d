//! `torpor migrate --pid PID --gpu N`: moves a running process tree (started by `torpor run`)
//! from its GPU to another GPU of this node, without CRIU: the driver locks and checkpoints its
//! CUDA state into host memory in place, restores it onto the target with the driver's GPU pairs
//! (`cuCheckpointProcessRestore`), and unlocks. The process keeps its pid, its files and its
//! host memory; its device pointers stay valid (the driver maps the state at the same virtual
//! addresses on the new GPU). The stop lasts from the lock to the unlock.
//!
//! Refused, in one line and before the process is touched: a tree with no CUDA process, one
//! that uses more than one GPU, a target that does not exist, is the GPU it is on, is another
//! model (the driver restores only onto the same one) or lacks the free memory the process holds
//! (NVML). Any failure after the lock puts the state back onto the old GPU (`GpuTasks::rollback`)
//! so the process keeps running where it was.

use std::time::{Duration, Instant};

use torpor_cuda::GpuUuid;

use crate::gpu_map::GpuRef;
use crate::gpu_tasks::{GpuTasks, StepError};
use crate::phases::Phases;
use crate::preflight::{self, PreflightError};
use crate::proctree;
use crate::snapshot::{self, SnapshotError};

/// What to move where.
pub struct MigrateOptions {
    /// Root of the tree: the pid `torpor run` printed.
    pub pid: i32,
    /// The GPU to move to (this node's ordinal or UUID).
    pub target: GpuRef,
    /// How long to wait for in-flight CUDA work when locking.
    pub lock_timeout: Duration,
}

/// What a migration did.
#[derive(Debug)]
pub struct MigrateReport {
    pub from: GpuRef,
    pub to: GpuRef,
    /// The CUDA processes moved.
    pub pids: Vec<i32>,
    /// Bytes of GPU memory the processes held (NVML), when known.
    pub bytes: Option<u64>,
    /// Seconds from the lock to the unlock: how long the processes could not run CUDA work.
    pub stopped_s: f64,
    pub phases: Phases,
}

/// Why a migration did not happen. The process runs on, on its old GPU, in every case but
/// [`MigrateError::RollbackFailed`].
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    #[error(transparent)]
    Inspect(#[from] SnapshotError),
    #[error("pid {pid} has no CUDA process in its tree: nothing to move to another GPU")]
    NoCuda { pid: i32 },
    #[error("pid {pid} uses {count} GPUs ({list}): torpor migrate moves a process on one GPU; restart it on one, or snapshot and restore it with --gpu OLD=NEW for each")]
    ManyGpus {
        pid: i32,
        count: usize,
        list: String,
    },
    #[error("GPU {target} does not exist on this node: see nvidia-smi -L for its GPUs")]
    NoSuchGpu { target: GpuRef },
    #[error("pid {pid} is on GPU {target} already: name another GPU")]
    SameGpu { pid: i32, target: GpuRef },
    #[error("pid {pid} is on a {from}, but GPU {target} is a {to}: the driver restores only onto the same model; choose a GPU of the same model")]
    GpuModel {
        pid: i32,
        from: String,
        target: GpuRef,
        to: String,
    },
    #[error("GPU {target} has {free} MiB free but pid {pid} holds {need} MiB: free memory on it or choose another GPU")]
    NoRoom {
        pid: i32,
        target: GpuRef,
        free: u64,
        need: u64,
    },
    #[error("{source}; pid {pid} runs on, on its old GPU")]
    Moved { pid: i32, source: Box<StepError> },
    #[error("{source}, and putting it back failed too ({rollback}); pid {pid} may be stuck: kill it and restart it")]
    RollbackFailed {
        pid: i32,
        source: Box<StepError>,
        rollback: Box<StepError>,
    },
}

/// Moves the tree rooted at `opts.pid` onto `opts.target`; see the module doc.
pub fn migrate(opts: &MigrateOptions) -> Result<MigrateReport, MigrateError> {
    preflight::require_root("torpor migrate")?;
    let root = preflight::require_torpor_root(opts.pid)?;
    let pids = proctree::tree(root.pid);
    let tree = pids
        .iter()
        .map(|&p| {
            proctree::read_process(p).map_err(|source| SnapshotError::Proc { pid: p, source })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Some((driver, nvml, cuda_pids)) = snapshot::find_cuda(&tree)? else {
        return Err(MigrateError::NoCuda { pid: root.pid });
    };
    let section = snapshot::gpu_section(&driver, nvml.as_ref(), &cuda_pids)?;
    // The GPU it is on: the one NVML sees its memory on, or the only one it can see.
    let used: Vec<_> = section
        .gpus
        .iter()
        .filter(|g| g.used_by_snapshot.is_some_and(|b| b > 0))
        .collect();
    let from = match (used.as_slice(), section.gpus.as_slice()) {
        ([one], _) => *one,
        ([], [only]) => only,
        (many, all) => {
            let on = if many.is_empty() {
                all.iter().collect()
            } else {
                many.to_vec()
            };
            return Err(MigrateError::ManyGpus {
                pid: root.pid,
                count: on.len(),
                list: on
                    .iter()
                    .map(|g| g.ordinal.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    };
    let devices = driver.devices().map_err(|source| SnapshotError::Driver {
        pid: root.pid,
        source,
    })?;
    let Some(target) = devices
        .iter()
        .find(|d| opts.target.matches(d.ordinal as u32, &d.uuid))
    else {
        return Err(MigrateError::NoSuchGpu {
            target: opts.target,
        });
    };
    let from_uuid: GpuUuid = from.uuid.parse().map_err(|_| MigrateError::NoSuchGpu {
        target: opts.target,
    })?;
    if target.uuid == from_uuid {
        return Err(MigrateError::SameGpu {
            pid: root.pid,
            target: opts.target,
        });
    }
    if target.name != from.name {
        return Err(MigrateError::GpuModel {
            pid: root.pid,
            from: from.name.clone(),
            target: opts.target,
            to: target.name.clone(),
        });
    }
    let need = from.used_by_snapshot;
    if let (Some(need), Some(gpus)) = (need, nvml.as_ref().and_then(|n| n.gpus().ok())) {
        if let Some(free) = gpus.iter().find(|g| g.uuid == target.uuid) {
            if free.free_memory < need {
                return Err(MigrateError::NoRoom {
                    pid: root.pid,
                    target: opts.target,
                    free: free.free_memory >> 20,
                    need: need >> 20,
                });
            }
        }
    }
    // A pair for every GPU the processes can see: the two swap, the others stay.
    let pairs: Vec<(GpuUuid, GpuUuid)> = section
        .gpus
        .iter()
        .filter_map(|g| g.uuid.parse::<GpuUuid>().ok())
        .map(|u| {
            if u == from_uuid {
                (u, target.uuid)
            } else if u == target.uuid {
                (u, from_uuid)
            } else {
                (u, u)
            }
        })
        .collect();
    let pairs = if pairs.iter().any(|(a, _)| *a == from_uuid) {
        pairs
    } else {
        vec![(from_uuid, target.uuid)]
    };

    let mut phases = Phases::default();
    let mut tasks = GpuTasks::new(&driver, cuda_pids.clone());
    let stop = Instant::now();
    let moved = phases
        .time("cuda_lock", || tasks.lock_all(opts.lock_timeout))
        .and_then(|()| phases.time("cuda_checkpoint", || tasks.checkpoint_all()))
        .and_then(|()| phases.time("cuda_restore", || tasks.restore_all(&pairs)))
        .and_then(|()| phases.time("cuda_unlock", || tasks.unlock_all()));
    if let Err(source) = moved {
        return Err(match tasks.rollback() {
            Ok(()) => MigrateError::Moved {
                pid: root.pid,
                source: Box::new(source),
            },
            Err(rollback) => MigrateError::RollbackFailed {
                pid: root.pid,
                source: Box::new(source),
                rollback: Box::new(rollback),
            },
        });
    }
    Ok(MigrateReport {
        from: GpuRef::Ordinal(from.ordinal),
        to: GpuRef::Ordinal(target.ordinal as u32),
        pids: cuda_pids,
        bytes: need,
        stopped_s: stop.elapsed().as_secs_f64(),
        phases,
    })
}
