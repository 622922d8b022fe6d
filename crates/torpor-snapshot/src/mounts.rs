//! The mount namespace of a launched process, and what CRIU does with each of its mounts.
//!
//! A snapshot holds the process and nothing of the node. CRIU archives the files of every tmpfs
//! it finds in the tree's mount namespace and unpacks them into every restored copy, so the
//! namespace is built on purpose ([`MountPolicy`], applied by [`crate::launch`]), and at snapshot
//! time every mount gets one [`Role`]:
//!
//! - [`Role::Root`]: `/`, CRIU's `--root`; nothing is archived.
//! - [`Role::Own`]: a tmpfs Torpor mounted fresh for the process (`/dev/shm`, a worker's `/tmp`),
//!   recognised by its source name [`OWN_TMPFS_SOURCE`]. Its files are the process's own state:
//!   archived and restored with it.
//! - [`Role::Kernel`]: kernel interfaces without files of their own (proc, sysfs, devpts,
//!   cgroup…; devtmpfs is one instance per kernel); CRIU mounts them anew.
//! - [`Role::External`]: everything else — disks, network and FUSE filesystems, bind mounts, and
//!   the host's tmpfs mounts the policy left visible. Dumped as `--external mnt[PATH]:KEY` and
//!   bound from the same host path at restore: the process sees the host's live files there,
//!   and no snapshot ever carries them (the GPU machine's driver libraries on a squashfs at
//!   /usr/local/nvidia are one such mount).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

pub use torpor_image::{ArchivedMount, ExternalMount};

/// The source name of the tmpfs mounts Torpor creates for a process (`/dev/shm`, `/tmp`): the
/// mark by which a snapshot tells the process's own tmpfs from the host's.
pub const OWN_TMPFS_SOURCE: &str = "torpor-own";

/// The source name of torpord's staging tmpfs (`crate::stage`): taken out of every mount
/// namespace [`crate::launch`] creates (it holds every staged snapshot).
pub const STAGE_MOUNT_SOURCE: &str = "torpor-stage";

/// Kernel filesystems without files of their own: CRIU mounts them anew at restore.
const KERNEL_FS: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
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
    "selinuxfs",
    "nsfs",
];

/// Filesystems whose files live in memory: the host's are never archived into a snapshot.
const MEMORY_FS: &[&str] = &["tmpfs", "ramfs"];

/// One line of `/proc/PID/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// Where it is mounted (unescaped).
    pub point: String,
    pub fstype: String,
    pub source: String,
}

/// What CRIU does with a mount; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Root,
    Own,
    Kernel,
    External,
}

impl MountInfo {
    pub fn role(&self) -> Role {
        if self.point == "/" {
            Role::Root
        } else if self.fstype == "tmpfs" && self.source == OWN_TMPFS_SOURCE {
            Role::Own
        } else if KERNEL_FS.contains(&self.fstype.as_str()) {
            Role::Kernel
        } else {
            Role::External
        }
    }
}

/// Parses a mount table in `/proc/PID/mountinfo` format; malformed lines are skipped.
pub fn parse(mountinfo: &str) -> Vec<MountInfo> {
    mountinfo
        .lines()
        .filter_map(|line| {
            // Fields: id parent major:minor root mountpoint options [optional...] - fstype source opts
            let fields: Vec<&str> = line.split_whitespace().collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            Some(MountInfo {
                point: unescape(fields.get(4)?),
                fstype: fields.get(sep + 1)?.to_string(),
                source: unescape(fields.get(sep + 2)?),
            })
        })
        .collect()
}

/// The mount holding `path` (absolute, symlinks resolved): the deepest mount point above it.
pub fn containing<'t>(path: &Path, table: &'t [MountInfo]) -> Option<&'t MountInfo> {
    table
        .iter()
        .filter(|m| path.starts_with(&m.point))
        .max_by_key(|m| m.point.len())
}

