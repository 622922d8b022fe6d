"""Weight packing (torpor.pack) on the GPU: a model's outputs are bit-identical after packing,
every pack is one whole allocator segment (torpor.shareable vouches for it), tied weights,
aliases and strides survive, weights over memory the allocator did not give stay where they
are, and the old segments are given back; with the device-memory hook
preloaded each pack is a cuda segment of its exact size. Skipped, with the reason shown, without
an NVIDIA GPU or without PyTorch.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PROGRAMS, PYTHON, describe
from test_hook_gpu import has_gpu, has_torch, hook_library

PACK_MODEL = PROGRAMS / "pack_model.py"
PACK_SANDBOX = PROGRAMS / "pack_sandbox.py"

pytestmark = [
    pytest.mark.skipif(not has_gpu(), reason="no NVIDIA GPU (`nvidia-smi -L` fails)"),
    pytest.mark.skipif(has_gpu() and not has_torch(), reason="needs PyTorch"),
]


def run(extra_env: dict[str, str], program: Path = PACK_MODEL) -> dict[str, object]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TORPOR_HOOK_LIB", "TORPOR_HOOK_CUDA")
    }
    r = subprocess.run(
        [PYTHON, str(program)],
        check=False,
        capture_output=True,
        text=True,
        env={**env, **extra_env},
        timeout=600,
    )
    assert r.returncode == 0, describe(r)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(doc, dict)
    return doc


CHECKS = (
    "whole",
    "all_in_packs",
    "own_segments",
    "shareable",
    "tied",
    "alias",
    "strides",
    "untouched",
    "external",
    "released",
)


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "hook"])
def test_packing_keeps_outputs_and_fills_whole_segments(hooked: bool) -> None:
    env: dict[str, str] = {}
    if hooked:
        lib = str(hook_library())
        env = {"LD_PRELOAD": lib, "TORPOR_HOOK_LIB": lib, "TORPOR_HOOK_CUDA": "1"}
    doc = run(env)
    print(doc)
    assert doc["after"] == doc["before"], "packing changed the model's output"
    assert {k: doc[k] for k in CHECKS} == dict.fromkeys(CHECKS, True), doc
    assert doc["left_bytes"] == 0, doc
    # The weights (tests/programs/pack_model.py: five 3.52 MiB layers, a 20.9 MiB embedding, ...)
    # in packs of at most 20 MiB, the embedding in one of its own: at least four packs, each
    # storage once (the tied head and the alias add tensors, not storages).
    assert isinstance(doc["packs"], int) and doc["packs"] >= 4, doc
    assert isinstance(doc["tensors"], int) and isinstance(doc["storages"], int), doc
    assert doc["tensors"] == doc["storages"] + 1, doc
    # Loaded beside staging blocks, the weights' segments were not shareable before packing.
    assert doc["shareable_before"] == 0, doc
    assert doc["hook_segments"] is (True if hooked else None), doc


def test_outputs_are_the_same_with_and_without_the_hook() -> None:
    lib = str(hook_library())
    plain = run({})
    hooked = run({"LD_PRELOAD": lib, "TORPOR_HOOK_LIB": lib, "TORPOR_HOOK_CUDA": "1"})
    assert hooked["after"] == plain["before"], (plain, hooked)


def test_a_sandboxs_later_function_is_packed_beside_the_pools_of_those_before_it() -> None:
    """A sandbox's second function is packed although the first's request pool and graph
    capture are private pools of the allocator (refused until session 48, so a sandbox's later
    functions never shared their weights); a function's own capture still stops its packing."""
    lib = str(hook_library())
    doc = run({"LD_PRELOAD": lib, "TORPOR_HOOK_LIB": lib, "TORPOR_HOOK_CUDA": "1"}, PACK_SANDBOX)
    print(doc)
    # The first function's capture and its request pool (the block its request left).
    assert isinstance(doc["private_pools"], int) and doc["private_pools"] >= 2, doc
    for check in ("second_packed", "second_same", "whole", "shareable", "first_same", "unnamed_refused"):
        assert doc[check] is True, (check, doc)
    assert "private memory pool" in str(doc["third_refused"]), doc
