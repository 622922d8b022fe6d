//! Locking helpers shared by the daemon's modules.

use std::sync::Mutex;

/// Locks `m`, taking the data of a poisoned lock as it is: a panicked holder is a bug that is
/// logged where it happened, and the daemon's state stays usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
