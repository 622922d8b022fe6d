"""Requests while a restore still maps segments (docs/split.md, "Restore server"): the generic
wait of torpor.readiness, and a real worker whose segments come back after its first request
arrived, played by the test as daemon with real fds and the real hook (host backend)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
from sdkd import Conn, Daemon, Spawned, Spawner, proc_state, wait_for
from test_sdk_hook import (
    BUFFER_SIZE,
    TABLE,
    info,
    pattern,
    segment_memfd,
    sha,
    start_segbuf,
    without_map_s,
)
from torpor.readiness import ModuleWaits, Readiness, SegmentWaitError, deferrable_vas

HOST = (0x10000, 0x1000, "host")
CUDA = (0x20000, 0x2000, "cuda")


def test_covering_finds_the_pending_segments_holding_addresses() -> None:
    r = Readiness([HOST, CUDA])
    assert r.covering([0x10000, 0x10FFF, 0x20001]) == {0x10000, 0x20000}
    # Just past a segment's end, below the first, between them: none.
    assert r.covering([0x11000, 0x0FFFF, 0x1F000, 0x22000]) == set()
    r.mapped(0x10000)
    assert r.covering([0x10000]) == set() and not r.done()
    r.mapped(0x20000)
    assert r.done() and r.pending() == set()


def test_a_wait_returns_when_another_thread_maps_the_segment() -> None:
    r = Readiness([HOST, CUDA])
    # Addresses outside every pending segment need nothing.
    r.wait_for([0x30000], timeout=0)
    returned = threading.Event()

    def waiter() -> None:
        r.wait_for([0x20010], timeout=30)
        returned.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not returned.wait(0.2), "wait_for returned before its segment was mapped"
    r.mapped(0x20000)
    t.join(30)
    assert returned.is_set(), "wait_for did not return once its segment was mapped"
    # The host segment is still pending.
    assert r.pending() == {0x10000}


def test_a_wait_times_out_naming_the_segment() -> None:
    r = Readiness([HOST, CUDA])
    with pytest.raises(SegmentWaitError) as e:
        r.wait_for([0x20010], timeout=0.05)
    assert str(e.value) == (
        "the segment at 0x20000 (8192 bytes, cuda) was not mapped within 0.05 s of the request; "
        "the restore server did not deliver it: see torpord's log"
    )
    with pytest.raises(SegmentWaitError, match=r"at 0x10000 \(4096 bytes, host\).*\(1 more still unmapped\)"):
        r.wait_all(timeout=0)


def test_a_refused_map_fails_its_waiters_at_once() -> None:
    r = Readiness([HOST, CUDA])
    r.refused(0x20000, "not a memfd")
    with pytest.raises(
        SegmentWaitError, match=r"segment at 0x20000 \(8192 bytes, cuda\) could not be mapped: not a memfd"
    ):
        r.wait_for([0x20000], timeout=30)
    # Other segments are not affected.
    r.mapped(0x10000)
    r.wait_for([0x10000], timeout=0)


def test_module_waits_install_nothing_without_torch() -> None:
    if "torch" in sys.modules:
        pytest.skip("torch is imported in this process")
    assert not ModuleWaits(Readiness([CUDA])).installed()


# -- the PyTorch side, against a stand-in for torch (the real one runs in test_sdk_gpu.py) -----


class FakeTensor:
    def __init__(self, ptr: int, cuda: bool = True) -> None:
        self.ptr, self.is_cuda = ptr, cuda

    def data_ptr(self) -> int:
        return self.ptr

    def untyped_storage(self) -> FakeTensor:
        return self

    def nbytes(self) -> int:
        return 1


class FakeModule:
    def __init__(self, *params: FakeTensor) -> None:
        self.params = list(params)

    def parameters(self, recurse: bool = True) -> list[FakeTensor]:
        return self.params

    def buffers(self, recurse: bool = True) -> list[FakeTensor]:
        return []


def fake_torch(snapshot: list[dict[str, Any]]) -> tuple[types.SimpleNamespace, list[Any]]:
    """What deferrable_vas and ModuleWaits use of torch; the second value lists the global
    forward pre-hooks registered."""
    hooks: list[Any] = []

    def register(hook: Any) -> Any:
        hooks.append(hook)
        return types.SimpleNamespace(remove=lambda: hooks.remove(hook))

    cuda = types.SimpleNamespace(is_initialized=lambda: True, memory_snapshot=lambda: snapshot)
    nn = types.SimpleNamespace(
        Module=FakeModule,
        modules=types.SimpleNamespace(
            module=types.SimpleNamespace(register_module_forward_pre_hook=register)
        ),
    )
    return types.SimpleNamespace(cuda=cuda, nn=nn, Tensor=FakeTensor), hooks


def test_deferrable_segments_hold_only_module_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    w1, w2, held = FakeTensor(0x100000), FakeTensor(0x300000), FakeTensor(0x500000)
    snapshot = [
        # Only a module's weight: deferrable.
        {
            "address": 0x100000,
            "blocks": [{"address": 0x100000, "size": 0x200000, "state": "active_allocated"}],
        },
        # A weight and a free block an activation could get: not deferrable.
        {
            "address": 0x300000,
            "blocks": [
                {"address": 0x300000, "size": 0x100000, "state": "active_allocated"},
                {"address": 0x400000, "size": 0x100000, "state": "inactive"},
            ],
        },
        # A tensor the function holds outside any module: not deferrable.
        {"address": 0x500000, "blocks": [{"size": 0x200000, "state": "active_allocated"}]},
    ]
    torch, _ = fake_torch(snapshot)
    monkeypatch.setitem(sys.modules, "torch", torch)
    function = types.SimpleNamespace(net=FakeModule(w1, w2), tensor=held)
    assert deferrable_vas(function) == {0x100000}
    assert deferrable_vas(types.SimpleNamespace(tensor=held)) == set()


def test_module_waits_wait_for_the_modules_own_segments_and_then_go(monkeypatch: pytest.MonkeyPatch) -> None:
    torch, hooks = fake_torch([])
    monkeypatch.setitem(sys.modules, "torch", torch)
    r = Readiness([(0x100000, 0x200000, "cuda"), (0x300000, 0x200000, "cuda")])
    waits = ModuleWaits(r, timeout=0.05)
    assert waits.installed() and len(hooks) == 1
    (pre_hook,) = hooks
    # A module without CUDA weights, or with weights outside every pending segment, runs.
    pre_hook(FakeModule(FakeTensor(0x100000, cuda=False), FakeTensor(0x900000)), ())
    r.mapped(0x100000)
    pre_hook(FakeModule(FakeTensor(0x100010)), ())
    with pytest.raises(SegmentWaitError, match=r"segment at 0x300000 \(2097152 bytes, cuda\) was not mapped"):
        pre_hook(FakeModule(FakeTensor(0x100010), FakeTensor(0x3FFFFF)), ())
    r.mapped(0x300000)
    # Every segment mapped: the next module's call removes the hook.
    pre_hook(FakeModule(FakeTensor(0x300000)), ())
    assert hooks == [] and not waits.installed()


# -- a real worker ------------------------------------------------------------------------------


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def restored_segbuf(
    spawn: Spawner, daemon: Daemon
) -> tuple[Spawned, Conn, list[dict[str, Any]], dict[str, Any]]:
    """A segbuf worker through a split quiesce, its segments released, resumed: connected again
    with every segment unmapped. Returns the worker, the new connection, the segments (buf,
    table, notes) and the info answer from before."""
    w, c = start_segbuf(spawn, daemon)
    before = info(c, 1)
    c.send({"type": "quiesce", "split": True})
    quiet, _ = c.recv_with_fd()
    for _ in quiet["segments"]:
        _, fd = c.recv_with_fd()
        assert fd is not None
        os.close(fd)
    c.send({"type": "release"})
    c.expect("released")
    assert c.at_eof()
    wait_for(lambda: proc_state(w.pid) == "S", 5, "the worker to block in sigwait")
    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.expect("hello")["resumed"] is True
    return w, c2, quiet["segments"], before


def send_map(c: Conn, s: dict[str, Any], fd: int, size: int | None = None) -> None:
    frame = {"type": "map", "va": s["va"], "size": size or s["size"], "readonly": s["readonly"], "fd": True}
    c.send_with_fd(frame, fd)


def frames_until_result(c: Conn, rid: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Reads frames until the result of `rid`: it, and every frame before it."""
    seen: list[dict[str, Any]] = []
    while True:
        doc = c.recv(timeout=15)
        if doc["type"] == "result" and doc["id"] == rid:
            return doc, seen
        seen.append(doc)


