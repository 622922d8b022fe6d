"""A Triton kernel (@triton.jit) adding and scaling two vectors that live on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from compat_common import digest, serve

REQUIRES = ("torch", "triton")
EXPECT = "identical"


@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out_ptr + i, alpha * tl.load(x_ptr + i, mask=mask) + tl.load(y_ptr + i, mask=mask), mask=mask)


g = torch.Generator(device="cuda").manual_seed(1)
x = torch.randn(1 << 20, device="cuda", generator=g)
y = torch.randn(1 << 20, device="cuda", generator=g)


def compute() -> str:
    out = torch.empty_like(x)
    axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), 2.5, BLOCK=1024)
    return digest(out)


serve(compute)
