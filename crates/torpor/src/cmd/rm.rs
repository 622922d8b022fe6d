//! `torpor rm NAME`: deletes a function (DELETE /v1/functions/{name}): its live instances are
//! stopped, its snapshots (function and hibernation) removed; the shared base stays.

use std::process::ExitCode;

use torpord::api::types::Deleted;

use super::DaemonArgs;

pub fn run(daemon: &DaemonArgs, name: &str, json: bool) -> anyhow::Result<ExitCode> {
    check_name(name)?;
    let path = format!("/v1/functions/{name}");
    let response = daemon.client().request("DELETE", &path, None)?.ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let d: Deleted = response.json()?;
    println!(
        "deleted {} ({} snapshot{} removed)",
        d.deleted,
        d.snapshots.len(),
        if d.snapshots.len() == 1 { "" } else { "s" }
    );
    for (dir, why) in &d.left_behind {
        eprintln!("warning: {} left on disk: {why}", dir.display());
    }
    Ok(if d.left_behind.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Refuses what cannot be a function name (and would not fit in a URL path as is).
pub fn check_name(name: &str) -> anyhow::Result<()> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        anyhow::bail!(
            "{name:?} is not a function name (letters, digits, '-', '_', '.'): see `torpor ls`"
        );
    }
    Ok(())
}
