//! A spinner with the elapsed time on stderr while a long step runs (deploy, snapshot, stage),
//! only when stderr is a terminal: piped or logged output stays exactly as without it. indicatif
//! is the maintained crate for this; it redraws from its own thread, so a step that blocks (a
//! CRIU dump) still shows time passing.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the spinner redraws.
const TICK: Duration = Duration::from_millis(100);

/// A running spinner, or nothing when stderr is not a terminal. Cleared when dropped.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// Starts `{spinner} {message} {elapsed}` on stderr if it is a terminal.
    pub fn start(message: impl Into<String>) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self(None);
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        let style = ProgressStyle::with_template("{spinner} {msg} {elapsed:.dim}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        bar.set_style(style);
        bar.set_message(message.into());
        bar.enable_steady_tick(TICK);
        Self(Some(bar))
    }

    /// A new message, and the elapsed time counted from now.
    pub fn next(&self, message: impl Into<String>) {
        if let Some(bar) = &self.0 {
            bar.reset_elapsed();
            bar.set_message(message.into());
        }
    }

    /// A new message, the elapsed time kept (progress within one step).
    pub fn message(&self, message: impl Into<String>) {
        if let Some(bar) = &self.0 {
            bar.set_message(message.into());
        }
    }

    /// Runs `f` (which prints) with the spinner out of the way, so that lines do not mix.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.0 {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Clears the spinner now (dropping it does too).
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
