"""torch.distributed with the NCCL backend, world size 1, a file store: the way serving engines
initialise it. Collectives must work after the restore."""

from __future__ import annotations

import torch
import torch.distributed as dist
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

import os

if os.path.exists("/tmp/torpor-compat-nccl-store"):
    os.unlink("/tmp/torpor-compat-nccl-store")
dist.init_process_group("nccl", init_method="file:///tmp/torpor-compat-nccl-store", rank=0, world_size=1)
torch.manual_seed(8)
x = torch.randn(1 << 16, device="cuda")


def compute() -> str:
    y = x.clone()
    dist.all_reduce(y)
    z = torch.empty_like(y)
    dist.broadcast(z.copy_(y), src=0)
    torch.cuda.synchronize()
    return digest(y, z)


serve(compute)
