//! The hook's segment table and C API on the host (memfd) backend, in real processes: the test
//! binary re-runs itself as a child (only `child_process_entry`, with the scenario and a socket
//! path in the environment), so each scenario has a hook of its own, as a worker would, and the
//! test process plays the daemon across a Unix socket with real fds.

use std::ffi::CStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use torpor_device::fd_passing::{recv_fd, send_fd};
use torpor_device::host::HostDevice;
use torpor_device::{Access, Device};
use torpor_hook::capi::{self, TorporHookSegment};

const SCENARIO_ENV: &str = "TORPOR_HOOK_TEST_SCENARIO";
const SOCKET_ENV: &str = "TORPOR_HOOK_TEST_SOCKET";

fn page() -> usize {
    HostDevice::new().granularity()
}

/// `len` bytes that differ for each `seed`.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

fn last_error() -> String {
    // SAFETY: the hook returns a NUL-terminated string valid until this thread's next failure.
    unsafe { CStr::from_ptr(capi::torpor_hook_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn list() -> Vec<TorporHookSegment> {
    let mut out = vec![TorporHookSegment::default(); 64];
    // SAFETY: `out` holds 64 entries.
    let n = unsafe { capi::torpor_hook_list(out.as_mut_ptr(), out.len()) };
    out.truncate(n);
    out
}

fn host_alloc(size: usize) -> u64 {
    let mut va = 0;
    // SAFETY: `va` is a valid out pointer.
    let rc = unsafe { capi::torpor_hook_host_alloc(size, &mut va) };
    assert_eq!(rc, 0, "host_alloc({size}): {}", last_error());
    va
}

fn release_all() -> u64 {
    let mut bytes = 0;
    // SAFETY: `bytes` is a valid out pointer.
    let rc = unsafe { capi::torpor_hook_release_all(&mut bytes) };
    assert_eq!(rc, 0, "release_all: {}", last_error());
    bytes
}

/// # Safety
/// `va..va+len` is mapped readable in this process.
unsafe fn read(va: u64, len: usize) -> Vec<u8> {
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts(va as *const u8, len) }.to_vec()
}

/// # Safety
/// `va..va+bytes.len()` is mapped writable in this process.
unsafe fn write(va: u64, bytes: &[u8]) {
    // SAFETY: per the contract.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), va as *mut u8, bytes.len()) };
}

/// The protection `/proc/self/maps` shows for the mapping that starts at `va`.
fn protection(va: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| l.starts_with(&format!("{va:x}-")))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("unmapped")
        .to_owned()
}

/// A memfd made by this (the "daemon") process: `len` bytes of `pattern(len, seed)`, sealed
/// read-only when asked.
fn daemon_memory(len: usize, seed: u64, sealed: bool) -> (HostDevice, OwnedFd) {
    let device = HostDevice::new();
    let memory = device.create(len).unwrap();
    let at = device.reserve(len, None).unwrap();
    device.map(&memory, at, Access::ReadWrite).unwrap();
    device.copy_to_device(at, &pattern(len, seed)).unwrap();
    device.unmap(at, len).unwrap();
    device.free_reservation(at, len).unwrap();
    if sealed {
        device.seal_read_only(&memory).unwrap();
    }
    let fd = device.export(&memory).unwrap();
    (device, fd)
}

/// Maps `fd` shared, for the test to look at what a process exported.
struct View {
    ptr: *mut u8,
    len: usize,
}

impl View {
    fn new(fd: &OwnedFd, len: usize) -> View {
        // SAFETY: a new shared mapping wherever the kernel chooses; unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        View {
            ptr: ptr.cast(),
            len,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        // SAFETY: the mapping is live and `len` bytes long.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// ---- child side -------------------------------------------------------------------------------

/// Not a test of its own: the entry point of the child processes. Without the scenario
/// variable it does nothing.
#[test]
fn child_process_entry() {
    let (Ok(scenario), Ok(socket)) = (std::env::var(SCENARIO_ENV), std::env::var(SOCKET_ENV))
    else {
        return;
    };
    let conn = UnixStream::connect(socket).unwrap();
    match scenario.as_str() {
        "release_and_map" => child_release_and_map(conn),
        "read_only" => child_read_only(conn),
        other => panic!("unknown scenario {other}"),
    }
    std::process::exit(0);
}

fn send_line(conn: &mut UnixStream, line: &str) {
    conn.write_all(format!("{line}\n").as_bytes()).unwrap();
}

fn recv_header(conn: &UnixStream) -> (OwnedFd, u64, u64) {
    let mut header = [0u8; 16];
    let fd = recv_fd(conn, &mut header).unwrap();
    let a = u64::from_le_bytes(header[..8].try_into().unwrap());
    let b = u64::from_le_bytes(header[8..].try_into().unwrap());
    (fd, a, b)
}

fn child_release_and_map(mut conn: UnixStream) {
    let page = page();
    // Two segments; the first's size is rounded up to whole pages.
    let a = host_alloc(3 * page + 1);
    let b = host_alloc(page);
    // SAFETY: both were just mapped read-write, with these sizes.
    unsafe {
        write(a, &pattern(4 * page, 1));
        write(b, &pattern(page, 2));
    }
    // B is used first.
    assert_eq!(capi::torpor_hook_mark_first_use(b + 10), 0);
    assert_eq!(capi::torpor_hook_mark_first_use(a + 4 * page as u64 - 1), 0);
    assert_eq!(capi::torpor_hook_mark_first_use(a), 0);
    let segments = list();
    assert_eq!(segments.len(), 2);
    let expected = [(a, 4 * page, 0, 1), (b, page, 1, 0)];
    for (s, (va, size, order, first_use)) in segments.iter().zip(expected) {
        assert_eq!(
            (s.va, s.size, s.order, s.first_use),
            (va, size as u64, order, first_use)
        );
        assert_eq!((s.backend, s.ordinal, s.mapped, s.read_only), (0, -1, 1, 0));
    }

    // Export each segment's memory to the daemon.
    for s in &segments {
        let fd = capi::torpor_hook_export(s.va);
        assert!(fd >= 0, "export: {}", last_error());
        // SAFETY: the hook returned a new descriptor this process owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let mut header = s.va.to_le_bytes().to_vec();
        header.extend_from_slice(&s.size.to_le_bytes());
        send_fd(&conn, fd.as_fd(), &header).unwrap();
    }

    // Release: the memory goes, the addresses stay reserved (inaccessible).
    assert_eq!(release_all(), 5 * page as u64);
    assert!(list().iter().all(|s| s.mapped == 0));
    assert_eq!(
        protection(a),
        "---p",
        "the released segment's addresses are not reserved"
    );
    assert_eq!(capi::torpor_hook_export(a), -1);
    assert!(
        last_error().contains("has been released"),
        "{}",
        last_error()
    );
    // Released twice is nothing to release.
    assert_eq!(release_all(), 0);
    send_line(&mut conn, "released");

    // The daemon's fresh memory, mapped at the same addresses.
    for _ in 0..2 {
        let (fd, va, seed) = recv_header(&conn);
        assert_eq!(
            capi::torpor_hook_map(va, fd.as_raw_fd(), 0),
            0,
            "map: {}",
            last_error()
        );
        drop(fd);
        let size = list().iter().find(|s| s.va == va).unwrap().size as usize;
        // SAFETY: mapped just now, read-write, `size` bytes.
        let bytes = unsafe { read(va, size) };
        assert!(bytes == pattern(size, seed), "wrong bytes at {va:#x}");
    }
    assert!(list().iter().all(|s| s.mapped == 1 && s.read_only == 0));
    assert_eq!(protection(a), "rw-s");
    // A write here is seen by the daemon: it is one physical copy.
    // SAFETY: mapped read-write.
    unsafe { write(a, b"written by the worker") };
    send_line(&mut conn, "mapped");
    let mut rest = Vec::new();
    conn.read_to_end(&mut rest).unwrap();

    assert_eq!(capi::torpor_hook_host_free(a), 0, "{}", last_error());
    assert_eq!(capi::torpor_hook_host_free(b), 0, "{}", last_error());
    assert!(list().is_empty());
    assert_eq!(
        protection(a),
        "unmapped",
        "a freed segment keeps its addresses"
    );
}

fn child_read_only(mut conn: UnixStream) {
    let page = page();
    let va = host_alloc(2 * page);
    release_all();
    let mut header = va.to_le_bytes().to_vec();
    header.extend_from_slice(&(2 * page as u64).to_le_bytes());
    conn.write_all(&header).unwrap();
    let (fd, _, _) = recv_header(&conn);
    // Sealed memory cannot be mapped writable …
    assert_eq!(capi::torpor_hook_map(va, fd.as_raw_fd(), 0), -1);
    assert!(
        last_error().contains("sealed read-only"),
        "{}",
        last_error()
    );
    assert_eq!(
        list()[0].mapped,
        0,
        "a failed map leaves the segment released"
    );
    // … read-only it can.
    assert_eq!(
        capi::torpor_hook_map(va, fd.as_raw_fd(), 1),
        0,
        "{}",
        last_error()
    );
    assert_eq!((list()[0].mapped, list()[0].read_only), (1, 1));
    // SAFETY: mapped read-only, 2 pages.
    assert!(unsafe { read(va, 2 * page) } == pattern(2 * page, 7));
    send_line(&mut conn, "mapped read-only");
    // SAFETY: none: this write must fault, and the test checks that it does.
    unsafe { std::ptr::write_volatile((va + 5) as *mut u8, 0xee) };
    send_line(&mut conn, "the write went through");
}

// ---- parent side ------------------------------------------------------------------------------

struct Child {
    process: std::process::Child,
    conn: UnixStream,
    _dir: tempfile::TempDir,
}

impl Child {
    fn start(scenario: &str) -> Child {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("daemon.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let process = Command::new(std::env::current_exe().unwrap())
            .args([
                "child_process_entry",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(SCENARIO_ENV, scenario)
            .env(SOCKET_ENV, &path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let (conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .unwrap();
        Child {
            process,
            conn,
            _dir: dir,
        }
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        BufReader::new(&mut self.conn).read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    }
}

#[test]
fn segments_are_exported_released_and_mapped_back_from_another_process_at_the_same_address() {
    let page = page();
    let mut child = Child::start("release_and_map");
    let mut exported = Vec::new();
    for _ in 0..2 {
        exported.push(recv_header(&child.conn));
    }
    assert_eq!(
        child.line(),
        "released",
        "the child failed before releasing"
    );
    // What the child exported holds what it wrote (the daemon's copy step), even though the
    // child has let go of it.
    let (a_fd, a, a_size) = &exported[0];
    let (b_fd, b, b_size) = &exported[1];
    assert_eq!((*a_size, *b_size), (4 * page as u64, page as u64));
    assert!(View::new(a_fd, 4 * page).bytes() == pattern(4 * page, 1));
    assert!(View::new(b_fd, page).bytes() == pattern(page, 2));

    // Fresh memory made here, with other contents, for the child to map at its addresses.
    let (_da, new_a) = daemon_memory(4 * page, 3, false);
    let (_db, new_b) = daemon_memory(page, 4, false);
    for (fd, va, seed) in [(&new_a, *a, 3u64), (&new_b, *b, 4)] {
        let mut header = va.to_le_bytes().to_vec();
        header.extend_from_slice(&seed.to_le_bytes());
        send_fd(&child.conn, fd.as_fd(), &header).unwrap();
    }
    assert_eq!(
        child.line(),
        "mapped",
        "the child failed to map the daemon's memory"
    );
    let seen = View::new(&new_a, 4 * page).bytes();
    assert_eq!(&seen[..21], b"written by the worker");
    // The old memory is untouched by the write.
    assert!(View::new(a_fd, 4 * page).bytes() == pattern(4 * page, 1));
    child.conn.shutdown(std::net::Shutdown::Both).unwrap();
    let status = child.process.wait().unwrap();
    assert!(status.success(), "the child failed: {status}");
}

#[test]
fn a_sealed_memfd_maps_read_only_and_a_write_through_it_kills_the_writer() {
    let page = page();
    let mut child = Child::start("read_only");
    let mut header = [0u8; 16];
    child.conn.read_exact(&mut header).unwrap();
    let va = u64::from_le_bytes(header[..8].try_into().unwrap());
    let size = u64::from_le_bytes(header[8..].try_into().unwrap()) as usize;
    assert_eq!(size, 2 * page);
    let (_device, fd) = daemon_memory(size, 7, true);
    let mut message = va.to_le_bytes().to_vec();
    message.extend_from_slice(&0u64.to_le_bytes());
    send_fd(&child.conn, fd.as_fd(), &message).unwrap();
    assert_eq!(child.line(), "mapped read-only");
    let status = child.process.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGSEGV),
        "the child should die by SIGSEGV, it ended with {status}"
    );
    // SAFETY: a read-only view of the sealed memfd (a writable one is refused).
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: the mapping just made, `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, size) }.to_vec();
    // SAFETY: the mapping just made.
    unsafe { libc::munmap(ptr, size) };
    assert!(bytes == pattern(size, 7), "the daemon's data changed");
}

/// In this process: the only test here that uses the hook itself (the others run it in children).
#[test]
fn bad_addresses_fds_and_sizes_are_clear_errors_and_sealed_data_stays_read_only() {
    let page = page();
    let mut va = 0;
    // SAFETY: `va` is a valid out pointer.
    assert_eq!(unsafe { capi::torpor_hook_host_alloc(0, &mut va) }, -1);
    assert!(last_error().contains("is 0 bytes"), "{}", last_error());

    let va = host_alloc(page);
    let (_device, other) = daemon_memory(page, 1, false);
    let other_fd = other.as_raw_fd();
    type Call<'a> = Box<dyn Fn() -> i32 + 'a>;
    let calls: [(Call, &str); 6] = [
        (
            Box::new(|| capi::torpor_hook_map(0x1000, other_fd, 0)),
            "is not the start of a segment",
        ),
        (
            Box::new(|| capi::torpor_hook_map(va, other_fd, 0)),
            "only a released segment can be mapped",
        ),
        (
            Box::new(|| capi::torpor_hook_export(va + 8)),
            "is not the start of a segment",
        ),
        (
            Box::new(|| capi::torpor_hook_host_free(0x1000)),
            "is not the start of a segment",
        ),
        (
            Box::new(|| capi::torpor_hook_mark_first_use(va + page as u64)),
            "lies in no segment",
        ),
        (
            Box::new(|| capi::torpor_hook_seal(0x1000)),
            "is not the start of a segment",
        ),
    ];
    for (call, expected) in calls {
        assert_eq!(call(), -1);
        assert!(
            last_error().contains(expected),
            "{} / {expected}",
            last_error()
        );
    }

    // Declared read-only data: filled, then sealed; no process can map it writable any more.
    // SAFETY: mapped read-write, one page.
    unsafe { write(va, &pattern(page, 9)) };
    assert_eq!(capi::torpor_hook_seal(va), 0, "{}", last_error());
    assert_eq!(capi::torpor_hook_seal(va), 0, "sealing twice is harmless");
    let info = list().into_iter().find(|s| s.va == va).unwrap();
    assert_eq!((info.mapped, info.read_only), (1, 1));
    assert_eq!(protection(va), "r--s");
    // SAFETY: mapped read-only, one page.
    assert!(unsafe { read(va, page) } == pattern(page, 9));
    let fd = capi::torpor_hook_export(va);
    assert!(fd >= 0, "{}", last_error());
    // SAFETY: the hook returned a new descriptor this process owns.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: a new mapping the kernel must refuse; unmapped if it was made.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    assert_eq!(
        ptr,
        libc::MAP_FAILED,
        "a writable mapping of sealed data was allowed"
    );

    // Restore-side failures: a bad fd, an fd of the wrong size, a file that is not a memfd.
    release_all();
    let file = tempfile::tempfile().unwrap();
    let (_device, small) = daemon_memory(page, 1, false);
    let big = host_alloc(2 * page);
    release_all();
    for (fd, at, expected) in [
        (-1, va, "is not an open file descriptor"),
        (9999, va, "is not an open file descriptor"),
        (file.as_raw_fd(), va, "is not a memfd"),
        (small.as_raw_fd(), big, "expected"),
    ] {
        assert_eq!(capi::torpor_hook_map(at, fd, 0), -1);
        assert!(
            last_error().contains(expected),
            "{} / {expected}",
            last_error()
        );
    }
    assert!(list().iter().all(|s| s.mapped == 0));
    assert_eq!(capi::torpor_hook_host_free(va), 0, "{}", last_error());
    assert_eq!(capi::torpor_hook_host_free(big), 0, "{}", last_error());
    assert!(list().is_empty());
    assert_eq!(
        capi::torpor_hook_abi_version(),
        capi::TORPOR_HOOK_ABI_VERSION
    );
}
