//! Structured logs on stderr: human lines or JSON objects, one per event.

use std::io::IsTerminal;

use tracing_subscriber::filter::LevelFilter;

use crate::config::{LogFormat, LogLevel};

impl From<LogLevel> for LevelFilter {
    fn from(level: LogLevel) -> Self {
        match level {
            LogLevel::Error => LevelFilter::ERROR,
            LogLevel::Warn => LevelFilter::WARN,
            LogLevel::Info => LevelFilter::INFO,
            LogLevel::Debug => LevelFilter::DEBUG,
            LogLevel::Trace => LevelFilter::TRACE,
        }
    }
}

/// Installs the process-wide subscriber. Returns false if one was installed already (the
/// existing one is kept).
pub fn init(format: LogFormat, level: LogLevel) -> bool {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(LevelFilter::from(level));
    match format {
        LogFormat::Human => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init()
            .is_ok(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .try_init()
            .is_ok(),
    }
}
