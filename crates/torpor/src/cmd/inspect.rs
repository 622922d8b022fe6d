use std::path::Path;
use std::process::ExitCode;

use torpor_image::store::ChunkStore;
use torpor_image::{ImageError, KeyError, Sealing, Snapshot, SnapshotKey, Trust};

/// `torpor inspect DIR [--json] [--store STORE [--store-id ID]]`.
pub fn run(
    dir: &Path,
    json: bool,
    store: Option<&Path>,
    store_id: Option<&str>,
    key: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    if torpor_snapshot::checkpoints::is_checkpoint_dir(dir) {
        if store.is_some() || key.is_some() {
            anyhow::bail!(
                "{} is a checkpoint directory, whose store is its own: leave --store and --key out (`torpor restore {}` checks the newest's seal)",
                dir.display(),
                dir.display()
            );
        }
        return checkpoints(dir, json);
    }
    let snapshot = Snapshot::open(dir)?;
    let seal = seal_line(&snapshot, key)?;
    let usage = match store {
        None => None,
        Some(root) => {
            let id = super::snapshot_id(dir, store_id, "--store-id")?;
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
        println!("seal      {seal}");
        if let Some((usage, store)) = usage {
            print!("{}", torpor_image::render_store_usage(&usage, store.root()));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A checkpoint directory (`torpor run --checkpoint-every`): each checkpoint kept and the space
/// it takes in the directory's store.
fn checkpoints(dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let used = torpor_snapshot::checkpoints::usage(dir)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&used)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "checkpoints of {} (newest last; `torpor restore {}` restores the newest):",
        dir.display(),
        dir.display()
    );
    for u in &used {
        println!(
            "  {}  {} ({} files), {} on disk with what it shares, {} its own",
            u.snapshot,
            super::human(u.logical),
            u.recipes,
            super::human(u.stored),
            super::human(u.exclusive),
        );
    }
    if used.is_empty() {
        println!("  none");
    }
    Ok(ExitCode::SUCCESS)
}

/// What `manifest.mac` says and, where a key is at hand, whether it holds. Never refuses: inspect
/// shows what is there (restore and verify refuse).
fn seal_line(snapshot: &Snapshot, key: Option<&Path>) -> anyhow::Result<String> {
    let seal = match snapshot.sealing() {
        Sealing::Unsealed => {
            return Ok("none: unkeyed (hashes only; nothing proves who wrote it; restore and verify need --unkeyed)".into())
        }
        Sealing::Malformed => {
            return Ok("manifest.mac is not a torpor MAC (restore and verify refuse it)".into())
        }
        Sealing::Sealed(seal) => seal,
    };
    let key_args = super::KeyArgs {
        key: key.map(Path::to_path_buf),
        unkeyed: false,
    };
    let path = key_args.path()?.unwrap_or_default();
    let key = match SnapshotKey::load(&path) {
        Ok(k) => k,
        // No key here: say so, the snapshot is still worth showing.
        Err(KeyError::Missing { .. }) if key_args.key.is_none() => {
            return Ok(format!(
                "key {} (not checked: no key at {}; pass --key)",
                seal.key_id,
                path.display()
            ))
        }
        Err(e) => return Err(e.into()),
    };
    Ok(match snapshot.authenticate(Trust::Key(&key)) {
        Ok(()) => format!(
            "key {}: the manifest is authentic under {}",
            seal.key_id,
            path.display()
        ),
        Err(ImageError::SealOtherKey { .. }) => format!(
            "key {} (another key than {}, which is {}: not checked)",
            seal.key_id,
            path.display(),
            key.id()
        ),
        Err(_) => format!(
            "key {}: INVALID, the manifest was changed after it was sealed (restore and verify refuse it)",
            seal.key_id
        ),
    })
}
