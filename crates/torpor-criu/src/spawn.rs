//! Starting `criu swrk` without copying the caller's address space.
//!
//! `std::process::Command` with a pre-exec hook forks: the kernel copies every page-table
//! entry of the caller and write-protects its private memory, holding the caller's mmap lock
//! for writing meanwhile. torpord is that caller, and it holds gigabytes (the host cache, the
//! segments it saved at a GPU release), so each CRIU it started cost ~27 ms per GiB of 4 KiB
//! pages on the H200 machine and ~48 ms on the development VM (`fork`+`exec` of `true` from a
//! Python process holding 1 GiB: 26.6 and 47.9 ms, against 0.97 and 0.64 ms with
//! `posix_spawn`), stalled every thread of the daemon that faulted meanwhile (the restore
//! server's fills), and left its memory copy-on-write until CRIU's `exec`. Measured on the
//! H200 through torpord: CRIU's restore phase 0.179 → 0.162 s at GPT-2-Large, 0.132 → 0.117 s
//! at ResNet-152 (docs/lazy-pages.md, "CRIU started without a fork"). `posix_spawn` avoids all of that by
//! `clone(CLONE_VM | CLONE_VFORK)`, but it cannot run the setup CRIU needs between the two
//! (its descriptors at fixed numbers, its cgroup, a mount namespace of its own:
//! crate::swrk, crate::kerndat); nor can std, whose `Command` forks as soon as a pre-exec hook is
//! set. So this module does what glibc's `posix_spawn` does, with that hook:
//!
//! * the child shares the caller's memory and runs on a stack of its own while the calling
//!   thread is suspended (`CLONE_VFORK`) until it `exec`s or exits; other threads go on;
//! * every signal is blocked around the `clone`, and the child resets each handled signal to
//!   its default before unblocking, so that no handler of the caller ever runs in the child
//!   (it would run on the caller's memory);
//! * the hook makes raw system calls only, allocates nothing and reports a failure as an errno,
//!   which the child leaves in memory the caller reads once it resumes.
//!
//! No crate offers a spawn with a hook that does not fork (nix's `clone` is the bare system
//! call, which `libc` already gives), hence this module.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};

/// The child's stack: the hook's system calls and `execve` need little.
const STACK_BYTES: usize = 256 * 1024;

/// A process started by [`spawn`]; reap it with [`Spawned::wait`] (as with std's `Child`,
/// dropping it unreaped leaves a zombie until the caller exits).
#[derive(Debug)]
pub(crate) struct Spawned {
    pid: libc::pid_t,
    status: Option<ExitStatus>,
}

impl Spawned {
    pub(crate) fn id(&self) -> u32 {
        self.pid as u32
    }

    /// Waits for the process to exit (once; later calls return the same status).
    pub(crate) fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let status = wait_pid(self.pid)?;
        self.status = Some(status);
        Ok(status)
    }
}

fn wait_pid(pid: libc::pid_t) -> io::Result<ExitStatus> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child, writing into a local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(ExitStatus::from_raw(status));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The child's standard descriptors (each duplicated onto 0, 1, 2).
pub(crate) struct Stdio {
    pub stdin: RawFd,
    pub stdout: RawFd,
    pub stderr: RawFd,
}

/// What the child reads (prepared by the caller, so that the child allocates nothing) and
/// where it leaves its errno.
struct ChildArgs<'a> {
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    stdio: [RawFd; 3],
    process_group: bool,
    hook: &'a mut dyn FnMut() -> io::Result<()>,
    errno: libc::c_int,
}

/// Starts `cmd`'s program with its arguments and environment (the caller's, with `cmd`'s
/// changes; its working directory and stdio settings are not read: the child starts in the
/// caller's directory with `stdio`), in a process group of its own when `process_group`,
/// running `hook` in the child just before `execve`.
///
/// # Safety
///
/// `hook` runs in a child that shares the caller's memory while the calling thread is
/// suspended: it must only make async-signal-safe system calls, must not allocate, take locks
/// or unwind, and must report a failure as an `io::Error` with an OS error code (any other is
/// reported as `EINVAL`).
pub(crate) unsafe fn spawn(
    cmd: &Command,
    stdio: Stdio,
    process_group: bool,
    hook: &mut dyn FnMut() -> io::Result<()>,
) -> io::Result<Spawned> {
    let program = cstring(resolve(cmd.get_program()).as_os_str())?;
    let mut args = vec![program.clone()];
    for a in cmd.get_args() {
        args.push(cstring(a)?);
    }
    let env = environment(cmd)?;
    let argv: Vec<*const libc::c_char> = args
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const libc::c_char> = env
        .iter()
        .map(|e| e.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let mut child = ChildArgs {
        program: program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        stdio: [stdio.stdin, stdio.stdout, stdio.stderr],
        process_group,
        hook,
        errno: 0,
    };
    let stack = Stack::new()?;
    // SAFETY: signal masks of this thread (blocked around the clone, restored after), and a
    // clone whose child runs `child_main` on `stack` with `child`, both alive until it has
    // exec'd or exited (CLONE_VFORK suspends this thread until then).
    let (pid, clone_err) = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let pid = libc::clone(
            child_main,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&mut child as *mut ChildArgs<'_>).cast(),
        );
        let clone_err = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        (pid, clone_err)
    };
    // The child has exec'd or exited (CLONE_VFORK): its stack and arguments are free again.
    drop(stack);
    if pid < 0 {
        return Err(clone_err);
    }
    if child.errno != 0 {
        // It exited without exec: reap it, report why.
        let _ = wait_pid(pid);
        return Err(io::Error::from_raw_os_error(child.errno));
    }
    Ok(Spawned { pid, status: None })
}

