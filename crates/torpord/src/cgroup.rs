//! One cgroup per worker tree, with the instance's memory, CPU and process limits
//! (docs/security.md).
//!
//! Every worker tree the daemon starts (a booted worker, a restored one, a woken hibernation,
//! a standby, a deploy's base and function workers) runs in a cgroup of its own, created before
//! the tree's first process and removed once the tree is gone. The daemon's cgroups live under
//! one directory of its own, `torpor-<hash of the state directory>`, below the cgroup the daemon
//! itself runs in (so a node's or a container's own limits still hold over them).
//!
//! Two kinds of cgroup file system, one interface ([`Cgroups`], [`Cgroup`]):
//!
//! - **cgroup v2** (the unified hierarchy: Ubuntu 22.04+, Debian 11+, RHEL 9): the primary path.
//!   `memory.max` (with `memory.swap.max = 0` and `memory.oom.group = 1`), `cpu.max`, `pids.max`;
//!   an OOM kill shows in `memory.events` (`oom_kill`). The daemon's cgroup must delegate the
//!   `memory`, `cpu` and `pids` controllers to its children; if it holds other processes (v2's
//!   "no internal processes" rule), the daemon first moves itself into a leaf `torpord` beside
//!   its workers' directory, as systemd's `Delegate=yes` expects.
//! - **cgroup v1** (and the v1/v2 hybrid layout of older distributions and of Torpor's CI,
//!   where `memory`, `cpu` and `pids` are v1 hierarchies and the unified one has none of them):
//!   the fallback, chosen at start-up when v2 lacks those controllers. `memory.limit_in_bytes`
//!   (and `memory.memsw.limit_in_bytes`, so that swap does not stretch it),
//!   `cpu.cfs_quota_us`/`cpu.cfs_period_us`, `pids.max`; an OOM kill shows in
//!   `memory.oom_control` (`oom_kill`).
//!
//! If neither is usable, [`Cgroups::detect`] says why in one line; the daemon then logs it as a
//! warning and runs workers without limits, or, with `workers.allow_unconfined = false` (the
//! packaged config), refuses to start.
//!
//! CRIU and cgroups: a tree joins its cgroup by its first process (the launcher writes itself
//! into `cgroup.procs` before it forks the worker's init; CRIU's `swrk` for a restore joins the
//! new instance's cgroup before it runs, and is told to leave cgroups alone, so the restored
//! processes, CRIU's children, are born in it). So a restored instance lands in its own new
//! cgroup, never its source's, and its restored memory is charged there.

use std::collections::HashSet;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where cgroup file systems are mounted; `TORPORD_CGROUP_FS` names another directory (tests
/// use it to make the cgroup file system unavailable).
pub const DEFAULT_FS: &str = "/sys/fs/cgroup";
/// Overrides [`DEFAULT_FS`].
pub const FS_ENV: &str = "TORPORD_CGROUP_FS";
/// `cpu.max`'s and `cpu.cfs_period_us`'s period, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;
/// The v1 controllers Torpor uses, each a hierarchy of its own.
const V1_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// The limits of one instance's cgroup; `None`: no limit.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Limits {
    /// Bytes of memory (anonymous, page cache, kernel), its tmpfs files included.
    pub memory: Option<u64>,
    /// CPU cores (bandwidth: quota per period).
    pub cpu: Option<f64>,
    /// Processes and threads.
    pub pids: Option<u64>,
}

/// Which cgroup file system the daemon uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    V1,
    V2,
}

/// Why the cgroup file system cannot confine workers: one line, with the fix.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "cannot confine workers in cgroups: {0}; mount cgroup v2 with the memory, cpu and pids \
     controllers (or v1 hierarchies of them) and run torpord as root, or set \
     workers.allow_unconfined = true in torpord's config to run workers without limits"
)]
pub struct Unavailable(pub String);

