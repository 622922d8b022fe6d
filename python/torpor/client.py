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
    headers: dict[str, str] | None = None,
) -> Response:
    """One request to the daemon at `socket_path`. `body`: bytes are sent as they are, anything
    else as JSON; `None` sends none; `headers`: more request headers (e.g. Idempotency-Key). Raises `OSError` (no daemon there, a timeout) and
    `http.client.HTTPException` (a broken answer)."""
    conn = UnixHTTPConnection(socket_path, timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        sent.update(headers or {})
        try:
            conn.request(method, path, body=data, headers=sent)
        except (BrokenPipeError, ConnectionResetError):
            # http.client writes the head and the body apart; the daemon may answer (an error:
            # no such route or function) from the head alone and close before the body lands.
            # Its answer is still there to read; if there is none, getresponse says so.
            pass
        r = conn.getresponse()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    finally:
        conn.close()


class ApiError(Exception):
    """An answer other than 200: its status and the daemon's one error line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Pulled:
    """`POST /v1/functions/{name}/pull`'s answer: what the pull moved (0 bytes when the node
    knew the function already)."""

    function: str
    pulled_bytes: int
    pulled_chunks: int
    seconds: float
    # The snapshot's page profile (its hot set) that came with it; 0: none (or nothing pulled).
    profile_bytes: int = 0
    # Where the pull's time went, and what it left for after its answer (`held_chunks`):
    # docs/objstore.md; None when nothing was pulled.
    phases: dict[str, float] | None = None


@dataclass(frozen=True)
class Placement:
    """`GET /v1/functions/{name}/placement`'s answer: the node's local facts for routing
    (docs/objstore.md, "Placement")."""

    function: str
    known: bool
    instances: int
    warm_idle: int
    # Restores and boots in flight: their processes exist before they are listed as instances.
    starting: int
    queue_depth: int
    # scaling.max_instances (None: the node does not know the function).
    max_instances: int | None
    staged: bool
    local_snapshot: bool
    in_bucket: bool | None
    gpu_free_bytes: int | None


class Client:
    """Typed calls of the daemon at `socket_path` (its Unix socket). Each raises `ApiError` on
    an answer other than 200, `OSError` when no daemon answers."""

    def __init__(self, socket_path: str | os.PathLike[str], timeout: float = 300.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def _ok(self, method: str, path: str) -> dict[str, Any]:
        r = request(self.socket_path, method, path, None, self.timeout)
        try:
            doc = r.json()
        except ValueError:
            doc = {"error": r.body.decode(errors="replace")}
        if r.status != 200:
            raise ApiError(r.status, str(doc.get("error", doc)) if isinstance(doc, dict) else str(doc))
        if not isinstance(doc, dict):
            raise ApiError(r.status, f"expected a JSON object, got {doc!r}")
        return doc

    def pull(self, name: str) -> Pulled:
        """Pulls function `name` from the object store into this node (only the chunks it
        lacks) and registers it; idempotent. `ApiError` 404: not in the bucket."""
        d = self._ok("POST", f"/v1/functions/{name}/pull")
        return Pulled(
            str(d["function"]),
            int(d["pulled_bytes"]),
            int(d["pulled_chunks"]),
            float(d["seconds"]),
            int(d.get("profile_bytes", 0)),
            {str(k): float(v) for k, v in d["phases"].items()} if isinstance(d.get("phases"), dict) else None,
        )

    def placement(self, name: str) -> Placement:
        """This node's facts for function `name`: known, instances, idle ones, starting ones, queue, staged,
        local snapshot, in the bucket, free GPU memory."""
        d = self._ok("GET", f"/v1/functions/{name}/placement")
        in_bucket = d["in_bucket"]
        gpu_free = d["gpu_free_bytes"]
        return Placement(
            function=str(d["function"]),
            known=bool(d["known"]),
            instances=int(d["instances"]),
            warm_idle=int(d["warm_idle"]),
            starting=int(d["starting"]),
            queue_depth=int(d["queue_depth"]),
            max_instances=None if d["max_instances"] is None else int(d["max_instances"]),
            staged=bool(d["staged"]),
            local_snapshot=bool(d["local_snapshot"]),
            in_bucket=None if in_bucket is None else bool(in_bucket),
            gpu_free_bytes=None if gpu_free is None else int(gpu_free),
        )

    def push(self, name: str) -> dict[str, Any]:
        """Pushes function `name`'s current snapshot now (a deploy pushes by itself)."""
        return self._ok("POST", f"/v1/functions/{name}/push")