def test_a_request_sent_before_the_last_map_runs_once_its_segments_are_mapped(
    spawn: Spawner, daemon: Daemon
) -> None:
    w, c, (buf, table, notes), before = restored_segbuf(spawn, daemon)
    fds = [
        segment_memfd(TABLE, table["size"], sealed=True),
        segment_memfd(pattern(BUFFER_SIZE, seed=3), buf["size"], sealed=False),
        segment_memfd(b"restored notes\n", notes["size"], sealed=False),
    ]
    try:
        send_map(c, table, fds[0])
        # The request reads every segment: before this change it would have run at once and
        # faulted on the unmapped buffer. It waits; the maps that follow are applied meanwhile.
        c.send({"type": "invoke", "id": 2, "request": {"op": "info"}, "timeout_s": 5})
        wait_for(lambda: threads(w.pid) == 2, 5, "the worker's map reader")
        send_map(c, buf, fds[1])
        send_map(c, notes, fds[2])
        result, seen = frames_until_result(c, 2)
        assert result["ok"] is True, result
        mapped = [without_map_s(d) for d in seen if d["type"] == "mapped"]
        assert mapped == [{"type": "mapped", "va": s["va"], "ok": True} for s in (table, buf, notes)], seen
        assert [d["type"] for d in seen if d["type"] != "mapped"] == ["started"], seen
        value = result["value"]
        assert value["buf_addr"] == before["buf_addr"]
        assert value["buf_sha"] == sha(pattern(BUFFER_SIZE, seed=3))
        assert value["table_sha"] == sha(TABLE) and value["notes"] == "restored notes\n"
        # Every segment mapped: the map reader is gone, frames are read on the main thread again.
        wait_for(lambda: threads(w.pid) == 1, 5, "the map reader to end")
        assert info(c, 3)["buf_sha"] == sha(pattern(BUFFER_SIZE, seed=3))
        assert threads(w.pid) == 1
    finally:
        for fd in fds:
            os.close(fd)
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_a_refused_map_fails_the_waiting_request_naming_the_segment(spawn: Spawner, daemon: Daemon) -> None:
    w, c, (buf, table, notes), _ = restored_segbuf(spawn, daemon)
    fds = [
        segment_memfd(TABLE, table["size"], sealed=True),
        segment_memfd(pattern(BUFFER_SIZE), buf["size"], sealed=False),
        segment_memfd(b"restored notes\n", notes["size"], sealed=False),
    ]
    try:
        c.send({"type": "invoke", "id": 2, "request": {"op": "info"}, "timeout_s": 5})
        send_map(c, table, fds[0])
        # A map the hook refuses (the wrong size) while the request waits for that segment.
        send_map(c, buf, fds[1], size=4096)
        result, seen = frames_until_result(c, 2)
        assert result["ok"] is False, result
        error = result["error"]
        assert error["type"] == "torpor.readiness.SegmentWaitError", error
        assert f"segment at {buf['va']:#x}" in error["message"] and "the segment has" in error["message"], (
            error
        )
        refused = [d for d in seen if d["type"] == "mapped" and not d["ok"]]
        assert len(refused) == 1 and refused[0]["va"] == buf["va"], seen
        # The worker serves on (torpord retires it; a right map still works).
        send_map(c, buf, fds[1])
        send_map(c, notes, fds[2])
        assert c.expect("mapped")["ok"] is True and c.expect("mapped")["ok"] is True
        assert info(c, 3)["buf_sha"] == sha(pattern(BUFFER_SIZE))
    finally:
        for fd in fds:
            os.close(fd)
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_a_quiesce_while_segments_are_mapped_is_a_protocol_error(spawn: Spawner, daemon: Daemon) -> None:
    w, c, segments, _ = restored_segbuf(spawn, daemon)
    table = segments[1]
    fd = segment_memfd(TABLE, table["size"], sealed=True)
    try:
        send_map(c, table, fd)
        assert c.expect("mapped")["ok"] is True
        c.send({"type": "quiesce"})
        assert w.wait() == 3
    finally:
        os.close(fd)
    left = len(segments) - 1
    assert f"quiesce while {left} segment(s) are still being mapped" in w.stderr(), w.stderr()


def test_the_ordinary_path_has_no_map_reader(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_segbuf(spawn, daemon)
    info(c, 1)
    assert threads(w.pid) == 1, Path(f"/proc/{w.pid}/task").iterdir()
    c.send({"type": "shutdown"})
    assert w.wait() == 0
