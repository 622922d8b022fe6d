//! Changing a mount namespace: building a launched process's from a [`MountPolicy`], and
//! binding a host directory into the namespace of a tree that already runs ([`bind_into`]:
//! torpord hands a worker its function's directory this way when it loads the function).
//!
//! Binds use the new mount API (`open_tree` + `move_mount`, Linux ≥ 5.2): a detached copy of
//! the host's mount is taken first and attached later, so it can come from a mount about to be
//! detached, or go into another namespace.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::mounts::{self, MountPolicy};
use crate::sys;

/// Why a mount namespace could not be built or changed; each names the step, the path and the
/// fix.
#[derive(Debug, thiserror::Error)]
pub enum MountNsError {
    /// A host path to bind in could not be taken.
    #[error("cannot bind {path} into the worker's mount namespace: {source}; it must be an existing directory, on Linux ≥ 5.2 (open_tree)")]
    Clone { path: PathBuf, source: io::Error },
    /// A taken path could not be attached.
    #[error("cannot attach {path} in the worker's mount namespace: {source}")]
    Attach { path: PathBuf, source: io::Error },
    /// Another step of building the namespace failed.
    #[error("{step} failed: {source}; the kernel must allow mount namespaces for root")]
    Step {
        step: &'static str,
        source: io::Error,
    },
    /// The target tree's mount namespace cannot be entered.
    #[error("cannot enter the mount namespace of pid {pid}: {source}; did the process exit?")]
    Enter { pid: i32, source: io::Error },
}

fn step(step: &'static str) -> impl Fn(io::Error) -> MountNsError {
    move |source| MountNsError::Step { step, source }
}

/// Makes every mount of this process's mount namespace private, so that what it mounts or
/// unmounts from now on propagates nowhere.
pub(crate) fn make_private() -> io::Result<()> {
    // SAFETY: mount with null source/fstype/data and MS_REC|MS_PRIVATE only changes the
    // propagation of this process's mount namespace.
    sys::check(unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    })?;
    Ok(())
}

/// Builds this process's (new, copied) mount namespace as `policy` says; see [`MountPolicy`].
pub(crate) fn build(policy: &MountPolicy) -> Result<(), MountNsError> {
    make_private().map_err(step("making mounts private"))?;
    // Taken first: a bind's source may lie in a mount about to be detached.
    let binds = policy
        .binds
        .iter()
        .map(|path| {
            let read_only = policy.read_only && !policy.writable.contains(path);
            Ok((path, clone_mount(path, read_only)?))
        })
        .collect::<Result<Vec<_>, MountNsError>>()?;
    let table =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(step("reading the mount table"))?;
    for point in policy.to_detach(&mounts::parse(&table)) {
        detach_all(&point).map_err(step("detaching a host mount"))?;
    }
    if policy.read_only {
        // Every mount of the host's left, from / down: what is mounted after this (the
        // process's own tmpfs, the binds) keeps its own flags.
        set_read_only(Path::new("/")).map_err(step("making the host's mounts read-only"))?;
    }
    for dir in &policy.private_tmpfs {
        mount_own_tmpfs(dir).map_err(step("mounting a private tmpfs"))?;
    }
    if policy.veil {
        let mut writable_areas = policy.private_tmpfs.clone();
        for (path, _) in &binds {
            veil_path_to(path, &mut writable_areas)?;
        }
    }
    for (path, fd) in binds {
        attach(&fd, path)?;
    }
    Ok(())
}

/// How [`bind_into`] binds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BindOptions {
    /// The bind is read-only.
    pub read_only: bool,
    /// Make the path reachable by an unprivileged user ([`MountPolicy::veil`]).
    pub veil: bool,
}

/// Makes the way to `target` (a bind's mount point) traversable by anyone and creatable: the
/// first directory on it that others cannot traverse, or that holds no next component on a
/// mount this process did not make (read-only), gets a veil (an empty tmpfs of the process's own,
/// mode 0755) unless it lies in `writable_areas` (the process's own tmpfs mounts and veils),
/// which a veil joins.
fn veil_path_to(target: &Path, writable_areas: &mut Vec<PathBuf>) -> Result<bool, MountNsError> {
    use std::os::unix::fs::PermissionsExt;
    let Some(parent) = target.parent() else {
        return Ok(false);
    };
    let mut at = PathBuf::from("/");
    for component in parent.components().skip(1) {
        if writable_areas.iter().any(|a| at.starts_with(a)) {
            return Ok(false);
        }
        let next = at.join(component);
        let veil_at = match std::fs::metadata(&next) {
            Ok(m) if m.is_dir() && m.permissions().mode() & 0o001 != 0 => {
                at = next;
                continue;
            }
            Ok(_) => next,
            Err(e) if e.kind() == io::ErrorKind::NotFound => at.clone(),
            Err(source) => {
                return Err(MountNsError::Clone { path: next, source });
            }
        };
        if veil_at == Path::new("/") {
            return Err(MountNsError::Attach {
                path: target.to_path_buf(),
                source: io::Error::other("its way would need a tmpfs over /"),
            });
        }
        mount_veil(&veil_at).map_err(|source| MountNsError::Attach {
            path: veil_at.clone(),
            source,
        })?;
        writable_areas.push(veil_at);
        return Ok(true);
    }
    Ok(false)
}

/// Mounts a veil at `dir`: an empty tmpfs of the process's own (named
/// [`mounts::OWN_TMPFS_SOURCE`]: a snapshot archives its few empty directories), mode 0755, small.
fn mount_veil(dir: &Path) -> io::Result<()> {
    mount_own(dir, c"mode=0755,size=1m")
}

