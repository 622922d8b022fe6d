//! `torpord`: Torpor's node daemon in the foreground (the same as `torpor serve`).

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(name = "torpord", version, about = "Torpor's node daemon")]
struct Cli {
    #[command(flatten)]
    serve: torpord::ServeArgs,
}

fn main() -> ExitCode {
    // The internal subcommands of workers: the init `torpor run` execs inside the new namespaces,
    // and the launcher the daemon runs for each worker (see torpord::launcher).
    // As in `torpor`: the snapshot engine enumerates every GPU of the node; workers keep the
    // variable of their own environment. Removed while the process is single-threaded.
    std::env::remove_var("CUDA_VISIBLE_DEVICES");
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.len() > 1 && args[1] == torpor_snapshot::launch::INIT_SUBCOMMAND {
        return init(&args[2..]);
    }
    if args.len() > 1 && args[1] == torpor_snapshot::page_server::SUBCOMMAND {
        return ExitCode::from(torpor_snapshot::page_server::main(&args[2..]) as u8);
    }
    if args.len() > 1 && args[1] == torpord::launcher::LAUNCH_SUBCOMMAND {
        return torpord::launcher::launch_main(&args[2..]);
    }
    let cli = Cli::parse();
    match torpord::run(&cli.serve) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // The error names its cause and the fix on one line.
            eprintln!("torpord: error: {}", err.to_string().replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

/// `__init REPORT_FD LOG CMD…`.
fn init(args: &[OsString]) -> ExitCode {
    let report_fd = args
        .first()
        .and_then(|a| a.to_str())
        .and_then(|a| a.parse::<i32>().ok());
    match (report_fd, args.get(1)) {
        (Some(fd), Some(log)) if args.len() > 2 => {
            let code = torpor_snapshot::launch::init_main(fd, Path::new(log), &args[2..]);
            ExitCode::from(code.clamp(0, 255) as u8)
        }
        _ => {
            eprintln!("usage: torpord __init REPORT_FD LOG CMD... (internal to torpor run)");
            ExitCode::from(2)
        }
    }
}
