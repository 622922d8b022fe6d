//! Dump and restore requests, and [`Criu::dump`] / [`Criu::restore`].

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Action, CriuError};
use crate::locate::Criu;
use crate::netns::set_loopback_up;
use crate::proto::{CriuOpts, CriuReq, InheritFd, NetworkLockMethod, ReqType, EMPTY_NS_NET};
use crate::swrk::{self, Notification, NotifyHandler};

/// The notification CRIU sends once the restored tree's namespaces exist, before any of its
/// files, sockets or memory are restored. Its pid is the restored root's host pid.
pub const SETUP_NAMESPACES: &str = "setup-namespaces";
/// The action-script point right before CRIU lets the restored tasks go (it still holds every
/// thread): a signal sent then is the first thing each thread meets.
pub const PRE_RESUME: &str = "pre-resume";

/// What to dump and how. CRIU writes its images and `log_file` into `images_dir`.
#[derive(Clone, Debug)]
pub struct DumpRequest<'a> {
    /// Root of the process tree to dump (host pid).
    pub pid: i32,
    /// Existing directory for the images.
    pub images_dir: &'a Path,
    /// CRIU's log, a plain file name inside `images_dir`.
    pub log_file: &'a str,
    /// CRIU log level, 0 (none) to 4 (debug); CRIU's default is 2 (errors and warnings).
    pub log_level: i32,
    /// Keep the tree running after a successful dump (a failed dump always leaves it running).
    pub leave_running: bool,
    /// CRIU `--external` entries, e.g. `mnt[/usr/local/nvidia]:nv`.
    pub external: Vec<String>,
    /// Do not dump the network namespace (`--empty-ns net`): restore gives an empty one.
    pub empty_ns_net: bool,
    /// Do not lock the network with iptables/nftables (`--network-lock skip`).
    pub network_lock_skip: bool,
    /// Dump established TCP connections (`--tcp-established`).
    pub tcp_established: bool,
    /// Allow Unix sockets connected to peers outside the tree (`--ext-unix-sk`).
    pub ext_unix_sk: bool,
    /// Dump file locks (`--file-locks`).
    pub file_locks: bool,
    /// Keep files that are open but whose opened name was removed while another name still
    /// links them (`--link-remap`): POSIX semaphores (`sem_open` links a temporary file to its
    /// name and removes the temporary one), shared-memory files renamed after opening.
    pub link_remap: bool,
    /// The images of a previous pre-dump, as a path relative to `images_dir`
    /// (`--prev-images-dir`): CRIU links it as `parent` and records the pages that did not
    /// change since as "in parent" (needs `track_mem`).
    pub parent_img: Option<String>,
    /// Track memory changes with the kernel's soft-dirty bits (`--track-mem`): needed by
    /// [`Criu::pre_dump`] and by a dump with `parent_img`.
    pub track_mem: bool,
    /// The tree reaches nothing in the host's `/run` (its `/run` is a mount of its own, and no
    /// external mount lies there): a dump of a root tree may then run CRIU with a `/run` of its
    /// own holding its kernel-feature cache, as [`RestoreRequest::private_run`] does, when this
    /// process made that cache ([`Criu::prepare_kernel_cache`]). A tree that is not root's
    /// always gets one (crate::kerndat).
    pub private_run: bool,
}

impl<'a> DumpRequest<'a> {
    /// A dump of `pid` into `images_dir` with log `dump.log` at level 2 and every option off.
    pub fn new(pid: i32, images_dir: &'a Path) -> Self {
        DumpRequest {
            pid,
            images_dir,
            log_file: "dump.log",
            log_level: 2,
            leave_running: false,
            external: Vec::new(),
            empty_ns_net: false,
            network_lock_skip: false,
            tcp_established: false,
            ext_unix_sk: false,
            file_locks: false,
            link_remap: false,
            parent_img: None,
            track_mem: false,
            private_run: false,
        }
    }
}

