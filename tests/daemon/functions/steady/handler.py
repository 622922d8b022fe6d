"""Steady: counts its calls in memory and sleeps when asked.

    {"add": n, "sleep": s} -> sleeps s seconds (default 0), then {"calls": calls so far, "total": running sum}
"""

from __future__ import annotations

import time
from typing import Any

import torpor


@torpor.function
class Steady:
    def setup(self) -> None:
        self.calls = 0
        self.total = 0

    def __call__(self, request: Any) -> Any:
        request = request or {}
        time.sleep(float(request.get("sleep", 0)))
        self.calls += 1
        self.total += int(request.get("add", 0))
        return {"calls": self.calls, "total": self.total}
