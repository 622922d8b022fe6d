"""Standby instances (`[scaling] standby = 1`) through the real daemon, real workers and real
CRIU, on a CPU function: a copy of tests/daemon/functions/sleepy (its call count lives in the
worker's memory, so a standby serves what a fresh restore serves: calls = 1). On a CPU function a
standby is a fully restored idle instance; the GPU variant (restored without the driver restore,
in gpu_released) is tests/daemon/test_daemon_gpu.py's.

One daemon serves the module; the tests build on each other.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

from conftest import alive

from .conftest import FUNCTIONS, Torpord

NAME = "sleepy-standby"


def standby_copy(tmp: Path, extra: str = "") -> Path:
    """sleepy as NAME with two instances, one of them standing by, and a 1 s hibernate_s (which
    an unused standby must ignore)."""
    d = tmp / NAME
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(FUNCTIONS / "sleepy", d)
    (d / "torpor.toml").write_text(
        f'name = "{NAME}"\nentry = "handler:Sleepy"\ntimeout_s = 10\n'
        "[scaling]\nmax_instances = 2\nstandby = 1\n"
        "[keepalive]\ngpu_release_s = 1\nhibernate_s = 1\nevict_s = 30\n" + extra
    )
    return d


def wait_instances(
    torpord: Torpord, want: int, not_ids: frozenset[str] = frozenset(), timeout: float = 30.0
) -> list[dict[str, Any]]:
    """Polls until the function has `want` live instances, none of them in `not_ids`."""
    deadline = time.monotonic() + timeout
    while True:
        live = [i for i in torpord.instances(NAME) if i["stage"] in ("warm", "gpu_released")]
        if len(live) == want and not {i["id"] for i in live} & not_ids:
            return live
        assert time.monotonic() < deadline, f"not {want} new live instances within {timeout} s: {live}\n{torpord.log_text()}"
        time.sleep(0.1)


def standby_gauge(torpord: Torpord) -> float:
    text = torpord.request("GET", "/metrics").body.decode()
    m = re.search(rf'^torpor_standby_instances{{function="{NAME}"}} (\S+)$', text, re.MULTILINE)
    assert m, text
    return float(m.group(1))


def wait_gauge(torpord: Torpord, want: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while standby_gauge(torpord) != want:
        assert time.monotonic() < deadline, f"torpor_standby_instances stays {standby_gauge(torpord)}, not {want}"
        time.sleep(0.1)


def test_a_standby_is_ready_before_the_first_request_and_serves_it(torpord: Torpord, tmp_path: Path) -> None:
    torpord.deploy(standby_copy(tmp_path))
    # Started after the deploy, with no request.
    [standby] = wait_instances(torpord, 1)
    assert standby["stage"] == "warm", standby
    wait_gauge(torpord, 1)
    # Past hibernate_s unused: still the same live process.
    time.sleep(2.5)
    now = [(i["id"], i["stage"]) for i in torpord.instances(NAME)]
    assert now == [(standby["id"], "warm")], now
    assert alive(standby["pid"])

    r = torpord.invoke(NAME, {"add": 2})
    assert r.status == 200 and r.start == "standby", (r.status, r.headers, r.body)
    # What a fresh restore of the function snapshot answers: the standby was never used.
    assert r.json() == {"calls": 1, "total": 2}
    assert "restore" not in r.timings, r.timings
    text = torpord.request("GET", "/metrics").body.decode()
    assert f'torpor_starts_total{{function="{NAME}",kind="standby"}} 1' in text

    # Used, it is an ordinary instance (warm next time); another standby takes its place.
    live = wait_instances(torpord, 2)
    assert standby["id"] in {i["id"] for i in live}
    wait_gauge(torpord, 1)
    again = torpord.invoke(NAME, {"add": 1})
    assert again.start == "warm" and again.json() == {"calls": 2, "total": 3}, (again.start, again.body)

    # The used one hibernates after hibernate_s; the standby stays live.
    deadline = time.monotonic() + 20
    while not any(i["stage"] == "hibernated" for i in torpord.instances(NAME)):
        assert time.monotonic() < deadline, torpord.instances(NAME)
        time.sleep(0.1)
    [left] = [i for i in torpord.instances(NAME) if i["stage"] == "warm"]
    assert left["id"] != standby["id"]


def test_stop_redeploy_and_rm_replace_or_end_the_standbys(torpord: Torpord, tmp_path: Path) -> None:
    [before] = [i for i in torpord.instances(NAME) if i["stage"] == "warm"]
    r = torpord.cli("stop", NAME)
    assert r.returncode == 0 and before["id"] in r.stdout, (r.stdout, r.stderr)
    # The stopped standby goes; the deploy still wants one: a new one comes.
    [after_stop] = wait_instances(torpord, 1, frozenset({before["id"]}))
    assert not alive(before["pid"])

    # A redeploy replaces it from the new snapshot.
    torpord.deploy(standby_copy(tmp_path, extra="# redeployed\n"))
    [after_deploy] = wait_instances(torpord, 1, frozenset({after_stop["id"]}))
    deadline = time.monotonic() + 5
    while alive(after_stop["pid"]):
        assert time.monotonic() < deadline, "the older deploy's standby lives on"
        time.sleep(0.05)
    served = torpord.invoke(NAME, {"add": 5})
    assert served.start == "standby" and served.json() == {"calls": 1, "total": 5}, (served.start, served.body)

    gone = torpord.cli("rm", NAME)
    assert gone.returncode == 0, gone.stderr
    deadline = time.monotonic() + 5
    while alive(after_deploy["pid"]):
        assert time.monotonic() < deadline, "a standby outlived its function"
        time.sleep(0.05)
    # Nothing comes back for a deleted function.
    time.sleep(1)
    assert torpord.request("GET", f"/v1/functions/{NAME}").status == 404
