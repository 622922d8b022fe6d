//! The human-readable summary shown by `torpor inspect`.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use crate::manifest::{Manifest, ProcessEntry};
use crate::store::Usage;

/// How many of the largest files the summary names.
const LARGEST_SHOWN: usize = 3;

/// A multi-line description of a snapshot: what, when, from which command and process tree, on
/// which GPUs, kernel and CRIU, its files and how long each phase of taking it took.
pub fn render_summary(manifest: &Manifest, dir: &Path) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail; `let _ =` keeps clippy quiet about the Result.
    let _ = write_summary(&mut out, manifest, dir);
    out
}

fn write_summary(out: &mut String, m: &Manifest, dir: &Path) -> std::fmt::Result {
    let kind = match m.kind {
        crate::SnapshotKind::Transparent => "transparent",
    };
    let what = if m.gpu.is_some() { "GPU" } else { "CPU-only" };
    writeln!(out, "snapshot  {}", dir.display())?;
    writeln!(
        out,
        "kind      {kind}, {what} (format {}, torpor {})",
        m.format_version, m.torpor_version
    )?;
    writeln!(out, "created   {}", m.created)?;

    let source = &m.source;
    let after = if source.leave_running {
        "left running"
    } else {
        "not left running"
    };
    writeln!(out, "command   {}", shell_words(&source.command))?;
    writeln!(
        out,
        "processes {} (root pid {}, {after})",
        source.tree.len(),
        source.root_pid
    )?;
    for (depth, process) in tree_order(&source.tree, source.root_pid) {
        let indent = "  ".repeat(depth + 1);
        let ns = match process.ns_pid.as_slice() {
            [_, .., inner] => format!(" (pid {inner} in its namespace)"),
            _ => String::new(),
        };
        let cuda = if process.cuda { " [CUDA]" } else { "" };
        let cmdline = if process.cmdline.is_empty() {
            process.comm.clone()
        } else {
            shell_words(&process.cmdline)
        };
        writeln!(out, "{indent}{}{ns}{cuda}  {cmdline}", process.pid)?;
    }

    match &m.gpu {
        None => writeln!(out, "gpu       none")?,
        Some(gpu) => {
            let cuda = gpu.cuda_driver_version;
            writeln!(
                out,
                "gpu       driver {}, CUDA {}.{}",
                gpu.driver_version,
                cuda / 1000,
                cuda % 1000 / 10
            )?;
            for g in &gpu.gpus {
                let used = match g.used_by_snapshot {
                    Some(bytes) => format!(", {} used by the snapshot", human_size(bytes)),
                    None => String::new(),
                };
                writeln!(
                    out,
                    "  [{}] {} {}, {}{used}",
                    g.ordinal,
                    g.name,
                    g.uuid,
                    human_size(g.total_memory)
                )?;
            }
        }
    }
    let host = &m.host;
    let criu = if host.criu_version.is_empty() {
        "unknown"
    } else {
        &host.criu_version
    };
    writeln!(
        out,
        "host      {}, kernel {}, CRIU {criu}",
        host.hostname, host.kernel
    )?;

    if !m.external_mounts.is_empty() {
        let mounts: Vec<String> = m
            .external_mounts
            .iter()
            .map(|e| format!("{} (key {})", e.path, e.key))
            .collect();
        writeln!(out, "external  {}", mounts.join(", "))?;
    }
    // What the image itself holds of the filesystems: the process's own tmpfs mounts only.
    let archived: Vec<String> = m
        .archived_mounts
        .iter()
        .map(|a| format!("{} ({})", a.path, a.fstype))
        .collect();
    writeln!(
        out,
        "archived  {}",
        if archived.is_empty() {
            "no filesystem".to_string()
        } else {
            archived.join(", ")
        }
    )?;

    writeln!(
        out,
        "files     {}, {}",
        m.files.len(),
        human_size(m.total_size())
    )?;
    let mut largest: Vec<_> = m.files.iter().collect();
    largest.sort_by(|a, b| b.size.cmp(&a.size).then_with(|| a.path.cmp(&b.path)));
    for f in largest.into_iter().take(LARGEST_SHOWN) {
        writeln!(out, "  {:>9}  {}", human_size(f.size), f.path)?;
    }

    if !m.timings.is_empty() {
        writeln!(out, "timings")?;
        let width = m.timings.keys().map(|k| k.len()).max().unwrap_or(0);
        for (phase, seconds) in &m.timings {
            writeln!(out, "  {phase:<width$}  {}", human_seconds(*seconds))?;
        }
    }
    writeln!(out, "stopped   {}", human_seconds(m.stop_time_s))?;
    Ok(())
}

