"""GPU memory exhausted by another process, on a real GPU (issue 13, item 4): a hog process holds
all but a little of the GPU's memory, then the daemon deploys (the base's CUDA warm-up, or the
restore of a base snapshot, finds no room) and restores (its own check finds no room). Each fails
in one line that names the lack of GPU memory and what to do; a request waits within its queue
timeout and is answered 503 with Retry-After; nothing of the daemon's is left running, and once
the hog goes the same function deploys and serves. Skipped without torch and a CUDA device; the
fake-GPU versions of the same promises run everywhere (tests/daemon/test_daemon_gpu_memory.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, pids_with

from .conftest import Torpord
from .test_daemon_migrate_gpu import gpus, uuid_of_pid

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

TORCHMM = ROOT / "tests" / "sdk" / "functions" / "torchmm"
MIB = 1 << 20
# What the hog leaves free: less than a PyTorch CUDA context needs (~350-600 MiB on the H100).
LEAVE = 128 * MIB

HOG = f"""
import sys, torch
held = []
for d in range(torch.cuda.device_count() if sys.argv[1] == "all" else 1):
    free, total = torch.cuda.mem_get_info(d)
    held.append(torch.empty(max(free - {LEAVE}, 0), dtype=torch.uint8, device=f"cuda:{{d}}"))
    free, total = torch.cuda.mem_get_info(d)
    print(f"GPU {{d}}: holding {{held[-1].numel() >> 20}} MiB, {{free >> 20}} MiB free of {{total >> 20}}; ", end="")
