"""Ballast: 48 MiB of bytes from a seeded generator, made at setup and kept in memory.

    {} -> {"sha256": digest of every byte, "mib": 48}
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torpor

SEED = 20261122
MIB = 48


def ballast() -> bytes:
    return random.Random(SEED).randbytes(MIB << 20)


@torpor.function
class Ballast:
    def setup(self) -> None:
        self.data = ballast()

    def __call__(self, request: Any) -> Any:
        return {"sha256": hashlib.sha256(self.data).hexdigest(), "mib": MIB}
