//! Reading process trees from /proc: who is in the tree, how each pid looks from inside its
//! namespaces, and which processes have the CUDA driver mapped.

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use torpor_image::StdioFile;

/// The files the tree reopens by path at restore: each process's executable and the files it
/// maps privately (its libraries), as absolute paths in the processes' mount namespace, sorted,
/// without duplicates. Paths under `skip` (mounts whose files CRIU archives into the image),
/// deleted files and shared mappings (data, not code) are left out, unless a mount of `keep`
/// (a bind of the node's own files) lies deeper under the archived one and holds the path:
/// a worker's /root is an archived tmpfs, but a Python installed in /root/.pyenv is bound into
/// it from the node, and reopened from there at restore.
pub fn reopened_paths(pids: &[i32], skip: &[String], keep: &[String]) -> Vec<String> {
    let mut paths = std::collections::BTreeSet::new();
    for &pid in pids {
        let dir = Path::new("/proc").join(pid.to_string());
        if let Some(exe) = fs::read_link(dir.join("exe"))
            .ok()
            .and_then(|p| p.to_str().map(str::to_owned))
        {
            paths.insert(exe);
        }
        let Ok(maps) = fs::read_to_string(dir.join("maps")) else {
            continue;
        };
        for line in maps.lines() {
            // address perms offset dev inode path
            let mut fields = line.splitn(6, ' ');
            let perms = fields.nth(1).unwrap_or("");
            let path = fields.nth(3).unwrap_or("").trim_start();
            if path.starts_with('/') && !perms.contains('s') {
                paths.insert(path.to_owned());
            }
        }
    }
    paths
        .into_iter()
        .filter(|p| !p.ends_with(" (deleted)"))
        .filter(|p| {
            // The deepest mount of each list that holds `p`: the innermost one is what the
            // process sees there.
            let deepest = |mounts: &[String]| {
                mounts
                    .iter()
                    .map(|m| m.trim_end_matches('/'))
                    .filter(|m| p == m || p.starts_with(&format!("{m}/")))
                    .map(str::len)
                    .max()
            };
            match (deepest(skip), deepest(keep)) {
                (Some(archived), Some(bound)) => bound > archived,
                (Some(_), None) => false,
                (None, _) => true,
            }
        })
        .collect()
}

/// One process as /proc describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: i32,
    pub ppid: i32,
    /// The pid in each nested PID namespace, outermost first (the `NSpid:` line).
    pub ns_pid: Vec<i32>,
    pub comm: String,
    pub cmdline: Vec<String>,
}

impl ProcessInfo {
    /// Whether this process is PID 1 of a PID namespace below the caller's: the root that
    /// `torpor run` creates and that CRIU can restore many times side by side.
    pub fn is_pidns_init(&self) -> bool {
        self.ns_pid.len() >= 2 && self.ns_pid.last() == Some(&1)
    }

    /// The pid as seen inside the innermost namespace; stable across restores.
    pub fn inner_pid(&self) -> i32 {
        self.ns_pid.last().copied().unwrap_or(self.pid)
    }
}

/// The regular files descriptors 1 and 2 of `pid` are open on, with the key CRIU's image will
/// name each by (see [`StdioFile`]); a pipe, terminal, socket or deleted file is left out.
pub fn stdio_files(pid: i32) -> Vec<StdioFile> {
    let dir = Path::new("/proc").join(pid.to_string());
    let mounts = mount_ids(&dir.join("mountinfo")).unwrap_or_default();
    let mut files = Vec::new();
    for fd in [1, 2] {
        let link = dir.join("fd").join(fd.to_string());
        let Ok(target) = fs::read_link(&link) else {
            continue;
        };
        // Following the /proc link reaches the open file itself, even across namespaces.
        let Ok(meta) = fs::metadata(&link) else {
            continue;
        };
        let Some(path) = target.to_str() else {
            continue;
        };
        if !meta.is_file() || !path.starts_with('/') || path.ends_with(" (deleted)") {
            continue;
        }
        let Some(mnt_id) = fd_mount_id(&dir.join("fdinfo").join(fd.to_string())) else {
            continue;
        };
        let key = if mounts.contains(&mnt_id) {
            path.trim_start_matches('/').to_string()
        } else {
            format!("file[{mnt_id:x}:{:x}]", meta.ino())
        };
        files.push(StdioFile {
            path: path.to_string(),
            key,
        });
    }
    files
}

/// The mount ids of a `mountinfo` file (its first column).
fn mount_ids(mountinfo: &Path) -> io::Result<Vec<u64>> {
    Ok(fs::read_to_string(mountinfo)?
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect())
}

/// The `mnt_id:` of an fdinfo file.
fn fd_mount_id(fdinfo: &Path) -> Option<u64> {
    fs::read_to_string(fdinfo)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:")?.trim().parse().ok())
}

/// Reads one process; `NotFound` when it does not exist.
pub fn read_process(pid: i32) -> io::Result<ProcessInfo> {
    read_process_at(Path::new("/proc"), pid)
}

fn read_process_at(proc_root: &Path, pid: i32) -> io::Result<ProcessInfo> {
    let dir = proc_root.join(pid.to_string());
    let status = fs::read_to_string(dir.join("status"))?;
    let mut info = ProcessInfo {
        pid,
        ppid: 0,
        ns_pid: Vec::new(),
        comm: String::new(),
        cmdline: Vec::new(),
    };
    for line in status.lines() {
        if let Some(v) = line.strip_prefix("Name:") {
            info.comm = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("PPid:") {
            info.ppid = v.trim().parse().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("NSpid:") {
            info.ns_pid = v
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect();
        }
    }
    // A zombie or kernel thread has an empty cmdline; that is not an error.
    let raw = fs::read(dir.join("cmdline")).unwrap_or_default();
    info.cmdline = raw
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    Ok(info)
}

/// Direct children of `pid`, from every thread's `children` file.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(text) = fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// `root` and all its descendants, parents before children.
pub fn tree(root: i32) -> Vec<i32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let kids = children(out[i]);
        out.extend(kids);
        i += 1;
    }
    out
}

