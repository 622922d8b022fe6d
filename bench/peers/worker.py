"""One peer process of the peer benchmark (bench/peers/run.py starts one per run; never imported):

    python3 bench/peers/worker.py --role scratch|pool|built --model M --weights FILE --loader L --device D

  scratch  imports torch and transformers, makes the CUDA context, builds the model on the meta
           device, loads the weights with the loader, assigns them, answers the request given
           with --request, prints the answer and exits: the parent times exec → answer;
  pool     imports torch and transformers and makes the CUDA context, says it is ready and waits
           for a request on stdin; then builds, loads, assigns and answers (what the parent
           times, from the request written to the answer read);
  built    as pool, with the model already built on the meta device: only the weights and the
           answer are left for the request.

Protocol: each line the parent reads starts with `PEER ` followed by JSON ({"ready": ...} or
{"answer": ..., "phases": {...}} or {"error": "..."}); a request is one JSON line on stdin
({"request": {...}}); EOF on stdin ends a pool or built process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lm  # noqa: E402
import loaders  # noqa: E402

PREFIX = "PEER "


def say(obj: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("scratch", "pool", "built"), required=True)
    p.add_argument("--model", choices=tuple(lm.SPECS), required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--loader", choices=loaders.LOADERS, default="safetensors")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--request", default='{"seed": 1}', help="scratch: the request (JSON)")
    return p.parse_args(argv)


class Phases:
    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.out: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.out[name] = round(now - self.t, 6)
        self.t = now


def ready_context(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()


def fill(model: Any, a: argparse.Namespace, ph: Phases) -> None:
    """Loads the weights into `model` (built on meta) with the chosen loader."""
    state = loaders.load(a.loader, a.weights, a.device)
    ph("load")
    lm.assign(model, state, lm.aliases(a.weights))
    ph("assign")


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def scratch(a: argparse.Namespace) -> None:
    ph = Phases()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    ph("import")
    ready_context(a.device)
    ph("context")
    model = lm.build(lm.spec(a.model), "meta")
    ph("build")
    fill(model, a, ph)
    out = lm.answer(model, json.loads(a.request), a.device)
    ph("answer")
    say({"answer": out, "phases": ph.out})


def serve(a: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import torch
    import transformers  # noqa: F401

    ready_context(a.device)
    model = lm.build(lm.spec(a.model), "meta") if a.role == "built" else None
    say(
        {
            "ready": {
                "setup_s": round(time.perf_counter() - t0, 3),
                "built": model is not None,
                "torch_reserved_bytes": torch.cuda.memory_reserved() if a.device == "cuda" else 0,
            }
        }
    )
    line = sys.stdin.readline()
    if not line:
        return
    request = json.loads(line)["request"]
    ph = Phases()
    if model is None:
        model = lm.build(lm.spec(a.model), "meta")
        ph("build")
    fill(model, a, ph)
    out = lm.answer(model, request, a.device)
    ph("answer")
    say({"answer": out, "phases": ph.out})
    # Kept alive, as a pool keeps its processes, until the parent closes stdin.
    sys.stdin.read()


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    try:
        if a.role == "scratch":
            scratch(a)
        else:
            serve(a)
    except Exception as e:  # the parent reports it as the run's error
        say({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
