"""cuBLASLt (bf16 matmul, addmm with a bias epilogue) and cuDNN (conv2d, benchmark mode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

torch.backends.cudnn.benchmark = True
torch.manual_seed(13)
a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
b = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
img = torch.randn(8, 16, 32, 32, device="cuda")
kernel = torch.randn(32, 16, 3, 3, device="cuda")


def compute() -> str:
    with torch.no_grad():
        return digest(a @ b, torch.addmm(bias, a, b), F.conv2d(img, kernel, padding=1))


serve(compute)
