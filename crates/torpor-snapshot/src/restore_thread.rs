//! A restored CUDA process must not run before the driver has given its GPU state back.
//!
//! CRIU resumes the tasks it restored; the driver's restore (`cuCheckpointProcessRestore`) comes
//! after. In that window libcuda's own threads run, and one of them can read a driver mapping that
//! only the driver's restore puts back: on the H100 (driver 580, 2026-11-23) a restored JAX process
//! died there with `segfault at 7f5e70e56000 … in libcuda.so`, four restores in a row, always at
//! the same address, so restoring again (what Torpor did before) was no fix.
//!
//! CRIU's own CUDA plugin keeps the tasks frozen through its `RESUME_DEVICES_LATE` hook and lets
//! only the driver's restore thread run while `cuda-checkpoint` restores ("The resuming process
//! has to stay frozen during this time", plugins/cuda/cuda_plugin.c). Torpor drives the driver
//! itself, after CRIU, so it does the same in two steps:
//!
//! 1. [`stop`] at CRIU's "pre-resume" notification: each CUDA process gets a `SIGSTOP` while
//!    CRIU still holds its threads, so the signal is the first thing each thread meets when CRIU
//!    lets go and none runs a user instruction (what CRIU's `--leave-stopped` does, which its RPC
//!    does not offer).
//! 2. [`RunningRestoreThread`]: the driver's restore thread of each stopped process
//!    (`cuCheckpointProcessGetRestoreThreadId`) is seized with ptrace and let run alone, signals
//!    blocked but `SIGTRAP` (as the plugin does), for the driver's restore and unlock; then it is
//!    stopped again, its signal mask put back, and released into the group stop. [`resume`]
//!    then continues the processes.
//!
//! The ptrace steps follow the kernel's rules for a thread already in group-stop: `PTRACE_SEIZE`
//! turns its stop into a ptrace group-stop trap (reported by `waitpid` as `PTRACE_EVENT_STOP`),
//! `PTRACE_CONT` runs that thread alone while the others stay stopped, and `PTRACE_DETACH` while
//! the group stop is in effect puts it back into the group stop.

use std::io;

/// Why the driver's restore thread could not be run alone.
#[derive(Debug, thiserror::Error)]
pub enum RestoreThreadError {
    /// A ptrace or waitpid step failed.
    #[error("{step} of the driver's restore thread {tid} (process {pid}): {source}")]
    Ptrace {
        step: &'static str,
        pid: i32,
        tid: i32,
        source: io::Error,
    },
    /// The thread or its process went away.
    #[error(
        "the driver's restore thread {tid} of process {pid} exited before the driver's restore"
    )]
    Exited { pid: i32, tid: i32 },
}

/// How many 1 ms polls [`RunningRestoreThread::start`] watches for a late group-stop trap.
const SETTLE_POLLS: u32 = 5;

/// Sends `SIGSTOP` to each of `pids` (their whole thread groups).
pub fn stop(pids: &[i32]) {
    for &pid in pids {
        crate::sys::kill(pid, libc::SIGSTOP);
    }
}

/// Waits, up to `bound`, until every thread of `pid` is in the group stop [`stop`] began
/// (each meets it as it comes out of CRIU's hold); says whether they all got there.
pub fn wait_stopped(pid: i32, bound: std::time::Duration) -> bool {
    let until = std::time::Instant::now() + bound;
    loop {
        let all = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks.flatten().all(|t| {
                    t.file_name()
                        .to_str()
                        .and_then(|tid| tid.parse().ok())
                        .is_some_and(|tid| in_group_stop(pid, tid))
                })
            })
            .unwrap_or(false);
        if all || std::time::Instant::now() >= until {
            return all;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Continues each of `pids` after [`stop`].
pub fn resume(pids: &[i32]) {
    for &pid in pids {
        crate::sys::kill(pid, libc::SIGCONT);
    }
}

/// The kernel's signal set as ptrace's GETSIGMASK/SETSIGMASK read and write it (64 signals).
type SigSet = u64;

/// The driver's restore thread of a stopped process, running alone while this lives; dropping
/// it stops the thread again, puts its signal mask back and releases it into the group stop.
pub struct RunningRestoreThread {
    pid: i32,
    tid: i32,
    saved_mask: SigSet,
}

impl RunningRestoreThread {
    /// Seizes thread `tid` of the stopped process `pid` and lets it run, every signal but
    /// `SIGTRAP` blocked so that nothing else the process has pending runs on it meanwhile.
    pub fn start(pid: i32, tid: i32) -> Result<Self, RestoreThreadError> {
        let fail = |step, source| RestoreThreadError::Ptrace {
            step,
            pid,
            tid,
            source,
        };
        // SAFETY: PTRACE_SEIZE takes no pointers; the kernel checks the permission.
        check(unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) })
            .map_err(|e| fail("ptrace(SEIZE)", e))?;
        let mut me = RunningRestoreThread {
            pid,
            tid,
            saved_mask: 0,
        };
        // One in group-stop reports a trap of its own once seized; a running one (the process
        // was not stopped after all) is interrupted. Either way exactly one stop is waited for.
        if !in_group_stop(pid, tid) {
            // SAFETY: PTRACE_INTERRUPT takes no pointers.
            check(unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) })
                .map_err(|e| fail("ptrace(INTERRUPT)", e))?;
        }
        me.wait_trap()?;
        // SAFETY: GETSIGMASK writes size_of::<SigSet>() bytes into `saved_mask`.
        check(unsafe {
            libc::ptrace(
                libc::PTRACE_GETSIGMASK,
                tid,
                std::mem::size_of::<SigSet>(),
                &mut me.saved_mask as *mut SigSet,
            )
        })
        .map_err(|e| fail("ptrace(GETSIGMASK)", e))?;
        let block: SigSet = !(1u64 << (libc::SIGTRAP - 1));
        // SAFETY: SETSIGMASK reads size_of::<SigSet>() bytes from `block`.
        check(unsafe {
            libc::ptrace(
                libc::PTRACE_SETSIGMASK,
                tid,
                std::mem::size_of::<SigSet>(),
                &block as *const SigSet,
            )
        })
        .map_err(|e| fail("ptrace(SETSIGMASK)", e))?;
        // SAFETY: PTRACE_CONT takes no pointers; signal 0 delivers nothing.
        check(unsafe { libc::ptrace(libc::PTRACE_CONT, tid, 0usize, 0usize) })
            .map_err(|e| fail("ptrace(CONT)", e))?;
        // A thread seized before it took part in the group stop meets the stop right after
        // (a ptrace group-stop trap): let it go on from that too.
        for _ in 0..SETTLE_POLLS {
            let mut status = 0;
            // SAFETY: waitpid writes one int; WNOHANG returns at once.
            let rc = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if rc == tid && libc::WIFSTOPPED(status) {
                // SAFETY: as above.
                check(unsafe { libc::ptrace(libc::PTRACE_CONT, tid, 0usize, 0usize) })
                    .map_err(|e| fail("ptrace(CONT)", e))?;
            } else if rc == tid {
                return Err(RestoreThreadError::Exited { pid, tid });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(me)
    }

    /// Waits for the thread's next ptrace stop.
    fn wait_trap(&mut self) -> Result<(), RestoreThreadError> {
        match crate::sys::wait_tracee(self.tid) {
            Ok(crate::sys::TraceeStop::Stopped { .. }) => Ok(()),
            Ok(crate::sys::TraceeStop::Gone) => Err(RestoreThreadError::Exited {
                pid: self.pid,
                tid: self.tid,
            }),
            Err(source) => Err(RestoreThreadError::Ptrace {
                step: "waitpid",
                pid: self.pid,
                tid: self.tid,
                source,
            }),
        }
    }
}

