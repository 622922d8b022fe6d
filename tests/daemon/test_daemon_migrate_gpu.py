"""Live migration of a GPU instance between two real GPUs of one model (issue 10 item 3;
docs/migration.md), through the real daemon, the real driver and CRIU. Skipped unless torch sees
a CUDA device and `nvidia-smi -L` lists two GPUs of one model (nvidia-h200-x2:
`TESTS=tests/daemon/test_daemon_migrate_gpu.py scripts/gpu-run.sh tests`).

The function (tests/daemon/functions/gpustate) keeps its state in a writable 64 MiB GPU tensor.
A step request sent after the pre-copy has read the segments (held open with
`TORPORD_DELAY=migrate-precopy`) writes to it: the stop must find the changed blocks and copy
them, or the state after the move would miss that step. The state is checked against the same
steps done on the CPU, and `nvidia-smi` must show the worker's process on the target GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

FUNCTION = FUNCTIONS / "gpustate"


def expected_sha(ks: list[int]) -> str:
    """The function's own state after steps `ks`, computed on the CPU (its model.py, loaded by
    path: other functions' files are called model.py too)."""
    spec = importlib.util.spec_from_file_location("gpustate_model", FUNCTION / "model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.expected_sha(ks))


def gpus() -> list[tuple[str, str]]:
    """(model, UUID) of each GPU, by ordinal."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [tuple(x.strip() for x in line.split(",", 1)) for line in r.stdout.splitlines() if "," in line]  # type: ignore[misc]


def tree_of(pid: int) -> set[int]:
    """`pid` and its descendants: an instance's pid is its tree's init, and the CUDA process is
    the worker below it."""
    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return seen


def uuid_of_pid(pid: int) -> str | None:
    """The GPU whose memory the instance with tree init `pid` holds (NVML's compute processes),
    or None."""
    r = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60, check=False
    )
    tree = {str(p) for p in tree_of(pid)}
    on = {u.strip() for p, _, u in (line.partition(",") for line in r.stdout.splitlines()) if p.strip() in tree}
    assert len(on) <= 1, f"the instance's processes hold memory on several GPUs: {on}"
    return on.pop() if on else None


@pytest.fixture(scope="module")
def two_gpus(cuda: None) -> list[tuple[str, str]]:
    g = gpus()
    if len(g) < 2 or g[0][0] != g[1][0]:
        pytest.skip(f"needs two GPUs of one model (nvidia-h200-x2); nvidia-smi lists {g}")
    return g


def daemon(torpor_bin: Path, tmp_path: Path, env: dict[str, str]) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    return Torpord(torpor_bin, tmp_path / "daemon", env=env, queue_timeout_s=60)


@pytest.fixture
def held(torpor_bin: Path, criu_ready: None, two_gpus: Any, tmp_path: Path) -> Iterator[Torpord]:
    d = daemon(torpor_bin, tmp_path, {"TORPORD_DELAY": "migrate-precopy:3000"})
    try:
        yield d
    finally:
        d.stop()


def ask(d: Torpord, request: dict[str, Any]) -> dict[str, Any]:
    r = d.invoke("gpustate", request, timeout=180)
    assert r.status == 200, (r.status, r.body, d.log_text())
    return dict(r.json())


def started(d: Torpord) -> dict[str, Any]:
    d.deploy(FUNCTION)
    first = ask(d, {"op": "step", "k": 1})
    assert first["sha"] == expected_sha([1]), first
    (inst,) = d.instances("gpustate")
    return dict(inst)


def test_a_gpu_instance_moves_to_the_other_gpu_with_a_write_during_the_copy_and_back(
    held: Torpord, two_gpus: list[tuple[str, str]]
) -> None:
    d = held
    inst = started(d)
    assert uuid_of_pid(inst["pid"]) == two_gpus[0][1], (inst, two_gpus)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=d.request("POST", f"/v1/instances/{inst['id']}/migrate", {"gpu": 1}, timeout=300)))
    t.start()
    deadline = time.monotonic() + 120
    while "TORPORD_DELAY delays this point" not in d.log.read_text(errors="replace"):
        assert time.monotonic() < deadline and t.is_alive(), d.log_text()
        time.sleep(0.02)
    # After the pre-copy read the state: this write is in the old memory only.
    during = ask(d, {"op": "step", "k": 2})
    assert during["sha"] == expected_sha([1, 2]), during
    t.join(300)
    r = result["r"]
    assert r.status == 200, (r.status, r.body, d.log_text())
    m = r.json()
    print("migrated:", m)
    assert (m["from"], m["to"], m["residue_moved"]) == (0, 1, True), m
    assert m["changed_blocks"] >= 1, m
    (row,) = d.instances("gpustate")
    assert (row["id"], row["pid"]) == (inst["id"], inst["pid"]), row
    assert uuid_of_pid(inst["pid"]) == two_gpus[1][1], "nvidia-smi does not show the worker on GPU 1"
    # The write made during the copy is there, and the state goes on from it, bit for bit.
    after = ask(d, {"op": "step", "k": 3})
    assert after["sha"] == expected_sha([1, 2, 3]) and after["calls"] == during["calls"] + 1, after
    # And back.
    back = d.cli("migrate", "--instance", inst["id"], "--gpu", "0", timeout=300)
    assert back.returncode == 0, (back.stdout, back.stderr, d.log_text())
    assert uuid_of_pid(inst["pid"]) == two_gpus[0][1]
    again = ask(d, {"op": "step", "k": 4})
    assert again["sha"] == expected_sha([1, 2, 3, 4]), again


def test_a_failure_after_the_residue_moved_puts_it_back_on_the_old_gpu(
    torpor_bin: Path, criu_ready: None, two_gpus: list[tuple[str, str]], tmp_path: Path
) -> None:
    """`map` fails after the driver moved the CUDA state: the undo moves it back with the
    same pairs and maps the old segments; it serves on GPU 0 with its state."""
    d = daemon(torpor_bin, tmp_path, {"TORPORD_FAULT": "migrate:map"})
    try:
        inst = started(d)
        r = d.request("POST", f"/v1/instances/{inst['id']}/migrate", {"gpu": 1}, timeout=300)
        assert r.status == 500, (r.status, r.body)
        assert "failed at map: forced by TORPORD_FAULT; it serves on, on GPU 0" in r.json()["error"], r.body
        (row,) = d.instances("gpustate")
        assert (row["id"], row["pid"], row["stage"]) == (inst["id"], inst["pid"], "warm"), row
        assert uuid_of_pid(inst["pid"]) == two_gpus[0][1]
        after = ask(d, {"op": "step", "k": 2})
        assert after["sha"] == expected_sha([1, 2]), after
    finally:
        d.stop()
