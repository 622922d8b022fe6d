"""Pinned host memory and non-blocking copies on a side stream, overlapped with compute."""

from __future__ import annotations

import torch
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

torch.manual_seed(12)
host_in = torch.randn(4, 1 << 18).pin_memory()
host_out = torch.empty(4, 1 << 18).pin_memory()
weight = torch.randn(1 << 18, device="cuda")
stream = torch.cuda.Stream()


def compute() -> str:
    with torch.cuda.stream(stream):
        dev = host_in.to("cuda", non_blocking=True)
        res = torch.sin(dev * weight)
        host_out.copy_(res, non_blocking=True)
    stream.synchronize()
    return digest(host_out)


serve(compute)
