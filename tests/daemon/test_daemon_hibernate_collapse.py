"""Before a hibernation, the idle worker's fully written 2 MiB ranges of private memory become
huge pages (`restore_server.hibernate_collapse`, torpor_snapshot::huge_collapse;
docs/checkpoints.md, "Huge pages before the stop"), so that CRIU's dump in the stop drains 2 MiB
at a time. Real daemon, worker and CRIU.

The function is tests/daemon/functions/sleepy with 48 MiB of written memory of its own: its
checksum and its call count must come back with the woken instance, and the daemon's log says
how much it gathered (none with the setting off).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import FUNCTIONS, Torpord

HANDLER = '''
"""Sleepy, holding 48 MiB it wrote: {"add": n} -> calls, total and the memory's checksum."""

from __future__ import annotations

import hashlib
from typing import Any

import torpor


@torpor.function
class HeavySleepy:
    def setup(self) -> None:
        self.calls = 0
        self.total = 0
        self.held = bytearray(i % 251 for i in range(1 << 20)) * 48

    def __call__(self, request: Any) -> Any:
        self.calls += 1
        self.total += int((request or {}).get("add", 0))
        return {"calls": self.calls, "total": self.total, "held": hashlib.sha256(self.held).hexdigest()}
'''


def heavy_sleepy(root: Path) -> Path:
    d = root / "heavy-sleepy"
    shutil.copytree(FUNCTIONS / "sleepy", d, ignore=shutil.ignore_patterns("__pycache__"))
    (d / "handler.py").write_text(HANDLER)
    toml = d / "torpor.toml"
    text = toml.read_text().replace('name = "sleepy"', 'name = "heavy-sleepy"')
    text = text.replace('entry = "handler:Sleepy"', 'entry = "handler:HeavySleepy"')
    toml.write_text(text.replace("evict_s = 4", "evict_s = 600"))
    return d


@pytest.fixture(params=[True, False], ids=["collapse", "no-collapse"])
def daemon(torpor_bin: Path, criu_ready: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Torpord, bool]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this kernel")
    on = bool(request.param)
    d = Torpord(torpor_bin, tmp_path / "torpord", config=f"[restore_server]\nhibernate_collapse = {'true' if on else 'false'}\n")
    try:
        d.deploy(heavy_sleepy(tmp_path))
        yield d, on
    finally:
        d.stop()


def gathered(d: Torpord) -> list[dict[str, float]]:
    """The daemon's `memory gathered into huge pages` lines, their numbers."""
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        if "memory gathered into huge pages" in line:
            out.append({k: float(v) for k, v in re.findall(r"\b(ranges|bytes|refused|seconds)=([0-9.]+)", line)})
    return out


def test_an_idle_workers_memory_becomes_huge_pages_before_its_hibernation_and_comes_back_whole(daemon: tuple[Torpord, bool]) -> None:
    d, on = daemon
    first = d.invoke("heavy-sleepy", {"add": 1})
    assert first.status == 200, first.body
    held = first.json()["held"]
    deadline = time.monotonic() + 30
    while [i["stage"] for i in d.instances("heavy-sleepy")] != ["hibernated"]:
        assert time.monotonic() < deadline, f"no hibernation within 30 s\n{d.log_text()}"
        time.sleep(0.05)

    lines = gathered(d)
    if on:
        assert len(lines) == 1, d.log_text()
        # 48 MiB written in one buffer: at least 46 MiB of it in whole, aligned 2 MiB ranges.
        assert lines[0]["bytes"] >= 46 << 20, lines
        assert lines[0]["refused"] == 0, lines
        text = d.log.read_text(errors="replace")
        assert text.index("memory gathered into huge pages") < text.index("hibernation stop"), d.log_text()
    else:
        assert lines == [], lines

    woken = d.invoke("heavy-sleepy", {"add": 2})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body)
    assert woken.json() == {"calls": 2, "total": 3, "held": held}, woken.body
    metrics = d.request("GET", "/metrics").body.decode()
    phase = 'torpor_phase_duration_seconds_count{function="heavy-sleepy",phase="hibernation_collapse"}'
    assert (phase in metrics) == on, json.dumps([m for m in metrics.splitlines() if "hibernation" in m])
