"""Concurrent hibernation of split instances (issue 10 item 1; docs/checkpoints.md), through
the real daemon, real workers with the hook, the host backend and real CRIU.

The daemon pre-copies an idle instance's writable segments while it still serves, then
hibernates it: in the stop, read-only segments keep their recipes unread and each pre-copied
segment is hashed block by block, the blocks that changed since the pre-copy copied again.
`TORPORD_DELAY` (crates/torpord/src/journal.rs) widens the windows a test must hit: the
pre-copy's (a request writes after the copy was read) and the stop's (a request arrives while
the instance is quiesced).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import Torpord
from .test_daemon_split import expected_sha, snapshot_line, twin

KEEPALIVE = "\n[keepalive]\ngpu_release_s = 1\nhibernate_s = 1\nevict_s = 600\n"


def sleepy(tmp_path: Path, name: str) -> Path:
    """splitbuf, one instance at most, hibernating after 1 s idle."""
    fdir = twin(tmp_path, name)
    toml = fdir / "torpor.toml"
    text = toml.read_text().replace("max_instances = 2", "max_instances = 1")
    toml.write_text(text + KEEPALIVE)
    return fdir


def daemon(torpor_bin: Path, tmp_path: Path, env: dict[str, str], config: str = "") -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    # A request waits through a hibernation's stop: the queue must outlast it.
    return Torpord(torpor_bin, root, env=env, config=config, queue_timeout_s=30)


def full_log(d: Torpord) -> str:
    return d.log.read_text(errors="replace")


def wait_log(d: Torpord, pattern: str, timeout: float = 30) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, full_log(d))
        if m:
            return m
        assert time.monotonic() < deadline, f"no {pattern!r} in the log\n{d.log_text()}"
        time.sleep(0.05)


def wait_hibernated(d: Torpord, name: str) -> None:
    deadline = time.monotonic() + 30
    while [i["stage"] for i in d.instances(name)] != ["hibernated"]:
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)


def stop_lines(d: Torpord) -> list[dict[str, Any]]:
    """The `hibernation stop` lines: stop_s, concurrent and the stop's delta (it is logged just
    after the registry shows the instance hibernated: wait for it)."""
    wait_log(d, "hibernation stop")
    out = []
    for line in full_log(d).splitlines():
        if "hibernation stop" not in line:
            continue
        stop = re.search(r"stop_s=([0-9.e-]+)", line)
        conc = re.search(r"concurrent=(true|false)", line)
        delta = re.search(r"delta=(\{.*?\})", line)
        assert stop and conc, line
        out.append(
            {
                "stop_s": float(stop.group(1)),
                "concurrent": conc.group(1) == "true",
                "delta": json.loads(delta.group(1)) if delta else None,
            }
        )
    return out


@pytest.fixture
def precopy_window(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    d = daemon(torpor_bin, tmp_path, {"TORPORD_DELAY": "precopy:3000"})
    try:
        yield d
    finally:
        d.stop()


def test_a_write_during_the_pre_copy_is_caught_in_the_stop_and_copied_again(
    precopy_window: Torpord, tmp_path: Path
) -> None:
    d = precopy_window
    snap = snapshot_line(d.deploy(sleepy(tmp_path, "splitbuf-conc")))
    # The deploy's function snapshot: the read-only probe's read was the pre-copy; its capture
    # copied only the scratch block the warm-up request wrote.
    assert snap["split"] and snap["concurrent"], snap
    assert snap["changed_blocks"] == 1 and snap["changed_bytes"] == 2 * 4096, snap
    assert snap["readonly_segments"] == 2, snap
    first = d.invoke("splitbuf-conc", {"op": "compute", "x": 7})
    assert first.status == 200, first.body
    assert first.json()["sha"] == expected_sha(7)
    # The deploy's warm-up requests ran in the snapshotted process too.
    calls = first.json()["calls"]
    # Idle for hibernate_s: the pre-copy reads the segments (scratch holds 1), then waits.
    wait_log(d, r"TORPORD_DELAY delays this point.*precopy|point=\"?precopy")
    # Still warm and serving during the pre-copy: this request writes 2 into the scratch
    # segment after the pre-copy read it.
    during = d.invoke("splitbuf-conc", {"op": "compute", "x": 7})
    assert during.status == 200 and during.start == "warm", (during.status, during.start, during.body)
    assert during.json()["calls"] == calls + 1
    wait_hibernated(d, "splitbuf-conc")
    (stop,) = stop_lines(d)
    assert stop["concurrent"], stop
    delta = stop["delta"]
    # weights (read-only by the probe) and table (declared) kept unread; scratch pre-copied,
    # its changed block found and copied again in the stop.
    assert delta["read_only_kept"] == 2, delta
    assert delta["pre_copied"] == 1 and delta["copied_in_stop"] == 0, delta
    assert delta["changed_blocks"] == 1 and delta["changed_bytes"] == 2 * 4096, delta
    # Woken: the scratch holds what the request during the pre-copy wrote, not what the
    # pre-copy read; the outputs are those of the process before.
    peek = d.invoke("splitbuf-conc", {"op": "peek"})
    assert peek.status == 200 and peek.start == "restored", (peek.status, peek.start, peek.body)
    assert peek.json() == {"scratch": calls + 1, "calls": calls + 1}
    after = d.invoke("splitbuf-conc", {"op": "compute", "x": 7}).json()
    assert after == {"sha": expected_sha(7), "calls": calls + 2}
    metrics = d.request("GET", "/metrics").body.decode()
    assert re.search(r'torpor_phase_duration_seconds_count\{function="splitbuf-conc",phase="hibernation_stop"\} 1', metrics)
    assert re.search(r'torpor_phase_duration_seconds_count\{function="splitbuf-conc",phase="hibernation_precopy"\} 1', metrics)


@pytest.fixture
def stop_window(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    d = daemon(torpor_bin, tmp_path, {"TORPORD_DELAY": "hibernate-stop:2000"})
    try:
        yield d
    finally:
        d.stop()


def test_a_request_during_the_stop_waits_and_is_answered_by_the_woken_instance(
    stop_window: Torpord, tmp_path: Path
) -> None:
    d = stop_window
    d.deploy(sleepy(tmp_path, "splitbuf-stop"))
    first = d.invoke("splitbuf-stop", {"op": "compute", "x": 5}).json()
    assert first["sha"] == expected_sha(5)
    wait_log(d, r"TORPORD_DELAY delays this point.*hibernate-stop|point=\"?hibernate-stop")
    t0 = time.monotonic()
    during = d.invoke("splitbuf-stop", {"op": "compute", "x": 5})
    waited = time.monotonic() - t0
    assert during.status == 200, (during.status, during.body, d.log_text())
    # It waited for the stop and then woke the hibernated instance: the same process state.
    assert during.start == "restored", during.start
    assert during.json() == {"sha": expected_sha(5), "calls": first["calls"] + 1}
    assert waited > 0.5, waited
    (stop,) = stop_lines(d)
    assert stop["concurrent"] and stop["stop_s"] >= 2.0, stop
    # The unchanged scratch (no request between pre-copy and stop) is not copied again.
    assert stop["delta"]["changed_blocks"] == 0 and stop["delta"]["pre_copied"] == 1, stop


@pytest.fixture
def stop_the_world(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    d = daemon(torpor_bin, tmp_path, {}, config="[restore_server]\nconcurrent_snapshot = false\n")
    try:
        yield d
    finally:
        d.stop()


def test_concurrent_snapshot_false_captures_everything_in_the_stop(stop_the_world: Torpord, tmp_path: Path) -> None:
    d = stop_the_world
    snap = snapshot_line(d.deploy(sleepy(tmp_path, "splitbuf-stw")))
    assert snap["split"] and not snap["concurrent"] and "changed_blocks" not in snap, snap
    assert snap["readonly_segments"] == 2, snap
    calls = d.invoke("splitbuf-stw", {"op": "compute", "x": 4}).json()["calls"]
    wait_hibernated(d, "splitbuf-stw")
    (stop,) = stop_lines(d)
    assert not stop["concurrent"] and stop["delta"] is None, stop
    assert "pre-copied" not in full_log(d)
    woken = d.invoke("splitbuf-stw", {"op": "peek"})
    assert woken.start == "restored" and woken.json() == {"scratch": calls, "calls": calls}, woken.body
