"""compat: a CuPy matmul and kernel on GPU arrays; answers its digest and the reference's."""

from __future__ import annotations

import hashlib
from typing import Any

import cupy
import torpor


@torpor.function
class Cupy:
    def setup(self) -> None:
        self.a = cupy.random.default_rng(24).standard_normal((256, 256), dtype=cupy.float32)
        self.reference = self.run()

    def run(self) -> str:
        return hashlib.sha256(cupy.tanh(self.a @ self.a).get().tobytes()).hexdigest()[:16]

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        got = self.run()
        return {"digest": got, "reference": self.reference, "ok": got == self.reference}
