//! `torpor snapshot`: refuse what the driver cannot restore → drop device mappings that forked
//! children inherited → CUDA lock → driver checkpoint → CRIU dump → (leave running) driver
//! restore and unlock, with every failure rolled back so the source keeps running.
//!
//! CRIU always dumps with leave-running: torpor itself decides the source's fate only after the
//! snapshot is complete on disk. Without `--leave-running` the source is frozen (SIGSTOP) from
//! the dump until the snapshot is committed, then killed; any failure before that thaws it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use torpor_criu::{Criu, CriuError, DumpRequest};
use torpor_cuda::{CudaDriver, CudaError, GpuUuid, Nvml, ProcessState};
use torpor_image::{
    Durability, GpuEntry, GpuSection, Host, ImageError, Manifest, ProcessEntry, SnapshotKey,
    SnapshotWriter, Source,
};

use crate::empty_gpu_memory;
use crate::fault;
use crate::gpu_tasks::{GpuTasks, StepError, TaskState};
use crate::inherited_mappings::{self, DropError};
use crate::interrupt;
use crate::mounts;
use crate::phases::Phases;
use crate::preflight::{self, PreflightError};
use crate::proctree::{self, ProcessInfo};
use crate::space::{self, NoSpace};
use crate::unsupported::{self, Refusal};

/// What to snapshot and how.
pub struct SnapshotOptions<'a> {
    /// Root of the tree: the pid `torpor run` printed.
    pub pid: i32,
    /// Snapshot directory to create; must not exist.
    pub out: &'a Path,
    /// Keep the source running afterwards.
    pub leave_running: bool,
    /// How long to wait for in-flight CUDA work when locking.
    pub lock_timeout: Duration,
    /// Where CRIU's log of a failed dump is kept.
    pub log_dir: &'a Path,
    /// Seals the snapshot (`manifest.mac`) so that restores can tell it was written by the
    /// key's holder; `None` writes an unkeyed snapshot (hashes only).
    pub key: Option<&'a SnapshotKey>,
    /// torpord's state directory, mounted in its workers: its external mount is saved under
    /// [`mounts::STATE_DIR_KEY`] so that any node's daemon can bind its own there at restore.
    pub state_dir: Option<&'a Path>,
    /// Concurrent snapshot: this many CRIU pre-dump rounds copy the tree's memory while it
    /// runs, each only what changed since the one before (soft-dirty tracking), so the stop
    /// copies only the pages written since the last round (and the GPU state). 0: the whole
    /// copy happens during the stop. Needs [`crate::dirty_tracking::available`].
    pub pre_dump_rounds: u32,
    /// When the sealed snapshot reaches the disk ([`Durability::Deferred`]: a hibernation, whose
    /// source is frozen until the snapshot is sealed; torpord flushes it afterwards).
    pub durability: Durability,
    /// The tree's CUDA processes may be checkpointed in place already (torpord's gpu_released
    /// instance): they are dumped as they are, their GPU state being in their memory, and are
    /// never restored by this snapshot, on failure either. NVML no longer shows what they held
    /// on the GPU, so the caller says it: bytes per GPU, taken before their checkpoint, which
    /// the manifest records as what a restore needs. `None`: every CUDA process must be running.
    pub gpu_released: Option<&'a [(GpuUuid, u64)]>,
}

