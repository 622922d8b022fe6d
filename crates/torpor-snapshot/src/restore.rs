//! `torpor restore`: verify → compatibility checks → CRIU restore into new PID, mount and network
//! namespaces → driver restore (onto the original GPUs or the mapped ones) → unlock. With
//! [`RestoreOptions::resume_gpu`] false the last two are left to the caller.
//!
//! A restored process keeps writing to the files it had open when it was snapshotted, its stdout
//! and stderr included. With [`RestoreOptions::stdio`], every descriptor of the tree open on one
//! of the files the manifest records as stdio (`stdio_files`) is instead restored as a descriptor
//! of the new file (CRIU's `--inherit-fd`, keyed as the image names the file).
//!
//! A file handed in that way is opened here, on a mount of the host's mount namespace, not the
//! tree's; a later snapshot of the restored tree dumps it as an external file (`file[MNT:INODE]`)
//! that CRIU cannot reopen by itself. Restoring such a snapshot without `stdio` therefore opens
//! the recorded path here and hands it in too.

use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use torpor_criu::{CriuError, InheritedFd, LazyPages, LazyPagesError, RestoreRequest};
use torpor_cuda::{CudaDriver, CudaError, GpuUuid, Nvml};
use torpor_image::{check_reopened, GpuSection, HashCache, ImageError, Manifest, Snapshot, Trust};

use crate::gpu_map::GpuMapping;
use crate::gpu_tasks::{GpuTasks, StepError};
use crate::interrupt;
use crate::phases::Phases;
use crate::preflight::{self, PreflightError};
use crate::proctree;
use crate::restore_thread;

/// What to restore and how.
pub struct RestoreOptions<'a> {
    pub dir: &'a Path,
    /// Return once restored; otherwise the restored root becomes the caller's child.
    pub detach: bool,
    /// `--gpu` pairs; empty means the snapshot's own GPUs.
    pub gpu_map: &'a [GpuMapping],
    /// Where CRIU writes its restore log.
    pub log_dir: &'a Path,
    /// File that receives the restored tree's stdout and stderr (created, appended), instead of
    /// the files they were open on when the snapshot was taken.
    pub stdio: Option<&'a Path>,
    /// How the image files are checked before CRIU reads them.
    pub verify: Verify,
    /// Who must have written the snapshot: its MAC (`manifest.mac`) is checked against this
    /// key before anything else is read, whichever `verify` is; [`Trust::Unkeyed`] skips that.
    pub trust: Trust<'a>,
    /// Run the driver's restore and unlock on the CUDA processes (the default everywhere).
    /// `false` leaves the restored tree's CUDA state locked and checkpointed, holding no GPU
    /// memory, exactly as an in-place lock + checkpoint leaves a live process: the caller must
    /// later call cuCheckpointProcessRestore then cuCheckpointProcessUnlock on each CUDA process
    /// before it runs CUDA work (torpord's standby instances, resumed as gpu_released ones are).
    pub resume_gpu: bool,
    /// The cgroup the restored tree is born in: the `cgroup.procs` file of each hierarchy
    /// (torpord's instance cgroup). Empty: CRIU's (and so the caller's) cgroup.
    pub cgroup: &'a [PathBuf],
    /// Host paths to bind at the external mounts of these keys instead of the paths recorded
    /// in the snapshot (torpord: its own state directory at [`crate::mounts::STATE_DIR_KEY`]).
    pub external_sources: &'a [(&'a str, &'a Path)],
    /// A bound on the GPU restores in flight at once (from CRIU's start to the end of the
    /// driver's restore), shared with the caller's other restores (torpord's
    /// `restore_server.gpu_restores`); `None`: no bound. The wait is the phase `restore_wait`.
    pub gpu_restore_slots: Option<&'a crate::gpu_restore_slots::GpuRestoreSlots>,
    /// The lane of `gpu_restore_slots` this restore waits in (torpord: the GPU it restores
    /// onto); 0 everywhere else.
    pub gpu_lane: u32,
    /// Its driver restore goes alone on the node, no other lane's beside it (torpord: the first
    /// start of a function with nothing live, whose instance serves the burst).
    pub gpu_alone: bool,
}

/// How a restore checks the snapshot's files against its manifest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verify {
    /// Hash every file (the default, and what `torpor restore` does).
    #[default]
    Hashes,
    /// Compare the listing and sizes only. For a copy whose every file was hashed when it was
    /// made and that nobody else can write since: a staged copy ([`crate::stage::stage`]) on a
    /// tmpfs only its owner (root) can write. Saves re-reading the images at every restore.
    /// The manifest's MAC is still checked ([`RestoreOptions::trust`]): a rewritten manifest is
    /// refused, a page changed in place (same size) is not.
    SizesOnly,
}

/// Where a restored process's memory comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PageSource {
    /// CRIU copies every page from the images before the process runs (the default).
    #[default]
    Copy,
    /// CRIU restores the memory layout only; Torpor's page server (`torpor_criu::page_server`)
    /// fills each fault with a run around it, the profiled hot set before the driver's restore,
    /// then the rest in the background. The restore's [`Restored::lazy_pages`] must be finished
    /// ([`LazyRestore::finish`]).
    Lazy,
    /// As [`PageSource::Lazy`], with CRIU's own `criu lazy-pages` daemon (one page per fault;
    /// kept to compare with).
    CriuLazy,
}

impl std::str::FromStr for PageSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "copy" => Ok(PageSource::Copy),
            "lazy" => Ok(PageSource::Lazy),
            "criu-lazy" => Ok(PageSource::CriuLazy),
            other => Err(format!(
                "unknown page source {other:?}: use `copy` (every page before the process runs), `lazy` (on first touch, over userfaultfd, Torpor's page server) or `criu-lazy` (the same with CRIU's daemon)"
            )),
        }
    }
}

