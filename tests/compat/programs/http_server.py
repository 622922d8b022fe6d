"""A model behind an HTTP server (a thread of the program), asked over a keep-alive connection
that stays open across the snapshot (a TCP connection inside the tree's network namespace)."""

from __future__ import annotations

import torch
from compat_common import digest, http_service, serve

REQUIRES = ("torch",)
EXPECT = "identical"

torch.manual_seed(15)
model = torch.nn.Linear(64, 8).cuda().eval()
x = torch.randn(4, 64, device="cuda")


def infer() -> str:
    with torch.no_grad():
        return digest(model(x))


serve(http_service(infer))
