"""Helpers for the SDK tests: the test plays torpord.

`Daemon` listens on a real Unix socket; workers are real `python3 -m torpor.worker` processes
that connect to it. The frames the test sends and reads go through a codec written here, not
torpor.frames, so a bug in the codec under test cannot cancel itself out. Every frame a worker
sends is checked against the protocol's schema, python/torpor/protocol.schema.json, which
torpord's Rust types generate (crates/torpord/src/protocol.rs): a worker frame the daemon's
types do not describe fails the test that received it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

ROOT = Path(__file__).resolve().parents[2]
PYTHON_DIR = ROOT / "python"
FUNCTIONS = Path(__file__).resolve().parent / "functions"
TINYMLP = FUNCTIONS / "tinymlp"
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

from torpor.spec import parse_dir  # noqa: E402

SCHEMA = json.loads((PYTHON_DIR / "torpor" / "protocol.schema.json").read_text())
FROM_WORKER = jsonschema.Draft202012Validator(SCHEMA["from_worker"])
TO_WORKER = jsonschema.Draft202012Validator(SCHEMA["to_worker"])


def _by_type(direction: str) -> dict[str, jsonschema.Draft202012Validator]:
    """One validator per frame type (checking a frame against its own variant only is fast
    enough for the timed round-trip test)."""
    schema = SCHEMA[direction]
    return {
        v["properties"]["type"]["const"]: jsonschema.Draft202012Validator({**v, "$defs": schema.get("$defs", {})})
        for v in schema["oneOf"]
    }


_FROM_WORKER_BY_TYPE = _by_type("from_worker")
_TO_WORKER_BY_TYPE = _by_type("to_worker")


def is_to_worker(doc: object) -> bool:
    """Whether `doc` is a frame torpord's types describe for sending to a worker."""
    v = _TO_WORKER_BY_TYPE.get(doc.get("type")) if isinstance(doc, dict) else None  # type: ignore[arg-type]
    return v is not None and v.is_valid(doc)


