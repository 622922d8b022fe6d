//! `torpor logs NAME [--lines N]`: the tail of the log files the function's workers write
//! (GET /v1/functions/{name}/logs).

use std::process::ExitCode;

use torpord::api::logs::FunctionLogs;

use super::DaemonArgs;

pub fn run(daemon: &DaemonArgs, name: &str, lines: usize, json: bool) -> anyhow::Result<ExitCode> {
    super::rm::check_name(name)?;
    let path = format!("/v1/functions/{name}/logs?lines={lines}");
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
        println!(
            "==> {} ({} bytes{}) <==",
            f.path.display(),
            f.bytes,
            if f.shared {
                ", shared with the other functions on its base"
            } else {
                ""
            }
        );
        print!("{}", f.tail);
    }
    Ok(ExitCode::SUCCESS)
}
