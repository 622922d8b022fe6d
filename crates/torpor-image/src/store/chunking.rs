//! Cutting a file or segment into chunks.
//!
//! - Device segments: fixed-size chunks ([`SEGMENT_CHUNK_BYTES`], the last one short). A buffer
//!   is shared between snapshots whole or not at all, at the same offsets, so content-defined
//!   cuts would buy nothing, and fixed cuts let a reader fill its slices in parallel.
//! - CRIU `pages-*.img`: the dumped pages, one after another in pagemap order. When one
//!   mapping grows, appears or disappears between two dumps, every page after it moves by whole
//!   pages. Content-defined chunking at page granularity ([`PageCdc`]) cuts after a page whose
//!   fingerprint matches a pattern, so the cuts move with the content and identical memory at
//!   shifted offsets still yields identical chunks. Cutting only between pages keeps chunks
//!   page-aligned. (The alternative, one chunk per pagemap entry, needs CRIU's protobuf
//!   pagemap and still has to split large entries; page CDC needs neither.)
//! - Other image files are small: one chunk each.

use std::ops::Range;

use rayon::prelude::*;

/// Size of a page in CRIU's pages images.
pub const PAGE_SIZE: usize = 4096;

/// Size of the chunks of device segments.
pub const SEGMENT_CHUNK_BYTES: usize = 4 << 20;

/// How to cut data into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunking {
    /// Chunks of this many bytes; the last one short.
    Fixed { bytes: usize },
    /// Content-defined, page-aligned.
    Pages(PageCdc),
    /// The whole data as one chunk.
    Whole,
}

impl Chunking {
    /// The chunking for device segments.
    pub const SEGMENT: Chunking = Chunking::Fixed {
        bytes: SEGMENT_CHUNK_BYTES,
    };

    /// The chunking for a file of a CRIU image directory named `name`: page CDC for
    /// `pages-*.img`, one chunk for everything else.
    pub fn for_image_file(name: &str) -> Chunking {
        let base = name.rsplit('/').next().unwrap_or(name);
        if base.starts_with("pages-") && base.ends_with(".img") {
            Chunking::Pages(PageCdc::default())
        } else {
            Chunking::Whole
        }
    }

    /// The byte ranges of the chunks of `data`, in order, covering it exactly. Empty data has
    /// no chunks.
    pub fn cut(&self, data: &[u8]) -> Vec<Range<usize>> {
        match *self {
            _ if data.is_empty() => Vec::new(),
            Chunking::Whole => std::iter::once(0..data.len()).collect(),
            Chunking::Fixed { bytes } => {
                let bytes = bytes.max(1);
                (0..data.len())
                    .step_by(bytes)
                    .map(|start| start..(start + bytes).min(data.len()))
                    .collect()
            }
            Chunking::Pages(cdc) => cdc.cut(data),
        }
    }
}

/// Content-defined chunking between pages: a chunk ends after a page whose fingerprint has its
/// low bits all zero (one page in `avg_pages` on average), but never before `min_pages` pages
/// and always at `max_pages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCdc {
    pub min_pages: usize,
    /// A power of two.
    pub avg_pages: usize,
    pub max_pages: usize,
}

impl Default for PageCdc {
    /// 8 pages (32 KiB) on average, from 2 to 32 pages. Measured on two dumps of one Python
    /// process whose memory changed in between (tests/store_criu.rs, `--nocapture`): of the
    /// second dump's 35 MB of pages, 81% are identical page for page; page CDC finds 64% shared
    /// at 16 pages average, 71% at 8, 76% at 4, with 2.2 times as many chunks at 4 as at 8;
    /// fixed 64 KiB chunks find 6% (one inserted mapping shifts everything after it). 8 pages
    /// keep most of what is there to find at ~80 000 chunk files for a 2.6 GB image.
    fn default() -> Self {
        PageCdc {
            min_pages: 2,
            avg_pages: 8,
            max_pages: 32,
        }
    }
}

impl PageCdc {
    fn cut(&self, data: &[u8]) -> Vec<Range<usize>> {
        let mask = (self.avg_pages.max(1).next_power_of_two() - 1) as u64;
        let min = self.min_pages.max(1);
        let max = self.max_pages.max(min);
        // Fingerprints in parallel (BLAKE3 is built optimised even in debug builds), cuts in order.
        let cut_after: Vec<bool> = data
            .par_chunks(PAGE_SIZE)
            .map(|page| page_fingerprint(page) & mask == 0)
            .collect();
        let mut chunks = Vec::with_capacity(cut_after.len() / min + 1);
        let mut start_page = 0;
        for (page, &cut) in cut_after.iter().enumerate() {
            let pages = page + 1 - start_page;
            if pages >= max || (pages >= min && cut) {
                chunks.push(start_page * PAGE_SIZE..((page + 1) * PAGE_SIZE).min(data.len()));
                start_page = page + 1;
            }
        }
        if start_page < cut_after.len() {
            chunks.push(start_page * PAGE_SIZE..data.len());
        }
        chunks
    }
}

