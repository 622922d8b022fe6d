"""Stage 2 of examples/vision-workflow: a classifier of the detector's crops (a 256-64-10
MLP). It takes the crops from the communication store (the very array stage 1 put there),
and puts the crops' 64-wide features there for stage 3.

Request: stage 1's value. Value: {"features": store key, "labels": [name per crop],
"confidence": [...], "boxes": [...], "request": id}
"""

from __future__ import annotations

from typing import Any

import common

import torpor

LABELS = ("cat", "dog", "car", "tree", "bird", "boat", "house", "person", "bike", "flower")


@torpor.function
class Classify:
    def setup(self) -> None:
        self.w = common.load_weights()

    def classify(self, crops: Any) -> tuple[Any, Any]:
        x = crops.reshape(crops.shape[0], -1)
        h = common.relu(x @ self.w["w1"] + self.w["b1"])
        return h, common.softmax(h @ self.w["w2"] + self.w["b2"])

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or "crops" not in request:
            raise ValueError('the request must be stage 1\'s value, {"crops": store key, ...}')
        crops = torpor.get(str(request["crops"]))
        features, probs = self.classify(crops)
        labels = [LABELS[i] for i in common.argmax(probs)]
        key = f"{request.get('request', 'r')}/features"
        torpor.put(key, features, ttl_s=60)
        return {
            "features": key,
            "labels": labels,
            "confidence": [round(max(p), 4) for p in common.tolist(probs)],
            "boxes": request.get("boxes", []),
            "request": request.get("request"),
        }