/// How [`crate::launch`] builds the mount namespace of what it starts. It starts as a private
/// copy of the caller's; then
/// 1. the mounts [`MountPolicy::to_detach`] names are detached (with everything below them);
/// 2. each of [`MountPolicy::private_tmpfs`] gets a fresh tmpfs of the process's own;
/// 3. each of [`MountPolicy::binds`] is bound back from the host at the same path (taken before
///    step 1, so a bind may come from a detached mount or land in a fresh tmpfs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountPolicy {
    /// Directories that get a fresh, empty tmpfs (mode 1777): the process's own, archived.
    pub private_tmpfs: Vec<PathBuf>,
    /// Host directories the process reaches at the same path, as external mounts.
    pub binds: Vec<PathBuf>,
    /// Take away the host's tmpfs and ramfs mounts instead of leaving them visible (live,
    /// external).
    pub hide_host_memory_fs: bool,
    /// Take away the host's cgroup file systems (`/sys/fs/cgroup`): a worker has no use for the
    /// node's cgroup tree (torpord sets and reports its limits), and CRIU mounts every cgroup
    /// file system anew at each restore, 40 ms of a 0.26 s lazy restore of a GPT-2-Large worker
    /// on the H100 (CRIU's log, docs/split.md).
    pub hide_cgroup_fs: bool,
    /// For a process that will drop root (torpord's unprivileged workers): every mount of the
    /// host's it keeps is made read-only (recursively, from `/`), and so is every bind but
    /// those in [`MountPolicy::writable`]; only its own tmpfs mounts stay writable.
    pub read_only: bool,
    /// Binds that stay writable with [`MountPolicy::read_only`] (the log directory the init
    /// opens its log in, as root, before it drops root).
    pub writable: Vec<PathBuf>,
    /// Make every bind reachable by an unprivileged user: the first directory on its path that
    /// others cannot traverse (`/root` 0700, a 0700 state directory) gets an empty tmpfs of the
    /// process's own (mode 0755, a *veil*: what the host keeps there is hidden), in which the
    /// rest of the path is made.
    pub veil: bool,
}

impl MountPolicy {
    /// `torpor run`: a command the user started, which may use any of the host's paths. Only
    /// `/dev/shm` (POSIX shared memory) is its own; every other mount stays visible.
    pub fn command() -> Self {
        Self {
            private_tmpfs: vec!["/dev/shm".into()],
            binds: Vec::new(),
            hide_host_memory_fs: false,
            hide_cgroup_fs: false,
            read_only: false,
            writable: Vec::new(),
            veil: false,
        }
    }

    /// torpord's workers: their own `/dev/shm` and `/tmp`, none of the host's memory
    /// filesystems, and `binds` (the state directory, the Python harness) reached only as
    /// the mounts the daemon chose.
    pub fn worker(binds: Vec<PathBuf>) -> Self {
        Self {
            private_tmpfs: vec!["/dev/shm".into(), "/tmp".into()],
            binds,
            hide_host_memory_fs: true,
            hide_cgroup_fs: true,
            read_only: false,
            writable: Vec::new(),
            veil: false,
        }
    }

    /// torpord's unprivileged workers: as [`MountPolicy::worker`], with the host read-only,
    /// `/var/tmp` a tmpfs of their own too (their scratch directory beside `/tmp`), `/run` one
    /// (the host's is a tmpfs, detached, on most nodes, but a directory of the root filesystem on
    /// some, whose files others may read), every bind reachable by their user
    /// ([`MountPolicy::veil`]) and read-only but `writable`.
    pub fn unprivileged_worker(binds: Vec<PathBuf>, writable: Vec<PathBuf>) -> Self {
        Self {
            private_tmpfs: vec![
                "/dev/shm".into(),
                "/tmp".into(),
                "/var/tmp".into(),
                "/run".into(),
            ],
            binds,
            hide_host_memory_fs: true,
            hide_cgroup_fs: true,
            read_only: true,
            writable,
            veil: true,
        }
    }

