"""The parts of users' programs that need no GPU: a worker forked with an inherited device mapping,
a connected TCP pair, a POSIX semaphore and a shared-memory file snapshot and restore; GPU state
the driver cannot restore is refused before anything is touched, and the source keeps answering.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PROGRAMS, PYTHON, FakeCuda, Torpor, Worker, Workers, fake_calls, fake_log
from linesrv import Endpoint

TREE = PROGRAMS / "tree_server.py"
LOOP_MAJOR = 7


@pytest.fixture
def fake_device() -> Iterator[Path]:
    """A block device node named like the NVIDIA driver's (/dev/nvidia-…), backed by loop0.

    CRIU refuses a mapping of it exactly as it refuses /dev/nvidia0 in a forked worker ("Can't
    handle non-regular mapping"), and Torpor finds it by the same path prefix.
    """
    loop = Path("/dev/loop0")
    if not loop.exists() or not stat.S_ISBLK(loop.stat().st_mode):
        pytest.skip("needs /dev/loop0 to stand in for a device")
    node = Path(f"/dev/nvidia-torpor-test-{os.getpid()}")
    node.unlink(missing_ok=True)
    os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(LOOP_MAJOR, 0))
    try:
        yield node
    finally:
        node.unlink(missing_ok=True)


def start_tree(workers: Workers, *flags: str | Path, name: str = "tree") -> Worker:
    endpoint = Endpoint(unix=str(workers.base / f"{name}.sock"))
    ready = workers.base / f"{name}.ready"
    argv = [PYTHON, TREE, "--unix", endpoint.unix or "", "--ready", ready, *flags]
    return workers.start(argv, endpoint=endpoint, ready=ready, name=name)


def test_forked_worker_with_an_inherited_device_mapping_restores(
    torpor: Torpor, workers: Workers, tmp_path: Path, fake_device: Path, fake_cuda: FakeCuda
) -> None:
    """The parent loads libcuda (the fake) and maps the device, then forks: the worker holds
    libcuda and the mapping but is no CUDA process, as a DataLoader worker."""
    w = start_tree(workers, "--cuda", fake_cuda.lib, "--device", fake_device)
    assert w.ask("work", "5") == "26"
    assert w.ask("devmaps") == "1", "the worker should have inherited the mapping"
    # The fake driver knows no CUDA process here: both are processes it has no state for.
    env = fake_cuda.env(fake_cuda.lib, [], tmp_path / "fake.log", tmp_path / "fake-state")

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running", env=env)
    # The source keeps running and answering; its worker lost only the mapping it never used.
    assert w.ask("work", "6") == "37"
    assert w.ask("devmaps") == "0"

    os.kill(w.init_pid, 9)  # SIGKILL to PID 1 of its namespace ends the whole tree
    w.wait_gone()
    r = workers.restore(snap, endpoint=w.endpoint, env=env)
    assert r.ask("work", "7") == "50"
    assert r.ask("devmaps") == "0"


def test_tcp_pair_semaphore_and_shared_memory_restore(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = start_tree(workers, "--tcp", "--sem", "torpor-test-sem", "--shm", "torpor-test-shm")
    assert w.ask("tcp", "hello") == "hello"
    assert w.ask("sem") == "3"
    shm_text = w.ask("shm")
    assert shm_text == "torpor shared memory survives"

    # Left running, the source's connection comes out of TCP repair and carries on.
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", tmp_path / "kept", "--leave-running")
    assert w.ask("tcp", "still") == "still"
    assert w.ask("sem") == "3"

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()
    r = workers.restore(snap, endpoint=w.endpoint)
    assert r.ask("tcp", "again") == "again"
    assert r.ask("sem") == "3"
    assert r.ask("shm") == shm_text


@pytest.mark.parametrize(
    ("flags", "expect"),
    [
        (("--marker", "torpor-unsupported-cuda-ipc-import"), "GPU memory of another process opened through CUDA IPC"),
        (("--marker", "torpor-unsupported-cuda-ipc-export"), "GPU memory exported to other processes through CUDA IPC"),
        (("--marker", "torpor-unsupported-cuda-managed-memory"), "CUDA managed memory (UVM"),
        (("--marker", "torpor-unsupported-nccl-multi-rank"), "multi-process NCCL"),
        (("--nccl-shm",), "share NCCL's shared-memory files"),
        (("--io-uring",), "holds an io_uring instance, which CRIU cannot save"),
    ],
)
def test_gpu_state_the_driver_cannot_restore_is_refused_first(
    torpor: Torpor, workers: Workers, tmp_path: Path, flags: tuple[str, ...], expect: str
) -> None:
    w = start_tree(workers, *flags)
    assert w.ask("work", "2") == "5"
    snap = tmp_path / "snap"
    line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", snap)
    assert expect in line, line
    assert f"pid {w.init_pid} keeps running, nothing was written" in line, line
    assert not snap.exists()
    assert w.ask("work", "3") == "10", "the source must keep answering"


def test_cuda_ipc_seen_by_the_preloaded_hook_is_refused_before_the_driver_is_touched(
    torpor: Torpor, workers: Workers, tmp_path: Path, fake_cuda: FakeCuda
) -> None:
    """`torpor run` preloads libtorpor_hook.so; a CUDA IPC import through it is refused with the
    driver never called, and once the program closes the handle the snapshot goes through."""
    w = start_tree(workers, "--cuda", fake_cuda.lib)
    pid = w.child_pid
    log = tmp_path / "fake-driver.log"
    env = fake_cuda.env(fake_cuda.lib, [pid], log, tmp_path / "fake-state")
    snap = tmp_path / "snap"

    assert w.ask("ipc-open") == "0"
    line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", snap, env=env)
    assert f"process {pid} holds GPU memory of another process opened through CUDA IPC" in line, line
    assert "cudaIpcCloseMemHandle" in line, line
    assert fake_calls(log, pid) == [], "the driver must not be touched\n" + fake_log(log)
    assert not snap.exists()
    assert w.ask("work", "4") == "17"

    assert w.ask("ipc-close") == "0"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running", env=env)
    assert fake_calls(log, pid) == ["lock", "checkpoint", "restore", "unlock"], fake_log(log)

    assert w.ask("managed") == "0"
    line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", tmp_path / "snap2", env=env)
    assert "CUDA managed memory (UVM" in line, line
    assert fake_calls(log, pid) == ["lock", "checkpoint", "restore", "unlock"], fake_log(log)
    assert w.ask("work", "5") == "26"


def test_torpor_run_keeps_libuv_off_io_uring_unless_told(torpor: Torpor, workers: Workers) -> None:
    w = start_tree(workers, name="uv-default")
    assert w.ask("env", "UV_USE_IO_URING") == "0"
    assert w.ask("env", "USE_LIBUV") == "0"
    endpoint = Endpoint(unix=str(workers.base / "uv-set.sock"))
    ready = workers.base / "uv-set.ready"
    argv = [PYTHON, TREE, "--unix", endpoint.unix or "", "--ready", ready]
    w2 = workers.start(argv, endpoint=endpoint, ready=ready, name="uv-set", env={"UV_USE_IO_URING": "1", "USE_LIBUV": "1"})
    assert w2.ask("env", "UV_USE_IO_URING") == "1"
    assert w2.ask("env", "USE_LIBUV") == "1"


def test_a_device_mapping_without_libcuda_is_left_alone(
    torpor: Torpor, workers: Workers, tmp_path: Path, fake_device: Path
) -> None:
    """A process that opened the devices without libcuda (NVML alone does) keeps them: CRIU then
    refuses the mapping, the source keeps running and keeps its mapping."""
    w = start_tree(workers, "--device", fake_device)
    assert w.ask("devmaps") == "1"
    line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", tmp_path / "snap", "--leave-running")
    assert "CRIU dump failed" in line and "keeps running" in line, line
    assert w.ask("devmaps") == "1" and w.ask("work", "3") == "10"


def test_the_hook_finds_a_driver_loaded_rtld_local(
    torpor: Torpor, workers: Workers, tmp_path: Path, fake_cuda: FakeCuda
) -> None:
    """A library loaded with RTLD_LOCAL (as CuPy's libcudart is) is not in the global scope, yet
    the call reaches the preloaded hook first: the hook must still find the real definition."""
    w = start_tree(workers, "--cuda", fake_cuda.lib, "--cuda-local", name="local")
    assert w.ask("managed") == "0", "the call through the hook must reach the library"
    env = fake_cuda.env(fake_cuda.lib, [], tmp_path / "fake.log", tmp_path / "fake-state")
    line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", tmp_path / "snap", env=env)
    assert "CUDA managed memory (UVM" in line, line
