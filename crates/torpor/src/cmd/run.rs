use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use torpor_snapshot::checkpoints::Checkpoints;
use torpor_snapshot::launch::{launch, LaunchOptions};
use torpor_snapshot::mounts::MountPolicy;

pub fn run(
    log: Option<PathBuf>,
    periodic: Option<super::checkpointing::Periodic>,
    key: &super::KeyArgs,
    command: &[OsString],
) -> anyhow::Result<ExitCode> {
    if periodic.is_none() && (key.key.is_some() || key.unkeyed) {
        bail!("--key and --unkeyed seal checkpoints: pass them with --checkpoint-every, or leave them out");
    }
    // Everything that can refuse the checkpoints is checked before the job starts.
    let checkpointing = match &periodic {
        Some(p) => {
            let sealing = super::checkpointing::check(p, key, "torpor run --checkpoint-every")?;
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
        (Some(p), Some((cps, sealing))) => {
            super::checkpointing::until_exit(pid, &p, cps, sealing.as_ref())
        }
        _ => Ok(ExitCode::SUCCESS),
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
