//! GPU memory·seconds and stage seconds per instance, from its first process to its last.
//!
//! Every instance is metered from the moment its start begins (boot or restore) until it is gone,
//! under one `stage` label at a time: `starting` until it is live, then its keep-alive stage, with
//! `hibernating` while it is quiesced and snapshotted. GPU memory is sampled at each keep-alive
//! tick from NVML and attributed to an instance when the process NVML names is the instance's
//! root or a descendant of it. A reading stands until the next one (sample and hold): the
//! interval up to a tick, or up to a stage change between ticks, is charged at the reading taken
//! at its start, so a stage change charges exactly what the ticker would have.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::metrics::{Metrics, STARTING};

/// The accounting state of one metered instance.
#[derive(Debug, Clone, Copy)]
pub struct Meter {
    /// Up to when its time and memory were added to the metrics.
    pub accounted: Instant,
    /// The GPU memory last read for it, in bytes; it stands until the next reading.
    pub gpu_bytes: u64,
}

/// One closed interval of a [`Meter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Charge {
    pub seconds: f64,
    pub byte_seconds: f64,
}

impl Meter {
    /// A meter that starts at `now` with no memory read yet.
    pub fn new(now: Instant) -> Self {
        Self {
            accounted: now,
            gpu_bytes: 0,
        }
    }

    /// Closes the interval up to `now` at the reading that stood over it; `reading`, where one
    /// was taken, stands from `now` on. A `now` before the last account closes nothing.
    pub fn close(&mut self, now: Instant, reading: Option<u64>) -> Charge {
        let seconds = now.saturating_duration_since(self.accounted).as_secs_f64();
        let charge = Charge {
            seconds,
            byte_seconds: self.gpu_bytes as f64 * seconds,
        };
        self.accounted = self.accounted.max(now);
        if let Some(bytes) = reading {
            self.gpu_bytes = bytes;
        }
        charge
    }
}

impl Metrics {
    /// Adds a closed interval of an instance of `function` spent in `stage`.
    pub fn add_charge(&self, function: &str, stage: &str, charge: Charge) {
        self.stage_seconds
            .with_label_values(&[function, stage])
            .inc_by(charge.seconds);
        if charge.byte_seconds > 0.0 {
            self.gpu_memory_byte_seconds
                .with_label_values(&[function, stage])
                .inc_by(charge.byte_seconds);
        }
    }
}

/// GPU memory per instance root: each process NVML lists is charged to the first of its
/// ancestors (itself included) that is in `roots`; `parent_of` gives a process's parent (None at
/// the top or for a process that is gone). Processes of no instance are left out.
pub fn memory_by_root(
    by_pid: &HashMap<i32, u64>,
    roots: &HashSet<i32>,
    parent_of: impl Fn(i32) -> Option<i32>,
) -> HashMap<i32, u64> {
    // Deeper than any instance tree (init → worker → its children); a guard against a cycle of
    // pids reused while walking.
    const MAX_DEPTH: usize = 64;
    let mut out = HashMap::new();
    for (&pid, &bytes) in by_pid {
        let mut p = pid;
        for _ in 0..MAX_DEPTH {
            if roots.contains(&p) {
                *out.entry(p).or_insert(0) += bytes;
                break;
            }
            match parent_of(p) {
                Some(parent) if parent > 0 && parent != p => p = parent,
                _ => break,
            }
        }
    }
    out
}

/// The parent of a host pid, from `/proc/PID/stat`.
pub fn parent_pid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The state letter and the ppid follow the last ')' of the comm field.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// An instance being started (booted or restored), metered as `starting` until it is live.
#[derive(Debug)]
pub struct Start {
    pub function: String,
    /// What it is charged once its process exists when NVML does not load: the spec's
    /// `gpu_memory` for a `gpus = 1` function, as a warm instance is, else 0.
    fallback_bytes: u64,
    state: Mutex<StartState>,
}

#[derive(Debug)]
struct StartState {
    /// The root of its process tree, once that process exists. Before (a restore inside CRIU
    /// and the driver restore), nothing is charged: see [`StartGuard::process_started`].
    root: Option<i32>,
    meter: Meter,
    /// Finished: the ticker no longer charges it.
    done: bool,
}

/// The instances being started, for the ticker.
#[derive(Debug, Default)]
pub struct Starts(Mutex<Vec<Arc<Start>>>);

