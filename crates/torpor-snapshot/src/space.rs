//! Disk space for a snapshot: the least a dump writes, what the target filesystem has free,
//! and whether a failed dump ran out of it. A full disk is then reported as such, with both
//! numbers, instead of as CRIU's exit status.

use std::io;
use std::path::Path;

/// The least CRIU writes for `pids`: their resident anonymous memory (every such page goes into
/// the image), the used bytes of the process's own tmpfs mounts (`own_tmpfs`, paths inside the
/// tree's mount namespace, archived with it) and `extra` (GPU memory the driver's checkpoint
/// moves into the process). Processes or mounts that cannot be read count as 0.
pub fn least_needed(pids: &[i32], own_tmpfs: &[String], extra: u64) -> u64 {
    let anonymous: u64 = pids.iter().filter_map(|&p| anonymous_bytes(p)).sum();
    let tmpfs: u64 = pids
        .first()
        .map(|root| {
            own_tmpfs
                .iter()
                .filter_map(|m| {
                    used_bytes(
                        &Path::new(&format!("/proc/{root}/root")).join(m.trim_start_matches('/')),
                    )
                    .ok()
                })
                .sum()
        })
        .unwrap_or(0);
    anonymous + tmpfs + extra
}

/// `Anonymous:` of /proc/PID/smaps_rollup, in bytes.
fn anonymous_bytes(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Anonymous:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// `statvfs(2)` of the filesystem holding `dir`.
pub fn statvfs(dir: &Path) -> io::Result<libc::statvfs> {
    let path = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str()))
        .map_err(|e| io::Error::other(e.to_string()))?;
    // SAFETY: zeroed is a valid statvfs (plain integers), filled in by the call below.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid C string and `st` a valid, writable statvfs.
    crate::sys::check(unsafe { libc::statvfs(path.as_ptr(), &mut st) })?;
    Ok(st)
}

/// Free bytes on the filesystem holding `dir`, the blocks reserved for root included: CRIU runs
/// as root, and a check that refuses a snapshot must not refuse one that fits.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let st = statvfs(dir)?;
    Ok(st.f_bfree as u64 * st.f_frsize as u64)
}

/// Bytes in use on the filesystem holding `dir`.
fn used_bytes(dir: &Path) -> io::Result<u64> {
    let st = statvfs(dir)?;
    Ok((st.f_blocks as u64).saturating_sub(st.f_bfree as u64) * st.f_frsize as u64)
}

/// Whether CRIU's log says a write failed for want of space (ENOSPC).
pub fn log_says_full(log: &Path) -> bool {
    std::fs::read(log).is_ok_and(|bytes| {
        let needle = b"No space left on device";
        bytes.windows(needle.len()).any(|w| w == needle)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_needs_its_anonymous_memory_at_least() {
        let big = std::hint::black_box(vec![1u8; 8 << 20]);
        let needed = least_needed(&[std::process::id() as i32], &[], 5);
        assert!(needed >= (8 << 20) + 5, "{needed}");
        drop(big);
        assert!(free_bytes(Path::new("/")).unwrap() > 0);
    }

    #[test]
    fn enospc_in_the_log_is_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(
            &log,
            "(00.1) Error (criu/image.c:1): Can't write: No space left on device\n",
        )
        .unwrap();
        assert!(log_says_full(&log));
        std::fs::write(&log, "(00.1) Error (criu/cr-dump.c:1): Dumping FAILED.\n").unwrap();
        assert!(!log_says_full(&log));
        assert!(!log_says_full(&dir.path().join("missing.log")));
    }
}