/// What to restore and how. CRIU reads the images and writes `log_file` in `images_dir`.
#[derive(Clone, Debug)]
pub struct RestoreRequest<'a> {
    /// Directory holding the images of a dump.
    pub images_dir: &'a Path,
    /// Directory for CRIU's log (and its other outputs) instead of `images_dir`, so restores
    /// can leave the snapshot untouched. Must exist and be writable.
    pub work_dir: Option<&'a Path>,
    /// CRIU's log, a plain file name inside `work_dir` (else `images_dir`); use one per restore
    /// when restoring one snapshot several times at once.
    pub log_file: &'a str,
    /// CRIU log level, 0 (none) to 4 (debug).
    pub log_level: i32,
    /// Root directory for the restored tree (`--root`); with a mount namespace in the images,
    /// `Some("/")` restores it on top of the host's root.
    pub root: Option<&'a Path>,
    /// CRIU `--external` entries, e.g. `mnt[nv]:/usr/local/nvidia`.
    pub external: Vec<String>,
    /// The dump was taken with `empty_ns_net`: create a new, empty network namespace.
    pub empty_ns_net: bool,
    /// `--network-lock skip`.
    pub network_lock_skip: bool,
    /// `--tcp-established`.
    pub tcp_established: bool,
    /// `--ext-unix-sk`.
    pub ext_unix_sk: bool,
    /// `--file-locks`.
    pub file_locks: bool,
    /// Make the restored root a child of the caller instead of CRIU's (`--restore-sibling`):
    /// the caller then gets its exit status and must reap it. (After a failed restore the
    /// killed root is reaped here, when CRIU got as far as "setup-namespaces".)
    pub rst_sibling: bool,
    /// Hand a pty master whose slave the tree holds to the "orphan-pts-master" notification.
    pub orphan_pts_master: bool,
    /// Bring `lo` up in the restored network namespace during "setup-namespaces", before CRIU
    /// restores sockets. With `empty_ns_net` the new namespace's `lo` is otherwise down, and
    /// anything the process listens on at 127.0.0.1 is unreachable (connect: ENETUNREACH).
    pub loopback_up: bool,
    /// Files the restored tree gets from the caller instead of reopening them (`--inherit-fd`):
    /// every descriptor of the tree that the image knows by the key is restored as a copy of
    /// the given one. CRIU gets them at the same numbers, whatever their close-on-exec flag.
    pub inherit_fds: Vec<InheritedFd<'a>>,
    /// Restore memory lazily (`--lazy-pages`): CRIU maps the tree's private anonymous memory
    /// empty and hands each process's userfaultfd to a `criu lazy-pages` daemon, which must
    /// already listen in `work_dir` (see [`Criu::start_lazy_pages`]); the daemon fills pages as
    /// they are touched, then the rest in the background.
    pub lazy_pages: bool,
    /// Restore into these cgroups (their `cgroup.procs` files, one per hierarchy): `criu swrk`
    /// joins them before it runs, so the restored processes, its children, are born in them,
    /// and CRIU is told to leave cgroups alone (`--manage-cgroups=ignore`), so it moves none of
    /// them back into the cgroups recorded at the dump. Empty: CRIU's default (soft mode).
    pub cgroup: Vec<PathBuf>,
    /// The restored tree reaches nothing in the host's `/run` (its `/run` is a tmpfs of its
    /// own, and no external mount lies there): CRIU may then run with a `/run` of its own that
    /// holds its kernel-feature cache, and skip probing the kernel (crate::kerndat), when this
    /// process made that cache ([`Criu::prepare_kernel_cache`]).
    pub private_run: bool,
}

/// One `--inherit-fd` entry of a restore.
#[derive(Clone, Debug)]
pub struct InheritedFd<'a> {
    /// How the image names the file: for a regular file its path without the leading `/`
    /// (`var/log/app.log`), for a pipe `pipe:[INODE]`.
    pub key: String,
    pub fd: BorrowedFd<'a>,
}

impl<'a> RestoreRequest<'a> {
    /// A restore from `images_dir` with log `restore.log` at level 2 and every option off.
    pub fn new(images_dir: &'a Path) -> Self {
        RestoreRequest {
            images_dir,
            work_dir: None,
            log_file: "restore.log",
            log_level: 2,
            root: None,
            external: Vec::new(),
            empty_ns_net: false,
            network_lock_skip: false,
            tcp_established: false,
            ext_unix_sk: false,
            file_locks: false,
            rst_sibling: false,
            orphan_pts_master: false,
            loopback_up: false,
            inherit_fds: Vec::new(),
            lazy_pages: false,
            cgroup: Vec::new(),
            private_run: false,
        }
    }
}

impl Criu {
    /// Dumps a process tree. On failure CRIU leaves the tree running.
    pub fn dump(&self, r: &DumpRequest<'_>) -> Result<(), CriuError> {
        self.dump_with(r, &mut |_| Ok(()))
    }

    /// Copies the tree's memory into `images_dir` while it keeps running (CRIU's pre-dump, as a
    /// `SINGLE_PRE_DUMP` request: the
    /// tree is frozen only while its memory is made readable and its soft-dirty bits are
    /// cleared). Needs the kernel's soft-dirty tracking; `leave_running` does not apply.
    pub fn pre_dump(&self, r: &DumpRequest<'_>) -> Result<(), CriuError> {
        // SINGLE_PRE_DUMP: one pre-dump per request. (PRE_DUMP enters CRIU's pre-dump loop,
        // which after its reply waits on the socket for the next pre-dump or the dump.)
        self.call_dump(ReqType::SinglePreDump, Action::PreDump, r, &mut |_| Ok(()))
    }

