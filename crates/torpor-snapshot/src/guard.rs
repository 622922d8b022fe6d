//! The snapshot guard: the rollback of a `torpor snapshot` that was killed.
//!
//! A snapshot that fails rolls itself back (`GpuTasks::rollback`). One that is killed (kill -9,
//! the OOM killer) cannot. CRIU lets the tree go when its client dies, but the driver checkpoint
//! stays: the source's GPU state is in its host memory and its CUDA calls block, and nothing is
//! left to restore it. So `torpor snapshot` first starts this guard, in a session of its own,
//! reading a pipe. The snapshot writes [`DONE`] to the pipe when it ends, whatever the outcome,
//! having rolled back what it had to. If the pipe closes without it, the snapshot died. The guard
//! then waits for CRIU to release the tree's tasks and returns every CUDA process of the tree that
//! the driver reports locked or checkpointed to running: the rollback the snapshot would have
//! made. CPU-only trees need nothing of it: the driver is loaded only where a task maps libcuda.

use std::io::Read;
use std::time::{Duration, Instant};

use torpor_cuda::{CudaDriver, ProcessState};

use crate::gpu_tasks::{GpuTasks, TaskState};
use crate::proctree;

/// What a snapshot that ended writes to its guard.
pub const DONE: &[u8] = b"done\n";

/// How long the guard waits for CRIU to let the tree's tasks go (CRIU gives a dump up at its
/// next exchange with its dead client, and unfreezes the tree then).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the guard of the snapshot of the tree of `root`, reading `from` (the snapshot's pipe);
/// returns the exit status: 0 when the snapshot ended or nothing had to be undone, 1 when a
/// rollback failed or the tree was never released.
pub fn guard_main(root: i32, mut from: impl Read) -> i32 {
    let mut said = Vec::new();
    let _ = from.read_to_end(&mut said);
    if said == DONE {
        return 0;
    }
    match roll_back(root) {
        Ok(0) => 0,
        Ok(n) => {
            eprintln!(
                "torpor: the snapshot of pid {root} was killed after its driver checkpoint; the \
                 guard returned its {n} CUDA process(es) to running"
            );
            0
        }
        Err(e) => {
            eprintln!("torpor: the snapshot of pid {root} was killed, and its guard could not return its CUDA processes to running: {e}; run NVIDIA's cuda-checkpoint --toggle --pid PID on each");
            1
        }
    }
}

/// Returns the CUDA processes of the tree of `root` that are locked or checkpointed to running,
/// once CRIU has let them go; how many there were.
fn roll_back(root: i32) -> Result<usize, String> {
    let pids: Vec<i32> = proctree::tree(root)
        .into_iter()
        .filter(|&p| proctree::maps_libcuda(p).unwrap_or(false))
        .collect();
    if pids.is_empty() {
        return Ok(0);
    }
    let deadline = Instant::now() + RELEASE_TIMEOUT;
    while pids.iter().any(|&p| traced(p)) {
        if Instant::now() > deadline {
            return Err(format!(
                "its tasks were still traced (by CRIU) after {} s",
                RELEASE_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let driver = CudaDriver::load().map_err(|e| e.to_string())?;
    let mut held = Vec::new();
    for pid in pids {
        match driver.process_state(pid) {
            Ok(Some(ProcessState::Locked)) => held.push((pid, TaskState::Locked)),
            Ok(Some(ProcessState::Checkpointed)) => held.push((pid, TaskState::Checkpointed)),
            Ok(_) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    let n = held.len();
    GpuTasks::with_states(&driver, held)
        .rollback()
        .map_err(|e| e.to_string())?;
    Ok(n)
}

/// Whether a tracer (CRIU) holds task `pid` (`TracerPid` in its status); a task gone is not.
fn traced(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .map(|v| v.trim() != "0")
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_that_said_done_is_left_alone_and_a_cpu_tree_needs_nothing() {
        assert_eq!(guard_main(i32::MAX, DONE), 0);
        // No such tree (no task maps libcuda): nothing to undo, whatever the pipe said.
        assert_eq!(guard_main(i32::MAX, &b""[..]), 0);
        assert!(!traced(std::process::id() as i32));
    }
}
