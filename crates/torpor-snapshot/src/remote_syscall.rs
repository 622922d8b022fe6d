//! Running system calls inside another process, the way CRIU's parasite code gets in: seize the
//! process with ptrace, stop it, point its registers at a `syscall` instruction with the call's
//! number and arguments, single-step over it, read the result, and put every register and byte
//! back before letting it go.
//!
//! Torpor needs this for one thing, which no other kernel interface does: changing another
//! process's mappings (see [`crate::inherited_mappings`]). A process stopped inside a blocking
//! system call is handled as CRIU's compel handles it: the injected call runs with `orig_rax`
//! cleared so the kernel does not restart anything on its behalf, and the original registers,
//! restored at the end, make the kernel restart the interrupted call when the process resumes.
//!
//! x86-64 only; elsewhere [`RemoteProcess::seize`] says so.

use std::io;

/// Why talking to the process failed; each message names the step.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// `ptrace` or `waitpid` failed.
    #[error("{step} of process {pid}: {source}")]
    Ptrace {
        step: &'static str,
        pid: i32,
        source: io::Error,
    },
    /// The process exited or was killed while seized.
    #[error("process {pid} exited while torpor was changing its mappings")]
    Exited { pid: i32 },
    /// This architecture has no injector.
    #[error("changing another process's mappings is implemented for x86-64 only, not {arch}")]
    Unsupported { arch: &'static str },
}

/// A process seized and stopped; dropping it restores its registers and code and detaches.
pub struct RemoteProcess {
    pid: i32,
    #[cfg(target_arch = "x86_64")]
    saved: Option<Saved>,
    /// A signal that arrived while the process was stopped, delivered again on detach.
    pending_signal: libc::c_int,
}

#[cfg(target_arch = "x86_64")]
struct Saved {
    regs: libc::user_regs_struct,
    /// Address of the word the `syscall` instruction was written over, and its old value.
    code_at: u64,
    code: libc::c_long,
}

impl RemoteProcess {
    /// Seizes and stops `pid` (its main thread; the others keep running, which is harmless for
    /// the calls Torpor makes). Fails if another tracer holds it.
    pub fn seize(pid: i32) -> Result<Self, RemoteError> {
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = pid;
            Err(RemoteError::Unsupported {
                arch: std::env::consts::ARCH,
            })
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: PTRACE_SEIZE takes no pointers; the kernel checks the permission.
            ptrace_check(pid, "ptrace(SEIZE)", unsafe {
                libc::ptrace(libc::PTRACE_SEIZE, pid, 0usize, 0usize)
            })?;
            let mut me = RemoteProcess {
                pid,
                saved: None,
                pending_signal: 0,
            };
            // SAFETY: PTRACE_INTERRUPT takes no pointers.
            ptrace_check(pid, "ptrace(INTERRUPT)", unsafe {
                libc::ptrace(libc::PTRACE_INTERRUPT, pid, 0usize, 0usize)
            })?;
            // The first stop is the interrupt's, or a signal's that was already on its way: that
            // one is delivered again on detach.
            let (sig, event) = me.wait_stop()?;
            if event != libc::PTRACE_EVENT_STOP {
                me.pending_signal = sig;
            }
            me.save()?;
            Ok(me)
        }
    }

    /// Runs system call `nr` with up to six arguments inside the process; returns its raw
    /// result (a negative errno on failure).
    pub fn syscall(&mut self, nr: libc::c_long, args: &[u64]) -> Result<i64, RemoteError> {
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (nr, args);
            Err(RemoteError::Unsupported {
                arch: std::env::consts::ARCH,
            })
        }
        #[cfg(target_arch = "x86_64")]
        {
            let saved = self
                .saved
                .as_ref()
                .expect("seized processes have saved registers");
            let mut regs = saved.regs;
            regs.rip = saved.code_at;
            regs.rax = nr as u64;
            // No restart on our behalf: the injected call is not the interrupted one.
            regs.orig_rax = u64::MAX;
            let a = |i: usize| args.get(i).copied().unwrap_or(0);
            regs.rdi = a(0);
            regs.rsi = a(1);
            regs.rdx = a(2);
            regs.r10 = a(3);
            regs.r8 = a(4);
            regs.r9 = a(5);
            self.set_regs(&regs)?;
            loop {
                // SAFETY: PTRACE_SINGLESTEP takes no pointers.
                ptrace_check(self.pid, "ptrace(SINGLESTEP)", unsafe {
                    libc::ptrace(libc::PTRACE_SINGLESTEP, self.pid, 0usize, 0usize)
                })?;
                match self.wait_stop()? {
                    (libc::SIGTRAP, 0) => break,
                    // A late stop of the interrupt: nothing to keep.
                    (_, libc::PTRACE_EVENT_STOP) => {}
                    // A signal stopped it before the step: keep it for later and step again.
                    (sig, _) => self.pending_signal = sig,
                }
            }
            let after = self.get_regs()?;
            Ok(after.rax as i64)
        }
    }

    /// Waits for the next stop; returns its signal and ptrace event (0 for none).
    #[cfg(target_arch = "x86_64")]
    fn wait_stop(&mut self) -> Result<(libc::c_int, libc::c_int), RemoteError> {
        match crate::sys::wait_tracee(self.pid) {
            Ok(crate::sys::TraceeStop::Stopped { signal, event }) => Ok((signal, event)),
            Ok(crate::sys::TraceeStop::Gone) => Err(RemoteError::Exited { pid: self.pid }),
            Err(source) => Err(RemoteError::Ptrace {
                step: "waitpid",
                pid: self.pid,
                source,
            }),
        }
    }

    #[cfg(target_arch = "x86_64")]
    fn save(&mut self) -> Result<(), RemoteError> {
        let regs = self.get_regs()?;
        let code_at = regs.rip;
        // SAFETY: PEEKTEXT reads one word of the tracee; errors come back through errno.
        let code = unsafe {
            *libc::__errno_location() = 0;
            libc::ptrace(libc::PTRACE_PEEKTEXT, self.pid, code_at as usize, 0usize)
        };
        let errno = io::Error::last_os_error();
        if code == -1 && errno.raw_os_error() != Some(0) {
            return Err(RemoteError::Ptrace {
                step: "ptrace(PEEKTEXT)",
                pid: self.pid,
                source: errno,
            });
        }
        // `syscall` is 0f 05; little endian puts the first byte lowest.
        let patched = (code & !0xffff) | 0x050f;
        // SAFETY: POKETEXT writes one word of the tracee's text (ptrace may write read-only code).
        ptrace_check(self.pid, "ptrace(POKETEXT)", unsafe {
            libc::ptrace(
                libc::PTRACE_POKETEXT,
                self.pid,
                code_at as usize,
                patched as usize,
            )
        })?;
        self.saved = Some(Saved {
            regs,
            code_at,
            code,
        });
        Ok(())
    }

    #[cfg(target_arch = "x86_64")]
    fn get_regs(&self) -> Result<libc::user_regs_struct, RemoteError> {
        // SAFETY: user_regs_struct is plain integers; all-zero is a valid value.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: GETREGS writes one user_regs_struct into `regs`.
        ptrace_check(self.pid, "ptrace(GETREGS)", unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGS,
                self.pid,
                0usize,
                &mut regs as *mut libc::user_regs_struct,
            )
        })?;
        Ok(regs)
    }

    #[cfg(target_arch = "x86_64")]
    fn set_regs(&self, regs: &libc::user_regs_struct) -> Result<(), RemoteError> {
        // SAFETY: SETREGS reads one user_regs_struct from `regs`.
        ptrace_check(self.pid, "ptrace(SETREGS)", unsafe {
            libc::ptrace(
                libc::PTRACE_SETREGS,
                self.pid,
                0usize,
                regs as *const libc::user_regs_struct,
            )
        })?;
        Ok(())
    }
}

