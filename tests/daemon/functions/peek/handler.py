"""Peek: what the worker sees. {"paths": [...]} -> {"calls": n, "seen": {path: contents or None},
"shm": sorted names in /dev/shm, "tmp": sorted names in /tmp}. Its setup leaves a file of its own
in /dev/shm and /tmp, which every restored instance must find again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torpor

OWN = "peek-own"


def read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


@torpor.function
class Peek:
    def setup(self) -> None:
        self.calls = 0
        for d in ("/dev/shm", "/tmp"):
            Path(d, OWN).write_text(f"own file in {d}")

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        return {
            "calls": self.calls,
            "seen": {p: read(p) for p in (request or {}).get("paths", [])},
            "shm": sorted(os.listdir("/dev/shm")),
            "tmp": sorted(os.listdir("/tmp")),
        }
