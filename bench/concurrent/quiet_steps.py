"""Where a worker's quiet point spends its time (the `quiesce` step of a hibernation's stop,
docs/checkpoints.md): the steps `torpor.worker` runs there, timed one by one in a process
holding GPT-2-Large on the GPU, as a hibernation finds it (after requests), then again right
after (a second quiet point), and with the objects alive at the first one frozen out of the
cyclic collector (gc.freeze()).

    PYTHONPATH=python python3 bench/concurrent/quiet_steps.py --out FILE [--model gpt2-large|ctx]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "coldstart"))
import residue  # noqa: E402 (the model the probes share)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return round(time.perf_counter() - t, 4)


def quiet_point(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    return {name: timed(fn) for name, fn in steps.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt2-large", choices=("gpt2-large", "ctx"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    import torch

    from torpor import gpu as torpor_gpu

    t0 = time.perf_counter()
    request = residue.build(a.model)
    built_s = time.perf_counter() - t0
    steps: dict[str, Callable[[], Any]] = {
        "sync": torpor_gpu.sync,
        "shrink_context": torpor_gpu.shrink_context,
        "release_pinned_caches": torpor_gpu.release_pinned_caches,
        "shared_anonymous_bytes": torpor_gpu.shared_anonymous_bytes,
        "flush": lambda: (sys.stdout.flush(), sys.stderr.flush()),
        "gc_collect": gc.collect,
    }
    rounds: dict[str, Any] = {}
    for _ in range(a.requests):
        request()
    rounds["after_requests"] = quiet_point(steps)
    rounds["again"] = quiet_point(steps)
    gc.freeze()
    for _ in range(a.requests):
        request()
    rounds["frozen_after_requests"] = quiet_point(steps)
    doc = {
        "model": a.model,
        "built_s": round(built_s, 2),
        "tracked_objects": len(gc.get_objects()),
        "frozen_objects": gc.get_freeze_count(),
        "rounds": rounds,
        "torch": torch.__version__,
    }
    a.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
