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
//!    blocked but `SIGTRAP` (as the plugin does), for the driver's restore and unlock; a tracer
//!    thread of its own continues it from any stop it meets meanwhile (the group stop can reach
//!    it late); then it is stopped again, its signal mask put back, and released into the group
//!    stop. [`resume`] then continues the processes.
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

/// How many polls, [`TRACER_POLL`] apart, the tracer makes for the seized thread's first late
/// stop before it says the thread runs.
const SETTLE_POLLS: u32 = 5;

/// How often the tracer looks for a stop of the thread it lets run (and for its release).
const TRACER_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// The driver's restore thread of a stopped process, running alone while this lives; dropping
/// it stops the thread again, puts its signal mask back and releases it into the group stop.
///
/// ptrace belongs to the thread that seized: a tracer thread of its own holds the restore
/// thread for as long as this lives and lets it go on from every stop it meets meanwhile. A
/// group stop reaches a thread when it next leaves the kernel, which under load can be long
/// after the seize: on the H100 (2026-11-24, a burst of 8 restores, `scripts/stuck-dump.sh`)
/// one restore thread met it after the 5 ms that the seizing thread used to watch, stayed in
/// its ptrace stop (`t`) and the driver's restore waited for it for ever.
pub struct RunningRestoreThread {
    release: Option<std::sync::mpsc::Sender<()>>,
    tracer: Option<std::thread::JoinHandle<()>>,
}

impl RunningRestoreThread {
    /// Seizes thread `tid` of the stopped process `pid` and lets it run, every signal but
    /// `SIGTRAP` blocked so that nothing else the process has pending runs on it meanwhile.
    pub fn start(pid: i32, tid: i32) -> Result<Self, RestoreThreadError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let tracer = std::thread::Builder::new()
            .name(format!("restore-thread-{tid}"))
            .spawn(move || {
                let mut traced = match Traced::seize(pid, tid).and_then(Traced::settled) {
                    Ok(t) => {
                        let _ = ready_tx.send(Ok(()));
                        t
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Until released (or the owner is gone): on from every stop.
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    released.recv_timeout(TRACER_POLL)
                {
                    if traced.go_on_from_stops().is_err() {
                        break;
                    }
                }
                traced.release();
            })
            .map_err(|source| RestoreThreadError::Ptrace {
                step: "spawning the tracer thread",
                pid,
                tid,
                source,
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                release: Some(release),
                tracer: Some(tracer),
            }),
            Ok(Err(e)) => {
                let _ = tracer.join();
                Err(e)
            }
            Err(_) => {
                let _ = tracer.join();
                Err(RestoreThreadError::Exited { pid, tid })
            }
        }
    }
}

impl Drop for RunningRestoreThread {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            let _ = release.send(());
        }
        if let Some(tracer) = self.tracer.take() {
            let _ = tracer.join();
        }
    }
}

/// The restore thread as its tracer thread holds it.
struct Traced {
    pid: i32,
    tid: i32,
    saved_mask: SigSet,
    /// It exited: nothing to put back.
    gone: bool,
    /// A signal its stop was for, given back when it is let go.
    pending: libc::c_int,
}

impl Traced {
    fn fail(&self, step: &'static str, source: io::Error) -> RestoreThreadError {
        RestoreThreadError::Ptrace {
            step,
            pid: self.pid,
            tid: self.tid,
            source,
        }
    }

