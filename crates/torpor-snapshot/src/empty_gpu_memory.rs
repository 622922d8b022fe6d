//! How much of the GPU memory a snapshot is about to save is an empty reservation.
//!
//! The driver checkpoint copies every byte a CUDA process allocated into that process's host
//! memory, used or not, and CRIU then saves all of it. A framework that reserves most of the GPU
//! up front (JAX preallocates 75% unless `XLA_PYTHON_CLIENT_PREALLOCATE=false`; a serving engine
//! sized by `gpu_memory_utilization`) turns into a snapshot of tens of GB of zeros. NVML cannot
//! tell used from reserved, but the copy can: the memory the checkpoint added is compared
//! mapping by mapping before and after it (`/proc/PID/smaps`), and pages sampled evenly from it
//! are read through `/proc/PID/mem`. If most are zero, the snapshot warns before the dump.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Added memory below this is not worth a warning.
pub const WARN_MIN_BYTES: u64 = 1 << 30;
/// A warning when at least this share of the sampled pages is zero.
pub const WARN_ZERO_SHARE: f64 = 0.75;
/// Pages sampled per process.
pub const SAMPLES: u64 = 2048;

const PAGE: u64 = 4096;

/// Each mapping's start, end and resident bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resident(pub Vec<(u64, u64, u64)>);

impl Resident {
    /// Reads `/proc/PID/smaps`.
    pub fn of(pid: i32) -> io::Result<Resident> {
        Ok(parse_smaps(&std::fs::read_to_string(format!(
            "/proc/{pid}/smaps"
        ))?))
    }
}

fn parse_smaps(text: &str) -> Resident {
    let mut out = Vec::new();
    let mut current: Option<(u64, u64)> = None;
    for line in text.lines() {
        if let Some(kb) = line.strip_prefix("Rss:") {
            if let Some((start, end)) = current.take() {
                let kb: u64 = kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                out.push((start, end, kb * 1024));
            }
            continue;
        }
        let Some(span) = line.split_whitespace().next() else {
            continue;
        };
        if let Some((s, e)) = span.split_once('-') {
            if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                current = Some((s, e));
            }
        }
    }
    Resident(out)
}

/// What the checkpoint added to one process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Added {
    /// Resident bytes added.
    pub bytes: u64,
    /// Share of the sampled added pages that are all zero (0 when nothing was sampled).
    pub zero_share: f64,
}

/// Compares `before` and `after` of `pid` and samples the memory that grew.
pub fn added(pid: i32, before: &Resident, after: &Resident, samples: u64) -> io::Result<Added> {
    // Ranges that are new, or grew (weighted by how much they grew).
    let mut grown: Vec<(u64, u64, u64)> = Vec::new();
    for &(start, end, rss) in &after.0 {
        let old = before
            .0
            .iter()
            .find(|&&(s, e, _)| s == start && e == end)
            .map_or(0, |&(_, _, r)| r);
        if rss > old {
            grown.push((start, end, rss - old));
        }
    }
    let bytes: u64 = grown.iter().map(|g| g.2).sum();
    if bytes == 0 || samples == 0 {
        return Ok(Added {
            bytes,
            zero_share: 0.0,
        });
    }
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut page = vec![0u8; PAGE as usize];
    let (mut read, mut zero) = (0u64, 0u64);
    // Sample k sits at the middle of the k-th of `samples` equal slices of the added bytes, so
    // each range gets samples in proportion to how much it grew (a small one often none).
    let mut slices = (0..samples)
        .map(|k| (2 * k + 1) * bytes / (2 * samples))
        .peekable();
    let mut covered = 0u64;
    for (start, end, weight) in grown {
        let pages = ((end - start) / PAGE).max(1);
        while let Some(&t) = slices.peek() {
            if t >= covered + weight {
                break;
            }
            slices.next();
            let index = ((t - covered) as u128 * pages as u128 / weight as u128) as u64;
            if mem.read_exact_at(&mut page, start + index * PAGE).is_ok() {
                read += 1;
                if page.iter().all(|&b| b == 0) {
                    zero += 1;
                }
            }
        }
        covered += weight;
    }
    Ok(Added {
        bytes,
        zero_share: if read == 0 {
            0.0
        } else {
            zero as f64 / read as f64
        },
    })
}

