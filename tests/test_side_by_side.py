"""Two restores of one snapshot, started at the same time, live side by side independently."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from conftest import Torpor, Worker, Workers, describe, ns_id, nspid, parse_pid


def test_two_restores_at_once_are_independent(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    # Abstract socket: each instance has its own network namespace, so the same name does not clash.
    w = workers.server(abstract=True)
    assert [w.ask("incr") for _ in range(2)] == ["1", "2"]
    digest = w.ask("digest")
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()

    results: list[subprocess.CompletedProcess[str] | None] = [None, None]
    start = threading.Barrier(2)

    def restore(i: int) -> None:
        start.wait()
        results[i] = torpor("restore", snap, "--detach")

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Track whatever was started before asserting anything, so cleanup kills it.
    for r in results:
        if r is not None and r.returncode == 0 and r.stdout.strip().isdigit():
            workers.track(int(r.stdout.strip()))
    for r in results:
        assert r is not None and r.returncode == 0, describe(r) if r else "restore thread did not finish"
    a, b = (workers.adopt(parse_pid(r), w.endpoint, f"restored-{i}") for i, r in enumerate(results) if r)
    instances: list[Worker] = [a, b]

    assert a.init_pid != b.init_pid
    assert a.child_pid != b.child_pid
    for inst in instances:
        assert inst.ask("get", wait=15) == "2"
        assert inst.ask("digest") == digest
        assert nspid(inst.init_pid)[-1] == 1, f"{inst}: init is not PID 1 in its namespace"
        assert nspid(inst.child_pid)[-1] == nspid(a.child_pid)[-1]
    for kind in ("pid", "net", "mnt"):
        assert ns_id(a.init_pid, kind) != ns_id(b.init_pid, kind), f"both instances share a {kind} namespace"

    assert a.ask("incr") == "3"
    assert b.ask("get") == "2", "incr on one instance changed the other"
    assert b.ask("incr") == "3"
    assert b.ask("incr") == "4"
    assert a.ask("get") == "3"
    assert a.ask_netns("get", tcp=True) == "3"
    assert b.ask_netns("get", tcp=True) == "4"
