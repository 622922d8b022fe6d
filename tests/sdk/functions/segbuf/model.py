"""SegBuf: keeps a writable torpor.buffer() and read-only declared data in hook segments.

Requests:
    {"op": "info"}                        -> addresses, SHA-256 of both, the writable notes, the
                                             hook's segments
    {"op": "write", "at": n, "hex": s}    -> writes bytes.fromhex(s) into the buffer at n
    {"op": "write_table"}                 -> tries to write the read-only data ("refused")
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import torpor
from torpor import hook

BUFFER_SIZE = 3 * 4096 + 100


def pattern(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


@torpor.function
class SegBuf:
    def setup(self) -> None:
        self.buf = torpor.buffer(BUFFER_SIZE)
        assert self.buf.tobytes() == bytes(BUFFER_SIZE), "torpor.buffer() is not zeroed"
        self.buf[:] = pattern(BUFFER_SIZE)
        self.table = torpor.load("table", buffer=True)
        self.notes = torpor.load("notes", buffer=True)
        self.notes[:8] = b"WRITABLE"
        assert torpor.load("table", buffer=True) is self.table, "a second load made a second copy"

    def __call__(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        if op == "info":
            return {
                "buf_addr": ctypes.addressof((ctypes.c_ubyte * len(self.buf)).from_buffer(self.buf)),
                "buf_len": len(self.buf),
                "buf_sha": hashlib.sha256(self.buf).hexdigest(),
                "table_len": len(self.table),
                "table_sha": hashlib.sha256(self.table).hexdigest(),
                "table_readonly": self.table.readonly,
                "notes": self.notes.tobytes().decode(),
                "notes_readonly": self.notes.readonly,
                "segments": [
                    {**s.frame(), "mapped": s.mapped} for s in hook.get().segments()
                ],
            }
        if op == "write":
            data = bytes.fromhex(request["hex"])
            self.buf[request["at"] : request["at"] + len(data)] = data
            return "written"
        if op == "write_table":
            try:
                self.table[0] = 1  # type: ignore[index]
            except TypeError:
                return "refused"
            return "written"
        raise ValueError(f"unknown op {op!r}")
