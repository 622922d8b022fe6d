//! Torpor's page server: takes `criu lazy-pages`' place in `criu restore --lazy-pages` (the
//! handshake is CRIU's, docs/lazy-pages.md) and serves the restored tasks' lazy memory from the
//! snapshot's page images, mapped read-only (a staged copy sits on a huge-page tmpfs), in large
//! `UFFDIO_COPY` runs:
//!
//! 1. a fault is served first, always, with a run of [`FAULT_RUN`] around it: CRIU's daemon
//!    copies one page per fault and resets its background transfer on each, which made the CUDA
//!    driver's sequential read of its ~0.7 GB of checkpointed state take 8.5 s;
//! 2. once CRIU says the restore finished, `hot-begun` is created in the work directory (the
//!    restore waits for it, then starts the driver's restore beside the copy) and the *hot set*
//!    (ranges a profiled restore saw faulted, in that order: `$TORPOR_PAGE_PROFILE_IN`) goes in
//!    at once, on several threads: the driver reads in about the order they are copied, and a
//!    copy wakes a fault on its pages;
//! 3. the rest in address order, in the background: batches of [`BACKGROUND_BATCH`] (pieces of
//!    at most [`BACKGROUND_RUN`], across the live tasks' remaining runs) copied on
//!    `$TORPOR_PAGE_SERVER_BACKGROUND_THREADS` threads ([`DEFAULT_BACKGROUND_THREADS`], at most
//!    the machine's cores) like the hot set, with [`Server::copy_pieces`]. Faults are served between two batches, so a fault
//!    waits at most one batch, 64 MiB split between the threads (and less when the batch holds
//!    its page: the copy wakes it). With one thread (or the test's fault switch) the copy is serial,
//!    [`BACKGROUND_RUN`] at a time, a fault taking its turn between two copies, as before session
//!    17.
//!
//! It runs as a child process of the restoring one (`torpor __page-server IMAGES WORK`, the
//! same binary), so the restore's handling of CRIU's daemon holds: it listens on
//! `lazy-pages.socket`, exits 0 once every page of every live task is in, and non-zero with one
//! line on stderr otherwise (the restore then kills the tree: a task left with missing pages
//! would wait for ever). `$TORPOR_PAGE_PROFILE_OUT` records the faults' ranges in order (for the
//! next restores' hot set); `$TORPOR_PAGE_SERVER_STATS` gets its counters as JSON.
//!
//! userfaultfd by raw ioctls (libc): the `userfaultfd` crate creates and registers uffds, but
//! here CRIU has done both and hands over the fd; only COPY, ZEROPAGE and WAKE are needed.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::images::{self, LazyRun, PAGE_SIZE};
use crate::lazy::LAZY_PAGES_SOCKET;

/// The hidden subcommand of the torpor binaries that runs the server.
pub const SUBCOMMAND: &str = "__page-server";
/// The descriptor on which the server sends each userfaultfd it serves to the restoring
/// process, which keeps them in flight (unread) until it knows the outcome
/// ([`crate::LazyPages::take_hold`]): a server that dies then leaves the restored tasks' faults
/// waiting instead of released to zero-filled pages. Its standard input: passed so, the server
/// is started by `posix_spawn` (no code between fork and exec), which does not copy the
/// restoring process's page tables as a fork does (torpord's can be large: a fork of a process
/// with 4 GiB of private memory took 0.3 s on the 2-core development VM).
pub const HOLD_FD: RawFd = 0;
/// The argument that names it: `--hold-fd=0`.
pub const HOLD_FD_ARG: &str = "--hold-fd=";
/// The hot set to copy first: a profile an earlier restore recorded.
pub const PROFILE_IN_ENV: &str = "TORPOR_PAGE_PROFILE_IN";
/// Where to record the ranges faulted in once CRIU's restore finished, in order.
pub const PROFILE_OUT_ENV: &str = "TORPOR_PAGE_PROFILE_OUT";
/// Where to append the server's counters (one JSON line per restore).
pub const STATS_ENV: &str = "TORPOR_PAGE_SERVER_STATS";
/// `off`: no background copy, faults and the hot set only; the server ends once every task
/// has exited (a profiling restore, whose tree is thrown away; a test that needs memory still
/// lazy while it forks and mremaps).
pub const BACKGROUND_ENV: &str = "TORPOR_PAGE_SERVER_BACKGROUND";
/// Created in the work directory when the hot set's copy begins (CRIU's restore is done): the
/// restore starts the driver's then.
pub const HOT_BEGUN: &str = "hot-begun";
/// Bytes copied around a fault.
pub const FAULT_RUN: u64 = 1 << 20;
/// Bytes per background copy.
pub const BACKGROUND_RUN: u64 = 4 << 20;
/// Bytes per background batch (the parallel copy): what a fault may wait behind.
pub const BACKGROUND_BATCH: u64 = 64 << 20;
/// Threads of the background copy; 1: serial, [`BACKGROUND_RUN`] at a time (as before session
/// 17). torpord sets it from `restore_server.background_threads`.
pub const BACKGROUND_THREADS_ENV: &str = "TORPOR_PAGE_SERVER_BACKGROUND_THREADS";
/// The background copy's threads unless told otherwise (at most the machine's cores).
pub const DEFAULT_BACKGROUND_THREADS: usize = 8;
/// The most background threads the server takes.
pub const MAX_BACKGROUND_THREADS: usize = 64;
/// `LAZY_PAGES_RESTORE_FINISHED` (criu/uffd.c).
const RESTORE_FINISHED: u32 = 0x5253_5446;
/// How long CRIU may take to connect.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(120);
/// `TORPOR_PAGE_SERVER_FAULT=hot-set`: how long the server lets the restore go on after CRIU's
/// "finished" before it stops, so that the restoring side is past CRIU and waits for the hot set.
const HOT_SET_FAULT_DELAY: Duration = Duration::from_millis(500);
/// The page [`Server::probe`] asks about: `mmap_min_addr`'s usual value, below any program.
const PROBE_ADDR: u64 = 0x10000;
/// How often an idle server without background copy probes whether its tasks still live.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// `TORPOR_PAGE_SERVER_FAULT=slow-background`: the pause between two background batches, so
/// that a test's tree forks and mremaps while batches still come (faults are served meanwhile).
const SLOW_BACKGROUND_PAUSE: Duration = Duration::from_millis(200);
/// While recording a profile, the background copy waits until no fault came for this long, so
/// that what the process (and the driver's restore) touches first faults and is recorded.
const PROFILE_QUIET: Duration = Duration::from_millis(300);

