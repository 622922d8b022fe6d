use std::process::ExitCode;

pub fn run(args: &torpord::ServeArgs) -> anyhow::Result<ExitCode> {
    torpord::run(args)?;
    Ok(ExitCode::SUCCESS)
}
