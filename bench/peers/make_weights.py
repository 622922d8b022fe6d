"""Writes a peer-benchmark model's random weights once, with a fixed seed, as one safetensors file:

    python3 bench/peers/make_weights.py MODEL OUT.safetensors [--device auto|cuda|cpu] [--seed 0]

MODEL is llama-8b (Llama-3-8B's shape, bf16, 16.1 GB: made on the GPU in seconds, then written
once; never put it in the repository), tiny-llama or tiny-gpt2 (the CPU smoke test's). GPT-2
Large's weights are the example's own: examples/gpt2-large/make_weights.py.

The model is built in its dtype on the device (bench/peers/lm.py: the same build every path
uses) and written with bench/coldstart/make_weights.py's writer (every parameter and buffer,
tied names as aliases in the metadata, atomically).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lm  # noqa: E402



def _coldstart_writer() -> ModuleType:
    """bench/coldstart/make_weights.py (the same file name as this one: loaded by path)."""
    coldstart = HERE.parent / "coldstart"
    sys.path.insert(1, str(coldstart))  # its own import of models.py
    spec = importlib.util.spec_from_file_location("coldstart_make_weights", coldstart / "make_weights.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATED = tuple(n for n in lm.SPECS if n != "gpt2-large")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=GENERATED)
    p.add_argument("out", type=Path, help="the .safetensors file to write")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to initialise")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def write(name: str, out: Path, device: str = "auto", seed: int = 0) -> str:
    """Writes `name`'s weights to `out`; returns a line saying what was written."""
    start = time.monotonic()
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    model = lm.build(lm.spec(name), device)
    if device == "cuda":
        torch.cuda.synchronize()
    made = time.monotonic() - start
    n, n_aliases, size = _coldstart_writer().save_model(model, out, {"model": name, "seed": str(seed), "init_device": device})
    del model
    return (
        f"{name}: {n} tensors, {n_aliases} aliases, {size / 1e9:.2f} GB -> {out} "
        f"(made on {device} in {made:.1f} s, {time.monotonic() - start:.1f} s in all)"
    )


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    print(write(a.model, a.out, a.device, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
