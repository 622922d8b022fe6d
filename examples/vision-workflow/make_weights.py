"""Writes the weights of the three stages once (fixed seed; the files are in the repository, so
this only needs to run again to change them), copies common.py into each stage's directory,
and with --gpu DEST writes the GPU variant (torch on CUDA: gpus = 1, preload torch) to DEST.

    python3 examples/vision-workflow/make_weights.py            # weights + common.py
    python3 examples/vision-workflow/make_weights.py --gpu /tmp/vision-gpu
"""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
STAGES = ("detect", "classify", "describe")
# Shapes (detect: 4 8×8 filters; classify: 256 → 64 → 10; describe: a one-layer attention text
# classifier over a 48-word vocabulary, 32 wide, with the crops' features mixed in).
VOCAB = 48
WIDTH = 32


def weights() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        s = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        return (rng.standard_normal(shape) * s).astype(np.float32)

    return {
        "detect": {"filters": w(4, 8, 8, scale=0.25)},
        "classify": {"w1": w(256, 64), "b1": w(64, scale=0.01), "w2": w(64, 10), "b2": w(10, scale=0.01)},
        "describe": {
            "embed": w(VOCAB, WIDTH, scale=0.5),
            "wq": w(WIDTH, WIDTH),
            "wk": w(WIDTH, WIDTH),
            "wv": w(WIDTH, WIDTH),
            "feat": w(64, WIDTH),
            "out": w(WIDTH, 4),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpu", type=Path, help="write the GPU variant (torch, CUDA) to this directory")
    args = ap.parse_args()
    for stage, arrays in weights().items():
        np.savez(HERE / stage / "weights.npz", **arrays)
        shutil.copy(HERE / "common.py", HERE / stage / "common.py")
    if args.gpu is not None:
        dest = args.gpu.resolve()
        for stage in STAGES:
            d = dest / stage
            shutil.copytree(HERE / stage, d, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            spec = (d / "torpor.toml").read_text()
            spec = re.sub(r'preload = \[.*\]', 'preload = ["numpy", "torch"]', spec)
            spec = spec.replace("gpus = 0", "gpus = 1").replace('gpu_memory = "0"', 'gpu_memory = "2GiB"')
            (d / "torpor.toml").write_text(spec)
        shutil.copy(HERE / "workflow.toml", dest / "workflow.toml")
        print(f"GPU variant in {dest}")


if __name__ == "__main__":
    main()
