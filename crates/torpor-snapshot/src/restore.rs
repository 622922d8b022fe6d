//! `torpor restore`: verify → compatibility checks → CRIU restore into new PID, mount and network
//! namespaces → driver restore (onto the original GPUs or the mapped ones) → unlock.

use std::path::Path;

use torpor_criu::{CriuError, RestoreRequest};
use torpor_cuda::{CudaDriver, CudaError, GpuUuid, Nvml};
use torpor_image::{GpuSection, ImageError, Manifest, Snapshot};

use crate::gpu_map::GpuMapping;
use crate::gpu_tasks::{GpuTasks, StepError};
use crate::interrupt;
use crate::phases::Phases;
use crate::preflight::{self, PreflightError};
use crate::proctree;

/// What to restore and how.
pub struct RestoreOptions<'a> {
    pub dir: &'a Path,
    /// Return once restored; otherwise the restored root becomes the caller's child.
    pub detach: bool,
    /// `--gpu` pairs; empty means the snapshot's own GPUs.
    pub gpu_map: &'a [GpuMapping],
    /// Where CRIU writes its restore log.
    pub log_dir: &'a Path,
}

/// Why a restore was refused or failed. Nothing restored is left running.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    /// The snapshot failed to open or verify.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The snapshot holds GPU state but the driver is unusable here.
    #[error("the snapshot holds GPU state, but {source}")]
    Driver { source: CudaError },
    /// Another driver version.
    #[error("the snapshot was taken with NVIDIA driver {snapshot}, this node has {here}: restore on a node with driver {snapshot} (the driver's checkpoint format is tied to its version)")]
    DriverVersion { snapshot: String, here: String },
    /// A GPU of the snapshot is not on this node and no mapping names it.
    #[error("the snapshot's GPU {ordinal} ({name}, {uuid}) is not on this node: map it onto one of this node's GPUs with --gpu {ordinal}=NEW")]
    GpuMissing {
        ordinal: u32,
        name: String,
        uuid: String,
    },
    /// `--gpu` names a GPU that does not exist.
    #[error("--gpu names {which} GPU {gpu}, which does not exist: see `torpor inspect` for the snapshot's GPUs and nvidia-smi -L for this node's")]
    NoSuchGpu { which: &'static str, gpu: String },
    /// `--gpu` given for a snapshot without GPU state.
    #[error(
        "--gpu was given, but the snapshot holds no GPU state (a CPU-only process): drop --gpu"
    )]
    GpuMapWithoutGpu,
    /// Another GPU model.
    #[error("the snapshot was taken on a {snapshot}, but GPU {ordinal} here is a {here}: restore onto the same GPU model")]
    GpuModel {
        snapshot: String,
        ordinal: u32,
        here: String,
    },
    /// Not enough free device memory.
    #[error("GPU {ordinal} has {free} MiB free but the snapshot needs {need} MiB: free GPU memory or choose another GPU with --gpu")]
    NoRoom { ordinal: u32, free: u64, need: u64 },
    /// CRIU failed.
    #[error(transparent)]
    Criu(#[from] CriuError),
    /// The directory for CRIU's restore log could not be created.
    #[error("cannot create the log directory {path}: {source}; set TORPOR_LOG_DIR to a writable directory")]
    LogDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// A CUDA process of the snapshot is missing from the restored tree.
    #[error("restored tree has no process with pid {inner} (a CUDA process of the snapshot): the snapshot is inconsistent; re-take it")]
    MissingCudaProcess { inner: i32 },
    /// The driver restore failed; the restored tree was killed.
    #[error("{source}; the restored processes were killed")]
    Gpu { source: StepError },
    /// SIGINT/SIGTERM arrived; the restored tree was killed.
    #[error("interrupted: the restored processes were killed")]
    Interrupted,
}

/// A restored tree.
pub struct Restored {
    /// Host pid of the restored root (the init `torpor run` made).
    pub pid: i32,
    /// Each phase's own duration; verify and gpu_checks overlap.
    pub phases: Phases,
    /// Wall time of the whole restore.
    pub total_s: f64,
    pub manifest: Manifest,
}

