"""The device-memory hook from Python: torpor.buffer(), torpor.load(name, buffer=True), and the
split frames between a test "daemon" and a real worker process, with real fds (docs/split.md).
The hook is the real libtorpor_hook.so (host backend: memfd segments)."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torpor
from sdkd import FUNCTIONS, Conn, Daemon, Spawned, Spawner, hook_lib, proc_state, wait_for, worker_env
from torpor import data, hook

SEGBUF = FUNCTIONS / "segbuf"
TABLE = (SEGBUF / "table.bin").read_bytes()
BUFFER_SIZE = 3 * 4096 + 100
PAGE = mmap.PAGESIZE
EXIT_PROTOCOL = 3


def without_map_s(frame: dict[str, Any]) -> dict[str, Any]:
    """A `mapped` frame less its `map_s` (the hook's time, a small positive number), checked."""
    frame = dict(frame)
    map_s = frame.pop("map_s", None)
    if frame.get("ok"):
        assert isinstance(map_s, float) and 0 <= map_s < 10, map_s
    return frame


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i + seed) % 251 for i in range(n))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def start_segbuf(spawn: Spawner, daemon: Daemon) -> tuple[Spawned, Conn]:
    w = spawn("--role", "function", env=worker_env(daemon.path, TORPOR_HOOK_LIB=str(hook_lib())))
    c = daemon.accept()
    c.expect("hello")
    ready = c.load(SEGBUF)
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    return w, c


def info(c: Conn, rid: int) -> dict[str, Any]:
    r = c.invoke(rid, {"op": "info"})
    assert r["ok"] is True, r
    value = r["value"]
    assert isinstance(value, dict)
    return value