impl Drop for RunningRestoreThread {
    fn drop(&mut self) {
        // SAFETY: PTRACE_INTERRUPT takes no pointers; a thread that is gone makes it fail.
        let stopped = unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, self.tid, 0usize, 0usize) }
            >= 0
            && self.wait_trap().is_ok();
        if stopped {
            // SAFETY: SETSIGMASK reads size_of::<SigSet>() bytes from `saved_mask`.
            unsafe {
                libc::ptrace(
                    libc::PTRACE_SETSIGMASK,
                    self.tid,
                    std::mem::size_of::<SigSet>(),
                    &self.saved_mask as *const SigSet,
                )
            };
        }
        // SAFETY: detaching takes no pointers; with the group stop in effect the thread stops.
        unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0usize, 0usize) };
    }
}

/// Whether thread `tid` of `pid` is stopped by a signal (state `T`).
fn in_group_stop(pid: i32, tid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))
        .ok()
        .and_then(|stat| {
            let at = stat.rfind(')')? + 2;
            stat.get(at..at + 1).map(|s| s == "T")
        })
        .unwrap_or(false)
}

fn check(rc: libc::c_long) -> Result<(), io::Error> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// The state letter of every thread of `pid`, by tid.
    fn thread_states(pid: i32) -> Vec<(i32, char)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let tid: i32 = e.unwrap().file_name().to_string_lossy().parse().unwrap();
            let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).unwrap();
            let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
            out.push((tid, state));
        }
        out
    }

    fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !ok() {
            assert!(Instant::now() < until, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A stopped process whose one thread is let run alone: that thread runs (it is not in a
    /// stop state), every other one stays stopped, and after the drop and `resume` all run.
    #[test]
    fn only_the_restore_thread_runs_until_the_process_is_resumed() {
        // A child with three threads, each spinning (so a running thread shows R).
        let child = std::process::Command::new("python3")
            .args([
                "-c",
                "import threading\n\
                 def spin():\n    while True: pass\n\
                 for _ in range(2): threading.Thread(target=spin, daemon=True).start()\n\
                 spin()",
            ])
            .spawn()
            .expect("python3");
        let pid = child.id() as i32;
        wait_for("three threads", || thread_states(pid).len() == 3);
        stop(&[pid]);
        wait_for("the group stop", || {
            thread_states(pid).iter().all(|(_, s)| *s == 'T')
        });
        let tid = thread_states(pid).iter().map(|(t, _)| *t).max().unwrap();
        {
            let _running = RunningRestoreThread::start(pid, tid).unwrap();
            wait_for("the restore thread to run", || {
                thread_states(pid)
                    .iter()
                    .any(|(t, s)| *t == tid && *s == 'R')
            });
            std::thread::sleep(Duration::from_millis(50));
            for (t, s) in thread_states(pid) {
                if t != tid {
                    assert!(
                        s == 'T',
                        "thread {t} left its stop ({s}) while {tid} ran alone"
                    );
                }
            }
        }
        wait_for("the restore thread to stop again", || {
            thread_states(pid)
                .iter()
                .all(|(_, s)| *s == 'T' || *s == 't')
        });
        resume(&[pid]);
        wait_for("every thread to run", || {
            thread_states(pid).iter().all(|(_, s)| *s == 'R')
        });
        crate::sys::kill(pid, libc::SIGKILL);
        let mut child = child;
        let _ = child.wait();
    }
}
