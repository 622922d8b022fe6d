"""Placement over two real GPUs of one model (docs/torpord.md, "Several GPUs"), through the real
daemon, the real driver and CRIU: what tests/daemon/test_daemon_placement.py checks on fake GPUs,
checked where the driver itself moves the process. Skipped unless torch sees a CUDA device and
`nvidia-smi` lists two GPUs of one model (nvidia-h200-x2:
`TESTS=tests/daemon/test_daemon_placement_gpu.py scripts/gpu-run.sh tests`).

Where an instance runs is read from NVML (`nvidia-smi`'s compute processes, by the instance's
process tree), never from the daemon: the daemon's `device` must agree with it. Every answer is
a digest of a product computed on the GPU, bit-identical on both GPUs.
"""

from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import Answer, Torpord
from .test_daemon_migrate_gpu import daemon, two_gpus, uuid_of_pid
from .test_daemon_placement import two_at_once

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

__all__ = ["two_gpus"]  # a fixture, used by name

HANDLER = '''
import hashlib
import time
from typing import Any

import torch
import torpor


@torpor.function
class Product:
    def setup(self) -> None:
        g = torch.Generator().manual_seed(0)
        # 16 MiB: a segment of its own on the split path.
        self.w = torch.randn(2048, 2048, generator=g).cuda()
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        time.sleep(float(request.get("sleep_s", 0)))
        y = (self.w @ self.w).sum(dim=0)
        torch.cuda.synchronize()
        return {"digest": hashlib.sha256(y.cpu().numpy().tobytes()).hexdigest(), "calls": self.calls}
'''


def function(tmp_path: Path, name: str, scaling: str, keepalive: str) -> Path:
    fdir = tmp_path / name
    fdir.mkdir()
    (fdir / "handler.py").write_text(HANDLER)
    (fdir / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "handler:Product"\npreload = ["torch"]\ngpus = 1\n'
        'gpu_memory = "512MiB"\nload_timeout_s = 120\ntimeout_s = 60\n'
        f"\n[scaling]\nmax_instances = 2\nrequests_per_instance = 1\n{scaling}"
        f"\n[keepalive]\n{keepalive}"
    )
    return fdir


def held_pair(d: Torpord, name: str) -> list[Answer]:
    """Two requests 0.3 s apart, each held 3 s in the handler, so that the second finds the
    first's instance busy."""
    return two_at_once(d, name, {"sleep_s": 3.0}, stagger_s=0.3, timeout=240)


def on_their_gpus(d: Torpord, name: str, gpus: list[tuple[str, str]]) -> dict[str, int]:
    """Each instance's id → device, after checking that NVML shows its processes on that
    device's GPU, and that the two are on GPUs 0 and 1."""
    rows = [i for i in d.instances(name) if i.get("pid")]
    placed = {i["id"]: i["device"] for i in rows}
    assert sorted(placed.values()) == [0, 1], (rows, d.log_text())
    for i in rows:
        assert uuid_of_pid(i["pid"]) == gpus[i["device"]][1], (i, gpus)
    return placed


def wait_for(d: Torpord, name: str, what: str, ok: Any, timeout: float = 120.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = d.instances(name)
        if ok(rows):
            return rows
        assert time.monotonic() < deadline, f"{name}: no {what}: {rows}\n{d.log_text()}"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["live", "released"])
def test_two_standbys_stand_by_on_both_gpus_and_serve_there(
    kind: str, torpor_bin: Path, criu_ready: None, two_gpus: list[tuple[str, str]], tmp_path: Path
) -> None:
    """`standby = 2` on the split path: one standby per GPU. A live one's driver restore, done
    ahead with the GPU pairs, puts its context on its GPU before any request; a released one
    holds no GPU memory until its first request resumes it there, with the pairs it owes."""
    d = daemon(torpor_bin, tmp_path, {})
    try:
        d.deploy(function(tmp_path, "sb2", f'standby = 2\nstandby_gpu = "{kind}"\n', "gpu_release_s = 600\nhibernate_s = 600\nevict_s = 600\n"))
        stage = "warm" if kind == "live" else "gpu_released"
        gauge = re.compile(r'^torpor_standby_instances\{function="sb2"\} 2$', re.M)

        def ready(rows: list[dict[str, Any]]) -> bool:
            if sum(bool(r.get("pid")) and r["stage"] == stage for r in rows) != 2:
                return False
            return bool(gauge.search(d.request("GET", "/metrics").body.decode()))

        rows = wait_for(d, "sb2", "two standbys", ready)
        assert sorted(r["device"] for r in rows) == [0, 1], (rows, d.log_text())
        if kind == "live":
            before = on_their_gpus(d, "sb2", two_gpus)
        else:
            assert [uuid_of_pid(r["pid"]) for r in rows] == [None, None], "a released standby holds GPU memory"
            before = {r["id"]: r["device"] for r in rows}
        answers = held_pair(d, "sb2")
        for a in answers:
            assert a.status == 200 and a.start == "standby", (a.status, a.body, a.headers, d.log_text())
            print(kind, "standby answered:", a.timings)
        assert answers[0].json() == answers[1].json(), [a.json() for a in answers]
        # The instances that served are the standbys, where they stood by.
        assert on_their_gpus(d, "sb2", two_gpus) == before
        metrics = d.request("GET", "/metrics").body.decode()
        print(kind, "fills by source:", re.findall(r'^torpor_restore_fill_gbps_(?:count|sum)\{source="\w+"\} \S+$', metrics, re.M))
    finally:
        d.stop()


def test_a_transparent_instance_on_gpu_1_hibernates_and_wakes_there(
    torpor_bin: Path, criu_ready: None, two_gpus: list[tuple[str, str]], tmp_path: Path
) -> None:
    """`split_gpu = false`: the driver's checkpoint holds all of the function's GPU memory. Two
    instances started at once land on GPUs 0 and 1; hibernated, each wakes (same id, its state
    kept) on the GPU it was checkpointed on, as the daemon counts it."""
    d = Torpord(torpor_bin, tmp_path / "daemon", config="split_gpu = false\n", queue_timeout_s=60)
    try:
        d.deploy(function(tmp_path, "tr2", "", "gpu_release_s = 1\nhibernate_s = 4\nevict_s = 600\n"))
        first = held_pair(d, "tr2")
        for a in first:
            assert a.status == 200 and a.start == "restored" and a.json()["calls"] == 1, (a.status, a.body, d.log_text())
        assert first[0].json()["digest"] == first[1].json()["digest"]
        placed = on_their_gpus(d, "tr2", two_gpus)

        wait_for(d, "tr2", "two hibernated instances", lambda rs: [r["stage"] for r in rs] == ["hibernated"] * 2)
        woken = held_pair(d, "tr2")
        for a in woken:
            assert a.status == 200 and a.start == "restored", (a.status, a.body, d.log_text())
            # Its own state: the hibernated instance woke, no new one started.
            assert a.json() == {"digest": first[0].json()["digest"], "calls": 2}, a.json()
            print("woken:", a.timings)
        assert on_their_gpus(d, "tr2", two_gpus) == placed
    finally:
        d.stop()