/// The GPUs a restore puts the snapshot's state on.
struct GpuPlan {
    driver: CudaDriver,
    pairs: Vec<(GpuUuid, GpuUuid)>,
}

/// Restores a snapshot; see the module doc.
pub fn restore(opts: &RestoreOptions) -> Result<Restored, RestoreError> {
    preflight::require_root("torpor restore")?;
    preflight::require_checkpoint_restore_kernel(Path::new("/proc"))?;
    let criu = preflight::require_criu()?;
    let mut phases = Phases::default();

    let start = std::time::Instant::now();
    let snapshot = phases.time("open", || Snapshot::open(opts.dir))?;
    let manifest = snapshot.manifest().clone();
    if manifest.gpu.is_none() && !opts.gpu_map.is_empty() {
        return Err(RestoreError::GpuMapWithoutGpu);
    }
    // Hashing the image and initialising the driver (cuInit, NVML) are independent: run them
    // side by side. A corrupt snapshot is reported before any GPU complaint.
    let (verified, plan) = std::thread::scope(|scope| {
        let verify = scope.spawn(|| {
            let t = std::time::Instant::now();
            (snapshot.verify(), t.elapsed().as_secs_f64())
        });
        let t = std::time::Instant::now();
        let plan = manifest
            .gpu
            .as_ref()
            .map(|gpu| plan_gpus(gpu, opts.gpu_map));
        let plan_s = t.elapsed().as_secs_f64();
        let (verified, verify_s) = verify.join().unwrap_or_else(|_| {
            (
                Err(ImageError::Invalid {
                    reason: "verification thread panicked".into(),
                }),
                0.0,
            )
        });
        phases.0.push(("verify".into(), verify_s));
        if plan.is_some() {
            phases.0.push(("gpu_checks".into(), plan_s));
        }
        (verified, plan)
    });
    verified?;
    let plan = plan.transpose()?;

    if interrupt::interrupted() {
        return Err(RestoreError::Interrupted);
    }

    std::fs::create_dir_all(opts.log_dir).map_err(|source| RestoreError::LogDir {
        path: opts.log_dir.to_path_buf(),
        source,
    })?;
    let log_name = format!(
        "restore-{}-{}.log",
        std::process::id(),
        crate::sys::unix_millis()
    );
    let external: Vec<String> = manifest
        .external_mounts
        .iter()
        .map(crate::mounts::restore_spec)
        .collect();
    let request = RestoreRequest {
        images_dir: opts.dir,
        work_dir: Some(opts.log_dir),
        log_file: &log_name,
        root: Some(Path::new("/")),
        external,
        empty_ns_net: true,
        network_lock_skip: true,
        tcp_established: false,
        ext_unix_sk: false,
        file_locks: true,
        rst_sibling: !opts.detach,
        log_level: 4,
        orphan_pts_master: false,
        loopback_up: true,
    };
    let pid = phases.time("criu_restore", || criu.restore(&request))?;
    // The log of a successful restore is noise; a failed one is kept and named in the error.
    let _ = std::fs::remove_file(opts.log_dir.join(&log_name));

    let kill_restored = || crate::sys::kill(pid, libc::SIGKILL);
    if let Some(plan) = &plan {
        let inner: Vec<i32> = manifest
            .source
            .tree
            .iter()
            .filter(|p| p.cuda)
            .map(|p| p.ns_pid.last().copied().unwrap_or(p.pid))
            .collect();
        let pids = match restored_pids(pid, &inner) {
            Ok(p) => p,
            Err(e) => {
                kill_restored();
                return Err(e);
            }
        };
        let mut tasks = GpuTasks::restored(&plan.driver, pids);
        let resumed = phases
            .time("cuda_restore", || tasks.restore_all(&plan.pairs))
            .and_then(|_| phases.time("cuda_unlock", || tasks.unlock_all()));
        if let Err(source) = resumed {
            kill_restored();
            return Err(RestoreError::Gpu { source });
        }
    }
    if interrupt::interrupted() {
        kill_restored();
        return Err(RestoreError::Interrupted);
    }
    let total_s = start.elapsed().as_secs_f64();
    Ok(Restored {
        total_s,
        pid,
        phases,
        manifest,
    })
}