/// Why a snapshot failed. In every case the source process keeps running and `--out` does not
/// exist, except [`SnapshotError::RollbackFailed`], which says what is stuck.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The tree could not be read from /proc.
    #[error("cannot read the process tree of pid {pid}: {source}; did the process exit?")]
    Proc { pid: i32, source: std::io::Error },
    /// A process maps libcuda but the driver cannot be used from torpor.
    #[error("process {pid} uses CUDA, but {source}")]
    Driver { pid: i32, source: CudaError },
    /// A CUDA process is not in the running state (another checkpoint in progress?).
    #[error("CUDA process {pid} is {state:?}, not running: another snapshot may be in progress; wait for it, or restart the process")]
    NotRunning { pid: i32, state: ProcessState },
    /// The tree holds GPU state the driver cannot restore; nothing was touched.
    #[error("{refusal}; pid {root} keeps running, nothing was written")]
    Unsupported { root: i32, refusal: Refusal },
    /// A process's inherited device mappings could not be dropped; the GPU was not touched.
    #[error(
        "cannot drop the NVIDIA device mappings and files process {pid} inherited by fork: \
         {source}; pid \
         {root} keeps running, nothing was written"
    )]
    InheritedMappings {
        root: i32,
        pid: i32,
        source: DropError,
    },
    /// A CUDA step failed; rolled back.
    #[error("{source}; pid {root} keeps running, nothing was written")]
    Gpu { root: i32, source: StepError },
    /// CRIU failed; rolled back.
    #[error("{source}; pid {root} keeps running, nothing was written")]
    Dump { root: i32, source: CriuError },
    /// The snapshot would not fit (found before the source was touched: [`space::check`]), or
    /// CRIU filled its filesystem; rolled back.
    #[error("{space}; pid {root} keeps running, nothing was written")]
    DiskFull {
        root: i32,
        #[source]
        space: Box<NoSpace>,
    },
    /// A concurrent snapshot was asked for on a kernel that does not track written pages.
    #[error("a concurrent snapshot needs the kernel's soft-dirty page tracking (CONFIG_MEM_SOFT_DIRTY), which this kernel lacks ({detail}), so CRIU's pre-dump cannot run: take the snapshot without --concurrent (stop-the-world); pid {root} keeps running, nothing was written")]
    NoDirtyTracking { root: i32, detail: String },
    /// A pre-dump round failed (before the tree was stopped for the snapshot).
    #[error("CRIU's pre-dump round {round} failed: {source}; pid {root} keeps running, nothing was written")]
    PreDump {
        root: i32,
        round: u32,
        source: CriuError,
    },
    /// The dump could not be made self-contained (its pre-dumped pages copied in); rolled back.
    #[error("cannot copy the pre-dumped pages into the snapshot: {source}; pid {root} keeps running, nothing was written")]
    Flatten {
        root: i32,
        source: torpor_criu::images::ImageReadError,
    },
    /// A fault forced by `TORPOR_FAULT` ([`crate::fault`]); rolled back.
    #[error("fault {} forced by {}; pid {root} keeps running, nothing was written", point.name(), crate::fault::ENV)]
    Fault { root: i32, point: fault::Point },
    /// SIGINT/SIGTERM arrived; rolled back.
    #[error("interrupted: pid {root} keeps running and no snapshot was written")]
    Interrupted { root: i32 },
    /// Writing the snapshot failed after the dump; rolled back.
    #[error("{source}; pid {root} keeps running")]
    Write { root: i32, source: ImageError },
    /// The rollback itself failed: the message keeps both errors and what became of the
    /// process the driver could not restore ([`proctree::fate`]).
    #[error("{original}; rolling back failed as well ({rollback}; {fate}): pid {root} may be stuck in a CUDA lock — check it, or kill it")]
    RollbackFailed {
        root: i32,
        original: Box<SnapshotError>,
        rollback: Box<StepError>,
        fate: String,
    },
}

/// A snapshot that was taken.
pub struct SnapshotReport {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// The phases in the order they ran (the manifest keeps them by name).
    pub phases: Phases,
    /// Things the user should know about the snapshot (one line each), e.g. that most of the GPU
    /// memory it saved is an empty reservation ([`crate::empty_gpu_memory`]).
    pub warnings: Vec<String>,
}

/// How many times a snapshot is tried when a process forked from a CUDA process reached CRIU
/// with the driver's mappings (see [`forked_during_dump`]).
const DUMP_ATTEMPTS: u32 = 3;

/// The identity of each file the tree reopens by path ([`proctree::reopened_paths`]), read in
/// the root's mount namespace. A file that cannot be read (gone meanwhile, not a regular file
/// such as a device) is left out: CRIU reports what it cannot dump.
fn identify_reopened(
    root: i32,
    pids: &[i32],
    archived: &[String],
    bound: &[String],
) -> Vec<torpor_image::ReopenedFile> {
    let ns_root = Path::new("/proc").join(root.to_string()).join("root");
    // The node's cache of file hashes (torpor_image::reopened): a deploy's snapshot of a
    // worker whose libraries were hashed before reads none of them again.
    let mut cache = torpor_image::HashCache::open(&torpor_image::hash_cache_path());
    let files = proctree::reopened_paths(pids, archived, bound)
        .iter()
        .filter_map(|p| {
            let path = ns_root.join(p.trim_start_matches('/'));
            torpor_image::ReopenedFile::identify(p, &path, Some(&mut cache)).ok()
        })
        .collect();
    cache.save();
    files
}

/// Takes a snapshot; see the module doc for the protocol.
///
/// A dump that CRIU refused because a process forked from a CUDA process still held the
/// driver's mappings is rolled back (the source runs again) and tried anew: the tree is listed
/// twice before the dump, yet a fork can land between the second listing and CRIU's seize. On
/// the H100 (2026-11-23) inductor's compile-worker pool did so once in three deploys of a
/// `torch.compile` function; the next attempt finds the pool started and its children already
/// released.
pub fn snapshot(opts: &SnapshotOptions) -> Result<SnapshotReport, SnapshotError> {
    let mut attempt = 1;
    loop {
        match snapshot_once(opts) {
            Err(e) if attempt < DUMP_ATTEMPTS && forked_during_dump(&e) => attempt += 1,
            Ok(mut report) if attempt > 1 => {
                report.warnings.push(format!(
                    "the dump was taken on attempt {attempt} of {DUMP_ATTEMPTS}: a process forked from a CUDA process reached CRIU with the driver's mappings before (each earlier attempt was rolled back and the source ran on)"
                ));
                return Ok(report);
            }
            other => return other,
        }
    }
}

