"""Tally: answers each request with its id and payload, and prints the id on stdout, so the load
benchmark can count from the instance logs how many times each request ran (0 lost, 0 duplicated).
{"id": str, "payload": any, "sleep": seconds} -> {"id": str, "payload": any, "pid": int}."""

from __future__ import annotations

import os
import time
from typing import Any

import torpor


@torpor.function
class Tally:
    def setup(self) -> None:
        self.pid = os.getpid()

    def __call__(self, request: Any) -> Any:
        time.sleep(float(request.get("sleep", 0)))
        print(f"tally-ran {request['id']}", flush=True)
        return {"id": request["id"], "payload": request.get("payload"), "pid": self.pid}
