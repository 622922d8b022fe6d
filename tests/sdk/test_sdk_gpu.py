"""The harness on a GPU: a base worker warms CUDA through torch, loads a torch function, and
quiesce synchronises CUDA. Skipped where torch or a CUDA device is missing."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
from sdkd import FUNCTIONS, Daemon, Spawner

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")


@pytest.fixture(scope="module")
def cuda() -> None:
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.stdout.strip() != "True":
        pytest.skip(f"needs a CUDA device visible to torch ({r.stdout.strip() or r.stderr.strip()[-200:]})")


def test_gpu_base_warm_load_quiesce(cuda: None, spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "base", "--preload", "torch", "--gpu")
    c = daemon.accept(timeout=120)
    assert c.expect("hello")["role"] == "base"
    ready = c.expect("ready", timeout=120)
    assert ready["ok"] is True and ready["warmup_s"] > 0, f"{ready}\n{w.stderr()}"
    print(f"preload torch {ready['setup_s']:.2f} s, GPU warm-up {ready['warmup_s']:.2f} s")
    ready = c.load(FUNCTIONS / "torchmm")
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    first = c.invoke(1, {"x": [0.5, -1.0, 2.0, 0.0]})
    assert first["ok"] is True and first["value"]["calls"] == 2, first
    c.send({"type": "quiesce"})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": True}
    assert c.at_eof()
    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.expect("hello")["resumed"] is True
    again = c2.invoke(2, {"x": [0.5, -1.0, 2.0, 0.0]})
    assert again["value"] == {"y": first["value"]["y"], "calls": 3}, again
    c2.send({"type": "shutdown"})
    assert w.wait(60) == 0
