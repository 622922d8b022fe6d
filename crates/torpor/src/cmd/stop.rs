//! `torpor stop NAME`: takes every live instance of a function out of service, the deploy kept
//! (POST /v1/functions/{name}/stop): idle ones now, busy ones when their requests end; its
//! hibernated instances are discarded too unless `--keep-hibernated`. The next request restores
//! a fresh instance from the function snapshot.

use std::process::ExitCode;

use torpord::api::types::{StopRequest, Stopped};

use super::rm::check_name;
use super::DaemonArgs;

pub fn run(
    daemon: &DaemonArgs,
    name: &str,
    keep_hibernated: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    check_name(name)?;
    let body = serde_json::to_vec(&StopRequest { keep_hibernated })?;
    let path = format!("/v1/functions/{name}/stop");
    let response = daemon.client().request("POST", &path, Some(&body))?.ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let s: Stopped = response.json()?;
    let list = |ids: &[String]| {
        if ids.is_empty() {
            String::new()
        } else {
            format!(" ({})", ids.join(", "))
        }
    };
    println!(
        "stopped {}: {} idle instance{} stopped{}, {} busy one{} stopping after {} request{}{}, {} hibernated discarded{}",
        s.function,
        s.stopped.len(),
        plural(s.stopped.len()),
        list(&s.stopped),
        s.retiring.len(),
        plural(s.retiring.len()),
        if s.retiring.len() == 1 { "its" } else { "their" },
        plural(s.retiring.len()),
        list(&s.retiring),
        s.discarded.len(),
        list(&s.discarded),
    );
    Ok(ExitCode::SUCCESS)
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}
