//! A process's private memory gathered into 2 MiB pages before it is dumped.
//!
//! CRIU's dump drains a process's pages into pipes one `vmsplice` entry per page it finds, and
//! the process stays frozen meanwhile. A worker restored lazily has all its memory in 4 KiB
//! pages (userfaultfd fills them one small page at a time), and the driver's checkpoint of a
//! released GPU worker is fresh 4 KiB memory too. On the development VM, CRIU dumped 1 GiB of
//! 4 KiB pages in 0.51-1.36 s and the same GiB in 2 MiB pages in 0.36-0.39 s, and collapsed from
//! outside (below) in 0.36-0.47 s.
//!
//! `process_madvise(MADV_COLLAPSE)` (Linux 6.1) has the kernel copy each 2 MiB range of another
//! process into one huge page, synchronously, whatever the node's THP mode (`madvise` on most
//! distributions), while the process runs. It costs a copy of the memory (2.3-2.7 s for 1 GiB
//! on the development VM), so it is done while the instance is idle, before a hibernation, not
//! in its stop. Only ranges whose 512 small pages are all present are collapsed: a collapse
//! fills the holes of a range with zeroes, which would grow the process and its image. A range
//! the kernel refuses (pinned pages, a range under userfaultfd) stays as it is; the dump is as
//! correct either way, only slower.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Instant;

/// `MADV_COLLAPSE` (include/uapi/asm-generic/mman-common.h; not in the libc crate).
const MADV_COLLAPSE: libc::c_int = 25;
/// A huge page, and the unit collapsed.
const HUGE: u64 = 2 << 20;
const PAGE: u64 = 4096;
/// Pagemap entry: page present in memory.
const PM_PRESENT: u64 = 1 << 63;

/// What [`collapse`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Collapsed {
    /// 2 MiB ranges fully present, so asked for.
    pub ranges: u64,
    /// Bytes the kernel collapsed (or found huge already).
    pub bytes: u64,
    /// Ranges it refused.
    pub refused: u64,
    pub seconds: f64,
}

/// Why nothing could be collapsed.
#[derive(Debug, thiserror::Error)]
pub enum CollapseError {
    #[error("cannot read the memory map of pid {pid} ({what}): {source}")]
    Read {
        pid: i32,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("pidfd_open of pid {pid}: {source}")]
    Pidfd {
        pid: i32,
        #[source]
        source: io::Error,
    },
    #[error("this kernel cannot collapse another process's memory (process_madvise MADV_COLLAPSE: {source}); it needs Linux 6.1 with transparent huge pages")]
    Unsupported {
        #[source]
        source: io::Error,
    },
}

/// A private, writable, anonymous mapping (or the heap): what a dump copies page by page.
fn private_anonymous(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    let range = fields.next()?;
    let perms = fields.next()?;
    let _offset = fields.next()?;
    let _dev = fields.next()?;
    let inode = fields.next()?;
    let path = fields.next().unwrap_or("");
    if !perms.starts_with("rw") || !perms.ends_with('p') || inode != "0" {
        return None;
    }
    if !(path.is_empty() || path == "[heap]") {
        return None;
    }
    let (a, b) = range.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

/// The 2 MiB-aligned ranges inside `maps`' private anonymous mappings whose pages are all
/// present, as `pagemap` says.
fn full_ranges(maps: &[(u64, u64)], pagemap: &File) -> io::Result<Vec<u64>> {
    let mut out = Vec::new();
    let mut entries = vec![0u8; (HUGE / PAGE) as usize * 8];
    for &(start, end) in maps {
        let mut at = start.div_ceil(HUGE) * HUGE;
        while at + HUGE <= end {
            pagemap.read_exact_at(&mut entries, at / PAGE * 8)?;
            let all = entries
                .chunks_exact(8)
                .all(|e| u64::from_le_bytes(e.try_into().expect("8 bytes")) & PM_PRESENT != 0);
            if all {
                out.push(at);
            }
            at += HUGE;
        }
    }
    Ok(out)
}

/// Collapses every fully present 2 MiB range of `pid`'s private anonymous memory into a huge
/// page (the module doc says why and when).
pub fn collapse(pid: i32) -> Result<Collapsed, CollapseError> {
    let start = Instant::now();
    let read = |what, source| CollapseError::Read { pid, what, source };
    let maps = File::open(format!("/proc/{pid}/maps")).map_err(|e| read("maps", e))?;
    let mut areas = Vec::new();
    for line in BufReader::new(maps).lines() {
        let line = line.map_err(|e| read("maps", e))?;
        if let Some((a, b)) = private_anonymous(&line) {
            if b - a >= HUGE {
                areas.push((a, b));
            }
        }
    }
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).map_err(|e| read("pagemap", e))?;
    let ranges = full_ranges(&areas, &pagemap).map_err(|e| read("pagemap", e))?;
    // SAFETY: pidfd_open(2) returns a new descriptor, owned right away.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(CollapseError::Pidfd {
            pid,
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: `fd` is the fresh descriptor above.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut done = Collapsed {
        ranges: ranges.len() as u64,
        ..Collapsed::default()
    };
    for at in ranges {
        let iov = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: HUGE as usize,
        };
        // SAFETY: process_madvise(2) reads one iovec describing the target's memory, not ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                pidfd.as_raw_fd(),
                &iov as *const libc::iovec,
                1,
                MADV_COLLAPSE,
                0,
            )
        };
        if r >= 0 {
            done.bytes += r as u64;
            continue;
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // No process_madvise, or no MADV_COLLAPSE: nothing will collapse.
            Some(libc::ENOSYS) if done.bytes == 0 => {
                return Err(CollapseError::Unsupported { source: err })
            }
            Some(libc::EINVAL) if done.bytes == 0 && done.refused == 0 => {
                return Err(CollapseError::Unsupported { source: err })
            }
            // The process is gone: what was done stays done.
            Some(libc::ESRCH) => break,
            // Pinned or locked pages, memory short (EAGAIN, ENOMEM, EBUSY, EINVAL on one
            // odd range): that range stays small.
            _ => done.refused += 1,
        }
    }
    done.seconds = start.elapsed().as_secs_f64();
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};

    /// A process holding 64 MiB of private memory, all written, plus 8 MiB of which it wrote one
    /// page in four; it prints the two addresses, then waits for a line on stdin.
    const HOLDER: &str = r#"