fn page_fingerprint(page: &[u8]) -> u64 {
    let hash = blake3::hash(page);
    u64::from_le_bytes(hash.as_bytes()[..8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(len: usize, seed: &[u8]) -> Vec<u8> {
        let mut data = vec![0u8; len];
        blake3::Hasher::new()
            .update(seed)
            .finalize_xof()
            .fill(&mut data);
        data
    }

    fn assert_covers(chunks: &[Range<usize>], len: usize) {
        let mut next = 0;
        for c in chunks {
            assert_eq!(c.start, next);
            assert!(c.end > c.start);
            next = c.end;
        }
        assert_eq!(next, len);
    }

    #[test]
    fn fixed_chunks_end_short() {
        let data = vec![1u8; 10];
        let chunks = Chunking::Fixed { bytes: 4 }.cut(&data);
        assert_eq!(chunks, [0..4, 4..8, 8..10]);
        assert_eq!(Chunking::SEGMENT.cut(&data), Chunking::Whole.cut(&data));
        assert!(Chunking::SEGMENT.cut(&[]).is_empty());
        assert_eq!(Chunking::Whole.cut(&data).first(), Some(&(0..10)));
    }

    #[test]
    fn image_files_pick_their_chunking() {
        assert!(matches!(
            Chunking::for_image_file("pages-1.img"),
            Chunking::Pages(_)
        ));
        assert!(matches!(
            Chunking::for_image_file("sub/pages-12.img"),
            Chunking::Pages(_)
        ));
        for whole in [
            "pagemap-1.img",
            "core-1.img",
            "pages-1.img.log",
            "inventory.img",
        ] {
            assert_eq!(Chunking::for_image_file(whole), Chunking::Whole, "{whole}");
        }
    }

    #[test]
    fn page_cuts_are_aligned_bounded_and_follow_shifted_content() {
        let cdc = PageCdc::default();
        let data = pseudo_random(600 * PAGE_SIZE, b"pages");
        let chunks = Chunking::Pages(cdc).cut(&data);
        assert_covers(&chunks, data.len());
        for c in &chunks {
            assert_eq!(c.start % PAGE_SIZE, 0);
            let pages = c.len() / PAGE_SIZE;
            assert!(pages <= cdc.max_pages, "{pages}");
        }
        for c in &chunks[..chunks.len() - 1] {
            assert!(c.len() / PAGE_SIZE >= cdc.min_pages);
        }
        // Content-defined: roughly 600 / avg chunks, not 600 / max.
        assert!(chunks.len() > 600 / cdc.max_pages * 2, "{}", chunks.len());

        // Three new pages in front: all but the first few chunks come out identical.
        let mut shifted = pseudo_random(3 * PAGE_SIZE, b"new");
        shifted.extend_from_slice(&data);
        let ids = |d: &[u8]| -> std::collections::HashSet<blake3::Hash> {
            Chunking::Pages(cdc)
                .cut(d)
                .into_iter()
                .map(|r| blake3::hash(&d[r]))
                .collect()
        };
        let (before, after) = (ids(&data), ids(&shifted));
        let common = before.intersection(&after).count();
        assert!(common + 3 >= before.len(), "{common} of {}", before.len());
        // Fixed chunking loses everything to the same shift.
        let fixed = Chunking::Fixed {
            bytes: 16 * PAGE_SIZE,
        };
        let fixed_ids = |d: &[u8]| -> std::collections::HashSet<blake3::Hash> {
            fixed
                .cut(d)
                .into_iter()
                .map(|r| blake3::hash(&d[r]))
                .collect()
        };
        assert_eq!(
            fixed_ids(&data).intersection(&fixed_ids(&shifted)).count(),
            0
        );
    }

    #[test]
    fn a_partial_last_page_is_kept() {
        let data = pseudo_random(5 * PAGE_SIZE + 100, b"tail");
        let chunks = Chunking::Pages(PageCdc {
            min_pages: 1,
            avg_pages: 1,
            max_pages: 2,
        })
        .cut(&data);
        assert_covers(&chunks, data.len());
        assert_eq!(chunks.last().expect("chunks").end, data.len());
    }
}