/// Whether CRIU refused the dump over a device mapping of a process the driver does not know
/// (its CUDA plugin's `handle_device_vma`): a child forked after the tree was listed. Only a
/// clean failure counts: the rollback put the source back, so trying again is safe.
fn forked_during_dump(e: &SnapshotError) -> bool {
    const PLUGIN: &str = "handle_device_vma";
    match e {
        SnapshotError::Dump { source, .. } => {
            source.to_string().contains(PLUGIN)
                || source.log_errors(20).iter().any(|l| l.contains(PLUGIN))
        }
        _ => false,
    }
}

fn snapshot_once(opts: &SnapshotOptions) -> Result<SnapshotReport, SnapshotError> {
    // Everything before the stop is timed as `prepare`: a caller that stopped routing to the
    // tree first (a hibernation) waits for it as much as for the dump.
    let prepare = Instant::now();
    preflight::require_root("torpor snapshot")?;
    preflight::require_checkpoint_restore_kernel(Path::new("/proc"))?;
    let criu = preflight::require_criu()?;
    let root = preflight::require_torpor_root(opts.pid)?;
    let writer = SnapshotWriter::create(opts.out)?;

    let pids = proctree::tree(root.pid);
    let tree: Vec<ProcessInfo> = pids
        .iter()
        .map(|&p| {
            proctree::read_process(p).map_err(|source| SnapshotError::Proc { pid: p, source })
        })
        .collect::<Result<_, _>>()?;
    let mount_plan = mounts::plan(root.pid).map_err(|source| SnapshotError::Proc {
        pid: root.pid,
        source,
    })?;
    let private_run = mounts::run_is_its_own(&mount_plan.archived, &mount_plan.external);
    let mut external = mount_plan.external;
    if let Some(state_dir) = opts.state_dir {
        // By identity, not by path: a worker restored from another node's snapshot has this
        // daemon's state directory mounted at that node's path.
        use std::os::unix::fs::MetadataExt;
        let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        let ours = id(state_dir);
        // Its directories, which an unprivileged worker gets bound in one by one.
        let pieces: Vec<(String, Option<(u64, u64)>)> = std::fs::read_dir(state_dir)
            .map(|entries| {
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| Some((e.file_name().to_str()?.to_owned(), id(&e.path()))))
                    .collect()
            })
            .unwrap_or_default();
        for m in external.iter_mut() {
            let seen =
                Path::new(&format!("/proc/{}/root", root.pid)).join(m.path.trim_start_matches('/'));
            let seen_id = id(&seen);
            if Path::new(&m.path) == state_dir || (ours.is_some() && seen_id == ours) {
                m.key = mounts::STATE_DIR_KEY.to_owned();
            } else if let Some((name, _)) = pieces
                .iter()
                .find(|(_, piece)| piece.is_some() && *piece == seen_id)
            {
                m.key = mounts::state_dir_piece_key(name);
            }
        }
    }
    // Identified now, while the tree runs (its files seen through /proc/PID/root), before it
    // is stopped: this adds nothing to the stop time.
    let archived: Vec<String> = mount_plan.archived.iter().map(|m| m.path.clone()).collect();
    // The node's own files bound into the tree (a Python prefix): checked at restore even under
    // an archived mount. The state directory's pieces are not: a restore binds the restoring
    // daemon's own there, at another path on another node.
    let bound: Vec<String> = external
        .iter()
        .filter(|m| !m.key.starts_with(mounts::STATE_DIR_KEY))
        .map(|m| m.path.clone())
        .collect();
    let identify = Instant::now();
    let reopened = identify_reopened(root.pid, &pids, &archived, &bound);
    let identify_s = identify.elapsed().as_secs_f64();

    let mut stdio: Vec<torpor_image::StdioFile> = Vec::new();
    for f in pids.iter().flat_map(|&p| proctree::stdio_files(p)) {
        if !stdio.iter().any(|s| s.key == f.key) {
            stdio.push(f);
        }
    }

    // Stdio a restore handed in from outside the tree's mount namespace is dumped as an external
    // file, which every restore must hand in again (see `restore`).
    let dump_external: Vec<String> = external
        .iter()
        .map(mounts::dump_spec)
        .chain(
            stdio
                .iter()
                .filter(|f| f.is_external())
                .map(|f| f.key.clone()),
        )
        .collect();

    // Everything that can fail without touching the source happens before it is stopped.
    let host = Host::current(criu.version_string())?;
    let mut phases = Phases::default();
    phases.0.push(("identify_reopened".into(), identify_s));
    let (cuda, cuda_pids, gpu_section) = phases.time("gpu_survey", || {
        let cuda = find_cuda_in(&tree, opts.gpu_released.is_some())?;
        let (pids, section) = match &cuda {
            Some((driver, nvml, pids)) => (
                pids.iter().map(|p| p.0).collect::<Vec<_>>(),
                Some(gpu_section_of(
                    driver,
                    nvml.as_ref(),
                    pids,
                    opts.gpu_released,
                )?),
            ),
            None => (Vec::new(), None),
        };
        Ok::<_, SnapshotError>((cuda, pids, section))
    })?;
    if let Some(refusal) = unsupported::find(&pids) {
        return Err(SnapshotError::Unsupported {
            root: root.pid,
            refusal,
        });
    }
    drop_inherited_mappings(root.pid, &pids, &cuda_pids)?;
    let mut tasks = cuda.as_ref().map(|(d, _, p)| {
        GpuTasks::found(
            d,
            p.iter()
                .map(|&(pid, state)| match state {
                    ProcessState::Checkpointed => (pid, TaskState::Checkpointed),
                    _ => (pid, TaskState::Running),
                })
                .collect(),
        )
    });

    // A dump into a filesystem that cannot hold it fails half-way: say so before the source
    // is stopped, and name a full disk as such should it fill up during the dump.
    let archived: Vec<String> = mount_plan.archived.iter().map(|a| a.path.clone()).collect();
    // What the driver's checkpoint will move into the processes' memory; a released one's is
    // there already, and counted with it.
    let released_bytes: u64 = opts
        .gpu_released
        .iter()
        .flat_map(|u| u.iter())
        .map(|u| u.1)
        .sum();
    let gpu_bytes: u64 = gpu_section
        .iter()
        .flat_map(|g| &g.gpus)
        .filter_map(|g| g.used_by_snapshot)
        .sum::<u64>()
        .saturating_sub(released_bytes);
    // Named by the directory the user gave (the partial one is hidden and goes away).
    let named = std::path::absolute(opts.out)
        .ok()
        .and_then(|out| out.parent().map(Path::to_path_buf));
    let check_empty_gpu_memory = gpu_section
        .as_ref()
        .is_some_and(|g| empty_gpu_memory::worth_checking(&g.gpus, gpu_bytes));
    let checked = phases.time("space_check", || {
        space::check(&pids, &archived, gpu_bytes, writer.dir())
    });
    let space = match checked {
        Ok(space) => space::Estimate {
            dir: named.unwrap_or(space.dir),
            ..space
        },
        Err(mut refusal) => {
            if let (space::NoSpace::Disk { dir, .. }, Some(named)) = (&mut refusal, named) {
                *dir = named;
            }
            return Err(SnapshotError::DiskFull {
                root: root.pid,
                space: Box::new(refusal),
            });
        }
    };

    phases
        .0
        .push(("prepare".into(), prepare.elapsed().as_secs_f64()));

    // Concurrent: copy the memory while the tree runs; the stop then copies what changed.
    let pre_dumps = if opts.pre_dump_rounds > 0 {
        Some(pre_dump(
            &criu,
            opts,
            root.pid,
            &dump_external,
            &writer,
            &mut phases,
        )?)
    } else {
        None
    };

    let stop_start = Instant::now();
    let mut warnings = Vec::new();
    let result = stop_and_dump(
        &criu,
        opts,
        &root,
        &dump_external,
        private_run,
        tasks.as_mut(),
        &mut phases,
        &writer,
        &mut warnings,
        pre_dumps.as_ref().map(|p| p.parent_of_final()),
        check_empty_gpu_memory,
    );
    if let Err(original) = result {
        return Err(roll_back(
            root.pid,
            tasks.as_mut(),
            original,
            Some((&writer, &space)),
            opts.log_dir,
            false,
        ));
    }
    let mut stop_time = stop_start.elapsed().as_secs_f64();

    if opts.leave_running {
        if let Some(t) = tasks.as_mut() {
            let resumed = phases
                .time("cuda_restore", || t.restore_all(&[]))
                .and_then(|_| phases.time("cuda_unlock", || t.unlock_all()));
            if let Err(source) = resumed {
                let original = SnapshotError::Gpu {
                    root: root.pid,
                    source,
                };
                return Err(roll_back(
                    root.pid,
                    Some(t),
                    original,
                    Some((&writer, &space)),
                    opts.log_dir,
                    false,
                ));
            }
        }
        stop_time = stop_start.elapsed().as_secs_f64();
    } else {
        // Freeze the source exactly as dumped until the snapshot is committed.
        signal_tree(&pids, libc::SIGSTOP);
    }

    // The pages the final dump left in the pre-dumps are copied in (the tree runs again, or is
    // frozen, meanwhile): the snapshot holds every page itself, as a stop-the-world one does.
    if let Some(pre) = pre_dumps {
        let flattened = phases.time("flatten_pre_dumps", || {
            torpor_criu::images::flatten(writer.dir())
        });
        drop(pre);
        if let Err(source) = flattened {
            let original = SnapshotError::Flatten {
                root: root.pid,
                source,
            };
            return Err(roll_back(
                root.pid,
                tasks.as_mut(),
                original,
                Some((&writer, &space)),
                opts.log_dir,
                !opts.leave_running,
            ));
        }
    }

    let mut manifest = Manifest::new(
        env!("CARGO_PKG_VERSION"),
        Source {
            command: root_command(&tree),
            root_pid: root.pid,
            tree: tree
                .iter()
                .map(|p| ProcessEntry {
                    pid: p.pid,
                    ppid: p.ppid,
                    ns_pid: p.ns_pid.clone(),
                    comm: p.comm.clone(),
                    cmdline: p.cmdline.clone(),
                    cuda: cuda_pids.contains(&p.pid),
                })
                .collect(),
            leave_running: opts.leave_running,
        },
        host,
    );
    manifest.gpu = gpu_section;
    manifest.external_mounts = external;
    manifest.archived_mounts = mount_plan.archived;
    manifest.stdio_files = stdio;
    manifest.reopened_files = reopened;
    manifest.stop_time_s = stop_time;

    let failed = if interrupt::interrupted() {
        Some(SnapshotError::Interrupted { root: root.pid })
    } else if fault::armed(fault::Point::AfterDump) {
        Some(SnapshotError::Fault {
            root: root.pid,
            point: fault::Point::AfterDump,
        })
    } else {
        None
    };
    if let Some(original) = failed {
        return Err(roll_back(
            root.pid,
            tasks.as_mut(),
            original,
            Some((&writer, &space)),
            opts.log_dir,
            !opts.leave_running,
        ));
    }
    manifest.timings = phases.0.iter().cloned().collect();
    // The writer hashes every file, adds its own "hash_and_write" timing, writes the manifest
    // last and renames the directory into place.
    let finished = writer.finish_with(manifest, opts.key, opts.durability);
    let manifest = match finished {
        Ok(m) => m,
        Err(source) => {
            let original = SnapshotError::Write {
                root: root.pid,
                source,
            };
            return Err(roll_back(
                root.pid,
                tasks.as_mut(),
                original,
                None,
                opts.log_dir,
                !opts.leave_running,
            ));
        }
    };
    if interrupt::interrupted() {
        // Too late to avoid writing, not too late to honour the request.
        let _ = std::fs::remove_dir_all(opts.out);
        let original = SnapshotError::Interrupted { root: root.pid };
        return Err(roll_back(
            root.pid,
            tasks.as_mut(),
            original,
            None,
            opts.log_dir,
            !opts.leave_running,
        ));
    }
    if !opts.leave_running {
        // SIGKILL to PID 1 of the namespace ends every process in it.
        crate::sys::kill(root.pid, libc::SIGKILL);
        signal_tree(&pids, libc::SIGCONT);
    }
    if let Some(secs) = manifest.timings.get(torpor_image::HASH_TIMING) {
        phases
            .0
            .push((torpor_image::HASH_TIMING.to_string(), *secs));
    }
    Ok(SnapshotReport {
        dir: opts.out.to_path_buf(),
        manifest,
        phases,
        warnings,
    })
}

