//! What the host and cuda tests share: a child process that imports a segment from the test
//! process and maps it, and the scenario both backends must pass.
//!
//! The child is the test binary itself, run again with only its `child_process_entry` test and
//! the path of a Unix socket in `CHILD_SOCKET_ENV`. Over that socket the parent sends the
//! segment's fd beside a header (address, size, access); the child reserves the same address,
//! imports and maps the fd, and then answers commands: `r` read the whole mapping back, `w` write
//! to it behind the device's back (as a kernel would), `q` release it and exit.

#![allow(dead_code)]

pub mod cuda_cases;

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use torpor_device::fd_passing::{recv_fd, send_fd};
use torpor_device::{Access, Device, DeviceError, PhysicalMemory};

pub const CHILD_SOCKET_ENV: &str = "TORPOR_DEVICE_TEST_CHILD_SOCKET";

/// The CUDA driver library the children load (`TORPOR_LIBCUDA`), when the tests chose one.
pub static CHILD_LIBCUDA: OnceLock<PathBuf> = OnceLock::new();

/// A test pattern: `len` bytes that differ for each `seed` and do not repeat within a page.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

// ---- child side -------------------------------------------------------------------------------

/// The socket the parent gave this process, when it is a child.
pub fn child_connection() -> Option<UnixStream> {
    let path = std::env::var_os(CHILD_SOCKET_ENV)?;
    Some(UnixStream::connect(&path).unwrap_or_else(|e| {
        eprintln!("child: cannot connect to {path:?}: {e}");
        std::process::exit(2)
    }))
}

fn reply(conn: &mut UnixStream, tag: u8, payload: &[u8]) {
    let mut frame = vec![tag];
    frame.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    frame.extend_from_slice(payload);
    if conn.write_all(&frame).is_err() {
        std::process::exit(3);
    }
}

/// Serves the parent as described at the top, then exits the process. `raw_write` writes one
/// byte at the given address without the device's checks.
pub fn serve_as_child<D: Device>(
    device: &D,
    mut conn: UnixStream,
    raw_write: impl Fn(u64) -> Result<(), String>,
) -> ! {
    let mut header = [0u8; 17];
    let setup = (|| -> Result<(u64, D::Memory), DeviceError> {
        let fd = recv_fd(&conn, &mut header).map_err(|e| DeviceError::Os {
            call: "recv_fd",
            hint: "see the parent",
            source: std::io::Error::other(e.to_string()),
        })?;
        let at = u64::from_le_bytes(header[..8].try_into().unwrap());
        let len = u64::from_le_bytes(header[8..16].try_into().unwrap()) as usize;
        let access = if header[16] == 1 {
            Access::ReadOnly
        } else {
            Access::ReadWrite
        };
        // The restore case: the segment goes back at the address it had. A device that cannot
        // give that address here (the driver may choose another) maps it elsewhere and says so.
        let mapped_at = match device.reserve(len, Some(at)) {
            Ok(at) => at,
            Err(DeviceError::AddressInUse { .. }) if device.backend() == "cuda" => {
                device.reserve(len, None)?
            }
            Err(e) => return Err(e),
        };
        let memory = device.import(fd, len)?;
        device.map(&memory, mapped_at, access)?;
        Ok((mapped_at, memory))
    })();
    let (at, memory) = match setup {
        Ok(ok) => ok,
        Err(e) => {
            reply(&mut conn, b'E', e.to_string().as_bytes());
            std::process::exit(1);
        }
    };
    reply(&mut conn, b'K', &at.to_le_bytes());
    let mut command = [0u8; 1];
    while conn.read_exact(&mut command).is_ok() {
        match command[0] {
            b'r' => {
                let mut bytes = vec![0; memory.size()];
                match device.copy_to_host(at, &mut bytes) {
                    Ok(()) => reply(&mut conn, b'K', &bytes),
                    Err(e) => reply(&mut conn, b'E', e.to_string().as_bytes()),
                }
            }
            b'w' => {
                // A fault must kill the process, not leave a core file behind.
                let no_core = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: setrlimit reads the struct given.
                unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
                reply(&mut conn, b'K', b"writing");
                match raw_write(at) {
                    Ok(()) => reply(&mut conn, b'K', b"written"),
                    Err(e) => reply(&mut conn, b'E', e.as_bytes()),
                }
            }
            _ => break,
        }
    }
    let size = memory.size();
    let released = device
        .release(at, memory)
        .and_then(|()| device.free_reservation(at, size));
    std::process::exit(if released.is_ok() { 0 } else { 4 });
}

// ---- parent side ------------------------------------------------------------------------------