/// Whether comparing the processes' memory around the driver's checkpoint can end in a warning:
/// the checkpoint adds at most what they hold on the GPU (`moved`, NVML's figure less what a
/// release moved already), so below [`WARN_MIN_BYTES`] it cannot, and the comparison (two walks
/// of each process's page tables: 36-52 ms of a GPT-2-Large hibernation's stop on the H200) is
/// left out. Without NVML's figure for a GPU it runs.
pub fn worth_checking(gpus: &[torpor_image::GpuEntry], moved: u64) -> bool {
    moved >= WARN_MIN_BYTES || gpus.iter().any(|g| g.used_by_snapshot.is_none())
}

/// The warning for what the checkpoint added to `pid`, if it is mostly an empty reservation.
pub fn warning(pid: i32, added: &Added) -> Option<String> {
    (added.bytes >= WARN_MIN_BYTES && added.zero_share >= WARN_ZERO_SHARE).then(|| {
        format!(
            "the GPU memory of CUDA process {pid} being saved is {:.1} GB, and {:.0}% of it is \
             zeros: mostly a reservation the program never used, which the snapshot stores and \
             every restore copies back. Reserve less before snapshotting (JAX: \
             XLA_PYTHON_CLIENT_PREALLOCATE=false or XLA_PYTHON_CLIENT_MEM_FRACTION; vLLM: a \
             lower gpu_memory_utilization; PyTorch: torch.cuda.empty_cache())",
            added.bytes as f64 / 1e9,
            added.zero_share * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    #[test]
    fn only_a_checkpoint_that_may_add_enough_is_worth_checking() {
        let gpu = |used: Option<u64>| torpor_image::GpuEntry {
            ordinal: 0,
            name: "GPU".into(),
            uuid: "GPU-0".into(),
            total_memory: 80 << 30,
            used_by_snapshot: used,
        };
        assert!(!worth_checking(&[gpu(Some(600 << 20))], 600 << 20));
        assert!(worth_checking(&[gpu(Some(60 << 30))], 60 << 30));
        assert!(worth_checking(&[gpu(Some(WARN_MIN_BYTES))], WARN_MIN_BYTES));
        // A released process moved its memory already: what is left to move counts.
        assert!(!worth_checking(&[gpu(Some(4 << 30))], 0));
        // NVML could not say: check.
        assert!(worth_checking(&[gpu(None)], 0));
    }

    #[test]
    fn parses_smaps_rss() {
        let text = "\
7f0000000000-7f0000100000 rw-p 00000000 00:00 0 
Size:               1024 kB
Rss:                 512 kB
7f0000200000-7f0000201000 r--p 00000000 08:01 42 /usr/lib/x.so
Size:                  4 kB
Rss:                   4 kB
";
        assert_eq!(
            parse_smaps(text).0,
            vec![
                (0x7f00_0000_0000, 0x7f00_0010_0000, 512 * 1024),
                (0x7f00_0020_0000, 0x7f00_0020_1000, 4096)
            ]
        );
    }

    /// A real process touches 256 MiB of zeros, then 256 MiB of data: the first is measured as
    /// (nearly) all zero, the second as (nearly) none. "Nearly": a new mapping may merge with a
    /// neighbour the process had, whose pages are sampled too.
    #[test]
    fn measures_the_zero_share_of_memory_a_process_added() {
        let script = "\
import mmap, sys
held = []
for line in sys.stdin:
    m = mmap.mmap(-1, 256 << 20)
    fill = b'\\0' if line.strip() == 'zeros' else b'\\x5a'
    for off in range(0, len(m), 4096):
        m[off:off + 1] = fill
    held.append(m)
    print('done', flush=True)
";
        let mut child = Command::new("python3")
            .args(["-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let pid = child.id() as i32;
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut ask = |what: &str| {
            child
                .stdin
                .as_mut()
                .unwrap()
                .write_all(format!("{what}\n").as_bytes())
                .unwrap();
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "done");
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        let before = Resident::of(pid).unwrap();
        ask("zeros");
        let after = Resident::of(pid).unwrap();
        let zeros = added(pid, &before, &after, 256).unwrap();
        assert!(zeros.bytes >= 250 << 20, "{zeros:?}");
        assert!(zeros.zero_share > 0.8, "{zeros:?}");
        ask("data");
        let data = added(pid, &after, &Resident::of(pid).unwrap(), 256).unwrap();
        assert!(data.zero_share < 0.2, "{data:?}");

        assert!(
            warning(pid, &zeros).is_none(),
            "256 MiB is below the threshold"
        );
        let big = Added {
            bytes: 40 << 30,
            zero_share: 0.9,
        };
        assert!(warning(pid, &big)
            .unwrap()
            .contains("XLA_PYTHON_CLIENT_PREALLOCATE=false"));
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}