    /// The mount points to detach, deepest first: torpord's staging tmpfs, namespace files
    /// (nsfs: other processes' namespaces), whatever is mounted at or below a private tmpfs
    /// directory, with [`MountPolicy::hide_host_memory_fs`] the host's tmpfs and ramfs, and with
    /// [`MountPolicy::hide_cgroup_fs`] its cgroup file systems.
    pub fn to_detach(&self, table: &[MountInfo]) -> Vec<String> {
        let mut points: Vec<String> = Vec::new();
        for m in table {
            if m.point == "/" || points.contains(&m.point) {
                continue;
            }
            let stage = m.fstype == "tmpfs" && m.source == STAGE_MOUNT_SOURCE;
            let under_private = self
                .private_tmpfs
                .iter()
                .any(|p| Path::new(&m.point).starts_with(p));
            let host_memory = self.hide_host_memory_fs
                && MEMORY_FS.contains(&m.fstype.as_str())
                && m.source != OWN_TMPFS_SOURCE;
            let cgroup = self.hide_cgroup_fs && matches!(m.fstype.as_str(), "cgroup" | "cgroup2");
            if stage || m.fstype == "nsfs" || under_private || host_memory || cgroup {
                points.push(m.point.clone());
            }
        }
        // Deepest first, so that a parent's detach never hides a child still to be named.
        points.sort_by_key(|p| std::cmp::Reverse(Path::new(p).components().count()));
        points
    }
}

impl MountPolicy {
    /// Whether `path` of the host would be out of reach in a namespace built by this policy
    /// without a bind: it lies in a private tmpfs directory or in a mount to be detached.
    pub fn hides(&self, path: &Path, table: &[MountInfo]) -> bool {
        self.private_tmpfs.iter().any(|p| path.starts_with(p))
            || self
                .to_detach(table)
                .iter()
                .any(|p| path.starts_with(Path::new(p)))
    }

    /// Whether the launched process reaches the host's `path` at the same path: it is not
    /// hidden, or lies in one of the binds.
    pub fn reaches(&self, path: &Path, table: &[MountInfo]) -> bool {
        self.binds.iter().any(|b| path.starts_with(b)) || !self.hides(path, table)
    }
}

/// The key of the external mount of torpord's state directory in a worker's snapshot
/// ([`crate::snapshot::SnapshotOptions::state_dir`]): a restore binds the restoring daemon's own
/// state directory there ([`crate::restore::RestoreOptions::external_sources`]), so a worker
/// snapshotted on a node whose state_dir differs reaches this node's daemon by its old path.
pub const STATE_DIR_KEY: &str = "torpor-state-dir";

/// The key of the external mount of the state directory's directory `name` (`init`, `sock`…),
/// which an unprivileged worker gets bound in instead of the whole state directory: a restore
/// binds the restoring daemon's own `<state_dir>/name` there.
pub fn state_dir_piece_key(name: &str) -> String {
    format!("{STATE_DIR_KEY}-{name}")
}

/// The `external` entry for `criu dump`: the mount point and the key it is saved under.
pub fn dump_spec(m: &ExternalMount) -> String {
    format!("mnt[{}]:{}", m.path, m.key)
}

/// The `external` entry for `criu restore`: the key and the host path bound in its place.
pub fn restore_spec(m: &ExternalMount) -> String {
    format!("mnt[{}]:{}", m.key, m.path)
}

/// Whether a tree's `/run` is its own: a mount archived with it (a tmpfs, as a torpord
/// worker's), and no external mount lies under it. CRIU may then run with a `/run` of its own
/// holding its kernel-feature cache (`torpor_criu::{DumpRequest, RestoreRequest}::private_run`).
pub fn run_is_its_own(archived: &[ArchivedMount], external: &[ExternalMount]) -> bool {
    let run = Path::new("/run");
    archived.iter().any(|m| Path::new(&m.path) == run)
        && !external.iter().any(|m| Path::new(&m.path).starts_with(run))
}

/// What a snapshot of a tree does with its mounts: dumps these as external, archives those.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountPlan {
    pub external: Vec<ExternalMount>,
    pub archived: Vec<ArchivedMount>,
}

/// Reads the mount table of `pid` and sorts its mounts into external and archived ones.
pub fn plan(pid: i32) -> io::Result<MountPlan> {
    Ok(plan_of(&parse(&fs::read_to_string(format!(
        "/proc/{pid}/mountinfo"
    ))?)))
}

