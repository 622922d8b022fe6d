//! The buffers a download fetches its ranges into: those that come back go round, and new ones
//! are made ahead, faulted in, on a thread of their own.
//!
//! Why: a pull that holds its chunks until after its answer (`StoreWriter::hold_up_to`) keeps
//! every buffer it fetched into, so each range is new memory, and the kernel zeroes each page on
//! the fetcher's first write into it. On the H100 that zeroing (`clear_page_erms` under huge-page
//! faults in `get_range_into`) was 21 % of the pulling daemon's CPU, on the sixteen fetchers'
//! path, while the store server was slow to be read from (`bench/results/pull-perf-s30-h100/`).
//! A maker thread pays it beside them: for each range a few jobs ahead of the fetchers, a buffer
//! of that range's length (a held buffer's spare room would be held too). Buffers that came
//! back are taken first, and while one that holds the next range waits the maker makes none,
//! so a download whose buffers go round (no holding) makes only its first few.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// Bytes between two writes that fault a buffer in: the base page size, so that each page is
/// touched whether or not the kernel backs the buffer with huge pages.
const PAGE: usize = 4096;

/// The buffers of one download, whose jobs are taken in order by their index (`next`).
pub(crate) struct FetchBuffers<'a> {
    /// (job index, length) of the download's ranges, in the order they are taken.
    ranges: &'a [(usize, usize)],
    /// The index of the next job to be taken.
    next: &'a AtomicUsize,
    /// How many jobs past `next` the maker may work ahead.
    ahead: usize,
    pool: Mutex<Pool>,
    taken: Condvar,
    stopped: AtomicBool,
}

#[derive(Default)]
struct Pool {
    /// Buffers that came back.
    free: Vec<Vec<u8>>,
    /// Buffers made ahead, by the job they were made for (its range's length).
    made: HashMap<usize, Vec<u8>>,
    /// How many the maker made.
    count: usize,
}

impl<'a> FetchBuffers<'a> {
    pub(crate) fn new(ranges: &'a [(usize, usize)], next: &'a AtomicUsize, ahead: usize) -> Self {
        FetchBuffers {
            ranges,
            next,
            ahead,
            pool: Mutex::new(Pool::default()),
            taken: Condvar::new(),
            stopped: AtomicBool::new(false),
        }
    }

    /// A buffer for job `n`, a range of `len` bytes: the smallest that came back and holds it,
    /// else the one made for `n`, else a new empty one (the fetch grows it itself).
    pub(crate) fn take(&self, n: usize, len: usize) -> Vec<u8> {
        let buf = {
            let mut pool = self.lock();
            let fit = (0..pool.free.len())
                .filter(|&i| pool.free[i].capacity() >= len)
                .min_by_key(|&i| pool.free[i].capacity());
            match fit {
                Some(i) => {
                    // One made for `n` goes to the others that came back.
                    if let Some(made) = pool.made.remove(&n) {
                        pool.free.push(made);
                    }
                    pool.free.swap_remove(i)
                }
                None => pool.made.remove(&n).unwrap_or_default(),
            }
        };
        self.taken.notify_one();
        buf
    }

    /// A buffer the download is done with, for the next range.
    pub(crate) fn give_back(&self, buf: Vec<u8>) {
        self.lock().free.push(buf);
    }

