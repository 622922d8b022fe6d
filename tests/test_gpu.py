"""GPU snapshots with the real NVIDIA driver: outputs after restore are bit-identical.

Skipped, with the reason shown, on machines without an NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PROGRAMS, PYTHON, Torpor, Worker, Workers, describe, parse_pid
from linesrv import Endpoint

GPU_MODEL = PROGRAMS / "gpu_model.py"
BOOT_TIMEOUT = 300.0
INFER_TIMEOUT = 120.0


def nvidia_gpus() -> list[dict[str, str]]:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    if r.returncode != 0:
        return []
    gpus = []
    for line in r.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3:
            gpus.append({"index": parts[0], "name": parts[1], "uuid": parts[2]})
    return gpus


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not has_gpu(), reason="no NVIDIA GPU (`nvidia-smi -L` fails)")


def boot(ws: Workers, name: str) -> Worker:
    endpoint = Endpoint(abstract=f"torpor-gpu-{name}")
    ready = ws.base / f"{name}.ready"
    return ws.start(
        [PYTHON, GPU_MODEL, "--ready", ready, "--abstract", endpoint.abstract or ""],
        endpoint=endpoint,
        ready=ready,
        name=name,
        timeout=BOOT_TIMEOUT,
    )


def infer(w: Worker) -> dict[str, object]:
    doc = json.loads(w.ask("infer", wait=30, timeout=INFER_TIMEOUT))
    assert isinstance(doc, dict) and "out" in doc and "extra" in doc, doc
    return doc


def outputs(doc: dict[str, object]) -> tuple[object, object]:
    return doc["out"], doc["extra"]


def compute_apps() -> list[tuple[int, str]]:
    r = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    apps = []
    for line in r.stdout.splitlines():
        pid, uuid = (x.strip() for x in line.split(","))
        apps.append((int(pid), uuid))
    return apps


@dataclass
class Booted:
    ws: Workers
    worker: Worker
    snap: Path
    ref: tuple[object, object]


@pytest.fixture(scope="module")
def left_running(
    torpor: Torpor, criu_ready: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Booted]:
    """One booted GPU worker and a --leave-running snapshot of it, shared by the tests below."""
    base = tmp_path_factory.mktemp("gpu")
    ws = Workers(torpor, base)
    try:
        w = boot(ws, "gpu")
        ref = outputs(infer(w))
        assert outputs(infer(w)) == ref, "the model is not deterministic by itself"
        snap = base / "snap"
        torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running", timeout=600)
        yield Booted(ws, w, snap, ref)
    finally:
        ws.cleanup()


def test_gpu_snapshot_kill_restore_identical(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    w = boot(workers, "gpu")
    ref = outputs(infer(w))
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, timeout=600)
    # Only the process's own /dev/shm is archived; the driver's mounts stay external (issue 19).
    lines = torpor.ok("inspect", snap).stdout.splitlines()
    assert [line for line in lines if line.startswith("archived")] == ["archived  /dev/shm (tmpfs)"], lines
    w.wait_gone(60)
    r = workers.restore(snap, endpoint=w.endpoint, wait=60)
    assert outputs(infer(r)) == ref
    assert outputs(infer(r)) == ref


def test_gpu_leave_running_original_and_restore_identical(
    torpor: Torpor, workers: Workers, left_running: Booted
) -> None:
    assert outputs(infer(left_running.worker)) == left_running.ref
    r = workers.restore(left_running.snap, endpoint=left_running.worker.endpoint, wait=60)
    assert outputs(infer(r)) == left_running.ref
    assert outputs(infer(left_running.worker)) == left_running.ref


def test_gpu_two_restores_and_original_at_once(
    torpor: Torpor, workers: Workers, left_running: Booted
) -> None:
    snap, endpoint = left_running.snap, left_running.worker.endpoint
    results: list[subprocess.CompletedProcess[str] | None] = [None, None]
    barrier = threading.Barrier(2)

    def restore(i: int) -> None:
        barrier.wait()
        results[i] = torpor("restore", snap, "--detach", timeout=600)

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if r is not None and r.returncode == 0 and r.stdout.strip().isdigit():
            workers.track(int(r.stdout.strip()))
    for r in results:
        assert r is not None and r.returncode == 0, describe(r) if r else "restore thread did not finish"
    instances = [workers.adopt(parse_pid(r), endpoint, f"restored-{i}") for i, r in enumerate(results) if r]
    instances.append(left_running.worker)

    answers: dict[int, tuple[object, object]] = {}
    errors: list[BaseException] = []

    def ask(i: int, w: Worker) -> None:
        try:
            answers[i] = outputs(infer(w))
        except BaseException as e:  # reported below, from the test's thread
            errors.append(e)

    askers = [threading.Thread(target=ask, args=(i, w)) for i, w in enumerate(instances)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert not errors, errors
    assert [answers[i] for i in range(len(instances))] == [left_running.ref] * len(instances)


def test_gpu_restore_onto_another_gpu(torpor: Torpor, workers: Workers, left_running: Booted) -> None:
    gpus = nvidia_gpus()
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs for --gpu mapping, this machine has {len(gpus)}")
    r = workers.restore(left_running.snap, "--gpu", "0=1", endpoint=left_running.worker.endpoint, wait=60)
    assert outputs(infer(r)) == left_running.ref
    on = {uuid for pid, uuid in compute_apps() if pid == r.child_pid}
    assert on == {gpus[1]["uuid"]}, f"restored process runs on {on}, expected GPU 1 {gpus[1]['uuid']}"


def test_gpu_manifest_records_the_gpu(torpor: Torpor, left_running: Booted) -> None:
    doc = torpor.inspect_json(left_running.snap)
    gpu = doc.get("gpu")
    assert isinstance(gpu, dict) and isinstance(gpu.get("gpus"), list) and gpu["gpus"], f"no gpu.gpus: {doc}"
    first = gpu["gpus"][0]
    assert isinstance(first, dict)
    assert first.get("name") == nvidia_gpus()[0]["name"]
    assert "ok" in torpor.ok("verify", left_running.snap).stdout.lower()


@pytest.mark.parametrize(
    "switch",
    [("TORPOR_FAULT", "before-dump"), ("CRIU_FAULT", "1"), ("CRIU_FAULT", "3"), ("TORPOR_FAULT", "after-dump")],
    ids=lambda s: f"{s[0]}={s[1]}",
)
def test_fault_points_after_gpu_checkpoint_roll_back(
    torpor: Torpor, workers: Workers, tmp_path: Path, switch: tuple[str, str]
) -> None:
    """Issue 13.1 with the real driver: a snapshot that fails after the driver's checkpoint (GPU
    memory moved into the process) at each point gives the source back running on the GPU, with
    the same outputs; the CPU twin with the fake driver is tests/test_failures.py's."""
    w = boot(workers, "gpu")
    ref = outputs(infer(w))
    out = tmp_path / "snap"
    r = torpor("snapshot", "--pid", w.init_pid, "--out", out, env={switch[0]: switch[1]}, timeout=600)
    assert r.returncode == 1, describe(r)
    assert "rolling back failed" not in r.stderr, describe(r)
    assert not out.exists()
    assert w.alive(), f"{w} died\n{describe(r)}"
    assert outputs(infer(w)) == ref
    assert any(pid == w.child_pid for pid, _ in compute_apps()), "the source is not back on the GPU"


