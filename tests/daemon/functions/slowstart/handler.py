"""Slowstart: a setup() that takes SETUP_S seconds, standing in for a model load, so that an
instance spends a known time starting. {} -> {"calls": calls so far}."""

from __future__ import annotations

import time
from typing import Any

import torpor

SETUP_S = 2.5


@torpor.function
class Slowstart:
    def setup(self) -> None:
        time.sleep(SETUP_S)
        self.calls = 0

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        return {"calls": self.calls}