/// The store section of `torpor inspect --store`: what the snapshot takes in the chunk store at
/// `root` and what it shares with which other snapshot.
pub fn render_store_usage(usage: &Usage, root: &Path) -> String {
    let mut out = String::new();
    let _ = write_store_usage(&mut out, usage, root);
    out
}

fn write_store_usage(out: &mut String, u: &Usage, root: &Path) -> std::fmt::Result {
    writeln!(out, "store     {} (as {})", root.display(), u.snapshot)?;
    writeln!(
        out,
        "  logical {} in {} files and segments, {} after dedup",
        human_size(u.logical),
        u.recipes,
        human_size(u.unique)
    )?;
    writeln!(
        out,
        "  stored  {}, of which {} held by no other snapshot",
        human_size(u.stored),
        human_size(u.exclusive)
    )?;
    if u.shared_with.is_empty() {
        writeln!(out, "  shared  with no other snapshot")?;
    }
    let mut shared: Vec<(&String, &u64)> = u.shared_with.iter().collect();
    shared.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    for (other, bytes) in shared {
        writeln!(out, "  shared  {} with {other}", human_size(*bytes))?;
    }
    if u.missing_chunks > 0 {
        writeln!(
            out,
            "  MISSING {} chunks: the store is damaged; re-take this snapshot",
            u.missing_chunks
        )?;
    }
    Ok(())
}

/// Processes depth-first from the root; processes whose parent is not in the tree start their own
/// subtree. Every process appears exactly once, even in a malformed tree with parent cycles.
fn tree_order(tree: &[ProcessEntry], root_pid: i32) -> Vec<(usize, &ProcessEntry)> {
    let pids: HashSet<i32> = tree.iter().map(|p| p.pid).collect();
    let mut children: BTreeMap<i32, Vec<&ProcessEntry>> = BTreeMap::new();
    let mut tops: Vec<&ProcessEntry> = Vec::new();
    for p in tree {
        if p.pid == root_pid || !pids.contains(&p.ppid) || p.ppid == p.pid {
            tops.push(p);
        } else {
            children.entry(p.ppid).or_default().push(p);
        }
    }
    tops.sort_by_key(|p| (p.pid != root_pid, p.pid));
    for list in children.values_mut() {
        list.sort_by_key(|p| p.pid);
    }

    let mut order = Vec::with_capacity(tree.len());
    let mut seen = HashSet::new();
    for &top in &tops {
        visit(top, &children, &mut seen, &mut order);
    }
    // Whatever a parent cycle kept unreachable.
    for p in tree {
        visit(p, &children, &mut seen, &mut order);
    }
    order
}

fn visit<'a>(
    start: &'a ProcessEntry,
    children: &BTreeMap<i32, Vec<&'a ProcessEntry>>,
    seen: &mut HashSet<i32>,
    order: &mut Vec<(usize, &'a ProcessEntry)>,
) {
    let mut stack = vec![(0, start)];
    while let Some((depth, p)) = stack.pop() {
        if !seen.insert(p.pid) {
            continue;
        }
        order.push((depth, p));
        if let Some(kids) = children.get(&p.pid) {
            stack.extend(kids.iter().rev().map(|&k| (depth + 1, k)));
        }
    }
}

/// Arguments joined by spaces, single-quoted where a shell would need it.
fn shell_words(args: &[String]) -> String {
    let quote = |arg: &String| {
        let plain = !arg.is_empty()
            && arg
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
        if plain {
            arg.clone()
        } else {
            format!("'{}'", arg.replace('\'', r"'\''"))
        }
    };
    args.iter().map(quote).collect::<Vec<_>>().join(" ")
}