def test_a_snapshot_killed_after_the_gpu_checkpoint_is_rolled_back_by_its_guard(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    """kill -9 of `torpor snapshot` with every image written (CRIU held at `post-dump` by
    TORPOR_DELAY), the source's GPU memory moved into it by the real driver: the snapshot's guard
    (torpor_snapshot::guard) restores and unlocks it, and it answers as before, on the GPU. The
    fake-driver twin is tests/test_failures.py's."""
    w = boot(workers, "gpu")
    ref = outputs(infer(w))
    p, _stdout, stderr = workers.popen_torpor(
        "snapshot", "--pid", w.init_pid, "--out", tmp_path / "snap", env={"TORPOR_DELAY": "criu-post-dump:20000"},
        new_session=True,
    )
    deadline = time.monotonic() + 300
    while not any("post-dump" in f.read_text(errors="replace") for f in tmp_path.rglob("dump.log")):
        assert p.poll() is None, f"the snapshot ended before post-dump\n{stderr.read_text()}"
        assert time.monotonic() < deadline, f"CRIU did not reach post-dump\n{stderr.read_text()}"
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    deadline = time.monotonic() + 120
    while "CUDA process(es) to running" not in stderr.read_text():
        assert time.monotonic() < deadline, f"the guard did not roll back\n{stderr.read_text()}"
        time.sleep(0.2)
    assert w.alive(), f"{w} died\n{stderr.read_text()}"
    assert outputs(infer(w)) == ref
    assert any(pid == w.child_pid for pid, _ in compute_apps()), "the source is not back on the GPU"
    assert not (tmp_path / "snap").exists()


def test_gpu_migrate_moves_a_running_process_to_the_other_gpu(torpor: Torpor, workers: Workers) -> None:
    """`torpor migrate --pid PID --gpu 1` (crates/torpor-snapshot/src/migrate.rs) on two GPUs of
    one model: the same process answers bit-identically on GPU 1, and back on GPU 0."""
    gpus = nvidia_gpus()
    if len(gpus) < 2 or gpus[0]["name"] != gpus[1]["name"]:
        pytest.skip(f"needs 2 GPUs of one model, this machine has {[g['name'] for g in gpus]}")
    w = boot(workers, "migrate")
    ref = outputs(infer(w))
    for target in (1, 0):
        r = torpor.ok("migrate", "--pid", w.init_pid, "--gpu", str(target), "-v", timeout=300)
        print(r.stdout, r.stderr)
        assert f"to GPU {target}" in r.stdout, r.stdout
        on = {uuid for pid, uuid in compute_apps() if pid == w.child_pid}
        assert on == {gpus[target]["uuid"]}, f"the process runs on {on}, expected GPU {target}"
        assert outputs(infer(w)) == ref
