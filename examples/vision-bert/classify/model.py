"""Stage 2 of examples/vision-bert: image classification with torchvision's ResNet-50
(25.6 M parameters, ImageNet's 1 000 classes) of the crops stage 1 put in the communication store.

Request: stage 1's value, {"crops": store key, "boxes": ..., "objects": ..., "request": id}.
Value:   {"labels": [ImageNet name per crop], "confidence": [p, ...], "boxes", "objects", "request"}

torpor.get takes the crops (a 4×3×224×224 CUDA tensor; in the workflow's sandbox the very
tensor stage 1 made) and consumes the key. Weights random with a fixed seed (../make_weights.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torchvision
from torchvision.models import ResNet50_Weights

import torpor

# ImageNet's normalisation, as the trained weights expect it.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build(device: str = "cuda") -> torch.nn.Module:
    with torch.device(device):
        return torchvision.models.resnet50(weights=None)


def load_into(model: torch.nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    state = load_file(path, device="cuda")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}; run make_weights.py")


@torpor.function
class Classify:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("vision-bert needs a CUDA GPU (torpor.toml: gpus = 1)")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        model = build()
        load_into(model, str(torpor.load("weights")))
        self.model = model.eval()
        self.names = ResNet50_Weights.IMAGENET1K_V2.meta["categories"]
        self.mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)

    def classify(self, crops: torch.Tensor) -> tuple[list[str], list[float]]:
        with torch.inference_mode():
            p = torch.softmax(self.model((crops - self.mean) / self.std), dim=-1)
        best, index = p.max(dim=-1)
        return [self.names[i] for i in index.tolist()], [round(v, 6) for v in best.tolist()]

    def __call__(self, request: Any) -> dict[str, Any]:
        if isinstance(request, dict) and request.get("warmup"):
            labels, _ = self.classify(torch.zeros(4, 3, 224, 224, device="cuda"))
            return {"labels": labels}
        if not isinstance(request, dict) or "crops" not in request:
            raise ValueError('the request must be stage 1\'s value, {"crops": store key, ...}')
        crops = torpor.get(str(request["crops"]))
        labels, confidence = self.classify(crops)
        return {
            "labels": labels,
            "confidence": confidence,
            "boxes": request.get("boxes", []),
            "objects": request.get("objects", []),
            "request": request.get("request"),
        }
