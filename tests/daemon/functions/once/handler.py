"""Once: counts its calls in memory, sleeps and raises when asked, so a test can tell whether a
request with an Idempotency-Key ran once.

    {"sleep": s, "raise": bool, "tag": any} -> sleeps s seconds (default 0), then raises
    ValueError("asked to raise") or answers {"calls": calls so far, "tag": tag, "pid": pid}
"""

from __future__ import annotations

import os
import time
from typing import Any

import torpor


@torpor.function
class Once:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: Any) -> Any:
        request = request or {}
        time.sleep(float(request.get("sleep", 0)))
        self.calls += 1
        print(f"once-ran {request.get('tag')}", flush=True)
        if request.get("raise"):
            raise ValueError("asked to raise")
        return {"calls": self.calls, "tag": request.get("tag"), "pid": os.getpid()}
