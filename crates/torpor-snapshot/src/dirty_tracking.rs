//! Whether this kernel tracks which pages a process wrote (soft-dirty bits,
//! `CONFIG_MEM_SOFT_DIRTY`), which CRIU's pre-dump and every concurrent snapshot need.
//!
//! The probe is CRIU's own (`kerndat_get_dirty_track`): clear this process's soft-dirty bits
//! (`4` into `/proc/self/clear_refs`), write a page, and read its pagemap entry: bit 55 is set
//! only where the kernel tracks writes. Without `CONFIG_MEM_SOFT_DIRTY` the write to
//! `clear_refs` succeeds and the bit simply never appears. (Linux 6.18 without soft-dirty, as on
//! the development machine: `criu check --feature mem_dirty_track` says "Dirty tracking is OFF",
//! and `criu pre-dump` fails with or without `--track-mem`.)

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};

/// Bit 55 of a pagemap entry: the page was written since the soft-dirty bits were cleared.
const PM_SOFT_DIRTY: u64 = 1 << 55;

/// Whether the kernel tracks written pages; `Err` names the step that could not be done.
pub fn available() -> Result<bool, String> {
    let page = 4096usize;
    // SAFETY: a private anonymous mapping of one page, unmapped below; no other reference.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let result = (|| {
        // SAFETY: `addr` is a writable page of our own.
        unsafe { std::ptr::write_volatile(addr as *mut u8, 1) };
        fs::OpenOptions::new()
            .write(true)
            .open("/proc/self/clear_refs")
            .and_then(|mut f| f.write_all(b"4"))
            .map_err(|e| format!("clearing soft-dirty bits in /proc/self/clear_refs: {e}"))?;
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(addr as *mut u8, 2) };
        let mut pagemap = fs::File::open("/proc/self/pagemap")
            .map_err(|e| format!("opening /proc/self/pagemap: {e}"))?;
        let mut entry = [0u8; 8];
        pagemap
            .seek(SeekFrom::Start((addr as u64 / page as u64) * 8))
            .and_then(|_| pagemap.read_exact(&mut entry))
            .map_err(|e| format!("reading /proc/self/pagemap: {e}"))?;
        Ok(u64::from_le_bytes(entry) & PM_SOFT_DIRTY != 0)
    })();
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(addr, page) };
    result
}

#[cfg(test)]
mod tests {
    /// The answer agrees with the kernel's configuration where /proc/config.gz says it.
    #[test]
    fn agrees_with_the_kernel_configuration() {
        let Ok(got) = super::available() else {
            return;
        };
        let config = std::process::Command::new("sh")
            .args([
                "-c",
                "zcat /proc/config.gz 2>/dev/null | grep -E '^CONFIG_MEM_SOFT_DIRTY=y' || true",
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        match config {
            Ok(line) if std::path::Path::new("/proc/config.gz").exists() => {
                assert_eq!(
                    got,
                    !line.is_empty(),
                    "probe says {got}, /proc/config.gz says {line:?}"
                )
            }
            _ => {}
        }
    }
}
