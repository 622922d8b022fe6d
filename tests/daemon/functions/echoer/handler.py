"""Echoer: prints what it is told, on stdout and stderr, after an optional pause.
{"say": text, "sleep": seconds} -> {"said": text}."""

from __future__ import annotations

import sys
import time
from typing import Any

import torpor


@torpor.function
class Echoer:
    def setup(self) -> None:
        print("echoer setup", flush=True)

    def __call__(self, request: Any) -> Any:
        request = request or {}
        time.sleep(float(request.get("sleep", 0)))
        said = str(request.get("say", ""))
        print(f"echoer says {said}", flush=True)
        print(f"echoer stderr {said}", file=sys.stderr, flush=True)
        return {"said": said}
