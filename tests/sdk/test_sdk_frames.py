"""The frame codec over real socket pairs: round trips, limits, truncation, garbage."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from torpor.errors import FrameError
from torpor.frames import HEADER, MAX_FRAME, FrameReader, decode, encode, write_frame, write_frame_with_fd


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_header_and_payload_layout() -> None:
    assert MAX_FRAME == 64 * 1024 * 1024
    data = encode({"type": "hello", "name": "ü"})
    (n,) = struct.unpack(">I", data[:4])
    assert n == len(data) - 4
    assert data[4:].decode("utf-8") == '{"type":"hello","name":"ü"}'


def test_round_trip_many_frames_and_a_big_one(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    big = {"blob": "x" * (3 << 20), "nested": {"list": [1, 2.5, None, True, "é😀"]}}
    frames: list[dict[str, Any]] = [{"type": "invoke", "id": i, "request": {"n": i}} for i in range(50)] + [
        big,
        {"after": "big"},
    ]

    def send() -> None:
        for f in frames:
            write_frame(a, f)
        a.shutdown(socket.SHUT_WR)

    t = threading.Thread(target=send)
    t.start()
    r = FrameReader(b)
    got = []
    while (doc := r.read()) is not None:
        got.append(doc)
    t.join()
    assert got == frames
    r.shrink()
    assert r.read() is None  # still at EOF after dropping the big buffer


def test_frame_at_and_over_the_limit(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload_len = len(encode({"k": "v" * 100})) - HEADER.size
    encode({"k": "v" * 100}, max_frame=payload_len)  # exactly the limit: fine
    with pytest.raises(
        FrameError, match=rf"frame of {payload_len} bytes is over the {payload_len - 1}-byte maximum"
    ):
        encode({"k": "v" * 100}, max_frame=payload_len - 1)
    # A reader refuses an oversize header before reading (or waiting for) the payload.
    a.sendall(HEADER.pack(MAX_FRAME + 1))
    with pytest.raises(FrameError, match="over the 67108864-byte maximum"):
        FrameReader(b).read()


def test_exactly_64_mib_is_accepted(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    filler = MAX_FRAME - len(b'{"k":""}')
    frame = encode({"k": "a" * filler})
    assert len(frame) == MAX_FRAME + HEADER.size
    t = threading.Thread(target=a.sendall, args=(frame,))
    t.start()
    doc = FrameReader(b).read()
    t.join()
    assert doc is not None and len(doc["k"]) == filler
    with pytest.raises(FrameError, match="over the"):
        encode({"k": "a" * (filler + 1)})


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"\x00", "inside a frame header (1 of 4 bytes)"),
        (b"\x00\x00\x00\x0a{}", "inside a frame (2 of 10 bytes)"),
    ],
)
def test_truncated(pair: tuple[socket.socket, socket.socket], raw: bytes, words: str) -> None:
    a, b = pair
    a.sendall(raw)
    a.close()
    with pytest.raises(FrameError) as info:
        FrameReader(b).read()
    assert words in str(info.value)


def test_clean_eof_between_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    write_frame(a, {"x": 1})
    a.close()
    r = FrameReader(b)
    assert r.read() == {"x": 1}
    assert r.read() is None


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"hello", "not valid JSON"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": -Infinity}', "not valid JSON"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'"text"', "JSON str, not an object"),
        (b"null", "JSON NoneType, not an object"),
        (b'{"a": "\xc3"}', "not valid UTF-8 (byte 7 of 10)"),
        (b"\xff\xfe{}", "not valid UTF-8 (byte 0"),
        (b'{"a":1} {"b":2}', "not valid JSON"),
    ],
)
def test_garbage_is_refused(pair: tuple[socket.socket, socket.socket], payload: bytes, words: str) -> None:
    with pytest.raises(FrameError) as info:
        decode(payload)
    assert words in str(info.value)
    a, b = pair
    a.sendall(HEADER.pack(len(payload)) + payload)
    with pytest.raises(FrameError, match="; the peer must"):
        FrameReader(b).read()


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ([1], "must be a JSON object, got list"),
        ({"v": float("nan")}, "cannot be encoded as JSON"),
        ({"v": {1, 2}}, "set is not JSON serializable"),
        ({"v": "\udc80"}, "cannot be encoded as JSON"),
    ],
)
def test_encode_refuses_what_a_peer_would_reject(obj: object, words: str) -> None:
    with pytest.raises(FrameError) as info:
        encode(obj)  # type: ignore[arg-type]
    assert words in str(info.value)


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _pipe_with(data: bytes) -> tuple[int, int]:
    r, w = os.pipe()
    os.write(w, data)
    return r, w


def test_a_frame_carries_one_fd_when_the_reader_takes_fds(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = FrameReader(b, fds=True)
    r, w = _pipe_with(b"through the fd")
    try:
        write_frame_with_fd(a, {"type": "map", "fd": True}, r)
        write_frame(a, {"type": "plain"})
        assert reader.read() == {"type": "map", "fd": True}
        fd = reader.take_fd()
        assert fd is not None and fd not in (r, w)
        assert os.read(fd, 100) == b"through the fd"
        assert not os.get_inheritable(fd)
        os.close(fd)
        assert reader.take_fd() is None
        assert reader.read() == {"type": "plain"}
        assert reader.take_fd() is None
    finally:
        os.close(r)
        os.close(w)


def test_an_fd_not_taken_is_closed_and_a_reader_without_fds_drops_them(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    r, w = _pipe_with(b"x")
    try:
        before = _open_fds()
        reader = FrameReader(b, fds=True)
        write_frame_with_fd(a, {"n": 1}, r)
        write_frame(a, {"n": 2})
        assert reader.read() == {"n": 1}
        assert len(_open_fds() - before) == 1, "the fd did not arrive"
        assert reader.read() == {"n": 2}
        assert _open_fds() == before, "an fd nobody took stayed open"

        reader.fds = False
        write_frame_with_fd(a, {"n": 3}, r)
        assert reader.read() == {"n": 3}
        assert reader.take_fd() is None
        assert _open_fds() == before
    finally:
        os.close(r)
        os.close(w)


def test_two_fds_on_one_frame_are_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        before = _open_fds()
        data = encode({"n": 1})
        socket.send_fds(a, [data], [r, w])
        with pytest.raises(FrameError, match="more than one fd"):
            FrameReader(b, fds=True).read()
        assert _open_fds() == before, "the refused fds stayed open"
    finally:
        os.close(r)
        os.close(w)