print(flush=True)
sys.stdin.read()
"""


class Hog:
    """Another process holding all but LEAVE of the memory of every GPU (`gpus = "all"`: a
    node of several GPUs would place the restore on another one) or of GPU 0 alone, until
    `release`."""

    def __init__(self, gpus: str = "all") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOG, gpus], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()
        assert self.line.startswith("GPU 0: holding"), f"the hog did not start: {self.line!r}"
        print("hog:", self.line)

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # The driver frees a dead process's memory shortly after it is reaped.
        time.sleep(1.0)


@pytest.fixture()
def daemon(torpor_bin: Path, criu_ready: None, cuda: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path, config=request.param, queue_timeout_s=3)
    try:
        yield d
    finally:
        d.stop()


def daemons_processes(d: Torpord) -> list[int]:
    return sorted(pids_with(f"{d.state}/"))


def settle(d: Torpord, want: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (got := daemons_processes(d)) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


MODES = ["split_gpu = true\n", "split_gpu = false\n"]


@pytest.mark.parametrize("daemon", MODES, indirect=True, ids=["split", "transparent"])
def test_a_deploy_on_a_full_gpu_fails_in_one_line_and_leaves_nothing(daemon: Torpord) -> None:
    before = daemons_processes(daemon)
    hog = Hog()
    try:
        r = daemon.cli("deploy", TORCHMM, timeout=300)
        # The API's last line names the node's GPU as the cause (a cluster deploys elsewhere).
        api = daemon.request("POST", "/v1/functions", {"dir": str(TORCHMM)}, timeout=300)
    finally:
        hog.release()
    assert r.returncode != 0, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    print("deploy:", line)
    assert "free GPU memory" in line and "memory" in line.lower(), (line, daemon.log_text())
    last = json.loads(api.body.decode().strip().splitlines()[-1])
    assert last.get("cause") == "gpu_memory", last
    assert settle(daemon, before) == before
    daemon.deploy(TORCHMM)
    r2 = daemon.invoke("torchmm", {"x": [0.5, -1.0, 2.0, 0.0]}, timeout=180)
    assert r2.status == 200, (r2.status, r2.body, daemon.log_text())


@pytest.mark.parametrize("daemon", MODES, indirect=True, ids=["split", "transparent"])
def test_a_restore_on_a_full_gpu_waits_then_answers_503_and_leaves_nothing(daemon: Torpord) -> None:
    daemon.deploy(TORCHMM)
    assert daemon.instances("torchmm") == []
    before = daemons_processes(daemon)
    hog = Hog()
    try:
        t0 = time.monotonic()
        r = daemon.invoke("torchmm", {"x": [0.5, -1.0, 2.0, 0.0]}, timeout=180)
        waited = time.monotonic() - t0
        print("restore:", r.status, r.body.decode(errors="replace"), f"{waited:.1f} s")
        assert r.status == 503, (r.status, r.body, daemon.log_text())
        msg = r.body.decode()
        assert "free GPU memory" in msg and "\n" not in msg.strip(), msg
        # Every GPU full: on a node of two of one model the retry went to the other, and the
        # answer names both (runtime::start::GpuShortfalls).
        g = gpus()
        if len(g) >= 2 and g[0][0] == g[1][0]:
            assert "GPU 0 has" in msg and "GPU 1 has" in msg, msg
        assert r.headers.get("retry-after"), r.headers
        assert daemon.instances("torchmm") == []
        assert settle(daemon, before) == before
        assert "booting an instance instead" not in daemon.log_text()
    finally:
        hog.release()
    r = daemon.invoke("torchmm", {"x": [0.5, -1.0, 2.0, 0.0]}, timeout=180)
    assert r.status == 200 and r.start == "restored", (r.status, r.body, daemon.log_text())


@pytest.mark.parametrize("daemon", MODES[:1], indirect=True, ids=["split"])
def test_a_restore_that_finds_gpu_0_full_is_placed_on_another_gpu_and_answers(daemon: Torpord) -> None:
    """On a node of two GPUs of one model (nvidia-h200-x2), another process filling GPU 0 does not
    cost a request: the restore placed there finds no room, GPU 0 is passed over for a while
    (device_choice::SHORT_MEMORY_PAUSE), and the request starts again at once onto GPU 1, where
    NVML shows the instance."""
    g = gpus()
    if len(g) < 2 or g[0][0] != g[1][0]:
        pytest.skip(f"needs two GPUs of one model (nvidia-h200-x2); nvidia-smi lists {g}")
    daemon.deploy(TORCHMM)
    hog = Hog("first")
    try:
        r = daemon.invoke("torchmm", {"x": [0.5, -1.0, 2.0, 0.0]}, timeout=180)
        assert r.status == 200 and r.start == "restored", (r.status, r.body, daemon.log_text())
        (inst,) = daemon.instances("torchmm")
        assert inst["device"] == 1, (inst, daemon.log_text())
        assert uuid_of_pid(inst["pid"]) == g[1][1], (inst, g)
        log = daemon.log_text()
        assert "starting again at once on another GPU" in log, log
        assert "the request waits for one to free up" not in log, log
        print("timings:", {k: round(v, 3) for k, v in r.timings.items() if k in ("queue", "restore", "total")})
    finally:
        hog.release()


@pytest.mark.parametrize("daemon", MODES, indirect=True, ids=["split", "transparent"])
def test_a_wake_that_finds_gpu_0_full_is_served_at_once_from_another_gpu(daemon: Torpord, tmp_path: Path) -> None:
    """On a node of two GPUs of one model (nvidia-h200-x2): an instance hibernated on GPU 0, then
    another process filling GPU 0. The wake restores where the hibernation was taken and finds
    no room; the hibernated instance is discarded (as any failed wake) and the function snapshot
    restored onto GPU 1 at once, its GPU 0 passed over (no wait of a second, no second try there)."""
    g = gpus()
    if len(g) < 2 or g[0][0] != g[1][0]:
        pytest.skip(f"needs two GPUs of one model (nvidia-h200-x2); nvidia-smi lists {g}")
    fdir = tmp_path / "torchhib"
    shutil.copytree(TORCHMM, fdir)
    spec = fdir / "torpor.toml"
    spec.write_text(spec.read_text().replace('name = "torchmm"', 'name = "torchhib"')
                    + "\n[keepalive]\ngpu_release_s = 1\nhibernate_s = 2\nevict_s = 600\n")
    daemon.deploy(fdir)
    x = {"x": [0.5, -1.0, 2.0, 0.0]}
    first = daemon.invoke("torchhib", x, timeout=180)
    assert first.status == 200 and first.start == "restored", (first.status, first.body, daemon.log_text())
    assert [i["device"] for i in daemon.instances("torchhib")] == [0], daemon.instances("torchhib")
    deadline = time.monotonic() + 120
    while [i["stage"] for i in daemon.instances("torchhib")] != ["hibernated"]:
        assert time.monotonic() < deadline, (daemon.instances("torchhib"), daemon.log_text())
        time.sleep(0.2)
    hog = Hog("first")
    try:
        r = daemon.invoke("torchhib", x, timeout=180)
        assert r.status == 200 and r.start == "restored", (r.status, r.body, daemon.log_text())
        assert r.json() == first.json(), (r.body, first.body)
        live = [i for i in daemon.instances("torchhib") if i.get("pid")]
        assert [i["device"] for i in live] == [1], (live, daemon.log_text())
        assert uuid_of_pid(live[0]["pid"]) == g[1][1], (live, g)
        log = daemon.log_text()
        assert "cannot wake the hibernated instance; discarding it" in log, log
        assert "the request waits for one to free up" not in log, log
        assert "starting again at once on another GPU" not in log, log
        print("timings:", {k: round(v, 3) for k, v in r.timings.items() if k in ("queue", "restore", "total")})
    finally:
        hog.release()
