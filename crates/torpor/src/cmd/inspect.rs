use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use torpor_image::store::ChunkStore;
use torpor_image::Snapshot;

/// `torpor inspect DIR [--json] [--store STORE [--store-id ID]]`.
pub fn run(
    dir: &Path,
    json: bool,
    store: Option<&Path>,
    store_id: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let snapshot = Snapshot::open(dir)?;
    let usage = match store {
        None => None,
        Some(root) => {
            let id = match store_id {
                Some(id) => id.to_owned(),
                None => dir
                    .canonicalize()
                    .ok()
                    .and_then(|d| d.file_name()?.to_str().map(str::to_owned))
                    .context(format!(
                        "cannot name {} in the store: pass --store-id",
                        dir.display()
                    ))?,
            };
            let store = ChunkStore::open_existing(root)?;
            Some((store.usage(&id)?, store))
        }
    };
    if json {
        match usage {
            None => println!("{}", snapshot.manifest().to_json()?),
            Some((usage, _)) => {
                let both = serde_json::json!({ "manifest": snapshot.manifest(), "store": usage });
                println!("{}", serde_json::to_string_pretty(&both)?);
            }
        }
    } else {
        print!("{}", torpor_image::render_summary(snapshot.manifest(), dir));
        if let Some((usage, store)) = usage {
            print!("{}", torpor_image::render_store_usage(&usage, store.root()));
        }
    }
    Ok(ExitCode::SUCCESS)
}
