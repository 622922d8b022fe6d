"""compat: a torch.compile MLP (inductor defaults); answers its digest and whether it equals the one setup() saw."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torpor


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().cpu().numpy().tobytes()).hexdigest()[:16]


@torpor.function
class Compiled:
    def setup(self) -> None:
        torch.manual_seed(22)
        self.model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
        self.x = torch.randn(16, 256, device="cuda")
        self.compiled = torch.compile(self.model)
        self.reference = self.run()

    def run(self) -> str:
        with torch.no_grad():
            return digest(self.compiled(self.x))

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        got = self.run()
        return {"digest": got, "reference": self.reference, "ok": got == self.reference}
