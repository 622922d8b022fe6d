//! Disk space for a snapshot: the least a dump writes, what the target filesystem has free,
//! and whether a failed dump ran out of it. A full disk is then reported as such, with both
//! numbers, instead of as CRIU's exit status.
//!
//! [`check`] is the preflight `torpor snapshot` runs before it touches the source, and
//! [`check_tree`] the same check for a caller that has not read the tree yet (torpord, before it
//! quiesces an instance for hibernation): a dump that fills its filesystem after the driver's
//! checkpoint has moved the GPU memory into the process is the riskiest failure there is.
//!
//! A snapshot counts only the space the filesystem makes available to everyone (`f_bavail`),
//! never the blocks it reserves: on the GPU machine's ext4 (mounted `resuid=65534,resv_strict`)
//! 172 GB were reserved and root's dump got ENOSPC with 129 MB available, while a count of the
//! reserve had let it start; where root may use the reserve, it is the system's last room.

use std::io;
use std::path::{Path, PathBuf};

use torpor_image::human_size;

/// Why a snapshot would not fit. Each message has the numbers and the fix.
#[derive(Debug, thiserror::Error)]
pub enum NoSpace {
    /// The snapshot's filesystem cannot hold it (found before the dump), or CRIU filled it
    /// (`log` is CRIU's log then).
    #[error("no space for the snapshot in {}: {}; free space there or put the snapshots (the state dir) on a larger filesystem", dir.display(), disk_full_detail(*needed, *available, *reserved, log.as_deref()))]
    Disk {
        dir: PathBuf,
        /// The least the dump writes ([`least_needed`]).
        needed: u64,
        /// Available when the snapshot began ([`Room`]).
        available: u64,
        /// Free but reserved by the filesystem then, named so a `df` that shows it is understood.
        reserved: u64,
        log: Option<PathBuf>,
    },
    /// The driver's checkpoint moves the tree's GPU memory into its host memory, and the host
    /// has less than that available: the kernel's OOM killer would end the source.
    #[error("not enough host memory for the snapshot: the CUDA checkpoint moves the {} the process holds on the GPU into host memory, and {} is available (MemAvailable + SwapFree); free host memory, or hold less GPU memory (e.g. limit the framework's pre-allocated pool) before snapshotting", human_size(*gpu), human_size(*available))]
    HostMemory { gpu: u64, available: u64 },
}

fn disk_full_detail(needed: u64, available: u64, reserved: u64, log: Option<&Path>) -> String {
    let reserve = if reserved > OWN_RESERVE {
        format!(
            " (and {} reserved by the filesystem, which a snapshot does not use)",
            human_size(reserved)
        )
    } else {
        String::new()
    };
    match log {
        None => format!(
            "it needs at least {}, the filesystem has {} available{reserve}",
            human_size(needed),
            human_size(available)
        ),
        Some(log) => format!(
            "CRIU filled the filesystem during the dump: it needs more than the {} that were available{reserve} (at least {} for the process's memory alone; CRIU's log: {})",
            human_size(available),
            human_size(needed),
            log.display()
        ),
    }
}

/// What a snapshot needs and what its filesystem had when it was checked.
#[derive(Debug, Clone)]
pub struct Estimate {
    /// The directory the snapshot goes in (named in messages).
    pub dir: PathBuf,
    pub needed: u64,
    pub room: Room,
}

impl Estimate {
    /// The error for this estimate, with CRIU's log when the dump itself filled the disk.
    pub fn full(&self, log: Option<PathBuf>) -> NoSpace {
        NoSpace::Disk {
            dir: self.dir.clone(),
            needed: self.needed,
            available: self.room.available,
            reserved: self.room.reserved,
            log,
        }
    }
}

/// The preflight: refuses when the filesystem holding `dir` cannot hold the least the dump of
/// `pids` writes ([`least_needed`]), or when the host cannot take `gpu_bytes` (the tree's GPU
/// memory, which the driver's checkpoint moves into the process) into memory. `dir` must exist.
pub fn check(
    pids: &[i32],
    own_tmpfs: &[String],
    gpu_bytes: u64,
    dir: &Path,
) -> Result<Estimate, NoSpace> {
    let estimate = Estimate {
        dir: std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()),
        needed: least_needed(pids, own_tmpfs, gpu_bytes),
        // Unreadable: no refusal on a guess (the dump's own failure is still named).
        room: room(dir).unwrap_or(Room {
            available: u64::MAX,
            reserved: 0,
        }),
    };
    verdict(estimate, gpu_bytes, host_memory_available())
}

/// The decision of [`check`] on its figures (`available`: host memory, when known).
fn verdict(
    estimate: Estimate,
    gpu_bytes: u64,
    available: Option<u64>,
) -> Result<Estimate, NoSpace> {
    if let Some(available) = available.filter(|&a| gpu_bytes > a) {
        return Err(NoSpace::HostMemory {
            gpu: gpu_bytes,
            available,
        });
    }
    if estimate.room.available < estimate.needed {
        return Err(estimate.full(None));
    }
    Ok(estimate)
}

