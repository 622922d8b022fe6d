"""Daemon restarts, fallback boots and the per-request timeout, through the real daemon, real
workers and real CRIU.

tests/daemon/functions/steady counts its calls in the worker's memory, so an instance that goes
on counting is the very same process. Its workers outlive a lost daemon for `workers.reattach_s`
(6 s here) and a restarted daemon re-adopts them; a graceful stop still stops them.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import alive, children, kill_tree, proc_start_time

from .conftest import FUNCTIONS, Answer, Torpord

STEADY = FUNCTIONS / "steady"
REATTACH_S = 6
# The daemon's READOPT_TIMEOUT (crates/torpord/src/runtime/readopt.rs).
READOPT_S = 10


@pytest.fixture(scope="module")
def torpord(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord-adopt"), config=f"[workers]\nreattach_s = {REATTACH_S}\n")
    d.deploy(STEADY)
    try:
        yield d
    finally:
        d.stop()


def the_instance(torpord: Torpord) -> dict[str, Any]:
    instances = torpord.instances("steady")
    assert len(instances) == 1, instances
    return instances[0]


def worker_of(init: int) -> int:
    kids = children(init)
    assert len(kids) == 1, f"init {init} has children {kids}"
    return kids[0]


def kill_daemon(torpord: Torpord) -> None:
    torpord.wait_pages_in()  # a restored instance with lazy pages to come is not re-adopted
    torpord.proc.send_signal(signal.SIGKILL)
    torpord.proc.wait()


def wait_log(torpord: Torpord, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in torpord.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout} s\n{torpord.log_text()}"
        time.sleep(0.05)


def wait_dead(pid: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"{what} (pid {pid}) still alive after {timeout} s"
        time.sleep(0.05)


def metric(torpord: Torpord, name: str, **labels: str) -> float:
    text = torpord.request("GET", "/metrics").body.decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{{{want}}} not in /metrics:\n{text}"
    return float(m.group(1))


def test_the_timeout_counts_from_the_handler_start_not_from_the_wait_inside_the_worker(torpord: Torpord) -> None:
    # Two requests of 2 s on one instance that runs them one after another: the second ends
    # about 4 s after it was sent, past timeout_s = 3, yet its handler ran only 2 s.
    assert torpord.invoke("steady", {}).status == 200
    init = the_instance(torpord)["pid"]
    answers: list[Answer] = []

    def call() -> None:
        answers.append(torpord.invoke("steady", {"sleep": 2}))

    threads = [threading.Thread(target=call) for _ in range(2)]
    t = time.monotonic()
    for th in threads:
        th.start()
        time.sleep(0.2)
    for th in threads:
        th.join()
    took = time.monotonic() - t
    assert [a.status for a in answers] == [200, 200], [(a.status, a.body) for a in answers]
    assert took > 3.5, f"the two requests did not run one after another ({took:.1f} s)"
    assert sorted(a.json()["calls"] for a in answers) == [2, 3]
    assert all(a.start == "warm" for a in answers), [a.start for a in answers]
    assert the_instance(torpord)["pid"] == init, "the instance was replaced"
    assert alive(init)
    # A handler that runs past timeout_s itself is still killed.
    hung = torpord.invoke("steady", {"sleep": 30})
    assert hung.status == 504, hung.body
    wait_dead(init, 5, "the hung instance")


def test_a_killed_daemon_restarted_re_adopts_the_same_warm_instance(torpord: Torpord) -> None:
    first = torpord.invoke("steady", {"add": 2})
    assert first.status == 200, first.body
    calls = first.json()["calls"]
    init = the_instance(torpord)["pid"]
    worker = worker_of(init)
    kill_daemon(torpord)
    time.sleep(0.5)
    assert alive(init) and alive(worker), "the instance did not outlive its daemon"
    again = Torpord.restart(torpord)
    wait_log(again, "re-adopted an instance of an earlier torpord", READOPT_S)
    r = again.invoke("steady", {"add": 3})
    assert r.status == 200 and r.start == "warm", (r.status, r.start, r.body)
    assert r.json()["calls"] == calls + 1, "not the same process: its memory is gone"
    inst = the_instance(again)
    assert inst["pid"] == init and inst["stage"] == "warm", inst
    assert worker_of(init) == worker


def test_a_request_in_flight_when_the_daemon_dies_is_lost_and_the_worker_comes_back(torpord: Torpord) -> None:
    before = torpord.invoke("steady", {})
    assert before.status == 200, before.body
    calls = before.json()["calls"]
    init = the_instance(torpord)["pid"]
    lost: list[BaseException] = []

    def call() -> None:
        try:
            torpord.invoke("steady", {"sleep": 1.5})
        except (OSError, http.client.HTTPException) as e:  # the connection dies with the daemon
            lost.append(e)

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.5)
    kill_daemon(torpord)
    th.join()
    assert lost, "the request in flight was answered by a dead daemon"
    again = Torpord.restart(torpord)
    wait_log(again, "re-adopted an instance of an earlier torpord", READOPT_S + 2)
    r = again.invoke("steady", {})
    assert r.status == 200 and r.start == "warm", (r.status, r.body)
    # The lost request's handler ran (calls + 1) and its result was dropped.
    assert r.json()["calls"] == calls + 2, r.json()
    assert the_instance(again)["pid"] == init


def test_a_worker_that_does_not_reconnect_is_killed_and_its_row_removed(torpord: Torpord) -> None:
    assert torpord.invoke("steady", {}).status == 200
    init = the_instance(torpord)["pid"]
    worker = worker_of(init)
    # A stopped worker cannot reconnect; SIGKILL still ends it.
    subprocess.run(["kill", "-STOP", str(worker)], check=True)
    kill_daemon(torpord)
    again = Torpord.restart(torpord)
    wait_log(again, "killed an instance of an earlier torpord", READOPT_S + 5)
    wait_dead(init, 5, "the instance that did not reconnect")
    assert again.instances("steady") == []
    r = again.invoke("steady", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body)
    assert r.json()["calls"] == 1


def test_without_a_daemon_workers_exit_after_reattach_s(torpord: Torpord) -> None:
    assert torpord.invoke("steady", {}).status == 200
    init = the_instance(torpord)["pid"]
    kill_daemon(torpord)
    time.sleep(REATTACH_S / 2)
    assert alive(init), "the worker did not wait for a daemon"
    wait_dead(init, REATTACH_S + 5, "a worker with no daemon past reattach_s")
    again = Torpord.restart(torpord)
    assert again.instances("steady") == []
    r = again.invoke("steady", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body)


def test_a_graceful_stop_still_stops_the_instances(torpord: Torpord) -> None:
    assert torpord.invoke("steady", {}).status == 200
    init = the_instance(torpord)["pid"]
    torpord.proc.send_signal(signal.SIGTERM)
    torpord.proc.wait(timeout=20)
    wait_dead(init, 5, "an instance after a graceful stop")
    again = Torpord.restart(torpord)
    assert again.instances("steady") == []
    r = again.invoke("steady", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body)
    assert r.json()["calls"] == 1


def test_a_recorded_pid_now_used_by_another_process_is_neither_adopted_nor_killed(torpord: Torpord) -> None:
    torpord.proc.send_signal(signal.SIGTERM)
    torpord.proc.wait(timeout=20)
    # A process whose command line names the state directory, as a worker's does, but which is
    # not the process the registry recorded for that pid (its start time differs).
    other = subprocess.Popen(["bash", "-c", f'exec -a "{torpord.state}/not-a-worker" sleep 300'])
    try:
        deadline = time.monotonic() + 5
        while str(torpord.state) not in Path(f"/proc/{other.pid}/cmdline").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = proc_start_time(other.pid)
        assert start is not None
        now = int(time.time() * 1000)
        db = sqlite3.connect(torpord.state / "registry.db")
        with db:
            snap = db.execute("SELECT snapshot FROM functions WHERE name = 'steady'").fetchone()[0]
            db.execute(
                "INSERT INTO instances (id, function, pid, stage, snapshot, started, last_used) "
                "VALUES ('steady-reused', 'steady', ?, 'warm', ?, ?, ?)",
                (other.pid, snap, now, now),
            )
            db.execute(
                "INSERT INTO instance_processes (instance, pid, start) VALUES ('steady-reused', ?, ?)",
                (other.pid, start + 1),
            )
        db.close()
        again = Torpord.restart(torpord)
        assert again.instances("steady") == [], "the row of a reused pid was kept"
        assert other.poll() is None and alive(other.pid), "a process that reused a recorded pid was killed"
        assert "is another process now; left alone" in again.log_text()
    finally:
        other.kill()
        other.wait()


def test_a_corrupt_function_snapshot_falls_back_to_booting_an_instance(torpord: Torpord) -> None:
    torpord.deploy(STEADY)  # a fresh snapshot, and no live instance
    assert torpord.instances("steady") == []
    snap = torpord.request("GET", "/v1/functions/steady").json()
    paths = [s["path"] for s in snap["snapshots"] if s["kind"] == "function"]
    assert len(paths) == 1, snap
    # The disk copy and the copy staged in memory (restores read that one, sizes checked only).
    staged = [p for p in (torpord.state / "stage").iterdir() if p.name.startswith(Path(paths[0]).name + ".")]
    assert len(staged) == 1, staged
    images = [p for d in [Path(paths[0]), *staged] for p in d.rglob("*.img") if p.is_file()]
    assert images, f"no CRIU images under {paths[0]}"
    for img in images:
        img.write_bytes(b"\xde\xad\xbe\xef" * 16)
    before = metric(torpord, "torpor_restore_fallbacks_total", function="steady")
    r = torpord.invoke("steady", {"add": 7})
    assert r.status == 200 and r.start == "booted", (r.status, r.start, r.body)
    assert r.json() == {"calls": 1, "total": 7}
    assert {"boot", "load", "start"} <= set(r.timings), r.timings
    assert metric(torpord, "torpor_restore_fallbacks_total", function="steady") == before + 1
    assert "restoring the function snapshot failed; booting an instance instead" in torpord.log_text()
    # The booted instance serves on, warm.
    warm = torpord.invoke("steady", {"add": 1})
    assert warm.status == 200 and warm.start == "warm" and warm.json() == {"calls": 2, "total": 8}

    # Each cold start tries the restore again until 3 in a row failed; then it boots at once.
    def cold_start() -> Answer:
        init = the_instance(torpord)["pid"]
        kill_tree(init)
        deadline = time.monotonic() + 10
        while torpord.instances("steady"):
            assert time.monotonic() < deadline, "the killed instance was not removed"
            time.sleep(0.05)
        r = torpord.invoke("steady", {})
        assert r.status == 200 and r.start == "booted", (r.status, r.body)
        return r

    failed = "restoring the function snapshot failed"
    cold_start()
    cold_start()
    log = torpord.log.read_text(errors="replace")
    assert log.count(failed) == 3, log.count(failed)
    assert "3 restores in a row failed" in log
    cold_start()
    assert torpord.log.read_text(errors="replace").count(failed) == 3, "a restore was tried during the pause"
    assert metric(torpord, "torpor_restore_fallbacks_total", function="steady") == before + 4
    kill_tree(the_instance(torpord)["pid"])
