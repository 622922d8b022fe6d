//! The CUDA side of a snapshot: every CUDA process of a tree, with the checkpoint state it is in.
//!
//! As in CRIU's CUDA plugin, each task's state is recorded *before* the next action, so one
//! rollback routine, safe to run twice, returns every task to running whatever step failed.

use std::time::Duration;

use torpor_cuda::{CudaDriver, CudaError, GpuUuid};

/// Where a CUDA process stands in the checkpoint protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    Running,
    Locked,
    Checkpointed,
}

/// A step of the protocol that failed, with the pid and the driver's error.
#[derive(Debug, thiserror::Error)]
#[error("{step} of CUDA process {pid}: {source}")]
pub struct StepError {
    pub step: &'static str,
    pub pid: i32,
    #[source]
    pub source: CudaError,
}

/// The CUDA processes of one tree.
pub struct GpuTasks<'d> {
    driver: &'d CudaDriver,
    tasks: Vec<(i32, TaskState)>,
}

impl<'d> GpuTasks<'d> {
    /// Tracks `pids`, all of which are running CUDA processes.
    pub fn new(driver: &'d CudaDriver, pids: Vec<i32>) -> Self {
        Self {
            driver,
            tasks: pids.into_iter().map(|p| (p, TaskState::Running)).collect(),
        }
    }

    /// Tracks `pids` that a restore left checkpointed and locked.
    pub fn restored(driver: &'d CudaDriver, pids: Vec<i32>) -> Self {
        Self {
            driver,
            tasks: pids
                .into_iter()
                .map(|p| (p, TaskState::Checkpointed))
                .collect(),
        }
    }

    /// Tracks tasks found in the given states (a killed snapshot's, for its guard).
    pub fn with_states(driver: &'d CudaDriver, tasks: Vec<(i32, TaskState)>) -> Self {
        Self { driver, tasks }
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    pub fn pids(&self) -> Vec<i32> {
        self.tasks.iter().map(|t| t.0).collect()
    }

    /// Locks every task's CUDA API; in-flight work completes first.
    pub fn lock_all(&mut self, timeout: Duration) -> Result<(), StepError> {
        for (pid, state) in self.tasks.iter_mut() {
            if *state == TaskState::Running {
                self.driver
                    .lock(*pid, timeout)
                    .map_err(|source| StepError {
                        step: "lock",
                        pid: *pid,
                        source,
                    })?;
                *state = TaskState::Locked;
            }
        }
        Ok(())
    }

    /// Moves every task's GPU state into its host memory and releases its GPU resources.
    pub fn checkpoint_all(&mut self) -> Result<(), StepError> {
        for (pid, state) in self.tasks.iter_mut() {
            if *state == TaskState::Locked {
                self.driver.checkpoint(*pid).map_err(|source| StepError {
                    step: "checkpoint",
                    pid: *pid,
                    source,
                })?;
                *state = TaskState::Checkpointed;
            }
        }
        Ok(())
    }

    /// Puts the GPU state back (onto the GPUs `pairs` name, or the original ones).
    pub fn restore_all(&mut self, pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), StepError> {
        for (pid, state) in self.tasks.iter_mut() {
            if *state == TaskState::Checkpointed {
                self.driver
                    .restore(*pid, pairs)
                    .map_err(|source| StepError {
                        step: "restore",
                        pid: *pid,
                        source,
                    })?;
                *state = TaskState::Locked;
            }
        }
        Ok(())
    }

    /// Lets every task call CUDA again.
    pub fn unlock_all(&mut self) -> Result<(), StepError> {
        for (pid, state) in self.tasks.iter_mut() {
            if *state == TaskState::Locked {
                self.driver.unlock(*pid).map_err(|source| StepError {
                    step: "unlock",
                    pid: *pid,
                    source,
                })?;
                *state = TaskState::Running;
            }
        }
        Ok(())
    }

    /// Returns every task to running, on its original GPUs. Safe to call in any state and twice;
    /// tries every task even if one fails, and reports the first failure.
    pub fn rollback(&mut self) -> Result<(), StepError> {
        let mut first = None;
        for (pid, state) in self.tasks.iter_mut() {
            if *state == TaskState::Checkpointed {
                match self.driver.restore(*pid, &[]) {
                    Ok(()) => *state = TaskState::Locked,
                    Err(source) => {
                        first.get_or_insert(StepError {
                            step: "rollback restore",
                            pid: *pid,
                            source,
                        });
                        continue;
                    }
                }
            }
            if *state == TaskState::Locked {
                match self.driver.unlock(*pid) {
                    Ok(()) => *state = TaskState::Running,
                    Err(source) => {
                        first.get_or_insert(StepError {
                            step: "rollback unlock",
                            pid: *pid,
                            source,
                        });
                    }
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}
