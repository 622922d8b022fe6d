"""Ledger: {"id": text, "sleep": seconds} -> sleeps, prints `ledger-ran <id>`, answers {"id": id, "n": calls so far}."""

from __future__ import annotations

import time
from typing import Any

import torpor


@torpor.function
class Ledger:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: Any) -> Any:
        request = request or {}
        time.sleep(float(request.get("sleep", 0)))
        self.calls += 1
        print(f"ledger-ran {request.get('id')}", flush=True)
        return {"id": request.get("id"), "n": self.calls}
