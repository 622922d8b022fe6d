//! The fair PCIe scheduler (issue 11 item 6, StreamBox §6): one per device, every host→device
//! copy the daemon makes goes through it.
//!
//! A transfer (one *request*: one segment's fill, one platform-managed data entry) is cut into
//! blocks of `[pcie] block_bytes` (2 MiB). Transfers take turns, one block per turn, round-robin:
//! a **round** serves each of its transfers one block, in order; the next round holds those of
//! the round with blocks left, in the same order, then the transfers that arrived during the
//! round, in the order they arrived ("newly arrived requests join the next batch"). A transfer
//! arriving at an idle device starts a round at once. So a small fill that arrives while a large
//! one is copying waits for at most one of its blocks per transfer ahead of it, never for the
//! whole large copy.
//!
//! A transfer alone on the device copies a pinned source in pieces of `solo_bytes` (64 MiB)
//! instead, each one copy over all the device's streams, so a large fill with nothing beside it
//! keeps the link's full speed; a transfer that arrives meanwhile waits for at most one such
//! piece, and from then on turns are one block again.
//!
//! Only the transfer holding the turn copies, so one piece is in flight per device. A source
//! that is not pinned ([`Source::Pageable`]: a memfd, a Python buffer) goes through the device's
//! one **shared staging buffer** (pinned host memory on cuda, allocated on first use, one
//! block long): the turn holder copies its block into it and from it to the device. A pinned
//! source (the restore server's host buffers) is copied from in place.
//!
//! With `[pcie] fair = false` (the benchmark's "without it" side) a transfer is one copy of the
//! whole source, and transfers on a device run one after another, whole, in the order the lock
//! takes them: what the cuda backend's single copy engine did before the scheduler, and what
//! the host backend now does too, so both sides can be compared on either backend.
//!
//! A copy that fails ends its transfer with that error, and a copy that panics unwinds out of
//! it; either way the transfer leaves the round and the next one takes the turn, so the other
//! transfers go on.
//!
//! The communication store's copies up to a GPU (a spilled value's get, a value from another GPU
//! without peer access: crate::runtime::store_gpu) go through [`Pcie::transfer`] too.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use prometheus::{Histogram, IntCounter, IntGauge};
use torpor_device::DeviceError;

use crate::config::PcieConfig;
use crate::split::device::HostBuffer;
use crate::split::lock;

/// Where a transfer's bytes are.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    /// In memory the device copies from at full speed (its `host_buffer`): blocks are copied
    /// from it in place.
    Pinned,
    /// Anywhere else: each block goes through the shared staging buffer, which the function
    /// makes (`len` bytes of the device's pinned host memory) when the device has none yet.
    Pageable(&'a StagingAlloc<'a>),
}

/// Makes the staging buffer: `len` bytes of the device's pinned host memory.
pub type StagingAlloc<'a> = dyn Fn(usize) -> Result<HostBuffer, DeviceError> + 'a;

/// The scheduler's metrics for one device.
#[derive(Clone)]
pub struct PcieMetrics {
    /// `torpor_pcie_wait_seconds{device}`: from a transfer's arrival to its first block.
    pub wait: Histogram,
    /// `torpor_pcie_bytes_total{device}`: bytes copied host→device.
    pub bytes: IntCounter,
    /// `torpor_pcie_transfers{device}`: transfers in progress (waiting or copying).
    pub active: IntGauge,
}

/// One device's scheduler.
pub struct Pcie {
    /// The device, as logs and metrics name it (`host`, `cuda0`).
    device: String,
    config: PcieConfig,
    state: Mutex<State>,
    turn: Condvar,
    /// Held for a whole transfer when `fair` is off.
    whole: Mutex<()>,
    staging: Mutex<Option<HostBuffer>>,
    metrics: Option<PcieMetrics>,
}

impl std::fmt::Debug for Pcie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pcie")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The transfers of a device and whose turn it is.
#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// The round being served, in turn order; the front holds the turn.
    round: VecDeque<u64>,
    /// Transfers of this round that had their turn and have blocks left.
    again: Vec<u64>,
    /// Transfers that arrived during this round.
    arrived: Vec<u64>,
}