/// Replaces the NVIDIA device mappings of every process that maps libcuda but that the driver
/// does not know (children forked after CUDA was initialised) with empty reservations and points
/// their NVIDIA descriptors at an eventfd: see [`inherited_mappings`].
fn drop_inherited_mappings(
    root: i32,
    pids: &[i32],
    cuda_pids: &[i32],
) -> Result<(), SnapshotError> {
    // Only processes whose image holds libcuda (a fork of a CUDA process) without CUDA state of
    // their own: one that opened the devices through NVML alone keeps its descriptors (and CRIU
    // refuses it, as before).
    let forked = |p: &&i32| !cuda_pids.contains(p) && proctree::maps_libcuda(**p).unwrap_or(false);
    for &pid in pids.iter().filter(forked) {
        // A process that exited meanwhile has nothing left to drop.
        let state = inherited_mappings::device_state(pid).unwrap_or_default();
        inherited_mappings::drop_device_state(pid, &state)
            .map_err(|source| SnapshotError::InheritedMappings { root, pid, source })?;
    }
    Ok(())
}

/// Lock, checkpoint and dump. Leaves CUDA processes checkpointed (GPU memory released).
#[allow(clippy::too_many_arguments)]
fn stop_and_dump(
    criu: &Criu,
    opts: &SnapshotOptions,
    root: &ProcessInfo,
    external: &[String],
    private_run: bool,
    tasks: Option<&mut GpuTasks>,
    phases: &mut Phases,
    writer: &SnapshotWriter,
    warnings: &mut Vec<String>,
    parent_img: Option<String>,
    check_empty_gpu_memory: bool,
) -> Result<(), SnapshotError> {
    let check_interrupt = || {
        if interrupt::interrupted() {
            Err(SnapshotError::Interrupted { root: root.pid })
        } else {
            Ok(())
        }
    };
    check_interrupt()?;
    let cuda_pids = tasks.as_ref().map(|t| t.pids()).unwrap_or_default();
    if let Some(t) = tasks {
        phases
            .time("cuda_lock", || t.lock_all(opts.lock_timeout))
            .map_err(|source| SnapshotError::Gpu {
                root: root.pid,
                source,
            })?;
        check_interrupt()?;
        // Only the tasks this checkpoint moves: a released one's memory does not change here,
        // and reading a big process's smaps walks its page tables (~13 ms a GiB of 4 KiB pages).
        let checked = if check_empty_gpu_memory {
            t.to_checkpoint()
        } else {
            Vec::new()
        };
        let before: Vec<_> = phases.time("empty_gpu_memory_check", || {
            checked
                .into_iter()
                .map(|p| (p, empty_gpu_memory::Resident::of(p).unwrap_or_default()))
                .collect()
        });
        phases
            .time("cuda_checkpoint", || t.checkpoint_all())
            .map_err(|source| SnapshotError::Gpu {
                root: root.pid,
                source,
            })?;
        let found = phases.time("empty_gpu_memory_check", || {
            before
                .iter()
                .filter_map(|(pid, before)| {
                    let after = empty_gpu_memory::Resident::of(*pid).unwrap_or_default();
                    let added =
                        empty_gpu_memory::added(*pid, before, &after, empty_gpu_memory::SAMPLES);
                    added.ok().and_then(|a| empty_gpu_memory::warning(*pid, &a))
                })
                .collect::<Vec<_>>()
        });
        warnings.extend(found);
        check_interrupt()?;
    }
    // Once more, on the tree as it is now: a process started, or one that mapped the driver,
    // since the tree was first listed (inductor's compile workers start in the background and
    // may still be importing torch then; the lock and checkpoint above take seconds) would
    // otherwise reach CRIU with its device mappings ("handle_device_vma plugin failed").
    phases.time("inherited_mappings", || {
        drop_inherited_mappings(root.pid, &proctree::tree(root.pid), &cuda_pids)
    })?;
    if fault::armed(fault::Point::BeforeDump) {
        return Err(SnapshotError::Fault {
            root: root.pid,
            point: fault::Point::BeforeDump,
        });
    }
    let request = DumpRequest {
        pid: root.pid,
        images_dir: writer.dir(),
        log_file: "dump.log",
        leave_running: true,
        external: external.to_vec(),
        empty_ns_net: true,
        network_lock_skip: true,
        // TCP repair is safe only where every connection is the tree's own: in a network
        // namespace of its own (what `torpor run` gives), nothing outside can be talking to it.
        tcp_established: own_network_namespace(root.pid),
        ext_unix_sk: false,
        file_locks: true,
        link_remap: true,
        log_level: 4,
        track_mem: parent_img.is_some(),
        parent_img,
        private_run,
    };
    phases
        .time("criu_dump", || {
            // A fault suite's timing switch (fault::DELAY_ENV) holds the dump at a notification.
            criu.dump_with(&request, &mut |n| {
                crate::fault::delay_at_notification(&n.script);
                Ok(())
            })
        })
        .map_err(|source| SnapshotError::Dump {
            root: root.pid,
            source,
        })?;
    check_interrupt()
}

