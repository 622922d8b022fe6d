use std::path::Path;
use std::process::ExitCode;

use torpor_snapshot::stage::stage;

use super::progress::Progress;

pub fn run(dir: &Path, to: &Path, key: &super::KeyArgs) -> anyhow::Result<ExitCode> {
    let key = key.checking_key()?;
    let progress = Progress::start(format!("staging {} into {}", dir.display(), to.display()));
    let staged = stage(dir, to, super::trust(key.as_ref()));
    progress.finish();
    let staged = staged?;
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
