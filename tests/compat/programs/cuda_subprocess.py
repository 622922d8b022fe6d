"""A CPU parent whose subprocess (exec'd Python) holds CUDA state and answers through pipes."""

from __future__ import annotations

import subprocess
import sys

from compat_common import serve

REQUIRES = ("torch",)
EXPECT = "identical"

CHILD = """
import hashlib, sys, torch
torch.manual_seed(14)
w = torch.randn(256, 256, device="cuda")
for line in sys.stdin:
    y = torch.tanh(w @ w).float().cpu().numpy()
    print(hashlib.sha256(y.tobytes()).hexdigest()[:16], flush=True)
"""
child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def compute() -> str:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    return child.stdout.readline().strip()


serve(compute)
