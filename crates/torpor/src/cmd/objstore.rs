//! `torpor push` and `torpor pull`: snapshots to and from an S3-compatible object store.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use torpor_image::store::ChunkStore;
use torpor_objstore::{Progress as Step, PullReport, PushReport, Remote, RemoteConfig};

use super::progress::Progress;

/// Where the bucket is: `--objstore FILE` (docs/objstore.md).
#[derive(clap::Args, Debug, Clone)]
pub struct RemoteArgs {
    /// The local chunk store (created if needed).
    #[arg(long, value_name = "STORE")]
    pub store: PathBuf,
    /// The object store's configuration (endpoint, bucket, region, credentials_file).
    #[arg(
        long,
        value_name = "FILE",
        env = "TORPOR_OBJSTORE",
        default_value = "/etc/torpor/objstore.toml"
    )]
    pub objstore: PathBuf,
    /// Requests in flight at once.
    #[arg(long, default_value_t = torpor_objstore::DEFAULT_PARALLEL as u64, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub parallel: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl RemoteArgs {
    fn open(&self) -> anyhow::Result<(Remote, ChunkStore)> {
        let config = RemoteConfig::load(&self.objstore)?;
        let remote = Remote::open(&config)?;
        let store = ChunkStore::open(&self.store)?;
        Ok((remote, store))
    }
}

/// Draws a step on the spinner: `<what> <phase> <done>/<total>`.
fn reporter<'a>(progress: &'a Progress, what: &'a str) -> impl Fn(Step) + Sync + 'a {
    move |step: Step| {
        progress.message(format!(
            "{what}: {} {}/{}",
            step.phase.describe(),
            step.done,
            step.total
        ))
    }
}

/// `torpor push DIR --store STORE [--id ID]`.
pub fn push(
    dir: &Path,
    id: Option<&str>,
    args: &RemoteArgs,
    key: &super::KeyArgs,
) -> anyhow::Result<ExitCode> {
    let key = key.checking_key()?;
    let id = super::snapshot_id(dir, id, "--id")?;
    let (remote, store) = args.open()?;
    let what = format!("pushing {id}");
    let progress = Progress::start(what.clone());
    let pushed = torpor_objstore::push(
        &remote,
        &store,
        dir,
        &id,
        super::trust(key.as_ref()),
        args.parallel as usize,
        &reporter(&progress, &what),
    );
    progress.finish();
    let report: PushReport = pushed?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "pushed {} to bucket {}: {} chunks, {} uploaded ({}), {} already there{}; {}",
            report.id,
            report.bucket,
            report.chunks,
            report.uploaded,
            torpor_image::human_size(report.traffic.bytes_up),
            report.present,
            if report.already_pushed {
                " (the snapshot was there already)"
            } else {
                ""
            },
            super::authenticity(key.as_ref())
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `torpor pull ID --store STORE --out DIR`.
pub fn pull(
    id: &str,
    out: &Path,
    args: &RemoteArgs,
    key: &super::KeyArgs,
) -> anyhow::Result<ExitCode> {
    let key = key.checking_key()?;
    let (remote, store) = args.open()?;
    let what = format!("pulling {id}");
    let progress = Progress::start(what.clone());
    let pulled = torpor_objstore::pull(
        &remote,
        &store,
        id,
        out,
        super::trust(key.as_ref()),
        args.parallel as usize,
        &reporter(&progress, &what),
    );
    progress.finish();
    let report: PullReport = pulled?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "pulled {} from bucket {} into {}: {} chunks, {} fetched ({}), {} already in {}; {}",
            report.id,
            report.bucket,
            report.out.display(),
            report.chunks,
            report.fetched,
            torpor_image::human_size(report.traffic.bytes_down),
            report.local,
            store.root().display(),
            super::authenticity(key.as_ref())
        );
    }
    Ok(ExitCode::SUCCESS)
}
