"""examples/vision-workflow ships what its make_weights.py makes: each stage's common.py is the
shared one (copied so each function directory is self-contained) and each stage's weights.npz
holds the arrays of the fixed seed. An edit of the shared file without running make_weights.py
would leave the stages computing with the old one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

VISION = Path(__file__).resolve().parent.parent / "examples" / "vision-workflow"
RERUN = "run python3 examples/vision-workflow/make_weights.py"


def make_weights() -> object:
    spec = importlib.util.spec_from_file_location("vision_make_weights", VISION / "make_weights.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stage", ["detect", "classify", "describe"])
def test_each_stage_holds_the_shared_common_py_and_its_seeded_weights(stage: str) -> None:
    shared = (VISION / "common.py").read_bytes()
    assert (VISION / stage / "common.py").read_bytes() == shared, f"{stage}/common.py differs: {RERUN}"
    expected = make_weights().weights()[stage]  # type: ignore[attr-defined]
    with np.load(VISION / stage / "weights.npz") as got:
        assert sorted(got.files) == sorted(expected), f"{stage}/weights.npz: {RERUN}"
        for name, array in expected.items():
            assert np.array_equal(got[name], array), f"{stage}/weights.npz[{name}]: {RERUN}"
