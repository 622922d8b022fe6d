"""Restore's GPU checks, with the fake driver (tests/fakes): a snapshot holding GPU state is
refused on another driver version, another GPU model, a missing GPU or too little free memory, in
one line and before any process is restored; a driver restore that fails kills what was restored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FakeCuda, Torpor, Workers, fake_calls, fake_log, pids_with, wait_until

GIB = 1 << 30


@dataclass(frozen=True)
class GpuSnapshot:
    snap: Path
    token: str  # in the command line of anything restored from it
    fake: FakeCuda
    base: Path

    def env(self, **extra: str) -> dict[str, str]:
        """Fake driver environment for a restore (every pid counts as a CUDA process)."""
        env = self.fake.env(self.fake.lib, [], self.base / "restore-fake.log", self.base / "restore-state")
        return {**env, "FAKE_CUDA_PIDS": "*", "FAKE_NVML_PROCS": "", **extra}


@pytest.fixture(scope="module")
def gpu_snapshot(
    torpor: Torpor, criu_ready: None, fake_cuda: FakeCuda, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GpuSnapshot]:
    base = tmp_path_factory.mktemp("gpu-checks")
    ws = Workers(torpor, base)
    try:
        w = ws.server(load_lib=fake_cuda.lib)
        assert w.ask("incr") == "1"
        child = w.child_pid
        log = base / "fake.log"
        env = fake_cuda.env(fake_cuda.lib, [child], log, base / "state", gpu_bytes=GIB)
        snap = base / "snap"
        torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, env=env)
        w.wait_gone()
        assert fake_calls(log, child) == ["lock", "checkpoint"], fake_log(log)
        gpu = torpor.inspect_json(snap).get("gpu")
        assert isinstance(gpu, dict) and gpu.get("gpus"), gpu
        yield GpuSnapshot(snap, ws.token, fake_cuda, base)
    finally:
        ws.cleanup()


def refused(torpor: Torpor, s: GpuSnapshot, *args: str, **env: str) -> str:
    line = torpor.fails("restore", s.snap, "--detach", *args, env=s.env(**env))
    assert pids_with(s.token) == [], "a refused restore left a process"
    return line


def test_other_driver_version_is_refused(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    line = refused(torpor, gpu_snapshot, FAKE_NVML_DRIVER_VERSION="999.1.1")
    assert "999.1.1" in line and "580.159.04" in line, line


def test_other_gpu_model_is_refused(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    # The fake's GPU 1 is "Fake NVIDIA GPU 1": another model than the snapshot's GPU 0.
    line = refused(torpor, gpu_snapshot, "--gpu", "0=1", FAKE_CUDA_DEVICES="2")
    assert "Fake NVIDIA GPU 1" in line, line


def test_gpu_missing_here_is_refused(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    line = refused(torpor, gpu_snapshot, FAKE_CUDA_DEVICES="0")
    assert "--gpu" in line, line


def test_unknown_target_gpu_is_refused(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    line = refused(torpor, gpu_snapshot, "--gpu", "0=7")
    assert "7" in line, line


def test_too_little_free_gpu_memory_is_refused(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    line = refused(torpor, gpu_snapshot, FAKE_CUDA_TOTAL_MEM=str(GIB // 2))
    assert "MiB" in line and "free" in line, line


def test_failed_driver_restore_kills_the_restored_tree(torpor: Torpor, gpu_snapshot: GpuSnapshot) -> None:
    """CRIU restores the processes, then the driver restore fails: nothing is left running."""
    line = torpor.fails(
        "restore", gpu_snapshot.snap, "--detach", env=gpu_snapshot.env(FAKE_CUDA_RESTORE_RESULT="999")
    )
    assert "restore" in line.lower(), line
    log = gpu_snapshot.base / "restore-fake.log"
    assert any(x.startswith("restore ") and x.endswith("result=999") for x in log.read_text().splitlines()), (
        fake_log(log)
    )
    wait_until(lambda: pids_with(gpu_snapshot.token) == [], 10, "the restored tree to be killed")


def test_a_transient_driver_restore_failure_is_retried_from_the_snapshot(
    torpor: Torpor, gpu_snapshot: GpuSnapshot, tmp_path: Path
) -> None:
    """The driver's restore fails once with CUDA_ERROR_OPERATING_SYSTEM (as it intermittently does
    for JAX processes): that tree is killed, and a fresh restore of the snapshot succeeds."""
    flaky = tmp_path / "flaky-once"
    env = gpu_snapshot.env(FAKE_CUDA_RESTORE_FLAKY=str(flaky), FAKE_CUDA_DEFAULT_STATE="checkpointed")
    r = torpor.ok("restore", gpu_snapshot.snap, "--detach", env=env)
    assert flaky.exists(), "the fake driver's flaky restore did not run"
    assert "attempt 2 succeeded" in r.stderr, r.stderr
    log = gpu_snapshot.base / "restore-fake.log"
    lines = log.read_text().splitlines()
    failed = [x for x in lines if x.startswith("restore ") and "flaky" in x]
    assert len(failed) == 1, fake_log(log)
    first_pid = int(failed[0].split()[1])
    wait_until(lambda: not Path(f"/proc/{first_pid}").exists(), 10, "the first restored tree to be killed")
    pid = int(r.stdout.split()[0])
    try:
        assert any(x.startswith("unlock ") for x in lines), fake_log(log)
    finally:
        import os
        import signal

        os.kill(pid, signal.SIGKILL)


def test_a_restored_cuda_process_runs_nothing_but_the_driver_restore_thread_until_restored(
    torpor: Torpor, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """Between CRIU letting the restored tasks go and the driver's restore, libcuda's own threads
    crashed a restored JAX process on the H100 (they read a driver mapping only the restore puts
    back). So the CUDA process is stopped at CRIU's pre-resume point and only the driver's restore
    thread runs (the fake driver names the main thread) while the driver restores: the fake logs
    every thread's state then. Afterwards the whole process runs and answers."""
    ws = Workers(torpor, tmp_path)
    try:
        w = ws.server(load_lib=fake_cuda.lib, threads=3)
        assert w.ask("incr") == "1"
        env = fake_cuda.env(fake_cuda.lib, [w.child_pid], tmp_path / "fake.log", tmp_path / "state", gpu_bytes=GIB)
        snap = tmp_path / "snap"
        torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, env=env)
        w.wait_gone()
        log = tmp_path / "restore-fake.log"
        renv = fake_cuda.env(fake_cuda.lib, [], log, tmp_path / "restore-state")
        renv = {**renv, "FAKE_CUDA_PIDS": "*", "FAKE_NVML_PROCS": "", "FAKE_CUDA_DEFAULT_STATE": "checkpointed",
                "FAKE_CUDA_LOG_THREADS": "1"}  # fmt: skip
        restored = ws.restore(snap, endpoint=w.endpoint, env=renv)
        [line] = [x for x in log.read_text().splitlines() if x.startswith("restore ")]
        states = line.split(" threads=")[1].split()[0].split(",")
        # The first listed thread is the main one: the fake's restore thread.
        assert len(states) == 4 and states[0] not in "Tt", line
        assert all(s == "T" for s in states[1:]), f"a thread ran before the driver's restore: {line}"
        # Then everything runs: the threads tick again and the server answers.
        assert restored.ask("incr") == "2"
        pid = int(line.split()[1])
        wait_until(
            lambda: all(t.read_text().split(")")[-1].split()[0] in "RS" for t in Path(f"/proc/{pid}/task").glob("*/stat")),
            10, "every thread to run again",
        )  # fmt: skip
    finally:
        ws.cleanup()


