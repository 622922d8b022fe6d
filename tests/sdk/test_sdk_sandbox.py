"""A sandbox in the worker harness (docs/sandboxes.md), the test as torpord: several `load`
frames of one tenant into one worker, `invoke` routed by `function` and run on threads (a
request does not wait for a slower one), a function not loaded answered NotLoaded, another
tenant's load refused (exit 3), and the store frames a request thread sends for
torpor.put(shared=True) / torpor.get with a memfd, answered by the test."""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sdkd import ROOT, Conn, Daemon, Spawned, Spawner
from torpor.spec import parse_dir

SANDBOXED = ROOT / "tests" / "daemon" / "functions" / "sandboxed"
EXIT_PROTOCOL = 3


def function(tmp: Path, name: str, tenant: str = "t") -> Path:
    d = tmp / name
    shutil.copytree(SANDBOXED, d, ignore=shutil.ignore_patterns("__pycache__"))
    (d / "torpor.toml").write_text(
        f'name = "{name}"\ntenant = "{tenant}"\nworkflow = "w"\nentry = "handler:Sandboxed"\n'
        "[scaling]\nsandbox = true\nrequests_per_instance = 4\n"
    )
    return d


def sandbox(spawn: Spawner, daemon: Daemon, tmp: Path, *names: str) -> tuple[Spawned, Conn]:
    w = spawn("--role", "function")
    c = daemon.accept()
    c.expect("hello")
    for name in names:
        ready = c.load(function(tmp, name))
        assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    return w, c


def invoke(c: Conn, rid: int, fn: str, request: dict[str, Any]) -> None:
    c.send({"type": "invoke", "id": rid, "request": request, "timeout_s": 10, "function": fn})


def results(c: Conn, n: int) -> list[dict[str, Any]]:
    """The next `n` results, in the order they arrive (started frames skipped)."""
    out = []
    while len(out) < n:
        doc = c.recv()
        if doc["type"] == "result":
            out.append(doc)
        else:
            assert doc["type"] == "started", doc
    return out