    /// [`Criu::dump`], calling `on_notify` at each of CRIU's action-script points
    /// ("pre-dump", "network-lock", "post-dump", …); an `Err` aborts the dump.
    pub fn dump_with(
        &self,
        r: &DumpRequest<'_>,
        on_notify: &mut NotifyHandler<'_>,
    ) -> Result<(), CriuError> {
        self.call_dump(ReqType::Dump, Action::Dump, r, on_notify)
    }

    fn call_dump(
        &self,
        kind: ReqType,
        action: Action,
        r: &DumpRequest<'_>,
        on_notify: &mut NotifyHandler<'_>,
    ) -> Result<(), CriuError> {
        let images = open_images_dir(r.images_dir)?;
        let opts = CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            pid: Some(r.pid),
            leave_running: (kind == ReqType::Dump).then_some(r.leave_running),
            parent_img: r.parent_img.clone(),
            track_mem: r.track_mem.then_some(true),
            ext_unix_sk: Some(r.ext_unix_sk),
            tcp_established: Some(r.tcp_established),
            file_locks: Some(r.file_locks),
            link_remap: Some(r.link_remap),
            log_level: Some(r.log_level),
            log_file: Some(plain_name(r.log_file)?),
            notify_scripts: Some(true),
            external: r.external.clone(),
            empty_ns: r.empty_ns_net.then_some(EMPTY_NS_NET),
            network_lock: r
                .network_lock_skip
                .then_some(NetworkLockMethod::Skip as i32),
            ..Default::default()
        };
        let log = r.images_dir.join(r.log_file);
        // A tree that dropped root is dumped by a CRIU with its real ids (crate::kerndat); a
        // root one with a `/run` of its own when it may, so that CRIU's kernel probes leave
        // the stop.
        let own_run = match tree_ids(r.pid) {
            Some((uid, gid)) => Some(crate::kerndat::OwnRun {
                ids: Some((uid, gid)),
                cache: crate::kerndat::cache(self, uid)?,
            }),
            None => r
                .private_run
                .then(crate::kerndat::cached)
                .flatten()
                .map(|cache| crate::kerndat::OwnRun { ids: None, cache }),
        };
        swrk::call(
            self,
            action,
            request(kind, opts),
            log,
            swrk::Start {
                own_run,
                ..swrk::Start::default()
            },
            on_notify,
        )?;
        Ok(())
    }

    /// Makes CRIU's kernel-feature cache for this process's later CRIU runs (one `criu check`,
    /// about 0.1 s; a no-op once made): restores with [`RestoreRequest::private_run`] then skip
    /// CRIU's probes of the kernel. A long-running caller (torpord) calls it once at start.
    pub fn prepare_kernel_cache(&self) -> Result<(), CriuError> {
        crate::kerndat::cache(self, 0).map(|_| ())
    }

    /// Restores a process tree and returns the host pid of its root.
    ///
    /// (A restore runs CRIU as plain root: it sets the restored tasks' credentials itself.)
    pub fn restore(&self, r: &RestoreRequest<'_>) -> Result<i32, CriuError> {
        self.restore_with(r, &mut |_| Ok(()))
    }

    /// [`Criu::restore`], calling `on_notify` at each of CRIU's action-script points
    /// ("setup-namespaces" with the restored root's pid, "post-restore", …); an `Err` aborts
    /// the restore and CRIU kills what it had restored. With `loopback_up`, `lo` is brought up
    /// before `on_notify` sees "setup-namespaces".
    pub fn restore_with(
        &self,
        r: &RestoreRequest<'_>,
        on_notify: &mut NotifyHandler<'_>,
    ) -> Result<i32, CriuError> {
        let images = open_images_dir(r.images_dir)?;
        let work = match r.work_dir {
            Some(dir) => Some(open_dir(dir).map_err(|source| CriuError::WorkDir {
                path: dir.to_path_buf(),
                source,
            })?),
            None => None,
        };
        let root = match r.root {
            Some(p) => Some(
                p.to_str()
                    .ok_or_else(|| CriuError::NonUtf8Path {
                        path: p.to_path_buf(),
                    })?
                    .to_string(),
            ),
            None => None,
        };
        let opts = CriuOpts {
            images_dir_fd: images.as_raw_fd(),
            work_dir_fd: work.as_ref().map(|w| w.as_raw_fd()),
            ext_unix_sk: Some(r.ext_unix_sk),
            tcp_established: Some(r.tcp_established),
            file_locks: Some(r.file_locks),
            log_level: Some(r.log_level),
            log_file: Some(plain_name(r.log_file)?),
            notify_scripts: Some(true),
            root,
            rst_sibling: Some(r.rst_sibling),
            inherit_fd: r
                .inherit_fds
                .iter()
                .map(|i| InheritFd {
                    key: i.key.clone(),
                    fd: i.fd.as_raw_fd(),
                })
                .collect(),
            external: r.external.clone(),
            empty_ns: r.empty_ns_net.then_some(EMPTY_NS_NET),
            orphan_pts_master: Some(r.orphan_pts_master),
            lazy_pages: r.lazy_pages.then_some(true),
            manage_cgroups: (!r.cgroup.is_empty()).then_some(false),
            network_lock: r
                .network_lock_skip
                .then_some(NetworkLockMethod::Skip as i32),
            ..Default::default()
        };
        let log = r.work_dir.unwrap_or(r.images_dir).join(r.log_file);
        let pass: Vec<BorrowedFd<'_>> = r.inherit_fds.iter().map(|i| i.fd).collect();
        let loopback_up = r.loopback_up;
        let mut root_pid = None;
        let mut handler = |n: &mut Notification| {
            if n.script == SETUP_NAMESPACES {
                root_pid = n.pid;
                if loopback_up {
                    let pid = n
                        .pid
                        .ok_or("CRIU sent setup-namespaces without the restored pid")?;
                    set_loopback_up(pid).map_err(|e| e.to_string())?;
                }
            }
            on_notify(n)
        };
        let result = swrk::call(
            self,
            Action::Restore,
            request(ReqType::Restore, opts),
            log.clone(),
            swrk::Start {
                pass: &pass,
                cgroup: &r.cgroup,
                own_run: r
                    .private_run
                    .then(crate::kerndat::cached)
                    .flatten()
                    .map(|cache| crate::kerndat::OwnRun { ids: None, cache }),
            },
            &mut handler,
        );
        let resp = match result {
            Ok(resp) => resp,
            Err(e) => {
                if let (true, Some(pid)) = (r.rst_sibling, root_pid) {
                    reap_killed_child(pid);
                }
                return Err(e);
            }
        };
        match resp.restore {
            Some(restored) => Ok(restored.pid),
            None => Err(CriuError::UnexpectedReply {
                action: Action::Restore,
                got: resp.r#type,
                log,
            }),
        }
    }
}

