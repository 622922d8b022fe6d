use std::process::ExitCode;

use torpord::api::types::Status;

use super::DaemonArgs;

pub fn run(daemon: &DaemonArgs, json: bool) -> anyhow::Result<ExitCode> {
    let response = daemon.client().request("GET", "/v1/status", None)?.ok()?;
    if json {
        println!("{}", String::from_utf8_lossy(&response.body));
        return Ok(ExitCode::SUCCESS);
    }
    let s: Status = response.json()?;
    println!(
        "torpord {} (pid {}), up {}",
        s.version,
        s.pid,
        super::short_duration(s.uptime_s)
    );
    println!("socket      {}", s.socket.display());
    match s.tcp {
        Some(addr) => println!("tcp         {addr} (bearer token required)"),
        None => println!("tcp         off"),
    }
    println!("state dir   {}", s.state_dir.display());
    match &s.config_file {
        Some(f) => println!("config      {}", f.display()),
        None => println!("config      none (defaults and flags)"),
    }
    println!("functions   {}", s.functions);
    println!(
        "snapshots   {} base, {} function, {} hibernation",
        s.snapshots.base, s.snapshots.function, s.snapshots.hibernation
    );
    println!("instances   {}", super::stages(&s.instances));
    println!(
        "keep-alive  GPU released after {} s idle, hibernated after {} s, evicted after {} s",
        s.keepalive.gpu_release_s, s.keepalive.hibernate_s, s.keepalive.evict_s
    );
    println!(
        "queue       {} requests per function, {} s timeout",
        s.queue.length, s.queue.timeout_s
    );
    let h = &s.hook;
    match (&h.library, &h.missing) {
        (Some(lib), _) => println!(
            "hook        {} (split {}, GPU memory split {}, GPU workers: {})",
            lib.display(),
            on(h.split),
            on(h.split_gpu),
            h.gpu_workers
        ),
        (None, Some(why)) => println!("hook        none: {why}"),
        (None, None) => println!("hook        none"),
    }
    Ok(ExitCode::SUCCESS)
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}
