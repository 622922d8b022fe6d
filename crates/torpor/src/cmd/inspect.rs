use std::path::Path;
use std::process::ExitCode;

use torpor_image::Snapshot;

pub fn run(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let snapshot = Snapshot::open(dir)?;
    if json {
        println!("{}", snapshot.manifest().to_json()?);
    } else {
        print!("{}", torpor_image::render_summary(snapshot.manifest(), dir));
    }
    Ok(ExitCode::SUCCESS)
}
