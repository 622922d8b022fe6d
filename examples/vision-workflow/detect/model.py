"""Stage 1 of examples/vision-workflow: a detector. It filters a 64×64 grey image with four
learned 8×8 filters, keeps the four strongest, non-overlapping 16×16 windows, and hands their
crops (an array of 4×16×16) to the next stage through the communication store: the value it
returns holds only the store key and the boxes.

Request: {"seed": int} (a synthetic image drawn from it) or {"image": 64 rows of 64 numbers}.
Value:   {"crops": store key, "boxes": [[y, x, 16, 16], ...], "request": id}
"""

from __future__ import annotations

import uuid
from typing import Any

import common
import numpy as np

import torpor

SIZE, CROP, TOP = 64, 16, 4


def synthetic(seed: int) -> np.ndarray:
    """A dark image with a few bright blobs: something for the detector to find."""
    rng = np.random.default_rng(seed)
    img = rng.random((SIZE, SIZE), dtype=np.float32) * 0.1
    for _ in range(5):
        y, x = rng.integers(0, SIZE - 12, 2)
        img[y : y + 12, x : x + 12] += rng.random((12, 12), dtype=np.float32)
    return img


@torpor.function
class Detect:
    def setup(self) -> None:
        self.filters = common.load_weights()["filters"]  # 4×8×8

    def detect(self, img: Any) -> tuple[Any, list[list[int]]]:
        # Energy of each 8×8 patch (stride 4) under the filters.
        if common.torch is None:
            patches = np.lib.stride_tricks.sliding_window_view(img, (8, 8))[::4, ::4]  # 15×15×8×8
            energy = np.abs(np.einsum("ijyx,fyx->ijf", patches, self.filters)).sum(-1)
        else:
            t = common.torch
            x = img.reshape(1, 1, SIZE, SIZE)
            energy = t.nn.functional.conv2d(x, self.filters.unsqueeze(1), stride=4).abs().sum(1)[0]
        scores = common.tolist(energy)
        order = sorted(((v, i, j) for i, row in enumerate(scores) for j, v in enumerate(row)), reverse=True)
        boxes: list[list[int]] = []
        for _, i, j in order:
            y, x = min(i * 4, SIZE - CROP), min(j * 4, SIZE - CROP)
            if all(abs(y - b[0]) >= CROP or abs(x - b[1]) >= CROP for b in boxes):
                boxes.append([y, x, CROP, CROP])
            if len(boxes) == TOP:
                break
        crops = [img[y : y + CROP, x : x + CROP] for y, x, _, _ in boxes]
        stack = np.stack(crops) if common.torch is None else common.torch.stack(crops)
        return stack, boxes

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise ValueError('the request must be {"seed": int} or {"image": 64×64 numbers}')
        if "image" in request:
            img = np.asarray(request["image"], dtype=np.float32)
            if img.shape != (SIZE, SIZE):
                raise ValueError(f"image must be {SIZE}×{SIZE}, got {img.shape}")
        else:
            img = synthetic(int(request.get("seed", 0)))
        crops, boxes = self.detect(common.asarray(img))
        if request.get("warmup"):
            return {"boxes": boxes}
        rid = str(request.get("request") or uuid.uuid4().hex)
        key = f"{rid}/crops"
        torpor.put(key, crops, ttl_s=60)
        return {"crops": key, "boxes": boxes, "request": rid}