    /// No more jobs are taken (none left, or the download failed): the maker ends.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.taken.notify_all();
    }

    /// The maker's loop, for a thread of its own: for each range not yet taken and at most
    /// `ahead` jobs past the next, a buffer of its length, unless one that came back holds it
    /// (the download's buffers go round: nothing to make). Returns how many it made.
    pub(crate) fn make_ahead(&self) -> usize {
        for &(n, len) in self.ranges {
            {
                let mut pool = self.lock();
                loop {
                    if self.stopped.load(Ordering::Acquire) {
                        return pool.count;
                    }
                    let next = self.next.load(Ordering::Acquire);
                    if n < next + self.ahead {
                        break;
                    }
                    pool = self.taken.wait(pool).unwrap_or_else(|p| p.into_inner());
                }
                // A buffer that came back and holds this range will be taken for it: none
                // to make. (Loose chunks' small buffers come back too, and hold no range.)
                let fits = pool.free.iter().any(|b| b.capacity() >= len);
                if n < self.next.load(Ordering::Acquire) || fits {
                    continue;
                }
            }
            let buf = faulted_in(len);
            let mut pool = self.lock();
            pool.count += 1;
            if n < self.next.load(Ordering::Acquire) {
                // Taken while it was made: for a later range.
                pool.free.push(buf);
            } else {
                pool.made.insert(n, buf);
            }
        }
        self.lock().count
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        // Every holder only moves whole buffers in or out: the pool is whole after a panic.
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `size` zero bytes in memory the kernel has already given: allocated zeroed (fresh pages
/// need no memset), advised into huge pages, then one write a page so that every page is
/// faulted in here rather than under the fetch.
fn faulted_in(size: usize) -> Vec<u8> {
    let mut buf = vec![0u8; size];
    crate::huge::advise(&mut buf);
    for b in buf.iter_mut().step_by(PAGE) {
        // SAFETY: `b` is a valid, aligned, exclusive reference. Volatile, because a plain
        // store of the value the byte already holds may be left out, and the store is what
        // faults the page in.
        unsafe { std::ptr::write_volatile(b, 0) };
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn buffers_are_made_for_the_ranges_ahead_of_the_next_job_at_their_length() {
        // Jobs 0, 1, 3 and 4 are ranges (2 is a loose chunk); two jobs ahead.
        let ranges = [(0, 1 << 20), (1, 8192), (3, 3 << 20), (4, 4096)];
        let next = AtomicUsize::new(0);
        let pool = FetchBuffers::new(&ranges, &next, 2);
        std::thread::scope(|s| {
            let maker = s.spawn(|| pool.make_ahead());
            wait_until("jobs 0 and 1 made", || pool.lock().made.len() == 2);
            // Not past `ahead`: job 3 waits for job 1 to be taken.
            std::thread::sleep(Duration::from_millis(20));
            assert!(!pool.lock().made.contains_key(&3));
            for (n, len) in [(0, 1 << 20), (1, 8192)] {
                next.store(n + 1, Ordering::Release);
                let buf = pool.take(n, len);
                assert_eq!(buf.len(), len);
                assert!(buf.iter().all(|&b| b == 0));
            }
            next.store(3, Ordering::Release);
            pool.take(2, 0);
            wait_until("job 3 made", || pool.lock().made.contains_key(&3));
            next.store(4, Ordering::Release);
            assert_eq!(pool.take(3, 3 << 20).len(), 3 << 20);
            wait_until("job 4 made", || pool.lock().made.contains_key(&4));
            next.store(5, Ordering::Release);
            assert_eq!(pool.take(4, 4096).len(), 4096);
            assert_eq!(maker.join().unwrap(), 4);
        });
    }

    /// Three ranges of a page, one job ahead: `check` runs once the maker has made job 0's
    /// buffer; returns what the maker made in all.
    fn with_three_pages(check: impl FnOnce(&FetchBuffers<'_>, &AtomicUsize)) -> usize {
        let ranges = [(0, 4096), (1, 4096), (2, 4096)];
        let next = AtomicUsize::new(0);
        let pool = FetchBuffers::new(&ranges, &next, 1);
        std::thread::scope(|s| {
            let maker = s.spawn(|| pool.make_ahead());
            // Stopped also when a check fails: the scope waits for the maker before the
            // failure goes on.
            let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                wait_until("job 0 made", || pool.lock().made.contains_key(&0));
                check(&pool, &next);
            }));
            pool.stop();
            let made = maker.join().unwrap();
            if let Err(failure) = checked {
                std::panic::resume_unwind(failure);
            }
            made
        })
    }

    #[test]
    fn buffers_that_came_back_are_taken_first_and_spare_the_maker() {
        let made = with_three_pages(|pool, next| {
            // A loose chunk's small buffer comes back: it holds no range, and spares nothing.
            pool.give_back(vec![1u8; 10]);
            // A buffer comes back before job 0 is taken: it is the one taken (the smallest that
            // holds the range), and the one made for job 0 joins the free list.
            pool.give_back(vec![9u8; 8192]);
            pool.give_back(vec![7u8; 5000]);
            next.store(1, Ordering::Release);
            let got = pool.take(0, 4096);
            assert_eq!((got.capacity() >= 4096, got[0]), (true, 7));
            // Buffers that hold a range wait: the maker makes none for the later jobs.
            next.store(3, Ordering::Release);
            pool.take(1, 4096);
            pool.take(2, 4096);
            // Too small a buffer is never handed out for a range: a new empty one is.
            assert_eq!(pool.take(7, 4096).capacity(), 0);
            assert_eq!(pool.lock().free.len(), 1);
        });
        assert_eq!(made, 1);
    }

    #[test]
    fn a_buffer_too_small_for_the_next_range_does_not_spare_the_maker() {
        let made = with_three_pages(|pool, next| {
            pool.give_back(vec![1u8; 10]);
            next.store(1, Ordering::Release);
            assert_eq!(pool.take(0, 4096).len(), 4096);
            wait_until("job 1 made", || pool.lock().made.contains_key(&1));
        });
        assert_eq!(made, 2);
    }

    #[test]
    fn a_stopped_maker_ends_though_nothing_is_taken() {
        assert_eq!(with_three_pages(|_, _| {}), 1);
    }
}