/// The page server's background threads: its default and the most it takes (torpord's
/// `restore_server.background_threads` is bounded by them).
pub use torpor_criu::page_server::{DEFAULT_BACKGROUND_THREADS, MAX_BACKGROUND_THREADS};

/// How a restore brings back the process's memory; `Default` is what [`restore`] does.
/// (A snapshot staged in memory with [`crate::stage::stage`] is restored by passing the staged
/// directory as [`RestoreOptions::dir`].)
#[derive(Clone, Debug)]
pub struct PageOptions {
    pub source: PageSource,
    /// Torpor's page server: what to serve as the hot set, a profile an earlier restore
    /// recorded (`profile_out`). A file that is missing or empty means no hot set.
    pub profile_in: Option<std::path::PathBuf>,
    /// Torpor's page server: where to record the ranges the restored tree faults in, in order,
    /// once CRIU's restore finished (written when the server ends).
    pub profile_out: Option<std::path::PathBuf>,
    /// Torpor's page server: serve faults (and the hot set) only, no background copy. For a
    /// restore whose tree is thrown away after it ran (a deploy's profiling restore): what it
    /// never touched is never copied, and every page it touched is recorded. The server, and so
    /// [`LazyRestore::finish`], ends only once the tree has exited.
    pub faults_only: bool,
    /// Torpor's page server: threads of its background copy (1: serial); `None`: its default
    /// (`torpor_criu::PageServerOptions::background_threads`).
    pub background_threads: Option<usize>,
    /// Read ahead the pages of mapped files CRIU's restore reads, beside the image's
    /// verification ([`crate::file_prefetch`]; on by default).
    pub prefetch_file_pages: bool,
}

impl Default for PageOptions {
    fn default() -> Self {
        Self {
            source: PageSource::default(),
            profile_in: None,
            profile_out: None,
            faults_only: false,
            background_threads: None,
            prefetch_file_pages: true,
        }
    }
}

/// The `criu lazy-pages` daemon still serving a lazily restored tree.
#[must_use = "finish() reports whether every page arrived; dropping it waits for the daemon"]
pub struct LazyRestore {
    /// Behind a lock: the hot-set wait and a daemon's wake polls it through `&self`.
    daemon: std::sync::Mutex<Option<LazyPages>>,
    work_dir: std::path::PathBuf,
    root: i32,
    /// The tree was killed after the restore: nobody waits for pages, stop the daemon.
    killed: std::sync::atomic::AtomicBool,
}

impl LazyRestore {
    /// The daemon's pid.
    pub fn daemon_pid(&self) -> Option<u32> {
        self.server().as_ref().and_then(|d| d.pid())
    }

    /// Waits until the daemon has served every page and exited, and reaps it. When it failed,
    /// the restored tree (which may miss memory) is killed and its logs are kept.
    pub fn finish(self) -> Result<(), RestoreError> {
        self.finish_or(|_| {})
    }

    /// [`finish`](Self::finish), but a failure is handed to `failed` before the tree is
    /// killed: a caller that also watches the tree (a daemon reading its worker's connection)
    /// records the cause first, instead of learning only that the worker died.
    pub fn finish_or(self, failed: impl FnOnce(&RestoreError)) -> Result<(), RestoreError> {
        let Some(mut daemon) = self.server().take() else {
            return Ok(());
        };
        let hold = daemon.take_hold();
        match daemon.wait() {
            Ok(()) => {
                drop(hold);
                let _ = std::fs::remove_dir_all(&self.work_dir);
                Ok(())
            }
            Err(source) => {
                let e = RestoreError::LazyPages { source };
                failed(&e);
                kill_every_task(self.root);
                // Only now may the uffds go: a task still alive would fault in zeros.
                drop(hold);
                Err(e)
            }
        }
    }
}

impl LazyRestore {
    fn server(&self) -> std::sync::MutexGuard<'_, Option<LazyPages>> {
        self.daemon.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Without blocking: `Ok(true)` once the server exited having served every page,
    /// `Ok(false)` while it runs, its error once it exited failing (reaped either way).
    pub fn server_exited(&self) -> Result<bool, LazyPagesError> {
        match self.server().as_mut() {
            Some(d) => d.try_wait(),
            None => Ok(true),
        }
    }
}

