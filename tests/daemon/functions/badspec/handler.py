"""Faulty: answers, raises, crashes or hangs, as the request asks.

    {"echo": v}     -> {"echo": v, "pid": host-independent worker pid, "calls": n}
    {"raise": msg}  -> raises ValueError(msg)            (a user exception; the worker lives on)
    {"exit": code}  -> os._exit(code)                    (a worker crash)
    {"sleep": s}    -> sleeps s seconds, then answers    (a hung handler when s > timeout_s)
"""

from __future__ import annotations

import os
import time
from typing import Any

import torpor


@torpor.function
class Faulty:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        if "raise" in request:
            raise ValueError(request["raise"])
        if "exit" in request:
            os._exit(int(request["exit"]))
        if "sleep" in request:
            time.sleep(float(request["sleep"]))
        return {"echo": request.get("echo"), "calls": self.calls}
