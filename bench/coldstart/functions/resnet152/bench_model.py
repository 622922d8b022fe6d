"""examples/resnet152 with `hold_s`, and a features ("embed") variant on the same weights.

`model` is examples/resnet152/model.py, copied beside this file by bench/coldstart/split.py.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import torchvision
import torpor
from model import ResNet152


def without_hold(request: Any) -> tuple[Any, float]:
    """The request without its `hold_s`, and the seconds to hold."""
    if not isinstance(request, dict) or "hold_s" not in request:
        return request, 0.0
    hold = request["hold_s"]
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 600:
        raise ValueError(f"hold_s must be a number of seconds from 0 to 600, got {hold!r}")
    return {k: v for k, v in request.items() if k != "hold_s"}, float(hold)


@torpor.function
class HeldResNet152(ResNet152):
    def __call__(self, request: Any) -> dict[str, Any]:
        request, hold = without_hold(request)
        out = super().__call__(request)
        time.sleep(hold)
        return out


@torpor.function
class EmbedResNet152(ResNet152):
    """The 2048 features before the classifier; the classifier's weights stay loaded."""

    def setup(self) -> None:
        super().setup()
        self.fc = self.model.fc
        self.model.fc = torch.nn.Identity()

    def __call__(self, request: Any) -> dict[str, Any]:
        request, hold = without_hold(request)
        seed = request.get("seed", 0) if isinstance(request, dict) else 0
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 3, 224, 224, generator=gen).to("cuda")
        with torch.inference_mode():
            features = self.model(x).float().cpu().contiguous()
        time.sleep(hold)
        return {
            "features": features.shape[1],
            "digest": hashlib.sha256(features.numpy().tobytes()).hexdigest(),
        }


@torpor.function
class MappedResNet152(HeldResNet152):
    """The same model with its weights as views of the platform-managed GPU memory of its
    `device = "cuda"` data `weights` (torpor.load_tensors): setup() reads and copies nothing
    (the `-pooled` copy of the split benchmark: a start in a ready sandbox)."""

    def setup(self) -> None:
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        resnet152 = torchvision.models.resnet152  # imported outside the meta device's mode
        with torch.device("meta"):
            model = resnet152(weights=None)
        torpor.assign(model, torpor.load_tensors("weights"))
        self.model = model.eval()
