"""Stage 1 of examples/vision-bert: object detection with torchvision's Faster R-CNN
(MobileNetV3-Large 320 FPN backbone, 19 M parameters, COCO's 91 classes) on one GPU.

Request: {"seed": int}: a synthetic 3×320×320 image drawn on the GPU from torch.Generator(seed).
Value:   {"crops": store key, "boxes": [[x1, y1, x2, y2], ...], "objects": [COCO name, ...],
          "request": id}

The four best boxes are cut out of the image and resized to 224×224 on the GPU (RoIAlign), and
that 4×3×224×224 CUDA tensor goes to stage 2 through the communication store (torpor.put: in
the workflow's sandbox, the same tensor, no copy); the value carries only its key. The weights
are random with a fixed seed (../make_weights.py: no download), so the boxes are what an
untrained detector proposes, deterministically: the same request gives the same answer.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torchvision
from torchvision.models.detection import FasterRCNN_MobileNet_V3_Large_320_FPN_Weights
from torchvision.ops import roi_align

import torpor

SIZE, CROP, TOP = 320, 224, 4


def build(device: str = "cuda") -> torch.nn.Module:
    """The detector, its parameters on the GPU (random until loaded): every box scored (an
    untrained head scores them all low), the best TOP kept."""
    with torch.device(device):
        return torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=91, box_score_thresh=0.0, box_detections_per_img=TOP
        )


def load_into(model: torch.nn.Module, path: str) -> None:
    """The safetensors file at `path` into `model`: every name must match (else make_weights.py
    wrote another model's file)."""
    from safetensors.torch import load_file

    state = load_file(path, device="cuda")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit {type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}; run make_weights.py")


def synthetic(seed: int) -> torch.Tensor:
    """A dark image with a few bright rectangles, drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.rand(3, SIZE, SIZE, generator=g, device="cuda") * 0.2
    corners = torch.randint(0, SIZE - 96, (5, 2), generator=g, device="cuda").tolist()
    colours = torch.rand(5, 3, 1, 1, generator=g, device="cuda")
    for (y, x), c in zip(corners, colours):
        img[:, y : y + 96, x : x + 96] += c
    return img.clamp_(0, 1)


@torpor.function
class Detect:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("vision-bert needs a CUDA GPU (torpor.toml: gpus = 1)")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        model = build()
        load_into(model, str(torpor.load("weights")))
        self.model = model.eval()
        self.names = FasterRCNN_MobileNet_V3_Large_320_FPN_Weights.COCO_V1.meta["categories"]

    def detect(self, img: torch.Tensor) -> tuple[torch.Tensor, list[list[float]], list[str]]:
        with torch.inference_mode():
            out = self.model([img])[0]
        boxes, labels = out["boxes"][:TOP], out["labels"][:TOP].tolist()
        # Fewer boxes than TOP (none survived): the whole image fills the rest.
        whole = torch.tensor([[0.0, 0.0, SIZE - 1.0, SIZE - 1.0]], device="cuda")
        while boxes.shape[0] < TOP:
            boxes = torch.cat([boxes, whole])
            labels.append(0)
        crops = roi_align(img[None], [boxes], output_size=(CROP, CROP), spatial_scale=1.0, aligned=True)
        rounded = [[round(v, 2) for v in b] for b in boxes.tolist()]
        return crops, rounded, [self.names[i] for i in labels]

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise ValueError('the request must be {"seed": int}')
        crops, boxes, objects = self.detect(synthetic(int(request.get("seed", 0))))
        if request.get("warmup"):
            return {"boxes": boxes}
        rid = str(request.get("request") or uuid.uuid4().hex)
        key = f"{rid}/crops"
        torpor.put(key, crops, ttl_s=60)
        return {"crops": key, "boxes": boxes, "objects": objects, "request": rid}