def check_from_worker(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` if it is a frame torpord's types describe; else an AssertionError naming why."""
    v = _FROM_WORKER_BY_TYPE.get(doc.get("type"))  # type: ignore[arg-type]
    if v is not None and v.is_valid(doc):
        return doc
    errors = sorted(FROM_WORKER.iter_errors(doc), key=lambda e: list(e.absolute_path))
    raise AssertionError(
        f"the worker sent a frame protocol.schema.json does not describe: {doc}: "
        + "; ".join(e.message for e in errors[:3])
        + " (change crates/torpord/src/protocol.rs and regenerate the schema, or the worker)"
    )

_LEN = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")


def hook_lib() -> Path:
    """The device-memory hook library: $TORPOR_HOOK_LIB, else the debug build's."""
    path = Path(os.environ.get("TORPOR_HOOK_LIB") or ROOT / "target/debug/libtorpor_hook.so")
    if not path.is_file():
        raise AssertionError(
            f"{path} not found: build it (make build, or cargo build -p torpor-hook) "
            "or set TORPOR_HOOK_LIB to it"
        )
    return path


def worker_env(sock_path: Path | str, **extra: str) -> dict[str, str]:
    """The environment torpord gives a worker (plus PYTHONPATH so the package is importable)."""
    old = os.environ.get("PYTHONPATH")
    pythonpath = f"{PYTHON_DIR}{os.pathsep}{old}" if old else str(PYTHON_DIR)
    return {**os.environ, "PYTHONPATH": pythonpath, "TORPOR_WORKER_SOCKET": str(sock_path), **extra}


class Conn:
    """One accepted worker connection, seen from the daemon's side."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # The worker's frames are checked against the schema while the test has sent only
        # frames the schema describes (a test may send others on purpose, e.g. string ids).
        self.on_protocol = True
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        self.peer_pid = pid

    def send(self, obj: dict[str, Any]) -> None:
        self.on_protocol = self.on_protocol and is_to_worker(obj)
        payload = json.dumps(obj).encode()
        self.sock.sendall(_LEN.pack(len(payload)) + payload)

    def send_raw(self, data: bytes) -> None:
        self.on_protocol = False
        self.sock.sendall(data)

    def _exact(self, n: int, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError(f"worker {self.peer_pid} closed the connection after {len(buf)} of {n} bytes")
            buf += chunk
        return buf

    def recv(self, timeout: float = 10.0) -> dict[str, Any]:
        (n,) = _LEN.unpack(self._exact(4, timeout))
        doc = json.loads(self._exact(n, timeout).decode("utf-8"))
        assert isinstance(doc, dict), doc
        return check_from_worker(doc) if self.on_protocol else doc

    def send_with_fd(self, obj: dict[str, Any], fd: int) -> None:
        """A frame with `fd` attached to its first byte (socket.send_fds)."""
        self.on_protocol = self.on_protocol and is_to_worker(obj)
        payload = json.dumps(obj).encode()
        data = _LEN.pack(len(payload)) + payload
        sent = socket.send_fds(self.sock, [data], [fd])
        if sent < len(data):  # a send of nothing fails (EPIPE) once a worker that read it all has exited
            self.sock.sendall(data[sent:])

    def recv_with_fd(self, timeout: float = 10.0) -> tuple[dict[str, Any], int | None]:
        """A frame and the fd that came with its first byte (None if none)."""
        self.sock.settimeout(timeout)
        head, fds, _flags, _addr = socket.recv_fds(self.sock, 4, 2)
        assert len(fds) <= 1, f"a frame came with {len(fds)} fds"
        if not head:
            raise EOFError(f"worker {self.peer_pid} closed the connection")
        head += self._exact(4 - len(head), timeout)
        (n,) = _LEN.unpack(head)
        doc = json.loads(self._exact(n, timeout).decode("utf-8"))
        assert isinstance(doc, dict), doc
        return (check_from_worker(doc) if self.on_protocol else doc), (fds[0] if fds else None)

    def expect(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        doc = self.recv(timeout)
        assert doc.get("type") == kind, f"expected a {kind} frame, got {doc}"
        return doc

    def at_eof(self, timeout: float = 10.0) -> bool:
        """Whether the worker closed its end (waits up to timeout for EOF)."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False

    def invoke(self, rid: object, request: object, timeout: float = 10.0) -> dict[str, Any]:
        self.send({"type": "invoke", "id": rid, "request": request, "timeout_s": 5})
        started = self.expect("started", timeout)
        assert started["id"] == rid, started
        doc = self.expect("result", timeout)
        assert doc["id"] == rid, doc
        return doc

    def load(self, fdir: Path = TINYMLP) -> dict[str, Any]:
        spec = parse_dir(fdir)
        self.send(
            {
                "type": "load",
                "spec": spec.to_json(),
                "dir": str(spec.dir),
                "data": {d.name: str(d.abs_path) for d in spec.data},
            }
        )
        return self.expect("ready", timeout=30)

    def close(self) -> None:
        self.sock.close()


class Daemon:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.conns: list[Conn] = []

    def accept(self, timeout: float = 15.0) -> Conn:
        self.sock.settimeout(timeout)
        s, _ = self.sock.accept()
        c = Conn(s)
        self.conns.append(c)
        return c

    def no_connection(self, within: float) -> bool:
        self.sock.settimeout(within)
        try:
            s, _ = self.sock.accept()
        except TimeoutError:
            return True
        s.close()
        return False

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


class Spawned:
    """A worker started directly as a child of the test (no namespaces)."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout: float = 15.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.pid} did not exit within {timeout} s\n{self.stderr()}"
            ) from None


class Spawner:
    def __init__(self, tmp: Path, daemon: Daemon) -> None:
        self.tmp = tmp
        self.daemon = daemon
        self.procs: list[Spawned] = []

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> Spawned:
        n = len(self.procs)
        err = self.tmp / f"worker-{n}.err"
        with open(err, "wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torpor.worker", *args],
                stdin=subprocess.DEVNULL,
                stdout=e,
                stderr=e,
                env=env if env is not None else worker_env(self.daemon.path),
            )
        w = Spawned(proc, err)
        self.procs.append(w)
        return w

    def cleanup(self) -> None:
        for w in self.procs:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data[data.rindex(")") + 2 :].split()[0]


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def run_ok(code: str) -> None:
    """Runs `code` in a fresh interpreter (CUDA is not initialised in pytest's) with the torpor
    package importable; it must print "ok"."""
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    print(r.stdout.strip())
