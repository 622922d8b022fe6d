"""Sandboxes on the GPU (issue 11; docs/sandboxes.md): examples/vision-workflow's GPU variant
(torch on CUDA, made by its make_weights.py --gpu) deployed through the real daemon: its three
stages share one sandbox (one CUDA context, a stream per request thread) and hand CUDA tensors
to each other through the store; the answer equals the NumPy variant's on the CPU. Skipped
without PyTorch and a CUDA device."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Torpord

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

ROOT = Path(__file__).resolve().parents[2]
VISION = ROOT / "examples" / "vision-workflow"

# The three stages run in this process with the NumPy backend: the expected answer.
EXPECTED = """
import importlib, json, sys
from pathlib import Path
import torpor
out = None
value = {"seed": 3, "request": "expected"}
for stage in ("detect", "classify", "describe"):
    d = Path(sys.argv[1]) / stage
    torpor.use_dir(d)
    sys.path.insert(0, str(d))
    for m in ("model", "common"):
        sys.modules.pop(m, None)
    mod = importlib.import_module("model")
    cls = next(v for v in vars(mod).values() if getattr(v, "__torpor_function__", False))
    f = cls()
    f.setup()
    sys.path.pop(0)
    value = f(value)
print(json.dumps(value))
"""


def test_the_gpu_vision_workflow_runs_in_one_sandbox_and_matches_the_cpu(cuda: None, torpord: Torpord, tmp_path: Path) -> None:
    gpu = tmp_path / "vision-gpu"
    subprocess.run([sys.executable, VISION / "make_weights.py", "--gpu", gpu], check=True, timeout=120)
    env = dict(os.environ, VISION_WORKFLOW_BACKEND="numpy", PYTHONPATH=str(ROOT / "python"))
    r = subprocess.run([sys.executable, "-c", EXPECTED, VISION], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    expected = json.loads(r.stdout)
    for stage in ("detect", "classify", "describe"):
        lines = torpord.deploy(gpu / stage)
        assert any(line.get("phase") == "load" for line in lines), lines
    r = torpord.cli("deploy", "--json", gpu)
    assert r.returncode == 0 and json.loads(r.stdout)["one_sandbox"] is True, (r.stdout, r.stderr)
    a = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"seed": 3, "request": "gpu"})
    assert a.status == 200, (a.status, a.body, torpord.log_text())
    got = a.json()
    assert a.timings["sandbox"] == 1.0
    assert got["caption"] == expected["caption"] and got["topic"] == expected["topic"], (got, expected)
    assert got["boxes"] == expected["boxes"]
    for t, p in expected["scores"].items():
        assert math.isclose(got["scores"][t], p, abs_tol=2e-3), (got["scores"], expected["scores"])
    # Warm: the same sandbox answers again.
    again = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"seed": 3})
    assert again.status == 200 and again.json()["caption"] == expected["caption"]
