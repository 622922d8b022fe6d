"""The harness on a GPU: a base worker warms CUDA through torch, loads a torch function, and
quiesce synchronises CUDA; a restored worker computes its first layers before the last ones'
segments are mapped. Skipped where torch or a CUDA device is missing."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from typing import Any

import pytest
from sdkd import FUNCTIONS, Daemon, Spawner, hook_lib, run_ok, wait_for, worker_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")


def test_gpu_base_warm_load_quiesce(cuda: None, spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "base", "--preload", "torch", "--gpu")
    c = daemon.accept(timeout=120)
    assert c.expect("hello")["role"] == "base"
    ready = c.expect("ready", timeout=120)
    assert ready["ok"] is True and ready["warmup_s"] > 0, f"{ready}\n{w.stderr()}"
    print(f"preload torch {ready['setup_s']:.2f} s, GPU warm-up {ready['warmup_s']:.2f} s")
    ready = c.load(FUNCTIONS / "torchmm")
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    first = c.invoke(1, {"x": [0.5, -1.0, 2.0, 0.0]})
    assert first["ok"] is True and first["value"]["calls"] == 2, first
    c.send({"type": "quiesce"})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": True}
    assert c.at_eof()
    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.expect("hello")["resumed"] is True
    again = c2.invoke(2, {"x": [0.5, -1.0, 2.0, 0.0]})
    assert again["value"] == {"y": first["value"]["y"], "calls": 3}, again
    c2.send({"type": "shutdown"})
    assert w.wait(60) == 0


def test_first_layers_compute_while_later_segments_are_withheld(
    cuda: None, spawn: Spawner, daemon: Daemon
) -> None:
    """Per-module readiness (docs/split.md): after a split restore, a request runs its first
    layers while the segments holding the later layers' weights are not mapped yet; each later
    layer waits for its own segment and computes once it comes. The test is the daemon: it hands
    back the segments' own exported memory, withholding the last layers' weights."""
    lib = str(hook_lib())
    env = worker_env(daemon.path, LD_PRELOAD=lib, TORPOR_HOOK_LIB=lib, TORPOR_HOOK_CUDA="1")
    w = spawn("--role", "function", "--preload", "torch", env=env)
    c = daemon.accept(timeout=120)
    c.expect("hello")
    ready = c.load(FUNCTIONS / "torchlayers")
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    weights = c.invoke(1, {"op": "weights"})["value"]["weights"]
    want = c.invoke(2, {"x": 7, "rid": 2}, timeout=60)["value"]["sha"]

    c.send({"type": "quiesce", "split": True})
    quiet, _ = c.recv_with_fd(timeout=60)
    segments: list[dict[str, Any]] = quiet["segments"]
    fds: dict[int, int] = {}
    for s in segments:
        frame, fd = c.recv_with_fd(timeout=60)
        assert frame["va"] == s["va"] and fd is not None
        fds[s["va"]] = fd

    def holding(addr: int) -> dict[str, Any]:
        (s,) = [s for s in segments if s["va"] <= addr < s["va"] + s["size"]]
        return s

    late = {holding(a)["va"] for a in weights[4:]}
    assert len(late) == 4, f"the last four weights should fill four segments of their own: {segments}"
    # Nothing but module weights in them: the worker lets a request start without them.
    assert all(holding(a).get("deferrable") for a in weights), segments
    try:
        c.send({"type": "release"})
        c.expect("released", timeout=60)
        assert c.at_eof(timeout=60)
        os.kill(w.pid, signal.SIGUSR2)
        c2 = daemon.accept(timeout=60)
        assert c2.expect("hello")["resumed"] is True

        def send_map(s: dict[str, Any]) -> None:
            frame = {"type": "map", "va": s["va"], "size": s["size"], "readonly": False, "fd": True}
            c2.send_with_fd(frame, fds[s["va"]])

        for s in segments:
            if s["va"] not in late:
                send_map(s)
        c2.send({"type": "invoke", "id": 3, "request": {"x": 7, "rid": 3}, "timeout_s": 60})
        wait_for(lambda: "layer 3 ran (request 3)" in w.stderr(), 60, "the first four layers to run")
        # Layer 4's weights are not mapped: it waits (it would fail its kernel otherwise). A
        # moment for it to run if nothing held it.
        time.sleep(1.0)
        assert "layer 4 ran (request 3)" not in w.stderr(), w.stderr()
        for s in segments:
            if s["va"] in late:
                send_map(s)
        seen: list[dict[str, Any]] = []
        while True:
            doc = c2.recv(timeout=60)
            if doc["type"] == "result":
                break
            seen.append(doc)
        assert doc["ok"] is True, doc
        assert doc["value"]["sha"] == want, "the output differs after the segments came back"
        assert [d["ok"] for d in seen if d["type"] == "mapped"] == [True] * len(segments), seen
        assert "layer 7 ran (request 3)" in w.stderr()
    finally:
        for fd in fds.values():
            os.close(fd)
    c2.send({"type": "shutdown"})
    assert w.wait(60) == 0


def test_the_quiet_point_gives_back_the_pinned_memory_torch_keeps_cached(cuda: None) -> None:
    """A host-to-GPU copy through pinned memory leaves PyTorch's block cached as shared anonymous
    memory, which CRIU would copy at every restore; torpor.gpu.release_pinned_caches() (called by
    quiesce after the sync) frees it, and a pinned tensor still alive keeps its memory and data."""
    code = (
        "import torch\n"
        "from torpor import gpu\n"
        "base = gpu.shared_anonymous_bytes()\n"
        "src = torch.ones(64 << 20, dtype=torch.uint8).pin_memory()\n"
        "dst = src.to('cuda', non_blocking=True)\n"
        "kept = torch.full((16 << 20,), 7, dtype=torch.uint8).pin_memory()\n"
        "del src\n"
        "torch.cuda.synchronize()\n"
        "held = gpu.shared_anonymous_bytes() - base\n"
        "assert held >= (80 << 20), f'the pinned blocks are not shared anonymous memory: {held}'\n"
        "freed = gpu.release_pinned_caches()\n"
        "left = gpu.shared_anonymous_bytes() - base\n"
        "assert freed >= (64 << 20), f'freed {freed} of {held}'\n"
        "assert (16 << 20) <= left < (32 << 20), f'left {left}: the live pinned tensor must stay'\n"
        "assert int(kept.sum()) == 7 * (16 << 20) and int(dst.sum()) == 64 << 20\n"
        "print('ok', held, freed, left)\n"
    )
    run_ok(code)


def test_sandbox_requests_on_new_threads_reuse_streams_and_cublas_workspaces(cuda: None) -> None:
    """A sandbox runs each request on a thread of its own (torpor.gpu.request_stream): requests
    one after another reuse one stream, so PyTorch's cuBLAS workspace per (handle, stream) is made
    once, not once per request; requests at once get streams of their own."""
    code = (
        "import threading, torch\n"
        "from torpor import gpu\n"
        "assert gpu.warm() == 'torch'\n"
        "after_warm = torch.cuda.memory_allocated()\n"
        "w = torch.randn(1024, 1024, device='cuda')\n"
        "seen = []\n"
        "def request(hold=None):\n"
        "    with gpu.request_stream('torch'):\n"
        "        seen.append(torch.cuda.current_stream())\n"
        "        (torch.ones(8, 1024, device='cuda') @ w).sum().item()\n"
        "        if hold is not None:\n"
        "            hold.wait()\n"
        "def on_thread(*a):\n"
        "    t = threading.Thread(target=request, args=a); t.start(); return t\n"
        "on_thread().join()\n"
        "one = torch.cuda.memory_allocated()\n"
        "for _ in range(10):\n"
        "    on_thread().join()\n"
        "ten = torch.cuda.memory_allocated()\n"
        "assert len({s.cuda_stream for s in seen}) == 1, 'requests one after another share a stream'\n"
        "assert ten == one, f'ten more requests grew the allocations by {ten - one} bytes'\n"
        "hold = threading.Barrier(3)\n"
        "ts = [on_thread(hold) for _ in range(2)]\n"
        "hold.wait()\n"
        "for t in ts: t.join()\n"
        "assert len({s.cuda_stream for s in seen[-2:]}) == 2, 'requests at once have streams of their own'\n"
        "print('ok', after_warm, one, ten)\n"
    )
    run_ok(code)
