use std::path::Path;
use std::process::ExitCode;

use torpor_image::Snapshot;

pub fn run(dir: &Path, key: &super::KeyArgs) -> anyhow::Result<ExitCode> {
    let key = key.checking_key()?;
    let snapshot = Snapshot::open(dir)?;
    snapshot.authenticate(super::trust(key.as_ref()))?;
    snapshot.verify()?;
    let m = snapshot.manifest();
    println!(
        "ok: {} files, {} verified; {}",
        m.files.len(),
        super::human(m.total_size()),
        super::authenticity(key.as_ref())
    );
    Ok(ExitCode::SUCCESS)
}
