"""snapshot --leave-running: the source keeps serving; the snapshot holds the state it had then."""

from __future__ import annotations

from pathlib import Path

from conftest import FakeCuda, Torpor, Workers, fake_calls, fake_log, fake_state


def test_source_keeps_running_and_restore_has_snapshot_state(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    # Abstract socket: the restored instance and the source run at the same time, each in its own
    # network namespace; a path socket would be taken over by the restore.
    w = workers.server(abstract=True)
    assert [w.ask("incr") for _ in range(2)] == ["1", "2"]
    digest = w.ask("digest")
    child = w.child_pid

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running")
    assert snap.is_dir()
    assert w.alive() and w.child_pid == child, "the source must be the same process, still running"
    assert w.ask("get") == "2"
    assert w.ask("digest") == digest
    assert w.ask("incr") == "3"

    r = workers.restore(snap, endpoint=w.endpoint)
    assert r.ask("get") == "2", "the restore must have the state at snapshot time"
    assert r.ask("digest") == digest
    assert w.ask("get") == "3", "restoring must not touch the source"
    assert r.ask("incr") == "3"
    assert w.ask("incr") == "4"
    assert r.ask("get") == "3"
    assert r.ask_netns("get", tcp=True) == "3"
    assert w.ask_netns("get", tcp=True) == "4"


def test_leave_running_hands_gpu_state_back(
    torpor: Torpor, workers: Workers, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """With the fake driver: lock, checkpoint, (CRIU dump), restore, unlock — in that order."""
    w = workers.server(abstract=True, load_lib=fake_cuda.lib)
    assert w.ask("incr") == "1"
    child = w.child_pid
    log, state = tmp_path / "fake-cuda.log", tmp_path / "fake-state"
    env = fake_cuda.env(fake_cuda.lib, [child], log, state)

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running", env=env)
    assert fake_calls(log, child) == ["lock", "checkpoint", "restore", "unlock"], fake_log(log)
    assert fake_state(state, child) == "running"

    # The manifest records the GPU the process used and how much of its memory.
    gpu = torpor.inspect_json(snap).get("gpu")
    assert isinstance(gpu, dict), gpu
    gpus = gpu.get("gpus")
    assert isinstance(gpus, list) and len(gpus) == 1, gpu
    assert gpus[0].get("name") == "Fake NVIDIA GPU 0", gpu
    assert gpus[0].get("used_by_snapshot") == 1 << 30, gpu
    assert w.ask("get") == "1"
    assert w.ask("incr") == "2"