/// The child: runs on its own stack, in the caller's memory, until `execve`.
extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the ChildArgs the suspended caller keeps alive until this exits or execs.
    let child = unsafe { &mut *arg.cast::<ChildArgs<'_>>() };
    let errno = match prepare_and_exec(child) {
        Ok(()) => libc::EINVAL, // execve returned without an error: cannot happen
        Err(e) => e.raw_os_error().unwrap_or(libc::EINVAL),
    };
    child.errno = errno;
    // SAFETY: _exit runs no atexit handler and flushes nothing of the caller's.
    unsafe { libc::_exit(127) }
}

fn prepare_and_exec(child: &mut ChildArgs<'_>) -> io::Result<()> {
    // SAFETY: system calls on this child only; every pointer is to memory the caller prepared.
    unsafe {
        reset_signals();
        if child.process_group && libc::setpgid(0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        for (target, &fd) in child.stdio.iter().enumerate() {
            if libc::dup2(fd, target as RawFd) < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        (child.hook)()?;
        libc::execve(child.program, child.argv, child.envp);
    }
    Err(io::Error::last_os_error())
}

/// Every handled signal back to its default (its handler is the caller's code), SIGPIPE too
/// (Rust programs ignore it, and an ignored signal stays ignored across `execve`), then
/// nothing blocked: the state std gives a child.
unsafe fn reset_signals() {
    // SAFETY: sigaction and the signal mask of this child only (the caller is the child).
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        for sig in 1..=libc::SIGRTMAX() {
            if sig == libc::SIGKILL || sig == libc::SIGSTOP {
                continue;
            }
            let mut cur: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut cur) != 0 {
                continue;
            }
            let handled = cur.sa_sigaction != libc::SIG_DFL && cur.sa_sigaction != libc::SIG_IGN;
            if handled || sig == libc::SIGPIPE {
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    }
}

/// A bare name is looked up in `PATH`, as std's `Command` and `execvp` do (`execve` does not);
/// one found nowhere is left as it is, for `execve` to report ENOENT.
fn resolve(program: &OsStr) -> std::path::PathBuf {
    if program.as_bytes().contains(&b'/') {
        return program.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p)
                .map(|m| {
                    m.is_file()
                        && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
                })
                .unwrap_or(false)
        })
        .unwrap_or_else(|| program.into())
}

fn cstring(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{s:?} holds a NUL byte"),
        )
    })
}

/// The caller's environment with `cmd`'s changes (`env_clear` is not used on CRIU's command).
fn environment(cmd: &Command) -> io::Result<Vec<CString>> {
    let mut vars: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    for (key, value) in cmd.get_envs() {
        vars.retain(|(k, _)| k != key);
        if let Some(v) = value {
            vars.push((key.to_os_string(), v.to_os_string()));
        }
    }
    vars.iter()
        .map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("environment variable {k:?} holds a NUL byte"),
                )
            })
        })
        .collect()
}

/// The child's stack, with a guard page below it.
struct Stack {
    base: *mut libc::c_void,
    len: usize,
}

