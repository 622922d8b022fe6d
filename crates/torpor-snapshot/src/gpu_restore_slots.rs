//! How many GPU restores may be in flight at once, from CRIU's start to the end of the CUDA
//! driver's restore (torpord's `restore_server.gpu_restores`, docs/split.md "Bursts").
//!
//! Eight cold starts of GPT-2-Large at once on the H100 each spent 1.0–1.5 s in
//! `cuCheckpointProcessRestore` against 0.3 s alone, and all eight finished together after
//! ~2.5 s (`bench/results/split-bench-burst-s17-h100.json`, `burst8`): the driver runs them
//! side by side but no faster in total, so every instance of a burst was ready only when the
//! last was. Bounding only the driver's part (the same file, `burst8@dr1`) made the burst's
//! first instance ready after 0.64–1.08 s, the seven other restores' CRIU runs and page
//! copies still slowing it; bounding the whole restore lets the first run as if alone and the
//! next one's CRIU overlap its driver restore. Two restores in flight still met in the driver
//! (each 0.66–0.68 s there instead of 0.3 s: `split-bench-burst-g-s17-h100.json`), so inside
//! a slot the driver's restore itself goes one at a time ([`GpuRestoreSlots::driver`]): the
//! next restore's CRIU and hot set run beside the current one's driver restore, and then it
//! takes its turn. With late binding (torpord's pool) the first instance up serves the burst
//! while the rest restore.
//!
//! Each bound holds per *lane*: the caller names the lane of each restore (torpord: the GPU it
//! restores onto, or 0 for every restore with `restore_server.driver_lanes = "node"`), so the
//! restores of a node's different GPUs neither wait for nor count against each other.
//!
//! Two GPUs' driver restores at once each take longer than one alone (on two H200s: 0.41-0.50 s
//! against 0.31-0.35 s, `bench/results/split-bench-s51-lanes-h200x2.json`), so a burst's first
//! instance, which serves the burst by late binding, would be up later. A restore may therefore
//! go *alone* in the driver: from the moment it has its slot ([`GpuRestoreSlots::acquire`] with
//! `alone`) no other restore enters the driver until its own turn there has ended, and that turn
//! waits until no lane is in the driver (torpord asks so for the first start of a function that
//! has nothing live). Held from the slot, not from the driver turn: the burst's other restores
//! finish CRIU first as often as not, and would otherwise be in the driver before it. The rest
//! of the burst then restores side by side.
//!
//! A counting semaphore over std's `Mutex` and `Condvar`: the restore runs on a blocking
//! thread (CRIU, ptrace, the driver's calls), so an async semaphore would need a runtime
//! handle inside it; this crate has none.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A bound on GPU restores in flight per lane, shared by every restore of one daemon.
#[derive(Debug)]
pub struct GpuRestoreSlots {
    max: usize,
    /// Restores holding a slot, per lane.
    used: Mutex<HashMap<u32, usize>>,
    freed: Condvar,
    /// Who is inside the driver's restore now.
    in_driver: Mutex<Driver>,
    driver_freed: Condvar,
}

/// The driver's restores now: one per lane at most, or one alone on the node.
#[derive(Debug, Default)]
struct Driver {
    lanes: HashMap<u32, usize>,
    alone: bool,
    /// Restores that hold a slot to go alone and have not had their turn: no lane enters
    /// meanwhile.
    alone_waiting: usize,
}

/// A restore's turn in the driver: given back when dropped.
#[derive(Debug)]
pub struct DriverTurn<'a> {
    slots: &'a GpuRestoreSlots,
    lane: u32,
    alone: bool,
}

/// One restore's slot: given back when dropped.
#[derive(Debug)]
pub struct GpuRestoreSlot<'a> {
    slots: &'a GpuRestoreSlots,
    lane: u32,
    /// Taken to go alone in the driver: the other restores keep out of it until dropped.
    alone: bool,
}