/// Why an instance's cgroup could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A directory or a control file could not be written.
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io<'p>(what: &'static str, path: &'p Path) -> impl FnOnce(std::io::Error) -> CgroupError + 'p {
    move |source| CgroupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The daemon's cgroups: where they are, and the ones made but not yet given their tree
/// (which [`Cgroups::sweep`] leaves alone).
#[derive(Debug)]
pub struct Cgroups {
    version: Version,
    /// The daemon's own directory in each hierarchy (one for v2; memory's first for v1).
    bases: Vec<PathBuf>,
    reserved: Mutex<HashSet<String>>,
}

/// The cgroup of one worker tree. Dropped, it is removed once its tree is gone (its last
/// process exited); until then [`Cgroups::sweep`] does it.
#[derive(Debug)]
pub struct Cgroup {
    owner: Arc<Cgroups>,
    name: String,
    dirs: Vec<PathBuf>,
    limits: Limits,
}

/// `id:controllers:path` lines of `/proc/self/cgroup`: (controllers, path).
fn own_cgroups(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

/// A short name for the daemon of `state_dir` (FNV-1a of its path): daemons of other state
/// directories on the node keep their cgroups apart.
fn tag(state_dir: &Path) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}", h >> 32)
}

fn join(root: &Path, cgroup_path: &str) -> PathBuf {
    root.join(cgroup_path.trim_start_matches('/'))
}

