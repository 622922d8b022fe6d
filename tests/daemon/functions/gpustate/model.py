"""A GPU function whose state lives in a writable 64 MiB tensor on the GPU (a segment of its
own on the split path: no module owns it, so the read-only probe never takes it), for the real
GPU's live-migration test (tests/daemon/test_daemon_migrate_gpu.py).

Requests:
    {"op": "sha"}          -> {"sha": sha256 of the state's bytes, "calls": n, "uuid": the GPU's UUID}
    {"op": "step", "k": k} -> adds k to a 1 MiB slice that k selects, then as "sha"

`expected_sha(ks)` is the state after the steps `ks`, computed on the CPU the same way.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torpor

ELEMENTS = 8 << 20  # int64: 64 MiB
SLICE = 128 << 10  # int64: 1 MiB


def start(k: int) -> int:
    """The slice step `k` writes: spread over the tensor, so different steps dirty different blocks."""
    return (k * 7919 * SLICE) % (ELEMENTS - SLICE)


def step(state: torch.Tensor, k: int) -> None:
    at = start(k)
    state[at : at + SLICE] += k


def sha(state: torch.Tensor) -> str:
    return hashlib.sha256(state.cpu().contiguous().numpy().tobytes()).hexdigest()


def expected_sha(ks: list[int]) -> str:
    state = torch.zeros(ELEMENTS, dtype=torch.int64)
    for k in ks:
        step(state, k)
    return sha(state)


@torpor.function
class State:
    def setup(self) -> None:
        self.state = torch.zeros(ELEMENTS, dtype=torch.int64, device="cuda")
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        op = request.get("op")
        if op == "step":
            step(self.state, int(request["k"]))
        elif op != "sha":
            raise ValueError(f"unknown op {op!r}")
        torch.cuda.synchronize()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        return {"sha": sha(self.state), "calls": self.calls, "uuid": uuid}