def segment_memfd(data: bytes, size: int, sealed: bool) -> int:
    """What the restore server hands out: a memfd of `size` bytes starting with `data`, its size
    sealed (the hook refuses others), sealed read-only when asked."""
    fd = os.memfd_create("restored-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, data, 0)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | (fcntl.F_SEAL_WRITE if sealed else 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def maps_of(pid: int, va: int) -> str:
    """The permissions /proc/PID/maps shows for the mapping that holds va ("" if none). Not the
    one starting at va: a released segment's PROT_NONE range merges with an adjacent one (another
    released segment, a guard page) into one line that starts lower."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= va < end:
            return line.split()[1]
    return ""


def test_buffer_and_buffered_data_live_in_segments(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_segbuf(spawn, daemon)
    i = info(c, 1)
    assert i["buf_len"] == BUFFER_SIZE and i["buf_sha"] == sha(pattern(BUFFER_SIZE))
    assert i["table_len"] == len(TABLE) and i["table_sha"] == sha(TABLE)
    assert i["table_readonly"] is True
    # Writable data is a private, writable copy: the file stays as it was.
    assert i["notes"] == "WRITABLE notes\n" and i["notes_readonly"] is False
    assert (SEGBUF / "notes.txt").read_text() == "writable notes\n"
    buf, table, notes = i["segments"]
    assert (notes["size"], notes["readonly"]) == (PAGE, False)
    assert buf == {
        "va": i["buf_addr"],
        "size": pages(BUFFER_SIZE),
        "backend": "host",
        "ordinal": -1,
        "order": 0,
        "first_use": None,
        "readonly": False,
        "mapped": True,
    }
    assert (table["size"], table["order"], table["readonly"]) == (pages(len(TABLE)), 1, True)
    # The kernel enforces it: the data is mapped read-only, the buffer read-write, both shared.
    assert maps_of(w.pid, table["va"]) == "r--s"
    assert maps_of(w.pid, i["buf_addr"]) == "rw-s"
    assert c.invoke(2, {"op": "write", "at": 10, "hex": "deadbeef"})["value"] == "written"
    expected = bytearray(pattern(BUFFER_SIZE))
    expected[10:14] = bytes.fromhex("deadbeef")
    assert info(c, 3)["buf_sha"] == sha(bytes(expected))
    assert c.invoke(4, {"op": "write_table"})["value"] == "refused"


def test_split_quiesce_hands_over_releases_and_maps_back(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_segbuf(spawn, daemon)
    before = info(c, 1)
    c.send({"type": "quiesce", "split": True})
    quiet, fd = c.recv_with_fd()
    assert fd is None and quiet["type"] == "quiet", quiet
    segments = quiet["segments"]
    assert [s["va"] for s in segments] == [s["va"] for s in before["segments"]]
    assert [(s["backend"], s["readonly"]) for s in segments] == [("host", False), ("host", True), ("host", False)]

    # One segment_fd frame per segment, each with the segment's memory: the capture step.
    exported = {}
    for s in segments:
        frame, fd = c.recv_with_fd()
        assert frame == {"type": "segment_fd", "va": s["va"], "fd": True}
        assert fd is not None, "segment_fd came without an fd"
        exported[s["va"]] = fd
    buf, table, notes = segments
    with mmap.mmap(exported[buf["va"]], buf["size"], prot=mmap.PROT_READ) as m:
        assert m[:BUFFER_SIZE] == pattern(BUFFER_SIZE)
    with mmap.mmap(exported[table["va"]], table["size"], prot=mmap.PROT_READ) as m:
        assert m[: len(TABLE)] == TABLE
    # The shared read-only data cannot be mapped writable anywhere.
    with pytest.raises(PermissionError):
        mmap.mmap(exported[table["va"]], table["size"])

    c.send({"type": "release"})
    released = c.expect("released")
    assert released == {"type": "released", "bytes": buf["size"] + table["size"] + notes["size"]}
    assert c.at_eof(), "the worker must close its connection after released"
    wait_for(lambda: proc_state(w.pid) == "S", 5, "the worker to block in sigwait")
    # The memory is gone from the worker, the addresses are still reserved.
    assert maps_of(w.pid, buf["va"]) == "---p"
    assert maps_of(w.pid, table["va"]) == "---p"
    # What the daemon copied is intact after the release.
    with mmap.mmap(exported[buf["va"]], buf["size"], prot=mmap.PROT_READ) as m:
        assert m[:BUFFER_SIZE] == pattern(BUFFER_SIZE)
    for fd in exported.values():
        os.close(fd)

    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.expect("hello")["resumed"] is True
    new_buf = segment_memfd(pattern(BUFFER_SIZE, seed=7), buf["size"], sealed=False)
    new_table = segment_memfd(TABLE[::-1], table["size"], sealed=True)
    new_notes = segment_memfd(b"restored notes\n", notes["size"], sealed=False)
    try:
        # A map the hook refuses is an answer, not the end of the worker.
        c2.send_with_fd({"type": "map", "va": buf["va"], "size": PAGE, "readonly": False, "fd": True}, new_buf)
        bad = c2.expect("mapped")
        assert bad["ok"] is False and bad["va"] == buf["va"], bad
        assert "the segment has" in bad["error"]["message"], bad
        # A sealed memfd cannot be mapped writable.
        c2.send_with_fd(
            {"type": "map", "va": table["va"], "size": table["size"], "readonly": False, "fd": True}, new_table
        )
        bad = c2.expect("mapped")
        assert bad["ok"] is False and "sealed read-only" in bad["error"]["message"], bad
        # First-use order: the table first.
        for s, fd in ((table, new_table), (buf, new_buf), (notes, new_notes)):
            c2.send_with_fd(
                {"type": "map", "va": s["va"], "size": s["size"], "readonly": s["readonly"], "fd": True}, fd
            )
            assert without_map_s(c2.expect("mapped")) == {"type": "mapped", "va": s["va"], "ok": True}
        after = info(c2, 2)
        # Same addresses, new contents.
        assert after["buf_addr"] == before["buf_addr"]
        assert after["buf_sha"] == sha(pattern(BUFFER_SIZE, seed=7))
        assert after["table_sha"] == sha(TABLE[::-1])
        assert after["notes"] == "restored notes\n"
        assert all(s["mapped"] for s in after["segments"])
        assert maps_of(w.pid, table["va"]) == "r--s"
        # The worker writes into the daemon's memory: one physical copy.
        assert c2.invoke(3, {"op": "write", "at": 0, "hex": "c0ffee"})["value"] == "written"
        assert os.pread(new_buf, 3, 0) == bytes.fromhex("c0ffee")
    finally:
        os.close(new_buf)
        os.close(new_table)
        os.close(new_notes)
    # The next snapshot works the same way.
    c2.send({"type": "quiesce", "split": True})
    quiet, _ = c2.recv_with_fd()
    assert len(quiet["segments"]) == 3
    for _ in quiet["segments"]:
        _, fd = c2.recv_with_fd()
        assert fd is not None
        os.close(fd)
    c2.send({"type": "shutdown"})
    assert w.wait() == 0


def test_unmap_releases_the_named_segments_on_a_live_connection_and_maps_bring_them_back(
    spawn: Spawner, daemon: Daemon
) -> None:
    """gpu_released on the split path: the worker gives back the memory of the segments the
    daemon names and serves on, connected; the daemon's map frames (memory it saved) bring them
    back at the same addresses. A segment it does not name keeps its memory."""
    w, c = start_segbuf(spawn, daemon)
    before = info(c, 1)
    buf, table, notes = before["segments"]
    c.send({"type": "unmap", "vas": [buf["va"], table["va"]]})
    unmapped = c.expect("unmapped")
    assert unmapped == {"type": "unmapped", "ok": True, "bytes": buf["size"] + table["size"]}
    # Released, addresses kept; the worker still holds the connection.
    assert maps_of(w.pid, buf["va"]) == "---p" and maps_of(w.pid, table["va"]) == "---p"
    assert maps_of(w.pid, notes["va"]) == "rw-s", "a segment the daemon did not name was released"
    assert not c.at_eof(timeout=0.3), "the worker must stay connected after unmapped"
    saved_buf = bytearray(pattern(BUFFER_SIZE))
    saved_buf[:4] = b"SAVE"
    new_buf = segment_memfd(bytes(saved_buf), buf["size"], sealed=False)
    new_table = segment_memfd(TABLE, table["size"], sealed=True)
    try:
        for s, fd in ((table, new_table), (buf, new_buf)):
            c.send_with_fd({"type": "map", "va": s["va"], "size": s["size"], "readonly": s["readonly"], "fd": True}, fd)
            assert without_map_s(c.expect("mapped")) == {"type": "mapped", "va": s["va"], "ok": True}
        after = info(c, 2)
        assert after["buf_addr"] == before["buf_addr"]
        assert after["buf_sha"] == sha(bytes(saved_buf)) and after["table_sha"] == before["table_sha"]
        assert after["notes"] == "WRITABLE notes\n"
        assert all(s["mapped"] for s in after["segments"])
        assert maps_of(w.pid, table["va"]) == "r--s" and maps_of(w.pid, buf["va"]) == "rw-s"
        # The worker now writes into the daemon's memory.
        assert c.invoke(3, {"op": "write", "at": 0, "hex": "c0ffee"})["value"] == "written"
        assert os.pread(new_buf, 3, 0) == bytes.fromhex("c0ffee")
    finally:
        for fd in (new_buf, new_table):
            os.close(fd)
    # And it can release them again (the next gpu_released).
    c.send({"type": "unmap", "vas": [notes["va"]]})
    assert c.expect("unmapped") == {"type": "unmapped", "ok": True, "bytes": notes["size"]}
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_unmap_needs_the_hook_its_segments_and_every_segment_mapped(spawn: Spawner, daemon: Daemon) -> None:
    env = worker_env(daemon.path)
    env.pop("TORPOR_HOOK_LIB", None)
    w = spawn("--role", "base", env=env)
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "unmap", "vas": []})
    assert w.wait() == EXIT_PROTOCOL
    assert "unmap, but this worker has no device-memory hook" in w.stderr(), w.stderr()

    # Nothing named, nothing given back.
    w = spawn("--role", "base", env=worker_env(daemon.path, TORPOR_HOOK_LIB=str(hook_lib())))
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "unmap", "vas": []})
    assert c.expect("unmapped") == {"type": "unmapped", "ok": True, "bytes": 0}
    c.send({"type": "shutdown"})
    assert w.wait() == 0

    w, c = start_segbuf(spawn, daemon)
    c.send({"type": "unmap"})
    assert w.wait() == EXIT_PROTOCOL
    assert "unmap needs vas" in w.stderr(), w.stderr()

    # A segment the worker no longer has (its allocator gave one back since the restore): the
    # unmap is refused with nothing released and the worker serves on, its segments mapped.
    w, c = start_segbuf(spawn, daemon)
    vas = [s["va"] for s in info(c, 1)["segments"]]
    c.send({"type": "unmap", "vas": [*vas, 4096]})
    refused = c.expect("unmapped")
    assert refused["ok"] is False and refused["released"] == [], refused
    assert "unmap names 0x1000, which is not the start of a segment" in refused["error"]["message"], refused
    assert all(s["mapped"] for s in info(c, 2)["segments"]), "a refused unmap released a segment"
    c.send({"type": "shutdown"})
    assert w.wait() == 0

    w, c = start_segbuf(spawn, daemon)
    vas = [s["va"] for s in info(c, 1)["segments"]]
    c.send({"type": "unmap", "vas": vas})
    assert c.expect("unmapped")["ok"] is True
    c.send({"type": "unmap", "vas": vas})
    assert w.wait() == EXIT_PROTOCOL
    assert "unmap while 3 segment(s) are still released" in w.stderr(), w.stderr()


def test_release_of_one_segment_keeps_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "_hook", None)
    monkeypatch.setenv("TORPOR_HOOK_LIB", str(hook_lib()))
    h = hook.get()
    kept, gone = h.host_alloc(PAGE), h.host_alloc(PAGE)
    h.release(gone)
    state = {s.va: s.mapped for s in h.segments()}
    assert state[gone] is False and state[kept] is True
    assert maps_of(os.getpid(), gone) == "---p"
    with pytest.raises(torpor.HookError, match="has been released"):
        h.release(gone)
    with pytest.raises(torpor.HookError, match="is not the start of a segment"):
        h.release(kept + 1)


def test_split_without_the_hook_and_maps_without_fds_are_protocol_errors(
    spawn: Spawner, daemon: Daemon
) -> None:
    env = worker_env(daemon.path)
    env.pop("TORPOR_HOOK_LIB", None)
    w = spawn("--role", "base", env=env)
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "quiesce", "split": True})
    assert w.wait() == EXIT_PROTOCOL
    assert "$TORPOR_HOOK_LIB is not set" in w.stderr(), w.stderr()

    w, c = start_segbuf(spawn, daemon)
    c.send({"type": "map", "va": 4096, "size": 4096, "readonly": False, "fd": True})
    assert w.wait() == EXIT_PROTOCOL
    assert "came without an fd" in w.stderr(), w.stderr()

    w, c = start_segbuf(spawn, daemon)
    c.send({"type": "release"})
    assert w.wait() == EXIT_PROTOCOL
    assert "release outside a split quiesce" in w.stderr(), w.stderr()


def test_buffer_needs_the_hook_and_a_positive_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "_hook", None)
    monkeypatch.delenv("TORPOR_HOOK_LIB", raising=False)
    with pytest.raises(torpor.HookError, match=r"\$TORPOR_HOOK_LIB is not set"):
        torpor.buffer(10)
    monkeypatch.setenv("TORPOR_HOOK_LIB", "/nonexistent/libtorpor_hook.so")
    with pytest.raises(torpor.HookError, match="cannot load the device-memory hook"):
        torpor.buffer(10)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive number of bytes"):
            torpor.buffer(bad)  # type: ignore[arg-type]


def test_buffer_in_this_process_is_zeroed_writable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook, "_hook", None)
    monkeypatch.setenv("TORPOR_HOOK_LIB", str(hook_lib()))
    b = torpor.buffer(5000)
    assert len(b) == 5000 and not b.readonly and b.format == "B"
    assert b.tobytes() == bytes(5000)
    b[4990:] = b"0123456789"
    segment = next(s for s in hook.get().segments() if s.size == pages(5000) and s.backend == "host")
    assert segment.mapped and not segment.read_only


def test_load_into_a_segment_checks_the_declared_size(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hook, "_hook", None)
    monkeypatch.setenv("TORPOR_HOOK_LIB", str(hook_lib()))
    fdir = tmp_path / "segbuf"
    fdir.mkdir()
    for name in ("torpor.toml", "model.py", "table.bin", "notes.txt"):
        (fdir / name).write_bytes((SEGBUF / name).read_bytes())
    torpor.use_dir(fdir)
    try:
        table = torpor.load("table", buffer=True)
        assert table.readonly and table.tobytes() == TABLE
        assert torpor.load("table") == fdir / "table.bin"
        # The file changes after the spec was validated (binding again forgets the buffers):
        # a clear error, not wrong data.
        torpor.use_dir(fdir)
        (fdir / "table.bin").write_bytes(TABLE[:-1])
        with pytest.raises(torpor.DataError, match="has 9999 bytes but 10000 were declared"):
            torpor.load("table", buffer=True)
    finally:
        data.unbind()