// From <linux/mount.h>.
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// `struct mount_attr` of <linux/mount.h>.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Makes the mount at `path` and every mount below it read-only.
fn set_read_only(path: &Path) -> io::Result<()> {
    let p = path_cstring(path)?;
    set_read_only_at(libc::AT_FDCWD, &p, AT_RECURSIVE)
}

fn set_read_only_at(dirfd: libc::c_int, path: &CStr, flags: libc::c_uint) -> io::Result<()> {
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads the path and `attr` (its size given), both valid for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Binds each of `paths` (host directories) at the same path into the mount namespace of
/// `pid`, unless that namespace shows the very same directory there already. The bind is an
/// external mount to CRIU: a snapshot records it, never its files.
pub fn bind_into(pid: i32, paths: &[PathBuf], how: BindOptions) -> Result<(), MountNsError> {
    // setns(CLONE_NEWNS) is refused to a thread sharing its filesystem context: a thread of
    // its own unshares it, enters the namespace, and ends, leaving the caller where it was.
    std::thread::scope(|scope| {
        scope
            .spawn(|| bind_into_here(pid, paths, how))
            .join()
            .unwrap_or_else(|_| {
                Err(MountNsError::Enter {
                    pid,
                    source: io::Error::other("the binding thread panicked"),
                })
            })
    })
}

fn bind_into_here(pid: i32, paths: &[PathBuf], how: BindOptions) -> Result<(), MountNsError> {
    let enter = |source| MountNsError::Enter { pid, source };
    let ns = File::open(format!("/proc/{pid}/ns/mnt")).map_err(enter)?;
    // The tree's own tmpfs mounts and veils, where paths may be made: read from here (inside,
    // /proc is the tree's PID namespace's, where this thread has no /proc/self).
    let mut own: Vec<PathBuf> = if how.veil {
        let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .map_err(step("reading the worker's mount table"))?;
        mounts::parse(&table)
            .into_iter()
            .filter(|m| m.role() == mounts::Role::Own)
            .map(|m| PathBuf::from(m.point))
            .collect()
    } else {
        Vec::new()
    };
    let clones = paths
        .iter()
        .map(|path| {
            let meta = std::fs::metadata(path).map_err(|source| MountNsError::Clone {
                path: path.clone(),
                source,
            })?;
            Ok((
                path,
                (meta.dev(), meta.ino()),
                clone_mount(path, how.read_only)?,
            ))
        })
        .collect::<Result<Vec<_>, MountNsError>>()?;
    // SAFETY: gives this thread (which ends after this function) a filesystem context of its
    // own; no memory is touched.
    sys::check(unsafe { libc::unshare(libc::CLONE_FS) }).map_err(enter)?;
    // SAFETY: moves this thread, and only it, into the namespace `ns` refers to.
    sys::check(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) }).map_err(enter)?;
    for (path, host_id, fd) in clones {
        let veiled = how.veil && veil_path_to(path, &mut own)?;
        let seen = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
        if veiled || seen != Some(host_id) {
            attach(&fd, path)?;
        }
    }
    Ok(())
}

fn path_cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|e| io::Error::other(e.to_string()))
}

/// Detaches every mount stacked at `point`, with everything below each. A bounded number of
/// layers; a point that is (no longer) a mount point is done.
fn detach_all(point: &str) -> io::Result<()> {
    let path = path_cstring(Path::new(point))?;
    for _ in 0..16 {
        // SAFETY: detaches a mount of this process's own (private) mount namespace.
        if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(());
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Mounts a fresh tmpfs of the process's own at `dir`, named [`mounts::OWN_TMPFS_SOURCE`] so a
/// snapshot archives it (and no other tmpfs).
fn mount_own_tmpfs(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    mount_own(dir, c"mode=1777")
}

/// A tmpfs named [`mounts::OWN_TMPFS_SOURCE`] at `dir`, with tmpfs `options`.
fn mount_own(dir: &Path, options: &std::ffi::CStr) -> io::Result<()> {
    let target = path_cstring(dir)?;
    let source = path_cstring(Path::new(mounts::OWN_TMPFS_SOURCE))?;
    // SAFETY: all pointers are valid NUL-terminated strings; the mount goes into this
    // process's own private namespace.
    sys::check(unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            options.as_ptr().cast(),
        )
    })?;
    Ok(())
}

// From <linux/mount.h>.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const AT_EMPTY_PATH: libc::c_uint = libc::AT_EMPTY_PATH as libc::c_uint;

/// A detached copy of the mount at `path`, rooted there (what `mount --bind` would attach);
/// with `read_only`, the copy is read-only.
fn clone_mount(path: &Path, read_only: bool) -> Result<OwnedFd, MountNsError> {
    let fail = |source| MountNsError::Clone {
        path: path.to_path_buf(),
        source,
    };
    let p = path_cstring(path).map_err(fail)?;
    // SAFETY: open_tree reads the path and returns a new descriptor, owned below.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            p.as_ptr(),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    // SAFETY: open_tree succeeded: `fd` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    if read_only {
        set_read_only_at(fd.as_raw_fd(), c"", AT_EMPTY_PATH).map_err(fail)?;
    }
    Ok(fd)
}

/// Attaches a mount from [`clone_mount`] at `path` in the caller's namespace, creating the
/// directory if needed (inside a fresh tmpfs it is the tmpfs's own).
fn attach(mount: &OwnedFd, path: &Path) -> Result<(), MountNsError> {
    let fail = |source| MountNsError::Attach {
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path).map_err(fail)?;
    let target = path_cstring(path).map_err(fail)?;
    // SAFETY: moves the detached mount `mount` onto `target` in the caller's namespace.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc != 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    Ok(())
}
