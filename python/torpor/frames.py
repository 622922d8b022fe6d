"""The frame codec of the worker protocol (docs/torpord.md).

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object.
A frame longer than MAX_FRAME (64 MiB), a connection that ends inside a frame, bytes that are
not UTF-8, text that is not JSON (NaN and Infinity included), and JSON that is not an object
are all FrameErrors. Encoding refuses the same things, so a peer never sees a frame it must
reject.

FrameReader keeps one receive buffer per connection and reads each frame with two recv_into
calls, so a small frame costs no allocation besides the decoded object.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from torpor.errors import FrameError

MAX_FRAME = 64 << 20
HEADER = struct.Struct(">I")
_INITIAL_BUFFER = 64 << 10

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_decoder = json.JSONDecoder(parse_constant=_no_constant)


def encode(obj: dict[str, Any], max_frame: int = MAX_FRAME) -> bytes:
    """One frame: header and payload. Raises FrameError for a non-object, a value JSON cannot
    carry (NaN, a set, an object of a class...) or a payload over max_frame bytes."""
    if not isinstance(obj, dict):
        raise FrameError(f"a frame must be a JSON object, got {type(obj).__name__}; wrap the value in a dict")
    try:
        payload = _encoder.encode(obj).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise FrameError(
            f"frame cannot be encoded as JSON: {e}; "
            "send only dicts, lists, str, int, finite float, bool, None"
        ) from None
    if len(payload) > max_frame:
        raise FrameError(
            f"frame of {len(payload)} bytes is over the {max_frame}-byte maximum; "
            "send less data per frame (e.g. a file path)"
        )
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The object in one frame's payload (without the header)."""
    try:
        text = str(payload, "utf-8")
    except UnicodeDecodeError as e:
        raise FrameError(
            f"frame is not valid UTF-8 (byte {e.start} of {len(payload)}); the peer must send UTF-8 JSON"
        ) from None
    try:
        obj = _decoder.decode(text)
    except ValueError as e:
        snippet = text[:80].replace("\n", " ")
        raise FrameError(
            f"frame is not valid JSON ({e}) in {snippet!r}; the peer must send one JSON object per frame"
        ) from None
    if not isinstance(obj, dict):
        raise FrameError(
            f"frame holds a JSON {type(obj).__name__}, not an object; "
            "the peer must send one JSON object per frame"
        )
    return obj


def write_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode(obj))


class FrameReader:
    """Reads frames from a stream socket, reusing one buffer."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._header = bytearray(HEADER.size)
        self._header_view = memoryview(self._header)
        self._buf = bytearray(_INITIAL_BUFFER)
        self._view = memoryview(self._buf)

    def _fill(self, view: memoryview) -> int:
        """Fill `view` completely; returns how many bytes arrived before EOF (len(view) if none)."""
        got = 0
        n = len(view)
        recv_into = self.sock.recv_into
        while got < n:
            k = recv_into(view[got:])
            if k == 0:
                return got
            got += k
        return got

    def read(self) -> dict[str, Any] | None:
        """The next frame's object, or None when the peer closed the connection between frames."""
        got = self._fill(self._header_view)
        if got == 0:
            return None
        if got < HEADER.size:
            raise FrameError(
                f"connection closed inside a frame header ({got} of {HEADER.size} bytes); "
                "the peer must send whole frames"
            )
        (size,) = HEADER.unpack(self._header)
        if size > self.max_frame:
            raise FrameError(
                f"frame of {size} bytes is over the {self.max_frame}-byte maximum; "
                "the peer must send smaller frames"
            )
        if size > len(self._buf):
            self._buf = bytearray(size)
            self._view = memoryview(self._buf)
        view = self._view[:size]
        got = self._fill(view)
        if got < size:
            raise FrameError(
                f"connection closed inside a frame ({got} of {size} bytes); the peer must send whole frames"
            )
        return decode(view)

    def shrink(self) -> None:
        """Drop a buffer that grew for a big frame (e.g. before a snapshot, to keep it small)."""
        if len(self._buf) > _INITIAL_BUFFER:
            self._buf = bytearray(_INITIAL_BUFFER)
            self._view = memoryview(self._buf)
