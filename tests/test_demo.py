"""`make demo` (scripts/demo.py), so that the demo cannot rot: a real torpord, a real deploy,
every step of the demo, and nothing left running afterwards. The CPU example runs everywhere; the
GPU one (ResNet-152, with the gpu_released stage) where there is a GPU with PyTorch."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, pids_with


def run_demo(torpor_bin: Path, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, ROOT / "scripts/demo.py", *args],
        env={**os.environ, "TORPOR_BIN": str(torpor_bin)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    return r.stdout


def assert_every_step(out: str, name: str, stages: tuple[str, ...]) -> None:
    assert f"deployed {name}" in out, out
    assert re.search(r"^1\. from-scratch boot: +booted ", out, re.MULTILINE), out
    assert re.search(r"^2\. cold start \(snapshot\): +restored .* identical output", out, re.MULTILINE), out
    assert re.search(r"^3\. warm call: +warm .* identical output", out, re.MULTILINE), out
    burst = re.search(r"^4\. 3 requests at once: +(.*) identical output", out, re.MULTILINE)
    assert burst is not None, out
    # Bound late, the warm instance may answer all three; the instances they started come up
    # anyway (the demo checks two or more live ones, else it fails).
    assert set(re.findall(r"\b(warm|restored)\b", burst.group(1))) <= {"warm", "restored"}, out
    assert len(re.findall(r"\b(?:warm|restored) [\d.]+ s", burst.group(1))) == 3, out
    for stage in stages:
        assert re.search(rf"^ +idle +[\d.]+ s: .*\b{stage}\b", out, re.MULTILINE), out
    assert re.search(r"^6\. wake from evicted: +restored .* identical output", out, re.MULTILINE), out
    restored = rf'^ +torpor_starts_total\{{function="{name}",kind="restored"\}} [1-9]'
    assert re.search(restored, out, re.MULTILINE), out
    assert "no process or mount left" in out, out
    temp = re.search(r"state (/tmp/torpor-demo-[^/]+)/state", out)
    assert temp is not None, out
    assert not Path(temp.group(1)).exists()
    assert pids_with(temp.group(1)) == []


def test_the_runtime_demo_runs_every_step_on_the_cpu_example(torpor_bin: Path, criu_ready: None) -> None:
    out = run_demo(torpor_bin, "--cpu")
    assert "CPU: examples/cpu-mlp" in out, out
    assert_every_step(out, "cpu-mlp", ("hibernated", "evicted"))


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is None or importlib.util.find_spec("torch") is None,
    reason="needs an NVIDIA GPU and PyTorch",
)
def test_the_runtime_demo_runs_every_step_on_the_gpu_example(torpor_bin: Path, criu_ready: None) -> None:
    out = run_demo(torpor_bin)
    assert "GPU: examples/resnet152" in out, out
    assert_every_step(out, "resnet152", ("gpu_released", "hibernated", "evicted"))
