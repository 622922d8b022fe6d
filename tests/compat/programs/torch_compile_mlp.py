"""torch.compile of an MLP with inductor's defaults (its compile workers are forked or spawned
children of this CUDA process)."""

from __future__ import annotations

import torch
from compat_common import digest, serve

REQUIRES = ("torch", "triton")
EXPECT = "identical"

torch.manual_seed(2)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.LayerNorm(256)
).cuda()
compiled = torch.compile(model)
x = torch.randn(64, 256, device="cuda")


def compute() -> str:
    with torch.no_grad():
        return digest(compiled(x))


serve(compute)
