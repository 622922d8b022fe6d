"""What the device-memory hook adds to an allocation: cudaMalloc + cudaFree through PyTorch with
its caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so every torch.empty reaches
cudaMalloc, with and without libtorpor_hook.so preloaded (TORPOR_HOOK_CUDA=1).

    python3 bench/hook/alloc.py [--lib .gpu/libtorpor_hook.so] [--n 200] > alloc.json

Prints one JSON object: per size, the median and p90 of one allocate-and-free in ms, plain and
hooked, and whether an allocation of that size became a segment in the hooked run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = [1 << 20, 2 << 20, 20 << 20, 256 << 20]


def child(n: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "python"))
    hooked = bool(os.environ.get("TORPOR_HOOK_LIB"))
    torch.empty(1, device="cuda")
    out: dict[str, object] = {}
    for size in SIZES:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x
            times.append(time.perf_counter() - t0)
        times.sort()
        row: dict[str, object] = {
            "p50_ms": statistics.median(times) * 1e3,
            "p90_ms": times[int(0.9 * len(times))] * 1e3,
        }
        if hooked:
            from torpor import hook

            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            row["segment"] = any(s.backend == "cuda" and s.va == x.data_ptr() for s in hook.get().segments())
            del x
        out[str(size)] = row
    print(json.dumps(out))


def run(n: int, env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TORPOR_HOOK_LIB", "TORPOR_HOOK_CUDA")}
    env = {**base, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1", **env}
    r = subprocess.run(
        [sys.executable, __file__, "--child", "--n", str(n)], capture_output=True, text=True, env=env, check=False
    )
    if r.returncode != 0:
        sys.exit(f"alloc bench child failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(doc, dict)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get("TORPOR_HOOK_LIB") or str(ROOT / ".gpu/libtorpor_hook.so"))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.n)
        return
    if not Path(args.lib).is_file():
        sys.exit(f"{args.lib} not found: run `make gpu-carry` or pass --lib")
    plain = run(args.n, {})
    hooked = run(args.n, {"LD_PRELOAD": args.lib, "TORPOR_HOOK_LIB": args.lib, "TORPOR_HOOK_CUDA": "1"})
    print(json.dumps({"n": args.n, "plain": plain, "hooked": hooked}, indent=1))


if __name__ == "__main__":
    main()
