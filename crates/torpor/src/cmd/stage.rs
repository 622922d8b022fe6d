use std::path::Path;
use std::process::ExitCode;

use torpor_snapshot::stage::stage;

pub fn run(dir: &Path, to: &Path, key: &super::KeyArgs) -> anyhow::Result<ExitCode> {
    let key = key.checking_key()?;
    let staged = stage(dir, to, super::trust(key.as_ref()))?;
    println!(
        "staged {} files, {} in {:.3} s ({} hard-linked) at {}; {}",
        staged.files,
        torpor_image::human_size(staged.bytes),
        staged.elapsed_s,
        staged.linked,
        staged.dir.display(),
        super::authenticity(key.as_ref())
    );
    Ok(ExitCode::SUCCESS)
}
