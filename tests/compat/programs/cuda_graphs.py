"""A model captured into a CUDA graph and replayed (static input and output buffers)."""

from __future__ import annotations

import torch
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

torch.manual_seed(11)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128)).cuda().eval()
static_in = torch.randn(32, 128, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side), torch.no_grad():
    for _ in range(3):
        model(static_in)  # warm-up before capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph), torch.no_grad():
    static_out = model(static_in)


def compute() -> str:
    graph.replay()
    torch.cuda.synchronize()
    return digest(static_out)


serve(compute)
