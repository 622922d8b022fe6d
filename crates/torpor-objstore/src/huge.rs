//! Fetched ranges in transparent huge pages.
//!
//! Why: a pull fetches its packs into 32 MiB buffers that the store then holds until the chunk
//! files are written after the answer, so every range is new memory. Faulted in 4 KiB at a time
//! that is ~760 000 page faults for GPT-2-Large's 3.1 GB, each taking the zone's and the LRU's
//! locks and a cgroup charge: on the development VM half of the pulling daemon's samples were in
//! the fault path (`bench/cluster/pull.py --perf`), and on the H100 sixteen threads fault side by
//! side. In 2 MiB pages it is ~1 500 faults for the same bytes. Nodes commonly run THP in
//! `madvise` mode (Ubuntu's default), where only memory asked for this way gets huge pages.

/// Huge pages cover 2 MiB on x86-64 and (with 4 KiB base pages) on arm64.
const HUGE: usize = 2 << 20;

/// Asks for huge pages over the 2 MiB-aligned part of `buf`'s spare capacity, when it spans at
/// least one huge page. Advice only: a kernel without THP or a failing call leaves 4 KiB pages.
pub(crate) fn advise_spare(buf: &mut Vec<u8>) {
    let spare = buf.spare_capacity_mut();
    advise_range(spare.as_mut_ptr() as usize, spare.len());
}

/// [`advise_spare`] for memory already in use, before its pages are faulted in.
pub(crate) fn advise(buf: &mut [u8]) {
    advise_range(buf.as_mut_ptr() as usize, buf.len());
}

fn advise_range(start: usize, len: usize) {
    let end = start + len;
    let (from, to) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if to <= from {
        return;
    }
    // SAFETY: [from, to) lies within a buffer its caller holds; MADV_HUGEPAGE changes how the
    // kernel backs those pages, never their contents or mapping.
    unsafe {
        libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advice_leaves_the_buffer_usable_and_small_buffers_alone() {
        let mut small = Vec::with_capacity(4096);
        advise_spare(&mut small);
        small.extend_from_slice(b"abc");
        assert_eq!(small, b"abc");
        let mut big: Vec<u8> = Vec::with_capacity(8 << 20);
        big.extend_from_slice(b"head");
        advise_spare(&mut big);
        // The kernel marked the aligned part for huge pages (`hg` in its VMA's flags).
        let inside = (big.as_ptr() as usize + 4).next_multiple_of(HUGE);
        assert!(
            vma_flags(inside).contains(&"hg".to_owned()),
            "{:?}",
            vma_flags(inside)
        );
        big.resize(8 << 20, 7);
        assert_eq!(&big[..4], b"head");
        assert!(big[4..].iter().all(|&b| b == 7));
    }

    /// The `VmFlags` of the mapping of this process that holds `addr` (proc(5), smaps).
    fn vma_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = head.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.split_whitespace().map(str::to_owned).collect();
                }
            }
        }
        Vec::new()
    }
}
