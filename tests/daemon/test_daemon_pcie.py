"""The fair PCIe scheduler (crates/torpord/src/split/pcie.rs, docs/sandboxes.md "Fair PCIe")
through the real daemon, real workers and real CRIU, on the host backend.

A large function (one writable 512 MiB segment) and a small one (4 MiB) are deployed on the
split path; both are restored once so that their segments are in the restore server's host
cache (the GPU cache is off, so every cold restore copies the segment host→device through the
scheduler). Then the large one is restored and, while its fill is copying, the small one: with
the scheduler the small fill waits at most one piece of the large one; without it
(`[pcie] fair = false`) it waits for the large copy to end. Each transfer's wait is the
daemon's own `pcie transfer` debug line.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord

PCIEBUF = FUNCTIONS / "pciebuf"
# 1 GiB: on the GPU machine's 16 cores 512 MiB were copied (0.45 s) before the small function's
# CRIU restore reached its fill, so nothing overlapped; `small_during_large` checks that it did.
LARGE = 1 << 30
SMALL = 4 << 20


def function(tmp_path: Path, name: str, size: int) -> Path:
    """A copy of pciebuf named `name` whose segment holds `size` bytes."""
    d = tmp_path / name
    shutil.copytree(PCIEBUF, d)
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "pciebuf"', f'name = "{name}"'))
    (d / "size.txt").write_text(str(size))
    return d


def daemon(torpor_bin: Path, tmp_path: Path, fair: bool) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    config = (
        'log_level = "debug"\nlog_format = "json"\n'
        "[restore_server]\ngpu_cache_bytes = 0\n"
        f"[pcie]\nfair = {str(fair).lower()}\nblock_bytes = 2097152\n"
    )
    return Torpord(torpor_bin, root, config=config)


def cold(d: Torpord, name: str, size: int) -> Any:
    a = d.invoke(name, {})
    assert a.status == 200 and a.start == "restored", (a.status, a.body, d.log_text()[-3000:])
    assert a.json()["size"] == size
    return a


def transfers(d: Torpord) -> list[dict[str, Any]]:
    """The daemon's `pcie transfer` lines, in order."""
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        if '"pcie transfer"' in line:
            out.append(json.loads(line))
    return out


def ended(line: dict[str, Any]) -> float:
    """When a transfer ended: its line's time, in seconds."""
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


def arrived(line: dict[str, Any]) -> float:
    """When a transfer arrived at the scheduler: its end less its whole time."""
    return ended(line) - float(line["s"])


def active(d: Torpord) -> int:
    text = d.request("GET", "/metrics").body.decode()
    line = 'torpor_pcie_transfers{device="host"} '
    found = [x for x in text.splitlines() if x.startswith(line)]
    return int(float(found[0].split()[-1])) if found else 0


def small_during_large(d: Torpord, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores the large function and, once its transfer is under way, the small one; returns
    the two transfers' lines (large, small)."""
    d.deploy(function(tmp_path, "large", LARGE))
    d.deploy(function(tmp_path, "small", SMALL))
    for name, size in [("large", LARGE), ("small", SMALL)]:
        cold(d, name, size)  # from the store: now in the host cache
        d.stop_instances(name)
    answers: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answers.update(large=cold(d, "large", LARGE)))
    t.start()
    deadline = time.monotonic() + 30
    while active(d) < 1:
        assert time.monotonic() < deadline, "the large fill never started"
        time.sleep(0.002)
    sent = time.time()
    small_answer = cold(d, "small", SMALL)
    t.join()
    assert "large" in answers
    # Two transfers of each (the first restore's and this one's); the log is written behind.
    deadline = time.monotonic() + 10
    while True:
        lines = transfers(d)
        larges = [x for x in lines if x["bytes"] == LARGE]
        smalls = [x for x in lines if x["bytes"] == SMALL]
        if len(larges) == 2 and len(smalls) == 2:
            break
        assert time.monotonic() < deadline, [x["bytes"] for x in lines]
        time.sleep(0.05)
    large, small = larges[-1], smalls[-1]
    assert large["ok"] and small["ok"], lines
    # For the overlap check's message: when the small request went out, and its phases.
    small["request_sent"] = sent
    small["request_timings"] = small_answer.timings
    # And the fill path's own lines of this pair of restores (when each fill thread started,
    # made and mapped its memory, and ended), for a small fill that reached the scheduler late.
    steps = [x for x in debug_lines(d) if x.get("message") in FILL_STEPS]
    small["fill_steps"] = [{k: v for k, v in x.items() if k not in ("level", "target")} for x in steps[-8:]]
    return large, small


FILL_STEPS = (
    "segment fills started",
    "device fill: memory made and mapped",
    "device fill: memory made, written unmapped",
    "segment filled",
)


def debug_lines(d: Torpord) -> list[dict[str, Any]]:
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def test_a_small_fill_is_not_stuck_behind_a_large_one(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    d = daemon(torpor_bin, tmp_path, fair=True)
    try:
        large, small = small_during_large(d, tmp_path)
    finally:
        d.stop()
    assert large["fair"] and small["fair"]
    # The comparison means something only if the small fill arrived before the large one ended
    # (without the scheduler the small one waits outside its transfer line: no such check there).
    assert arrived(small) < ended(large), (
        f"the small fill arrived {arrived(small) - ended(large):.3f} s after the large copy ended: "
        "nothing to schedule (the large copy is too short for this machine: raise LARGE): "
        + json.dumps([large, small])
    )
    # It arrived while the large copy was under way, waited for at most the piece the large one
    # was copying (64 MiB while it was alone, `solo_bytes`), and was done long before it.
    assert small["waited_s"] < 0.25 * large["s"], json.dumps([large, small])
    assert ended(small) < ended(large) - 0.25 * large["s"], json.dumps([large, small])


def test_without_the_scheduler_the_small_fill_waits_for_the_large_copy(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """The benchmark's "without it" side, and the proof that the test above can fail."""
    d = daemon(torpor_bin, tmp_path, fair=False)
    try:
        large, small = small_during_large(d, tmp_path)
    finally:
        d.stop()
    assert not large["fair"] and not small["fair"]
    # It ended with the large copy, not before: on the host backend the wait is partly outside
    # the transfer (the device's bookkeeping of its mappings is locked while a copy runs, as the
    # cuda backend's one copy engine is), so the ends are compared. Both lines are written as
    # that lock is let go, in either order (CI once saw the small one's first, 0.4 ms ahead):
    # 5 % of the large copy's time is the margin, against the 25 % the test above asks.
    assert ended(small) > ended(large) - 0.05 * large["s"], json.dumps([large, small])