impl Stack {
    fn new() -> io::Result<Stack> {
        let page = 4096;
        let len = STACK_BYTES + page;
        // SAFETY: a fresh private anonymous mapping, owned by the returned value.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the lowest page of the mapping just made.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            let err = io::Error::last_os_error();
            // SAFETY: unmaps what was mapped above.
            unsafe { libc::munmap(base, len) };
            return Err(err);
        }
        Ok(Stack { base, len })
    }

    /// The stack grows down from here (16-byte aligned).
    fn top(&self) -> *mut libc::c_void {
        // SAFETY: one past the end of the mapping, as clone(2) expects.
        unsafe { self.base.cast::<u8>().add(self.len).cast() }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used (the child exec'd or exited).
        unsafe { libc::munmap(self.base, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::AsRawFd;

    fn null() -> File {
        File::options()
            .read(true)
            .write(true)
            .open("/dev/null")
            .expect("/dev/null")
    }

    fn run_sh(script: &str, hook: &mut dyn FnMut() -> io::Result<()>) -> (ExitStatus, String) {
        let out = tempfile::tempfile().expect("tempfile");
        let dev_null = null();
        // A bare name: found in PATH, as std would.
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script).env("TORPOR_SPAWN_TEST", "set");
        // SAFETY: the hooks below make raw system calls only.
        let mut child = unsafe {
            spawn(
                &cmd,
                Stdio {
                    stdin: dev_null.as_raw_fd(),
                    stdout: out.as_raw_fd(),
                    stderr: out.as_raw_fd(),
                },
                true,
                hook,
            )
        }
        .expect("spawn");
        let status = child.wait().expect("wait");
        assert_eq!(child.wait().expect("wait again"), status);
        let text = std::fs::read_to_string(format!("/proc/self/fd/{}", out.as_raw_fd()))
            .expect("read output");
        (status, text)
    }

    #[test]
    fn the_child_runs_with_its_stdio_environment_group_and_a_clean_signal_state() {
        // A caller that ignores SIGPIPE (as every Rust program does) and blocks SIGUSR1: the
        // child must see neither.
        // SAFETY: an all-zero sigset_t is a valid value, overwritten below.
        let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: changes of this test thread's signal state, restored below.
        unsafe {
            let mut usr1: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut usr1);
            libc::sigaddset(&mut usr1, libc::SIGUSR1);
            libc::pthread_sigmask(libc::SIG_BLOCK, &usr1, &mut old);
        }
        let (status, text) = run_sh(
            "echo env=$TORPOR_SPAWN_TEST; grep -E '^(SigBlk|SigIgn)' /proc/self/status; \
             echo pgid=$(cut -d' ' -f5 /proc/self/stat) pid=$$; exit 3",
            &mut || Ok(()),
        );
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
        assert_eq!(status.code(), Some(3), "{text}");
        assert!(text.contains("env=set"), "{text}");
        assert!(text.contains("SigBlk:\t0000000000000000"), "{text}");
        let ign = text
            .lines()
            .find_map(|l| l.strip_prefix("SigIgn:\t"))
            .expect("SigIgn line");
        let ign = u64::from_str_radix(ign.trim(), 16).expect("hex");
        assert_eq!(
            ign & (1 << (libc::SIGPIPE - 1)),
            0,
            "SIGPIPE ignored: {text}"
        );
        let line = text
            .lines()
            .find(|l| l.starts_with("pgid="))
            .expect("pgid line");
        let (pgid, pid) = line.split_once(' ').expect("two fields");
        assert_eq!(
            pgid.trim_start_matches("pgid="),
            pid.trim_start_matches("pid="),
            "its own process group: {text}"
        );
    }

    #[test]
    fn the_hook_runs_in_the_child_before_exec() {
        // The hook moves the child to another directory: the caller's stays where it was.
        let before = std::env::current_dir().expect("cwd");
        let (status, text) = run_sh("pwd", &mut || {
            // SAFETY: chdir(2) of the child (CLONE_FS is not shared) to a static path.
            if unsafe { libc::chdir(c"/proc".as_ptr()) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
        assert!(status.success(), "{text}");
        assert_eq!(text.trim(), "/proc");
        assert_eq!(std::env::current_dir().expect("cwd"), before);
    }

    #[test]
    fn spawns_from_many_threads_at_once_each_run_their_own_child() {
        // The children share the caller's memory until they exec: each must still run its own
        // arguments and hand back its own status, whatever the other threads do meanwhile.
        let threads: Vec<_> = (0..8)
            .map(|t| {
                std::thread::spawn(move || {
                    for i in 0..20 {
                        let code = (t * 20 + i) % 200;
                        let (status, text) =
                            run_sh(&format!("echo {t}-{i}; exit {code}"), &mut || Ok(()));
                        assert_eq!(status.code(), Some(code), "{text}");
                        assert_eq!(text.trim(), format!("{t}-{i}"));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a spawning thread failed");
        }
    }

    #[test]
    fn a_failing_hook_or_a_missing_program_is_the_spawns_error() {
        let dev_null = null();
        let stdio = || Stdio {
            stdin: dev_null.as_raw_fd(),
            stdout: dev_null.as_raw_fd(),
            stderr: dev_null.as_raw_fd(),
        };
        let cmd = Command::new("/bin/true");
        // SAFETY: the hook only returns an error.
        let err = unsafe {
            spawn(&cmd, stdio(), false, &mut || {
                Err(io::Error::from_raw_os_error(libc::EACCES))
            })
        }
        .expect_err("the hook failed");
        assert_eq!(err.raw_os_error(), Some(libc::EACCES));

        let cmd = Command::new("/nonexistent/criu");
        // SAFETY: an empty hook.
        let err =
            unsafe { spawn(&cmd, stdio(), false, &mut || Ok(())) }.expect_err("no such program");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
}
