use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use torpor_snapshot::checkpoints::Checkpoints;
use torpor_snapshot::interrupt;
use torpor_snapshot::launch::{launch, LaunchOptions};
use torpor_snapshot::mounts::MountPolicy;

/// `--checkpoint-every`: checkpoint the job periodically (docs/checkpoints.md).
pub struct Periodic {
    pub every: f64,
    pub dir: PathBuf,
    pub keep: usize,
    pub timeout: f64,
    /// Pre-dump rounds of each checkpoint (0: stop-the-world).
    pub pre_dump_rounds: u32,
}

pub fn run(
    log: Option<PathBuf>,
    periodic: Option<Periodic>,
    key: &super::KeyArgs,
    command: &[OsString],
) -> anyhow::Result<ExitCode> {
    if periodic.is_none() && (key.key.is_some() || key.unkeyed) {
        bail!("--key and --unkeyed seal checkpoints: pass them with --checkpoint-every, or leave them out");
    }
    // Everything that can refuse the checkpoints is checked before the job starts.
    let checkpointing = match &periodic {
        Some(p) => {
            if !(p.every.is_finite() && p.every > 0.0) {
                bail!(
                    "--checkpoint-every must be a positive number of seconds, got {}",
                    p.every
                );
            }
            if !(p.timeout.is_finite() && p.timeout > 0.0) {
                bail!(
                    "--timeout must be a positive number of seconds, got {}",
                    p.timeout
                );
            }
            if p.keep == 0 {
                bail!(
                    "--keep must be at least 1 (the newest checkpoint is the one a restore needs)"
                );
            }
            torpor_snapshot::preflight::require_root("torpor run --checkpoint-every")?;
            if p.pre_dump_rounds > 0 {
                match torpor_snapshot::dirty_tracking::available() {
                    Ok(true) => {}
                    Ok(false) => bail!("--concurrent-rounds needs the kernel's soft-dirty page tracking (CONFIG_MEM_SOFT_DIRTY), which this kernel lacks: leave --concurrent-rounds out (stop-the-world checkpoints)"),
                    Err(e) => bail!("--concurrent-rounds needs the kernel's soft-dirty page tracking, which could not be probed ({e}): leave --concurrent-rounds out (stop-the-world checkpoints)"),
                }
            }
            let sealing = key.sealing_key()?;
            Some((Checkpoints::open(&p.dir)?, sealing))
        }
        None => None,
    };
    let log = log.unwrap_or_else(|| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        super::log_dir().join(format!("run-{ms}.log"))
    });
    let state_dir = super::state_dir();
    let hook = hook_library();
    // The launch moves this process into the job's new namespaces (its /proc is the job's): a
    // checkpointer goes back to its own before it looks at the job.
    let home = match checkpointing {
        Some(_) => Some(Namespaces::current()?),
        None => None,
    };
    let pid = launch(&LaunchOptions {
        command,
        log: &log,
        state_dir: &state_dir,
        mounts: &MountPolicy::command(),
        preload: hook.as_deref(),
        cgroup: &[],
        user: None,
    })?;
    if let Some(home) = home {
        home.enter()?;
    }
    println!("{pid}");
    let _ = std::io::stdout().flush();
    eprintln!("torpor: started pid {pid}, output in {}", log.display());
    match (periodic, checkpointing) {
        (Some(p), Some((cps, sealing))) => checkpoint_until_exit(pid, &p, cps, sealing.as_ref()),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// Checkpoints the job every `p.every` seconds until it exits; returns its exit status (128 +
/// the signal when a signal ended it). A checkpoint that fails is reported and the job runs on
/// (the snapshot's guarantee); the next one is tried on time. SIGINT/SIGTERM stop the
/// checkpointing and leave the job running.
fn checkpoint_until_exit(
    pid: i32,
    p: &Periodic,
    mut cps: Checkpoints,
    key: Option<&torpor_image::SnapshotKey>,
) -> anyhow::Result<ExitCode> {
    interrupt::install();
    let every = Duration::from_secs_f64(p.every);
    let log_dir = super::log_dir();
    eprintln!(
        "torpor: checkpointing pid {pid} every {} s into {} (keeping {}), {}",
        p.every,
        cps.dir().display(),
        p.keep,
        if p.pre_dump_rounds > 0 {
            format!("concurrently ({} pre-dump rounds each)", p.pre_dump_rounds)
        } else {
            "stop-the-world".to_string()
        }
    );
    let mut next = Instant::now() + every;
    loop {
        if let Some(code) = exited(pid)? {
            eprintln!(
                "torpor: pid {pid} exited with status {code}; checkpoints stay in {}",
                cps.dir().display()
            );
            return Ok(ExitCode::from(code.clamp(0, 255) as u8));
        }
        if interrupt::interrupted() {
            eprintln!("torpor: interrupted: checkpointing stopped, pid {pid} keeps running");
            return Ok(ExitCode::from(130));
        }
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        next = Instant::now() + every;
        match cps.take(
            pid,
            p.keep,
            p.pre_dump_rounds,
            Duration::from_secs_f64(p.timeout),
            &log_dir,
            key,
        ) {
            Ok(t) => {
                for w in &t.warnings {
                    eprintln!("torpor: warning: {w}");
                }
                let pruned = if t.pruned.is_empty() {
                    String::new()
                } else {
                    format!("; pruned {}", t.pruned.join(", "))
                };
                eprintln!(
                    "torpor: checkpoint {}: job stopped {:.3} s; {} ({} chunks), {} new to the store ({} chunks); took {:.3} s{pruned}",
                    t.id,
                    t.stop_s,
                    super::human(t.stats.logical_bytes),
                    t.stats.chunks,
                    super::human(t.stats.new_raw_bytes),
                    t.stats.new_chunks,
                    t.total_s,
                );
            }
            // The job may have ended during the checkpoint: the loop's next turn says so.
            Err(_) if exited_quietly(pid) => {}
            Err(e) => eprintln!(
                "torpor: warning: checkpoint failed, pid {pid} keeps running: {}",
                e.to_string().replace('\n', " ")
            ),
        }
    }
}

/// This process's mount, network and PID namespaces and working directory, to come back to.
struct Namespaces {
    mnt: std::fs::File,
    net: std::fs::File,
    pid: std::fs::File,
    cwd: std::fs::File,
}

impl Namespaces {
    fn current() -> anyhow::Result<Namespaces> {
        let open =
            |p: &str| std::fs::File::open(p).map_err(|e| anyhow::anyhow!("cannot open {p}: {e}"));
        Ok(Namespaces {
            mnt: open("/proc/self/ns/mnt")?,
            net: open("/proc/self/ns/net")?,
            pid: open("/proc/self/ns/pid_for_children")?,
            cwd: open(".")?,
        })
    }

    /// Returns this (single-threaded) process to the namespaces it was in.
    fn enter(self) -> anyhow::Result<()> {
        use std::os::fd::AsRawFd;
        for (f, kind, name) in [
            (&self.mnt, libc::CLONE_NEWNS, "mount"),
            (&self.net, libc::CLONE_NEWNET, "network"),
            (&self.pid, libc::CLONE_NEWPID, "PID"),
        ] {
            // SAFETY: setns on a namespace descriptor we own; the CLI has started no threads
            // yet (a mount namespace cannot be entered by a multi-threaded process).
            if unsafe { libc::setns(f.as_raw_fd(), kind) } != 0 {
                bail!(
                    "cannot return to torpor's own {name} namespace after starting the job: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        // SAFETY: fchdir on a directory descriptor we own.
        if unsafe { libc::fchdir(self.cwd.as_raw_fd()) } != 0 {
            bail!(
                "cannot return to the working directory: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }
}

/// The job's exit status once it has exited (reaped: torpor run is the init's parent).
fn exited(pid: i32) -> anyhow::Result<Option<i32>> {
    let mut status = 0;
    // SAFETY: waitpid on our own child with a valid pointer to a local.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    if r == 0 {
        return Ok(None);
    }
    if r < 0 {
        bail!(
            "cannot wait for pid {pid}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(Some(if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }))
}

/// Whether the job is gone or a zombie (without reaping it).
fn exited_quietly(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// libtorpor_hook.so, preloaded into the tree. Without `TORPOR_HOOK_CUDA` it changes no
/// allocation; it only records GPU state the driver's checkpoint cannot restore (CUDA IPC, managed
/// memory, a NCCL communicator of several ranks), so that `torpor snapshot` refuses such a tree
/// before it touches it instead of leaving it stuck.
fn hook_library() -> Option<std::path::PathBuf> {
    match torpord::split::find_hook_lib() {
        Ok(hook) => Some(hook),
        Err(e) => {
            eprintln!(
                "torpor: note: {e}; without it a snapshot cannot see CUDA IPC or managed memory \
                 before touching the driver"
            );
            None
        }
    }
}