impl Cgroups {
    /// Finds the cgroup file system (v2 first, then v1) under `$TORPORD_CGROUP_FS` or
    /// [`DEFAULT_FS`] and makes the daemon's directory in it, named after `state_dir`.
    pub fn detect(state_dir: &Path) -> Result<Arc<Cgroups>, Unavailable> {
        let tag = &tag(state_dir);
        let fs = std::env::var_os(FS_ENV).map_or_else(|| PathBuf::from(DEFAULT_FS), PathBuf::from);
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| Unavailable(format!("cannot read /proc/self/cgroup: {e}")))?;
        let own = own_cgroups(&own);
        let v2 = Self::detect_v2(&fs, &own, tag);
        let found = match v2 {
            Ok(c) => Ok(c),
            Err(v2_why) => Self::detect_v1(&fs, &own, tag)
                .map_err(|v1_why| Unavailable(format!("v2: {v2_why}; v1: {v1_why}"))),
        }?;
        Ok(Arc::new(found))
    }

    fn detect_v2(fs: &Path, own: &[(String, String)], tag: &str) -> Result<Cgroups, String> {
        if !fs.join("cgroup.controllers").is_file() {
            return Err(format!("{} is not a cgroup2 mount", fs.display()));
        }
        let path = own
            .iter()
            .find(|(c, _)| c.is_empty())
            .map(|(_, p)| p.as_str())
            .ok_or("this process is in no cgroup2 group")?;
        let dir = join(fs, path);
        let available = std::fs::read_to_string(dir.join("cgroup.controllers"))
            .map_err(|e| format!("cannot read {}/cgroup.controllers: {e}", dir.display()))?;
        let missing: Vec<&str> = V1_CONTROLLERS
            .into_iter()
            .filter(|c| !available.split_whitespace().any(|a| a == *c))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "{} lacks the {} controller(s)",
                dir.display(),
                missing.join(", ")
            ));
        }
        let enable = |d: &Path| {
            std::fs::write(d.join("cgroup.subtree_control"), "+memory +cpu +pids").map_err(|e| {
                (
                    e.raw_os_error(),
                    format!(
                        "cannot enable memory, cpu and pids in {}/cgroup.subtree_control: {e}",
                        d.display()
                    ),
                )
            })
        };
        if let Err((errno, why)) = enable(&dir) {
            // v2 lets no cgroup but the root both hold processes and give controllers to its
            // children: the daemon moves into a leaf of its own (systemd's Delegate=yes way).
            if errno != Some(libc::EBUSY) {
                return Err(why);
            }
            let leaf = dir.join("torpord");
            mkdir(&leaf).map_err(|e| format!("cannot make {}: {e}", leaf.display()))?;
            std::fs::write(leaf.join("cgroup.procs"), "0")
                .map_err(|e| format!("cannot move torpord into {}: {e}", leaf.display()))?;
            enable(&dir).map_err(|(_, why)| {
                format!("{why} (it holds processes other than torpord's: give torpord a cgroup of its own, e.g. systemd's Delegate=yes)")
            })?;
        }
        let base = dir.join(format!("torpor-{tag}"));
        mkdir(&base).map_err(|e| format!("cannot make {}: {e}", base.display()))?;
        enable(&base).map_err(|(_, why)| why)?;
        Ok(Cgroups {
            version: Version::V2,
            bases: vec![base],
            reserved: Mutex::default(),
        })
    }

    fn detect_v1(fs: &Path, own: &[(String, String)], tag: &str) -> Result<Cgroups, String> {
        let mut bases = Vec::new();
        for controller in V1_CONTROLLERS {
            let (controllers, path) = own
                .iter()
                .find(|(c, _)| c.split(',').any(|c| c == controller))
                .ok_or_else(|| format!("no {controller} hierarchy in /proc/self/cgroup"))?;
            // Mounted as `cpu`, or `cpu,cpuacct` with a `cpu` link beside it.
            let mount = [fs.join(controller), fs.join(controllers)]
                .into_iter()
                .find(|m| m.join("cgroup.procs").is_file())
                .ok_or_else(|| format!("{controller} is not mounted under {}", fs.display()))?;
            let base = join(&mount, path).join(format!("torpor-{tag}"));
            mkdir(&base).map_err(|e| format!("cannot make {}: {e}", base.display()))?;
            bases.push(base);
        }
        Ok(Cgroups {
            version: Version::V1,
            bases,
            reserved: Mutex::default(),
        })
    }

    /// Which file system is used.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The daemon's directories (one per hierarchy).
    pub fn bases(&self) -> &[PathBuf] {
        &self.bases
    }

    /// Makes the cgroup `name` (unique among the daemon's) with `limits`. The caller puts a tree
    /// in it ([`Cgroup::procs_files`]); until the returned value is dropped, [`Cgroups::sweep`]
    /// leaves it alone even while it is empty.
    pub fn create(self: &Arc<Self>, name: &str, limits: Limits) -> Result<Cgroup, CgroupError> {
        crate::sync::lock(&self.reserved).insert(name.to_string());
        let cgroup = Cgroup {
            owner: Arc::clone(self),
            name: name.to_string(),
            dirs: self.bases.iter().map(|b| b.join(name)).collect(),
            limits,
        };
        for dir in &cgroup.dirs {
            mkdir(dir).map_err(io("make", dir))?;
        }
        cgroup.apply()?;
        Ok(cgroup)
    }

    /// Removes every cgroup of the daemon that is neither reserved nor in use (its tree
    /// exited); the rest stay (rmdir(2) refuses a cgroup that has processes).
    pub fn sweep(&self) {
        // Held throughout: a cgroup reserved after a copy of the names was taken would be
        // listed below, still empty, and removed under its maker.
        let reserved = crate::sync::lock(&self.reserved);
        for base in &self.bases {
            let Ok(entries) = std::fs::read_dir(base) else {
                continue;
            };
            for e in entries.flatten() {
                let keep = e.file_name().to_str().is_some_and(|n| reserved.contains(n));
                if !keep && e.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
        }
    }

    /// At the daemon's stop: [`Cgroups::sweep`], then the daemon's own directories if empty
    /// (workers left to be re-adopted keep theirs).
    pub fn shut_down(&self) {
        // Killed trees take a moment to exit.
        for _ in 0..50 {
            self.sweep();
            let mut left = false;
            for base in &self.bases {
                match std::fs::remove_dir(base) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(_) => left = true,
                }
            }
            if !left {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cgroups {
    /// The daemon's directories go with it when empty (a daemon that failed to start, one
    /// that stopped); [`Cgroups::shut_down`] waits for exiting trees first.
    fn drop(&mut self) {
        for base in &self.bases {
            let _ = std::fs::remove_dir(base);
        }
    }
}

impl Cgroup {
    fn apply(&self) -> Result<(), CgroupError> {
        let l = self.limits;
        let write = |dir: &Path, file: &str, value: &str| {
            let path = dir.join(file);
            std::fs::write(&path, value).map_err(io("write", &path))
        };
        // Files a kernel may lack (swap accounting off: no memory.swap.max, no memsw): written
        // where they exist. (cgroupfs cannot create a file: a missing one fails with EACCES.)
        let optional = |dir: &Path, file: &str, value: &str| {
            let path = dir.join(file);
            if !path.exists() {
                return Ok(());
            }
            std::fs::write(&path, value).map_err(io("write", &path))
        };
        match self.owner.version {
            Version::V2 => {
                let dir = &self.dirs[0];
                let memory = l.memory.map_or("max".to_string(), |m| m.to_string());
                write(dir, "memory.max", &memory)?;
                // Swap would only stretch the limit and hide the kill for a long while.
                optional(dir, "memory.swap.max", "0")?;
                // An OOM kill ends the whole tree at once, not one of its processes.
                optional(dir, "memory.oom.group", "1")?;
                let cpu = l.cpu.map_or("max".to_string(), |c| quota_us(c).to_string());
                write(dir, "cpu.max", &format!("{cpu} {CPU_PERIOD_US}"))?;
                let pids = l.pids.map_or("max".to_string(), |p| p.to_string());
                write(dir, "pids.max", &pids)?;
            }
            Version::V1 => {
                let [memory_dir, cpu_dir, pids_dir] = &self.dirs[..] else {
                    unreachable!("one v1 directory per controller");
                };
                // -1: no limit. memsw (memory + swap) must be ≥ the memory limit: set after it.
                let memory = l.memory.map_or("-1".to_string(), |m| m.to_string());
                write(memory_dir, "memory.limit_in_bytes", &memory)?;
                optional(memory_dir, "memory.memsw.limit_in_bytes", &memory)?;
                write(cpu_dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                let cpu = l.cpu.map_or("-1".to_string(), |c| quota_us(c).to_string());
                write(cpu_dir, "cpu.cfs_quota_us", &cpu)?;
                let pids = l.pids.map_or("max".to_string(), |p| p.to_string());
                write(pids_dir, "pids.max", &pids)?;
            }
        }
        Ok(())
    }

    /// The files a process writes `0` into to join this cgroup (one per hierarchy).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Its directories (one per hierarchy).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// How many times the kernel's OOM killer killed a process of this cgroup because of its
    /// memory limit.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.owner.version {
            Version::V2 => ("memory.events", "oom_kill"),
            Version::V1 => ("memory.oom_control", "oom_kill"),
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .ok()
            .and_then(|text| {
                text.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse().ok()).flatten()
                })
            })
            .unwrap_or(0)
    }

    /// The reason to give for a worker of this cgroup that died: [`out_of_memory`]
    /// when the kernel killed it for the memory limit, else `otherwise`.
    pub fn explain_death(cgroup: Option<&Cgroup>, otherwise: String) -> String {
        match cgroup.filter(|c| c.oom_kills() > 0) {
            Some(c) => out_of_memory(c.limits.memory),
            None => otherwise,
        }
    }

    /// Writes `pid` (a process of a tree that started outside it) into this cgroup, in every
    /// hierarchy.
    pub fn add(&self, pid: i32) -> Result<(), CgroupError> {
        for f in self.procs_files() {
            std::fs::write(&f, pid.to_string()).map_err(io("write", &f))?;
        }
        Ok(())
    }
}

