"""Sleepy: counts its calls in memory. {"add": n} -> {"calls": calls so far, "total": running sum}."""

from __future__ import annotations

from typing import Any

import torpor


@torpor.function
class Sleepy:
    def setup(self) -> None:
        self.calls = 0
        self.total = 0

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        self.total += int((request or {}).get("add", 0))
        print(f"sleepy call {self.calls}", flush=True)
        return {"calls": self.calls, "total": self.total}