def test_a_sandbox_serves_its_functions_on_threads(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    w, c = sandbox(spawn, daemon, tmp_path, "fa", "fb")
    invoke(c, 1, "fa", {"op": "sleep", "s": 1.0})
    invoke(c, 2, "fb", {})
    first, second = results(c, 2)
    # fb answered while fa still slept: each request has a thread of its own.
    assert (first["id"], second["id"]) == (2, 1), (first, second)
    assert first["value"]["fn"] == "fb" and second["value"]["fn"] == "fa"
    assert first["value"]["process"] == second["value"]["process"]
    assert first["value"]["thread"] != second["value"]["thread"]
    invoke(c, 3, "nope", {})
    (r,) = results(c, 1)
    assert r["ok"] is False and r["error"]["type"] == "NotLoaded", r
    assert "fa, fb" in r["error"]["message"] and "deploy nope again" in r["error"]["message"], r
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_another_tenants_load_is_refused(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    w, c = sandbox(spawn, daemon, tmp_path, "fa")
    spec = parse_dir(function(tmp_path, "fx", tenant="other"))
    c.send({"type": "load", "spec": spec.to_json(), "dir": str(spec.dir), "data": {}})
    assert w.wait() == EXIT_PROTOCOL
    assert "functions of different tenants never share a sandbox" in w.stderr()


def wait_for(w: Spawned, line: str, timeout: float = 10.0) -> None:
    """Until the worker printed `line` (its stdout and stderr go to one file)."""
    deadline = time.monotonic() + timeout
    while line not in w.stderr().splitlines():
        assert time.monotonic() < deadline, f"no {line!r} within {timeout} s\n{w.stderr()}"
        time.sleep(0.02)


def test_an_invoke_of_a_lost_connection_never_starts_after_the_reattach(
    spawn: Spawner, daemon: Daemon, tmp_path: Path
) -> None:
    """docs/torpord.md, "Retries": keyed request 3 came on the connection that is then lost, and
    waits for its lane (behind 2, which gave the lane back and still runs: the handler's `hold`
    op) until the worker has reattached. Its key is not in the reattach hello, so it must not
    start: a client's retry would run it again, and its `started` and `result` would carry the
    lost daemon's id 3 to the new daemon, where that id may be another request's."""
    w, c = sandbox(spawn, daemon, tmp_path, "fa")
    c.send({"type": "attached", "reattach_s": 10})
    invoke(c, 1, "fa", {})
    (first,) = results(c, 1)
    release = tmp_path / "release"
    invoke(c, 2, "fa", {"op": "hold", "until": str(release)})
    assert c.expect("started")["id"] == 2
    wait_for(w, "hold-began")
    c.send(
        {"type": "invoke", "id": 3, "request": {}, "timeout_s": 10, "function": "fa", "key": "b", "fingerprint": "fb"}
    )
    c.close()
    again = daemon.accept()
    hello = again.expect("hello")
    assert hello["reattach"] is True and "keys" not in hello, hello
    again.send({"type": "attached", "reattach_s": 10})
    release.touch()
    wait_for(w, "hold-ended")
    # 3 would start on 2's lane right after 2's handler returned (a new request now takes
    # another lane, so it cannot serve as a mark behind 3).
    time.sleep(0.5)
    # 2's result dies with its connection; 3 never runs. Only 4 is answered here.
    invoke(again, 4, "fa", {})
    seen: list[tuple[str, Any]] = []
    last: dict[str, Any] = {}
    while not seen or seen[-1] != ("result", 4):
        doc = again.recv()
        if doc["type"] in ("started", "result", "settled"):
            seen.append((doc["type"], doc.get("id")))
            if doc["type"] == "result" and doc["id"] == 4:
                last = doc
    assert seen == [("started", 4), ("result", 4)], seen
    assert last["value"]["calls"] == first["value"]["calls"] + 2, (first, last)
    again.send({"type": "shutdown"})
    assert w.wait() == 0


def test_the_store_frames_of_a_request_thread(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    w, c = sandbox(spawn, daemon, tmp_path, "fa", "fb")
    invoke(c, 1, "fa", {"op": "share", "key": "k", "n": 8})
    assert c.expect("started")["id"] == 1
    put = c.expect("store_put")
    assert put["key"] == "k" and put["meta"] == {"kind": "bytes"} and put["ttl_s"] == 600.0, put
    fd_frame, fd = c.recv_with_fd()
    assert fd_frame == {"type": "store_fd", "id": put["id"], "fd": True} and fd is not None
    # Sealed against writes and resizing, holding the bytes.
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    assert os.pread(fd, 100, 0) == bytes(range(8))
    c.send({"type": "store_stored", "id": put["id"], "ok": True})
    (r,) = results(c, 1)
    assert r["ok"] is True, r
    # A get the sandbox cannot answer itself goes to the daemon, which hands the fd back.
    invoke(c, 2, "fb", {"op": "get_shared", "key": "k"})
    assert c.expect("started")["id"] == 2
    get = c.expect("store_get")
    assert get["key"] == "k" and get["keep"] is False, get
    c.send_with_fd(
        {"type": "store_value", "id": get["id"], "found": True, "meta": {"kind": "bytes"}, "bytes": 8, "fd": True}, fd
    )
    os.close(fd)
    (r,) = results(c, 1)
    assert r["ok"] is True and r["value"]["value"] == list(range(8)) and r["value"]["writeable"] is False, r
    # Not found there either: KeyError in the function.
    invoke(c, 3, "fb", {"op": "get_shared", "key": "gone"})
    c.expect("started")
    get = c.expect("store_get")
    c.send({"type": "store_value", "id": get["id"], "found": False})
    (r,) = results(c, 1)
    assert r["ok"] is False and r["error"]["type"] == "KeyError", r
    # A refused put is the function's RuntimeError, with the daemon's reason.
    invoke(c, 4, "fa", {"op": "share", "key": "k2"})
    c.expect("started")
    put = c.expect("store_put")
    _, fd2 = c.recv_with_fd()
    assert fd2 is not None
    os.close(fd2)
    c.send({"type": "store_stored", "id": put["id"], "ok": False, "error": "the tenant's store is full"})
    (r,) = results(c, 1)
    assert r["ok"] is False and r["error"]["type"] == "RuntimeError" and "is full" in r["error"]["message"], r
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_each_function_s_memory_is_measured_reported_and_given_back(
    spawn: Spawner, daemon: Daemon, tmp_path: Path
) -> None:
    """torpor.mempool in the harness: `ready` carries the function's model (its warm-up's peak),
    a request's `result` its pool after it, and an idle function's pool is given back and said
    in a `memory` frame (every frame checked against the protocol's schema by sdkd)."""
    w = spawn("--role", "function")
    c = daemon.accept()
    c.expect("hello")
    d = function(tmp_path, "fm")
    with (d / "torpor.toml").open("a") as f:
        f.write('[warmup]\nrequest = { op = "scratch", mib = 3 }\n[keepalive]\nmemory_release_s = 0.3\n')
    ready = c.load(d)
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    assert ready["memory"] == {"backend": "host", "resident": 0, "request_peak": 3 << 20}, ready
    invoke(c, 1, "fm", {"op": "scratch", "mib": 5})
    (r,) = results(c, 1)
    assert r["ok"] is True, r
    # The array died with the request; its block stays cached in the function's pool...
    assert r["memory"] == {"function": "fm", "resident": 0, "pool": 5 << 20, "peak": 5 << 20}, r
    # ...until the function has been idle for memory_release_s.
    assert c.expect("memory") == {"type": "memory", "function": "fm", "resident": 0, "pool": 0}
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_release_memory_gives_idle_pools_back_at_once(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    """torpord's `release_memory` (a request waits for room): every idle function's pool goes
    back now, each answered by a `memory` frame; a busy one keeps its pool."""
    w, c = sandbox(spawn, daemon, tmp_path, "ra", "rb")
    invoke(c, 1, "ra", {"op": "scratch", "mib": 2})
    (r,) = results(c, 1)
    assert r["memory"]["pool"] == 2 << 20, r
    invoke(c, 2, "rb", {"op": "scratch", "mib": 1, "s": 1.5})
    assert c.expect("started")["id"] == 2
    c.send({"type": "release_memory"})
    # ra's pool (idle) comes back at once, long before its memory_release_s (2 s by default)...
    assert c.expect("memory") == {"type": "memory", "function": "ra", "resident": 0, "pool": 0}
    # ...rb's request is still running and keeps its own.
    (r,) = results(c, 1)
    assert r["id"] == 2 and r["memory"]["pool"] == 1 << 20, r
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_release_gpu_gives_idle_pools_back_and_holds_every_release_until_served_again(
    spawn: Spawner, daemon: Daemon, tmp_path: Path
) -> None:
    """torpord's `release_gpu` (the driver checkpoints the GPU in place next): idle pools go back
    and `gpu_quiet` answers. A pool that gains memory meanwhile (a request still running here;
    torpord itself releases only an idle worker) keeps it past its memory_release_s, since a CUDA
    call into a checkpointed context crashes the process; once torpord serves the worker again
    the held release is timed afresh."""
    w = spawn("--role", "function")
    c = daemon.accept()
    c.expect("hello")
    for name in ("ga", "gb"):
        d = function(tmp_path, name)
        with (d / "torpor.toml").open("a") as f:
            f.write("[keepalive]\nmemory_release_s = 0.3\n")
        ready = c.load(d)
        assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    # ga's idle release would come after 0.3 s: release_gpu comes first.
    invoke(c, 1, "ga", {"op": "scratch", "mib": 2})
    (r,) = results(c, 1)
    assert r["memory"]["pool"] == 2 << 20, r
    invoke(c, 2, "gb", {"op": "scratch", "mib": 1, "s": 1.0})
    assert c.expect("started")["id"] == 2
    c.send({"type": "release_gpu"})
    assert c.expect("memory") == {"type": "memory", "function": "ga", "resident": 0, "pool": 0}
    assert c.expect("gpu_quiet") == {"type": "gpu_quiet", "bytes": 2 << 20}
    (r,) = results(c, 1)
    assert r["id"] == 2 and r["memory"]["pool"] == 1 << 20, r
    # gb is idle past its 0.3 s: held, no frame...
    try:
        doc = c.recv(timeout=1.2)
    except TimeoutError:
        doc = None
    assert doc is None, f"a frame while the GPU is released: {doc}"
    # ...until torpord serves the worker again.
    invoke(c, 3, "ga", {"op": "scratch", "mib": 1})
    (r,) = results(c, 1)
    assert r["ok"] is True, r
    released = {c.expect("memory", timeout=5)["function"] for _ in range(2)}
    assert released == {"ga", "gb"}, released
    c.send({"type": "shutdown"})
    assert w.wait() == 0
