//! Which mounts of a worker's mount namespace CRIU must treat as external.
//!
//! `torpor run` gives the worker a private copy of the host's mount table. CRIU can re-create
//! virtual filesystems (proc, sysfs, tmpfs, devpts, cgroup…) by itself, but not a mount of a block
//! device or a network or FUSE filesystem other than the root (the GPU machine has the driver's
//! libraries on a read-only squashfs at /usr/local/nvidia). Those are dumped as external and
//! bind-mounted from the same host path at restore, which is what the worker saw anyway.

use std::fs;
use std::io;

/// Filesystems CRIU re-creates itself.
const VIRTUAL_FS: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
    "tmpfs",
    "devpts",
    "cgroup",
    "cgroup2",
    "mqueue",
    "securityfs",
    "debugfs",
    "tracefs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
    "autofs",
    "efivarfs",
    "nsfs",
    "ramfs",
];

pub use torpor_image::ExternalMount;

/// The `external` entry for `criu dump`: the mount point and the key it is saved under.
pub fn dump_spec(m: &ExternalMount) -> String {
    format!("mnt[{}]:{}", m.path, m.key)
}

/// The `external` entry for `criu restore`: the key and the host path bound in its place.
pub fn restore_spec(m: &ExternalMount) -> String {
    format!("mnt[{}]:{}", m.key, m.path)
}

/// Reads the mount table of `pid` and picks the external mounts.
pub fn external_mounts(pid: i32) -> io::Result<Vec<ExternalMount>> {
    Ok(pick_external(&fs::read_to_string(format!(
        "/proc/{pid}/mountinfo"
    ))?))
}

fn pick_external(mountinfo: &str) -> Vec<ExternalMount> {
    let mut paths: Vec<String> = Vec::new();
    for line in mountinfo.lines() {
        // Fields: id parent major:minor root mountpoint options [optional...] - fstype source opts
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(mountpoint), Some(fstype)) = (fields.get(4), fields.get(sep + 1)) else {
            continue;
        };
        let mountpoint = unescape(mountpoint);
        if mountpoint == "/" || VIRTUAL_FS.contains(fstype) || paths.contains(&mountpoint) {
            continue;
        }
        paths.push(mountpoint);
    }
    paths
        .into_iter()
        .enumerate()
        .map(|(i, path)| ExternalMount {
            key: format!("torpor-ext{i}"),
            path,
        })
        .collect()
}

/// The source name of torpord's staging tmpfs (`crate::stage`): mounts with it are taken out of
/// every mount namespace [`crate::launch`] creates, since CRIU would dump a tmpfs it finds there
/// (contents included) into the worker's snapshot.
pub const STAGE_MOUNT_SOURCE: &str = "torpor-stage";

/// The mount points of staging tmpfs mounts in a mount table, deepest (latest) first.
pub fn stage_mount_points(mountinfo: &str) -> Vec<String> {
    let mut points: Vec<String> = mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            let (mountpoint, fstype, source) =
                (fields.get(4)?, fields.get(sep + 1)?, fields.get(sep + 2)?);
            (*fstype == "tmpfs" && *source == STAGE_MOUNT_SOURCE).then(|| unescape(mountpoint))
        })
        .collect();
    points.reverse();
    points
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    // The mount table a worker saw on the GPU machine (H100, Ubuntu 24.04), trimmed.
    const GPU_MACHINE: &str = "\
87 86 254:0 / / rw,relatime - ext4 /dev/vda rw
89 87 0:21 / /proc rw,relatime - proc proc rw
90 87 0:22 / /sys rw,relatime - sysfs sysfs rw
102 87 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
103 102 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
105 102 0:24 / /dev/pts rw,relatime - devpts devpts rw
106 87 254:16 / /usr/local/nvidia ro,nosuid,nodev,relatime - squashfs /dev/vdb ro
108 87 0:50 / /data\\040dir rw shared:5 - virtiofs data rw
107 89 0:41 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
";

    #[test]
    fn picks_block_and_network_mounts_but_not_root_or_virtual() {
        let ext = pick_external(GPU_MACHINE);
        let paths: Vec<&str> = ext.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, vec!["/usr/local/nvidia", "/data dir"]);
        assert_eq!(dump_spec(&ext[0]), "mnt[/usr/local/nvidia]:torpor-ext0");
        assert_eq!(restore_spec(&ext[0]), "mnt[torpor-ext0]:/usr/local/nvidia");
    }

    #[test]
    fn stage_mounts_are_found_by_their_source() {
        let table = format!(
            "{GPU_MACHINE}\
120 87 0:60 / /var/lib/torpor/stage rw - tmpfs {STAGE_MOUNT_SOURCE} rw,mode=700,huge=within_size
121 87 0:61 / /st\\040x rw - tmpfs {STAGE_MOUNT_SOURCE} rw
122 87 0:62 / /other rw - ext4 {STAGE_MOUNT_SOURCE} rw
"
        );
        assert_eq!(
            stage_mount_points(&table),
            vec!["/st x", "/var/lib/torpor/stage"]
        );
        assert!(stage_mount_points(GPU_MACHINE).is_empty());
    }

    #[test]
    fn own_mount_table_parses() {
        // Whatever this machine has, parsing must not fail and keys must be unique.
        let ext = external_mounts(std::process::id() as i32).unwrap();
        let mut keys: Vec<_> = ext.iter().map(|e| e.key.clone()).collect();
        keys.dedup();
        assert_eq!(keys.len(), ext.len());
    }
}
