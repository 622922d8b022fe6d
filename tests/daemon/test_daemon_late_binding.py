"""Late binding of requests to instances (crates/torpord/src/runtime/pool.rs): a request that
started an instance is served by whichever is ready first, its own start or an instance another
request leaves idle meanwhile; the start it leaves goes on and joins the pool idle. Through the
real daemon, workers and CRIU, on tests/daemon/functions/echoer (two instances, one request each).

`TORPORD_DELAY=restored:<ms>` holds every restore after CRIU (crate::journal), so a busy instance
frees up long before a new one could be ready.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Answer, Torpord, daemon_processes

# Every restore held this long: far longer than the busy request below.
RESTORE_HOLD_MS = 6000
BUSY_S = 1.5


@pytest.fixture
def daemon(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path / "d", env={"TORPORD_DELAY": f"restored:{RESTORE_HOLD_MS}"}, queue_timeout_s=60)
    try:
        yield d
    finally:
        d.stop()


def in_thread(d: Torpord, request: dict[str, Any], out: dict[str, Answer], key: str) -> threading.Thread:
    def run() -> None:
        out[key] = d.invoke("echoer", request, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t


def live(d: Torpord) -> list[dict[str, Any]]:
    return [i for i in d.instances("echoer") if i.get("pid") and i["stage"] == "warm"]


def test_a_request_that_started_an_instance_takes_one_that_frees_up_first_and_its_start_joins_idle(
    daemon: Torpord, tmp_path: Path
) -> None:
    fdir = tmp_path / "echoer"
    shutil.copytree(FUNCTIONS / "echoer", fdir)
    daemon.deploy(fdir)
    first = daemon.invoke("echoer", {"say": "first"}, timeout=120)
    assert first.status == 200, first.body
    [one] = live(daemon)

    out: dict[str, Answer] = {}
    busy = in_thread(daemon, {"say": "busy", "sleep": BUSY_S}, out, "busy")
    time.sleep(0.3)
    t0 = time.monotonic()
    late = in_thread(daemon, {"say": "late"}, out, "late")
    late.join(timeout=120)
    waited = time.monotonic() - t0
    busy.join(timeout=120)
    assert out["busy"].status == 200 and out["late"].status == 200, (out["busy"].body, out["late"].body)
    # Served by the busy instance once it freed up, not by the restore it started (held 6 s).
    assert out["late"].start == "warm", (out["late"].start, out["late"].headers.get("x-torpor-timings"))
    assert out["late"].json() == {"said": "late"}
    assert waited < RESTORE_HOLD_MS / 1000 - 1, f"the request waited {waited:.2f} s: for its own restore?\n{daemon.log_text()}"

    # The start it left came up and joined the pool idle: two instances, each takes a request.
    deadline = time.monotonic() + 60
    while len(live(daemon)) < 2:
        assert time.monotonic() < deadline, f"the left start never joined: {daemon.instances('echoer')}\n{daemon.log_text()}"
        time.sleep(0.1)
    assert one["id"] in {i["id"] for i in live(daemon)}
    both: dict[str, Answer] = {}
    t0 = time.monotonic()
    threads = [in_thread(daemon, {"say": k, "sleep": BUSY_S}, both, k) for k in ("a", "b")]
    for t in threads:
        t.join(timeout=120)
    took = time.monotonic() - t0
    assert [both[k].status for k in ("a", "b")] == [200, 200], [both[k].body for k in ("a", "b")]
    assert {both[k].start for k in ("a", "b")} == {"warm"}
    # Side by side (each instance idle, its count given back), not one after the other.
    assert took < 2 * BUSY_S, f"two requests took {took:.2f} s on two idle instances\n{daemon.log_text()}"
    assert len(live(daemon)) == 2 and len(daemon.instances("echoer")) == 2


def test_a_graceful_stop_stops_the_start_a_request_left_behind(daemon: Torpord, tmp_path: Path) -> None:
    """The start a request left (it was answered by an instance that freed up first) is still
    restoring when the daemon is told to stop: the stop waits for it, and it stops its instance
    as it ends, so no process of the daemon's outlives it (before, its tree joined no pool and
    its worker waited for a daemon for its reattach_s)."""
    fdir = tmp_path / "echoer"
    shutil.copytree(FUNCTIONS / "echoer", fdir)
    daemon.deploy(fdir)
    assert daemon.invoke("echoer", {"say": "first"}, timeout=120).status == 200
    out: dict[str, Answer] = {}
    busy = in_thread(daemon, {"say": "busy", "sleep": BUSY_S}, out, "busy")
    time.sleep(0.3)
    late = in_thread(daemon, {"say": "late"}, out, "late")
    late.join(timeout=120)
    busy.join(timeout=120)
    assert out["late"].status == 200 and out["late"].start == "warm", (out["late"].status, out["late"].body)
    placement = daemon.request("GET", "/v1/functions/echoer/placement").json()
    assert placement["starting"] == 1 and placement["instances"] == 1, placement

    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=RESTORE_HOLD_MS / 1000 + 30) == 0, daemon.log_text()
    deadline = time.monotonic() + 5
    while daemon_processes(daemon.state):
        assert time.monotonic() < deadline, f"processes of the stopped daemon's left: {daemon_processes(daemon.state)}\n{daemon.log_text()}"
        time.sleep(0.05)
    log = daemon.log_text()
    assert "waiting for the starts in flight to end" in log and "stopped: torpord is stopping" in log, log