impl Cgroup {
    /// SIGKILL to every process in the cgroup, until it has none (or about a second passed):
    /// after a restore that failed with CRIU gone, what CRIU had forked and restored is left
    /// in it, waiting for ever and no longer marked as the daemon's (its environment is the
    /// restored tree's, or unreadable). Returns how many were killed.
    pub fn kill_all(&self) -> usize {
        kill_procs(&self.procs_files())
    }
}

/// [`Cgroup::kill_all`] on the cgroup's `cgroup.procs` files (for a blocking thread).
pub fn kill_procs(procs_files: &[PathBuf]) -> usize {
    let mut killed = 0;
    for _ in 0..50 {
        let pids: Vec<i32> = procs_files
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .flat_map(|t| {
                t.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<i32>>()
            })
            .collect();
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            // SAFETY: kill(2) only sends a signal, to a process in this instance's cgroup,
            // which the daemon made for it alone.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    killed
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        crate::sync::lock(&self.owner.reserved).remove(&self.name);
        // Fails while the tree still has processes: the next sweep removes it.
        for dir in &self.dirs {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A CPU quota per [`CPU_PERIOD_US`] for `cores` (at least the kernel's 1 ms).
fn quota_us(cores: f64) -> u64 {
    ((cores * CPU_PERIOD_US as f64).round() as u64).max(1000)
}

fn mkdir(dir: &Path) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        r => r,
    }
}

/// Why an instance went whose worker the kernel killed for its cgroup's memory limit
/// (`limit`, in bytes: the spec's `memory_limit`, else `workers.memory_limit`, plus a GPU
/// function's `gpu_memory`).
pub fn out_of_memory(limit: Option<u64>) -> String {
    let limit = limit.map_or_else(
        || "its memory limit".to_string(),
        |b| format!("its memory limit, {} MiB", b.div_ceil(1 << 20)),
    );
    format!(
        "the worker was killed by the kernel for using more than {limit} (memory_limit): raise \
         memory_limit in the function's torpor.toml (or workers.memory_limit in torpord's \
         config), or make the function use less memory"
    )
}

/// How often the daemon removes the cgroups of trees that are gone.
pub const SWEEP_EVERY: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cgroups_are_read_from_both_layouts() {
        let hybrid = "9:name=systemd:/\n4:memory:/a/b\n1:cpu,cpuacct:/\n0::/\n";
        let got = own_cgroups(hybrid);
        assert_eq!(got[1], ("memory".to_string(), "/a/b".to_string()));
        assert_eq!(got[2].0, "cpu,cpuacct");
        assert_eq!(got[3], (String::new(), "/".to_string()));
        assert_eq!(
            join(Path::new("/sys/fs/cgroup/memory"), "/a/b"),
            Path::new("/sys/fs/cgroup/memory/a/b")
        );
    }

    #[test]
    fn the_out_of_memory_reason_names_the_limit_and_how_to_raise_it() {
        let m = out_of_memory(Some(96 << 20));
        assert!(
            m.contains("more than its memory limit, 96 MiB (memory_limit)"),
            "{m}"
        );
        assert!(
            m.contains("raise memory_limit in the function's torpor.toml"),
            "{m}"
        );
        assert!(!out_of_memory(None).contains("MiB"));
    }

    /// The files each version writes, on a directory tree standing in for the cgroup file
    /// system (the real ones: tests/daemon/test_daemon_confine.py, on the version the machine has).
    #[test]
    fn each_version_writes_its_own_files() {
        let limits = Limits {
            memory: Some(96 << 20),
            cpu: Some(0.5),
            pids: Some(64),
        };
        let fs = tempfile::tempdir().unwrap();
        let root = fs.path();
        std::fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        let own = own_cgroups("0::/system.slice/torpord.service\n");
        let unit = root.join("system.slice/torpord.service");
        std::fs::create_dir_all(&unit).unwrap();
        std::fs::write(unit.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let v2 = Arc::new(Cgroups::detect_v2(root, &own, "t").unwrap());
        assert_eq!(v2.bases(), [unit.join("torpor-t")]);
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        assert_eq!(
            read(unit.join("cgroup.subtree_control")),
            "+memory +cpu +pids"
        );
        let c = v2.create("i.1", limits).unwrap();
        let dir = unit.join("torpor-t/i.1");
        assert_eq!(read(dir.join("memory.max")), "100663296");
        assert_eq!(read(dir.join("cpu.max")), "50000 100000");
        assert_eq!(read(dir.join("pids.max")), "64");
        assert!(
            !dir.join("memory.swap.max").exists(),
            "written only where the kernel has it"
        );
        assert_eq!(c.procs_files(), [dir.join("cgroup.procs")]);
        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(c.oom_kills(), 1);
        assert!(explain_death_line(&c).contains("96 MiB"));

        let fs = tempfile::tempdir().unwrap();
        let root = fs.path();
        for m in ["memory", "cpu,cpuacct", "pids"] {
            std::fs::create_dir_all(root.join(m).join("a")).unwrap();
            std::fs::write(root.join(m).join("cgroup.procs"), "").unwrap();
        }
        let own = own_cgroups("4:memory:/a\n1:cpu,cpuacct:/a\n8:pids:/a\n0::/\n");
        let v1 = Arc::new(Cgroups::detect_v1(root, &own, "t").unwrap());
        let c = v1.create("i.2", Limits::default()).unwrap();
        let [m, cpu, p] = c.dirs() else { panic!() };
        assert_eq!(m, &root.join("memory/a/torpor-t/i.2"));
        assert_eq!(cpu, &root.join("cpu,cpuacct/a/torpor-t/i.2"));
        assert_eq!(read(m.join("memory.limit_in_bytes")), "-1");
        assert_eq!(read(cpu.join("cpu.cfs_quota_us")), "-1");
        assert_eq!(read(p.join("pids.max")), "max");
        std::fs::write(
            m.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        )
        .unwrap();
        assert_eq!(c.oom_kills(), 2);
    }

    fn explain_death_line(c: &Cgroup) -> String {
        Cgroup::explain_death(Some(c), "closed".to_string())
    }

    #[test]
    fn cpu_quota_is_per_period_and_never_below_a_millisecond() {
        assert_eq!(quota_us(2.0), 200_000);
        assert_eq!(quota_us(0.5), 50_000);
        assert_eq!(quota_us(0.001), 1000);
    }

    #[test]
    fn a_missing_file_system_is_one_line_naming_the_way_out() {
        let dir = tempfile::tempdir().unwrap();
        let own = own_cgroups("4:memory:/\n0::/\n");
        let v2 = Cgroups::detect_v2(dir.path(), &own, "t").unwrap_err();
        assert!(v2.contains("not a cgroup2 mount"), "{v2}");
        let v1 = Cgroups::detect_v1(dir.path(), &own, "t").unwrap_err();
        assert!(v1.contains("memory is not mounted"), "{v1}");
        let e = Unavailable(format!("v2: {v2}; v1: {v1}")).to_string();
        assert!(
            !e.contains('\n') && e.contains("workers.allow_unconfined = true"),
            "{e}"
        );
    }

    /// A sweep running while cgroups are made never removes one that was just made and not yet
    /// given its tree (it did: the sweep read the reserved names before it listed the
    /// directories, so one made in between was empty and unknown to it; CI's boot then found
    /// no `cgroup.procs`). On the machine's real cgroup file system; skipped where there is none.
    #[test]
    fn a_sweep_never_removes_a_cgroup_being_made() {
        let state = tempfile::tempdir().unwrap();
        let Ok(cgroups) = Cgroups::detect(state.path()) else {
            eprintln!("skipped: no usable cgroup file system here");
            return;
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sweeper = {
            let (c, stop) = (Arc::clone(&cgroups), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    c.sweep();
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        let mut lost = 0;
        for i in 0..500 {
            match cgroups.create(&format!("race.{i}"), Limits::default()) {
                Ok(c) => lost += c.procs_files().iter().filter(|p| !p.exists()).count(),
                Err(e) => {
                    eprintln!("{e}");
                    lost += 1;
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        sweeper.join().unwrap();
        cgroups.shut_down();
        assert_eq!(lost, 0, "cgroups removed by a sweep while being made");
    }
}