/// The pre-dump rounds of a concurrent snapshot, in a directory beside the snapshot being
/// written (removed when dropped: the snapshot's own images are made self-contained first).
pub(crate) struct PreDumps {
    dir: PathBuf,
    rounds: u32,
}

impl PreDumps {
    /// The last round, as CRIU's `parent_img` of the final dump (relative to its images).
    fn parent_of_final(&self) -> String {
        let name = self
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        format!("../{name}/{}", self.rounds)
    }
}

impl Drop for PreDumps {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `opts.pre_dump_rounds` CRIU pre-dumps of the running tree, each into its own directory
/// with the one before as its parent (only the pages written since are copied). Refuses a
/// kernel without soft-dirty tracking before CRIU is asked (`TORPOR_FAULT=skip-tracking-check`
/// asks CRIU anyway, so its own refusal is tested). A failure leaves the tree running.
fn pre_dump(
    criu: &Criu,
    opts: &SnapshotOptions,
    root: i32,
    external: &[String],
    writer: &SnapshotWriter,
    phases: &mut Phases,
) -> Result<PreDumps, SnapshotError> {
    if !fault::armed(fault::Point::SkipTrackingCheck) {
        match crate::dirty_tracking::available() {
            Ok(true) => {}
            Ok(false) => {
                return Err(SnapshotError::NoDirtyTracking {
                    root,
                    detail: "written pages never show as soft-dirty".into(),
                })
            }
            Err(detail) => return Err(SnapshotError::NoDirtyTracking { root, detail }),
        }
    }
    // Named like the writer's partial directory (`.NAME-pre.partial-PID`, beside it), so that
    // what a killed torpor left is removed as stale as the partial snapshot is.
    let out_name = writer
        .out()
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let parent = writer.dir().parent().unwrap_or(Path::new("."));
    let pre = PreDumps {
        dir: parent.join(format!(".{out_name}-pre.partial-{}", std::process::id())),
        rounds: opts.pre_dump_rounds,
    };
    for round in 1..=opts.pre_dump_rounds {
        if interrupt::interrupted() {
            return Err(SnapshotError::Interrupted { root });
        }
        let dir = pre.dir.join(round.to_string());
        std::fs::create_dir_all(&dir)
            .map_err(|source| SnapshotError::Proc { pid: root, source })?;
        let request = DumpRequest {
            parent_img: (round > 1).then(|| format!("../{}", round - 1)),
            track_mem: true,
            external: external.to_vec(),
            empty_ns_net: true,
            network_lock_skip: true,
            tcp_established: own_network_namespace(root),
            file_locks: true,
            link_remap: true,
            log_level: 4,
            log_file: "pre-dump.log",
            ..DumpRequest::new(root, &dir)
        };
        phases
            .time(&format!("criu_pre_dump_{round}"), || {
                criu.pre_dump(&request)
            })
            .map_err(|source| {
                // CRIU's log outlives the pre-dump directory.
                let to = opts
                    .log_dir
                    .join(format!("pre-dump-{root}-{}.log", crate::sys::unix_millis()));
                let kept = std::fs::create_dir_all(opts.log_dir)
                    .and_then(|_| std::fs::copy(dir.join("pre-dump.log"), &to))
                    .is_ok();
                let source = if kept { source.with_log(to) } else { source };
                SnapshotError::PreDump {
                    root,
                    round,
                    source,
                }
            })?;
    }
    if fault::armed(fault::Point::AfterPreDump) {
        return Err(SnapshotError::Fault {
            root,
            point: fault::Point::AfterPreDump,
        });
    }
    Ok(pre)
}

/// Whether `pid` lives in a network namespace other than torpor's own.
fn own_network_namespace(pid: i32) -> bool {
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/net")).ok();
    match (ns(&pid.to_string()), ns("self")) {
        (Some(theirs), Some(ours)) => theirs != ours,
        _ => false,
    }
}

/// Undoes whatever was done, in the order that gives the source the best chance: keeps CRIU's
/// log of a failed dump in `log_dir`, removes the partial snapshot (a dump that filled the
/// filesystem gives its space back before the source runs again: the process, and the driver
/// putting its GPU state back, must not meet a full disk), thaws a frozen tree, and returns
/// CUDA processes to running.
fn roll_back(
    root: i32,
    tasks: Option<&mut GpuTasks>,
    original: SnapshotError,
    writer: Option<(&SnapshotWriter, &space::Estimate)>,
    log_dir: &Path,
    frozen: bool,
) -> SnapshotError {
    let original = match writer {
        Some((w, space)) => {
            let kept = keep_dump_log(original, w, log_dir, space);
            // The writer's Drop would remove it too, but only once the rollback is over.
            let _ = std::fs::remove_dir_all(w.dir());
            kept
        }
        None => original,
    };
    if frozen {
        signal_tree(&proctree::tree(root), libc::SIGCONT);
    }
    match tasks.map(|t| t.rollback()) {
        Some(Err(rollback)) => SnapshotError::RollbackFailed {
            root,
            fate: proctree::fate(rollback.pid),
            original: Box::new(original),
            rollback: Box::new(rollback),
        },
        _ => original,
    }
}

/// Moves CRIU's dump log out of the partial snapshot (which is about to be removed) so the error
/// can name it, and names a full filesystem as such. The log is renamed when it can be (no
/// space needed: the partial snapshot and `log_dir` are usually on one filesystem), else
/// copied; an error never names a log that is gone.
fn keep_dump_log(
    err: SnapshotError,
    writer: &SnapshotWriter,
    log_dir: &Path,
    space: &space::Estimate,
) -> SnapshotError {
    let SnapshotError::Dump { root, source } = err else {
        return err;
    };
    let from = writer.dir().join("dump.log");
    // CRIU's log lives on the filesystem that filled, so its last lines (the ENOSPC) may be
    // missing: a filesystem left all but full by the failed dump counts as filled too.
    let left_full = space::left_full(writer.dir());
    let to = log_dir.join(format!("dump-{root}-{}.log", crate::sys::unix_millis()));
    let kept = std::fs::create_dir_all(log_dir)
        .and_then(|_| {
            std::fs::rename(&from, &to).or_else(|_| std::fs::copy(&from, &to).map(|_| ()))
        })
        .is_ok();
    let log = kept.then_some(to);
    if left_full
        || log.as_deref().is_some_and(space::log_says_full)
        || (!kept && space::log_says_full(&from))
    {
        return SnapshotError::DiskFull {
            root,
            space: Box::new(space.full(log)),
        };
    }
    let source = match log {
        Some(to) => source.with_log(to),
        None => source.with_log(PathBuf::from(format!(
            "(CRIU's log could not be kept in {})",
            log_dir.display()
        ))),
    };
    SnapshotError::Dump { root, source }
}

fn signal_tree(pids: &[i32], sig: libc::c_int) {
    for &p in pids {
        crate::sys::kill(p, sig);
    }
}

/// The user's command: the init's only child's command line, else the init's own.
fn root_command(tree: &[ProcessInfo]) -> Vec<String> {
    let root = &tree[0];
    tree.iter()
        .find(|p| p.ppid == root.pid)
        .map(|p| p.cmdline.clone())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| root.cmdline.clone())
}

