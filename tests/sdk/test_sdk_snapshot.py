"""The worker harness through real snapshots: `torpor run`, quiesce, `torpor snapshot`, two
`torpor restore`s, SIGUSR2 to all three, and every copy reconnects and answers like the others.

Needs root and CRIU (`make criu`); uses the `workers` fixture of tests/conftest.py, which kills
every process it started or restored.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from linesrv import Endpoint
from sdkd import PYTHON_DIR, Conn, Daemon

PYTHON = sys.executable
X = [1.0, 2.0, -0.5, 0.0]


def status_nspid(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid line for {pid}")


def test_snapshot_then_two_restores_all_reconnect_and_agree(
    workers: Any, daemon: Daemon, tmp_path: Path
) -> None:
    env = {"PYTHONPATH": str(PYTHON_DIR), "TORPOR_WORKER_SOCKET": str(daemon.path)}
    argv = [PYTHON, "-m", "torpor.worker", "--role", "base", "--preload", "json"]
    w = workers.start(argv, endpoint=Endpoint(), ready=None, name="sdk-worker", env=env)

    def log() -> str:
        return str(w.log_tail())

    c = daemon.accept()
    source = w.child_pid
    assert c.peer_pid == source, f"SO_PEERCRED says {c.peer_pid}, the worker is {source}\n{log()}"
    hello = c.expect("hello")
    inner_pid = status_nspid(source)[-1]
    assert hello == {
        "type": "hello",
        "pid": inner_pid,
        "role": "base",
        "function": None,
        "resumed": False,
        "protocol": 5,
        "reattach": False,
    }
    assert c.expect("ready")["ok"] is True
    assert c.load()["ok"] is True, log()
    before = c.invoke("before", {"x": X})
    assert before["ok"] is True and before["value"]["calls"] == 2, before

    c.send({"type": "quiesce"})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": False}
    assert c.at_eof(), f"the worker kept its connection open after quiet\n{log()}"

    snap = tmp_path / "snap"
    r = workers.torpor("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running")
    assert r.returncode == 0, f"snapshot failed\n{r.stderr}\n{log()}"
    pids = [source]
    instances = [w]
    for i in range(2):
        r = workers.torpor("restore", snap, "--detach")
        assert r.returncode == 0 and r.stdout.strip().isdigit(), f"restore {i} failed\n{r.stdout}\n{r.stderr}"
        restored = workers.adopt(int(r.stdout.strip()), Endpoint(), f"restored-{i}")
        pids.append(restored.child_pid)
        instances.append(restored)
    assert len(set(pids)) == 3, pids
    # Nobody reconnects before its SIGUSR2.
    assert daemon.no_connection(within=0.3), "a worker reconnected before SIGUSR2"
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)

    conns: dict[int, Conn] = {}
    for _ in pids:
        conn = daemon.accept()
        hello = conn.expect("hello")
        assert hello == {
            "type": "hello",
            "pid": inner_pid,
            "role": "function",
            "function": "tinymlp",
            "resumed": True,
            "protocol": 5,
            "reattach": False,
        }
        conns[conn.peer_pid] = conn
    assert sorted(conns) == sorted(pids), f"SO_PEERCRED pids {sorted(conns)}, workers {sorted(pids)}"

    answers = {pid: conn.invoke(f"after-{pid}", {"x": X}) for pid, conn in conns.items()}
    for pid, a in answers.items():
        assert a["ok"] is True, a
        # Same weights, same state (the counter the snapshot holds), same output.
        assert a["value"] == {"y": before["value"]["y"], "calls": 3}, (pid, a)
    # The copies are independent from here on.
    assert conns[pids[1]].invoke("again", {"echo": 0})["value"] == {"echo": 0, "calls": 4}
    assert conns[pids[2]].invoke("again", {"echo": 0})["value"] == {"echo": 0, "calls": 4}
    assert conns[source].invoke("again", {"echo": 0})["value"] == {"echo": 0, "calls": 4}

    for conn in conns.values():
        conn.send({"type": "shutdown"})
        assert conn.at_eof()
    for inst in instances:
        inst.wait_gone()  # the worker exited 0 on shutdown, so its init did too
