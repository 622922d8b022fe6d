//! Host memory for copies, pinned once when the daemon starts and handed out from there, so
//! that a pull or a fill never pins memory on its path.
//!
//! Why: pinning is a driver call that maps the memory and takes every page of it
//! (`cuMemHostAlloc`, `pin_user_pages` under the process's address-space lock). During a pull
//! of GPT-2-Large on the H100 the prefill pinned 3.15 GB for the host cache while sixteen
//! writers faulted in their buffers: 1.5–2 threads waited on that lock in every sample, and the
//! fetch took 2.28–2.57 s against 1.67–2.36 s without the prefill
//! (bench/results/cluster-pull-s27-prefill-ab-h100.json, docs/cluster.md). The host cache
//! (`restore_server.host_cache_bytes`) is what holds those buffers, so its bytes are pinned at
//! start (`restore_server.pin_host_cache_at_start`) and the cache's buffers are carved from
//! them; a request the pool cannot serve (full, fragmented) is pinned on its own as before.
//!
//! The offsets are kept by `offset-allocator` (Sebastian Aaltonen's two-level bitmap allocator,
//! Rust port by pcwalton, used by Bevy for its GPU buffers): O(1) allocation and free with
//! neighbour merging, the structure GPU runtimes use to sub-allocate one big buffer. It counts
//! in u32 units, so the pool counts in 4 KiB pages (up to 16 TiB).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use offset_allocator::{Allocation, Allocator};

use super::device::HostBuffer;
use super::lock;

/// The pool's unit: a buffer takes whole pages of it.
const PAGE: usize = 4096;

/// One pinned allocation, carved into buffers.
pub struct HostPool {
    inner: Arc<Inner>,
}

struct Inner {
    /// Keeps the pinned allocation alive (and is never touched again: `base` is its start).
    _memory: Mutex<HostBuffer>,
    base: *mut u8,
    pages: u32,
    free: Mutex<Allocator>,
}

// SAFETY: `base` points into `_memory`'s allocation, which does not move or go away while the
// Inner lives (a boxed buffer, kept until the last PoolBuffer drops its Arc). Each byte range is
// owned by at most one PoolBuffer at a time (the allocator never hands out overlapping ranges
// until the holder frees it), so no two threads reach the same bytes through the pool.
unsafe impl Send for Inner {}
// SAFETY: as above; the allocator is behind a Mutex.
unsafe impl Sync for Inner {}

impl HostPool {
    /// The pool over `memory` (pinned on cuda); `None` when it holds less than a page.
    pub fn new(mut memory: HostBuffer) -> Option<Self> {
        let pages = u32::try_from(memory.len() / PAGE).ok()?;
        if pages == 0 {
            return None;
        }
        let base = memory.as_mut_ptr();
        Some(HostPool {
            inner: Arc::new(Inner {
                _memory: Mutex::new(memory),
                base,
                pages,
                free: Mutex::new(Allocator::new(pages)),
            }),
        })
    }

    /// `len` bytes from the pool, or `None` when no free range holds them.
    pub fn take(&self, len: usize) -> Option<HostBuffer> {
        let pages = u32::try_from(len.div_ceil(PAGE).max(1)).ok()?;
        if pages > self.inner.pages {
            return None;
        }
        let allocation = lock(&self.inner.free).allocate(pages)?;
        let offset = allocation.offset as usize * PAGE;
        Some(Box::new(PoolBuffer {
            inner: Arc::clone(&self.inner),
            allocation,
            // SAFETY: offset + len lies within the pool's pages (the allocator's range is
            // within `pages`, and len <= pages * PAGE of this allocation).
            ptr: unsafe { self.inner.base.add(offset) },
            len,
        }))
    }

    /// The pool's bytes.
    pub fn capacity(&self) -> usize {
        self.inner.pages as usize * PAGE
    }

    /// Its bytes not handed out (the allocator's count: a buffer takes its size class, which
    /// may be more than it asked for).
    pub fn free_bytes(&self) -> usize {
        lock(&self.inner.free).storage_report().total_free_space as usize * PAGE
    }
}

/// A range of the pool, given back when dropped.
struct PoolBuffer {
    inner: Arc<Inner>,
    allocation: Allocation,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the range is this buffer's alone until it is dropped (see Inner).
unsafe impl Send for PoolBuffer {}

impl Deref for PoolBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is this buffer's own range of the live pinned allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for PoolBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` makes this the only reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        lock(&self.inner.free).free(self.allocation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pages: usize) -> HostPool {
        HostPool::new(Box::new(vec![0u8; pages * PAGE])).expect("a pool")
    }

    #[test]
    fn buffers_are_disjoint_and_given_back() {
        let p = pool(64);
        let mut a = p.take(3 * PAGE + 1).expect("a");
        let mut b = p.take(PAGE).expect("b");
        assert_eq!((a.len(), b.len()), (3 * PAGE + 1, PAGE));
        a.fill(1);
        b.fill(2);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        let (ra, rb) = (a.as_ptr_range(), b.as_ptr_range());
        assert!(ra.end <= rb.start || rb.end <= ra.start, "overlap");
        assert!(p.free_bytes() <= 60 * PAGE);
        drop(a);
        drop(b);
        assert_eq!(p.free_bytes(), p.capacity());
        // Everything is one free range again: the whole pool can be had at once.
        assert_eq!(p.take(64 * PAGE).expect("whole").len(), 64 * PAGE);
    }

    #[test]
    fn a_request_it_cannot_hold_is_refused_not_shortened() {
        let p = pool(16);
        assert!(p.take(17 * PAGE).is_none());
        let whole = p.take(16 * PAGE).expect("whole");
        assert!(p.take(1).is_none(), "nothing left");
        drop(whole);
        assert!(p.take(1).is_some());
        assert!(HostPool::new(Box::new(vec![0u8; PAGE - 1])).is_none());
    }

    #[test]
    fn the_memory_outlives_the_pool_while_a_buffer_is_held() {
        let p = pool(8);
        let mut held = p.take(2 * PAGE).expect("held");
        drop(p);
        held.fill(9);
        assert!(held.iter().all(|&x| x == 9));
    }

    #[test]
    fn threads_take_and_give_back_side_by_side() {
        let p = Arc::new(pool(256));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    for i in 0..200 {
                        if let Some(mut b) = p.take((t + i) % 7 * PAGE + 100) {
                            b.fill(t as u8);
                            assert!(b.iter().all(|&x| x == t as u8), "another thread wrote here");
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("thread");
        }
        assert_eq!(p.free_bytes(), p.capacity());
    }
}
