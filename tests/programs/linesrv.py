"""Line protocol shared by the test programs and their clients.

One request per connection: the client connects, sends one line ("word word ...\n", Unix sockets may
carry file descriptors with it), the server answers one line and closes the connection. Closing after
every answer matters for snapshots: when `torpor snapshot` starts, the program holds no connection to
a process outside its tree, which CRIU could not dump.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

MAX_LINE = 64 * 1024
MAX_FDS = 8


@dataclass(frozen=True)
class Endpoint:
    """Where a program listens: a path or abstract Unix socket, and optionally TCP 127.0.0.1:port."""

    unix: str | None = None
    abstract: str | None = None
    port: int | None = None

    def unix_address(self) -> str | None:
        if self.unix is not None:
            return self.unix
        if self.abstract is not None:
            return "\0" + self.abstract
        return None


class Exit(Exception):
    """Raised by a handler: answer `reply`, then exit the program with `code`."""

    def __init__(self, reply: str, code: int) -> None:
        super().__init__(reply)
        self.reply = reply
        self.code = code


@dataclass
class Request:
    words: list[str]
    fds: list[int] = field(default_factory=list)


Handler = Callable[[Request], str]


def listen(endpoint: Endpoint) -> list[socket.socket]:
    socks: list[socket.socket] = []
    address = endpoint.unix_address()
    if address is None:
        raise ValueError("a Unix socket (path or abstract) is required")
    if endpoint.unix is not None and os.path.exists(endpoint.unix):
        os.unlink(endpoint.unix)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(address)
    unix.listen(16)
    socks.append(unix)
    if endpoint.port is not None:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", endpoint.port))
        tcp.listen(16)
        socks.append(tcp)
    return socks


def write_ready(path: str) -> None:
    """Atomically create the ready file (contains the program's PID as it sees it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.rename(tmp, path)


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    fds: list[int] = []
    while b"\n" not in data and len(data) < MAX_LINE:
        if conn.family == socket.AF_UNIX:
            chunk, new_fds, _flags, _addr = socket.recv_fds(conn, 4096, MAX_FDS)
            fds.extend(new_fds)
        else:
            chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    line = data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    if not line:
        for fd in fds:
            os.close(fd)
        return None
    return Request(words=line.split(), fds=fds)


def serve(socks: Sequence[socket.socket], handler: Handler, ready: str | None) -> NoReturn:
    """Answer requests forever (until a handler raises Exit)."""
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    if ready is not None:
        write_ready(ready)
    while True:
        for key, _events in sel.select():
            listener = key.fileobj
            assert isinstance(listener, socket.socket)
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            exit_code: int | None = None
            with conn:
                conn.settimeout(5.0)
                try:
                    request = _read_request(conn)
                    if request is None:
                        continue
                    try:
                        reply = handler(request)
                    except Exit as e:
                        reply, exit_code = e.reply, e.code
                    except Exception as e:  # a bad request must not take the program down
                        reply = f"error {type(e).__name__}: {e}"
                    conn.sendall(reply.replace("\n", " ").encode() + b"\n")
                except (OSError, TimeoutError):
                    pass
            if exit_code is not None:
                os._exit(exit_code)


def request(
    endpoint: Endpoint,
    words: Sequence[str],
    *,
    timeout: float = 10.0,
    wait: float = 0.0,
    fds: Sequence[int] = (),
    tcp: bool = False,
) -> str:
    """Send one request and return the answer line.

    `wait`: keep retrying a refused or missing socket for this many seconds (a program that is
    still starting or being restored). `tcp`: use the TCP port instead of the Unix socket.
    """
    deadline = time.monotonic() + wait
    line = (" ".join(words) + "\n").encode()
    while True:
        try:
            if tcp:
                if endpoint.port is None:
                    raise ValueError("endpoint has no TCP port")
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                target: object = ("127.0.0.1", endpoint.port)
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                target = endpoint.unix_address()
            with s:
                s.settimeout(timeout)
                s.connect(target)  # type: ignore[arg-type]
                if fds:
                    socket.send_fds(s, [line], list(fds))
                else:
                    s.sendall(line)
                data = b""
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            if not data.endswith(b"\n"):
                raise ConnectionError(f"connection closed without a full answer (got {data!r})")
            return data.decode().rstrip("\n")
        except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, ConnectionError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
