"""A function for the sandbox tests (tests/daemon/test_daemon_sandbox.py): every copy of this
directory is deployed under another name, tenant and workflow (the test writes torpor.toml),
all with this one module name `handler`, so a sandbox hosting several must keep them apart.

Its answer says which function answered (`fn`, from torpor.toml's name as the spec gave it),
which process (`process`: a token drawn at the first request a process serves and shared by
every function in it; a restore of the function snapshot draws a new one, a woken hibernated
process keeps its own), which thread, and how many calls this function had in this process.
Ops: sleep {s}, crash (os._exit), break_pool (the harness's next request fails before the
handler, once), put {key} and get {key} through the communication store,
share {key, n | array, nodes?, ttl_s?} (put with shared=True, and nodes and ttl_s when
given) and get_shared {key, keep}; buffer (with a file
`with_buffer` in the directory: whether its torpor.buffer() segment holds its own bytes; a
file `slow_setup` holding seconds makes setup() that much slower, a file `fail_setup` makes it
fail);
scratch {mib, s}: `mib` MiB from the function's memory pool (torpor.scratch), written, held for
`s` seconds (tests/daemon/test_daemon_sandbox_memory.py: a warm-up of it makes the function's
memory model); hold {until, s?}: gives its lane back at once (torpor.lanes.release, as the
harness does just before a result), prints `hold-began`, and returns once the file `until`
exists (at most `s` seconds, default 60), printing `hold-ended`: a request submitted meanwhile
waits on this lane to start (tests/daemon/test_daemon_idempotency.py,
tests/sdk/test_sdk_sandbox.py)."""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import torpor

NAME = Path(__file__).resolve().parent.name
BUFFER_SIZE = 8 * 4096


def pattern() -> bytes:
    """This function's own bytes (its name in them), so two functions' buffers differ."""
    seed = NAME.encode()
    return bytes((seed[i % len(seed)] + i) % 251 for i in range(BUFFER_SIZE))


def process_token() -> str:
    shared = sys.modules.get("_sandbox_test_process")
    if shared is None:
        candidate = types.ModuleType("_sandbox_test_process")
        candidate.token = os.urandom(8).hex()  # type: ignore[attr-defined]
        # Two functions' first requests run at once on their threads: setdefault (one step
        # under the GIL) keeps the first token drawn, where a get-then-set kept two (CI, once).
        shared = sys.modules.setdefault("_sandbox_test_process", candidate)
    return str(shared.token)  # type: ignore[attr-defined]


@torpor.function
class Sandboxed:
    def setup(self) -> None:
        self.calls = 0
        # With a file `slow_setup` beside it: setup() takes that many seconds more (a function
        # that starts faster restored than loaded, tests/daemon/test_daemon_sandbox_pool.py).
        here = Path(__file__).resolve().parent
        if (here / "slow_setup").exists():
            time.sleep(float((here / "slow_setup").read_text()))
        # With a file `fail_setup` beside it: setup() fails (made after a deploy: a start in a
        # ready sandbox fails, a restore does not run setup()).
        if (here / "fail_setup").exists():
            raise RuntimeError("fail_setup exists: this function's setup() fails (a test)")
        # With a file `with_buffer` beside it: its state also in a torpor.buffer() segment
        # (the split path keeps it outside the CRIU image; a restore maps it back).
        self.buf = None
        if (Path(__file__).resolve().parent / "with_buffer").exists():
            self.buf = torpor.buffer(BUFFER_SIZE)
            self.buf[:] = pattern()

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        out: dict[str, Any] = {
            "fn": NAME,
            "process": process_token(),
            "thread": threading.get_ident(),
            "calls": self.calls,
        }
        op = request.get("op")
        if op == "sleep":
            time.sleep(float(request["s"]))
        elif op == "scratch":
            held = torpor.scratch(int(request["mib"]) << 20)
            held[::4096] = 1
            time.sleep(float(request.get("s", 0)))
            out["held"] = int(held.nbytes)
            del held
        elif op == "hold":
            from torpor import lanes

            lanes.release()
            print("hold-began", flush=True)
            until, deadline = Path(str(request["until"])), time.monotonic() + float(request.get("s", 60))
            while not until.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            print("hold-ended", flush=True)
        elif op == "crash":
            os._exit(7)
        elif op == "break_pool":
            # The harness's next request of any function here fails before its handler (once):
            # its memory pool raises, as PyTorch's did for concurrent requests on one pool.
            from torpor import mempool

            real = mempool.FunctionPool.request

            def broken(pool: Any) -> Any:
                mempool.FunctionPool.request = real  # type: ignore[method-assign]
                raise RuntimeError("the request's memory pool broke (test)")

            mempool.FunctionPool.request = broken  # type: ignore[method-assign]
        elif op == "put":
            value = {"by": NAME, "rows": list(range(int(request.get("n", 3))))}
            torpor.put(str(request["key"]), value)
            out["id"] = id(value)
        elif op == "get":
            value = torpor.get(str(request["key"]))
            out["id"] = id(value)
            out["value"] = value
        elif op == "buffer":
            # Whether its segment holds its own bytes, then a count written into it.
            assert self.buf is not None, "deployed without with_buffer"
            out["intact"] = bytes(self.buf[8:]) == pattern()[8:]
            out["count"] = int.from_bytes(self.buf[:8], "little") if self.calls > 1 else 0
            self.buf[:8] = self.calls.to_bytes(8, "little")
        elif op == "share":
            # Through torpord's store, for another sandbox of the tenant: bytes or an array.
            kw: dict[str, Any] = {k: request[k] for k in ("nodes", "ttl_s") if k in request}
            if request.get("array"):
                import numpy as np

                torpor.put(str(request["key"]), np.arange(12, dtype=np.float32).reshape(3, 4), shared=True, **kw)
            else:
                torpor.put(str(request["key"]), bytes(range(int(request.get("n", 16)))), shared=True, **kw)
        elif op == "get_shared":
            value = torpor.get(str(request["key"]), keep=bool(request.get("keep", False)))
            out["type"] = type(value).__name__
            if out["type"] == "ndarray":
                out["value"] = value.tolist()
                out["dtype"] = value.dtype.str
                out["shape"] = list(value.shape)
                out["writeable"] = bool(value.flags.writeable)
            else:
                out["value"] = list(bytes(value))
                out["writeable"] = not value.readonly
        return out
