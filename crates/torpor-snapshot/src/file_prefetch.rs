//! Reading ahead, in parallel, the pages of mapped files that CRIU's restore reads one fault at
//! a time.
//!
//! CRIU restores a saved page of a private file mapping (a library's relocated data) by mapping
//! the file and writing the page over it; the kernel first reads the file's page, synchronously,
//! and before that CRIU reads each file's ELF header to check its build-id. With the page cache
//! warm that costs nothing; after it was dropped (a node that has not run this base lately) it
//! was most of a GPT-2-Large worker's CPU restore on the H200: 1.7-1.8 s against 0.11 s, of
//! which 1.0 s in those faults and 0.66 s mapping the files (`bench/coldstart/criu_log_gaps.py`
//! on `TORPOR_KEEP_RESTORE_LOG=1` logs; docs/split.md, "Cold from disk").
//!
//! [`prefetch`] asks the kernel to read exactly those ranges (`posix_fadvise(WILLNEED)`, which
//! queues the reads and returns), and the first pages of each file, before CRIU starts: the
//! disk then serves them side by side instead of one after another. It runs beside the image's
//! verification, which reads the image from disk too. Only files the authenticated manifest
//! lists as reopened are touched (the images are read before their hashes are checked, so a
//! damaged image can at worst make it read ahead other pages of those files). Never an error:
//! anything it cannot read is left for CRIU to report.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use torpor_image::ReopenedFile;

/// The first bytes of each reopened file: its ELF header and program headers, and the build-id
/// note CRIU reads at restore (they sit in the first pages of every library seen).
pub const HEADER_BYTES: u64 = 64 * 1024;

/// What [`prefetch`] asked the kernel to read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefetched {
    pub files: usize,
    pub ranges: usize,
    pub bytes: u64,
}

/// Reads ahead the pages of `reopened` files that a restore of the images in `dir` will read
/// (see the module doc); `root` is where the tree's paths are found (`/`).
pub fn prefetch(dir: &Path, reopened: &[ReopenedFile], root: &Path) -> Prefetched {
    let listed: HashSet<&str> = reopened.iter().map(|f| f.path.as_str()).collect();
    let mut ranges: Vec<(String, Vec<(u64, u64)>)> = reopened
        .iter()
        .map(|f| (f.path.clone(), vec![(0, HEADER_BYTES.min(f.size))]))
        .collect();
    // Images this CRIU cannot read as it writes them: headers only (CRIU will say what is wrong).
    if let Ok(pages) = torpor_criu::images::private_file_pages(dir) {
        for p in pages {
            if !listed.contains(p.path.as_str()) {
                continue;
            }
            if let Some((_, r)) = ranges.iter_mut().find(|(path, _)| *path == p.path) {
                r.extend(p.ranges);
            }
        }
    }
    // Several files at once: opening one whose inode is not cached is itself a wait for the
    // disk, and one after another they delayed the last files' reads by a second.
    let per = ranges.len().div_ceil(THREADS).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = ranges
            .chunks(per)
            .map(|part| scope.spawn(move || read_ahead(part, root)))
            .collect();
        parts
            .into_iter()
            .filter_map(|h| h.join().ok())
            .fold(Prefetched::default(), |a, b| Prefetched {
                files: a.files + b.files,
                ranges: a.ranges + b.ranges,
                bytes: a.bytes + b.bytes,
            })
    })
}

/// Threads [`prefetch`] opens files and queues their reads on.
const THREADS: usize = 8;

/// Queues the reads of `ranges` ((path, [(offset, len)])) under `root`.
fn read_ahead(ranges: &[(String, Vec<(u64, u64)>)], root: &Path) -> Prefetched {
    let mut out = Prefetched::default();
    for (path, list) in ranges {
        // Non-blocking: a path that is now a FIFO must not hang the thread in open(); only
        // regular files are read ahead (check_reopened refuses anything else).
        let Ok(file) = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(root.join(path.trim_start_matches('/')))
        else {
            continue;
        };
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            continue;
        }
        out.files += 1;
        for &(offset, len) in list {
            let (Ok(o), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
                continue;
            };
            // SAFETY: a valid fd for the call's duration; the advice changes no memory of ours.
            let rc =
                unsafe { libc::posix_fadvise(file.as_raw_fd(), o, l, libc::POSIX_FADV_WILLNEED) };
            if rc == 0 {
                out.ranges += 1;
                out.bytes += len;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlisted_and_missing_files_are_skipped_and_headers_are_read_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("lib.so");
        std::fs::write(&lib, vec![7u8; 256 * 1024]).unwrap();
        let listed = |path: &str, size: u64| ReopenedFile {
            path: path.into(),
            size,
            sha256: String::new(),
        };
        // A FIFO where a library was must not block the open.
        let fifo = dir.path().join("fifo.so");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // No images in `dir`: headers only; the missing file and the FIFO are not counted.
        let got = prefetch(
            dir.path(),
            &[
                listed("/lib.so", 256 * 1024),
                listed("/gone.so", 10),
                listed("/fifo.so", 10),
            ],
            dir.path(),
        );
        assert_eq!(
            got,
            Prefetched {
                files: 1,
                ranges: 1,
                bytes: HEADER_BYTES
            }
        );
    }
}
