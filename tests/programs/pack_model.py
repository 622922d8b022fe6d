"""Weight packing (torpor.pack) on a real PyTorch model on the GPU: prints one JSON line.

The model has what packing must keep right: an embedding tied to the output head (one
Parameter), a non-contiguous parameter, a second Parameter viewing part of another's storage,
BatchNorm buffers (one of them int64), and it is loaded the way a checkpoint reader that stages
each tensor leaves it: weights beside freed staging blocks, so no segment holds weights only.
The function object also holds a CPU module and a CUDA tensor outside any module, and the
model a layer whose weight views memory of the driver's own (cuMemAlloc, as platform-managed GPU
data is), which stay where they are.

    {"before", "after": sha256 of the output before and after packing,
     "packs", "pack_bytes", "segment_bytes", "tensors", "storages", "whole", "left_bytes",
     "all_in_packs": every CUDA parameter and buffer now lies in a pack,
     "own_segments": every pack is one allocator segment of exactly its size, one active block,
     "shareable": torpor.shareable vouches for every pack segment,
     "shareable_before": how many segments it vouched for before packing,
     "tied", "alias", "strides", "untouched", "external": the checks named above,
     "released": the old segments were given back (the reservation did not grow by the weights),
     "hook_segments": with the hook, every pack is a cuda segment of its exact size (null without)}

Run plainly and with LD_PRELOAD=libtorpor_hook.so TORPOR_HOOK_CUDA=1 TORPOR_HOOK_LIB=<same>.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

from torpor import cuda_driver  # noqa: E402
from torpor.pack import pack_function  # noqa: E402
from torpor.shareable import shareable_vas  # noqa: E402

# Sizes that leave every segment holding only weights with a free tail over 1 MiB (which the
# allocator keeps as a free block): 5 weights of 3.52 MiB in a 20 MiB segment, an embedding of
# 20.9 MiB in 22 MiB. So no segment is shareable before packing, whatever the placement.
HIDDEN, VOCAB, LAYERS = 960, 5700, 12
MiB = 1 << 20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.mix = nn.Parameter(torch.randn(HIDDEN, 64).t())  # (64, HIDDEN), strides (1, 64)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.side = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        h = self.bn(self.norm(h))
        h = h + h[:, :64] @ self.mix + self.side(h)
        return self.head(h)


def external(like: torch.Tensor) -> torch.Tensor:
    """A copy of CUDA tensor `like` in memory of the driver's own (cuMemAlloc), outside
    PyTorch's allocator, viewed through __cuda_array_interface__ as torpor.load views
    platform-managed GPU data. Never freed: the process ends with the test."""
    nbytes = like.numel() * like.element_size()
    ptr = ctypes.c_uint64()
    rc = cuda_driver.load().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    assert rc == 0, f"cuMemAlloc_v2: {rc}"

    class Array:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr.value, False), "version": 3}

    blob = torch.as_tensor(Array(), device="cuda")
    out = blob.view(like.dtype).view(like.shape)
    out.copy_(like)
    return out


def load_staged(net: Net) -> None:
    """Move every parameter and buffer to the GPU beside a staging block, then free the staging
    blocks: segments of weights with holes, as checkpoint readers leave them."""
    staging = []
    for t in (*net.parameters(), *net.buffers()):
        staging.append(torch.empty(MiB + 4096, dtype=torch.uint8, device="cuda"))
        t.data = t.data.to("cuda")
    del staging


class Function:
    def setup(self) -> None:
        torch.manual_seed(0)
        net = Net().eval()
        load_staged(net)
        # A second Parameter on part of the first layer's storage (after the move, which would
        # have given it a storage of its own).
        net.alias = nn.Parameter(net.layers[0].weight.data[:8])
        net.side.weight.data = external(net.side.weight.data)
        self.net = net
        self.cpu = nn.Linear(4, 4)
        self.extra = torch.arange(16, dtype=torch.float32, device="cuda")


def digest(fn: Function) -> str:
    ids = torch.arange(32, device="cuda").remainder(VOCAB)
    with torch.no_grad():
        out = fn.net(ids)
    torch.cuda.synchronize()
    return hashlib.sha256(out.cpu().contiguous().numpy().tobytes()).hexdigest()


def own_segment(va: int, size: int) -> bool:
    """The allocator segment at `va` is exactly `size` bytes, in one active block."""
    for s in torch.cuda.memory_snapshot():
        if int(s["address"]) == va:
            blocks = s["blocks"]
            return (
                int(s["total_size"]) == size
                and len(blocks) == 1
                and blocks[0]["state"] == "active_allocated"
                and int(blocks[0]["size"]) == size
            )
    return False


def main() -> None:
    fn = Function()
    fn.setup()
    result: dict[str, Any] = {
        "before": digest(fn),
        "shareable_before": len(shareable_vas(fn)),
    }
    extra_before = fn.extra.cpu().tolist()
    side_before = fn.net.side.weight.data_ptr()
    reserved = torch.cuda.memory_reserved()
    packed = pack_function(fn, max_pack_bytes=20 * MiB)
    assert packed is not None, "nothing was packed"
    grown = torch.cuda.memory_reserved() - reserved
    net = fn.net
    vas = {s.va: s.size for s in packed.segments}
    weights = [*net.parameters(), *net.buffers()]
    result |= {
        "after": digest(fn),
        "packs": len(packed.segments),
        "pack_bytes": packed.bytes,
        "segment_bytes": sum(vas.values()),
        "tensors": packed.tensors,
        "storages": packed.storages,
        "whole": packed.whole,
        "left_bytes": packed.left_bytes,
        "all_in_packs": all(t.untyped_storage().data_ptr() in vas for t in weights if t is not net.side.weight),
        "external": net.side.weight.data_ptr() == side_before and side_before not in vas,
        "own_segments": all(own_segment(va, size) for va, size in vas.items()),
        "shareable": set(vas) <= shareable_vas(fn),
        "tied": net.head.weight is net.emb.weight and net.head.weight.untyped_storage().data_ptr() in vas,
        "alias": net.alias.data_ptr() == net.layers[0].weight.data_ptr()
        and net.alias.untyped_storage().data_ptr() == net.layers[0].weight.untyped_storage().data_ptr(),
        "strides": net.mix.stride() == (1, 64) and not net.mix.is_contiguous(),
        "untouched": fn.cpu.weight.device.type == "cpu"
        and fn.extra.untyped_storage().data_ptr() not in vas
        and fn.extra.cpu().tolist() == extra_before,
        # The old segments went back to the driver: the packs (~102 MiB) replace segments of
        # weights, staging holes and tails of about as much. Keeping the old ones as well would
        # grow the reservation by the packs' size.
        "released": grown <= 20 * MiB,
        "hook_segments": None,
    }
    if os.environ.get("TORPOR_HOOK_CUDA") == "1":
        from torpor import hook

        cuda = {s.va: s.size for s in hook.get().segments() if s.backend == "cuda"}
        result["hook_segments"] = all(cuda.get(va) == size for va, size in vas.items())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
