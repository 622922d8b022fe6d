"""`torpor migrate --pid PID --gpu N` (crates/torpor-snapshot/src/migrate.rs) with the fake
driver (tests/fakes): a process started by `torpor run` is moved onto another GPU of one model in
place (lock, checkpoint, restore with the GPU pairs, unlock) and answers as before; a move the
driver could not do is refused in one line before the process is touched (no CUDA process, the
GPU it is on, a missing GPU, another model, too little free memory); a lock that fails leaves it
running on its old GPU. The real move runs on nvidia-h200-x2 (docs/gpu-machine.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FakeCuda, Torpor, Workers, Worker, fake_log

GIB = 1 << 30


@dataclass
class OnGpu:
    worker: Worker
    fake: FakeCuda
    base: Path

    def env(self, **extra: str) -> dict[str, str]:
        child = self.worker.child_pid
        env = self.fake.env(self.fake.lib, [child], self.base / "fake.log", self.base / "state", gpu_bytes=GIB)
        return {**env, "FAKE_CUDA_DEVICES": "2", "FAKE_CUDA_SAME_MODEL": "1", **extra}

    def calls(self) -> list[str]:
        log = self.base / "fake.log"
        child = str(self.worker.child_pid)
        lines = log.read_text().splitlines() if log.exists() else []
        return [line for line in lines if line.split()[1:2] == [child]]


@pytest.fixture
def on_gpu(torpor: Torpor, fake_cuda: FakeCuda, tmp_path: Path) -> Iterator[OnGpu]:
    ws = Workers(torpor, tmp_path)
    try:
        w = ws.server(load_lib=fake_cuda.lib)
        assert w.ask("incr") == "1"
        yield OnGpu(w, fake_cuda, tmp_path)
    finally:
        ws.cleanup()


def test_a_process_moves_to_another_gpu_in_place_and_answers_on(torpor: Torpor, on_gpu: OnGpu) -> None:
    r = torpor.ok("migrate", "--pid", on_gpu.worker.init_pid, "--gpu", "1", "-v", env=on_gpu.env())
    assert "moved from GPU 0 to GPU 1" in r.stdout and "1.07 GB" in r.stdout, r.stdout
    calls = on_gpu.calls()
    assert [c.split()[0] for c in calls] == ["lock", "checkpoint", "restore", "unlock"], fake_log(on_gpu.base / "fake.log")
    # The driver gets a pair for each GPU the process sees: its GPU and the target swap.
    restore = calls[2]
    assert "pairs=2" in restore and "result=0" in restore, restore
    assert "GPU-fa4e0000-0000-0000-0000-000000000000>GPU-fa4e0000-0000-0000-0000-000000000001" in restore, restore
    # Same process, same memory: the count goes on.
    assert on_gpu.worker.ask("incr") == "2"


@pytest.mark.parametrize(
    ("gpu", "extra", "says"),
    [
        ("0", {}, "is on GPU 0 already"),
        ("7", {}, "GPU 7 does not exist"),
        ("1", {"FAKE_CUDA_SAME_MODEL": ""}, "is a Fake NVIDIA GPU 1: the driver restores only onto the same model"),
        ("1", {"FAKE_CUDA_TOTAL_MEM": str(GIB // 2)}, "has 512 MiB free but pid"),
        ("x", {}, "--gpu"),
    ],
)
def test_a_move_the_driver_cannot_do_is_refused_in_one_line_untouched(
    torpor: Torpor, on_gpu: OnGpu, gpu: str, extra: dict[str, str], says: str
) -> None:
    env = {k: v for k, v in on_gpu.env(**extra).items() if v != ""}
    line = torpor.fails("migrate", "--pid", on_gpu.worker.init_pid, "--gpu", gpu, env=env)
    assert says in line, line
    assert on_gpu.calls() == [], "a refused move must not touch the process"
    assert on_gpu.worker.ask("incr") == "2"


def test_a_failed_lock_leaves_it_running_on_its_gpu(torpor: Torpor, on_gpu: OnGpu) -> None:
    line = torpor.fails(
        "migrate", "--pid", on_gpu.worker.init_pid, "--gpu", "1", env=on_gpu.env(FAKE_CUDA_LOCK_RESULT="600")
    )
    assert "runs on, on its old GPU" in line, line
    assert on_gpu.worker.ask("incr") == "2"


def test_a_tree_without_cuda_is_refused(torpor: Torpor, tmp_path: Path, fake_cuda: FakeCuda) -> None:
    ws = Workers(torpor, tmp_path)
    try:
        w = ws.server()
        env = fake_cuda.env(fake_cuda.lib, [], tmp_path / "fake.log", tmp_path / "state")
        line = torpor.fails("migrate", "--pid", w.init_pid, "--gpu", "1", env=env)
        assert "has no CUDA process" in line, line
    finally:
        ws.cleanup()
