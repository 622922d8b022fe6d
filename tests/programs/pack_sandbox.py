"""Weight packing (torpor.pack) of a sandbox's functions on the GPU: prints one JSON line.

In a sandbox a function is loaded beside others that have already run: their request pools
(torpor.mempool: a lane's cuBLAS workspace and what a request left behind stay in them after the
pool is given back) and their torpor.graphed captures are private pools in PyTorch's allocator.
Packing refused every function after the first for them until session 48, so their weights
were never shared read-only. Here, in one process as in a sandbox worker:

- `first` sets up a small model with a graphed forward (its capture's pool is first's) and
  runs one request in its pool on a thread and stream of its own, which leaves a block there;
  its pool is then given back, as after a warm-up;
- `second` (tests/programs/pack_model.py's model) is packed under its name: whole segments,
  shareable, outputs unchanged, and first's graph still gives its answer;
- a function packed without a name (a worker of its own) counts every capture, so it is
  refused while first's graph exists;
- `third` captures a graph of its own in setup(): refused, naming the cause.

    {"private_pools", "second_packed", "second_same", "whole", "shareable", "first_same",
     "unnamed_refused", "third_refused"}
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from pack_model import MiB, Function, digest  # noqa: E402

from torpor import mempool  # noqa: E402
from torpor.graphs import graphed  # noqa: E402
from torpor.pack import PackError, pack_function  # noqa: E402
from torpor.shareable import shareable_vas  # noqa: E402

EXAMPLE = (4, 256)


class Graphed:
    """A small model whose forward setup() captures as CUDA graphs."""

    def setup(self) -> None:
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)).cuda().eval()
        self.forward = graphed(self.net, torch.zeros(*EXAMPLE, device="cuda"), instances=1)

    def answer(self) -> list[float]:
        x = torch.linspace(-1, 1, EXAMPLE[0] * EXAMPLE[1], device="cuda").view(*EXAMPLE)
        out = self.forward(x)
        torch.cuda.synchronize()
        return [float(v) for v in out.flatten().cpu()]


def set_up(fn: Any, name: str) -> mempool.FunctionPool:
    pool = mempool.FunctionPool(name, "cuda")
    with pool.setup():
        fn.setup()
    return pool


def a_request_in(pool: mempool.FunctionPool, fn: Graphed, kept: list[Any]) -> None:
    """One request of `fn` in its pool, on a thread and stream of its own (a sandbox's lane);
    the tensor it leaves behind keeps a block, and so a segment, of the pool."""

    def run() -> None:
        with pool.request():
            side = torch.cuda.Stream()
            with torch.cuda.stream(side), torch.no_grad():
                kept.append(fn.net(torch.randn(64, 256, device="cuda")))
            side.synchronize()

    t = threading.Thread(target=run)
    t.start()
    t.join()


def main() -> None:
    kept: list[Any] = []
    first = Graphed()
    first_pool = set_up(first, "first")
    first_before = first.answer()
    a_request_in(first_pool, first, kept)
    first_pool.release()
    private = {tuple(s.get("segment_pool_id", (0, 0))) for s in torch.cuda.memory_snapshot()} - {(0, 0)}

    second = Function()
    set_up(second, "second")
    second_before = digest(second)
    unnamed = Function()
    unnamed.setup()
    try:
        pack_function(unnamed, max_pack_bytes=20 * MiB)
        unnamed_refused = False
    except PackError:
        unnamed_refused = True
    packed = pack_function(second, max_pack_bytes=20 * MiB, name="second")
    vas = {s.va for s in packed.segments} if packed is not None else set()

    third = Graphed()
    set_up(third, "third")
    try:
        pack_function(third, name="third")
        third_refused = ""
    except PackError as e:
        third_refused = str(e)

    print(
        json.dumps(
            {
                "private_pools": len(private),
                "second_packed": packed is not None and len(vas) > 0,
                "second_same": digest(second) == second_before,
                "whole": packed is not None and packed.whole,
                "shareable": bool(vas) and vas <= shareable_vas(second),
                "first_same": first.answer() == first_before,
                "unnamed_refused": unnamed_refused,
                "third_refused": third_refused,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
