//! Wall-clock time of each phase of an operation, in order.

use std::time::Instant;

/// Named phase durations in seconds, in the order they ran.
#[derive(Debug, Default, Clone)]
pub struct Phases(pub Vec<(String, f64)>);

impl Phases {
    /// Runs `f` and records how long it took under `name`, added to what `name` took before (a
    /// step timed in two pieces is one phase).
    pub fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let took = start.elapsed().as_secs_f64();
        match self.0.iter_mut().find(|(n, _)| n == name) {
            Some((_, secs)) => *secs += took,
            None => self.0.push((name.to_string(), took)),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_timed_in_two_pieces_is_one_entry_with_their_sum() {
        let mut phases = Phases::default();
        phases.time("a", || {
            std::thread::sleep(std::time::Duration::from_millis(5))
        });
        phases.time("b", || ());
        phases.time("a", || {
            std::thread::sleep(std::time::Duration::from_millis(5))
        });
        let names: Vec<&str> = phases.0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(phases.0[0].1 >= 0.010, "{:?}", phases.0);
    }
}
