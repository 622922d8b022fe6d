"""torch.distributed with the NCCL backend, world size 1, a TCP store: the way serving engines
initialise it. Collectives must work after the restore."""

from __future__ import annotations

import torch
import torch.distributed as dist
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
torch.manual_seed(7)
x = torch.randn(1 << 16, device="cuda")


def compute() -> str:
    y = x.clone()
    dist.all_reduce(y)
    z = torch.empty_like(y)
    dist.broadcast(z.copy_(y), src=0)
    torch.cuda.synchronize()
    return digest(y, z)


serve(compute)
