"""Torpor's Python SDK: write a serverless function, declare its data, and let torpord run it.

    import torpor

    @torpor.function
    class MLP:
        def setup(self) -> None:            # once per instance, before the function snapshot
            self.weights = torpor.load_bytes("weights")

        def __call__(self, request):        # once per request; JSON in, JSON out
            return {"y": ...}

torpor.buffer(size) gives writable memory that a split snapshot stores outside the CRIU image
(torpor.hook); torpor.load(name, buffer=True) puts declared data there.

The function's directory holds torpor.toml (see torpor.spec) and its code. The worker harness
that runs it is torpor.worker; the frame codec it speaks is torpor.frames.

Declared data may come from the node's object store (`source = "s3://…"` in torpor.toml,
loaded by torpord while the instance starts), a request may pass inputs by reference
(`{"$ref": "s3://…"}`), and torpor.dump(name, obj) writes a result back without waiting
(torpor.data; docs/data.md).

torpor.put(key, value) / torpor.get(key) hand values between the functions of a sandbox
without a copy (torpor.store, docs/sandboxes.md); torpor.scratch(nbytes) gives request memory
from the function's pool, which its sandbox accounts and gives back when it idles
(torpor.mempool). torpor.load_tensors(name) gives a safetensors file declared `device = "cuda"`
as views of the GPU memory the platform filled, and torpor.assign(model, tensors) makes them a
meta-built model's weights (torpor.tensors). torpor.graphed(model, example) captures a model's GPU work as CUDA graphs in
setup() and replays them per request (torpor.graphs).
"""

from __future__ import annotations

from torpor.data import declared, dump, load, load_bytes, use_dir
from torpor.errors import DataError, DefinitionError, FrameError, HookError, SpecError, TorporError
from torpor.functions import function
from torpor.graphs import graphed
from torpor.hook import buffer
from torpor.mempool import scratch
from torpor.store import get, put
from torpor.tensors import assign, load_tensors

__all__ = [
    "DataError",
    "DefinitionError",
    "FrameError",
    "HookError",
    "SpecError",
    "TorporError",
    "assign",
    "buffer",
    "declared",
    "dump",
    "function",
    "get",
    "graphed",
    "load",
    "load_bytes",
    "load_tensors",
    "put",
    "scratch",
    "use_dir",
]
