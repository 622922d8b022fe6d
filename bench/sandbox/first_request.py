"""Where the first request of a function loaded into a pooled sandbox goes (issue 11's pooled start).

    python3 bench/sandbox/first_request.py --out FILE [--variants pool,thread-warm,eager] [--runs 2]
    python3 bench/sandbox/first_request.py --table FILE

A pooled start (bench/sandbox/run.py, `pooled_start_s`) is the function's load into a warm
sandbox (~18 ms with its setup) and then its first request, whose handler took 42-56 ms on the
H100 against ~3 ms for the next ones (bench/results/sandbox-h100.json). This probe replays that
path outside torpord, with torpor's own modules, each variant in a fresh process: torch imported
and `torpor.gpu.warm()` run as the pool's sandbox does before it is counted ready; the function's
setup (`bench/sandbox/run.py`'s GPU function: 64 MiB of fp32 weights) in its `torpor.mempool`
pool; then each request on a new thread, in the function's pool and on a request stream
(`torpor.gpu.request_stream`), as `torpor.worker` runs a sandbox's request. Every step of a request
is synchronised and timed apart, so the first request's extra time is named by step.

Variants:
  pool         what a pooled sandbox does today
  thread-warm  also `torpor.gpu.warm()` once more on a short-lived thread inside a request stream
               and a pool, before the function loads (a request-like warm-up)
  eager        CUDA_MODULE_LOADING=EAGER (every kernel loaded at the context's start)
  common       `torpor.gpu.warm_requests`, what a ready sandbox of the pool runs since session
               32: the common kernels loaded on a request thread and stream
  common-fp32  the same in fp32 only (what the fp16 and bf16 kernels cost)

Each variant also reports the GPU memory the warm-up left in use (`warm_used_bytes`:
`torch.cuda.mem_get_info` before and after it, PyTorch's cache emptied) and, comparable across
variants, what was in use after the first request (`first_request_used_bytes`, the same way:
the warm-up, the function's weights and what its first request kept, such as its stream's
cuBLAS workspace).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("pool", "thread-warm", "eager", "common", "common-fp32")
STEPS = ("pool_enter", "stream", "input", "matmul_1", "tanh_1", "layers_rest", "sum", "result")


def child(variant: str, requests: int) -> dict[str, Any]:
    """One variant in this process: the sandbox's warm-up, the function's setup, `requests`
    requests each on a new thread; returns every step's seconds."""
    sys.path.insert(0, str(ROOT / "python"))
    t0 = time.perf_counter()
    import torch

    from torpor import gpu as torpor_gpu
    from torpor import mempool

    imported = time.perf_counter()
    torch.cuda.init()
    free_before = torch.cuda.mem_get_info()[0]
    torpor_gpu.warm()
    warmed = time.perf_counter()
    common_runs = 0
    if variant == "common":
        common_runs = torpor_gpu.warm_requests("torch")
    elif variant == "common-fp32":
        common_runs = torpor_gpu.warm_requests("torch", ("float32",))
    if variant == "thread-warm":
        def warm_like_a_request() -> None:
            pool = mempool.FunctionPool("warm", mempool.backend_for("torch"))
            with pool.request(), torpor_gpu.request_stream("torch"):
                torpor_gpu.warm()

        warmer = threading.Thread(target=warm_like_a_request)
        warmer.start()
        warmer.join()
    thread_warmed = time.perf_counter()
    torch.cuda.empty_cache()
    warm_used = free_before - torch.cuda.mem_get_info()[0]

    pool = mempool.FunctionPool("fn", mempool.backend_for("torch"))
    width, mib = 1024, 64
    with pool.setup():
        layers = [torch.randn(width, width, device="cuda") / 32 for _ in range(mib * (1 << 20) // (4 * width * width))]
        torch.cuda.synchronize()
    set_up = time.perf_counter()

    def request(out: dict[str, float]) -> None:
        def step(name: str, since: float) -> float:
            torch.cuda.synchronize()
            now = time.perf_counter()
            out[name] = now - since
            return now

        t = time.perf_counter()
        with pool.request():
            t = step("pool_enter", t)
            with torpor_gpu.request_stream("torch"):
                t = step("stream", t)
                x = torch.ones(8, width, device="cuda")
                t = step("input", t)
                y = x @ layers[0]
                t = step("matmul_1", t)
                x = torch.tanh(y)
                t = step("tanh_1", t)
                for w in layers[1:]:
                    x = torch.tanh(x @ w)
                t = step("layers_rest", t)
                s = x.sum()
                t = step("sum", t)
                out["value"] = float(s)
                step("result", t)

    runs = []
    first_used = 0
    for _ in range(requests):
        out: dict[str, float] = {}
        t = time.perf_counter()
        th = threading.Thread(target=request, args=(out,))
        th.start()
        th.join()
        out["total"] = time.perf_counter() - t
        runs.append(out)
        if len(runs) == 1:
            torch.cuda.empty_cache()
            first_used = free_before - torch.cuda.mem_get_info()[0]
    return {
        "variant": variant,
        "import_s": imported - t0,
        "warm_s": warmed - imported,
        "thread_warm_s": thread_warmed - warmed,
        "common_runs": common_runs,
        "warm_used_bytes": warm_used,
        "first_request_used_bytes": first_used,
        "setup_s": set_up - thread_warmed,
        "requests": runs,
        "identical": len({r["value"] for r in runs}) == 1,
    }


def run_variant(variant: str, requests: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("CUDA_MODULE_LOADING", None)
    if variant == "eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    r = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--requests", str(requests)],
        capture_output=True, text=True, env=env, check=False, timeout=300,
    )
    if r.returncode != 0:
        return {"variant": variant, "error": (r.stderr or r.stdout)[-2000:]}
    return json.loads(r.stdout.splitlines()[-1])


def table(path: Path) -> str:
    d = json.loads(path.read_text())
    head = "| variant | warm-up: time, GPU memory, in use after the first request | request | " + " | ".join(STEPS) + " (ms) | total |"
    lines = [head, "|" + "---|" * (len(STEPS) + 4)]
    for v in d["variants"]:
        if "error" in v:
            lines.append(f"| {v['variant']} | failed | | " + " | ".join("" for _ in STEPS) + " | |")
            continue
        for k, name in ((0, "first"), (-1, "later")):
            r = v["requests"][k]
            cells = " | ".join(f"{r[s] * 1e3:.1f}" for s in STEPS)
            # Files written before first_request_used_bytes existed have none.
            after = v.get("first_request_used_bytes")
            warm = (f"{(v['warm_s'] + v['thread_warm_s']):.2f} s, {v['warm_used_bytes'] / 2**20:.0f} MiB, "
                    + (f"{after / 2**20:.0f} MiB" if after is not None else "–"))
            lines.append(f"| {v['variant']} | {warm} | {name} | {cells} | {r['total'] * 1e3:.1f} ms |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--runs", type=int, default=2, help="fresh processes per variant")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return 0
    if args.table:
        print(table(args.table))
        return 0
    if args.out is None:
        ap.error("--out FILE (or --table FILE)")
    results = []
    for variant in args.variants.split(","):
        for _ in range(args.runs):
            results.append(run_variant(variant, args.requests))
            print(json.dumps(results[-1]), flush=True)
    import torch

    doc = {
        "what": "a pooled sandbox's first request of a new function, by step (bench/sandbox/first_request.py)",
        "machine": {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "variants": results,
        "summary": {
            v: statistics.median(r["requests"][0]["total"] for r in results if r["variant"] == v and "requests" in r)
            for v in args.variants.split(",")
            if any(r["variant"] == v and "requests" in r for r in results)
        },
    }
    args.out.write_text(json.dumps(doc, indent=1))
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