/// A child process holding an imported segment.
pub struct Child {
    process: std::process::Child,
    conn: UnixStream,
    _dir: tempfile::TempDir,
    /// Where the child mapped the segment.
    pub mapped_at: u64,
}

fn read_frame(conn: &mut UnixStream) -> Result<Result<Vec<u8>, String>, std::io::Error> {
    let mut head = [0u8; 9];
    conn.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().unwrap()) as usize;
    let mut payload = vec![0; len];
    conn.read_exact(&mut payload)?;
    Ok(match head[0] {
        b'K' => Ok(payload),
        _ => Err(String::from_utf8_lossy(&payload).into_owned()),
    })
}

impl Child {
    /// Starts the child, sends it `memory`'s fd (exported by `device`) to map `access` at `at`,
    /// and waits until it has. `Err` is the child's one-line error.
    pub fn start<D: Device>(
        device: &D,
        memory: &D::Memory,
        at: u64,
        access: Access,
    ) -> Result<Child, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("child.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut process = spawn_child(&path);
        let mut conn = accept(&listener, &mut process);
        let fd = device.export(memory).unwrap();
        let mut header = Vec::with_capacity(17);
        header.extend_from_slice(&at.to_le_bytes());
        header.extend_from_slice(&(memory.size() as u64).to_le_bytes());
        header.push(u8::from(access == Access::ReadOnly));
        send_fd(&conn, fd.as_fd(), &header).unwrap();
        drop(fd);
        match read_frame(&mut conn).expect("the child died while mapping the segment") {
            Ok(bytes) => Ok(Child {
                mapped_at: u64::from_le_bytes(bytes[..8].try_into().unwrap()),
                process,
                conn,
                _dir: dir,
            }),
            Err(message) => {
                let status = process.wait().unwrap();
                assert_eq!(status.code(), Some(1), "child: {message}");
                Err(message)
            }
        }
    }

    /// The bytes the child reads through its mapping.
    pub fn read(&mut self) -> Vec<u8> {
        self.conn.write_all(b"r").unwrap();
        read_frame(&mut self.conn)
            .expect("the child died while reading its mapping")
            .unwrap_or_else(|e| panic!("the child could not read its mapping: {e}"))
    }

    /// Asks the child to write into its mapping behind the device's back. Returns the child's
    /// answer, or the status it died with.
    pub fn write_behind_the_device(mut self) -> Result<Result<(), String>, ExitStatus> {
        self.conn.write_all(b"w").unwrap();
        let started = read_frame(&mut self.conn).expect("the child died before writing");
        assert_eq!(started.as_deref(), Ok(&b"writing"[..]));
        match read_frame(&mut self.conn) {
            Ok(answer) => {
                let _ = self.quit();
                Ok(answer.map(|_| ()))
            }
            Err(_) => Err(self.process.wait().unwrap()),
        }
    }

    /// Tells the child to release the segment and exit; its exit status.
    pub fn quit(mut self) -> ExitStatus {
        let _ = self.conn.write_all(b"q");
        self.process.wait().unwrap()
    }
}

