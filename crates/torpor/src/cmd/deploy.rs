use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

use super::progress::Progress;
use super::DaemonArgs;

/// `torpor deploy DIR`: prints each phase as the daemon reports it, then the result.
pub fn run(daemon: &DaemonArgs, dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let dir = std::path::absolute(dir)
        .map_err(|e| anyhow::anyhow!("cannot make {} absolute: {e}", dir.display()))?;
    if dir.join("workflow.toml").exists() && !dir.join("torpor.toml").exists() {
        return workflow(daemon, &dir, json);
    }
    let body = serde_json::to_vec(&serde_json::json!({ "dir": dir }))?;
    // A deploy that boots a framework may be silent for minutes between phases: no timeout.
    let response = daemon
        .client_without_timeout()
        .send("POST", "/v1/functions", Some(&body))?;
    if response.status != 200 {
        response.read_all()?.ok()?;
        anyhow::bail!("torpord answered an unexpected status");
    }
    let mut ok = false;
    let mut seen_end = false;
    let what = dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let progress = Progress::start(format!("deploy {what}: validating"));
    for line in BufReader::new(response.body).lines() {
        let line = line.map_err(|e| anyhow::anyhow!("reading the deploy's progress: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        if json {
            progress.suspend(|| println!("{line}"));
        }
        let v: Value = serde_json::from_str(&line)?;
        if let Some(phase) = v.get("phase").and_then(Value::as_str) {
            if v.get("error").is_none() {
                if !json {
                    let s = v.get("s").and_then(Value::as_f64).unwrap_or(0.0);
                    progress.suspend(|| {
                        println!(
                            "{phase:<18} {:>9.3} s{}{}",
                            s,
                            snapshot_details(&v),
                            packing_details(&v)
                        )
                    });
                }
                progress.next(format!("deploy {what}: {phase} done, next phase"));
                continue;
            }
        }
        progress.finish();
        seen_end = true;
        if let Some(r) = v.get("result") {
            ok = true;
            if !json {
                println!(
                    "deployed {} in {:.3} s (snapshot {}, base {}{})",
                    r["function"].as_str().unwrap_or("?"),
                    r["total_s"].as_f64().unwrap_or(0.0),
                    r["snapshot"].as_str().unwrap_or("?"),
                    r["base"].as_str().unwrap_or("?"),
                    if r["base_reused"].as_bool() == Some(true) {
                        ", reused"
                    } else {
                        ""
                    }
                );
            }
        } else if let Some(e) = v.get("error").and_then(Value::as_str) {
            let phase = v.get("phase").and_then(Value::as_str).unwrap_or("?");
            let mut msg = format!("deploy failed in {phase}: {e}");
            if let Some(tb) = v
                .pointer("/worker_error/error/traceback")
                .and_then(Value::as_str)
            {
                if !json && !tb.is_empty() {
                    eprintln!("{}", tb.trim_end());
                }
            }
            if v.get("previous_kept").and_then(Value::as_bool) == Some(true) {
                msg.push_str(" (the previously deployed version stays in service)");
            }
            anyhow::bail!(msg);
        }
    }
    if !seen_end {
        anyhow::bail!("torpord ended the deploy's answer without a result: see its log");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What the `snapshot_function` line adds (docs/split.md, "Capture"): how long the instance
/// was stopped and, for a split snapshot, its segments; empty for other phases.
fn snapshot_details(v: &Value) -> String {
    let Some(stop) = v.get("stop_s").and_then(Value::as_f64) else {
        return String::new();
    };
    let mut out = format!("  (instance stopped {stop:.3} s");
    if v.get("split").and_then(Value::as_bool) == Some(true) {
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        out.push_str(&format!(
            "; split: {} segments ({} read-only), {}, {} new in the chunk store",
            n("segments"),
            n("readonly_segments"),
            super::human(n("segment_bytes")),
            super::human(n("stored_bytes"))
        ));
    }
    out.push(')');
    out
}

/// What the `load` and `load_sandbox` lines add: the weights the harness packed into segments
/// of their own, which instances share read-only (docs/split.md, "Weight packing"); empty when
/// nothing was packed (CPU functions, packing off or refused: the worker's log says why).
fn packing_details(v: &Value) -> String {
    let one = |p: &Value| {
        let n = |k: &str| p.get(k).and_then(Value::as_u64).unwrap_or(0);
        let whole = p.get("whole").and_then(Value::as_bool) != Some(false);
        format!(
            "{} in {} segment{}{}",
            super::human(n("bytes")),
            n("segments"),
            if n("segments") == 1 { "" } else { "s" },
            if whole { "" } else { ", not all whole" }
        )
    };
    // `load`: the function's own; `load_sandbox`: each other member's, by name.
    let parts: Vec<String> = match (v.get("phase").and_then(Value::as_str), v.get("packed")) {
        (Some("load"), Some(p)) if p.is_object() => vec![one(p)],
        (Some("load_sandbox"), Some(Value::Object(members))) => members
            .iter()
            .map(|(name, p)| format!("{name} {}", one(p)))
            .collect(),
        _ => Vec::new(),
    };
    if parts.is_empty() {
        String::new()
    } else {
        format!("  (weights packed: {})", parts.join("; "))
    }
}

/// `torpor deploy DIR` of a directory holding workflow.toml (and no torpor.toml): records the
/// workflow (docs/sandboxes.md); its functions are deployed on their own beforehand.
fn workflow(daemon: &DaemonArgs, dir: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let body = serde_json::to_vec(&serde_json::json!({ "dir": dir }))?;
    let r = daemon
        .client_without_timeout()
        .request("POST", "/v1/workflows", Some(&body))?;
    if r.status != 200 {
        anyhow::bail!("torpord answered {}: {}", r.status, r.error_message());
    }
    if json {
        println!("{}", String::from_utf8_lossy(&r.body).trim_end());
        return Ok(ExitCode::SUCCESS);
    }
    let v: Value = serde_json::from_slice(&r.body)?;
    let stages: Vec<&str> = v["stages"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["function"].as_str()).collect())
        .unwrap_or_default();
    println!(
        "deployed workflow {} ({} stages: {}; {})",
        v["workflow"].as_str().unwrap_or("?"),
        stages.len(),
        stages.join(" → "),
        if v["one_sandbox"].as_bool() == Some(true) {
            "one sandbox"
        } else {
            "stages in their own instances"
        }
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::packing_details;

    #[test]
    fn the_load_lines_say_what_was_packed() {
        let load = json!({"phase": "load", "s": 0.5, "packed": {"bytes": 347_859_984u64, "segments": 2, "whole": true}});
        let text = packing_details(&load);
        assert!(
            text.starts_with("  (weights packed: ") && text.contains("in 2 segments)"),
            "{text}"
        );
        let members = json!({"phase": "load_sandbox", "s": 1.2, "packed": {
            "vision-bert-classify": {"bytes": 102_475_168u64, "segments": 1, "whole": true},
            "vision-bert-detect": {"bytes": 77_822_384u64, "segments": 1, "whole": false},
        }});
        let text = packing_details(&members);
        assert!(
            text.contains("vision-bert-classify ") && text.contains("in 1 segment;"),
            "{text}"
        );
        assert!(
            text.contains("vision-bert-detect ") && text.ends_with("in 1 segment, not all whole)"),
            "{text}"
        );
        // Nothing packed (a CPU function, an older daemon): nothing added.
        assert_eq!(
            packing_details(&json!({"phase": "load_sandbox", "packed": {}})),
            ""
        );
        assert_eq!(packing_details(&json!({"phase": "load", "s": 0.1})), "");
        assert_eq!(
            packing_details(&json!({"phase": "stage", "packed": {"bytes": 1}})),
            ""
        );
    }
}