pub(crate) type CudaContext = (CudaDriver, Option<Nvml>, Vec<i32>);

/// Finds the CUDA processes of the tree, all of them running. The driver is loaded only if some
/// process maps libcuda, so CPU-only trees never need (or touch) it.
pub(crate) fn find_cuda(tree: &[ProcessInfo]) -> Result<Option<CudaContext>, SnapshotError> {
    Ok(find_cuda_in(tree, false)?
        .map(|(d, n, pids)| (d, n, pids.into_iter().map(|p| p.0).collect())))
}

/// [`find_cuda`], with each process's state; `checkpointed_too`: a process the driver holds
/// checkpointed (a GPU released in place, [`SnapshotOptions::gpu_released`]) is taken as well.
#[allow(clippy::type_complexity)]
fn find_cuda_in(
    tree: &[ProcessInfo],
    checkpointed_too: bool,
) -> Result<Option<(CudaDriver, Option<Nvml>, Vec<(i32, ProcessState)>)>, SnapshotError> {
    let mapped: Vec<i32> = tree
        .iter()
        .filter(|p| proctree::maps_libcuda(p.pid).unwrap_or(false))
        .map(|p| p.pid)
        .collect();
    let Some(&first) = mapped.first() else {
        return Ok(None);
    };
    let driver =
        CudaDriver::load().map_err(|source| SnapshotError::Driver { pid: first, source })?;
    let mut pids = Vec::new();
    for pid in mapped {
        match driver.process_state(pid) {
            Ok(None) => {} // libcuda loaded but never initialised: no GPU state
            Ok(Some(ProcessState::Running)) => pids.push((pid, ProcessState::Running)),
            Ok(Some(ProcessState::Checkpointed)) if checkpointed_too => {
                pids.push((pid, ProcessState::Checkpointed))
            }
            Ok(Some(state)) => return Err(SnapshotError::NotRunning { pid, state }),
            Err(source) => return Err(SnapshotError::Driver { pid, source }),
        }
    }
    if pids.is_empty() {
        return Ok(None);
    }
    Ok(Some((driver, Nvml::load().ok(), pids)))
}