impl Starts {
    /// Begins metering a start of `function` now; it ends when the guard finishes or drops.
    pub fn begin(
        &self,
        function: &str,
        fallback_bytes: u64,
        metrics: Arc<Metrics>,
    ) -> StartGuard<'_> {
        let start = Arc::new(Start {
            function: function.to_string(),
            fallback_bytes,
            state: Mutex::new(StartState {
                root: None,
                meter: Meter::new(Instant::now()),
                done: false,
            }),
        });
        lock(&self.0).push(Arc::clone(&start));
        StartGuard {
            starts: self,
            metrics,
            start,
        }
    }

    /// The roots of the starts whose process exists.
    pub fn roots(&self) -> Vec<i32> {
        lock(&self.0)
            .iter()
            .filter_map(|s| lock(&s.state).root)
            .collect()
    }

    /// Whether any start is under way.
    pub fn any(&self) -> bool {
        !lock(&self.0).is_empty()
    }

    /// The ticker's account of every start up to `now`, each at the memory `by_root` gives its
    /// root where NVML loads, else at its fallback once its process exists. Returns the memory
    /// held.
    pub fn tick(
        &self,
        now: Instant,
        by_root: Option<&HashMap<i32, u64>>,
        metrics: &Metrics,
    ) -> u64 {
        let starts: Vec<Arc<Start>> = lock(&self.0).clone();
        let mut held = 0;
        for s in starts {
            let mut st = lock(&s.state);
            if st.done {
                continue;
            }
            let reading = match (st.root, by_root) {
                (None, _) => 0,
                (Some(r), Some(m)) => m.get(&r).copied().unwrap_or(0),
                (Some(_), None) => s.fallback_bytes,
            };
            let charge = st.meter.close(now, Some(reading));
            held += st.meter.gpu_bytes;
            metrics.add_charge(&s.function, STARTING, charge);
        }
        held
    }
}

/// A start being metered; see [`Starts::begin`].
pub struct StartGuard<'a> {
    starts: &'a Starts,
    metrics: Arc<Metrics>,
    start: Arc<Start>,
}

impl StartGuard<'_> {
    /// The start's process tree exists from now, rooted at `root` (a booted worker's init once
    /// launched; a restored one's once CRIU and the driver restore returned). Until then it is
    /// charged nothing: a restoring process holds no GPU memory before the driver restore, which
    /// runs inside the restore call, so its 0.2–0.5 s are the part not charged.
    pub fn process_started(&self, root: i32) {
        lock(&self.start.state).root = Some(root);
    }

    /// The start ended in a live instance whose meter begins where this one ends: the interval
    /// up to there is charged as `starting`, and the last reading carries over to the instance
    /// (the same processes), so that neither a gap nor an overlap is left between the two.
    pub fn finish_into(self, instance: &mut Meter) {
        let mut st = lock(&self.start.state);
        let end = st.meter.accounted.max(instance.accounted);
        let charge = st.meter.close(end, None);
        *instance = Meter {
            accounted: end,
            gpu_bytes: st.meter.gpu_bytes,
        };
        self.end(&mut st, charge);
    }

    fn end(&self, st: &mut StartState, charge: Charge) {
        if st.done {
            return;
        }
        st.done = true;
        self.metrics
            .add_charge(&self.start.function, STARTING, charge);
        lock(&self.starts.0).retain(|s| !Arc::ptr_eq(s, &self.start));
    }
}

