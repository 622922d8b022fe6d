"""What each step of a sandbox's GPU request path costs in GPU memory, in one process, step by
step (issue 11's memory ratio; docs/sandboxes.md, "Lanes"). After a context is made, CUDA is
warmed as a worker boots (torpor.gpu.warm: a thread of its own, joined), then a lane's steps
(torpor.lanes: a long-lived thread with a stream of its own) and last the main thread's own
cuBLAS handle, each recorded as NVML's memory of this process and PyTorch's reserved bytes, so
that what lies outside PyTorch's allocator (the context, loaded kernels, cuBLAS's own state) is
the difference:

    context       torch.zeros(1) on the GPU
    warm          torpor.gpu.warm() (matmul, linear, softmax, conv in fp32 and fp16)
    lane_stream   a lane made, its stream made (torpor.gpu.lane_stream: one driver stream)
    lane_handle   cuBLAS's handle for the lane and its workspace for the lane's stream
    lane_matmul   the bench's request on the lane: tanh(ones(8, 1024) @ w) for a 1024x1024 w
    lane2_*       the same on a second lane, while the first is busy (two requests at once)
    main_handle   the main thread's own handle (a worker that warmed on its main thread)
    main_matmul   the request on the main thread's default stream
    torch_stream_pool  the first torch.cuda.Stream(), which makes PyTorch's stream pool

    python3 bench/sandbox/handle_cost.py [--out FILE]
    python3 bench/sandbox/handle_cost.py --table FILE    # the Markdown table docs/sandboxes.md quotes

Exits 2 with one line on stderr where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "python"))


def nvml_mib() -> float:
    """NVML's memory of this process (MiB); 0 where NVML does not list it."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    for line in out.splitlines():
        pid, _, mib = (x.strip() for x in line.partition(","))
        if pid == str(os.getpid()):
            return float(mib)
    return 0.0


def table(doc: dict[str, Any]) -> str:
    """One row per step: NVML's memory of the process, PyTorch's reserved bytes, and the step's
    growth outside PyTorch's allocator (MiB)."""
    lines = [
        "| step | NVML (MiB) | PyTorch reserved (MiB) | growth outside the allocator (MiB) |",
        "|---|---|---|---|",
    ]
    for st in doc["steps"]:
        grown = st.get("outside_allocator_growth_mib")
        lines.append(
            f"| {st['step']} | {st['nvml_mib']:.0f} | {st['reserved_mib']:.0f} | {'–' if grown is None else f'{grown:.0f}'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sandbox-handle-cost-h100.json")
    ap.add_argument("--table", type=Path, help="render FILE's steps as a Markdown table and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("handle_cost: needs PyTorch with CUDA; run it on the GPU machine", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("handle_cost: torch sees no CUDA device; run it on the GPU machine", file=sys.stderr)
        return 2
    from torpor import gpu as torpor_gpu
    from torpor import lanes as torpor_lanes

    steps: list[dict[str, Any]] = []

    def record(step: str) -> None:
        torch.cuda.synchronize()
        steps.append({
            "step": step,
            "nvml_mib": nvml_mib(),
            "reserved_mib": torch.cuda.memory_reserved() / 2**20,
            "threads": threading.active_count(),
        })

    torch.zeros(1, device="cuda")
    record("context")
    torpor_gpu.warm()
    record("warm")
    w = torch.full((1024, 1024), 0.01, device="cuda")
    lanes = torpor_lanes.Lanes()

    def lane_stream() -> None:
        lane = torpor_lanes.current()
        assert lane is not None
        lane.stream = torpor_gpu.lane_stream(torch)

    def request() -> None:
        with torpor_gpu.request_stream("torch"):
            float(torch.tanh(torch.ones(8, 1024, device="cuda") @ w).sum())

    lanes.run(lane_stream)
    record("lane_stream")
    lanes.run(lambda: torpor_gpu.prepare_lane("torch"))
    record("lane_handle")
    lanes.run(request)
    record("lane_matmul")
    # A second lane: the first kept busy until the second has run.
    busy, free = threading.Event(), threading.Event()
    def hold() -> None:
        busy.set()
        free.wait(60)

    lanes.submit(hold)
    busy.wait(60)
    lanes.run(lane_stream)
    record("lane2_stream")
    lanes.run(lambda: torpor_gpu.prepare_lane("torch"))
    record("lane2_handle")
    lanes.run(request)
    record("lane2_matmul")
    free.set()
    torch.cuda.current_blas_handle()
    record("main_handle")
    float(torch.tanh(torch.ones(8, 1024, device="cuda") @ w).sum())
    record("main_matmul")
    # What the lanes' driver streams spare: PyTorch's stream pool, made by its first Stream().
    torch.cuda.Stream()
    record("torch_stream_pool")
    for prev, step in zip(steps, steps[1:], strict=False):
        step["nvml_growth_mib"] = step["nvml_mib"] - prev["nvml_mib"]
        step["outside_allocator_growth_mib"] = step["nvml_growth_mib"] - (step["reserved_mib"] - prev["reserved_mib"])
    doc = {
        "summary": {s["step"]: s.get("outside_allocator_growth_mib") for s in steps},
        "steps": steps,
        "machine": {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("TORPOR_COMMIT"),
        },
    }
    text = json.dumps(doc, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