import mmap, sys
full = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
full.write(bytes(range(256)) * (256 << 10))
# Executable too, so that the kernel does not merge it with `full` into one mapping.
sparse = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
for i in range(0, 8 << 20, 16384):
    sparse[i] = 7
import ctypes
addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr(full), addr(sparse), flush=True)
sys.stdin.readline()
print(sum(full[i] for i in range(0, 64 << 20, 4093)), sum(sparse[i] for i in range(0, 8 << 20, 4096)), flush=True)
"#;

    fn smaps_huge_kb(pid: u32, at: u64) -> u64 {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("smaps");
        let mut inside = false;
        for line in text.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
                    {
                        inside = a <= at && at < b;
                        continue;
                    }
                }
            }
            if inside {
                if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                    return kb
                        .trim()
                        .trim_end_matches(" kB")
                        .trim()
                        .parse()
                        .expect("kB");
                }
            }
        }
        0
    }

    #[test]
    fn full_ranges_are_collapsed_sparse_ones_left_and_the_contents_kept() {
        // With `always`, the mappings would be huge from their first write, sparse or not.
        if !std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .map(|m| m.contains("[madvise]"))
            .unwrap_or(false)
        {
            eprintln!("SKIP: the node's THP mode is not `madvise`");
            return;
        }
        let mut child = Command::new("python3")
            .arg("-c")
            .arg(HOLDER)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        out.read_line(&mut line).expect("addresses");
        let addrs: Vec<u64> = line
            .split_whitespace()
            .map(|a| a.parse().expect("addr"))
            .collect();
        let (full, sparse) = (addrs[0], addrs[1]);
        let pid = child.id();
        let before = smaps_huge_kb(pid, full);

        let done = collapse(pid as i32).expect("collapse");
        assert!(done.ranges >= 31, "{done:?}"); // 64 MiB, at worst not 2 MiB-aligned at both ends
        assert!(done.bytes >= 31 * HUGE, "{done:?}");
        let after = smaps_huge_kb(pid, full);
        assert!(
            after >= before + 31 * 2048,
            "AnonHugePages {before} -> {after} kB"
        );
        assert_eq!(
            smaps_huge_kb(pid, sparse),
            0,
            "a range with holes was collapsed"
        );

        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(b"\n")
            .expect("go on");
        let mut sums = String::new();
        out.read_line(&mut sums).expect("sums");
        let expect_full: u64 = (0..64u64 << 20).step_by(4093).map(|i| i % 256).sum();
        let expect_sparse: u64 = (0..8u64 << 20)
            .step_by(4096)
            .map(|i| if i % 16384 == 0 { 7 } else { 0 })
            .sum();
        assert_eq!(sums.trim(), format!("{expect_full} {expect_sparse}"));
        assert!(child.wait().expect("wait").success());
    }

    #[test]
    fn a_process_gone_is_one_error_naming_it() {
        let mut child = Command::new("true").spawn().expect("true");
        let pid = child.id() as i32;
        child.wait().expect("wait");
        let e = collapse(pid).expect_err("gone").to_string();
        assert!(e.contains(&format!("pid {pid}")), "{e}");
    }

    #[test]
    fn only_private_writable_anonymous_mappings_count() {
        assert_eq!(
            private_anonymous("7f0000000000-7f0000400000 rw-p 00000000 00:00 0 "),
            Some((0x7f00_0000_0000, 0x7f00_0040_0000))
        );
        assert!(private_anonymous("55d0-55f0 rw-p 00000000 00:00 0   [heap]").is_some());
        assert!(private_anonymous("7f00-7f40 r--p 00000000 00:00 0 ").is_none());
        assert!(
            private_anonymous("7f00-7f40 rw-s 00000000 00:01 12 /dev/zero (deleted)").is_none()
        );
        assert!(
            private_anonymous("7f00-7f40 rw-p 00001000 fd:01 123 /usr/lib/libc.so.6").is_none()
        );
        assert!(private_anonymous("7ffc-7ffd rw-p 00000000 00:00 0   [stack]").is_none());
    }
}
