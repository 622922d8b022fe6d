use std::path::Path;
use std::process::ExitCode;

use torpor_image::Snapshot;

pub fn run(dir: &Path) -> anyhow::Result<ExitCode> {
    let snapshot = Snapshot::open(dir)?;
    snapshot.verify()?;
    let m = snapshot.manifest();
    println!(
        "ok: {} files, {} verified",
        m.files.len(),
        super::human(m.total_size())
    );
    Ok(ExitCode::SUCCESS)
}