/// Whether the process has the CUDA driver library mapped. A process that has libcuda mapped may
/// hold GPU state; one that has not cannot, so CPU-only trees never touch the driver.
pub fn maps_libcuda(pid: i32) -> io::Result<bool> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps.lines().any(|l| {
        l.rsplit('/')
            .next()
            .is_some_and(|name| name.starts_with("libcuda.so"))
    }))
}

/// Whether a process exists (and is not a zombie).
pub fn is_alive(pid: i32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the last ')' of the comm field.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// What became of `pid`, for an error that must say why the driver could not act on it: the
/// state /proc gives (a process that is exiting, a zombie, gone), and an OOM kill the kernel's
/// log records for it.
pub fn fate(pid: i32) -> String {
    let state = fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
        });
    let oom = oom_kill_of(pid);
    let what = match state {
        None => format!("pid {pid} no longer exists"),
        Some('Z') | Some('X') => format!("pid {pid} has exited"),
        Some(c) => format!("pid {pid} is in state {c}"),
    };
    match oom {
        Some(line) => format!("{what}: the kernel's OOM killer killed it ({line})"),
        None => what,
    }
}

/// The kernel log's record of an OOM kill of `pid`, if it is still in the log buffer.
fn oom_kill_of(pid: i32) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut kmsg = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
        .ok()?;
    let needle = format!("Killed process {pid} ");
    let mut found = None;
    let mut buf = vec![0u8; 8192];
    // One record per read; EAGAIN at the end of the buffer, EPIPE when a record was overwritten
    // (reading goes on at the next one).
    for _ in 0..100_000 {
        match kmsg.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                if let Some((_, msg)) = rec.split_once(';') {
                    if msg.contains(&needle) {
                        found = Some(msg.trim().to_string());
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reopened_paths_are_the_executable_and_its_libraries() {
        let me = std::process::id() as i32;
        let exe = fs::read_link("/proc/self/exe").expect("exe");
        let exe = exe.to_str().expect("utf-8").to_owned();
        let paths = reopened_paths(&[me], &[], &[]);
        assert!(paths.contains(&exe), "{paths:?}");
        assert!(paths.iter().any(|p| p.contains("libc")), "{paths:?}");
        assert!(paths.windows(2).all(|w| w[0] < w[1]), "sorted, unique");
        // A mount CRIU archives hides what is under it.
        let parent = Path::new(&exe).parent().expect("dir");
        let skipped = reopened_paths(&[me], &[parent.to_string_lossy().into_owned()], &[]);
        assert!(!skipped.contains(&exe), "{skipped:?}");
        // ... unless a bind of the node's files lies under it and holds the path (a Python in
        // /root/.pyenv under an archived /root); a bind above the archived mount does not.
        let grand = parent.parent().expect("dir").to_string_lossy().into_owned();
        let parent = parent.to_string_lossy().into_owned();
        let kept = reopened_paths(
            &[me],
            std::slice::from_ref(&grand),
            std::slice::from_ref(&parent),
        );
        assert!(kept.contains(&exe), "{kept:?}");
        let hidden = reopened_paths(
            &[me],
            std::slice::from_ref(&parent),
            std::slice::from_ref(&grand),
        );
        assert!(!hidden.contains(&exe), "{hidden:?}");
    }

    #[test]
    fn fate_tells_a_live_process_from_a_gone_one() {
        let me = std::process::id() as i32;
        assert!(
            fate(me).starts_with(&format!("pid {me} is in state")),
            "{}",
            fate(me)
        );
        let gone = i32::MAX - 9;
        assert_eq!(fate(gone), format!("pid {gone} no longer exists"));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        // Not reaped yet: a zombie once it has exited.
        while is_alive(pid) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(fate(pid), format!("pid {pid} has exited"));
        child.wait().unwrap();
    }

    #[test]
    fn reads_self() {
        let me = read_process(std::process::id() as i32).unwrap();
        assert_eq!(me.pid, std::process::id() as i32);
        assert!(!me.ns_pid.is_empty());
        assert!(!me.cmdline.is_empty());
        assert!(is_alive(me.pid));
    }

    #[test]
    fn parses_nested_nspid() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("42");
        fs::create_dir(&p).unwrap();
        fs::write(
            p.join("status"),
            "Name:\tpython3\nPPid:\t7\nNSpid:\t42\t1\n",
        )
        .unwrap();
        fs::write(p.join("cmdline"), b"python3\0-c\0pass\0").unwrap();
        let info = read_process_at(dir.path(), 42).unwrap();
        assert_eq!(info.ppid, 7);
        assert_eq!(info.ns_pid, vec![42, 1]);
        assert!(info.is_pidns_init());
        assert_eq!(info.inner_pid(), 1);
        assert_eq!(info.cmdline, vec!["python3", "-c", "pass"]);
    }

    #[test]
    fn host_process_is_not_a_pidns_init() {
        let me = read_process(std::process::id() as i32).unwrap();
        // The test runner lives in the host PID namespace (or at least is not its init).
        assert!(!me.is_pidns_init() || me.ns_pid.len() < 2);
    }

    #[test]
    fn tree_contains_a_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let t = tree(me);
        let found = t.contains(&(child.id() as i32));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(found, "child not in tree {t:?}");
        assert!(!maps_libcuda(me).unwrap());
    }
}