fn spawn_child(socket: &Path) -> std::process::Child {
    let mut command = Command::new(std::env::current_exe().unwrap());
    if let Some(libcuda) = CHILD_LIBCUDA.get() {
        command.env("TORPOR_LIBCUDA", libcuda);
    }
    command
        .args([
            "child_process_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_SOCKET_ENV, socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn accept(listener: &UnixListener, process: &mut std::process::Child) -> UnixStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                conn.set_nonblocking(false).unwrap();
                return conn;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(status) = process.try_wait().unwrap() {
                    panic!("the child exited ({status}) before connecting");
                }
                assert!(
                    Instant::now() < deadline,
                    "the child did not connect within 60 s"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

// ---- the scenario both backends pass ----------------------------------------------------------

/// The owner's side of a segment: reserved at `at` (or anywhere), created, mapped read-write and
/// filled with `pattern(len, seed)`.
pub fn owned_segment<D: Device>(
    device: &D,
    at: Option<u64>,
    len: usize,
    seed: u64,
) -> (u64, D::Memory) {
    let at = device
        .reserve(len, at)
        .unwrap_or_else(|e| panic!("reserve {len:#x} bytes: {e}"));
    let memory = device
        .create(len)
        .unwrap_or_else(|e| panic!("create {len:#x} bytes: {e}"));
    device
        .map(&memory, at, Access::ReadWrite)
        .unwrap_or_else(|e| panic!("map read-write at {at:#x}: {e}"));
    device
        .copy_to_device(at, &pattern(len, seed))
        .unwrap_or_else(|e| panic!("fill the segment: {e}"));
    (at, memory)
}

/// Export → import in a child at the same address → identical bytes; a later write by the owner
/// is seen by the child (one physical copy); the owner then releases the segment, keeping its
/// addresses, and maps a new one there.
pub fn scenario_export_import_release<D: Device>(device: &D, at: Option<u64>, len: usize) {
    let (at, memory) = owned_segment(device, at, len, 1);
    let mut back = vec![0; len];
    device.copy_to_host(at, &mut back).unwrap();
    assert!(
        back == pattern(len, 1),
        "the owner reads back what it wrote"
    );

    let mut child = Child::start(device, &memory, at, Access::ReadWrite)
        .unwrap_or_else(|e| panic!("the child could not import and map the segment: {e}"));
    if child.mapped_at != at {
        eprintln!(
            "note: the {} device gave the child {:#x}, not the owner's {at:#x}",
            device.backend(),
            child.mapped_at
        );
    }
    assert!(
        child.read() == pattern(len, 1),
        "the child's mapping holds other bytes than the owner wrote"
    );
    device.copy_to_device(at + 7, &pattern(100, 2)).unwrap();
    let mut expected = pattern(len, 1);
    expected[7..107].copy_from_slice(&pattern(100, 2));
    assert!(
        child.read() == expected,
        "a write by the owner is not seen by the child: the memory is not shared"
    );
    assert!(
        child.quit().success(),
        "the child failed to release the segment"
    );

    // Release (the snapshot step): the addresses stay reserved, the memory goes.
    device.release(at, memory).unwrap();
    let err = device.copy_to_host(at, &mut back).unwrap_err();
    assert!(matches!(err, DeviceError::NotMapped { .. }), "{err:?}");
    // Restore: new memory, filled, mapped at the same addresses.
    let fresh = device.create(len).unwrap();
    device.map(&fresh, at, Access::ReadWrite).unwrap();
    device.copy_to_device(at, &pattern(len, 3)).unwrap();
    device.copy_to_host(at, &mut back).unwrap();
    assert!(
        back == pattern(len, 3),
        "the re-mapped segment reads back wrong"
    );
    device.release(at, fresh).unwrap();
    device.free_reservation(at, len).unwrap();
}

/// One read-only segment, two importers: both see the owner's bytes, and the owner's later
/// writes (before sealing) through its own mapping.
pub fn scenario_two_importers_share_one_copy<D: Device>(device: &D, at: Option<u64>, len: usize) {
    let (at, memory) = owned_segment(device, at, len, 10);
    let mut first = Child::start(device, &memory, at, Access::ReadOnly)
        .unwrap_or_else(|e| panic!("the first importer could not map the segment: {e}"));
    let mut second = Child::start(device, &memory, at, Access::ReadOnly)
        .unwrap_or_else(|e| panic!("the second importer could not map the segment: {e}"));
    assert!(first.read() == pattern(len, 10));
    assert!(second.read() == pattern(len, 10));
    device.copy_to_device(at, &pattern(len, 11)).unwrap();
    assert!(
        first.read() == pattern(len, 11),
        "the first importer does not see the owner's write"
    );
    assert!(
        second.read() == pattern(len, 11),
        "the second importer does not see the owner's write"
    );
    assert!(first.quit().success());
    assert!(second.quit().success());
    device.release(at, memory).unwrap();
    device.free_reservation(at, len).unwrap();
}

/// Sealing: a writable mapping of sealed memory is refused here and in a child; a read-only one
/// works. Returns the child holding the read-only mapping, and the owner's address and memory
/// (mapped read-only), for the backend's own check of what a write does.
pub fn scenario_sealed_segment<D: Device>(
    device: &D,
    at: Option<u64>,
    len: usize,
) -> (Child, u64, D::Memory) {
    let (at, memory) = owned_segment(device, at, len, 20);
    device.unmap(at, len).unwrap();
    device.seal_read_only(&memory).unwrap();
    assert!(memory.is_sealed());
    let err = device.map(&memory, at, Access::ReadWrite).unwrap_err();
    assert!(matches!(err, DeviceError::Sealed), "{err:?}");
    assert!(
        err.to_string().contains("map it with Access::ReadOnly"),
        "{err}"
    );
    device.map(&memory, at, Access::ReadOnly).unwrap();
    let err = device.copy_to_device(at, &[1]).unwrap_err();
    assert!(matches!(err, DeviceError::ReadOnly { .. }), "{err:?}");

    let mut child = Child::start(device, &memory, at, Access::ReadOnly)
        .unwrap_or_else(|e| panic!("the child could not map the sealed segment read-only: {e}"));
    assert!(child.read() == pattern(len, 20));
    (child, at, memory)
}
