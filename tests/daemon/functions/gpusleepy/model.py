"""MatMul: y = softmax(x @ W) with a fixed W on the GPU; {"x": [4 numbers]} -> {"y": [4 numbers], "calls": n}."""

from __future__ import annotations

from typing import Any

import torch
import torpor


@torpor.function
class MatMul:
    def setup(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(4, 4, generator=g).cuda()
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        x = torch.tensor([request["x"]], device="cuda")
        y = torch.softmax(x @ self.w, dim=-1)
        return {"y": y[0].tolist(), "calls": self.calls}
