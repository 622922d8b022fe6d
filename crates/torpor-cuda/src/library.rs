//! Opening a shared library chosen by an environment variable, and looking up its symbols.

use std::ffi::OsString;
use std::mem::ManuallyDrop;
use std::path::PathBuf;

use libloading::Library;

use crate::error::CudaError;

/// A loaded library that is never unloaded: the NVIDIA libraries start threads that may still run
/// their code after the last handle is gone, so `dlclose` is not safe on them.
pub(crate) struct Loaded {
    library: ManuallyDrop<Library>,
    path: PathBuf,
    env_var: &'static str,
}

/// The path named by `env_var`, or `default` when it is unset or empty.
pub(crate) fn path_from_env(env_var: &str, default: &str) -> PathBuf {
    match std::env::var_os(env_var) {
        Some(value) if !value.is_empty() => PathBuf::from(value),
        _ => PathBuf::from(default),
    }
}

impl Loaded {
    /// Opens the library at `path`; `env_var` is named in errors as the way to choose another.
    pub(crate) fn open(path: PathBuf, env_var: &'static str) -> Result<Self, CudaError> {
        let name: OsString = path.clone().into_os_string();
        // SAFETY: opening a library runs its initialisers. The NVIDIA libraries (and Torpor's
        // fakes) have no initialisers with preconditions on the caller; a library the user named
        // that does is the user's choice, as with `LD_PRELOAD`.
        let library = unsafe { Library::new(&name) }.map_err(|e| CudaError::LibraryNotFound {
            path: path.clone(),
            env_var,
            reason: e.to_string(),
        })?;
        Ok(Loaded {
            library: ManuallyDrop::new(library),
            path,
            env_var,
        })
    }

    pub(crate) fn path(&self) -> &PathBuf {
        &self.path
    }

    /// Looks up `symbol` as a value of type `T`, `None` when the library lacks it.
    ///
    /// # Safety
    /// `T` must be the function pointer type that matches the symbol's C declaration.
    pub(crate) unsafe fn get<T: Copy>(&self, symbol: &'static str) -> Option<T> {
        // SAFETY: the caller guarantees `T` matches the symbol's type. The value is copied out of
        // the `Symbol`, which is sound because the library is never unloaded (`ManuallyDrop`).
        unsafe { self.library.get::<T>(symbol.as_bytes()) }
            .ok()
            .map(|s| *s)
    }

    /// Like [`Loaded::get`], but a missing symbol means the library is not what the user thinks.
    ///
    /// # Safety
    /// As for [`Loaded::get`].
    pub(crate) unsafe fn require<T: Copy>(&self, symbol: &'static str) -> Result<T, CudaError> {
        // SAFETY: forwarded from the caller.
        unsafe { self.get(symbol) }.ok_or_else(|| CudaError::SymbolMissing {
            path: self.path.clone(),
            env_var: self.env_var,
            symbol,
        })
    }
}
