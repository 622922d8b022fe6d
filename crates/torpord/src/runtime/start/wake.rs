//! Start by waking a hibernated (or evicted) instance: its own snapshot restored through
//! [`super::restore`]. It keeps its id, its log and its registry row; a hibernation is never
//! staged (restored once, copying it first would only add a read), and its snapshot is removed
//! once nothing reads it any more. A wake that fails discards the hibernated instance, and the
//! request gets a cold start instead.

use std::sync::Arc;

use crate::runtime::instance::Sleeper;
use crate::runtime::pool::FnInfo;
use crate::runtime::start::{NewInstance, StartError, StartKind, Started};
use crate::runtime::Runtime;

impl Runtime {
    /// Restores `sleeper` from its hibernation snapshot.
    pub(crate) async fn wake_instance(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: &Sleeper,
        new: &NewInstance<'_, '_>,
    ) -> Result<Started, StartError> {
        self.restore_instance(name, info, generation, Some(sleeper), new)
            .await
    }

    /// Wakes `sleeper` for a request; when that fails, discards it and cold-starts instead.
    pub(crate) async fn wake_or_cold_start(
        self: &Arc<Self>,
        name: &str,
        info: &FnInfo,
        generation: u64,
        sleeper: &Sleeper,
        charge: &crate::accounting::StartGuard<'_>,
    ) -> Result<Started, StartError> {
        let (id, log) = self.instance_files(name, Some(&sleeper.id));
        let new = NewInstance {
            id: &id,
            log: &log,
            charge,
        };
        let woken = self
            .start(StartKind::Wake(sleeper), name, info, generation, &new)
            .await;
        let Err(e) = woken else {
            return woken;
        };
        tracing::warn!(function = %name, instance = %sleeper.id, error = %e, "cannot wake the hibernated instance; discarding it and restoring the function snapshot");
        self.discard_sleeper(
            sleeper.id.clone(),
            sleeper.snapshot_id.clone(),
            sleeper.snapshot_dir.clone(),
        )
        .await;
        self.cold_start(name, info, generation, charge).await
    }
}