impl State {
    fn join(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        if self.round.is_empty() {
            self.round.push_back(id);
        } else {
            self.arrived.push(id);
        }
        id
    }

    fn holder(&self) -> Option<u64> {
        self.round.front().copied()
    }

    /// `id` (the holder) copied a block; `more`: it has blocks left.
    fn turn_done(&mut self, id: u64, more: bool) {
        debug_assert_eq!(self.holder(), Some(id));
        self.round.pop_front();
        if more {
            self.again.push(id);
        }
        self.next_round_if_over();
    }

    /// `id` goes, wherever it is (its copy failed or panicked).
    fn leave(&mut self, id: u64) {
        self.round.retain(|&x| x != id);
        self.again.retain(|&x| x != id);
        self.arrived.retain(|&x| x != id);
        self.next_round_if_over();
    }

    fn next_round_if_over(&mut self) {
        if self.round.is_empty() {
            self.round.extend(self.again.drain(..));
            self.round.extend(self.arrived.drain(..));
        }
    }

    fn active(&self) -> usize {
        self.round.len() + self.again.len() + self.arrived.len()
    }
}

/// One transfer counted in `torpor_pcie_transfers` while it lives.
struct Active(IntGauge);

impl Active {
    fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Takes a transfer out of the rotation when it ends early (an error or a panic in its copy).
struct Leave<'a> {
    pcie: &'a Pcie,
    id: u64,
    gone: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if !self.gone {
            lock(&self.pcie.state).leave(self.id);
            self.pcie.turn.notify_all();
        }
    }
}

impl Pcie {
    /// The scheduler of `device` (its name in logs), with `config`.
    pub fn new(device: &str, config: PcieConfig, metrics: Option<PcieMetrics>) -> Self {
        Self {
            device: device.to_string(),
            config,
            state: Mutex::new(State::default()),
            turn: Condvar::new(),
            whole: Mutex::new(()),
            staging: Mutex::new(None),
            metrics,
        }
    }

    pub fn config(&self) -> PcieConfig {
        self.config
    }

    /// Transfers in progress (waiting or copying).
    pub fn active(&self) -> usize {
        lock(&self.state).active()
    }

    /// Copies `src` to the device: `copy(offset, bytes)` copies `bytes` to the destination's
    /// `offset`, and is called for each block in order, only while this transfer holds the
    /// turn (with `fair` off: once, for all of `src`, while no other transfer of the device
    /// copies). Returns the first error of `copy` (or of making the staging buffer); the
    /// transfer then stops.
    pub fn transfer(
        &self,
        src: &[u8],
        from: Source,
        copy: impl FnMut(usize, &[u8]) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        if src.is_empty() {
            return Ok(());
        }
        let arrived = Instant::now();
        // In progress until this returns or unwinds.
        let _active = self.metrics.as_ref().map(|m| Active::new(&m.active));
        let waited = std::cell::Cell::new(None);
        let r = if self.config.fair {
            self.in_turns(src, from, copy, arrived, &waited)
        } else {
            self.whole(src, copy, arrived, &waited)
        };
        // One line per transfer: how long it waited for its first block and took in all.
        tracing::debug!(
            device = %self.device,
            bytes = src.len(),
            fair = self.config.fair,
            waited_s = waited.get().unwrap_or(0.0),
            s = arrived.elapsed().as_secs_f64(),
            ok = r.is_ok(),
            "pcie transfer"
        );
        r
    }

    /// Without fairness: all of `src` in one copy, while no other transfer of the device copies.
    fn whole(
        &self,
        src: &[u8],
        mut copy: impl FnMut(usize, &[u8]) -> Result<(), DeviceError>,
        arrived: Instant,
        waited: &std::cell::Cell<Option<f64>>,
    ) -> Result<(), DeviceError> {
        let _whole = lock(&self.whole);
        waited.set(Some(self.waited(arrived, src.len())));
        copy(0, src)
    }