/// Host pids of the restored processes whose innermost pid is in `inner`, in that order.
fn restored_pids(root: i32, inner: &[i32]) -> Result<Vec<i32>, RestoreError> {
    let tree: Vec<_> = proctree::tree(root)
        .into_iter()
        .filter_map(|p| proctree::read_process(p).ok())
        .collect();
    inner
        .iter()
        .map(|&want| {
            tree.iter()
                .find(|p| p.inner_pid() == want)
                .map(|p| p.pid)
                .ok_or(RestoreError::MissingCudaProcess { inner: want })
        })
        .collect()
}

/// Checks that the snapshot's GPU state can go onto this node's GPUs and works out the pairs
/// for the driver.
fn plan_gpus(gpu: &GpuSection, map: &[GpuMapping]) -> Result<GpuPlan, RestoreError> {
    let driver = CudaDriver::load().map_err(|source| RestoreError::Driver { source })?;
    let nvml = Nvml::load().ok();
    let here = match nvml.as_ref().and_then(|n| n.driver_version().ok()) {
        Some(v) => v,
        None => format!(
            "cuda-{}",
            driver
                .driver_version()
                .map_err(|source| RestoreError::Driver { source })?
        ),
    };
    if here != gpu.driver_version {
        return Err(RestoreError::DriverVersion {
            snapshot: gpu.driver_version.clone(),
            here,
        });
    }
    let devices = driver
        .devices()
        .map_err(|source| RestoreError::Driver { source })?;
    for m in map {
        if !gpu
            .gpus
            .iter()
            .any(|g| g.uuid.parse().is_ok_and(|u| m.old.matches(g.ordinal, &u)))
        {
            return Err(RestoreError::NoSuchGpu {
                which: "snapshot",
                gpu: m.old.to_string(),
            });
        }
        if !devices
            .iter()
            .any(|d| m.new.matches(d.ordinal as u32, &d.uuid))
        {
            return Err(RestoreError::NoSuchGpu {
                which: "target",
                gpu: m.new.to_string(),
            });
        }
    }
    let free = nvml.as_ref().and_then(|n| n.gpus().ok());
    let mut pairs = Vec::new();
    let mut need_per_target: Vec<(GpuUuid, u64)> = Vec::new();
    for g in &gpu.gpus {
        let old: GpuUuid = g.uuid.parse().map_err(|_| ImageError::Invalid {
            reason: format!("GPU uuid {:?} in the manifest is malformed", g.uuid),
        })?;
        let mapped = map.iter().find(|m| m.old.matches(g.ordinal, &old));
        let target = match mapped {
            Some(m) => devices
                .iter()
                .find(|d| m.new.matches(d.ordinal as u32, &d.uuid)),
            None => devices.iter().find(|d| d.uuid == old),
        }
        .ok_or_else(|| RestoreError::GpuMissing {
            ordinal: g.ordinal,
            name: g.name.clone(),
            uuid: g.uuid.clone(),
        })?;
        if target.name != g.name {
            return Err(RestoreError::GpuModel {
                snapshot: g.name.clone(),
                ordinal: target.ordinal as u32,
                here: target.name.clone(),
            });
        }
        pairs.push((old, target.uuid));
        let need = g.used_by_snapshot.unwrap_or(0);
        match need_per_target.iter_mut().find(|(u, _)| *u == target.uuid) {
            Some((_, n)) => *n += need,
            None => need_per_target.push((target.uuid, need)),
        }
    }
    if let Some(free) = free {
        for (uuid, need) in need_per_target {
            if let Some(f) = free.iter().find(|f| f.uuid == uuid) {
                if f.free_memory < need {
                    return Err(RestoreError::NoRoom {
                        ordinal: f.index,
                        free: f.free_memory >> 20,
                        need: need >> 20,
                    });
                }
            }
        }
    }
    // Without a mapping every GPU goes back onto itself: the driver needs no pairs.
    if pairs.iter().all(|(a, b)| a == b) {
        pairs.clear();
    }
    Ok(GpuPlan { driver, pairs })
}
