//! `torpor logs NAME [--lines N] [--instance ID]`: the tail of each instance's log file, most
//! recently written first (GET /v1/functions/{name}/logs).

use std::process::ExitCode;

use torpord::api::logs::FunctionLogs;

use super::DaemonArgs;

pub fn run(
    daemon: &DaemonArgs,
    name: &str,
    lines: usize,
    instance: Option<&str>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    super::rm::check_name(name)?;
    let mut path = format!("/v1/functions/{name}/logs?lines={lines}");
    if let Some(id) = instance {
        // Instance ids are function names with a suffix: the same characters.
        super::rm::check_name(id).map_err(|_| {
            anyhow::anyhow!("{id:?} is not an instance id: see `torpor logs {name}` for them")
        })?;
        path.push_str(&format!("&instance={id}"));
    }
    let response = daemon.client().request("GET", &path, None)?.ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let logs: FunctionLogs = response.json()?;
    if logs.files.is_empty() {
        println!("no logs yet for {name}");
    }
    for f in &logs.files {
        let who = match &f.instance {
            Some(id) => format!("instance {id}"),
            None => "deploy".to_string(),
        };
        println!("==> {who}: {} ({} bytes) <==", f.path.display(), f.bytes);
        print!("{}", f.tail);
    }
    Ok(ExitCode::SUCCESS)
}
