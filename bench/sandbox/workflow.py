"""A workflow's end-to-end latency with the communication store against passing its data through
JSON (issue 11, "Measure"; docs/sandboxes.md, "Workflows").

One torpord, two copies of a three-stage workflow of one tenant: `make` draws an array of SIZE
bytes (float32; a CUDA tensor on the GPU) from the request's seed, `scale` computes 2x + 1 of it,
`reduce` sums it (float64). In `pipe-store` the stages are sandboxed functions of one group, so
the workflow runs in one sandbox and the arrays go through `torpor.put` / `torpor.get` (the same
object; only keys travel as values). In `pipe-json` the stages are ordinary functions (one
process each, `sandbox = false`), and each value holds the array itself as a JSON list, carried by
torpord from stage to stage (the way without the store). Each size: one warm-up invoke of each
workflow (its cold start), then `--runs` invokes of each, alternating, timed at the client
(`POST /v1/workflows/NAME/invoke` → answer). Both must give the same sum on every run (the same
numbers: float32 through JSON is exact).

The JSON way cannot carry much more: a worker's frame to torpord holds at most 64 MiB, and a
float32 array written as JSON takes ~5 bytes a byte (16 MiB of floats is an 80 MB value, refused
with "frame of … bytes is over the 67108864-byte maximum"); the store's values have no such bound.

Writes bench/results/sandbox-workflow-<device>.json: every run, and a top-level `summary` with,
per size in KiB, `workflow_store_ms` and `workflow_json_ms` (medians) and `json_over_store`.

    python3 bench/sandbox/workflow.py [--sizes-kib 64,1024,8192] [--runs 5] [--out FILE]
    python3 bench/sandbox/workflow.py --cpu      # NumPy stages (no GPU)
    python3 bench/sandbox/workflow.py --table FILE...   # the Markdown table docs/sandboxes.md quotes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(HERE))

from run import start_daemon, stop_daemon  # noqa: E402

from torpor import client  # noqa: E402

STAGES = ("make", "scale", "reduce")

# One stage's function (formatted: braces doubled). MODE "store" hands the array through the
# communication store, "json" puts it in the value.
MODEL = '''
import numpy as np
import torpor

MODE, STAGE, GPU = "{mode}", "{stage}", {gpu}
if GPU:
    import torch


def draw(floats, seed):
    if GPU:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.rand(floats, device="cuda", generator=g)
    return np.random.default_rng(seed).random(floats, dtype=np.float32)


def to_value(x, key):
    if MODE == "store":
        torpor.put(key, x, ttl_s=60)
        return {{"key": key}}
    return {{"data": x.cpu().tolist() if GPU else x.tolist()}}


def from_value(v):
    if MODE == "store":
        return torpor.get(v["key"])
    if GPU:
        return torch.tensor(v["data"], dtype=torch.float32, device="cuda")
    return np.asarray(v["data"], dtype=np.float32)


@torpor.function
class Stage:
    def setup(self):
        pass

    def __call__(self, request):
        rid = request["id"]
        if STAGE == "make":
            return dict(to_value(draw(request["floats"], request["seed"]), f"{{rid}}/a"), id=rid)
        x = from_value(request)
        if STAGE == "scale":
            return dict(to_value(x * 2 + 1, f"{{rid}}/b"), id=rid)
        total = float(x.double().sum()) if GPU else float(x.astype(np.float64).sum())
        return {{"sum": total, "floats": int(x.numel() if GPU else x.size), "id": rid}}
'''


def write_workflow(root: Path, mode: str, gpu: bool) -> list[Path]:
    """The three stage directories of `pipe-MODE`, then the workflow's own (deploy order)."""
    dirs = []
    for stage in STAGES:
        d = root / mode / stage
        d.mkdir(parents=True)
        (d / "model.py").write_text(MODEL.format(mode=mode, stage=stage, gpu=gpu))
        spec = [
            f'name = "wf-{mode}-{stage}"',
            'tenant = "bench"',
            f'workflow = "pipe-{mode}"',
            'entry = "model:Stage"',
            f'preload = ["{"torch" if gpu else "numpy"}"]',
            f"gpus = {1 if gpu else 0}",
            f'gpu_memory = "{"4GiB" if gpu else "0"}"',
            "timeout_s = 300",
            "load_timeout_s = 300",
            "[scaling]",
            "max_instances = 1",
            f"sandbox = {'true' if mode == 'store' else 'false'}",
            "[keepalive]",
            "gpu_release_s = 3600",
            "hibernate_s = 3600",
            "evict_s = 3600",
        ]
        (d / "torpor.toml").write_text("\n".join(spec) + "\n")
        dirs.append(d)
    w = root / mode
    stages = "".join(
        f'[[stage]]\nfunction = "wf-{mode}-{s}"\n' + (f'after = ["wf-{mode}-{STAGES[i - 1]}"]\n' if i else "")
        for i, s in enumerate(STAGES)
    )
    (w / "workflow.toml").write_text(f'name = "pipe-{mode}"\ntenant = "bench"\n{stages}')
    return [*dirs, w]


def invoke(sock: Path, mode: str, floats: int, seed: int, rid: str) -> dict[str, Any]:
    body = json.dumps({"floats": floats, "seed": seed, "id": rid}).encode()
    t = time.perf_counter()
    a = client.request(sock, "POST", f"/v1/workflows/pipe-{mode}/invoke", body, 600)
    wall = time.perf_counter() - t
    if a.status != 200:
        raise RuntimeError(f"pipe-{mode}: {a.status} {a.body[:300]!r}")
    value = json.loads(a.body)
    timings = dict(json.loads(a.headers.get("x-torpor-timings", "{}")))
    return {"wall_s": wall, "sum": value["sum"], "floats": value["floats"], "timings": timings}


