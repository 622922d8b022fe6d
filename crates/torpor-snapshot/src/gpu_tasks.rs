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
    /// Tasks found checkpointed by someone else before the snapshot (a torpord instance whose
    /// GPU was released in place): the snapshot takes them as they are and leaves them so, never
    /// restoring them, on success (`leave_running`) as on a rollback: their GPU memory was given
    /// back and may be someone else's now.
    stay_checkpointed: Vec<i32>,
}

impl<'d> GpuTasks<'d> {
    /// Tracks `pids`, all of which are running CUDA processes.
    pub fn new(driver: &'d CudaDriver, pids: Vec<i32>) -> Self {
        Self {
            driver,
            tasks: pids.into_iter().map(|p| (p, TaskState::Running)).collect(),
            stay_checkpointed: Vec::new(),
        }
    }

    /// Tracks `tasks` as found: running ones go through the protocol as with [`GpuTasks::new`],
    /// checkpointed ones (a GPU released in place) are dumped as they are and stay checkpointed
    /// whatever happens.
    pub fn found(driver: &'d CudaDriver, tasks: Vec<(i32, TaskState)>) -> Self {
        let stay_checkpointed = tasks
            .iter()
            .filter(|(_, s)| *s == TaskState::Checkpointed)
            .map(|(p, _)| *p)
            .collect();
        Self {
            driver,
            tasks,
            stay_checkpointed,
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
            stay_checkpointed: Vec::new(),
        }
    }

    /// Tracks tasks found in the given states (a killed snapshot's, for its guard).
    pub fn with_states(driver: &'d CudaDriver, tasks: Vec<(i32, TaskState)>) -> Self {
        Self {
            driver,
            tasks,
            stay_checkpointed: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    pub fn pids(&self) -> Vec<i32> {
        self.tasks.iter().map(|t| t.0).collect()
    }

    /// The tasks `checkpoint_all` will checkpoint: those locked and not yet checkpointed (a
    /// released task's GPU state is in its memory already).
    pub fn to_checkpoint(&self) -> Vec<i32> {
        self.tasks
            .iter()
            .filter(|t| t.1 == TaskState::Locked)
            .map(|t| t.0)
            .collect()
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
            if *state == TaskState::Checkpointed && !self.stay_checkpointed.contains(pid) {
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

    /// Returns every task to running, on its original GPUs (those found checkpointed to where
    /// they were found: [`GpuTasks::found`]). Safe to call in any state and twice; tries every
    /// task even if one fails, and reports the first failure.
    pub fn rollback(&mut self) -> Result<(), StepError> {
        let mut first = None;
        for (pid, state) in self.tasks.iter_mut() {
            if self.stay_checkpointed.contains(pid) {
                continue;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_cuda::fakes::{self, Fake};

    /// The fake driver (tests/fakes/fake_libcuda.c) with its per-pid state in files.
    #[test]
    fn tasks_found_checkpointed_are_neither_restored_nor_rolled_back() {
        let dir = tempfile::tempdir().unwrap();
        let lib = fakes::build(Fake::Cuda, dir.path()).unwrap();
        let states = dir.path().join("state");
        std::fs::create_dir(&states).unwrap();
        // Only this test sets these; the fake reads them at each call.
        std::env::set_var("FAKE_CUDA_PIDS", "*");
        std::env::set_var("FAKE_CUDA_STATE_DIR", &states);
        let (released, running) = (4_000_001, 4_000_002);
        std::fs::write(states.join(released.to_string()), "checkpointed").unwrap();
        let state =
            |pid: i32| std::fs::read_to_string(states.join(pid.to_string())).unwrap_or_default();
        let driver = CudaDriver::load_from(lib).unwrap();
        // Both checkpointed, one by this snapshot.
        let checkpointed = || {
            let mut tasks = GpuTasks::found(
                &driver,
                vec![
                    (released, TaskState::Checkpointed),
                    (running, TaskState::Running),
                ],
            );
            tasks.lock_all(Duration::from_secs(1)).unwrap();
            tasks.checkpoint_all().unwrap();
            tasks
        };

        let mut tasks = checkpointed();
        assert_eq!(state(running).trim(), "checkpointed");
        // leave_running: only the one this snapshot checkpointed comes back.
        tasks.restore_all(&[]).unwrap();
        tasks.unlock_all().unwrap();
        assert_eq!(state(running).trim(), "running");
        assert_eq!(state(released).trim(), "checkpointed");

        // A failed dump's rollback: the same.
        let mut tasks = checkpointed();
        tasks.rollback().unwrap();
        tasks.rollback().unwrap();
        assert_eq!(state(running).trim(), "running");
        assert_eq!(state(released).trim(), "checkpointed");
        std::env::remove_var("FAKE_CUDA_PIDS");
        std::env::remove_var("FAKE_CUDA_STATE_DIR");
    }
}
