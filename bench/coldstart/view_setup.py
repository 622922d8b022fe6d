"""How long a model's setup takes in a warm process when its weights are already on the GPU.

    python3 bench/coldstart/view_setup.py --out bench/results/view-setup-TAG.json [--models M,M]

A function new to a node can start in a ready sandbox of the live-context pool (docs/sandboxes.md):
interpreter, imports and CUDA context are already there, and its `device = "cuda"` data arrive
as GPU memory the platform filled (the GPU cache, the tenant's shared copy). What is left is the
function's own setup() and its first forward. This probe prices that for the split benchmark's two
models, each side in a fresh process that first imports torch and the model library and warms
CUDA as a ready sandbox does (`torpor.gpu.warm`), untimed:

- `file`: the examples' setup: build on the meta device, `to_empty` on the GPU, copy the
  safetensors file in (from the page cache);
- `views`: the file's bytes already in GPU memory (copied in untimed, as the platform's fill),
  then build on the meta device and make every parameter and buffer a view of that memory
  (`torpor.tensors`: no copy).

Each side times its setup, first and second forward, and gives the logits' SHA-256 and, for
`views`, how many tensors start at an address aligned to 256 bytes (cuBLAS picks kernels by
alignment, so a misaligned weight may change output bits). Writes JSON with every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "python"))


def child(model_name: str, side: str, weights: Path) -> dict[str, Any]:
    """One side, in this (fresh) process."""
    import torch
    from models import build, example_input, forward, import_libraries, named_tensors  # bench/coldstart, the script's dir

    import_libraries(model_name)
    from torpor import gpu as torpor_gpu

    torpor_gpu.warm()
    torch.cuda.synchronize()
    inp = example_input(model_name).to("cuda")
    out: dict[str, Any] = {"side": side}
    blob = None
    if side == "views":
        data = weights.read_bytes()
        blob = torch.empty(len(data), dtype=torch.uint8, device="cuda")
        blob.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()
        del data
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = build(model_name)
    out["meta_build_s"] = time.perf_counter() - t0
    if side == "file":
        from safetensors import safe_open
        from safetensors.torch import load_file

        model = model.to_empty(device="cuda")
        state = load_file(str(weights), device="cpu")
        with safe_open(str(weights), framework="pt") as f:
            aliases: dict[str, str] = json.loads((f.metadata() or {}).get("aliases", "{}"))
        with torch.no_grad():
            for key, t in named_tensors(model):
                t.copy_(state[aliases.get(key, key)])
    else:
        assert blob is not None
        from torpor.tensors import assign, views

        tensors, meta = views(blob, str(weights))
        aliases = json.loads(meta.get("aliases", "{}"))
        assign(model, tensors, aliases)
        out["aligned_256"] = sum(1 for t in tensors.values() if t.data_ptr() % 256 == 0)
        out["tensors"] = len(tensors)
    torch.cuda.synchronize()
    model = model.eval()
    out["setup_s"] = time.perf_counter() - t0
    with torch.inference_mode():
        for k in ("first", "second"):
            t = time.perf_counter()
            logits = forward(model_name, model, inp)
            torch.cuda.synchronize()
            out[f"{k}_forward_s"] = time.perf_counter() - t
    out["digest"] = hashlib.sha256(logits.float().cpu().contiguous().numpy().tobytes()).hexdigest()
    out["setup_and_first_s"] = out["setup_s"] + out["first_forward_s"]
    return out


def versions() -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip().splitlines()
        v["device"], v["driver"] = [s.strip() for s in smi[0].split(",")]
    except (OSError, IndexError, ValueError):
        pass
    return v


def commit() -> str | None:
    carried = ROOT / ".gpu" / "commit"
    if carried.exists():
        return carried.read_text().strip()
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return r.stdout.strip() or None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-large,resnet152")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "SIDE", "WEIGHTS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], Path(a.child[2]))))
        return 0
    work = Path(tempfile.mkdtemp(prefix="torpor-view-setup-"))
    doc: dict[str, Any] = {"commit": commit(), "versions": versions(), "results": []}
    summary: dict[str, Any] = {}
    for model in a.models.split(","):
        weights = work / f"{model}.safetensors"
        subprocess.run([sys.executable, str(HERE / "make_weights.py"), model, str(weights)], check=True)
        runs: list[dict[str, Any]] = []
        for _ in range(a.runs):
            for side in ("file", "views"):
                r = subprocess.run(
                    [sys.executable, __file__, "--child", model, side, str(weights)],
                    capture_output=True, text=True, check=False, env=dict(os.environ),
                )
                if r.returncode != 0:
                    raise SystemExit(f"{model} {side}: exit {r.returncode}\n{r.stderr[-3000:]}")
                runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
                print(model, runs[-1], flush=True)
        doc["results"].append({"model": model, "runs": runs})
        med: dict[str, Any] = {}
        for side in ("file", "views"):
            xs = sorted(r["setup_and_first_s"] for r in runs if r["side"] == side)
            med[f"{side}_setup_and_first_s"] = xs[len(xs) // 2]
        med["identical"] = len({r["digest"] for r in runs}) == 1
        summary[model] = med
    doc["summary"] = summary
    text = json.dumps(doc, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