def machine(gpu: bool) -> dict[str, Any]:
    m: dict[str, Any] = {"host": platform.node(), "kernel": platform.release(), "python": platform.python_version()}
    # The binary's commit where gpu-run.sh says it (the GPU machine's copy of .git can be older).
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    m["commit"] = os.environ.get("TORPOR_COMMIT") or commit.stdout.strip()
    if gpu:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        )
        m["gpu"] = q.stdout.strip()
        import torch

        m["torch"] = torch.__version__
    else:
        import numpy

        m["numpy"] = numpy.__version__
    return m


def table(paths: list[Path]) -> str:
    """Markdown: a row per file and size, the medians and their ratio, read from the JSONs."""
    rows = [
        "| file | where | array between stages | store (one sandbox) | JSON (a process a stage) | JSON ÷ store |",
        "|---|---|---|---|---|---|",
    ]
    for path in paths:
        d = json.loads(path.read_text())
        where = "CPU (NumPy)" if d["settings"]["cpu"] else f"GPU ({d['machine'].get('gpu', '').split(',')[0]})"
        s = d["summary"]
        for kib in d["settings"]["sizes_kib"]:
            k = str(kib)
            size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
            rows.append(
                f"| `{path.name}` | {where} | {size} | {s['workflow_store_ms'][k]:.1f} ms "
                f"| {s['workflow_json_ms'][k]:.1f} ms | {s['json_over_store'][k]:.0f}× |"
            )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", type=Path, nargs="+", metavar="FILE", help="print the Markdown table of these JSONs and stop")
    ap.add_argument("--cpu", action="store_true", help="NumPy stages on the CPU")
    ap.add_argument("--sizes-kib", default="64,1024,8192", help="array sizes, KiB, comma-separated")
    ap.add_argument("--runs", type=int, default=5, help="timed invokes of each workflow per size")
    ap.add_argument("--torpor", type=Path, default=Path(os.environ.get("TORPOR_BIN", ROOT / "target/release/torpor")))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return 0
    gpu = not args.cpu
    sizes = [int(s) for s in args.sizes_kib.split(",") if s]
    out = args.out or ROOT / "bench" / "results" / f"sandbox-workflow-{'cpu' if args.cpu else 'gpu'}.json"

    root = Path(tempfile.mkdtemp(prefix="torpor-workflow-bench-"))
    daemon, log, sock = start_daemon(args.torpor, root, "")
    results: list[dict[str, Any]] = []
    try:
        env = dict(os.environ, TORPOR_SOCKET=str(sock))
        for mode in ("store", "json"):
            for d in write_workflow(root / "fns", mode, gpu):
                r = subprocess.run([args.torpor, "deploy", d], capture_output=True, text=True, env=env, check=False)
                if r.returncode != 0:
                    raise RuntimeError(f"deploy {d}: {r.stdout}{r.stderr}")
        for kib in sizes:
            floats = kib * 1024 // 4
            row: dict[str, Any] = {"size_kib": kib, "floats": floats, "store": [], "json": [], "warmup": {}}
            for mode in ("store", "json"):
                row["warmup"][mode] = invoke(sock, mode, floats, 0, f"warm-{mode}-{kib}")
            for i in range(args.runs):
                seed = i + 1
                got = {mode: invoke(sock, mode, floats, seed, f"{mode}-{kib}-{i}") for mode in ("store", "json")}
                if got["store"]["sum"] != got["json"]["sum"] or got["store"]["floats"] != floats:
                    raise RuntimeError(f"{kib} KiB, seed {seed}: the two ways differ: {got}")
                # What is compared: one sandbox against a process a stage (the daemon says which).
                ran = {mode: got[mode]["timings"].get("sandbox") for mode in got}
                if ran != {"store": 1.0, "json": 0.0}:
                    raise RuntimeError(f"{kib} KiB: expected the store's workflow in one sandbox, JSON's across processes: {ran}")
                for mode in ("store", "json"):
                    row[mode].append(got[mode])
            st = median(r["wall_s"] for r in row["store"]) * 1e3
            js = median(r["wall_s"] for r in row["json"]) * 1e3
            print(f"{kib} KiB: store {st:.1f} ms, JSON {js:.1f} ms ({js / st:.1f}x)", flush=True)
            results.append(row)
    finally:
        stop_daemon(daemon, log, root)

    summary: dict[str, Any] = {
        "workflow_store_ms": {}, "workflow_json_ms": {}, "json_over_store": {}, "identical": True,
    }
    for row in results:
        k = str(row["size_kib"])
        st = median(r["wall_s"] for r in row["store"]) * 1e3
        js = median(r["wall_s"] for r in row["json"]) * 1e3
        summary["workflow_store_ms"][k] = round(st, 3)
        summary["workflow_json_ms"][k] = round(js, 3)
        summary["json_over_store"][k] = round(js / st, 2)
    doc = {
        "benchmark": "workflow end-to-end: communication store against JSON (bench/sandbox/workflow.py)",
        "summary": summary,
        "machine": machine(gpu),
        "settings": {"cpu": args.cpu, "sizes_kib": sizes, "runs": args.runs, "stages": list(STAGES)},
        "results": results,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