    /// Seizes, blocks every signal but `SIGTRAP`, and continues it.
    fn seize(pid: i32, tid: i32) -> Result<Self, RestoreThreadError> {
        let mut me = Traced {
            pid,
            tid,
            saved_mask: 0,
            gone: false,
            pending: 0,
        };
        // SAFETY: PTRACE_SEIZE takes no pointers; the kernel checks the permission.
        check(unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) })
            .map_err(|e| me.fail("ptrace(SEIZE)", e))?;
        // One in group-stop reports a trap of its own once seized; a running one (the process
        // was not stopped yet) is interrupted. Either way exactly one stop is waited for.
        if !in_group_stop(pid, tid) {
            // SAFETY: PTRACE_INTERRUPT takes no pointers.
            check(unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, tid, 0usize, 0usize) })
                .map_err(|e| me.fail("ptrace(INTERRUPT)", e))?;
        }
        me.wait_stop()?;
        // SAFETY: GETSIGMASK writes size_of::<SigSet>() bytes into `saved_mask`.
        check(unsafe {
            libc::ptrace(
                libc::PTRACE_GETSIGMASK,
                tid,
                std::mem::size_of::<SigSet>(),
                &mut me.saved_mask as *mut SigSet,
            )
        })
        .map_err(|e| me.fail("ptrace(GETSIGMASK)", e))?;
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
        .map_err(|e| me.fail("ptrace(SETSIGMASK)", e))?;
        me.go_on()?;
        Ok(me)
    }

    /// A thread seized in the group stop usually meets a group-stop trap right after it is
    /// continued: it is let go on from that before the driver is called, so that it is running
    /// when the driver's restore begins (later stops are the tracer loop's).
    fn settled(mut self) -> Result<Self, RestoreThreadError> {
        for _ in 0..SETTLE_POLLS {
            self.go_on_from_stops()?;
            std::thread::sleep(TRACER_POLL);
        }
        Ok(self)
    }

    /// Waits for its next ptrace stop; keeps the signal of a signal-delivery stop.
    fn wait_stop(&mut self) -> Result<(), RestoreThreadError> {
        match crate::sys::wait_tracee(self.tid) {
            Ok(crate::sys::TraceeStop::Stopped { signal, event }) => {
                self.note(signal, event);
                Ok(())
            }
            Ok(crate::sys::TraceeStop::Gone) => {
                self.gone = true;
                Err(RestoreThreadError::Exited {
                    pid: self.pid,
                    tid: self.tid,
                })
            }
            Err(source) => Err(self.fail("waitpid", source)),
        }
    }

    /// A stop for a signal (not a ptrace event) keeps that signal for when it goes on: the
    /// `SIGSTOP` that starts the process's group stop, say, which must reach the other threads.
    fn note(&mut self, signal: libc::c_int, event: libc::c_int) {
        self.pending = if event == 0 && signal != libc::SIGTRAP {
            signal
        } else {
            0
        };
    }

    /// Continues it from its stop, with the signal the stop was for.
    fn go_on(&mut self) -> Result<(), RestoreThreadError> {
        let signal = std::mem::take(&mut self.pending);
        // SAFETY: PTRACE_CONT takes no pointers; the signal is one the thread stopped for.
        check(unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0usize, signal as usize) })
            .map_err(|e| self.fail("ptrace(CONT)", e))
    }

    /// Continues it from any stop it met since (a group stop it reached late, a signal); an
    /// error when it is gone.
    fn go_on_from_stops(&mut self) -> Result<(), RestoreThreadError> {
        loop {
            let mut status = 0;
            // SAFETY: waitpid writes one int; WNOHANG returns at once.
            let rc = unsafe { libc::waitpid(self.tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if rc == self.tid && libc::WIFSTOPPED(status) {
                self.note(libc::WSTOPSIG(status), status >> 16);
                self.go_on()?;
            } else if rc == self.tid {
                self.gone = true;
                return Err(RestoreThreadError::Exited {
                    pid: self.pid,
                    tid: self.tid,
                });
            } else {
                return Ok(());
            }
        }
    }

    /// Stops it again, puts its signal mask back and detaches into the group stop.
    fn release(mut self) {
        if self.gone {
            return;
        }
        // SAFETY: PTRACE_INTERRUPT takes no pointers; a thread that is gone makes it fail.
        let stopped = unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, self.tid, 0usize, 0usize) }
            >= 0
            && self.wait_stop().is_ok();
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
        unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0usize, self.pending as usize) };
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

    /// A child killed and reaped when dropped, also when a test fails before its end.
    struct Spinning(std::process::Child);

    impl Drop for Spinning {
        fn drop(&mut self) {
            crate::sys::kill(self.0.id() as i32, libc::SIGKILL);
            let _ = self.0.wait();
        }
    }

    /// A child with three threads, each spinning (so a running thread shows R), and its pid.
    /// Each spins in a two-byte machine-code loop called through ctypes, without the GIL:
    /// threads spinning in Python wait for the GIL in turn (S most of the time), a thread
    /// stopped holding it keeps the others waiting, and the checks below then saw R only by
    /// chance (0.8-8.7 s of their 10 s here; one CI run timed out).
    fn spinning_child() -> (Spinning, i32) {
        let child = std::process::Command::new("python3")
            .args([
                "-c",
                "import ctypes, mmap, platform, threading\n\
                 loop = {'x86_64': b'\\xeb\\xfe', 'aarch64': (0x14000000).to_bytes(4, 'little')}[platform.machine()]\n\
                 m = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n\
                 m.write(loop)\n\
                 spin = ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(m)))\n\
                 for _ in range(2): threading.Thread(target=spin, daemon=True).start()\n\
                 spin()",
            ])
            .spawn()
            .expect("python3");
        let pid = child.id() as i32;
        let child = Spinning(child);
        wait_for("three threads", || thread_states(pid).len() == 3);
        (child, pid)
    }

    /// Once released, the restore thread stops with the others; `resume` then runs them all.
    fn stopped_again_then_resumed(pid: i32) {
        wait_for("the restore thread to stop with the rest", || {
            thread_states(pid)
                .iter()
                .all(|(_, s)| *s == 'T' || *s == 't')
        });
        resume(&[pid]);
        wait_for("every thread to run", || {
            thread_states(pid).iter().all(|(_, s)| *s == 'R')
        });
    }

    /// A stopped process whose one thread is let run alone: that thread runs (it is not in a
    /// stop state), every other one stays stopped, and after the drop and `resume` all run.
    #[test]
    fn only_the_restore_thread_runs_until_the_process_is_resumed() {
        let (_child, pid) = spinning_child();
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
        stopped_again_then_resumed(pid);
    }

    /// The group stop reaches the seized thread long after the seize (what a burst of restores
    /// did on the H100): it still runs alone until released, and stops with the rest after.
    #[test]
    fn a_group_stop_that_comes_late_does_not_stop_the_restore_thread() {
        let (_child, pid) = spinning_child();
        let tid = thread_states(pid).iter().map(|(t, _)| *t).max().unwrap();
        {
            // Seized while the process still runs; its SIGSTOP comes well after.
            let _running = RunningRestoreThread::start(pid, tid).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            stop(&[pid]);
            wait_for("the other threads' group stop", || {
                thread_states(pid)
                    .iter()
                    .all(|(t, s)| *t == tid || *s == 'T')
            });
            std::thread::sleep(Duration::from_millis(100));
            wait_for("the restore thread to run on", || {
                thread_states(pid)
                    .iter()
                    .any(|(t, s)| *t == tid && *s == 'R')
            });
        }
        stopped_again_then_resumed(pid);
    }
}