impl Drop for StartGuard<'_> {
    /// A start that failed (or whose task went away) is charged up to now.
    fn drop(&mut self) {
        let mut st = lock(&self.start.state);
        if !st.done {
            let charge = st.meter.close(Instant::now(), None);
            self.end(&mut st, charge);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const GIB: u64 = 1 << 30;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_reading_stands_until_the_next_one() {
        let t0 = Instant::now();
        let mut m = Meter::new(t0);
        // Nothing read yet: time counts, memory does not.
        assert_eq!(
            m.close(at(t0, 200), Some(GIB)),
            Charge {
                seconds: 0.2,
                byte_seconds: 0.0
            }
        );
        // The 1 GiB read at 200 ms is charged over the next interval, whatever is read at its end.
        let c = m.close(at(t0, 400), Some(0));
        assert!((c.byte_seconds - 0.2 * GIB as f64).abs() < 1.0, "{c:?}");
        let c = m.close(at(t0, 600), None);
        assert_eq!(c.byte_seconds, 0.0);
    }

    #[test]
    fn a_stage_change_between_ticks_charges_what_the_tick_would_have() {
        let t0 = Instant::now();
        let (mut ticked, mut changed) = (Meter::new(t0), Meter::new(t0));
        ticked.close(at(t0, 200), Some(3 * GIB));
        changed.close(at(t0, 200), Some(3 * GIB));
        let whole = ticked.close(at(t0, 400), Some(0));
        let part = changed.close(at(t0, 300), None);
        let rest = changed.close(at(t0, 400), Some(0));
        let split = part.byte_seconds + rest.byte_seconds;
        assert!(
            (split - whole.byte_seconds).abs() < 1.0,
            "{split} vs {whole:?}"
        );
        assert!((part.seconds + rest.seconds - whole.seconds).abs() < 1e-9);
    }

    #[test]
    fn closing_before_the_last_account_charges_nothing_and_keeps_the_time() {
        let t0 = Instant::now();
        let mut m = Meter::new(at(t0, 500));
        m.gpu_bytes = GIB;
        assert_eq!(m.close(at(t0, 100), None).seconds, 0.0);
        assert_eq!(m.accounted, at(t0, 500));
    }

    #[test]
    fn memory_goes_to_the_instance_whose_tree_holds_the_process() {
        // 10 is an init with worker 11, whose child 12 also uses the GPU; 20 is another
        // instance's init; 30 is a process of no instance (under pid 1).
        let parents: HashMap<i32, i32> = [(11, 10), (12, 11), (10, 1), (21, 20), (20, 1), (30, 1)]
            .into_iter()
            .collect();
        let by_pid: HashMap<i32, u64> = [(11, 100), (12, 5), (21, 7), (30, 1000)]
            .into_iter()
            .collect();
        let roots: HashSet<i32> = [10, 20].into_iter().collect();
        let got = memory_by_root(&by_pid, &roots, |p| parents.get(&p).copied());
        assert_eq!(got, [(10, 105), (20, 7)].into_iter().collect());
    }

    #[test]
    fn a_parent_cycle_ends_the_walk() {
        let by_pid: HashMap<i32, u64> = [(5, 1)].into_iter().collect();
        let roots: HashSet<i32> = [9].into_iter().collect();
        let got = memory_by_root(&by_pid, &roots, |p| Some(if p == 5 { 6 } else { 5 }));
        assert!(got.is_empty());
    }

    #[test]
    fn parent_pid_reads_proc() {
        let me = i32::try_from(std::process::id()).unwrap();
        let want = i32::try_from(std::os::unix::process::parent_id()).unwrap();
        assert_eq!(parent_pid(me), Some(want));
        assert_eq!(parent_pid(i32::MAX), None);
    }

    fn sample(text: &str, function: &str, stage: &str) -> f64 {
        let key = format!(
            "torpor_gpu_memory_byte_seconds_total{{function=\"{function}\",stage=\"{stage}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map_or(0.0, |v| v.parse().unwrap())
    }

    #[test]
    fn a_start_is_charged_from_its_process_and_hands_its_reading_to_the_instance() {
        let metrics = Arc::new(Metrics::new().unwrap());
        let starts = Starts::default();
        let guard = starts.begin("f", 0, Arc::clone(&metrics));
        let t0 = lock(&starts.0)[0].state.lock().unwrap().meter.accounted;
        let by_root: HashMap<i32, u64> = [(42, GIB)].into_iter().collect();
        // No process yet: nothing read for it.
        assert_eq!(starts.tick(at(t0, 200), Some(&by_root), &metrics), 0);
        assert!(starts.roots().is_empty());
        guard.process_started(42);
        assert_eq!(starts.roots(), vec![42]);
        assert_eq!(starts.tick(at(t0, 400), Some(&by_root), &metrics), GIB);
        starts.tick(at(t0, 1400), Some(&by_root), &metrics);
        // Live at 1.5 s: the start is charged up to there, the instance's meter begins there.
        let mut instance = Meter::new(at(t0, 1500));
        guard.finish_into(&mut instance);
        assert!(!starts.any());
        assert_eq!(instance.accounted, at(t0, 1500));
        assert_eq!(instance.gpu_bytes, GIB);
        let text = metrics.render().unwrap();
        let charged = sample(&text, "f", STARTING) / GIB as f64;
        assert!((charged - 1.1).abs() < 1e-6, "{charged}\n{text}");
        // A tick after the end no longer charges it.
        starts.tick(at(t0, 3000), Some(&by_root), &metrics);
        let text = metrics.render().unwrap();
        assert!((sample(&text, "f", STARTING) / GIB as f64 - 1.1).abs() < 1e-6);
    }

    #[test]
    fn without_nvml_a_start_is_charged_its_fallback_once_its_process_exists() {
        let metrics = Arc::new(Metrics::new().unwrap());
        let starts = Starts::default();
        let guard = starts.begin("f", 2 * GIB, Arc::clone(&metrics));
        let t0 = lock(&starts.0)[0].state.lock().unwrap().meter.accounted;
        assert_eq!(starts.tick(at(t0, 200), None, &metrics), 0);
        guard.process_started(9);
        assert_eq!(starts.tick(at(t0, 400), None, &metrics), 2 * GIB);
        starts.tick(at(t0, 900), None, &metrics);
        let mut instance = Meter::new(at(t0, 900));
        guard.finish_into(&mut instance);
        let charged = sample(&metrics.render().unwrap(), "f", STARTING) / GIB as f64;
        assert!((charged - 1.0).abs() < 1e-6, "{charged}");
    }

    #[test]
    fn a_failed_start_is_charged_up_to_its_end_and_leaves_the_list() {
        let metrics = Arc::new(Metrics::new().unwrap());
        let starts = Starts::default();
        let guard = starts.begin("f", 0, Arc::clone(&metrics));
        guard.process_started(7);
        assert!(starts.any());
        drop(guard);
        assert!(!starts.any());
        let text = metrics.render().unwrap();
        assert!(
            text.contains("torpor_instance_stage_seconds_total{function=\"f\",stage=\"starting\"}"),
            "{text}"
        );
    }
}
