"""Stage 3 of examples/vision-workflow: a text classifier. It writes a caption from stage 2's
labels, embeds its words, runs one self-attention layer over them (a BERT block in miniature)
mixed with the crops' features taken from the communication store, and classifies the scene's
topic.

Request: stage 2's value. Value: {"caption": str, "topic": str, "scores": {topic: p}}
"""

from __future__ import annotations

import math
from typing import Any

import common

import torpor

TOPICS = ("nature", "city", "pets", "travel")
WORDS = (
    "<unk> a an the scene with and of photo picture cat cats dog dogs car cars tree trees bird birds "
    "boat boats house houses person people bike bikes flower flowers one two three four in on near "
    "street park sea sky garden road field big small"
).split()


@torpor.function
class Describe:
    def setup(self) -> None:
        self.w = common.load_weights()
        self.index = {w: i for i, w in enumerate(WORDS)}

    def caption(self, labels: list[str]) -> str:
        counts: dict[str, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        parts = [
            f"a {name}" if n == 1 else f"{('one', 'two', 'three', 'four')[min(n, 4) - 1]} {name}s"
            for name, n in counts.items()
        ]
        return "a scene with " + (" and ".join(parts) if parts else "nothing")

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict) or "features" not in request:
            raise ValueError('the request must be stage 2\'s value, {"features": store key, ...}')
        features = torpor.get(str(request["features"]))
        text = self.caption(list(request.get("labels", [])))
        ids = [self.index.get(t, 0) for t in text.split()]
        w = self.w
        x = w["embed"][ids]  # tokens × 32
        q, k, v = x @ w["wq"], x @ w["wk"], x @ w["wv"]
        att = common.softmax((q @ k.T) / math.sqrt(q.shape[-1])) @ v
        pooled = att.mean(0) + (features @ w["feat"]).mean(0)
        scores = common.tolist(common.softmax(pooled @ w["out"]))
        best = max(range(len(TOPICS)), key=lambda i: scores[i])
        return {
            "caption": text,
            "topic": TOPICS[best],
            "scores": {t: round(s, 4) for t, s in zip(TOPICS, scores, strict=True)},
            "boxes": request.get("boxes", []),
        }
