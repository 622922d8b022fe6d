"""Why do a sandbox's overlapping requests run slower than processes?

On the serverless traces (docs/sandboxes.md, session 35) four ResNet-152 requests at once took
78-80 ms each in one sandbox against 15-17 ms in four processes. A sandbox runs each request on a
thread of its own, on a CUDA stream of its own, in one Python process: its threads launch
PyTorch's kernels one at a time under the GIL. This probe runs ResNet-152's request (a 1x3x224x224
fp32 input, eager forward under inference_mode, the logits copied back) in the ways that tell
the causes apart, each worker back to back, all workers at once:

- threads-1, threads-2, threads-4: one process, N threads, a stream each (the sandbox's way);
- processes-4: four processes of one thread (the processes' way);
- threads-4-graphs: four threads whose forward is one CUDA graph replay each (captured once per
  stream before the run), so a request launches a handful of operations instead of ~500.

For each: every request's latency and its launch time (until the forward call returns, before
the copy back waits for the GPU), medians, and requests a second over all workers.

    python3 bench/sandbox/gil_probe.py [--requests 30] [--modes ...] [--out F]
    python3 bench/sandbox/gil_probe.py --table F      # the Markdown table docs/sandboxes.md quotes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

Json = dict[str, Any]

MODES = ("threads-1", "threads-2", "threads-4", "processes-4", "threads-4-graphs")


def build(torch: Any) -> Any:
    import torchvision

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return torchvision.models.resnet152(weights=None).cuda().eval()


class Request:
    """One worker's way of serving a request: eager, or a CUDA graph replay on its stream."""

    def __init__(self, torch: Any, model: Any, stream: Any, graph: bool) -> None:
        self.torch, self.model, self.stream, self.graph = torch, model, stream, None
        if graph:
            self.static_x = torch.zeros(1, 3, 224, 224, device="cuda")
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(3):  # warm-up on the capture stream, as PyTorch asks
                    model(self.static_x)
            stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(self.graph, stream=stream):
                self.static_out = model(self.static_x)

    def __call__(self, seed: int) -> tuple[float, float]:
        torch = self.torch
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 3, 224, 224, generator=gen)
        with torch.cuda.stream(self.stream), torch.inference_mode():
            if self.graph is not None:
                self.static_x.copy_(x, non_blocking=True)
                self.graph.replay()
                out = self.static_out
            else:
                out = self.model(x.to("cuda", non_blocking=True))
            launched = time.perf_counter() - t0
            out.float().cpu()
        return time.perf_counter() - t0, launched


def run_threads(n: int, requests: int, graphs: bool) -> tuple[list[tuple[float, float]], float]:
    import torch

    model = build(torch)
    workers = [Request(torch, model, torch.cuda.Stream(), graphs) for _ in range(n)]
    for w in workers:  # kernels chosen, memory pooled
        for s in range(3):
            w(s)
    torch.cuda.synchronize()
    out: list[tuple[float, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(n)

    def serve(w: Request) -> None:
        start.wait()
        mine = [w(s) for s in range(requests)]
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=serve, args=(w,)) for w in workers]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, time.perf_counter() - t0


def child(requests: int) -> None:
    """processes-N: one of them; waits for `go` after `ready`, prints its timings as JSON."""
    import torch

    w = Request(torch, build(torch), torch.cuda.Stream(), False)
    for s in range(3):
        w(s)
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps([w(s) for s in range(requests)]), flush=True)


def run_processes(n: int, requests: int) -> tuple[list[tuple[float, float]], float]:
    ps = [
        subprocess.Popen([sys.executable, __file__, "--child", str(requests)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    for p in ps:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    for p in ps:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out: list[tuple[float, float]] = []
    for p in ps:
        assert p.stdout is not None
        out.extend(tuple(x) for x in json.loads(p.stdout.readline()))
    span = time.perf_counter() - t0
    for p in ps:
        p.wait()
    return out, span


def measure(mode: str, requests: int) -> Json:
    kind, n_text, *rest = mode.split("-")
    n = int(n_text)
    runs, span = run_processes(n, requests) if kind == "processes" else run_threads(n, requests, rest == ["graphs"])
    lat = [r[0] for r in runs]
    launch = [r[1] for r in runs]
    return {
        "mode": mode,
        "workers": n,
        "requests_per_worker": requests,
        "latency_s": lat,
        "launch_s": launch,
        "latency_p50_s": round(statistics.median(lat), 5),
        "launch_p50_s": round(statistics.median(launch), 5),
        # All workers' requests over the time from their start to the last answer.
        "requests_per_s": round(len(runs) / span, 2),
        "span_s": round(span, 3),
    }


def table(doc: Json) -> str:
    """The kept run as docs/sandboxes.md quotes it."""
    m = doc["machine"]
    head = (
        f"{m['gpu']}, driver {m['driver']}, torch {m['torch']}; ResNet-152, batch 1, fp32, "
        f"{doc['results'][0]['requests_per_worker']} requests per worker back to back; {doc['when']}."
    )
    rows = [
        "| mode | workers | latency p50 | launch p50 | requests/s, all workers |",
        "|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        rows.append(
            f"| {r['mode']} | {r['workers']} | {r['latency_p50_s'] * 1e3:.1f} ms | "
            f"{r['launch_p50_s'] * 1e3:.1f} ms | {r['requests_per_s']:.0f} |"
        )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests", type=int, default=30, help="requests per worker, back to back")
    ap.add_argument("--out")
    ap.add_argument("--table", help="print the Markdown table of a kept run and exit")
    a = ap.parse_args()
    if a.table:
        with open(a.table) as f:
            print(table(json.load(f)), end="")
        return 0
    if a.child is not None:
        child(a.child)
        return 0
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"gil_probe.py: unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    import torch

    results = []
    for m in modes:
        r = measure(m, a.requests)
        print(json.dumps({k: v for k, v in r.items() if k not in ("latency_s", "launch_s")}), flush=True)
        results.append(r)
    doc: Json = {
        "benchmark": "sandbox-gil-probe",
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, check=False).stdout.strip(),
            "cpus": os.cpu_count(),
        },
        "commit": os.environ.get("TORPOR_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip(),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "results": results,
        "summary": {r["mode"]: {"latency_p50_ms": round(r["latency_p50_s"] * 1e3, 2),
                                "launch_p50_ms": round(r["launch_p50_s"] * 1e3, 2),
                                "requests_per_s": r["requests_per_s"]} for r in results},
    }
    if a.out:
        with open(a.out, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
