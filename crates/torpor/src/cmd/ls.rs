use std::process::ExitCode;

use torpord::api::types::{FunctionList, FunctionSummary};

use super::DaemonArgs;

pub fn run(daemon: &DaemonArgs, json: bool) -> anyhow::Result<ExitCode> {
    let response = daemon
        .client()
        .request("GET", "/v1/functions", None)?
        .ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let list: FunctionList = response.json()?;
    if list.functions.is_empty() {
        println!("no functions deployed");
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<[String; 4]> = list
        .functions
        .iter()
        .map(|f| {
            [
                f.name.clone(),
                f.state.to_string(),
                instances(f, &list),
                format!("{} ago", super::ago(f.updated)),
            ]
        })
        .collect();
    let header = ["NAME", "STATE", "INSTANCES", "UPDATED"].map(String::from);
    let mut widths = [0; 4];
    for row in std::iter::once(&header).chain(&rows) {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let line: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
    Ok(ExitCode::SUCCESS)
}

/// The INSTANCES cell: a sandbox's member is served by its host's instances, so it names them.
fn instances(f: &FunctionSummary, list: &FunctionList) -> String {
    match &f.sandbox_host {
        Some(host) => {
            let counts = list
                .functions
                .iter()
                .find(|h| &h.name == host)
                .map_or_else(|| "?".to_string(), |h| super::stages(&h.instances));
            format!("in {host}'s sandbox: {counts}")
        }
        None => super::stages(&f.instances),
    }
}
