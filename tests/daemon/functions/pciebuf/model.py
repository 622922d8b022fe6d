"""PcieBuf: one writable torpor.buffer() segment, its size in size.txt beside this file.

Requests: {} -> the buffer's size and its first and last byte (each request writes them, so
the segment is writable: every restore fills it from the restore server's caches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torpor

SIZE = int((Path(__file__).resolve().parent / "size.txt").read_text())


@torpor.function
class PcieBuf:
    def setup(self) -> None:
        self.buf = torpor.buffer(SIZE)
        self.buf[0] = 1
        self.buf[SIZE - 1] = 2
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        first, last = self.buf[0], self.buf[SIZE - 1]
        self.calls += 1
        self.buf[0] = (first + 1) % 256
        return {"size": SIZE, "first": first, "last": last, "calls": self.calls}
