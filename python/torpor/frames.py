"""The frame codec of the worker protocol (docs/torpord.md).

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object.
A frame longer than MAX_FRAME (64 MiB), a connection that ends inside a frame, bytes that are
not UTF-8, text that is not JSON (NaN and Infinity included), and JSON that is not an object
are all FrameErrors. Encoding refuses the same things, so a peer never sees a frame it must
reject.

FrameReader keeps one receive buffer per connection and reads each frame with two recv_into
calls, so a small frame costs no allocation besides the decoded object.

A frame may carry one file descriptor (SCM_RIGHTS), sent with its first byte
(write_frame_with_fd). A reader takes it only while its `fds` attribute is set: the header is
then read with recvmsg_into, which costs about 2 us more per frame than recv_into, so the
worker sets it only while it waits for fds (docs/split.md). Without it the kernel closes any
fd that comes, and the frame arrives without it.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from typing import Any

from torpor.errors import FrameError

MAX_FRAME = 64 << 20
HEADER = struct.Struct(">I")
_INITIAL_BUFFER = 64 << 10
# Room for two fds, so a second one is received (and closed) rather than silently truncated.
_FD_SPACE = socket.CMSG_SPACE(2 * array.array("i").itemsize)
_CMSG_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)

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


def write_frame_with_fd(sock: socket.socket, obj: dict[str, Any], fd: int) -> None:
    """One frame with `fd` (which stays open here) attached to its first byte."""
    data = encode(obj)
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


class FrameReader:
    """Reads frames from a stream socket, reusing one buffer."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME, fds: bool = False) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.fds = fds
        # A sandbox's reader: frames may carry an fd whatever `fds` says (torpor.store's
        # store_value), so every header is read with recvmsg.
        self.accept_fds = False
        self._fd: int | None = None
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

    def _fill_header_with_fd(self) -> int:
        """Like _fill for the header, taking the fd that came with its first byte (if any)."""
        view = self._header_view
        got, ancdata, flags, _ = self.sock.recvmsg_into([view], _FD_SPACE, _CMSG_CLOEXEC)
        fds = _fds_of(ancdata)
        if len(fds) > 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError("a frame came with more than one fd; the peer must send at most one fd per frame")
        if fds:
            if not _CMSG_CLOEXEC:
                os.set_inheritable(fds[0], False)
            self._fd = fds[0]
        if got == 0:
            return 0
        return got + self._fill(view[got:])

    def take_fd(self) -> int | None:
        """The fd that came with the last frame read, now the caller's to close (None if none).
        An fd not taken before the next read is closed then."""
        fd, self._fd = self._fd, None
        return fd

    def read(self) -> dict[str, Any] | None:
        """The next frame's object, or None when the peer closed the connection between frames."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        got = self._fill_header_with_fd() if self.fds or self.accept_fds else self._fill(self._header_view)
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
