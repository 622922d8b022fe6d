use std::process::ExitCode;

use serde_json::Value;

use super::DaemonArgs;

/// How long `--idempotency-key` keeps retrying a request whose daemon went away (a restart).
const RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// With an idempotency key a request is safe to send again: one whose connection failed (the
/// daemon restarting, killed mid-request) is retried for [`RETRY_FOR`]; the daemon runs it once.
fn retried(
    send: impl Fn() -> Result<torpord::client::Response, torpord::client::ClientError>,
) -> Result<torpord::client::Response, torpord::client::ClientError> {
    use torpord::client::ClientError;
    let deadline = std::time::Instant::now() + RETRY_FOR;
    loop {
        match send() {
            Err(
                ClientError::NotRunning { .. }
                | ClientError::Connect { .. }
                | ClientError::Io { .. },
            ) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// `torpor invoke NAME --data JSON`: prints the function's value (JSON) on stdout.
/// With `workflow`, NAME is a workflow's (docs/sandboxes.md), run as one request.
pub fn run(
    daemon: &DaemonArgs,
    name: &str,
    data: &str,
    verbose: bool,
    workflow: bool,
    idempotency_key: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let request: Value = serde_json::from_str(data).map_err(|e| {
        anyhow::anyhow!(
            "--data is not JSON ({e}): pass the request as JSON, e.g. --data '{{\"x\": [1, 2]}}'"
        )
    })?;
    let body = serde_json::to_vec(&request)?;
    // The daemon enforces the function's timeout_s; the client waits for its answer.
    let path = if workflow {
        format!("/v1/workflows/{name}/invoke")
    } else {
        format!("/v1/functions/{name}/invoke")
    };
    let key: Vec<(&str, &str)> = idempotency_key
        .map(|k| ("Idempotency-Key", k))
        .into_iter()
        .collect();
    let client = daemon.client_without_timeout();
    let send = || {
        client
            .send_with("POST", &path, Some(&body), &key)?
            .read_all()
    };
    let r = match idempotency_key {
        None => send()?,
        Some(_) => retried(send)?,
    };
    if verbose {
        let replayed = match r.header("idempotent-replayed") {
            Some("true") => "  (replayed: the answer of an earlier run of this key)",
            _ => "",
        };
        eprintln!(
            "start: {}  timings: {}{replayed}",
            r.header("x-torpor-start").unwrap_or("-"),
            r.header("x-torpor-timings").unwrap_or("-")
        );
    }
    if r.status == 200 {
        println!("{}", String::from_utf8_lossy(&r.body).trim_end());
        return Ok(ExitCode::SUCCESS);
    }
    let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    if let Some(e) = v.get("error").filter(|e| e.is_object()) {
        // The function raised: its traceback, then one line.
        if let Some(tb) = e
            .get("traceback")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        {
            eprintln!("{}", tb.trim_end());
        }
        let who = match e.get("stage").and_then(Value::as_str) {
            Some(stage) => format!("{name}'s stage {stage}"),
            None => name.to_string(),
        };
        anyhow::bail!(
            "{who} raised {}: {}",
            e["type"].as_str().unwrap_or("an exception"),
            e["message"].as_str().unwrap_or("")
        );
    }
    let mut msg = format!("torpord answered {}: {}", r.status, r.error_message());
    if let Some(after) = r.header("retry-after") {
        msg.push_str(&format!(" (Retry-After: {after} s)"));
    }
    anyhow::bail!(msg)
}
