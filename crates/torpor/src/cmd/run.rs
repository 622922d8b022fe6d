use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use torpor_snapshot::launch::{launch, LaunchOptions};
use torpor_snapshot::mounts::MountPolicy;

pub fn run(log: Option<PathBuf>, command: &[OsString]) -> anyhow::Result<ExitCode> {
    let log = log.unwrap_or_else(|| {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        super::log_dir().join(format!("run-{ms}.log"))
    });
    let state_dir = super::state_dir();
    let hook = hook_library();
    let pid = launch(&LaunchOptions {
        command,
        log: &log,
        state_dir: &state_dir,
        mounts: &MountPolicy::command(),
        preload: hook.as_deref(),
        cgroup: &[],
        user: None,
    })?;
    println!("{pid}");
    eprintln!("torpor: started pid {pid}, output in {}", log.display());
    Ok(ExitCode::SUCCESS)
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
