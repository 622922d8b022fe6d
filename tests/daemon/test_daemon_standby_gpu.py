"""A GPU function's standby of each kind (`scaling.standby_gpu`), through the real daemon, real
workers and real CRIU, with tests/fakes as the GPU (fake_libcuda.c logs every driver call,
fake_nvml.c counts 64 MiB per worker): "released" (the default) restores by CRIU only and leaves
the driver's restore to the request; "live" does the driver's restore ahead, so the request pays
none, and /metrics shows what each standby holds. The GPU machine runs the same kinds on a real
GPU in tests/daemon/test_daemon_gpu.py."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeCuda, descendants

from .conftest import Torpord, fake_gpu_env

MIB = 1 << 20
HANDLER = '''
import torpor


@torpor.function
class Counter:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: dict) -> dict:
        self.calls += 1
        return {"calls": self.calls, "pid": __import__("os").getpid()}
'''


def spec(name: str, kind: str) -> str:
    return f"""name = "{name}"
entry = "handler:Counter"
gpus = 1
gpu_memory = "64MiB"
timeout_s = 30

[scaling]
max_instances = 2
standby = 1
standby_gpu = "{kind}"

[keepalive]
gpu_release_s = 600
hibernate_s = 600
evict_s = 600
"""


@pytest.fixture(scope="module")
def daemon(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Torpord, Path]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path_factory.mktemp("torpord-standby-gpu")
    log = root / "cuda-calls.log"
    env = fake_gpu_env(root, fake_cuda, FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 * MIB}", FAKE_CUDA_LOG=str(log))
    d = Torpord(torpor_bin, root, config="split = false\n", env=env)
    try:
        for name, kind in (("sb-live", "live"), ("sb-released", "released")):
            fdir = root / name
            fdir.mkdir()
            (fdir / "handler.py").write_text(HANDLER)
            (fdir / "torpor.toml").write_text(spec(name, kind))
            d.deploy(fdir)
        yield d, log
    finally:
        d.stop()


def gauge(d: Torpord, metric: str, name: str) -> float:
    text = d.request("GET", "/metrics").body.decode()
    m = re.search(rf'^{metric}{{function="{name}"}} (\S+)$', text, re.MULTILINE)
    assert m, f"{metric} for {name} is not in /metrics"
    return float(m.group(1))


def ready_standby(d: Torpord, name: str, stage: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        live = [i for i in d.instances(name) if i.get("pid")]
        if len(live) == 1 and live[0]["stage"] == stage and gauge(d, "torpor_standby_instances", name) == 1:
            return live[0]
        assert time.monotonic() < deadline, f"no {stage} standby of {name}: {live}\n{d.log_text()}"
        time.sleep(0.1)


def driver_calls(log: Path, pid: int) -> list[str]:
    if not log.exists():
        return []
    return [line.split()[0] for line in log.read_text().splitlines() if line.split()[1:2] == [str(pid)]]


def test_a_live_standby_has_its_gpu_context_before_the_request_and_the_request_pays_no_driver_restore(
    daemon: tuple[Torpord, Path],
) -> None:
    d, log = daemon
    standby = ready_standby(d, "sb-live", "warm")
    # Restored by CRIU with the CUDA state checkpointed, then the driver's restore and unlock,
    # all before any request.
    calls = [c for pid in [standby["pid"], *descendants(standby["pid"])] for c in driver_calls(log, pid)]
    assert calls[-2:] == ["restore", "unlock"], (calls, standby)
    # What it holds while it waits: its context on the GPU (fake NVML: 64 MiB per process of the
    # tree whose command line names torpor.worker), its process.
    assert gauge(d, "torpor_standby_gpu_memory_bytes", "sb-live") >= 64 * MIB
    assert gauge(d, "torpor_standby_host_memory_bytes", "sb-live") > 1 * MIB
    r = d.invoke("sb-live", {})
    assert r.status == 200 and r.start == "standby", (r.status, r.headers, r.body)
    assert r.json()["calls"] == 1
    assert "gpu_resume" not in r.timings and "restore" not in r.timings, r.timings
    # Taken, it is an ordinary warm instance; a new standby takes its place.
    again = d.invoke("sb-live", {})
    assert again.start == "warm" and again.json()["calls"] == 2


def test_a_released_standby_holds_no_gpu_context_and_the_request_pays_the_driver_restore(
    daemon: tuple[Torpord, Path],
) -> None:
    d, _log = daemon
    ready_standby(d, "sb-released", "gpu_released")
    assert gauge(d, "torpor_standby_host_memory_bytes", "sb-released") > 1 * MIB
    r = d.invoke("sb-released", {})
    assert r.status == 200 and r.start == "standby", (r.status, r.headers, r.body)
    assert "gpu_resume" in r.timings and r.json()["calls"] == 1, r.timings


def test_a_bad_standby_gpu_is_refused_at_deploy_in_one_line(daemon: tuple[Torpord, Path], tmp_path: Path) -> None:
    d, _log = daemon
    fdir = tmp_path / "sb-bad"
    fdir.mkdir()
    (fdir / "handler.py").write_text(HANDLER)
    (fdir / "torpor.toml").write_text(spec("sb-bad", "hot"))
    r = d.cli("deploy", fdir)
    assert r.returncode != 0
    assert 'scaling.standby_gpu must be "released" or "live", got "hot"' in r.stderr, r.stderr