/// [`check`] for the tree rooted at `root`, snapshotted into a new directory in `dir`: reads
/// the tree, its own tmpfs mounts and (when NVML loads) its GPU memory.
pub fn check_tree(root: i32, dir: &Path) -> Result<Estimate, NoSpace> {
    let pids = crate::proctree::tree(root);
    let archived: Vec<String> = crate::mounts::plan(root)
        .map(|p| p.archived.into_iter().map(|a| a.path).collect())
        .unwrap_or_default();
    check(&pids, &archived, gpu_bytes_of(&pids), dir)
}

/// The GPU memory NVML lists for `pids`; 0 without NVML.
pub fn gpu_bytes_of(pids: &[i32]) -> u64 {
    let Ok(nvml) = torpor_cuda::Nvml::load() else {
        return 0;
    };
    nvml.process_memory()
        .map(|procs| {
            procs
                .iter()
                .filter(|p| i32::try_from(p.pid).is_ok_and(|pid| pids.contains(&pid)))
                .map(|p| p.used_memory.unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// `MemAvailable` + `SwapFree` of /proc/meminfo, in bytes.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some(field("MemAvailable:")? + field("SwapFree:").unwrap_or(0))
}

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

/// `RssAnon:` of /proc/PID/status, in bytes: the kernel's counter of the process's resident
/// anonymous pages. `Anonymous:` of smaps_rollup says the same but walks every page table to
/// say it (~13 ms a GiB of 4 KiB pages), and a hibernation's stop waits for this check.
fn anonymous_bytes(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
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

/// The room on a filesystem, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// What any user may write (`f_bavail`): what a snapshot counts on.
    pub available: u64,
    /// Free blocks the filesystem keeps back (`f_bfree - f_bavail`): a reserve root may use
    /// (ext4's default, with CAP_SYS_RESOURCE) or one it may not (ext4 mounted `resv_strict`
    /// for another uid: root's writes fail with ENOSPC while `df` shows the blocks unused).
    pub reserved: u64,
}

/// The [`Room`] on the filesystem holding `dir`.
pub fn room(dir: &Path) -> io::Result<Room> {
    let st = statvfs(dir)?;
    let unit = st.f_frsize as u64;
    let (free, available) = (st.f_bfree as u64 * unit, st.f_bavail as u64 * unit);
    Ok(Room {
        available,
        reserved: free.saturating_sub(available),
    })
}

/// Bytes in use on the filesystem holding `dir`.
fn used_bytes(dir: &Path) -> io::Result<u64> {
    let st = statvfs(dir)?;
    Ok((st.f_blocks as u64).saturating_sub(st.f_bfree as u64) * st.f_frsize as u64)
}

/// Available space below which a filesystem that a failed dump wrote to counts as filled by it.
const FULL_BELOW: u64 = 4 << 20;
/// The most space a filesystem holds back from every user of its own accord (ext4 keeps up to
/// 4096 clusters, 16 MiB at 4 KiB, even from root): a smaller reserve is not worth naming.
const OWN_RESERVE: u64 = 64 << 20;

/// Whether the filesystem holding `dir` is all but full (after a failed dump: CRIU's log is on it,
/// so the log may lack the ENOSPC line that says so). Its reserve does not count ([`Room`]).
pub fn left_full(dir: &Path) -> bool {
    room(dir).is_ok_and(|r| r.available < FULL_BELOW)
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
        assert!(room(Path::new("/")).unwrap().available > 0);
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

    #[test]
    fn check_refuses_what_the_filesystem_cannot_hold_with_both_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let me = [std::process::id() as i32];
        let fits = check(&me, &[], 0, dir.path()).unwrap();
        assert!(fits.needed > 0 && fits.room.available >= fits.needed);
        let at = |needed, available, reserved| Estimate {
            dir: PathBuf::from("/snapshots"),
            needed,
            room: Room {
                available,
                reserved,
            },
        };
        verdict(at(10 << 30, 10 << 30, 0), 0, None).unwrap();
        let err = verdict(at(3 << 30, 1 << 30, 0), 2 << 30, Some(64 << 30)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "no space for the snapshot in /snapshots: it needs at least 3.22 GB, the filesystem \
             has 1.07 GB available; free space there or put the snapshots (the state dir) on a \
             larger filesystem"
        );
        // The reserve is not counted, and is named: `df` shows it as free.
        let err = verdict(at(3 << 30, 1 << 30, 100 << 30), 0, None).unwrap_err();
        assert!(
            err.to_string().contains(
                "the filesystem has 1.07 GB available (and 107 GB reserved by the filesystem, \
                 which a snapshot does not use)"
            ),
            "{err}"
        );
        let filled = at(3 << 30, 1 << 30, 100 << 30).full(Some(PathBuf::from("/logs/dump.log")));
        assert!(
            filled.to_string().contains(
                "CRIU filled the filesystem during the dump: it needs more than the 1.07 GB that \
                 were available (and 107 GB reserved"
            ),
            "{filled}"
        );
    }

    #[test]
    fn gpu_memory_must_fit_in_host_memory() {
        let dir = tempfile::tempdir().unwrap();
        let me = [std::process::id() as i32];
        let err = check(&me, &[], u64::MAX / 4, dir.path()).unwrap_err();
        assert!(
            matches!(err, NoSpace::HostMemory { gpu, available } if gpu == u64::MAX / 4 && available > 0),
            "{err}"
        );
        assert!(err.to_string().contains("MemAvailable"), "{err}");
    }
}