impl LazyRestore {
    /// For a tree the caller has killed (e.g. it failed to start): stops the daemon, which has
    /// nobody left to serve, and reaps it; its logs are kept. Never touches the tree's pid,
    /// which may belong to another process by now.
    pub fn abandon(self) {
        self.killed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for LazyRestore {
    fn drop(&mut self) {
        let Some(daemon) = self.server().take() else {
            return;
        };
        if self.killed.load(std::sync::atomic::Ordering::SeqCst) {
            daemon.kill();
        } else {
            // Killing the daemon would leave the tree hanging on its next fault: wait instead.
            let mut daemon = daemon;
            let hold = daemon.take_hold();
            if daemon.wait().is_ok() {
                let _ = std::fs::remove_dir_all(&self.work_dir);
            } else {
                kill_every_task(self.root);
            }
            drop(hold);
        }
    }
}

/// SIGKILL to every process of the tree of `root`, then to `root`: each has a fatal signal
/// pending before its page server's uffds are released, so none runs user code again (killing
/// the namespace's init alone kills the others only once it has exited).
pub fn kill_every_task(root: i32) {
    for pid in crate::proctree::tree(root).into_iter().rev() {
        crate::sys::kill(pid, libc::SIGKILL);
    }
    crate::sys::kill(root, libc::SIGKILL);
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
    #[error("the snapshot's GPU {ordinal} ({name}, {uuid}) has no free counterpart on this node: map it onto one of this node's GPUs with --gpu {ordinal}=NEW")]
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
    /// Two snapshot GPUs would go onto one GPU.
    #[error("the snapshot's GPU {ordinal} would go onto GPU {target}, which another snapshot GPU already takes: give each snapshot GPU its own target with --gpu (e.g. --gpu 0=1,1=0)")]
    GpuTaken { ordinal: u32, target: u32 },
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
    #[error("cannot create the restore's log directory {path}: {source}: free space on its filesystem, or make it writable")]
    LogDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// `--log` for a snapshot that does not say which files its stdout and stderr were.
    #[error("--log was given, but the snapshot records no file its stdout and stderr were open on (it was taken by an older torpor, or they were a terminal or pipe): take the snapshot again with this torpor from a process started with `torpor run --log`, or restore without --log")]
    StdioUnknown,
    /// The new stdout/stderr file cannot be opened.
    #[error("cannot open the log file {path} for the restored processes' stdout and stderr: {source}; pass --log with a writable file path")]
    StdioOpen {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// A CUDA process of the snapshot is missing from the restored tree.
    #[error("restored tree has no process with pid {inner} (a CUDA process of the snapshot): the snapshot is inconsistent; re-take it")]
    MissingCudaProcess { inner: i32 },
    /// The driver restore failed; the restored tree was killed.
    #[error("{source}; the restored processes were killed")]
    Gpu { source: StepError },
    /// The driver's restore thread of a restored CUDA process could not be run alone; the
    /// restored tree was killed.
    #[error("{source}; the restored processes were killed")]
    RestoreThread {
        source: crate::restore_thread::RestoreThreadError,
    },
    /// SIGINT/SIGTERM arrived; the restored tree was killed.
    #[error("interrupted: the restored processes were killed")]
    Interrupted,
    /// The lazy-pages daemon failed to start or to serve every page.
    #[error(transparent)]
    LazyPages { source: LazyPagesError },
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
    /// With [`PageSource::Lazy`]: the daemon still serving the tree's memory.
    pub lazy_pages: Option<LazyRestore>,
    /// How many restores it took (more than 1 after a transient driver failure).
    pub attempts: u32,
    /// The GPU pairs of [`RestoreOptions::gpu_map`] as the driver takes them (old UUID → new),
    /// empty without a map: with [`RestoreOptions::resume_gpu`] false, what the caller's own
    /// driver restore must pass to put the state where the map says.
    pub gpu_pairs: Vec<(GpuUuid, GpuUuid)>,
}

/// The GPUs a restore puts the snapshot's state on.
struct GpuPlan {
    driver: &'static CudaDriver,
    pairs: Vec<(GpuUuid, GpuUuid)>,
}

/// Restores a snapshot; see the module doc.
pub fn restore(opts: &RestoreOptions) -> Result<Restored, RestoreError> {
    restore_with(opts, &PageOptions::default())
}

/// How many times a restore is tried when the driver's restore fails transiently (see
/// [`restore_with`]).
pub const RESTORE_ATTEMPTS: u32 = 3;

/// [`restore`], bringing the memory back as `pages` says.
///
/// A freshly restored JAX process (driver 580) sometimes cannot be given its CUDA state back:
/// CRIU resumes its tasks before the driver's restore, and in that window one of libcuda's own
/// threads reads a driver mapping that only the driver's restore puts back. On the H100 the
/// kernel then logged `segfault at … in libcuda.so` (the same address each time) and the process
/// was gone before, or during, the driver's restore: `CUDA_ERROR_OPERATING_SYSTEM` (seen once in
/// two in issue 16), "not a CUDA process", or no such process in the restored tree. A fresh
/// restore of the same snapshot usually wins the race. So such a failure kills what was
/// restored and starts again, up to [`RESTORE_ATTEMPTS`] times in all; `Restored::attempts` says
/// how many it took.
pub fn restore_with(opts: &RestoreOptions, pages: &PageOptions) -> Result<Restored, RestoreError> {
    let mut attempt = 1;
    loop {
        let again = attempt < RESTORE_ATTEMPTS && !interrupt::interrupted();
        match restore_once(opts, pages) {
            Err(RestoreError::Gpu { source })
                if again
                    && source.step == "restore"
                    && (source.source.is_operating_system_error()
                        || source.source.is_process_lost()) =>
            {
                attempt += 1;
            }
            Err(RestoreError::MissingCudaProcess { .. }) if again => attempt += 1,
            Ok(mut restored) => {
                restored.attempts = attempt;
                return Ok(restored);
            }
            Err(e) => return Err(e),
        }
    }
}

fn restore_once(opts: &RestoreOptions, pages: &PageOptions) -> Result<Restored, RestoreError> {
    preflight::require_root("torpor restore")?;
    preflight::require_checkpoint_restore_kernel(Path::new("/proc"))?;
    let criu = preflight::require_criu()?;
    let mut phases = Phases::default();

    let start = std::time::Instant::now();
    let snapshot = phases.time("open", || {
        let snapshot = Snapshot::open(opts.dir)?;
        snapshot.authenticate(opts.trust)?;
        Ok::<_, ImageError>(snapshot)
    })?;
    let manifest = snapshot.manifest().clone();
    if manifest.gpu.is_none() && !opts.gpu_map.is_empty() {
        return Err(RestoreError::GpuMapWithoutGpu);
    }
    let stdio = stdio_handles(opts.stdio, &manifest)?;
    // The file pages CRIU will fault in one at a time, read ahead in the background from now on
    // (crate::file_prefetch): after a dropped page cache the verification below reads the image
    // from disk meanwhile. Not waited for.
    let prefetch = if pages.prefetch_file_pages {
        let dir = opts.dir.to_path_buf();
        let reopened = manifest.reopened_files.clone();
        std::thread::Builder::new()
            .name("file-prefetch".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                crate::file_prefetch::prefetch(&dir, &reopened, Path::new("/"));
                t.elapsed().as_secs_f64()
            })
            .ok()
    } else {
        None
    };
    // Hashing the image and initialising the driver (cuInit, NVML) are independent: run them
    // side by side. A corrupt snapshot is reported before any GPU complaint.
    let (verified, plan) = std::thread::scope(|scope| {
        let verify = scope.spawn(|| {
            let t = std::time::Instant::now();
            let checked = match opts.verify {
                Verify::Hashes => snapshot.verify(),
                Verify::SizesOnly => snapshot.size_check_only(),
            };
            (checked, t.elapsed().as_secs_f64())
        });
        // The files CRIU maps again by path must be the ones it was taken with: hashed through
        // the node's cache, so only files changed since they were last seen are read
        // (torpor_image::reopened), staged copy or not. Beside the image's hashing: after a
        // dropped page cache even the cache's `stat`s of a few hundred libraries took 0.3 s.
        let reopened = scope.spawn(|| {
            let t = std::time::Instant::now();
            let reopened = &snapshot.manifest().reopened_files;
            let mut cache = HashCache::open(&torpor_image::hash_cache_path());
            let checked = check_reopened(reopened, Path::new("/"), opts.dir, &mut cache);
            (checked, t.elapsed().as_secs_f64())
        });
        let t = std::time::Instant::now();
        let plan = manifest
            .gpu
            .as_ref()
            .map(|gpu| plan_gpus(gpu, opts.gpu_map));
        let plan_s = t.elapsed().as_secs_f64();
        let panicked = || ImageError::Invalid {
            reason: "verification thread panicked".into(),
        };
        let (image, verify_s) = verify.join().unwrap_or_else(|_| (Err(panicked()), 0.0));
        let (files, reopened_s) = reopened.join().unwrap_or_else(|_| (Err(panicked()), 0.0));
        // The image's own damage is reported first, as when the two ran one after the other.
        let verified = image.and_then(|report| files.map(|()| report));
        phases.0.push(("verify".into(), verify_s));
        phases.0.push(("check_reopened".into(), reopened_s));
        if plan.is_some() {
            phases.0.push(("gpu_checks".into(), plan_s));
        }
        (verified, plan)
    });
    verified?;
    let plan = plan.transpose()?;
    // How long asking for the reads took, when that is over by now (the reads themselves go on).
    if let Some(p) = prefetch.filter(|p| p.is_finished()) {
        if let Ok(s) = p.join() {
            phases.0.push(("file_prefetch".into(), s));
        }
    }

    if interrupt::interrupted() {
        return Err(RestoreError::Interrupted);
    }
    // A restore that resumes GPU state holds one of the caller's slots from CRIU's start until
    // the driver's restore ended (dropped there, or with any error on the way).
    let slot = match (&plan, opts.gpu_restore_slots) {
        (Some(_), Some(slots)) if opts.resume_gpu => {
            let (slot, waited) =
                slots.acquire(opts.gpu_lane, opts.gpu_alone, GPU_RESTORE_SLOT_WAIT);
            phases.0.push(("restore_wait".to_string(), waited));
            slot
        }
        _ => None,
    };

    std::fs::create_dir_all(opts.log_dir).map_err(|source| RestoreError::LogDir {
        path: opts.log_dir.to_path_buf(),
        source,
    })?;
    // Restores side by side in one process (torpord) within one millisecond must not share a
    // log or a lazy-pages work directory: the sequence number keeps the names apart.
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let unique = format!(
        "{}-{}-{}",
        std::process::id(),
        crate::sys::unix_millis(),
        SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let log_name = format!("restore-{unique}.log");
    let external: Vec<String> = manifest
        .external_mounts
        .iter()
        .map(
            |m| match opts.external_sources.iter().find(|(key, _)| *key == m.key) {
                Some((key, here)) => format!("mnt[{key}]:{}", here.display()),
                None => crate::mounts::restore_spec(m),
            },
        )
        .collect();
    let private_run = reaches_no_host_run(&manifest, &external);
    let request = RestoreRequest {
        images_dir: opts.dir,
        work_dir: Some(opts.log_dir),
        log_file: &log_name,
        root: Some(Path::new("/")),
        external,
        empty_ns_net: true,
        network_lock_skip: true,
        // Every restore gets a network namespace of its own, so repairing the tree's TCP
        // connections (all between its own processes) cannot disturb anyone else's.
        tcp_established: true,
        ext_unix_sk: false,
        file_locks: true,
        rst_sibling: !opts.detach,
        // CRIU's debug steps (~18 000 lines for a GPU worker): the post-mortem of a failed
        // restore. At -v2 the restore was no faster on the H200 (session 49, docs/lazy-pages.md).
        log_level: 4,
        orphan_pts_master: false,
        loopback_up: true,
        inherit_fds: stdio
            .iter()
            .map(|(key, file)| InheritedFd {
                key: key.clone(),
                fd: file.as_fd(),
            })
            .collect(),
        lazy_pages: false,
        cgroup: opts.cgroup.to_vec(),
        private_run,
    };
    // Lazy pages: the daemon and the restore meet at a socket in a work directory of their own,
    // so that restores side by side never share one.
    let lazy_dir = opts.log_dir.join(format!("lazy-{unique}"));
    let mut request = request;
    let daemon = match pages.source {
        PageSource::Copy => None,
        PageSource::Lazy | PageSource::CriuLazy => {
            std::fs::create_dir(&lazy_dir).map_err(|source| RestoreError::LogDir {
                path: lazy_dir.clone(),
                source,
            })?;
            let daemon = phases
                .time("lazy_pages_start", || {
                    if pages.source == PageSource::CriuLazy {
                        // Errors and warnings only: at debug level it logs every fault.
                        return criu.start_lazy_pages(opts.dir, &lazy_dir, "lazy-pages.log", 2);
                    }
                    let exe = std::env::current_exe().map_err(|source| {
                        torpor_criu::LazyPagesError::Spawn {
                            program: "/proc/self/exe".into(),
                            source,
                        }
                    })?;
                    torpor_criu::start_page_server(
                        &exe,
                        opts.dir,
                        &lazy_dir,
                        &torpor_criu::PageServerOptions {
                            profile_in: pages.profile_in.as_deref(),
                            profile_out: pages.profile_out.as_deref(),
                            background: !pages.faults_only,
                            background_threads: pages.background_threads,
                        },
                    )
                })
                .map_err(|source| RestoreError::LazyPages { source })?;
            request.work_dir = Some(&lazy_dir);
            request.lazy_pages = true;
            Some(daemon)
        }
    };
    // The CUDA processes stay stopped from CRIU's resume until the driver has restored them
    // (restore_thread): only when this restore resumes them on the GPU itself.
    let cuda_inner: Vec<i32> = match &plan {
        Some(_) if opts.resume_gpu => cuda_inner_pids(&manifest),
        _ => Vec::new(),
    };
    let daemon = daemon.map(std::sync::Mutex::new);
    let restored = restore_watching(&criu, &request, daemon.as_ref(), &cuda_inner, &mut phases);
    let mut daemon = daemon.map(|d| d.into_inner().unwrap_or_else(|e| e.into_inner()));
    let pid = match restored {
        // The watcher may have seen the daemon fail, and killed the tree, in the instant
        // between CRIU's answer and its end: the daemon's failure is then the cause, not a
        // tree found dead later. (Its failure is sticky: try_wait keeps returning it.)
        Ok(pid) => match daemon.as_mut().map(|d| d.try_wait()) {
            Some(Err(source)) => {
                kill_every_task(pid);
                return Err(RestoreError::LazyPages { source });
            }
            _ => pid,
        },
        Err(e) => {
            // Nothing to serve: stop the daemon (kill and reap); its log stays next to CRIU's.
            // When the daemon failed first, its failure is the cause.
            if let Some(mut daemon) = daemon {
                if let Err(source) = daemon.try_wait() {
                    return Err(RestoreError::LazyPages { source });
                }
                daemon.kill();
            }
            return Err(e.into());
        }
    };
    // The log of a successful restore is noise; a failed one is kept and named in the error.
    // `TORPOR_KEEP_RESTORE_LOG=1` keeps every one (CRIU's timestamped steps of a slow restore,
    // docs/gpu-machine.md).
    let log_in = request.work_dir.unwrap_or(opts.dir);
    if std::env::var_os("TORPOR_KEEP_RESTORE_LOG").is_none_or(|v| v != "1") {
        let _ = std::fs::remove_file(log_in.join(&log_name));
    } else if log_in != opts.log_dir {
        // A lazy restore's work directory goes once its pages are served: keep a copy beside.
        let _ = std::fs::copy(log_in.join(&log_name), opts.log_dir.join(&log_name));
    }
    let lazy_pages = daemon.map(|daemon| LazyRestore {
        daemon: std::sync::Mutex::new(Some(daemon)),
        work_dir: lazy_dir.clone(),
        root: pid,
        killed: std::sync::atomic::AtomicBool::new(false),
    });

    let kill_restored = || {
        kill_every_task(pid);
        if let Some(lazy) = &lazy_pages {
            lazy.killed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    };
    // Torpor's page server copies the hot set as soon as CRIU is done. The driver's restore,
    // which reads what it saved into the process, starts once that copy has begun (or the
    // server ended), beside it: the hot set is in the order the driver reads, copied several
    // times faster than the driver reads it, and a copy wakes a fault on its pages. Waiting
    // for the whole copy first cost GPT-2-Large's cold start 0.066 s and ResNet-152's 0.053 s
    // on the H200, the driver's restore no slower beside it (session 48, docs/lazy-pages.md).
    if pages.source == PageSource::Lazy && plan.is_some() && opts.resume_gpu {
        let waited = match lazy_pages.as_ref() {
            Some(lazy) => phases.time("hot_set", || wait_hot_set(&lazy_dir, lazy)),
            None => Ok(()),
        };
        if let Err(source) = waited {
            kill_restored();
            return Err(RestoreError::LazyPages { source });
        }
    }
    if let Some(plan) = &plan {
        let inner = cuda_inner_pids(&manifest);
        let pids = match restored_pids(pid, &inner) {
            Ok(p) => p,
            Err(e) => {
                kill_restored();
                return Err(e);
            }
        };
        let mut tasks = GpuTasks::restored(plan.driver, pids.clone());
        let resumed = if !opts.resume_gpu {
            // Left locked + checkpointed for the caller (see RestoreOptions::resume_gpu).
            Ok(())
        } else {
            // Stopped since CRIU let them go: each runs only its driver restore thread until
            // the driver has put its GPU state back (restore_thread's module doc says why).
            let alone = match run_restore_threads(plan.driver, &pids) {
                Ok(threads) => threads,
                Err(e) => {
                    kill_restored();
                    return Err(e);
                }
            };
            // A page server that ends while the driver restores (every page in) must let go of
            // the uffds at once (LazyPages::try_wait), or the driver's munmap of registered
            // memory waits for an UNMAP event nobody reads; one that fails leaves faults nobody
            // serves, so the tree is killed, which ends the driver's restore with an error.
            let driver_done = std::sync::atomic::AtomicBool::new(false);
            let resumed = std::thread::scope(|scope| {
                if let Some(lazy) = lazy_pages.as_ref() {
                    let driver_done = &driver_done;
                    let kill_restored = &kill_restored;
                    scope.spawn(move || {
                        while !driver_done.load(std::sync::atomic::Ordering::Acquire) {
                            match lazy.server_exited() {
                                Ok(true) => return,
                                Ok(false) => {}
                                Err(_) => return kill_restored(),
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                    });
                }
                // Holding a slot: the driver's restore itself one at a time (gpu_restore_slots).
                let turn = opts
                    .gpu_restore_slots
                    .filter(|_| slot.is_some())
                    .map(|slots| {
                        let (turn, waited) =
                            slots.driver(opts.gpu_lane, opts.gpu_alone, GPU_RESTORE_SLOT_WAIT);
                        phases.0.push(("cuda_wait".to_string(), waited));
                        turn
                    });
                let resumed = phases
                    .time("cuda_restore", || tasks.restore_all(&plan.pairs))
                    .and_then(|_| phases.time("cuda_unlock", || tasks.unlock_all()));
                drop(turn);
                driver_done.store(true, std::sync::atomic::Ordering::Release);
                resumed
            });
            drop(alone);
            restore_thread::resume(&pids);
            resumed
        };
        // The driver is done with it: the next GPU restore may start.
        drop(slot);
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
        lazy_pages,
        attempts: 1,
        gpu_pairs: plan.map(|p| p.pairs).unwrap_or_default(),
    })
}

/// How long a restore waits for a slot (RestoreOptions::gpu_restore_slots) before it goes on
/// without one: far past what a burst's restores take (8 × 0.5 s on the H100), so it only ends
/// a wait that something lost.
const GPU_RESTORE_SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// How long the driver's restore waits for a slow page server to begin the hot set before it
/// starts anyway (its faults are then served one run at a time).
const HOT_SET_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Waits until the page server marked the hot set's copy begun, exited after serving every
/// page, or [`HOT_SET_WAIT`] passed (a slow server: the restore goes on). A server that exited
/// failing is the error at once: its pages will never come, and waiting would only delay the
/// one line.
fn wait_hot_set(work_dir: &Path, lazy: &LazyRestore) -> Result<(), LazyPagesError> {
    let marker = work_dir.join(torpor_criu::page_server::HOT_BEGUN);
    let start = std::time::Instant::now();
    while !marker.exists() && start.elapsed() < HOT_SET_WAIT {
        if lazy.server_exited()? {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
    Ok(())
}

/// The CRIU restore; with a lazy-pages daemon, watched: should the daemon fail while CRIU
/// restores, the restored tasks would wait for their pages (and CRIU for them) for ever, so CRIU
/// and the restored tree are killed, which ends the request with an error.
fn restore_watching(
    criu: &torpor_criu::Criu,
    request: &RestoreRequest,
    daemon: Option<&std::sync::Mutex<LazyPages>>,
    stop_at_resume: &[i32],
    phases: &mut Phases,
) -> Result<i32, CriuError> {
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
    let root = AtomicI32::new(0);
    let criu_pid = AtomicI32::new(0);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if let Some(daemon) = daemon {
            scope.spawn(|| {
                while !done.load(Ordering::Acquire) {
                    let failed = daemon
                        .lock()
                        .map(|mut d| d.try_wait().is_err())
                        .unwrap_or(false);
                    if failed {
                        // CRIU traces the restored tasks: they can only die once CRIU is gone.
                        for pid in [
                            criu_pid.load(Ordering::Acquire),
                            root.load(Ordering::Acquire),
                        ] {
                            if pid > 0 {
                                crate::sys::kill(pid, libc::SIGKILL);
                            }
                        }
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            });
        }
        // When CRIU's first and last notifications came ("pre-restore", "post-resume"): the
        // time before the first is CRIU's start (spawn, its own set-up, reading the request),
        // the time after the last its answer and exit.
        let mut first_notice: Option<std::time::Instant> = None;
        let mut last_notice: Option<std::time::Instant> = None;
        let called = std::time::Instant::now();
        let result = phases.time("criu_restore", || {
            criu.restore_with(request, &mut |n| {
                let now = std::time::Instant::now();
                first_notice.get_or_insert(now);
                last_notice = Some(now);
                criu_pid.store(n.criu_pid as i32, Ordering::Release);
                crate::fault::delay_at_notification(&n.script);
                if n.script == torpor_criu::SETUP_NAMESPACES {
                    root.store(n.pid.unwrap_or(0), Ordering::Release);
                }
                // CRIU still holds every thread: a SIGSTOP now is what each of them meets
                // first when CRIU lets go. A CUDA process not found is reported after CRIU
                // (restored_pids), when nothing of it has run.
                if n.script == torpor_criu::PRE_RESUME && !stop_at_resume.is_empty() {
                    if let Ok(pids) = restored_pids(root.load(Ordering::Acquire), stop_at_resume) {
                        restore_thread::stop(&pids);
                    }
                }
                Ok(())
            })
        });
        done.store(true, Ordering::Release);
        if let (Some(first), Some(last)) = (first_notice, last_notice) {
            phases
                .0
                .push(("criu_start".into(), (first - called).as_secs_f64()));
            phases
                .0
                .push(("criu_finish".into(), last.elapsed().as_secs_f64()));
        }
        // CRIU gone without answering (killed, or crashed) rolled nothing back: the tasks it
        // had restored so far wait in its restorer for ever. Its own forks went with its
        // process group (torpor_criu); the restored root leads a group of its own.
        if let Err(CriuError::Exited { .. }) = &result {
            let root = root.load(Ordering::Acquire);
            if root > 0 {
                kill_every_task(root);
            }
        }
        result
    })
}

/// The files to hand to CRIU, by image key: with `new`, that file (created, appended) for every
/// stdio file of the manifest; without, the recorded path of each external one.
fn stdio_handles(
    new: Option<&Path>,
    manifest: &Manifest,
) -> Result<Vec<(String, std::fs::File)>, RestoreError> {
    let open = |path: &Path| {
        let fail = |source| RestoreError::StdioOpen {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(fail)?;
        }
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o644)
            .open(path)
            .map_err(fail)
    };
    match new {
        Some(path) => {
            if manifest.stdio_files.is_empty() {
                return Err(RestoreError::StdioUnknown);
            }
            let file = open(path)?;
            manifest
                .stdio_files
                .iter()
                .map(|f| {
                    let copy = file.try_clone().map_err(|source| RestoreError::StdioOpen {
                        path: path.to_path_buf(),
                        source,
                    })?;
                    Ok((f.key.clone(), copy))
                })
                .collect()
        }
        None => manifest
            .stdio_files
            .iter()
            .filter(|f| f.is_external())
            .map(|f| Ok((f.key.clone(), open(Path::new(&f.path))?)))
            .collect(),
    }
}

/// Host pids of the restored processes whose innermost pid is in `inner`, in that order.
/// The pids of the snapshot's CUDA processes as seen inside its PID namespace.
fn cuda_inner_pids(manifest: &Manifest) -> Vec<i32> {
    manifest
        .source
        .tree
        .iter()
        .filter(|p| p.cuda)
        .map(|p| p.ns_pid.last().copied().unwrap_or(p.pid))
        .collect()
}

/// Lets the driver's restore thread of each stopped CUDA process run alone.
fn run_restore_threads(
    driver: &CudaDriver,
    pids: &[i32],
) -> Result<Vec<restore_thread::RunningRestoreThread>, RestoreError> {
    let mut running = Vec::with_capacity(pids.len());
    for &pid in pids {
        // Each thread stops as CRIU lets it go; a thread seized before its stop is handled
        // too (RunningRestoreThread::start), so this only saves that detour.
        restore_thread::wait_stopped(pid, std::time::Duration::from_secs(1));
        let tid = driver
            .restore_thread_id(pid)
            .map_err(|source| RestoreError::Gpu {
                source: StepError {
                    step: "restore thread lookup",
                    pid,
                    source,
                },
            })?;
        running.push(
            restore_thread::RunningRestoreThread::start(pid, tid)
                .map_err(|source| RestoreError::RestoreThread { source })?,
        );
    }
    Ok(running)
}

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

fn parse_uuid(uuid: &str) -> Result<GpuUuid, RestoreError> {
    uuid.parse().map_err(|_| {
        ImageError::Invalid {
            reason: format!("GPU uuid {uuid:?} in the manifest is malformed"),
        }
        .into()
    })
}

/// The GPU of this node that takes over each GPU of the snapshot (in the manifest's order). The
/// driver needs a one-to-one pairing of *every* GPU the process could see: `--gpu` pairs first,
/// then each GPU onto itself where it is present and free, then GPUs the snapshot did not use
/// onto whatever is left (so `--gpu 0=1` on two GPUs swaps them). A used GPU is never moved
/// without being named.
fn assign_targets<'d>(
    gpu: &GpuSection,
    map: &[GpuMapping],
    devices: &'d [torpor_cuda::GpuDevice],
) -> Result<Vec<&'d torpor_cuda::GpuDevice>, RestoreError> {
    let mut targets: Vec<Option<&torpor_cuda::GpuDevice>> = vec![None; gpu.gpus.len()];
    let taken = |t: &[Option<&torpor_cuda::GpuDevice>], d: &torpor_cuda::GpuDevice| {
        t.iter().flatten().any(|x| x.uuid == d.uuid)
    };
    for (i, g) in gpu.gpus.iter().enumerate() {
        let old = parse_uuid(&g.uuid)?;
        if let Some(m) = map.iter().find(|m| m.old.matches(g.ordinal, &old)) {
            let dev = devices
                .iter()
                .find(|d| m.new.matches(d.ordinal as u32, &d.uuid))
                .ok_or_else(|| RestoreError::NoSuchGpu {
                    which: "target",
                    gpu: m.new.to_string(),
                })?;
            if taken(&targets, dev) {
                return Err(RestoreError::GpuTaken {
                    ordinal: g.ordinal,
                    target: dev.ordinal as u32,
                });
            }
            targets[i] = Some(dev);
        }
    }
    for (i, g) in gpu.gpus.iter().enumerate() {
        if targets[i].is_none() {
            let old = parse_uuid(&g.uuid)?;
            if let Some(dev) = devices.iter().find(|d| d.uuid == old) {
                if !taken(&targets, dev) {
                    targets[i] = Some(dev);
                }
            }
        }
    }
    for (i, g) in gpu.gpus.iter().enumerate() {
        if targets[i].is_some() {
            continue;
        }
        if g.used_by_snapshot != Some(0) {
            return Err(RestoreError::GpuMissing {
                ordinal: g.ordinal,
                name: g.name.clone(),
                uuid: g.uuid.clone(),
            });
        }
        let free = devices
            .iter()
            .filter(|d| !taken(&targets, d))
            .min_by_key(|d| (d.name != g.name, d.ordinal))
            .ok_or_else(|| RestoreError::GpuMissing {
                ordinal: g.ordinal,
                name: g.name.clone(),
                uuid: g.uuid.clone(),
            })?;
        targets[i] = Some(free);
    }
    Ok(targets.into_iter().flatten().collect())
}

/// Checks that the snapshot's GPU state can go onto this node's GPUs and works out the pairs
/// for the driver.
/// The driver and NVML, loaded once per process and kept: torpord restores many times, and
/// loading both (`nvmlInit` above all) cost 0.12–0.20 s of every restore on the H100 (the
/// `gpu_checks` phase). A failure is not kept: the next restore tries again.
fn loaded_driver() -> Result<&'static CudaDriver, RestoreError> {
    static DRIVER: OnceLock<CudaDriver> = OnceLock::new();
    if let Some(d) = DRIVER.get() {
        return Ok(d);
    }
    let d = CudaDriver::load().map_err(|source| RestoreError::Driver { source })?;
    Ok(DRIVER.get_or_init(|| d))
}

fn loaded_nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Nvml> = OnceLock::new();
    if let Some(n) = NVML.get() {
        return Some(n);
    }
    let n = Nvml::load().ok()?;
    Some(NVML.get_or_init(|| n))
}

fn plan_gpus(gpu: &GpuSection, map: &[GpuMapping]) -> Result<GpuPlan, RestoreError> {
    let driver = loaded_driver()?;
    let nvml = loaded_nvml();
    let here = match nvml.and_then(|n| n.driver_version().ok()) {
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
    let free = nvml.and_then(|n| n.gpus().ok());
    let targets = assign_targets(gpu, map, &devices)?;
    let mut pairs = Vec::new();
    let mut need_per_target: Vec<(GpuUuid, u64)> = Vec::new();
    for (g, target) in gpu.gpus.iter().zip(targets) {
        let old: GpuUuid = parse_uuid(&g.uuid)?;
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

/// Whether a restored tree reaches nothing in the host's `/run`: its `/run` is its own
/// (`mounts::run_is_its_own`) and no external mount (`mnt[KEY]:HOST_PATH`, as CRIU gets them)
/// comes from the host's `/run` either.
fn reaches_no_host_run(manifest: &Manifest, external: &[String]) -> bool {
    let from_run = |spec: &String| {
        spec.split_once("]:")
            .is_none_or(|(_, host)| Path::new(host).starts_with("/run"))
    };
    crate::mounts::run_is_its_own(&manifest.archived_mounts, &manifest.external_mounts)
        && !external.iter().any(from_run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu_map::parse_gpu_map;
    use torpor_cuda::GpuDevice;
    use torpor_image::GpuEntry;

    #[test]
    fn criu_gets_a_run_of_its_own_only_for_a_tree_that_reaches_nothing_in_the_hosts() {
        let mut m = Manifest::new(
            "test",
            torpor_image::Source {
                command: vec!["w".into()],
                root_pid: 1,
                tree: Vec::new(),
                leave_running: false,
            },
            torpor_image::Host {
                kernel: "6.18".into(),
                hostname: "h".into(),
                criu_version: "4.2.1".into(),
            },
        );
        let nv = vec!["mnt[nv]:/usr/local/nvidia".to_string()];
        // A tree that sees the host's /run (no tmpfs of its own there): never.
        assert!(!reaches_no_host_run(&m, &nv));
        m.archived_mounts.push(torpor_image::ArchivedMount {
            path: "/run".into(),
            fstype: "tmpfs".into(),
        });
        assert!(reaches_no_host_run(&m, &nv));
        // An external mount bound from the host's /run, by its mount point or by an override.
        let from_run = vec!["mnt[sock]:/run/nvidia-persistenced".to_string()];
        assert!(!reaches_no_host_run(&m, &from_run));
        m.external_mounts.push(torpor_image::ExternalMount {
            key: "x".into(),
            path: "/run/user/0".into(),
        });
        assert!(!reaches_no_host_run(&m, &nv));
    }

    fn dev(ordinal: i32, byte: u8) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: GpuUuid([byte; 16]),
            total_memory: 1 << 30,
        }
    }

    fn section(used: &[Option<u64>]) -> GpuSection {
        GpuSection {
            driver_version: "580.159.04".into(),
            cuda_driver_version: 13000,
            gpus: used
                .iter()
                .enumerate()
                .map(|(i, u)| GpuEntry {
                    ordinal: i as u32,
                    name: "NVIDIA H200".into(),
                    uuid: GpuUuid([i as u8 + 1; 16]).to_string(),
                    total_memory: 1 << 30,
                    used_by_snapshot: *u,
                })
                .collect(),
        }
    }

    fn ordinals(v: Vec<&GpuDevice>) -> Vec<i32> {
        v.iter().map(|d| d.ordinal).collect()
    }

    #[test]
    fn identity_without_a_map() {
        let devices = [dev(0, 1), dev(1, 2)];
        let t = assign_targets(&section(&[Some(5), Some(0)]), &[], &devices).unwrap();
        assert_eq!(ordinals(t), vec![0, 1]);
    }

    #[test]
    fn mapping_one_gpu_moves_the_unused_one_out_of_the_way() {
        // The driver refuses a pair list that does not cover every GPU the process saw.
        let devices = [dev(0, 1), dev(1, 2)];
        let map = parse_gpu_map("0=1").unwrap();
        let t = assign_targets(&section(&[Some(5), Some(0)]), &map, &devices).unwrap();
        assert_eq!(ordinals(t), vec![1, 0]);
    }

    #[test]
    fn a_used_gpu_is_never_moved_silently() {
        let devices = [dev(0, 1), dev(1, 2)];
        let map = parse_gpu_map("0=1").unwrap();
        let err = assign_targets(&section(&[Some(5), Some(7)]), &map, &devices).unwrap_err();
        assert!(
            matches!(err, RestoreError::GpuMissing { ordinal: 1, .. }),
            "{err}"
        );
        let map = parse_gpu_map("0=1,1=1").unwrap();
        let err = assign_targets(&section(&[Some(5), Some(7)]), &map, &devices).unwrap_err();
        assert!(matches!(err, RestoreError::GpuTaken { .. }), "{err}");
        let map = parse_gpu_map("0=1,1=0").unwrap();
        assert_eq!(
            ordinals(assign_targets(&section(&[Some(5), Some(7)]), &map, &devices).unwrap()),
            vec![1, 0]
        );
    }

    #[test]
    fn a_snapshot_gpu_missing_here_needs_a_mapping() {
        let devices = [dev(0, 9)];
        let err = assign_targets(&section(&[Some(5)]), &[], &devices).unwrap_err();
        assert!(err.to_string().contains("--gpu 0=NEW"), "{err}");
        let map = parse_gpu_map("0=0").unwrap();
        assert_eq!(
            ordinals(assign_targets(&section(&[Some(5)]), &map, &devices).unwrap()),
            vec![0]
        );
    }
}
