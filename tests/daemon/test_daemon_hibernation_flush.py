"""A hibernation's snapshot is sealed in the instance's stop from the page cache and flushed to
disk after it (torpor_image::Durability::Deferred; docs/checkpoints.md, "The hibernation's
flush"): the daemon says so once it is on disk, after the instance hibernated; a daemon killed
before the flush loses nothing (the kernel still has the pages); a torn snapshot, what a machine
crash before the flush can leave, is refused by the wake's hashes and the request is served by a
cold start instead.

tests/daemon/functions/sleepy counts its calls in the worker's memory, so a woken instance goes
on counting and a cold-started one starts again at 1. Here it never reaches eviction.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import FUNCTIONS, Torpord

HELD_MS = 60_000


def sleepy_without_eviction(root: Path) -> Path:
    d = root / "sleepy"
    shutil.copytree(FUNCTIONS / "sleepy", d, ignore=shutil.ignore_patterns("__pycache__"))
    toml = d / "torpor.toml"
    toml.write_text(toml.read_text().replace("evict_s = 4", "evict_s = 600"))
    return d


@pytest.fixture
def daemon(torpor_bin: Path, criu_ready: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path / "torpord", env=getattr(request, "param", {}))
    try:
        d.deploy(sleepy_without_eviction(tmp_path))
        yield d
    finally:
        d.stop()


def hibernate(d: Torpord) -> None:
    first = d.invoke("sleepy", {"add": 1})
    assert first.status == 200 and first.json() == {"calls": 1, "total": 1}, first.body
    second = d.invoke("sleepy", {"add": 2})
    assert second.status == 200 and second.json() == {"calls": 2, "total": 3}, second.body
    deadline = time.monotonic() + 30
    while [i["stage"] for i in d.instances("sleepy")] != ["hibernated"]:
        assert time.monotonic() < deadline, f"no hibernation within 30 s\n{d.log_text()}"
        time.sleep(0.05)


def log_has(d: Torpord, text: str) -> bool:
    return text in d.log.read_text(errors="replace")


@pytest.mark.parametrize("daemon", [{"TORPORD_DELAY": f"hibernate-flush:{HELD_MS}"}], indirect=True)
def test_a_daemon_killed_before_the_hibernation_is_flushed_wakes_the_instance_with_its_memory(daemon: Torpord) -> None:
    hibernate(daemon)
    # The stage turns before the line is written (the journal's end comes between).
    deadline = time.monotonic() + 10
    while not log_has(daemon, "instance hibernated"):
        assert time.monotonic() < deadline, daemon.log_text()
        time.sleep(0.05)
    # The flush is held: recorded and sealed, not yet said to be on disk.
    assert not log_has(daemon, "hibernation snapshot on disk"), daemon.log_text()
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.env = {}
    again = daemon.restart()
    woken = again.invoke("sleepy", {"add": 3})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body)
    assert woken.json() == {"calls": 3, "total": 6}, "the instance was not woken from its hibernation"


def test_the_hibernation_is_flushed_after_it_and_a_torn_snapshot_is_refused_by_the_wake(daemon: Torpord) -> None:
    hibernate(daemon)
    deadline = time.monotonic() + 30
    while not log_has(daemon, "hibernation snapshot on disk"):
        assert time.monotonic() < deadline, f"the hibernation snapshot was never flushed\n{daemon.log_text()}"
        time.sleep(0.05)
    text = daemon.log.read_text(errors="replace")
    assert text.index("instance hibernated") < text.index("hibernation snapshot on disk"), text[-4000:]
    # What a machine crash before the flush could leave: the image's largest file short.
    (hib,) = (daemon.state / "snapshots").glob("hib-sleepy-*")
    largest = max((p for p in hib.iterdir() if p.suffix == ".img"), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    served = daemon.invoke("sleepy", {"add": 5})
    assert served.status == 200 and served.start == "restored", (served.status, served.body)
    assert served.json() == {"calls": 1, "total": 5}, "a torn hibernation snapshot was woken"
    assert log_has(daemon, "cannot wake the hibernated instance"), daemon.log_text()


FROZEN = '''
import gc

import torpor


@torpor.function
class Frozen:
    def setup(self) -> None:
        self.calls = 0
        self.model = [{"weights": list(range(100))} for _ in range(20_000)]

    def __call__(self, request):
        self.calls += 1
        return {"calls": self.calls, "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())}
'''


def test_the_quiet_point_freezes_what_lives_so_the_next_one_collects_only_what_came_since(daemon: Torpord, tmp_path: Path) -> None:
    """torpor.worker's quiet point: gc.collect() then gc.freeze(), so a hibernation's stop does
    not walk the whole heap again (0.25 s for GPT-2-Large on the H100)."""
    fn = tmp_path / "frozen"
    fn.mkdir()
    (fn / "handler.py").write_text(FROZEN)
    (fn / "torpor.toml").write_text(
        'name = "frozen"\nentry = "handler:Frozen"\n[scaling]\nmax_instances = 1\n'
        "[keepalive]\ngpu_release_s = 1\nhibernate_s = 2\nevict_s = 600\n"
    )
    daemon.deploy(fn)
    first = daemon.invoke("frozen", {})
    assert first.status == 200 and first.start == "restored", first.body
    at_deploy = first.json()
    # Restored from the deploy's snapshot: its quiet point froze setup()'s 20 000 dicts and lists.
    assert at_deploy["frozen"] > 40_000 and at_deploy["tracked"] < at_deploy["frozen"], at_deploy
    deadline = time.monotonic() + 30
    while [i["stage"] for i in daemon.instances("frozen")] != ["hibernated"]:
        assert time.monotonic() < deadline, f"no hibernation within 30 s\n{daemon.log_text()}"
        time.sleep(0.05)
    woken = daemon.invoke("frozen", {})
    assert woken.status == 200 and woken.json()["calls"] == 2, woken.body
    assert woken.json()["frozen"] >= at_deploy["frozen"], woken.json()
