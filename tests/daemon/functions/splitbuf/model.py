"""SplitBuf: a function whose state lives in device-memory hook segments (docs/split.md).

- `weights`: a torpor.buffer() filled in setup and only read afterwards (read-only by the
  daemon's warm-up probe);
- `table`: read-only declared data loaded with torpor.load(name, buffer=True) (sealed);
- `scratch`: a torpor.buffer() every request writes (writable).

Requests:
    {"op": "compute", "x": n}   -> SHA-256 of weights + table + n, and the request count
    {"op": "info", "sleep": s}  -> addresses, hashes and /proc/self/maps lines of the segments
    {"op": "peek"}              -> the scratch buffer's first 8 bytes as the previous request
                                   left them (this request writes nothing)
    {"op": "renew_scratch"}     -> the scratch buffer moved to a new segment and its old one
                                   freed, as an allocator emptying its cache after a restore
                                   gives back a segment torpord handed over
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from typing import Any

import torpor
from torpor import hook

WEIGHTS_SIZE = 16 * 4096


def weights_pattern() -> bytes:
    return bytes((i * 31 + 7) % 251 for i in range(WEIGHTS_SIZE))


def address(view: memoryview) -> int:
    """The address of a writable view's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def sealed_segment() -> int:
    """The address of the one read-only (sealed) segment: the declared table."""
    (va,) = [s.va for s in hook.get().segments() if s.read_only]
    return va


def mapping(addr: int) -> dict[str, Any] | None:
    """The /proc/self/maps line covering `addr`: perms, inode, path."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return {
                    "start": lo,
                    "end": hi,
                    "perms": fields[1],
                    "inode": int(fields[4]),
                    "path": " ".join(fields[5:]),
                }
    return None


@torpor.function
class SplitBuf:
    def setup(self) -> None:
        self.weights = torpor.buffer(WEIGHTS_SIZE)
        self.weights[:] = weights_pattern()
        self.table = torpor.load("table", buffer=True)
        self.scratch = torpor.buffer(2 * 4096)
        self.calls = 0
        self.addrs = {
            "weights": address(self.weights),
            "table": sealed_segment(),
            "scratch": address(self.scratch),
        }

    def __call__(self, request: dict[str, Any]) -> Any:
        if request.get("op") == "peek":
            return {"scratch": int.from_bytes(self.scratch[:8], "little"), "calls": self.calls}
        self.calls += 1
        self.scratch[:8] = self.calls.to_bytes(8, "little")
        op = request.get("op")
        if op == "compute":
            h = hashlib.sha256(self.weights)
            h.update(self.table)
            h.update(str(request["x"]).encode())
            return {"sha": h.hexdigest(), "calls": self.calls}
        if op == "renew_scratch":
            old = self.addrs["scratch"]
            fresh = torpor.buffer(len(self.scratch))
            fresh[:] = self.scratch[:]
            self.scratch = fresh
            self.addrs["scratch"] = address(fresh)
            hook.get().host_free(old)
            return {"freed": old, "calls": self.calls}
        if op == "info":
            time.sleep(float(request.get("sleep", 0)))
            return {
                "addrs": self.addrs,
                "sha": {
                    "weights": hashlib.sha256(self.weights).hexdigest(),
                    "table": hashlib.sha256(self.table).hexdigest(),
                },
                "maps": {name: mapping(a) for name, a in self.addrs.items()},
            }
        raise ValueError(f"unknown op {op!r}")
