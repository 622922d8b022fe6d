"""Write a model's weights once, randomly initialised with a fixed seed, as a safetensors file.

    python3 make_weights.py MODEL OUT.safetensors [--device cuda|cpu]

The benchmark's from-scratch path then loads real weights from disk, as a deployed function does,
instead of measuring random initialisation. Every parameter and buffer is stored (non-persistent
buffers too, so a model built on the meta device can be filled completely); a tensor shared by
several names (tied weights) is stored once and the other names are listed as aliases in the
file's metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import MODELS, build, check, named_tensors  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=MODELS)
    p.add_argument("out", type=Path, help="the .safetensors file to write")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to initialise")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    name = check(a.model)
    start = time.time()

    import torch
    from safetensors.torch import save_file

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = build(name)

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    canonical: dict[tuple[object, ...], str] = {}
    for key, t in named_tensors(model):
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and ident in canonical:
            aliases[key] = canonical[ident]
            continue
        canonical[ident] = key
        tensors[key] = t.detach().to("cpu").contiguous().clone()

    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(f".{a.out.name}.tmp-{os.getpid()}")
    metadata = {
        "model": name,
        "seed": str(a.seed),
        "init_device": device,
        "aliases": json.dumps(aliases, sort_keys=True),
    }
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, a.out)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"{name}: {len(tensors)} tensors, {len(aliases)} aliases, {size / 1e6:.0f} MB -> {a.out} "
        f"({time.time() - start:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
