"""`torpor snapshot --concurrent` (crates/torpor-snapshot/src/snapshot.rs, docs/checkpoints.md):
CRIU pre-dump rounds copy the memory while the process runs, the stop copies only what changed
(and the GPU state), the pre-dumped pages are then copied into the snapshot so it stands alone.

Where the kernel has no soft-dirty tracking (this development machine: Linux 6.18 without
CONFIG_MEM_SOFT_DIRTY) the request is refused in one line before anything is touched, and CRIU's
own refusal, forced past that check, leaves the source running. Where the kernel tracks writes
(the GPU machine's Ubuntu kernel), a training loop that writes its weights every step is
snapshotted concurrently and restored: its loss curve goes on bit for bit, so the pages it wrote
during the pre-copy were caught and copied again."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
from pathlib import Path

import pytest
from conftest import PYTHON, Torpor, Workers, alive, parse_pid, wait_until
from test_checkpoints import STEPS, TRAIN, reference, steps


def soft_dirty() -> bool:
    """CRIU's probe: clear this process's soft-dirty bits, write a page, read bit 55 of its pagemap entry."""
    m = mmap.mmap(-1, mmap.PAGESIZE)
    m[0] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("4")
    m[0] = 2
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // mmap.PAGESIZE * 8)
        entry = int.from_bytes(f.read(8), "little")
    return bool(entry >> 55 & 1)


TRACKING = soft_dirty()
needs_tracking = pytest.mark.skipif(not TRACKING, reason="the kernel has no soft-dirty tracking (CONFIG_MEM_SOFT_DIRTY)")
without_tracking = pytest.mark.skipif(TRACKING, reason="the kernel tracks writes: CRIU's pre-dump runs here")


def start_training(workers: Workers, tmp_path: Path) -> tuple[int, Path]:
    log = tmp_path / "train.log"
    r = workers.torpor("run", "--log", log, "--", PYTHON, TRAIN, "--steps", STEPS, "--sleep", "0.05")
    init = parse_pid(r)
    workers.track(init)
    wait_until(lambda: len(steps(log)) >= 20, 60, "the job to train 20 steps")
    return init, log


@without_tracking
def test_concurrent_is_refused_where_the_kernel_does_not_track_writes(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    init, log = start_training(workers, tmp_path)
    out = tmp_path / "snap"
    line = torpor.fails("snapshot", "--pid", init, "--out", out, "--concurrent")
    assert "needs the kernel's soft-dirty page tracking (CONFIG_MEM_SOFT_DIRTY)" in line, line
    assert "without --concurrent" in line and f"pid {init} keeps running" in line, line
    assert not out.exists() and alive(init)
    # Periodic checkpoints refuse it before the job starts.
    line = torpor.fails(
        "run", "--checkpoint-every", "1", "--checkpoints", tmp_path / "ck", "--concurrent-rounds", "2", "--", "true"
    )
    assert "needs the kernel's soft-dirty page tracking" in line, line


@without_tracking
def test_criu_refusing_the_pre_dump_leaves_the_source_training(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    init, log = start_training(workers, tmp_path)
    out = tmp_path / "snap"
    line = torpor.fails(
        "snapshot", "--pid", init, "--out", out, "--concurrent", env={"TORPOR_FAULT": "skip-tracking-check"}
    )
    assert "CRIU's pre-dump round 1 failed" in line and f"pid {init} keeps running" in line, line
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".snap")], list(tmp_path.iterdir())
    # It goes on training, bit for bit.
    n = len(steps(log))
    wait_until(lambda: len(steps(log)) > n + 10, 30, "the job to go on training")
    ref = reference()
    assert all(loss == ref[s - 1] for s, loss in steps(log))


@needs_tracking
def test_a_concurrent_snapshot_of_a_training_job_restores_bit_for_bit(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    init, log = start_training(workers, tmp_path)
    out = tmp_path / "snap"
    r = torpor.ok("snapshot", "--pid", init, "--out", out, "--concurrent", "--rounds", "3", "-v")
    phases = r.stderr
    for phase in ("criu_pre_dump_1", "criu_pre_dump_2", "criu_pre_dump_3", "criu_dump", "flatten_pre_dumps"):
        assert f"phase {phase}" in phases, phases
    assert "now killed" in r.stdout and not alive(init)
    # The snapshot stands alone: no link to the pre-dumps, which are gone.
    assert not (out / "parent").exists() and not (out / "parent").is_symlink()
    assert not [p for p in tmp_path.iterdir() if "-pre.partial-" in p.name]
    torpor.ok("verify", out)
    before = steps(log)
    log2 = tmp_path / "resumed.log"
    pid = parse_pid(torpor.ok("restore", out, "--detach", "--log", log2))
    workers.track(pid)
    wait_until(lambda: log2.exists() and "done" in log2.read_text(), 90, "the restored job to finish")
    after = steps(log2)
    ref = reference()
    # Resumed right after the last step the source printed, with the weights it had then.
    assert after[0][0] == before[-1][0] + 1, (after[0], before[-1])
    assert [s for s, _ in after] == list(range(after[0][0], STEPS + 1))
    assert all(loss == ref[s - 1] for s, loss in after), "the restored curve differs: a page written during the pre-copy was lost"


@needs_tracking
def test_a_fault_after_the_pre_dumps_leaves_the_source_running(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    init, log = start_training(workers, tmp_path)
    out = tmp_path / "snap"
    line = torpor.fails("snapshot", "--pid", init, "--out", out, "--concurrent", env={"TORPOR_FAULT": "after-pre-dump"})
    assert "fault after-pre-dump" in line and f"pid {init} keeps running" in line, line
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".snap")]
    n = len(steps(log))
    wait_until(lambda: len(steps(log)) > n + 10, 30, "the job to go on training")
    # CRIU killed during the final dump (CRIU_FAULT=1) after the pre-dumps: still running.
    line = torpor.fails("snapshot", "--pid", init, "--out", out, "--concurrent", env={"CRIU_FAULT": "1"})
    assert f"pid {init} keeps running" in line, line
    n = len(steps(log))
    wait_until(lambda: len(steps(log)) > n + 10, 30, "the job to go on training")
    os.kill(init, signal.SIGKILL)
