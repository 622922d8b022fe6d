"""`torpor serve --cold-start boot`: snapshots off at invoke, the benchmark's baseline. A cold
start boots a fresh worker (launch, import, setup, warm-up) and answers `X-Torpor-Start:
booted`; keep-alive is the same except that an instance idle past hibernate_s is stopped, as
there is no snapshot to hibernate to, and the next request boots again."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from .conftest import FUNCTIONS, Torpord

CPU_MLP = ROOT / "examples" / "cpu-mlp"
SLEEPY = FUNCTIONS / "sleepy"
X16 = [float(i % 7) - 3.0 for i in range(16)]


@pytest.fixture(scope="module")
def booting(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord-boot"), "--cold-start", "boot")
    try:
        yield d
    finally:
        d.stop()


def test_cold_starts_boot_a_fresh_worker_and_warm_ones_reuse_it(booting: Torpord) -> None:
    booting.deploy(CPU_MLP)
    request = {"x": X16}
    local = subprocess.run(
        ["python3", str(CPU_MLP / "model.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "python")),
        check=True,
    )
    first = booting.invoke("cpu-mlp", request)
    assert first.status == 200 and first.start == "booted", (first.status, first.headers, first.body)
    assert first.json() == json.loads(local.stdout)
    parts = [f"load.{k}" for k in ("data", "map", "import", "setup", "pack", "warmup")]
    assert {"boot", "load", "start", "handler", *parts} <= set(first.timings), sorted(first.timings)
    # The load's parts, as the daemon and the worker timed them, lie within it.
    assert sum(first.timings[k] for k in parts) <= first.timings["load"], first.timings
    assert "restore" not in first.timings
    second = booting.invoke("cpu-mlp", request)
    assert second.status == 200 and second.start == "warm"
    assert second.json() == first.json()
    metrics = booting.request("GET", "/metrics").body.decode()
    assert 'torpor_starts_total{function="cpu-mlp",kind="booted"} 1' in metrics, metrics


def test_an_idle_instance_is_stopped_at_hibernate_s_and_the_next_request_boots(booting: Torpord) -> None:
    booting.deploy(SLEEPY)
    assert booting.invoke("sleepy", {"add": 2}).json() == {"calls": 1, "total": 2}
    assert booting.invoke("sleepy", {"add": 2}).json() == {"calls": 2, "total": 4}
    deadline = time.monotonic() + 30
    while booting.instances("sleepy"):
        assert time.monotonic() < deadline, booting.instances("sleepy")
        time.sleep(0.05)
    assert not list((booting.state / "snapshots").glob("hib-*"))
    again = booting.invoke("sleepy", {"add": 2})
    assert again.status == 200 and again.start == "booted", (again.status, again.body)
    assert again.json() == {"calls": 1, "total": 2}  # a fresh process: nothing carried over

    logs = booting.request("GET", "/v1/functions/sleepy/logs").json()["files"]
    # Each booted instance has its own log, the newest first.
    booted = [f for f in logs if f["instance"] is not None]
    assert len(booted) == 2, logs
    assert "sleepy call 1" in booted[0]["tail"] and "sleepy call 2" not in booted[0]["tail"], booted
    assert "sleepy call 2" in booted[1]["tail"], booted
