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
    let pid = launch(&LaunchOptions {
        command,
        log: &log,
        state_dir: &state_dir,
        mounts: &MountPolicy::command(),
    })?;
    println!("{pid}");
    eprintln!("torpor: started pid {pid}, output in {}", log.display());
    Ok(ExitCode::SUCCESS)
}
