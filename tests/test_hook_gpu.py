"""The device-memory hook in a real PyTorch process on the GPU: cudaMalloc interposition.

A ResNet-style forward pass runs plainly and with libtorpor_hook.so preloaded
(TORPOR_HOOK_CUDA=1): the outputs are bit-identical, PyTorch's caching allocator got its blocks
from the hook (cuda segments > 0), and after releasing every segment and mapping the exported
memory back at the same addresses the output is still the same. Skipped, with the reason shown,
without an NVIDIA GPU or without PyTorch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import PROGRAMS, PYTHON, ROOT, describe

HOOK_RESNET = PROGRAMS / "hook_resnet.py"


def has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def has_torch() -> bool:
    return subprocess.run([PYTHON, "-c", "import torch"], capture_output=True, timeout=120).returncode == 0


pytestmark = [
    pytest.mark.skipif(not has_gpu(), reason="no NVIDIA GPU (`nvidia-smi -L` fails)"),
    pytest.mark.skipif(has_gpu() and not has_torch(), reason="needs PyTorch"),
]


def hook_library() -> Path:
    """$TORPOR_HOOK_LIB, else what `make gpu-carry` copied to .gpu/, else a local build."""
    candidates = [os.environ.get("TORPOR_HOOK_LIB", "")]
    candidates += [str(ROOT / p) for p in (".gpu/libtorpor_hook.so", "target/release/libtorpor_hook.so")]
    candidates += [str(ROOT / "target/debug/libtorpor_hook.so")]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise AssertionError("libtorpor_hook.so not found: run `make gpu-carry` (or set TORPOR_HOOK_LIB)")


def run(extra_env: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TORPOR_HOOK_LIB", "TORPOR_HOOK_CUDA")}
    r = subprocess.run(
        [PYTHON, str(HOOK_RESNET)], capture_output=True, text=True, env={**env, **extra_env}, timeout=600
    )
    assert r.returncode == 0, describe(r)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(doc, dict)
    return doc


def test_cuda_malloc_interposition_gives_identical_outputs_and_segments_that_remap() -> None:
    lib = str(hook_library())
    plain = run({})
    hooked = run({"LD_PRELOAD": lib, "TORPOR_HOOK_LIB": lib, "TORPOR_HOOK_CUDA": "1"})
    assert plain["cuda_segments"] == 0
    assert isinstance(hooked["cuda_segments"], int) and hooked["cuda_segments"] > 0, hooked
    assert hooked["out"] == plain["out"], "the output differs with VMM-backed allocations"
    assert hooked["after_remap"] == plain["out"], "the output differs after release and map back"
    # The forward pass recorded first-use order: the stem convolution's segment is first.
    assert isinstance(hooked["marked"], int) and hooked["marked"] > 0, hooked
    assert hooked["first_use_ok"] is True, hooked
    # The hook without TORPOR_HOOK_CUDA=1 leaves allocations alone.
    passive = run({"LD_PRELOAD": lib, "TORPOR_HOOK_LIB": lib})
    assert passive["cuda_segments"] == 0 and passive["out"] == plain["out"], passive
