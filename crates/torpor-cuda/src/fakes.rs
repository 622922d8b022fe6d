//! Builds the fake NVIDIA libraries of the repository's `tests/fakes/` so that tests, here and in
//! the crates above, can run the real loading and calling code on machines without a GPU.
//!
//! The fakes are steered through environment variables (`FAKE_CUDA_PIDS`, `FAKE_CUDA_LOG`,
//! `FAKE_CUDA_LOCK_RESULT`, …), documented at the top of each C file. Point
//! [`LIBCUDA_ENV`](crate::LIBCUDA_ENV) / [`LIBNVML_ENV`](crate::LIBNVML_ENV) at the built
//! library, or pass its path to [`CudaDriver::load_from`](crate::CudaDriver::load_from).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

/// Which fake library to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fake {
    /// `libcuda` with the checkpoint API (`fake_libcuda.c`).
    Cuda,
    /// `libcuda` of a driver older than 570: no `cuCheckpoint*` functions.
    CudaWithoutCheckpoint,
    /// `libcuda` with the checkpoint API and the virtual memory management, copy and stream
    /// calls, on memfd-backed host memory (for `torpor-device`'s cuda backend without a GPU).
    CudaWithVmm,
    /// `libnvidia-ml` (`fake_nvml.c`).
    Nvml,
}

const FAKE_LIBCUDA_C: &str = include_str!("../../../tests/fakes/fake_libcuda.c");
const FAKE_NVML_C: &str = include_str!("../../../tests/fakes/fake_nvml.c");

impl Fake {
    fn file_name(self) -> &'static str {
        match self {
            Fake::Cuda => "libfakecuda.so",
            Fake::CudaWithoutCheckpoint => "libfakecuda-nockpt.so",
            Fake::CudaWithVmm => "libfakecuda-vmm.so",
            Fake::Nvml => "libfakenvml.so",
        }
    }

    fn source(self) -> &'static str {
        match self {
            Fake::Cuda | Fake::CudaWithoutCheckpoint | Fake::CudaWithVmm => FAKE_LIBCUDA_C,
            Fake::Nvml => FAKE_NVML_C,
        }
    }

    fn defines(self) -> &'static [&'static str] {
        match self {
            Fake::CudaWithoutCheckpoint => &["-DFAKE_CUDA_NO_CHECKPOINT"],
            Fake::CudaWithVmm => &["-DFAKE_CUDA_VMM"],
            Fake::Cuda | Fake::Nvml => &[],
        }
    }
}

/// A fake library that could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FakeBuildError {
    /// The C compiler could not be started.
    #[error(
        "cannot run the C compiler `{compiler}` to build a fake NVIDIA library ({source}): \
         install a C compiler (Debian: apt-get install gcc) or set CC"
    )]
    CompilerNotFound {
        compiler: String,
        source: std::io::Error,
    },
    /// The compiler ran and failed.
    #[error(
        "`{compiler}` failed to build {fake:?} ({status}): {stderr}; fix the fake's C source in \
         tests/fakes/"
    )]
    CompileFailed {
        compiler: String,
        fake: Fake,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// The output directory could not be written.
    #[error("cannot write {}: {source}; give a writable output directory", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Compiles `fake` into `out_dir` with `$CC` (default `cc`) and returns the library's path.
/// Safe to call from several processes at once: each writes aside and renames into place.
pub fn build(fake: Fake, out_dir: &Path) -> Result<PathBuf, FakeBuildError> {
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(out_dir).map_err(|source| FakeBuildError::Io {
        path: out_dir.to_owned(),
        source,
    })?;
    let path = out_dir.join(fake.file_name());
    let tmp = out_dir.join(format!(
        ".{}.{}.{}.tmp",
        fake.file_name(),
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed)
    ));
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".to_owned());
    let mut child = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-std=c11"])
        .args(fake.defines())
        .arg("-o")
        .arg(&tmp)
        .args(["-x", "c", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| FakeBuildError::CompilerNotFound {
            compiler: compiler.clone(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        // A write error means the compiler exited early; its status and stderr say why.
        let _ = stdin.write_all(fake.source().as_bytes());
    }
    let output = child
        .wait_with_output()
        .map_err(|source| FakeBuildError::CompilerNotFound {
            compiler: compiler.clone(),
            source,
        })?;
    if !output.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(FakeBuildError::CompileFailed {
            compiler,
            fake,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr)
                .lines()
                .collect::<Vec<_>>()
                .join(" | "),
        });
    }
    std::fs::rename(&tmp, &path).map_err(|source| FakeBuildError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}
