//! `torpord`: Torpor's node daemon in the foreground (the same as `torpor serve`).

use std::process::ExitCode;

use clap::Parser;

#[derive(Parser)]
#[command(name = "torpord", version, about = "Torpor's node daemon")]
struct Cli {
    #[command(flatten)]
    serve: torpord::ServeArgs,
}

fn main() -> ExitCode {
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
