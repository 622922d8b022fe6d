"""Layers: eight Linear(2048, 2048) layers in sequence on the GPU.

Requests:
    {"x": seed, "rid": n}  -> {"sha": SHA-256 of the output's bytes}; each layer, as its forward
                              ends, prints "torchlayers: layer I ran (request N)" on stderr
    {"op": "weights"}      -> {"weights": [each layer's weight address]}
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch
import torpor

LAYERS = 8
WIDTH = 2048


@torpor.function
class Layers:
    def setup(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda().eval()
        self.rid = None
        for i, layer in enumerate(self.net):
            layer.register_forward_hook(self._progress(i))

    def _progress(self, i: int) -> Any:
        def hook(_module: Any, _args: Any, _out: Any) -> None:
            print(f"torchlayers: layer {i} ran (request {self.rid})", file=sys.stderr, flush=True)

        return hook

    def __call__(self, request: dict[str, Any]) -> Any:
        if request.get("op") == "weights":
            return {"weights": [layer.weight.data_ptr() for layer in self.net]}
        self.rid = request["rid"]
        g = torch.Generator().manual_seed(int(request["x"]))
        x = torch.randn(4, WIDTH, generator=g).cuda()
        with torch.no_grad():
            y = self.net(x)
        return {"sha": hashlib.sha256(y.cpu().numpy().tobytes()).hexdigest()}
