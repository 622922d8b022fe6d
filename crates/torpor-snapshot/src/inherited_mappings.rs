//! Device mappings and files that a process inherited from a CUDA parent by `fork` and can never
//! use.
//!
//! A process forked after its parent initialised CUDA (a PyTorch `DataLoader` worker, one of
//! inductor's compile workers, any `multiprocessing` child) inherits the parent's mappings of
//! `/dev/nvidia*` (a hundred or more `rw-s` windows of the GPU and the UVM range) and its open
//! descriptors of those devices. The child is not a CUDA process (the driver has no state for it,
//! and CUDA cannot be used after `fork`), so the driver checkpoint leaves them in place, and CRIU
//! refuses them ("Can't handle non-regular mapping", "Can't dump file … of that type"). Before
//! the dump, Torpor replaces each such mapping in each such process with an inaccessible
//! anonymous reservation of the same range and points each such descriptor at an eventfd: the
//! address space keeps its shape, CRIU dumps both, and a stray access faults as it would have in
//! the child anyway.
//!
//! Why here and not in the process: a preloaded `pthread_atfork` handler would miss raw `clone`
//! calls and every program not started with the preload, and a CRIU plugin cannot make the
//! restore skip a mapping. Doing it at dump time needs nothing from the program, the same way
//! CRIU's own parasite code changes a process from outside ([`crate::remote_syscall`]).

use std::fs;
use std::io;

use crate::remote_syscall::{RemoteError, RemoteProcess};

/// Mappings of files whose path starts with this are device mappings of the NVIDIA driver.
pub const NVIDIA_DEVICE_PREFIX: &str = "/dev/nvidia";

/// A half-open address range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub start: u64,
    pub end: u64,
}

/// Why the inherited mappings of a process could not be dropped.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The kernel refused the replacement mapping.
    #[error("replacing its mapping {start:#x}-{end:#x} failed: {source}")]
    Replace {
        start: u64,
        end: u64,
        source: io::Error,
    },
    /// Replacing an inherited descriptor failed.
    #[error("replacing its descriptor {fd} of {path} failed: {source}")]
    Close {
        fd: i32,
        path: String,
        source: io::Error,
    },
}

/// What of the NVIDIA driver one process holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceState {
    pub ranges: Vec<Range>,
    /// Descriptors open on `/dev/nvidia*`, with their paths.
    pub fds: Vec<(i32, String)>,
}

impl DeviceState {
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty() && self.fds.is_empty()
    }
}

/// The NVIDIA device mappings and descriptors of `pid`.
pub fn device_state(pid: i32) -> io::Result<DeviceState> {
    let ranges = device_mappings(pid)?;
    let mut fds = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if target.starts_with(NVIDIA_DEVICE_PREFIX) {
            fds.push((fd, target));
        }
    }
    fds.sort();
    Ok(DeviceState { ranges, fds })
}

/// Drops everything `state` lists from `pid`: mappings replaced, descriptors closed.
pub fn drop_device_state(pid: i32, state: &DeviceState) -> Result<(), DropError> {
    if state.is_empty() {
        return Ok(());
    }
    let mut remote = RemoteProcess::seize(pid)?;
    replace(&mut remote, &state.ranges)?;
    if state.fds.is_empty() {
        return Ok(());
    }
    // Each descriptor number stays taken, by an eventfd (which CRIU dumps): the program (or a
    // library's destructor) may close the number later, and must not close a file opened since.
    let errno = |rc: i64| io::Error::from_raw_os_error(-rc as i32);
    let placeholder = remote.syscall(libc::SYS_eventfd2, &[0, libc::EFD_CLOEXEC as u64])?;
    if placeholder < 0 {
        let (fd, path) = state.fds[0].clone();
        return Err(DropError::Close {
            fd,
            path,
            source: errno(placeholder),
        });
    }
    let mut result = Ok(());
    for (fd, path) in &state.fds {
        let rc = remote.syscall(
            libc::SYS_dup3,
            &[placeholder as u64, *fd as u64, libc::O_CLOEXEC as u64],
        )?;
        if rc < 0 {
            result = Err(DropError::Close {
                fd: *fd,
                path: path.clone(),
                source: errno(rc),
            });
            break;
        }
    }
    remote.syscall(libc::SYS_close, &[placeholder as u64])?;
    result
}

/// The NVIDIA device mappings of `pid`, adjacent ones merged.
pub fn device_mappings(pid: i32) -> io::Result<Vec<Range>> {
    Ok(parse_device_mappings(&fs::read_to_string(format!(
        "/proc/{pid}/maps"
    ))?))
}

fn parse_device_mappings(maps: &str) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::new();
    for line in maps.lines() {
        // start-end perms offset dev inode path
        let mut fields = line.splitn(6, char::is_whitespace);
        let Some(span) = fields.next() else { continue };
        let path = fields.nth(4).map(str::trim).unwrap_or("");
        if !path.starts_with(NVIDIA_DEVICE_PREFIX) {
            continue;
        }
        let Some((start, end)) = span.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        match out.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => out.push(Range { start, end }),
        }
    }
    out
}

/// Replaces each range with an inaccessible, unreserved anonymous mapping.
fn replace(remote: &mut RemoteProcess, ranges: &[Range]) -> Result<(), DropError> {
    for r in ranges {
        let rc = remote.syscall(
            libc::SYS_mmap,
            &[
                r.start,
                r.end - r.start,
                libc::PROT_NONE as u64,
                (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE)
                    as u64,
                u64::MAX, // fd -1
                0,
            ],
        )?;
        if rc < 0 {
            return Err(DropError::Replace {
                start: r.start,
                end: r.end,
                source: io::Error::from_raw_os_error(-rc as i32),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_merges_nvidia_mappings_only() {
        let maps = "\
200000000-200200000 rw-s 00000000 00:05 612 /dev/nvidia0
200200000-200400000 rw-s 00000000 00:05 612 /dev/nvidiactl
200600000-200800000 rw-s 00000000 00:05 613 /dev/nvidia-uvm
300000000-300200000 ---p 00000000 00:00 0 
7f0000000000-7f0000001000 r--p 00000000 08:01 42 /usr/lib/libcuda.so.580
7f0000002000-7f0000003000 rw-s 00000000 00:05 612 /dev/nvidia0 (deleted)
";
        assert_eq!(
            parse_device_mappings(maps),
            vec![
                Range {
                    start: 0x2_0000_0000,
                    end: 0x2_0040_0000
                },
                Range {
                    start: 0x2_0060_0000,
                    end: 0x2_0080_0000
                },
                Range {
                    start: 0x7f00_0000_2000,
                    end: 0x7f00_0000_3000
                },
            ]
        );
    }

    #[test]
    fn a_process_without_device_state_has_none() {
        let me = std::process::id() as i32;
        let state = device_state(me).unwrap();
        assert!(state.is_empty(), "{state:?}");
        assert!(drop_device_state(me, &state).is_ok());
    }
}