impl GpuRestoreSlots {
    /// At most `max` GPU restores at once in each lane; `max` ≥ 1 (0 means no bound: pass no
    /// slots).
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            used: Mutex::new(HashMap::new()),
            freed: Condvar::new(),
            in_driver: Mutex::new(Driver::default()),
            driver_freed: Condvar::new(),
        }
    }

    /// Waits for the driver to be free of the other restores of `lane` (with `alone`, taken by
    /// a restore whose slot was taken alone: of every lane), at most `bound` (as
    /// [`Self::acquire`]); the turn, if had, and the seconds waited.
    pub fn driver(&self, lane: u32, alone: bool, bound: Duration) -> (Option<DriverTurn<'_>>, f64) {
        let start = Instant::now();
        let mut d = self.in_driver.lock().unwrap_or_else(|e| e.into_inner());
        let free = |d: &Driver| {
            !d.alone
                && if alone {
                    d.lanes.values().all(|&n| n == 0)
                } else {
                    d.alone_waiting == 0 && d.lanes.get(&lane).copied().unwrap_or(0) == 0
                }
        };
        while !free(&d) {
            let left = bound.saturating_sub(start.elapsed());
            if left.is_zero() {
                return (None, start.elapsed().as_secs_f64());
            }
            d = self
                .driver_freed
                .wait_timeout(d, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        if alone {
            d.alone = true;
        } else {
            *d.lanes.entry(lane).or_default() += 1;
        }
        let turn = DriverTurn {
            slots: self,
            lane,
            alone,
        };
        (Some(turn), start.elapsed().as_secs_f64())
    }

    /// The bound of each lane.
    pub fn max(&self) -> usize {
        self.max
    }

    /// GPU restores in flight now, all lanes together.
    pub fn in_use(&self) -> usize {
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum()
    }

    /// Waits for a slot of `lane`, at most `bound` (then goes on without one: a restore held
    /// up longer than any burst's restores take means a slot was lost, and waiting longer only
    /// adds to the start). With `alone`, no other restore enters the driver from now until this
    /// one's turn there ([`Self::driver`] with `alone`) has ended. Returns the slot, if one was
    /// had, and the seconds waited.
    pub fn acquire(
        &self,
        lane: u32,
        alone: bool,
        bound: Duration,
    ) -> (Option<GpuRestoreSlot<'_>>, f64) {
        let (got, waited) = take(&self.used, &self.freed, lane, self.max, bound);
        // Made only when taken: a slot dropped gives its count back.
        if !got {
            return (None, waited);
        }
        if alone {
            self.in_driver
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .alone_waiting += 1;
        }
        let slot = GpuRestoreSlot {
            slots: self,
            lane,
            alone,
        };
        (Some(slot), waited)
    }
}

/// Waits until `lane`'s count is below `max`, at most `bound`, then counts one more: whether
/// it did, and the seconds waited.
fn take(
    counts: &Mutex<HashMap<u32, usize>>,
    freed: &Condvar,
    lane: u32,
    max: usize,
    bound: Duration,
) -> (bool, f64) {
    let start = Instant::now();
    let mut n = counts.lock().unwrap_or_else(|e| e.into_inner());
    while n.get(&lane).copied().unwrap_or(0) >= max {
        let left = bound.saturating_sub(start.elapsed());
        if left.is_zero() {
            return (false, start.elapsed().as_secs_f64());
        }
        n = freed
            .wait_timeout(n, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    *n.entry(lane).or_default() += 1;
    (true, start.elapsed().as_secs_f64())
}

/// Counts one less in `lane` and wakes the waiters (of every lane: one condition variable
/// serves them all, so each checks its own lane again).
fn give(counts: &Mutex<HashMap<u32, usize>>, freed: &Condvar, lane: u32) {
    let mut n = counts.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = n.get_mut(&lane) {
        *c = c.saturating_sub(1);
        if *c == 0 {
            n.remove(&lane);
        }
    }
    freed.notify_all();
}

impl Drop for GpuRestoreSlot<'_> {
    fn drop(&mut self) {
        if self.alone {
            let mut d = self
                .slots
                .in_driver
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            d.alone_waiting = d.alone_waiting.saturating_sub(1);
            self.slots.driver_freed.notify_all();
        }
        give(&self.slots.used, &self.slots.freed, self.lane);
    }
}

impl Drop for DriverTurn<'_> {
    fn drop(&mut self) {
        let mut d = self
            .slots
            .in_driver
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if self.alone {
            d.alone = false;
        } else if let Some(n) = d.lanes.get_mut(&self.lane) {
            *n = n.saturating_sub(1);
        }
        self.slots.driver_freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn no_more_than_max_hold_a_slot_at_once_and_every_waiter_gets_one() {
        let slots = GpuRestoreSlots::new(2);
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let served = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let (slot, _) = slots.acquire(0, false, Duration::from_secs(30));
                    assert!(slot.is_some(), "a waiter went without a slot");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    served.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        assert_eq!(served.load(Ordering::SeqCst), 8);
        assert_eq!(
            most.load(Ordering::SeqCst),
            2,
            "the bound was not reached or was passed"
        );
        assert_eq!(slots.in_use(), 0, "a slot was not given back");
    }

    #[test]
    fn inside_the_slots_the_driver_takes_one_restore_at_a_time() {
        let slots = GpuRestoreSlots::new(3);
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let (slot, _) = slots.acquire(0, false, Duration::from_secs(30));
                    let (turn, _) = slots.driver(0, false, Duration::from_secs(30));
                    assert!(slot.is_some() && turn.is_some());
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                    inside.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "two restores were in the driver at once"
        );
        let (turn, _) = slots.driver(0, false, Duration::from_millis(10));
        assert!(turn.is_some(), "a turn was not given back");
    }

    #[test]
    fn a_waiter_past_its_bound_goes_on_without_a_slot() {
        let slots = GpuRestoreSlots::new(1);
        let (held, waited) = slots.acquire(0, false, Duration::from_secs(1));
        assert!(held.is_some() && waited < 1.0);
        let (none, waited) = slots.acquire(0, false, Duration::from_millis(50));
        assert!(none.is_none());
        assert!(waited >= 0.05, "{waited}");
        // Going without a slot gives none back: the held one still counts.
        assert_eq!(
            slots.in_use(),
            1,
            "a waiter past its bound gave back a slot it never had"
        );
        drop(held);
        let (again, _) = slots.acquire(0, false, Duration::from_millis(50));
        assert!(again.is_some(), "the slot given back was not reusable");
    }

    #[test]
    fn the_lanes_of_two_gpus_neither_wait_for_nor_count_against_each_other() {
        let slots = GpuRestoreSlots::new(1);
        let (a, _) = slots.acquire(0, false, Duration::from_secs(1));
        let (ta, _) = slots.driver(0, false, Duration::from_secs(1));
        assert!(a.is_some() && ta.is_some());
        // Lane 0 is full, in both bounds; lane 1 is free in both.
        let (b, waited) = slots.acquire(1, false, Duration::from_millis(50));
        let (tb, waited_turn) = slots.driver(1, false, Duration::from_millis(50));
        assert!(b.is_some() && tb.is_some());
        assert!(
            waited < 0.05 && waited_turn < 0.05,
            "{waited} {waited_turn}"
        );
        assert_eq!(slots.in_use(), 2);
        let (none, _) = slots.acquire(0, false, Duration::from_millis(20));
        assert!(
            none.is_none(),
            "lane 0 took a second restore past its bound of 1"
        );
        // A waiter on lane 0 gets its slot when lane 0's is given back, not lane 1's.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| slots.acquire(0, false, Duration::from_secs(10)).0.is_some());
            std::thread::sleep(Duration::from_millis(30));
            drop(b);
            std::thread::sleep(Duration::from_millis(30));
            assert!(!waiter.is_finished(), "lane 1's slot freed lane 0's waiter");
            drop(a);
            assert!(waiter.join().unwrap());
        });
        drop((ta, tb));
        assert_eq!(slots.in_use(), 0);
    }

    #[test]
    fn a_restore_alone_keeps_the_driver_from_its_slot_on_and_waits_for_every_lane() {
        let slots = GpuRestoreSlots::new(2);
        let (on1, _) = slots.driver(1, false, Duration::from_secs(1));
        assert!(on1.is_some());
        std::thread::scope(|s| {
            // The one alone has its slot (its CRIU runs): from now on no lane enters the driver.
            let (slot, _) = slots.acquire(0, true, Duration::from_secs(1));
            assert!(slot.is_some());
            let (none, _) = slots.driver(0, false, Duration::from_millis(20));
            assert!(
                none.is_none(),
                "a lane entered the driver before the one alone had its turn"
            );
            let alone = s.spawn(|| {
                let (turn, waited) = slots.driver(0, true, Duration::from_secs(10));
                assert!(turn.is_some());
                std::thread::sleep(Duration::from_millis(60));
                drop(turn);
                drop(slot);
                waited
            });
            std::thread::sleep(Duration::from_millis(30));
            // Its turn waits for lane 1's restore, in the driver before it had its slot.
            drop(on1);
            std::thread::sleep(Duration::from_millis(20));
            // Alone now: lane 1, free again, waits until it is done.
            let t = Instant::now();
            let (after, _) = slots.driver(1, false, Duration::from_secs(10));
            assert!(after.is_some());
            assert!(
                t.elapsed() >= Duration::from_millis(20),
                "lane 1 entered beside the one alone"
            );
            let waited = alone.join().unwrap();
            assert!(
                waited >= 0.02,
                "the one alone did not wait for lane 1: {waited}"
            );
        });
        // Its slot given back without a turn (its restore failed before the driver): the lanes
        // enter again.
        let (slot, _) = slots.acquire(1, true, Duration::from_secs(1));
        drop(slot);
        let (lane1, waited) = slots.driver(1, false, Duration::from_millis(50));
        assert!(lane1.is_some() && waited < 0.05, "{waited}");
        assert_eq!(slots.in_use(), 0);
    }
}