/// A byte count in decimal units with three significant digits: `512 B`, `2.61 GB`, `80.0 GB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    // Rounding may carry into the next unit: 999.96 kB prints as 1.00 MB, not 1000 kB.
    let decimals = |v: f64| -> usize {
        match v {
            v if v < 10.0 => 2,
            v if v < 100.0 => 1,
            _ => 0,
        }
    };
    let rounded = |v: f64, d: usize| {
        let scale = 10_f64.powi(d as i32);
        (v * scale).round() / scale
    };
    let carried = rounded(value, decimals(value));
    if carried >= 1000.0 && unit + 1 < UNITS.len() {
        value = carried / 1000.0;
        unit += 1;
    }
    format!("{value:.prec$} {}", UNITS[unit], prec = decimals(value))
}

/// Seconds for people: `0.6 ms`, `930 ms`, `1.34 s`, `2 min 5.0 s`.
pub fn human_seconds(seconds: f64) -> String {
    if !seconds.is_finite() {
        return format!("{seconds} s");
    }
    let three_digits = |v: f64| match v.abs() {
        a if a < 10.0 => format!("{v:.2}"),
        a if a < 100.0 => format!("{v:.1}"),
        _ => format!("{v:.0}"),
    };
    let abs = seconds.abs();
    if abs == 0.0 {
        "0 s".to_owned()
    } else if abs < 1e-3 {
        format!("{} µs", three_digits(seconds * 1e6))
    } else if abs < 0.9995 {
        format!("{} ms", three_digits(seconds * 1e3))
    } else if abs < 120.0 {
        format!("{} s", three_digits(seconds))
    } else {
        let minutes = (seconds / 60.0).trunc();
        format!("{minutes:.0} min {:.1} s", seconds - minutes * 60.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{ExternalMount, FileEntry, GpuEntry, GpuSection, Host, Source};

    #[test]
    fn sizes() {
        let table = [
            (0, "0 B"),
            (999, "999 B"),
            (1000, "1.00 kB"),
            (1234, "1.23 kB"),
            (999_499, "999 kB"),
            (999_500, "1.00 MB"),
            (999_996, "1.00 MB"),
            (12_345_678, "12.3 MB"),
            (2_610_000_000, "2.61 GB"),
            (85_520_809_984, "85.5 GB"),
            (u64::MAX, "18.4 EB"),
        ];
        for (bytes, expected) in table {
            assert_eq!(human_size(bytes), expected, "{bytes}");
        }
    }

    #[test]
    fn durations() {
        let table = [
            (0.0, "0 s"),
            (0.000_2, "200 µs"),
            (0.000_6, "600 µs"),
            (0.0014, "1.40 ms"),
            (0.93, "930 ms"),
            (0.9999, "1.00 s"),
            (1.34, "1.34 s"),
            (12.26, "12.3 s"),
            (125.0, "2 min 5.0 s"),
        ];
        for (seconds, expected) in table {
            assert_eq!(human_seconds(seconds), expected, "{seconds}");
        }
    }

    #[test]
    fn store_usage_lists_the_largest_sharing_first() {
        let usage = Usage {
            snapshot: "fn-resnet".into(),
            recipes: 21,
            logical: 40_568_461,
            unique: 40_000_000,
            stored: 23_897_855,
            exclusive: 7_608_032,
            shared_with: [("base".to_owned(), 29_489_720), ("fn-b".to_owned(), 1_000)]
                .into_iter()
                .collect(),
            missing_chunks: 0,
        };
        let text = render_store_usage(&usage, Path::new("/var/lib/torpor/store"));
        let expected = "\
store     /var/lib/torpor/store (as fn-resnet)
  logical 40.6 MB in 21 files and segments, 40.0 MB after dedup
  stored  23.9 MB, of which 7.61 MB held by no other snapshot
  shared  29.5 MB with base
  shared  1.00 kB with fn-b
";
        assert_eq!(text, expected);
        let alone = Usage {
            shared_with: Default::default(),
            missing_chunks: 3,
            ..usage
        };
        let text = render_store_usage(&alone, Path::new("s"));
        assert!(text.contains("shared  with no other snapshot"), "{text}");
        assert!(text.contains("MISSING 3 chunks"), "{text}");
    }

    #[test]
    fn shell_quoting() {
        let args = ["python", "-c", "print('hi there')", ""].map(String::from);
        assert_eq!(
            shell_words(&args),
            r#"python -c 'print('\''hi there'\'')' ''"#
        );
    }

    fn process(pid: i32, ppid: i32) -> ProcessEntry {
        ProcessEntry {
            pid,
            ppid,
            ns_pid: vec![pid, pid - 99],
            comm: format!("p{pid}"),
            cmdline: vec![],
            cuda: pid == 100,
        }
    }

    #[test]
    fn tree_order_is_depth_first_and_survives_cycles() {
        let tree = [
            process(102, 101),
            process(101, 100),
            process(100, 1),
            process(103, 100),
            process(200, 201), // cycle not reachable from the root
            process(201, 200),
        ];
        let order: Vec<(usize, i32)> = tree_order(&tree, 100)
            .into_iter()
            .map(|(d, p)| (d, p.pid))
            .collect();
        assert_eq!(
            order,
            [(0, 100), (1, 101), (2, 102), (1, 103), (0, 200), (1, 201)]
        );
    }

    #[test]
    fn summary_mentions_everything() {
        let mut m = Manifest::new(
            "0.1.0",
            Source {
                command: vec!["python".into(), "serve.py".into()],
                root_pid: 100,
                tree: vec![process(100, 1), process(101, 100)],
                leave_running: true,
            },
            Host {
                kernel: "6.18.0".into(),
                hostname: "gpu-1".into(),
                criu_version: "4.1.1".into(),
            },
        );
        m.created = "2026-05-01T12:34:56Z".into();
        m.gpu = Some(GpuSection {
            driver_version: "580.159.04".into(),
            cuda_driver_version: 13000,
            gpus: vec![GpuEntry {
                ordinal: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                uuid: "GPU-abc".into(),
                total_memory: 85_520_809_984,
                used_by_snapshot: Some(1_900_000_000),
            }],
        });
        for (path, size) in [
            ("pages-1.img", 2_500_000_000),
            ("core-100.img", 4_000),
            ("mm-100.img", 9_000),
            ("inventory.img", 40),
        ] {
            m.files.push(FileEntry {
                path: path.into(),
                size,
                blake3: "00".repeat(32),
            });
        }
        m.timings.insert("criu_dump".into(), 1.34);
        m.timings.insert("cuda_lock".into(), 0.0006);
        m.stop_time_s = 2.3;
        m.external_mounts.push(ExternalMount {
            key: "nv".into(),
            path: "/usr/local/nvidia".into(),
        });
        m.archived_mounts.push(crate::manifest::ArchivedMount {
            path: "/dev/shm".into(),
            fstype: "tmpfs".into(),
        });
        let text = render_summary(&m, Path::new("/snaps/resnet"));
        for needle in [
            "snapshot  /snaps/resnet",
            "transparent, GPU (format 1.1, torpor 0.1.0)",
            "created   2026-05-01T12:34:56Z",
            "command   python serve.py",
            "processes 2 (root pid 100, left running)",
            "  100 (pid 1 in its namespace) [CUDA]  p100",
            "    101 (pid 2 in its namespace)  p101",
            "driver 580.159.04, CUDA 13.0",
            "[0] NVIDIA H100 80GB HBM3 GPU-abc, 85.5 GB, 1.90 GB used by the snapshot",
            "gpu-1, kernel 6.18.0, CRIU 4.1.1",
            "archived  /dev/shm (tmpfs)",
            "external  /usr/local/nvidia (key nv)",
            "files     4, 2.50 GB",
            "2.50 GB  pages-1.img",
            "9.00 kB  mm-100.img",
            "4.00 kB  core-100.img",
            "criu_dump  1.34 s",
            "cuda_lock  600 µs",
            "stopped   2.30 s",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        assert!(
            !text.contains("inventory.img"),
            "only the 3 largest:\n{text}"
        );

        m.gpu = None;
        let text = render_summary(&m, Path::new("s"));
        assert!(
            text.contains("CPU-only") && text.contains("gpu       none"),
            "{text}"
        );
    }
}