/// After a failed restore with `rst_sibling`, the root CRIU had forked is our child and CRIU has
/// killed it: reap it so no zombie is left. Bounded, in case CRIU left it alive after all.
fn reap_killed_child(pid: i32) {
    for _ in 0..200 {
        let mut status = 0;
        // SAFETY: waitpid writes only the status integer; WNOHANG never blocks.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc != 0 {
            return; // reaped, or not (or no longer) our child
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn request(kind: ReqType, opts: CriuOpts) -> CriuReq {
    CriuReq {
        r#type: kind as i32,
        opts: Some(opts),
        notify_success: None,
    }
}

/// Opens the images directory for CRIU: CRIU reaches it as `/proc/<our pid>/fd/<fd>` and
/// resolves `log_file` inside it (unless a work directory is given), so nothing is inherited.
fn open_images_dir(path: &Path) -> Result<File, CriuError> {
    open_dir(path).map_err(|source| CriuError::ImagesDir {
        path: path.to_path_buf(),
        source,
    })
}

fn open_dir(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)
}

fn plain_name(name: &str) -> Result<String, CriuError> {
    let plain = !name.is_empty() && !name.contains('/') && name != "." && name != "..";
    if plain {
        Ok(name.to_string())
    } else {
        Err(CriuError::LogFileName {
            name: name.to_string(),
        })
    }
}

/// The uid and gid of the tree rooted at `pid` when it runs as one user that is not root (real,
/// effective and saved ids alike, `/proc/PID/status`): CRIU's dump runs with these as its real
/// ids (crate::kerndat). `None`: root, mixed ids, or unreadable.
fn tree_ids(pid: i32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let ids = |key: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let v: Vec<u32> = line[key.len()..]
            .split_whitespace()
            .take(3)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        (v.len() == 3 && v.iter().all(|x| *x == v[0]) && v[0] != 0).then_some(v[0])
    };
    Some((ids("Uid:")?, ids("Gid:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_file_must_be_a_plain_name() {
        assert!(plain_name("dump.log").is_ok());
        for bad in ["", ".", "..", "sub/dump.log", "/tmp/dump.log"] {
            assert!(
                matches!(plain_name(bad), Err(CriuError::LogFileName { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn missing_images_dir_is_named() {
        let e = open_images_dir(Path::new("/nonexistent/images")).expect_err("must fail");
        assert!(e.to_string().contains("/nonexistent/images"), "{e}");
    }
}