/// What the manifest records about the GPUs: the ones the tree uses (per NVML), or every device
/// when NVML is unavailable.
pub(crate) fn gpu_section(
    driver: &CudaDriver,
    nvml: Option<&Nvml>,
    pids: &[i32],
) -> Result<GpuSection, SnapshotError> {
    let running: Vec<(i32, ProcessState)> =
        pids.iter().map(|&p| (p, ProcessState::Running)).collect();
    gpu_section_of(driver, nvml, &running, None)
}

/// [`gpu_section`] of processes in the states found: a checkpointed one's use is `released`'s
/// (NVML no longer shows it), a running one's NVML's.
fn gpu_section_of(
    driver: &CudaDriver,
    nvml: Option<&Nvml>,
    found: &[(i32, ProcessState)],
    released: Option<&[(GpuUuid, u64)]>,
) -> Result<GpuSection, SnapshotError> {
    let pids: Vec<i32> = found.iter().map(|p| p.0).collect();
    let running: Vec<i32> = found
        .iter()
        .filter(|p| p.1 != ProcessState::Checkpointed)
        .map(|p| p.0)
        .collect();
    let any_checkpointed = running.len() < pids.len();
    let pids = pids.as_slice();
    let driver_err = |source| SnapshotError::Driver {
        pid: pids[0],
        source,
    };
    let devices = driver.devices().map_err(driver_err)?;
    let cuda_driver_version = driver.driver_version().map_err(driver_err)?;
    let usage = nvml.and_then(|n| n.process_memory().ok());
    // Every GPU some CUDA process of the tree can see, in the order torpor enumerates them:
    // restoring onto other GPUs needs a pair for each of them, used or not.
    let mut visible: Vec<torpor_cuda::GpuDevice> = Vec::new();
    for &pid in pids {
        for dev in crate::visible_gpus::visible_to(pid, &devices) {
            if !visible.iter().any(|d| d.uuid == dev.uuid) {
                visible.push(dev);
            }
        }
    }
    visible.sort_by_key(|d| d.ordinal);
    let gpus = visible
        .into_iter()
        .map(|dev| GpuEntry {
            ordinal: dev.ordinal as u32,
            used_by_snapshot: {
                let seen = usage.as_ref().map(|u| {
                    u.iter()
                        .filter(|p| p.gpu == dev.uuid && running.contains(&(p.pid as i32)))
                        .map(|p| p.used_memory.unwrap_or(0))
                        .sum::<u64>()
                });
                let given = released.filter(|_| any_checkpointed).map(|r| {
                    r.iter()
                        .filter(|r| r.0 == dev.uuid)
                        .map(|r| r.1)
                        .sum::<u64>()
                });
                match (seen, given) {
                    (None, None) => None,
                    (seen, given) => Some(seen.unwrap_or(0) + given.unwrap_or(0)),
                }
            },
            name: dev.name,
            uuid: dev.uuid.to_string(),
            total_memory: dev.total_memory,
        })
        .collect();
    let driver_version = nvml
        .and_then(|n| n.driver_version().ok())
        .unwrap_or_else(|| format!("cuda-{cuda_driver_version}"));
    Ok(GpuSection {
        driver_version,
        cuda_driver_version,
        gpus,
    })
}
