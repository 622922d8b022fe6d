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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent.parent / "python"))

from models import MODELS, build, check, named_tensors  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=MODELS)
    p.add_argument("out", type=Path, help="the .safetensors file to write")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to initialise")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def save_model(model: torch.nn.Module, out: Path, metadata: dict[str, str]) -> tuple[int, int, int]:
    """Writes every parameter and buffer of `model` to `out` (atomically: a temporary file, then
    a rename), each storage once: a tensor under a second name (tied weights) is listed in the
    metadata's "aliases". Returns (tensors stored, aliases, bytes). bench/peers/make_weights.py
    writes its models with it too."""
    import torch  # noqa: F401 (named by the annotation below, which is not evaluated)
    from torpor.tensors import save

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    canonical: dict[tuple[object, ...], str] = {}
    for key, t in named_tensors(model):
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and ident in canonical:
            aliases[key] = canonical[ident]
            continue
        canonical[ident] = key
        # One copy on the host (from the GPU: one device-to-host copy, not two).
        tensors[key] = t.detach().to("cpu", copy=True).contiguous()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    # Laid out for views (torpor.tensors.save): a function that maps the file as platform-managed
    # GPU memory (torpor.load_tensors) gets weights as aligned as its own allocations would be.
    save(tensors, str(tmp), metadata={**metadata, "aliases": json.dumps(aliases, sort_keys=True)})
    # Readable by others whatever the umask: torpord's workers run as an unprivileged user and
    # must read the weights (workers.unprivileged, docs/security.md).
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return len(tensors), len(aliases), sum(t.numel() * t.element_size() for t in tensors.values())


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    name = check(a.model)
    start = time.time()

    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = build(name)

    metadata = {"model": name, "seed": str(a.seed), "init_device": device}
    n, n_aliases, size = save_model(model, a.out, metadata)
    print(
        f"{name}: {n} tensors, {n_aliases} aliases, {size / 1e6:.0f} MB -> {a.out} "
        f"({time.time() - start:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
