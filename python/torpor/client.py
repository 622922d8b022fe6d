"""A client of torpord's HTTP API over its Unix socket, for scripts, benchmarks and tests
(`scripts/demo.py`, `bench/`, `tests/daemon/`); the `torpor` CLI is the user's client.

The standard library's `http.client` speaks HTTP/1.1 over any stream socket once `connect` hands
it one, so a Unix socket needs only that override. The SDK depends on the standard library alone
(python/pyproject.toml), so it carries no HTTP library for this (requests-unixsocket, httpx's
UDS transport would each be a dependency for these few lines). One request per connection.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from dataclasses import dataclass
from typing import Any


class UnixHTTPConnection(http.client.HTTPConnection):
    """`http.client.HTTPConnection` to the Unix socket at `path` (the Host header says `torpord`)."""

    def __init__(self, path: str | os.PathLike[str], timeout: float) -> None:
        super().__init__("torpord", timeout=timeout)
        self.unix_path = os.fspath(path)

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self.unix_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


@dataclass(frozen=True)
class Response:
    """An answer: its status, headers (names in lower case) and whole body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    socket_path: str | os.PathLike[str],
    method: str,
    path: str,
    body: Any = None,
    timeout: float = 60.0,
) -> Response:
    """One request to the daemon at `socket_path`. `body`: bytes are sent as they are, anything
    else as JSON; `None` sends none. Raises `OSError` (no daemon there, a timeout) and
    `http.client.HTTPException` (a broken answer)."""
    conn = UnixHTTPConnection(socket_path, timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()
