"""Packed: a ~97 MB model (a tied embedding and head, 18 linear layers) on the GPU, loaded the
way a checkpoint reader that stages each tensor leaves it (weights beside freed staging blocks,
so without packing no segment holds weights only).

Requests:
    {"op": "forward", "sleep": s}  -> sleeps s seconds, then {"sha": sha256 of the output's bytes,
                                      "calls": n}
    {"op": "write", "sleep": s}    -> adds 1 to the first layer's weights in place, sleeps s
                                      seconds (busy), then waits for the GPU: with the weights
                                      mapped read-only this fails
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import torpor
from torch import nn

# Sizes that leave every segment holding only weights with a free tail over 1 MiB (which the
# allocator keeps as a free block): 5 weights of 3.52 MiB in a 20 MiB segment, an embedding of
# 28.9 MiB in 30 MiB. So unpacked, no segment can be shared, whatever the placement.
HIDDEN, VOCAB, LAYERS = 960, 7900, 18


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.norm(h))


def build() -> Net:
    """The model on the GPU, its weights beside freed staging blocks. Seeded on the CPU, so any
    process builds the same weights."""
    torch.manual_seed(0)
    net = Net().eval()
    staging = []
    for t in (*net.parameters(), *net.buffers()):
        staging.append(torch.empty((1 << 20) + 4096, dtype=torch.uint8, device="cuda"))
        t.data = t.data.to("cuda")
    del staging
    return net


def digest(net: Net) -> str:
    ids = torch.arange(64, device="cuda").remainder(VOCAB)
    with torch.no_grad():
        out = net(ids)
    torch.cuda.synchronize()
    return hashlib.sha256(out.cpu().contiguous().numpy().tobytes()).hexdigest()


@torpor.function
class Packed:
    def setup(self) -> None:
        self.net = build()
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        op = request.get("op")
        if op == "forward":
            time.sleep(float(request.get("sleep", 0)))
            return {"sha": digest(self.net), "calls": self.calls}
        if op == "write":
            with torch.no_grad():
                self.net.layers[0].weight.add_(1)
            time.sleep(float(request.get("sleep", 0)))
            torch.cuda.synchronize()
            return {"wrote": True}
        raise ValueError(f"unknown op {op!r}")