impl Drop for RemoteProcess {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if let Some(saved) = self.saved.take() {
            // SAFETY: puts back the word `save` overwrote; failure leaves nothing to undo.
            unsafe {
                libc::ptrace(
                    libc::PTRACE_POKETEXT,
                    self.pid,
                    saved.code_at as usize,
                    saved.code as usize,
                )
            };
            // Restoring orig_rax and rax lets the kernel restart an interrupted call.
            let _ = self.set_regs(&saved.regs);
        }
        // SAFETY: detaching takes no pointers; the signal argument is re-delivered.
        unsafe {
            libc::ptrace(
                libc::PTRACE_DETACH,
                self.pid,
                0usize,
                self.pending_signal as usize,
            )
        };
    }
}

#[cfg(target_arch = "x86_64")]
fn ptrace_check(pid: i32, step: &'static str, rc: libc::c_long) -> Result<(), RemoteError> {
    if rc < 0 {
        Err(RemoteError::Ptrace {
            step,
            pid,
            source: io::Error::last_os_error(),
        })
    } else {
        Ok(())
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    /// A real child blocked in `read`: an injected `getpid` answers its own pid, and the read it
    /// was blocked in is restarted, so the line written afterwards still reaches it.
    #[test]
    fn injected_call_runs_in_the_process_and_the_interrupted_read_restarts() {
        if !crate::is_root() {
            eprintln!("skipped: needs root for ptrace of a child");
            return;
        }
        let mut child = Command::new("python3")
            .args([
                "-c",
                "import sys; print(sys.stdin.readline().strip()[::-1], flush=True)",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let pid = child.id() as i32;
        std::thread::sleep(std::time::Duration::from_millis(300)); // let it block in read
        {
            let mut remote = RemoteProcess::seize(pid).expect("seize");
            let got = remote.syscall(libc::SYS_getpid, &[]).expect("getpid");
            assert_eq!(got, pid as i64);
            let bad = remote.syscall(libc::SYS_close, &[9999]).expect("close");
            assert_eq!(bad, -(libc::EBADF as i64));
        }
        child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"torpor\n")
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "roprot");
        child.wait().unwrap();
    }

    #[test]
    fn a_missing_process_is_named() {
        let e = RemoteProcess::seize(i32::MAX).err().expect("must fail");
        assert!(e.to_string().contains(&i32::MAX.to_string()), "{e}");
    }
}