def test_a_page_server_dead_before_the_hot_set_fails_the_restore_at_once(
    torpor: Torpor, gpu_snapshot: GpuSnapshot, tmp_path: Path
) -> None:
    """With Torpor's page server, a restore that resumes GPU state starts the driver's restore
    once the hot set's copy has begun (the driver reads what it saved into the process, beside
    the copy), waiting up to 30 s for a slow server. A server that has exited is told from a
    slow one: here it stops right after CRIU's restore, the hot set never begun
    (TORPOR_PAGE_SERVER_FAULT=hot-set), and the restore fails at once with its one line, the tree
    killed and the driver's restore never run on it."""
    log = tmp_path / "fake.log"
    env = gpu_snapshot.env(TORPOR_PAGE_SERVER_FAULT="hot-set", TORPOR_LOG_DIR=str(tmp_path / "logs"), FAKE_CUDA_LOG=str(log))
    start = time.monotonic()
    line = torpor.fails("restore", gpu_snapshot.snap, "--detach", "--pages", "lazy", env=env, timeout=90)
    took = time.monotonic() - start
    assert "torpor's page server failed" in line and "TORPOR_PAGE_SERVER_FAULT=hot-set" in line, line
    assert took < 20, f"the failed restore took {took:.1f} s: it waited for a dead page server"
    wait_until(lambda: pids_with(gpu_snapshot.token) == [], 10, "the restored tree to be killed")
    calls = log.read_text().splitlines() if log.exists() else []
    assert not any(x.startswith("restore ") for x in calls), calls
