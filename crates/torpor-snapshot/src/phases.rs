//! Wall-clock time of each phase of an operation, in order.

use std::time::Instant;

/// Named phase durations in seconds, in the order they ran.
#[derive(Debug, Default, Clone)]
pub struct Phases(pub Vec<(String, f64)>);

impl Phases {
    /// Runs `f` and records how long it took under `name`.
    pub fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.0
            .push((name.to_string(), start.elapsed().as_secs_f64()));
        out
    }
}