// linux/userfaultfd.h (x86-64 and arm64 alike).
const UFFDIO_COPY: u64 = 0xC028_AA03;
const UFFDIO_ZEROPAGE: u64 = 0xC020_AA04;
const UFFDIO_WAKE: u64 = 0x8010_AA02;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_FORK: u8 = 0x13;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioZeropage {
    start: u64,
    len: u64,
    mode: u64,
    zeropage: i64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);
const _: () = assert!(std::mem::size_of::<UffdioZeropage>() == 32);

/// Why the server stopped before every page was in.
#[derive(Debug, thiserror::Error)]
pub enum PageServerError {
    #[error(transparent)]
    Image(#[from] images::ImageReadError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("CRIU did not connect within {} s", ACCEPT_TIMEOUT.as_secs())]
    NoRestore,
    #[error("CRIU closed the connection before the restore finished")]
    RestoreAborted,
    #[error("UFFDIO_COPY of {len} bytes at {at:#x} into pid {pid} failed: {source}")]
    Copy {
        pid: i32,
        at: u64,
        len: u64,
        source: std::io::Error,
    },
    #[error("stopped by TORPOR_PAGE_SERVER_FAULT after {pages} pages (a test's fault switch)")]
    Fault { pages: u64 },
    #[error("{BACKGROUND_THREADS_ENV} must be a number from 1 to {MAX_BACKGROUND_THREADS}, got {0:?}: set it so or unset it ({DEFAULT_BACKGROUND_THREADS})")]
    BackgroundThreads(String),
    #[error("stopped by TORPOR_PAGE_SERVER_FAULT=hot-set before serving the hot set, {} ms after CRIU's restore finished (a test's fault switch)", HOT_SET_FAULT_DELAY.as_millis())]
    FaultHotSet,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PageServerError {
    let what = what.into();
    move |source| PageServerError::Io { what, source }
}

/// Counters, written as JSON to `$TORPOR_PAGE_SERVER_STATS`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub tasks: u64,
    pub faults: u64,
    pub fault_pages: u64,
    pub hot_pages: u64,
    pub background_pages: u64,
    /// Background batches copied on more than one thread (0 on the serial path).
    pub background_batches: u64,
    pub zero_pages: u64,
    pub forks: u64,
}

struct Task {
    pid: i32,
    uffd: OwnedFd,
    /// Index into the mapped page files.
    pages: usize,
    /// What is still to copy, sorted, disjoint.
    runs: Vec<LazyRun>,
    gone: bool,
}

/// The index of the run that holds `addr`, if any. Runs are sorted and disjoint, so every
/// lookup is a binary search: a GPU worker's image has tens of thousands of runs (its recorded
/// profile on the H100: ~60 000 one-page runs of the driver's residue), and a linear scan per
/// fault made a restore quadratic.
fn run_at(runs: &[LazyRun], addr: u64) -> Option<usize> {
    let i = runs.partition_point(|r| r.end <= addr);
    (i < runs.len() && runs[i].start <= addr).then_some(i)
}

/// Removes `[start, end)` from `runs`, touching only the runs it overlaps.
fn cut(runs: &mut Vec<LazyRun>, start: u64, end: u64) {
    let lo = runs.partition_point(|r| r.end <= start);
    let hi = runs.partition_point(|r| r.start < end);
    if lo >= hi {
        return;
    }
    let (first, last) = (runs[lo], runs[hi - 1]);
    let mut kept = Vec::with_capacity(2);
    if first.start < start {
        kept.push(LazyRun {
            start: first.start,
            end: start,
            offset: first.offset,
        });
    }
    if last.end > end {
        kept.push(LazyRun {
            start: end,
            end: last.end,
            offset: last.offset + (end - last.start),
        });
    }
    runs.splice(lo..hi, kept);
}

/// Removes every range of `done` from `runs` in one pass (`done` is sorted here): a batch of
/// thousands of one-page pieces cut one by one would move the rest of the list each time.
fn cut_many(runs: &mut Vec<LazyRun>, done: &mut [(u64, u64)]) {
    if done.is_empty() {
        return;
    }
    done.sort_unstable();
    let mut out = Vec::with_capacity(runs.len());
    let mut k = 0;
    for r in runs.iter() {
        while k < done.len() && done[k].1 <= r.start {
            k += 1;
        }
        let (mut at, mut j) = (r.start, k);
        while at < r.end {
            match done.get(j) {
                Some(&(s, e)) if s < r.end => {
                    if s > at {
                        out.push(LazyRun {
                            start: at,
                            end: s,
                            offset: r.offset + (at - r.start),
                        });
                    }
                    at = at.max(e);
                    j += 1;
                }
                _ => {
                    out.push(LazyRun {
                        start: at,
                        end: r.end,
                        offset: r.offset + (at - r.start),
                    });
                    at = r.end;
                }
            }
        }
    }
    *runs = out;
}

/// Profile ranges with each range that continues the one before it merged into it, in order:
/// a profiling restore records the driver's sequential read page by page (one range per fault),
/// and a hot set served range by range is 60 000 copies where 150 will do.
fn coalesce(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in ranges {
        match out.last_mut() {
            Some(last) if last.0 <= s && s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Moves the part of `runs` inside `[from, from + len)` to start at `to` (mremap).
fn remap(runs: &mut Vec<LazyRun>, from: u64, to: u64, len: u64) {
    let moved: Vec<LazyRun> = runs
        .iter()
        .filter(|r| r.end > from && r.start < from + len)
        .map(|r| {
            let (s, e) = (r.start.max(from), r.end.min(from + len));
            LazyRun {
                start: s - from + to,
                end: e - from + to,
                offset: r.offset + (s - r.start),
            }
        })
        .collect();
    cut(runs, from, from + len);
    runs.extend(moved);
    runs.sort_unstable_by_key(|r| r.start);
}

fn ioctl<T>(fd: RawFd, request: u64, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: `arg` is the struct the request takes, alive for the call.
    let rc = unsafe { libc::ioctl(fd, request as _, arg as *mut T) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// One `UFFDIO_COPY` of `src` to `dst`. The kernel refuses the whole range when one page of it is
/// there already (EEXIST: a fault raced us) or when it is no longer inside one registered VMA
/// (ENOENT: an mprotect split its VMA, which sends no event, or the task unmapped part of it
/// before the server read that event); the range is then copied page by page, and a page
/// outside every registered VMA is skipped (the task can never fault on it through this uffd).
/// Only ESRCH, the task's memory gone, makes the task gone: taking ENOENT for it left the
/// task's later faults unserved, a worker hung in its profiling restore on the H200 (session 47).
fn uffd_copy(fd: RawFd, dst: u64, src: &[u8]) -> std::io::Result<Copied> {
    let len = src.len() as u64;
    let mut arg = UffdioCopy {
        dst,
        src: src.as_ptr() as u64,
        len,
        mode: 0,
        copy: 0,
    };
    match ioctl(fd, UFFDIO_COPY, &mut arg) {
        Ok(()) => Ok(Copied::Done),
        Err(e) => match e.raw_os_error() {
            Some(libc::EEXIST | libc::ENOENT) if len > PAGE_SIZE => {
                for (i, page) in src.chunks(PAGE_SIZE as usize).enumerate() {
                    match uffd_copy(fd, dst + i as u64 * PAGE_SIZE, page)? {
                        Copied::Done => {}
                        other => return Ok(other),
                    }
                }
                Ok(Copied::Done)
            }
            Some(libc::EEXIST | libc::ENOENT) => Ok(Copied::Done),
            Some(libc::EAGAIN) => Ok(Copied::Again),
            Some(libc::ESRCH) => Ok(Copied::Gone),
            _ => Err(e),
        },
    }
}

/// One piece of the hot set or of a background batch: `[start, end)` of task `t`, inside one
/// run, at `from` in its pages file.
struct Piece {
    t: usize,
    start: u64,
    end: u64,
    from: u64,
}

/// Threads that copy the hot set. The kernel's `UFFDIO_COPY` takes the target's memory map
/// lock for reading (or a per-VMA lock), so copies into one process run side by side; the
/// driver's residue is ~60 000 one-page runs, one ioctl each: one thread spent 0.23 s on
/// GPT-2-Large's 500 MiB hot set on the H100, four 0.07 s (still 0.07–0.13 s once CRIU's own
/// part shrank to 0.15 s, session 15), so eight where the machine has the cores.
const HOT_THREADS: usize = 8;

struct Server {
    maps: Vec<memmap2::Mmap>,
    tasks: Vec<Task>,
    stats: Stats,
    profile: Vec<(u64, u64)>,
    /// Faults are recorded once CRIU's restore finished (before, they are CRIU's restorer's).
    recording: bool,
    last_fault: Instant,
    fault_budget: Option<u64>,
    /// Threads of the background copy (at most the machine's cores); 1: serial.
    background_threads: usize,
    /// Where each uffd goes to be kept open ([`HOLD_FD`]).
    hold: Option<UnixStream>,
    /// Faults not served yet: (task, page), see [`Server::retry_unserved`].
    unserved: Vec<(usize, u64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copied {
    Done,
    Gone,
    Again,
}

impl Server {
    /// Copies `[start, end)` (inside one run of task `t`) into the task.
    fn copy(&mut self, t: usize, start: u64, end: u64) -> Result<Copied, PageServerError> {
        let task = &self.tasks[t];
        let Some(run) = run_at(&task.runs, start).map(|i| task.runs[i]) else {
            return Ok(Copied::Done);
        };
        let end = end.min(run.end);
        let map = &self.maps[task.pages];
        let from = (run.offset + (start - run.start)) as usize;
        let src = map
            .get(from..from + (end - start) as usize)
            .ok_or_else(|| PageServerError::Copy {
                pid: task.pid,
                at: start,
                len: end - start,
                source: std::io::Error::other("the pages image is shorter than its pagemap says"),
            })?;
        match uffd_copy(task.uffd.as_raw_fd(), start, src) {
            Ok(Copied::Done) => {}
            Ok(Copied::Again) => return Ok(Copied::Again),
            Ok(Copied::Gone) => {
                self.tasks[t].gone = true;
                return Ok(Copied::Gone);
            }
            Err(source) => {
                return Err(PageServerError::Copy {
                    pid: task.pid,
                    at: start,
                    len: end - start,
                    source,
                })
            }
        }
        cut(&mut self.tasks[t].runs, start, end);
        Ok(Copied::Done)
    }

    /// Copies every lazy page of `[start, end)` into task `t`, run by run (one `UFFDIO_COPY`
    /// each: a copy may not cross a VMA), and returns the bytes copied; `record` appends each
    /// copied piece to the profile. Stops early when the task is gone or its memory is changing.
    fn copy_span(
        &mut self,
        t: usize,
        start: u64,
        end: u64,
        record: bool,
    ) -> Result<u64, PageServerError> {
        let mut copied = 0;
        let mut at = start;
        while at < end && !self.tasks[t].gone {
            let runs = &self.tasks[t].runs;
            let i = runs.partition_point(|r| r.end <= at);
            let Some(r) = runs.get(i).copied().filter(|r| r.start < end) else {
                break;
            };
            let (cs, mut ce) = (r.start.max(at), r.end.min(end));
            // The fault switch stops at exactly its page count: a copy is cut to what is left
            // of it, so that one large copy (a hot-set range can span a whole heap) cannot
            // carry the server past the switch and serve every page after all.
            // (The counters take this span's pages only when it returns: count them here.)
            if let Some(budget) = self.fault_budget {
                let done = self.stats.fault_pages
                    + self.stats.hot_pages
                    + self.stats.background_pages
                    + copied / PAGE_SIZE;
                if done >= budget {
                    return Err(PageServerError::Fault { pages: done });
                }
                ce = ce.min(cs + (budget - done) * PAGE_SIZE);
            }
            match self.copy(t, cs, ce)? {
                Copied::Done => {
                    copied += ce - cs;
                    if record {
                        self.profile.push((cs, ce));
                    }
                }
                Copied::Gone | Copied::Again => break,
            }
            at = ce;
        }
        Ok(copied)
    }

    /// Serves one fault at `addr` of task `t`; one the kernel would not take yet waits in
    /// [`Server::unserved`] for [`Server::retry_unserved`].
    fn fault(&mut self, t: usize, addr: u64) -> Result<(), PageServerError> {
        let page = addr & !(PAGE_SIZE - 1);
        self.stats.faults += 1;
        if !self.serve_fault(t, page)? {
            self.unserved.push((t, page));
        }
        Ok(())
    }

    /// Faults whose copy the kernel refused (EAGAIN: an event of the task's memory map waits to
    /// be read, the very next message on its uffd maybe), served again once the events read so
    /// far are handled. Before session 47 such a fault was dropped: its thread waited for the
    /// background copy, or for ever where there is none (a deploy's profiling restore: GPU
    /// workers whose Python threads gave memory back meanwhile hung there on the H200).
    fn retry_unserved(&mut self) -> Result<(), PageServerError> {
        for (t, page) in std::mem::take(&mut self.unserved) {
            if !self.tasks[t].gone && !self.serve_fault(t, page)? {
                self.unserved.push((t, page));
            }
        }
        Ok(())
    }

    /// Serves the fault at `page` of task `t`: its run around it copied, or a zero page, or a
    /// wake. Whether it was (false: the kernel refused for now, try again).
    fn serve_fault(&mut self, t: usize, page: u64) -> Result<bool, PageServerError> {
        if run_at(&self.tasks[t].runs, page).is_some() {
            let recording = self.recording;
            let copied = self.copy_span(t, page, page + FAULT_RUN, recording)?;
            self.stats.fault_pages += copied / PAGE_SIZE;
            self.last_fault = Instant::now();
            // The faulting page is still lazy only when its copy was refused (the task gone
            // needs nothing more).
            return Ok(self.tasks[t].gone || run_at(&self.tasks[t].runs, page).is_none());
        }
        // Not in the image (a hole, or memory the task unmapped and mapped again): zeros, or
        // a wake when the page arrived meanwhile.
        let fd = self.tasks[t].uffd.as_raw_fd();
        let mut z = UffdioZeropage {
            start: page,
            len: PAGE_SIZE,
            mode: 0,
            zeropage: 0,
        };
        match ioctl(fd, UFFDIO_ZEROPAGE, &mut z) {
            Ok(()) => self.stats.zero_pages += 1,
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let mut r = UffdioRange {
                    start: page,
                    len: PAGE_SIZE,
                };
                let _ = ioctl(fd, UFFDIO_WAKE, &mut r);
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                self.tasks[t].gone = true;
            }
            // ENOENT: no registered VMA there any more (uffd_copy says why): nothing to serve.
            Err(_) => {}
        }
        Ok(true)
    }

    /// Reads and handles every pending event of task `t`.
    fn events(&mut self, t: usize) -> Result<(), PageServerError> {
        loop {
            let mut msg = [0u8; 32];
            // SAFETY: reading into our own buffer of its size.
            let n = unsafe {
                libc::read(
                    self.tasks[t].uffd.as_raw_fd(),
                    msg.as_mut_ptr().cast(),
                    msg.len(),
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    return Ok(());
                }
                self.tasks[t].gone = true;
                return Ok(());
            }
            if n == 0 {
                self.tasks[t].gone = true;
                return Ok(());
            }
            let u64_at =
                |at: usize| u64::from_ne_bytes(msg[at..at + 8].try_into().unwrap_or([0; 8]));
            match msg[0] {
                UFFD_EVENT_PAGEFAULT => self.fault(t, u64_at(16))?,
                UFFD_EVENT_FORK => {
                    let ufd = u32::from_ne_bytes(msg[8..12].try_into().unwrap_or([0; 4])) as RawFd;
                    // SAFETY: the kernel made this descriptor for us with the event.
                    let uffd = unsafe { OwnedFd::from_raw_fd(ufd) };
                    set_nonblocking(uffd.as_raw_fd());
                    self.hold(&uffd)?;
                    let parent = &self.tasks[t];
                    let child = Task {
                        pid: parent.pid,
                        uffd,
                        pages: parent.pages,
                        runs: parent.runs.clone(),
                        gone: false,
                    };
                    self.tasks.push(child);
                    self.stats.forks += 1;
                }
                UFFD_EVENT_REMAP => {
                    remap(&mut self.tasks[t].runs, u64_at(8), u64_at(16), u64_at(24))
                }
                UFFD_EVENT_REMOVE | UFFD_EVENT_UNMAP => {
                    cut(&mut self.tasks[t].runs, u64_at(8), u64_at(16))
                }
                _ => {}
            }
        }
    }

    /// Hands a copy of `uffd` to the restoring process to keep ([`HOLD_FD`]).
    fn hold(&self, uffd: &OwnedFd) -> Result<(), PageServerError> {
        match &self.hold {
            Some(sock) => send_fd(sock, uffd.as_raw_fd())
                .map_err(io("handing a userfaultfd to the restoring process")),
            None => Ok(()),
        }
    }

    /// Without a background copy nothing tells the server that a task exited (a uffd signals
    /// no exit; CRIU's daemon, too, learns it from a copy failing with ESRCH). So, when idle,
    /// each task with pages left is probed: `UFFDIO_ZEROPAGE` of [`PROBE_ADDR`] fails with ESRCH
    /// once its memory is gone, else with ENOENT (nothing registered there) or EEXIST. Where
    /// that page is registered and missing, it gets the zero page a fault there would get (it
    /// is in none of the task's runs: a page outside the image).
    fn probe(&mut self) {
        for t in self
            .tasks
            .iter_mut()
            .filter(|t| !t.gone && !t.runs.is_empty())
        {
            if run_at(&t.runs, PROBE_ADDR).is_some() {
                continue;
            }
            let mut z = UffdioZeropage {
                start: PROBE_ADDR,
                len: PAGE_SIZE,
                mode: 0,
                zeropage: 0,
            };
            if let Err(e) = ioctl(t.uffd.as_raw_fd(), UFFDIO_ZEROPAGE, &mut z) {
                if e.raw_os_error() == Some(libc::ESRCH) {
                    t.gone = true;
                }
            }
        }
    }

    fn live(&self) -> bool {
        self.tasks.iter().any(|t| !t.gone && !t.runs.is_empty())
    }

    /// The next background step: a batch on [`Server::background_threads`] threads, or one
    /// serial copy.
    fn background(&mut self) -> Result<(), PageServerError> {
        if self.fault_budget.is_some() || self.background_threads <= 1 {
            return self.background_serial();
        }
        let pieces = self.next_batch();
        let outcomes = self.copy_pieces(&pieces, self.background_threads);
        let copied = self.settle(&pieces, outcomes)?;
        self.stats.background_pages += copied / PAGE_SIZE;
        self.stats.background_batches += 1;
        Ok(())
    }

    /// The next [`BACKGROUND_BATCH`] still lazy, in address order, task by task, in pieces of
    /// at most [`BACKGROUND_RUN`]. A piece that answered `Again` last time is in it again: the
    /// main loop runs a batch only when no event is pending, and `Again` means one is (the
    /// kernel refuses copies while a fork, mremap or munmap event waits to be read), so it is
    /// read before the next batch, as on the serial path.
    fn next_batch(&self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut left = BACKGROUND_BATCH;
        for (t, task) in self.tasks.iter().enumerate().filter(|(_, t)| !t.gone) {
            for r in &task.runs {
                let mut start = r.start;
                while start < r.end {
                    if left == 0 {
                        return pieces;
                    }
                    let end = r.end.min(start + BACKGROUND_RUN.min(left));
                    pieces.push(Piece {
                        t,
                        start,
                        end,
                        from: r.offset + (start - r.start),
                    });
                    left -= end - start;
                    start = end;
                }
            }
        }
        pieces
    }

    /// One serial background copy: the first task with pages left, its lowest run.
    fn background_serial(&mut self) -> Result<(), PageServerError> {
        let Some(t) = self
            .tasks
            .iter()
            .position(|t| !t.gone && !t.runs.is_empty())
        else {
            return Ok(());
        };
        let start = self.tasks[t].runs[0].start;
        let copied = self.copy_span(t, start, start + BACKGROUND_RUN, false)?;
        self.stats.background_pages += copied / PAGE_SIZE;
        Ok(())
    }

    /// The hot set: each profiled range still lazy, in every task, in profile order.
    fn hot(&mut self, ranges: &[(u64, u64)]) -> Result<(), PageServerError> {
        if self.fault_budget.is_some() {
            // The fault switch counts pages copy by copy: keep the serial path for it.
            for &(s, e) in ranges {
                for t in 0..self.tasks.len() {
                    let copied = self.copy_span(t, s, e, false)?;
                    self.stats.hot_pages += copied / PAGE_SIZE;
                }
            }
            return Ok(());
        }
        let mut pieces = Vec::new();
        for &(s, e) in ranges {
            for (t, task) in self.tasks.iter().enumerate().filter(|(_, t)| !t.gone) {
                let first = task.runs.partition_point(|r| r.end <= s);
                for r in task.runs[first..].iter().take_while(|r| r.start < e) {
                    let (start, end) = (r.start.max(s), r.end.min(e));
                    let from = r.offset + (start - r.start);
                    pieces.push(Piece {
                        t,
                        start,
                        end,
                        from,
                    });
                }
            }
        }
        let outcomes = self.copy_pieces(&pieces, HOT_THREADS);
        let copied = self.settle(&pieces, outcomes)?;
        self.stats.hot_pages += copied / PAGE_SIZE;
        Ok(())
    }

    /// Takes the outcomes of [`Server::copy_pieces`]: what was copied leaves its task's runs,
    /// a task gone is marked so, a piece that answered `Again` stays lazy (a fault or the
    /// background copy takes it); returns the bytes copied. An error is the first piece's that
    /// failed.
    fn settle(
        &mut self,
        pieces: &[Piece],
        outcomes: Vec<std::io::Result<Copied>>,
    ) -> Result<u64, PageServerError> {
        let mut done: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.tasks.len()];
        let mut copied = 0;
        let mut failed = None;
        for (p, outcome) in pieces.iter().zip(outcomes) {
            match outcome {
                Ok(Copied::Done) => {
                    done[p.t].push((p.start, p.end));
                    copied += p.end - p.start;
                }
                Ok(Copied::Again) => {}
                Ok(Copied::Gone) => self.tasks[p.t].gone = true,
                Err(source) => {
                    failed = Some(PageServerError::Copy {
                        pid: self.tasks[p.t].pid,
                        at: p.start,
                        len: p.end - p.start,
                        source,
                    });
                    break;
                }
            }
        }
        for (task, mut done) in self.tasks.iter_mut().zip(done) {
            cut_many(&mut task.runs, &mut done);
        }
        failed.map_or(Ok(copied), Err)
    }

    /// Copies `pieces` on up to `threads` threads (at most the machine's cores), each a
    /// contiguous share of about the same bytes (so each reads its part of the image in
    /// order); one outcome per piece.
    fn copy_pieces(&self, pieces: &[Piece], threads: usize) -> Vec<std::io::Result<Copied>> {
        let total: u64 = pieces.iter().map(|p| p.end - p.start).sum();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, threads.max(1));
        let share = total.div_ceil(threads as u64).max(1);
        let mut groups: Vec<&[Piece]> = Vec::new();
        let (mut begin, mut bytes) = (0, 0);
        for (i, p) in pieces.iter().enumerate() {
            bytes += p.end - p.start;
            if bytes >= share {
                groups.push(&pieces[begin..=i]);
                (begin, bytes) = (i + 1, 0);
            }
        }
        groups.push(&pieces[begin..]);
        let one = |p: &Piece| -> std::io::Result<Copied> {
            let task = &self.tasks[p.t];
            let src = self.maps[task.pages]
                .get(p.from as usize..(p.from + p.end - p.start) as usize)
                .ok_or_else(|| {
                    std::io::Error::other("the pages image is shorter than its pagemap says")
                })?;
            uffd_copy(task.uffd.as_raw_fd(), p.start, src)
        };
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .iter()
                .map(|g| scope.spawn(move || g.iter().map(one).collect::<Vec<_>>()))
                .collect();
            handles
                .into_iter()
                .zip(&groups)
                .flat_map(|(h, g)| {
                    h.join().unwrap_or_else(|_| {
                        g.iter()
                            .map(|_| Err(std::io::Error::other("a copy thread panicked")))
                            .collect()
                    })
                })
                .collect()
        })
    }
}

fn set_nonblocking(fd: RawFd) {
    // SAFETY: flags of a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

/// Receives one descriptor (SCM_RIGHTS) on `sock`.
fn recv_fd(sock: &UnixStream) -> std::io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u8; 64];
    // SAFETY: msghdr over our own buffers, read back only as the kernel filled them.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        if libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(std::io::Error::other("no descriptor came with the message"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Sends `fd` (SCM_RIGHTS) on `sock`, with one byte.
fn send_fd(sock: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE of one descriptor, computed by libc.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr over our own buffers; the one control message is laid out with libc's
    // CMSG macros inside `control`, which is CMSG_SPACE bytes long.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        if libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A value of [`BACKGROUND_THREADS_ENV`]: 1 to [`MAX_BACKGROUND_THREADS`].
pub fn parse_background_threads(value: &str) -> Option<usize> {
    value
        .trim()
        .parse()
        .ok()
        .filter(|n| (1..=MAX_BACKGROUND_THREADS).contains(n))
}

fn read_profile(path: &Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .ok()
        .map(|t| {
            t.lines()
                .filter_map(|l| {
                    let (a, b) = l.split_once(' ')?;
                    Some((
                        u64::from_str_radix(a.trim_start_matches("0x"), 16).ok()?,
                        u64::from_str_radix(b.trim().trim_start_matches("0x"), 16).ok()?,
                    ))
                })
                .collect::<Vec<_>>()
        })
        .map(coalesce)
        .unwrap_or_default()
}

/// Serves one restore's lazy pages; see the module doc.
pub fn serve(
    images_dir: &Path,
    work_dir: &Path,
    hold: Option<UnixStream>,
) -> Result<Stats, PageServerError> {
    // Absolute before the chdir below.
    let images_dir = &std::path::absolute(images_dir).map_err(io("the images directory"))?;
    let work_dir = &std::path::absolute(work_dir).map_err(io("the work directory"))?;
    let env_path = |name: &str| std::env::var_os(name).and_then(|p| std::path::absolute(p).ok());
    let (profile_in, profile_out, stats_out) = (
        env_path(PROFILE_IN_ENV),
        env_path(PROFILE_OUT_ENV),
        env_path(STATS_ENV),
    );
    // The test's fault switch: a number of pages after which to stop, or `hot-set`.
    let fault = std::env::var("TORPOR_PAGE_SERVER_FAULT").ok();
    let hot_set_fault = fault.as_deref() == Some("hot-set");
    let batch_pause =
        (fault.as_deref() == Some("slow-background")).then_some(SLOW_BACKGROUND_PAUSE);
    let mut last_batch: Option<Instant> = None;
    let background_on = std::env::var_os(BACKGROUND_ENV).is_none_or(|v| v != "off");
    let background_threads = match std::env::var(BACKGROUND_THREADS_ENV) {
        Err(_) => DEFAULT_BACKGROUND_THREADS,
        Ok(v) => parse_background_threads(&v).ok_or(PageServerError::BackgroundThreads(v))?,
    };
    // More threads than cores only take turns; one core: the serial copy, 4 MiB per fault turn.
    let background_threads =
        background_threads.min(std::thread::available_parallelism().map_or(1, |n| n.get()));
    // Bound by its name in the work directory, as CRIU connects to it: a full path could pass
    // the 108 bytes a socket address holds.
    std::env::set_current_dir(work_dir).map_err(io(format!("entering {}", work_dir.display())))?;
    let _ = std::fs::remove_file(LAZY_PAGES_SOCKET);
    let listener = UnixListener::bind(LAZY_PAGES_SOCKET).map_err(io(format!(
        "binding {LAZY_PAGES_SOCKET} in {}",
        work_dir.display()
    )))?;
    let pids = images::task_pids(images_dir)?;
    listener
        .set_nonblocking(true)
        .map_err(io("the listening socket"))?;
    let start = Instant::now();
    let (mut conn, _) = loop {
        match listener.accept() {
            Ok(c) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() > ACCEPT_TIMEOUT {
                    return Err(PageServerError::NoRestore);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io("accepting CRIU's connection")(e)),
        }
    };
    conn.set_nonblocking(false)
        .map_err(io("CRIU's connection"))?;
    let mut server = Server {
        maps: Vec::new(),
        tasks: Vec::new(),
        stats: Stats::default(),
        profile: Vec::new(),
        recording: false,
        last_fault: Instant::now(),
        fault_budget: fault.as_deref().and_then(|v| v.parse().ok()),
        background_threads,
        hold,
        unserved: Vec::new(),
    };
    let mut files: HashMap<PathBuf, usize> = HashMap::new();
    for _ in 0..pids.len() {
        let mut pid = [0u8; 4];
        conn.read_exact(&mut pid).map_err(io("CRIU's task pid"))?;
        let pid = i32::from_ne_bytes(pid);
        if pid < 0 {
            continue; // a zombie: no memory
        }
        let uffd = recv_fd(&conn).map_err(io(format!("the userfaultfd of pid {pid}")))?;
        set_nonblocking(uffd.as_raw_fd());
        server.hold(&uffd)?;
        let lazy = images::lazy_pages(images_dir, pid)?;
        let pages = match files.get(&lazy.pages_file) {
            Some(&i) => i,
            None => {
                let f = std::fs::File::open(&lazy.pages_file)
                    .map_err(io(format!("opening {}", lazy.pages_file.display())))?;
                // SAFETY: a snapshot's image, which nothing writes while it is restored.
                let map = unsafe { memmap2::Mmap::map(&f) }
                    .map_err(io(format!("mapping {}", lazy.pages_file.display())))?;
                server.maps.push(map);
                files.insert(lazy.pages_file.clone(), server.maps.len() - 1);
                server.maps.len() - 1
            }
        };
        server.tasks.push(Task {
            pid,
            uffd,
            pages,
            runs: lazy.runs,
            gone: false,
        });
    }
    server.stats.tasks = server.tasks.len() as u64;
    let hot = profile_in.map(|p| read_profile(&p)).unwrap_or_default();
    let profiling = profile_out.is_some();
    let mut finished = false;
    let mut last_probe = Instant::now();
    conn.set_nonblocking(true)
        .map_err(io("CRIU's connection"))?;
    loop {
        let mut fds: Vec<libc::pollfd> = server
            .tasks
            .iter()
            .map(|t| libc::pollfd {
                fd: if t.gone { -1 } else { t.uffd.as_raw_fd() },
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if !finished {
            fds.push(libc::pollfd {
                fd: conn.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        if finished && !server.live() {
            break;
        }
        // Recording: no background copy until the process went quiet (see PROFILE_QUIET).
        let background = background_on
            && finished
            && server.live()
            && !(profiling && server.last_fault.elapsed() < PROFILE_QUIET)
            && batch_pause.is_none_or(|p| last_batch.is_none_or(|t| t.elapsed() >= p));
        // Unserved faults are tried again at once after the events this turn reads.
        let timeout = if background {
            0
        } else if !server.unserved.is_empty() {
            1
        } else {
            20
        };
        // SAFETY: poll over our own array.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io("poll")(e));
        }
        // CRIU's "finished" first: it is sent before the tasks run, but their first faults can
        // be ready in the same poll, and served before it they would go unrecorded (an idle
        // process faults only then, and its profile came out empty).
        if !finished {
            let p = fds[fds.len() - 1];
            if p.revents != 0 {
                let mut word = [0u8; 4];
                match conn.read(&mut word) {
                    Ok(4) if u32::from_ne_bytes(word) == RESTORE_FINISHED => {
                        if hot_set_fault {
                            std::thread::sleep(HOT_SET_FAULT_DELAY);
                            return Err(PageServerError::FaultHotSet);
                        }
                        finished = true;
                        server.recording = profiling;
                        server.last_fault = Instant::now();
                        std::fs::write(work_dir.join(HOT_BEGUN), b"")
                            .map_err(io("marking the hot set begun"))?;
                        server.hot(&hot)?;
                    }
                    Ok(_) => return Err(PageServerError::RestoreAborted),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => return Err(PageServerError::RestoreAborted),
                }
            }
        }
        for (i, p) in fds.iter().enumerate().take(server.tasks.len()) {
            if p.revents & libc::POLLIN != 0 {
                server.events(i)?;
            } else if p.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                server.tasks[i].gone = true;
            }
        }
        server.retry_unserved()?;
        if background && n == 0 {
            server.background()?;
            last_batch = Some(Instant::now());
        }
        if !background_on && finished && n == 0 && last_probe.elapsed() >= PROBE_EVERY {
            server.probe();
            last_probe = Instant::now();
        }
    }
    if let Some(out) = profile_out {
        let mut text = String::new();
        for (s, e) in coalesce(server.profile.iter().copied()) {
            text.push_str(&format!("{s:#x} {e:#x}\n"));
        }
        std::fs::write(&out, text).map_err(io("writing the page profile"))?;
    }
    if let Some(out) = stats_out {
        let s = server.stats;
        let json = format!(
            "{{\"tasks\":{},\"faults\":{},\"fault_pages\":{},\"hot_pages\":{},\"background_pages\":{},\"background_batches\":{},\"zero_pages\":{},\"forks\":{}}}\n",
            s.tasks, s.faults, s.fault_pages, s.hot_pages, s.background_pages, s.background_batches, s.zero_pages, s.forks
        );
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&out)
            .and_then(|mut f| f.write_all(json.as_bytes()));
    }
    Ok(server.stats)
}

/// `__page-server IMAGES_DIR WORK_DIR [--hold-fd=N]`: the exit status is the outcome.
pub fn main(args: &[std::ffi::OsString]) -> i32 {
    let usage = || {
        eprintln!(
            "usage: torpor {SUBCOMMAND} IMAGES_DIR WORK_DIR [{HOLD_FD_ARG}N] (internal to lazy restores)"
        );
        2
    };
    let (images, work, hold) = match args {
        [images, work] => (images, work, None),
        [images, work, hold] => {
            let Some(fd) = hold
                .to_str()
                .and_then(|h| h.strip_prefix(HOLD_FD_ARG))
                .and_then(|n| n.parse::<RawFd>().ok())
                .filter(|&fd| fd == 0 || fd > 2)
            else {
                return usage();
            };
            // SAFETY: the restoring process put its end of a socket pair at this descriptor for
            // us (crate::start_page_server); nothing else in this process owns it.
            let sock = unsafe { UnixStream::from_raw_fd(fd) };
            (images, work, Some(sock))
        }
        _ => return usage(),
    };
    match serve(Path::new(images), Path::new(work), hold) {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("torpor page server: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: u64, end: u64, offset: u64) -> LazyRun {
        LazyRun { start, end, offset }
    }

    /// A userfaultfd of this process with `len` bytes of fresh anonymous memory registered
    /// for missing pages, as CRIU hands the server a restored task's.
    fn registered(len: usize) -> (OwnedFd, memmap2::MmapMut) {
        const UFFDIO_API: u64 = 0xC018_AA3F;
        const UFFDIO_REGISTER: u64 = 0xC020_AA00;
        const UFFD_USER_MODE_ONLY: i32 = 1;
        // SAFETY: a plain syscall; the fd is ours.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
            )
        };
        assert!(fd >= 0, "userfaultfd: {}", std::io::Error::last_os_error());
        // SAFETY: the syscall returned a new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut api = [0xAAu64, 0, 0];
        ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api).expect("UFFDIO_API");
        let memory = memmap2::MmapMut::map_anon(len).expect("anonymous memory");
        let mut register = [memory.as_ptr() as u64, len as u64, 1, 0];
        ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut register).expect("UFFDIO_REGISTER");
        (fd, memory)
    }

    /// A serial server of this process alone: `pages` pages at `start` registered on `uffd`, all
    /// lazy, served from `image`.
    fn one_task_server(
        uffd: OwnedFd,
        image: memmap2::MmapMut,
        start: u64,
        pages: u64,
        fault_budget: Option<u64>,
    ) -> Server {
        Server {
            maps: vec![image.make_read_only().expect("a read-only image")],
            tasks: vec![Task {
                pid: std::process::id() as i32,
                uffd,
                pages: 0,
                runs: vec![run(start, start + pages * PAGE_SIZE, 0)],
                gone: false,
            }],
            stats: Stats::default(),
            profile: Vec::new(),
            recording: false,
            last_fault: Instant::now(),
            fault_budget,
            background_threads: 1,
            hold: None,
            unserved: Vec::new(),
        }
    }

    fn resident_pages(memory: &memmap2::MmapMut) -> Vec<bool> {
        let mut vec = vec![0u8; memory.len() / PAGE_SIZE as usize];
        // SAFETY: `vec` holds one byte per page of the mapping.
        let rc =
            unsafe { libc::mincore(memory.as_ptr() as *mut _, memory.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().map(|b| b & 1 == 1).collect()
    }

    #[test]
    fn the_fault_switch_stops_at_exactly_its_page_count_even_inside_one_large_copy() {
        const PAGES: u64 = 64;
        const BUDGET: u64 = 10;
        let len = (PAGES * PAGE_SIZE) as usize;
        let (uffd, memory) = registered(len);
        let mut image = memmap2::MmapMut::map_anon(len).expect("the image");
        image.fill(0x5A);
        let start = memory.as_ptr() as u64;
        let mut server = one_task_server(uffd, image, start, PAGES, Some(BUDGET));
        // One span of 64 pages in one run: before, a single copy of all of it went through.
        match server.copy_span(0, start, start + PAGES * PAGE_SIZE, false) {
            Err(PageServerError::Fault { pages }) => assert_eq!(pages, BUDGET),
            other => panic!("the switch did not stop the span: {other:?}"),
        }
        let resident = resident_pages(&memory);
        assert!(
            resident[..BUDGET as usize].iter().all(|&r| r),
            "{resident:?}"
        );
        assert!(
            resident[BUDGET as usize..].iter().all(|&r| !r),
            "{resident:?}"
        );
        assert_eq!(
            memory[..(BUDGET * PAGE_SIZE) as usize]
                .iter()
                .filter(|&&b| b != 0x5A)
                .count(),
            0
        );
    }

    #[test]
    fn a_run_across_an_mprotect_split_is_copied_page_by_page_and_the_task_stays() {
        const PAGES: u64 = 16;
        let len = (PAGES * PAGE_SIZE) as usize;
        let (uffd, memory) = registered(len);
        let mut image = memmap2::MmapMut::map_anon(len).expect("the image");
        for (i, page) in image.chunks_mut(PAGE_SIZE as usize).enumerate() {
            page.fill(i as u8 + 1);
        }
        let start = memory.as_ptr() as u64;
        // Pages 5 and 6 read-only: the registered VMA splits in three, and one UFFDIO_COPY of
        // the whole run is refused with ENOENT.
        // SAFETY: inside our own mapping.
        let rc = unsafe {
            libc::mprotect(
                (start + 5 * PAGE_SIZE) as *mut _,
                2 * PAGE_SIZE as usize,
                libc::PROT_READ,
            )
        };
        assert_eq!(rc, 0, "mprotect: {}", std::io::Error::last_os_error());
        let mut server = one_task_server(uffd, image, start, PAGES, None);
        let copied = server
            .copy_span(0, start, start + PAGES * PAGE_SIZE, false)
            .expect("the span");
        assert_eq!(copied, PAGES * PAGE_SIZE);
        assert!(!server.tasks[0].gone, "ENOENT taken for the task's end");
        assert!(
            server.tasks[0].runs.is_empty(),
            "{:?}",
            server.tasks[0].runs
        );
        assert!(resident_pages(&memory).iter().all(|&r| r));
        for (i, page) in memory.chunks(PAGE_SIZE as usize).enumerate() {
            assert!(page.iter().all(|&b| b == i as u8 + 1), "page {i}");
        }
    }

    #[test]
    fn a_cut_splits_runs_and_keeps_their_offsets() {
        let mut runs = vec![run(0x1000, 0x5000, 0), run(0x8000, 0x9000, 0x4000)];
        cut(&mut runs, 0x2000, 0x3000);
        assert_eq!(
            runs,
            vec![
                run(0x1000, 0x2000, 0),
                run(0x3000, 0x5000, 0x2000),
                run(0x8000, 0x9000, 0x4000)
            ]
        );
        cut(&mut runs, 0, 0x10000);
        assert!(runs.is_empty());
    }

    #[test]
    fn a_cut_inside_one_run_keeps_both_ends_and_the_order() {
        let mut runs: Vec<LazyRun> = (0..4u64)
            .map(|i| run(0x1000 * (2 * i + 1), 0x1000 * (2 * i + 2), 0x1000 * i))
            .collect();
        cut(&mut runs, 0x3000, 0x6000);
        assert_eq!(
            runs,
            vec![run(0x1000, 0x2000, 0), run(0x7000, 0x8000, 0x3000)]
        );
        let mut one = vec![run(0x1000, 0x9000, 0)];
        cut(&mut one, 0x4000, 0x5000);
        assert_eq!(
            one,
            vec![run(0x1000, 0x4000, 0), run(0x5000, 0x9000, 0x4000)]
        );
        cut(&mut one, 0x9000, 0xa000);
        assert_eq!(one.len(), 2, "a range past every run cuts nothing");
    }

    #[test]
    fn cutting_many_ranges_at_once_leaves_what_cutting_them_one_by_one_does() {
        // A small linear congruential generator: the same cases every run.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        for _ in 0..500 {
            let mut runs = Vec::new();
            let mut at = next(4) * 0x1000;
            for i in 0..next(12) {
                let len = (1 + next(6)) * 0x1000;
                runs.push(run(at, at + len, i * 0x10_0000));
                at += len + next(3) * 0x1000;
            }
            let mut done: Vec<(u64, u64)> = (0..next(10))
                .map(|_| {
                    let s = next(80) * 0x1000;
                    (s, s + (1 + next(8)) * 0x1000)
                })
                .collect();
            let mut one_by_one = runs.clone();
            for &(s, e) in &done {
                cut(&mut one_by_one, s, e);
            }
            cut_many(&mut runs, &mut done);
            assert_eq!(runs, one_by_one, "cuts {done:x?}");
        }
    }

    #[test]
    fn a_run_is_found_by_any_address_inside_it_only() {
        let runs = vec![run(0x1000, 0x3000, 0), run(0x5000, 0x6000, 0x2000)];
        assert_eq!(run_at(&runs, 0x1000), Some(0));
        assert_eq!(run_at(&runs, 0x2fff), Some(0));
        assert_eq!(run_at(&runs, 0x3000), None);
        assert_eq!(run_at(&runs, 0x5000), Some(1));
        assert_eq!(run_at(&runs, 0x0), None);
        assert_eq!(run_at(&runs, 0x6000), None);
    }

    #[test]
    fn a_profile_recorded_page_by_page_coalesces_in_order() {
        let pages = (0..1000u64).map(|i| (0x10_0000 + i * 0x1000, 0x10_1000 + i * 0x1000));
        let low = (0x1000, 0x3000);
        let merged = coalesce(pages.chain([low, (0x2000, 0x4000), (0x9000, 0xa000)]));
        assert_eq!(
            merged,
            vec![
                (0x10_0000, 0x10_0000 + 1000 * 0x1000),
                (0x1000, 0x4000),
                (0x9000, 0xa000)
            ],
            "adjacent and overlapping ranges merge; a range before the last one stays in its place"
        );
    }

    #[test]
    fn a_remap_moves_what_is_left_with_its_image_offset() {
        let mut runs = vec![run(0x1000, 0x3000, 0x10000)];
        remap(&mut runs, 0x2000, 0x7000, 0x1000);
        assert_eq!(
            runs,
            vec![run(0x1000, 0x2000, 0x10000), run(0x7000, 0x8000, 0x11000)]
        );
    }
}
