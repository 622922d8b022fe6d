use std::path::Path;
use std::process::ExitCode;

use torpor_snapshot::stage::stage;

use super::progress::Progress;

pub fn run(dir: &Path, to: &Path) -> anyhow::Result<ExitCode> {
    let progress = Progress::start(format!("staging {} into {}", dir.display(), to.display()));
    let staged = stage(dir, to);
    progress.finish();
    let staged = staged?;
    println!(
        "staged {} files, {} in {:.3} s ({} hard-linked) at {}",
        staged.files,
        torpor_image::human_size(staged.bytes),
        staged.elapsed_s,
        staged.linked,
        staged.dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