    /// Round-robin, one block per turn (more while it is alone on the device).
    fn in_turns(
        &self,
        src: &[u8],
        from: Source,
        mut copy: impl FnMut(usize, &[u8]) -> Result<(), DeviceError>,
        arrived: Instant,
        waited: &std::cell::Cell<Option<f64>>,
    ) -> Result<(), DeviceError> {
        let block = self.config.block_bytes.max(1);
        let solo = self.config.solo_bytes.max(block);
        let id = lock(&self.state).join();
        let mut leave = Leave {
            pcie: self,
            id,
            gone: false,
        };
        let mut offset = 0;
        while offset < src.len() {
            let alone = {
                let mut st = lock(&self.state);
                while st.holder() != Some(id) {
                    st = self.turn.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                st.active() == 1
            };
            if offset == 0 {
                waited.set(Some(self.waited(arrived, src.len())));
            }
            // Alone, a pinned source goes in bigger pieces (one copy on all the device's
            // streams); the next transfer to arrive waits for at most one such piece.
            let turn = match from {
                Source::Pinned if alone => solo,
                _ => block,
            };
            let piece = &src[offset..src.len().min(offset + turn)];
            match from {
                Source::Pinned => copy(offset, piece)?,
                Source::Pageable(alloc) => {
                    let mut staging = lock(&self.staging);
                    if staging.as_ref().is_none_or(|s| s.len() < piece.len()) {
                        *staging = Some(alloc(block)?);
                    }
                    let Some(buf) = staging.as_mut() else {
                        unreachable!("the staging buffer was just made");
                    };
                    buf[..piece.len()].copy_from_slice(piece);
                    copy(offset, &buf[..piece.len()])?;
                }
            }
            offset += piece.len();
            let more = offset < src.len();
            lock(&self.state).turn_done(id, more);
            if !more {
                leave.gone = true;
            }
            self.turn.notify_all();
        }
        Ok(())
    }

    /// The transfer got its first turn: counts it; returns its wait in seconds.
    fn waited(&self, arrived: Instant, bytes: usize) -> f64 {
        let s = arrived.elapsed().as_secs_f64();
        if let Some(m) = &self.metrics {
            m.wait.observe(s);
            m.bytes.inc_by(bytes as u64);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::thread;
    use std::time::Duration;

    const BLOCK: usize = 16;

    fn pcie(fair: bool) -> Arc<Pcie> {
        Arc::new(Pcie::new(
            "test",
            PcieConfig {
                fair,
                block_bytes: BLOCK,
                solo_bytes: BLOCK,
            },
            None,
        ))
    }

    fn vec_alloc(len: usize) -> Result<HostBuffer, DeviceError> {
        Ok(Box::new(vec![0u8; len]))
    }

    /// The blocks copied, in order, as (transfer, block index).
    type Log = Arc<Mutex<Vec<(char, usize)>>>;

    fn wait_until(what: &str, ok: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Starts transfer `name` of `blocks` blocks on its own thread. Before copying its block
    /// `at`, it waits until `gate` transfers are active (so that the test decides who has
    /// arrived by then).
    fn start(
        p: &Arc<Pcie>,
        log: &Log,
        name: char,
        blocks: usize,
        gate: Option<(usize, usize)>,
    ) -> thread::JoinHandle<Result<(), DeviceError>> {
        let (p, log) = (Arc::clone(p), Arc::clone(log));
        thread::spawn(move || {
            let src = vec![name as u8; blocks * BLOCK];
            let probe = Arc::clone(&p);
            p.transfer(&src, Source::Pinned, |off, bytes| {
                let i = off / BLOCK;
                if let Some((at, n)) = gate {
                    if i == at {
                        wait_until(&format!("{n} transfers are active"), || probe.active() >= n);
                    }
                }
                assert_eq!(bytes.len(), BLOCK);
                log.lock().unwrap().push((name, i));
                Ok(())
            })
        })
    }

    fn order(log: &Log) -> String {
        log.lock()
            .unwrap()
            .iter()
            .map(|(n, i)| format!("{n}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn a_small_transfer_arriving_during_a_large_one_is_served_in_the_next_round() {
        let (p, log) = (pcie(true), Log::default());
        // A (8 blocks) starts on an idle device; B (2 blocks) arrives while A copies block 0.
        let a = start(&p, &log, 'A', 8, Some((0, 2)));
        wait_until("A is active", || p.active() == 1);
        let b = start(&p, &log, 'B', 2, None);
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
        assert_eq!(order(&log), "A0 A1 B0 A2 B1 A3 A4 A5 A6 A7");
        assert_eq!(p.active(), 0);
    }

    #[test]
    fn a_late_request_joins_the_next_round_behind_the_ones_already_there() {
        let (p, log) = (pcie(true), Log::default());
        // A and B: A's block 0 waits for B; C arrives while B copies its block 0 (round 2).
        let a = start(&p, &log, 'A', 4, Some((0, 2)));
        wait_until("A is active", || p.active() == 1);
        let b = start(&p, &log, 'B', 4, Some((0, 3)));
        wait_until("B is active", || p.active() == 2);
        // Round 2 has begun (A copied block 1; B holds its block 0 until C has arrived).
        wait_until("A copied block 1", || log.lock().unwrap().len() >= 2);
        let c = start(&p, &log, 'C', 2, None);
        for t in [a, b, c] {
            t.join().unwrap().unwrap();
        }
        assert_eq!(order(&log), "A0 A1 B0 A2 B1 C0 A3 B2 C1 B3");
    }

    #[test]
    fn a_failed_copy_ends_its_transfer_and_the_others_go_on() {
        let (p, log) = (pcie(true), Log::default());
        let a = start(&p, &log, 'A', 4, Some((0, 2)));
        wait_until("A is active", || p.active() == 1);
        let (p2, log2) = (Arc::clone(&p), Arc::clone(&log));
        let b = thread::spawn(move || {
            let src = vec![0u8; 3 * BLOCK];
            p2.transfer(&src, Source::Pinned, |off, _| {
                if off / BLOCK == 1 {
                    return Err(DeviceError::Sealed);
                }
                log2.lock().unwrap().push(('B', off / BLOCK));
                Ok(())
            })
        });
        a.join().unwrap().unwrap();
        let e = b.join().unwrap().unwrap_err();
        assert!(matches!(e, DeviceError::Sealed), "{e}");
        assert_eq!(order(&log), "A0 A1 B0 A2 A3");
        assert_eq!(p.active(), 0);
        // The device serves the next transfer as if nothing had happened.
        let c = start(&p, &log, 'C', 1, None);
        c.join().unwrap().unwrap();
    }

    #[test]
    fn a_panicking_copy_does_not_stop_the_other_transfers() {
        let (p, log) = (pcie(true), Log::default());
        let a = start(&p, &log, 'A', 3, Some((0, 2)));
        wait_until("A is active", || p.active() == 1);
        let p2 = Arc::clone(&p);
        let b = thread::spawn(move || {
            let src = vec![0u8; 2 * BLOCK];
            p2.transfer(&src, Source::Pinned, |_, _| panic!("a copy that panics"))
        });
        assert!(b.join().is_err(), "the panic reaches the caller");
        a.join().unwrap().unwrap();
        assert_eq!(order(&log), "A0 A1 A2");
        assert_eq!(p.active(), 0);
    }

    #[test]
    fn the_metrics_count_transfers_and_bytes_also_when_a_copy_panics() {
        let metrics = PcieMetrics {
            wait: Histogram::with_opts(prometheus::HistogramOpts::new("w", "w")).unwrap(),
            bytes: IntCounter::new("b", "b").unwrap(),
            active: IntGauge::new("a", "a").unwrap(),
        };
        let p = Pcie::new("test", pcie(true).config(), Some(metrics.clone()));
        p.transfer(&[1u8; 3 * BLOCK], Source::Pinned, |_, _| {
            assert_eq!(metrics.active.get(), 1, "in progress while it copies");
            Ok(())
        })
        .unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.transfer(&[1u8; BLOCK], Source::Pinned, |_, _| {
                panic!("a copy that panics")
            })
        }));
        assert!(panicked.is_err());
        assert_eq!(
            metrics.active.get(),
            0,
            "the panicking transfer is not counted on"
        );
        assert_eq!(metrics.bytes.get(), 4 * BLOCK as u64);
        assert_eq!(metrics.wait.get_sample_count(), 2);
    }

    #[test]
    fn pageable_sources_go_through_the_one_staging_buffer_and_arrive_whole() {
        let p = pcie(true);
        let made = AtomicUsize::new(0);
        let alloc = |len| {
            made.fetch_add(1, Ordering::SeqCst);
            vec_alloc(len)
        };
        for len in [1, BLOCK, 5 * BLOCK + 3] {
            let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            let mut staged = true;
            p.transfer(&src, Source::Pageable(&alloc), |off, bytes| {
                staged &= !std::ptr::eq(bytes.as_ptr(), src[off..].as_ptr());
                dst[off..off + bytes.len()].copy_from_slice(bytes);
                Ok(())
            })
            .unwrap();
            assert_eq!(dst, src);
            assert!(
                staged,
                "a pageable block was copied from its source in place"
            );
        }
        assert_eq!(made.load(Ordering::SeqCst), 1, "one staging buffer, reused");
        // A pinned source is copied from in place.
        let src = vec![7u8; 2 * BLOCK];
        p.transfer(&src, Source::Pinned, |off, bytes| {
            assert!(std::ptr::eq(bytes.as_ptr(), src[off..].as_ptr()));
            Ok(())
        })
        .unwrap();
        // Nothing to copy: no turn, no copy.
        p.transfer(&[], Source::Pageable(&vec_alloc), |_, _| {
            panic!("no copy of nothing")
        })
        .unwrap();
    }

    #[test]
    fn a_transfer_alone_copies_bigger_pieces_until_another_arrives() {
        let p = Arc::new(Pcie::new(
            "test",
            PcieConfig {
                fair: true,
                block_bytes: BLOCK,
                solo_bytes: 4 * BLOCK,
            },
            None,
        ));
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let run = |name: char, blocks: usize, gate: bool| {
            let (p, log) = (Arc::clone(&p), Arc::clone(&log));
            thread::spawn(move || {
                let src = vec![0u8; blocks * BLOCK];
                let probe = Arc::clone(&p);
                p.transfer(&src, Source::Pinned, |off, bytes| {
                    if gate && off == 0 {
                        wait_until("B is active", || probe.active() >= 2);
                    }
                    let entry = format!("{name}{}x{}", off / BLOCK, bytes.len() / BLOCK);
                    log.lock().unwrap().push(entry);
                    Ok(())
                })
            })
        };
        let a = run('A', 8, true);
        wait_until("A is active", || p.active() == 1);
        let b = run('B', 2, false);
        a.join().unwrap().unwrap();
        b.join().unwrap().unwrap();
        // Alone: 4 blocks in one copy; with B there: a block each; alone again: the rest.
        assert_eq!(
            log.lock().unwrap().join(" "),
            "A0x4 A4x1 B0x1 A5x1 B1x1 A6x2"
        );
    }

    #[test]
    fn without_fairness_transfers_run_whole_one_after_another() {
        let (p, log) = (pcie(false), Log::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for name in ['A', 'B', 'C'] {
            let (p, log, inside) = (Arc::clone(&p), Arc::clone(&log), Arc::clone(&inside));
            threads.push(thread::spawn(move || {
                let src = vec![0u8; 4 * BLOCK];
                p.transfer(&src, Source::Pageable(&vec_alloc), |off, bytes| {
                    assert_eq!((off, bytes.len()), (0, 4 * BLOCK), "one copy of all of it");
                    assert_eq!(
                        inside.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two copies at once"
                    );
                    thread::sleep(Duration::from_millis(20));
                    log.lock().unwrap().push((name, 0));
                    inside.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                })
            }));
        }
        for t in threads {
            t.join().unwrap().unwrap();
        }
        assert_eq!(log.lock().unwrap().len(), 3);
    }
}
