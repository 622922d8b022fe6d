"""Which cuda segments may be shared read-only between instances (docs/split.md).

The daemon shares a segment that a warm-up request left unchanged, mapped read-only into every
instance. For a cuda segment that is not enough: PyTorch's caching allocator puts activations in
the same kind of blocks as weights, and a deterministic warm-up rewrites them with identical
bytes, so they look unchanged, and the next write into them is refused. A cuda segment is
offered for sharing only when the allocator's own view shows nothing in it but the function's
parameters and buffers, and no free block it could hand out later. Weights as models load them
rarely fill segments like that; the harness packs them first (torpor.pack), so that each pack
buffer is one segment holding one block, the start of the weights' storage, which passes here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def modules_of(obj: Any) -> list[Any]:
    """The torch.nn.Modules the function object holds as attributes, each once, in attribute
    order (the harness packs their weights, torpor.pack, and vouches for them here)."""
    torch = sys.modules["torch"]
    out: list[Any] = []
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.nn.Module) and all(value is not m for m in out):
            out.append(value)
    return out


def _tensors_of(obj: Any) -> Iterable[Any]:
    """The parameters and buffers of every torch.nn.Module held by the function object. Not the
    tensors it holds directly: those are as often state the handler writes (a cache, a counter,
    a running sum) as weights, and a warm-up request that only reads them leaves them unchanged,
    so vouching for one had it mapped read-only and the first write after a restore killed the
    instance's CUDA context (tests/daemon/functions/gpustate on the H100, session 21). Weights
    held as bare tensors stay writable segments: correct, only not shared between instances."""
    for module in modules_of(obj):
        yield from module.parameters()
        yield from module.buffers()


def shareable_vas(function: Any) -> set[int]:
    """Start addresses of the CUDA allocator segments holding only `function`'s weights."""
    torch = sys.modules.get("torch")
    if torch is None or function is None or not torch.cuda.is_initialized():
        return set()
    try:
        weights = {
            t.untyped_storage().data_ptr()
            for t in _tensors_of(function)
            if t.is_cuda and t.untyped_storage().nbytes() > 0
        }
    except Exception:  # a torch without these APIs: share nothing, which is always safe
        return set()
    return segments_holding_only(weights)


def segments_holding_only(storages: set[int]) -> set[int]:
    """Start addresses of the CUDA allocator segments whose every block is allocated and starts
    at one of `storages` (storage data pointers): no free block the allocator could hand out, and
    nothing else. Empty when torch cannot tell (no memory_snapshot)."""
    torch = sys.modules.get("torch")
    if torch is None or not storages:
        return set()
    try:
        snapshot = torch.cuda.memory_snapshot()
    except Exception:  # a torch without this API: nothing qualifies, which is always safe
        return set()
    out: set[int] = set()
    for segment in snapshot:
        blocks = segment.get("blocks", [])
        address = int(segment["address"])  # blocks follow one another from the segment's start
        ok = bool(blocks)
        for block in blocks:
            start = int(block.get("address", address))
            if block.get("state") != "active_allocated" or start not in storages:
                ok = False
                break
            address = start + int(block["size"])
        if ok:
            out.add(int(segment["address"]))
    return out