fn plan_of(table: &[MountInfo]) -> MountPlan {
    let mut plan = MountPlan::default();
    let mut external_paths: Vec<&str> = Vec::new();
    for m in table {
        match m.role() {
            Role::External if !external_paths.contains(&m.point.as_str()) => {
                external_paths.push(&m.point)
            }
            Role::Own => plan.archived.push(ArchivedMount {
                path: m.point.clone(),
                fstype: m.fstype.clone(),
            }),
            _ => {}
        }
    }
    plan.external = external_paths
        .into_iter()
        .enumerate()
        .map(|(i, path)| ExternalMount {
            key: format!("torpor-ext{i}"),
            path: path.to_string(),
        })
        .collect();
    plan
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

    // The mount table a worker saw on the GPU machine (H100, Ubuntu 24.04), trimmed, with a
    // systemd host's /run and a tmpfs of the user's added.
    const GPU_MACHINE: &str = "\
87 86 254:0 / / rw,relatime - ext4 /dev/vda rw
89 87 0:21 / /proc rw,relatime - proc proc rw
90 87 0:22 / /sys rw,relatime - sysfs sysfs rw
102 87 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
103 102 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw
105 102 0:24 / /dev/pts rw,relatime - devpts devpts rw
106 87 254:16 / /usr/local/nvidia ro,nosuid,nodev,relatime - squashfs /dev/vdb ro
108 87 0:50 / /data\\040dir rw shared:5 - virtiofs data rw
109 87 0:51 / /run rw,nosuid,nodev - tmpfs tmpfs rw,mode=755
110 109 0:4 net:[4026532] /run/netns/a rw - nsfs nsfs rw
111 87 0:52 / /tmp/tm rw - tmpfs tmpfs rw,size=40m
107 89 0:41 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
";

    fn points(v: &[ExternalMount]) -> Vec<&str> {
        v.iter().map(|e| e.path.as_str()).collect()
    }

    #[test]
    fn host_filesystems_are_external_and_only_own_tmpfs_is_archived() {
        let table = format!(
            "{GPU_MACHINE}\
130 102 0:70 / /dev/shm rw - tmpfs {OWN_TMPFS_SOURCE} rw,mode=1777
131 87 0:71 / /tmp rw - tmpfs {OWN_TMPFS_SOURCE} rw,mode=1777
"
        );
        let plan = plan_of(&parse(&table));
        assert_eq!(
            points(&plan.external),
            vec![
                "/dev/shm",
                "/usr/local/nvidia",
                "/data dir",
                "/run",
                "/tmp/tm"
            ]
        );
        assert_eq!(
            plan.archived,
            vec![
                ArchivedMount {
                    path: "/dev/shm".into(),
                    fstype: "tmpfs".into()
                },
                ArchivedMount {
                    path: "/tmp".into(),
                    fstype: "tmpfs".into()
                }
            ]
        );
        assert_eq!(
            dump_spec(&plan.external[1]),
            "mnt[/usr/local/nvidia]:torpor-ext1"
        );
        assert_eq!(
            restore_spec(&plan.external[1]),
            "mnt[torpor-ext1]:/usr/local/nvidia"
        );
    }

    #[test]
    fn a_worker_loses_the_hosts_memory_filesystems_and_what_lies_under_its_own() {
        let table = parse(GPU_MACHINE);
        let detach = MountPolicy::worker(vec!["/var/lib/torpor".into()]).to_detach(&table);
        assert_eq!(detach, vec!["/run/netns/a", "/dev/shm", "/tmp/tm", "/run"]);
        // A command keeps the host's tmpfs visible (external), all but /dev/shm.
        let detach = MountPolicy::command().to_detach(&table);
        assert_eq!(detach, vec!["/run/netns/a", "/dev/shm"]);
        let worker = MountPolicy::worker(Vec::new());
        for (path, hidden) in [
            ("/tmp/x/python", true),
            ("/run/user/0/py", true),
            ("/dev/shm/a", true),
            ("/home/u/torpor/python", false),
            ("/data dir/py", false),
        ] {
            assert_eq!(worker.hides(Path::new(path), &table), hidden, "{path}");
        }
        assert!(!MountPolicy::command().hides(Path::new("/tmp/x"), &table));
        let holder = |p: &str| containing(Path::new(p), &table).map(|m| m.point.as_str());
        assert_eq!(holder("/tmp/tm/a"), Some("/tmp/tm"));
        assert_eq!(holder("/tmp/tmx"), Some("/"));
        assert_eq!(holder("/run/netns/a"), Some("/run/netns/a"));
        let bound = MountPolicy::worker(vec!["/tmp/state".into()]);
        assert!(bound.reaches(Path::new("/tmp/state/logs/w.log"), &table));
        assert!(!bound.reaches(Path::new("/tmp/other.log"), &table));
        assert!(bound.reaches(Path::new("/home/u/w.log"), &table));
    }

    #[test]
    fn an_unprivileged_worker_has_its_own_run_and_var_tmp_and_a_read_only_host() {
        let table = parse(GPU_MACHINE);
        let p = MountPolicy::unprivileged_worker(
            vec!["/var/lib/torpor/sock".into()],
            vec!["/var/lib/torpor/logs".into()],
        );
        assert!(p.read_only && p.veil && p.hide_host_memory_fs);
        for (path, hidden) in [
            ("/run/nvidia-persistenced/socket", true),
            ("/var/tmp/x", true),
            ("/tmp/x", true),
            ("/usr/lib/python3", false),
        ] {
            assert_eq!(p.hides(Path::new(path), &table), hidden, "{path}");
        }
        // /run is detached as a host tmpfs, then gets one of the worker's own.
        assert!(p.to_detach(&table).contains(&"/run".to_string()));
    }

    #[test]
    fn workers_lose_the_hosts_cgroup_file_systems_and_commands_keep_them() {
        let table = parse(&format!(
            "{GPU_MACHINE}\
130 90 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
131 90 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
"
        ));
        for policy in [
            MountPolicy::worker(Vec::new()),
            MountPolicy::unprivileged_worker(Vec::new(), Vec::new()),
        ] {
            let detach = policy.to_detach(&table);
            // The v1 hierarchy below the v2 mount first (deepest first), then the v2 one.
            let at = |p: &str| detach.iter().position(|d| d == p).unwrap();
            assert!(
                at("/sys/fs/cgroup/cpu,cpuacct") < at("/sys/fs/cgroup"),
                "{detach:?}"
            );
            assert!(policy.hides(Path::new("/sys/fs/cgroup/memory.max"), &table));
            assert!(!policy.hides(Path::new("/sys/class/net"), &table));
        }
        let command = MountPolicy::command().to_detach(&table);
        assert!(
            !command.iter().any(|d| d.starts_with("/sys")),
            "{command:?}"
        );
    }

    #[test]
    fn stage_mounts_are_found_by_their_source_and_always_detached() {
        let table = format!(
            "{GPU_MACHINE}\
120 87 0:60 / /var/lib/torpor/stage rw - tmpfs {STAGE_MOUNT_SOURCE} rw,mode=700,huge=within_size
121 87 0:61 / /st\\040x rw - tmpfs {STAGE_MOUNT_SOURCE} rw
122 87 0:62 / /other rw - ext4 {STAGE_MOUNT_SOURCE} rw
"
        );
        let detach = MountPolicy::command().to_detach(&parse(&table));
        assert_eq!(
            detach,
            vec!["/var/lib/torpor/stage", "/run/netns/a", "/dev/shm", "/st x"]
        );
    }

    #[test]
    fn own_mount_table_parses() {
        // Whatever this machine has, parsing must not fail and keys must be unique.
        let plan = plan(std::process::id() as i32).unwrap();
        let mut keys: Vec<_> = plan.external.iter().map(|e| e.key.clone()).collect();
        keys.dedup();
        assert_eq!(keys.len(), plan.external.len());
    }
}
