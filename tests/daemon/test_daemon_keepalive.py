"""Keep-alive stages and daemon restarts through the real daemon, real workers and real CRIU.

tests/daemon/functions/sleepy steps down after 1/2/4 s idle (gpu_release_s, hibernate_s,
evict_s). It is a CPU function, so it skips gpu_released: warm → hibernated → evicted. Its call
count lives in the worker's memory, so an instance woken from hibernation goes on counting,
while one restored from the function snapshot starts again at 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Any

from conftest import alive, pids_with

from .conftest import FUNCTIONS, Torpord

SLEEPY = FUNCTIONS / "sleepy"


def wait_stage(torpord: Torpord, stage: str, timeout: float = 30.0) -> tuple[dict[str, Any], set[str]]:
    """Polls the function's one instance until it is in `stage`; returns it and every stage seen."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        instances = torpord.instances("sleepy")
        assert len(instances) <= 1, instances
        if instances:
            seen.add(instances[0]["stage"])
            if instances[0]["stage"] == stage:
                return instances[0], seen
        assert time.monotonic() < deadline, f"no {stage} instance within {timeout} s: {instances}\n{torpord.log_text()}"
        time.sleep(0.05)


def metric(torpord: Torpord, name: str, **labels: str) -> float:
    text = torpord.request("GET", "/metrics").body.decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{{{want}}} not in /metrics:\n{text}"
    return float(m.group(1))


def hibernation_dirs(torpord: Torpord) -> list[str]:
    return sorted(p.name for p in (torpord.state / "snapshots").glob("hib-sleepy-*"))


def test_an_idle_cpu_instance_hibernates_then_is_evicted_and_wakes_with_its_memory(torpord: Torpord) -> None:
    torpord.deploy(SLEEPY)
    first = torpord.invoke("sleepy", {"add": 1})
    assert first.status == 200 and first.start == "restored", (first.status, first.body)
    assert first.json() == {"calls": 1, "total": 1}
    warm = torpord.invoke("sleepy", {"add": 2})
    assert warm.start == "warm" and warm.json() == {"calls": 2, "total": 3}

    inst, seen = wait_stage(torpord, "hibernated")
    assert "gpu_released" not in seen, seen  # a CPU function skips that stage
    assert inst["pid"] is None, inst
    assert len(hibernation_dirs(torpord)) == 1
    assert metric(torpord, "torpor_instances", stage="hibernated") == 1
    assert metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="warm") >= 1.5
    assert metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="gpu_released") == 0
    for stage in ("starting", "warm", "hibernating", "hibernated"):
        # No NVML on this machine and a CPU function: nothing to charge in any stage.
        assert metric(torpord, "torpor_gpu_memory_byte_seconds_total", function="sleepy", stage=stage) == 0
    # Its restore was metered as starting; its snapshot as hibernating.
    assert metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="starting") > 0
    assert metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="hibernating") > 0

    # Woken from its hibernation snapshot: "restored", and its memory came back with it.
    woken = torpord.invoke("sleepy", {"add": 3})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body)
    assert woken.json() == {"calls": 3, "total": 6}
    assert "restore" in woken.timings, woken.timings
    instances = torpord.instances("sleepy")
    assert [i["stage"] for i in instances] == ["warm"] and instances[0]["id"] == inst["id"], instances
    # The snapshot served; it is removed once the request is on its way.
    deadline = time.monotonic() + 10
    while hibernation_dirs(torpord):
        assert time.monotonic() < deadline, hibernation_dirs(torpord)
        time.sleep(0.05)

    # Through hibernated to evicted, then back from cold storage.
    _, seen = wait_stage(torpord, "evicted")
    assert "hibernated" in seen or metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="hibernated") > 0
    assert metric(torpord, "torpor_instances", stage="evicted") == 1
    cold = torpord.invoke("sleepy", {"add": 4})
    assert cold.status == 200 and cold.start == "restored", (cold.status, cold.body)
    assert cold.json() == {"calls": 4, "total": 10}
    assert metric(torpord, "torpor_instance_stage_seconds_total", function="sleepy", stage="evicted") > 0


def test_a_daemon_killed_and_started_again_keeps_functions_and_hibernated_instances(torpord: Torpord) -> None:
    # The instance of the test before hibernates; then the daemon dies without cleaning up.
    wait_stage(torpord, "hibernated")
    torpord.proc.send_signal(signal.SIGKILL)
    torpord.proc.wait()
    again = Torpord.restart(torpord)
    listed = {f["name"] for f in again.request("GET", "/v1/functions").json()["functions"]}
    assert "sleepy" in listed, listed
    assert [i["stage"] for i in again.instances("sleepy")] in (["hibernated"], ["evicted"])
    woken = again.invoke("sleepy", {"add": 5})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body)
    assert woken.json() == {"calls": 5, "total": 15}

    # A warm instance outlives its daemon: its worker reconnects, the new daemon re-adopts it
    # (same process, same memory), and a graceful stop then stops it.
    init = again.instances("sleepy")[0]["pid"]
    again.wait_pages_in()  # woken with lazy pages: re-adopted only once they are all in
    again.proc.send_signal(signal.SIGKILL)
    again.proc.wait()
    third = Torpord.restart(again)
    deadline = time.monotonic() + 15
    while "re-adopted an instance" not in third.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the warm instance was not re-adopted\n{third.log_text()}"
        time.sleep(0.05)
    kept = third.invoke("sleepy", {"add": 1})
    assert kept.status == 200 and kept.start == "warm", (kept.status, kept.body)
    assert kept.json() == {"calls": 6, "total": 16}
    assert [i["pid"] for i in third.instances("sleepy")] == [init]
    assert os.path.isdir(third.state / "snapshots")
    third.proc.send_signal(signal.SIGTERM)
    third.proc.wait(timeout=20)
    deadline = time.monotonic() + 5
    while alive(init):
        assert time.monotonic() < deadline, f"instance {init} outlived a graceful stop"
        time.sleep(0.05)
    fourth = Torpord.restart(third)
    assert fourth.instances("sleepy") == []
    fresh = fourth.invoke("sleepy", {"add": 1})
    assert fresh.status == 200 and fresh.start == "restored", fresh.body
    assert fresh.json() == {"calls": 1, "total": 1}


def test_a_redeploy_discards_the_hibernated_instances_of_the_old_one(torpord: Torpord) -> None:
    wait_stage(torpord, "hibernated")
    torpord.deploy(SLEEPY)
    assert torpord.instances("sleepy") == []
    assert hibernation_dirs(torpord) == []
    fresh = torpord.invoke("sleepy", {"add": 7})
    assert fresh.status == 200 and fresh.start == "restored", fresh.body
    assert fresh.json() == {"calls": 1, "total": 7}  # from the new function snapshot


def test_logs_show_the_workers_output_and_rm_removes_everything(torpord: Torpord) -> None:
    r = torpord.cli("logs", "sleepy", "--lines", "50")
    assert r.returncode == 0, r.stderr
    assert "sleepy call 1" in r.stdout, r.stdout
    r = torpord.cli("logs", "sleepy", "--json")
    assert r.returncode == 0, r.stderr
    files = json.loads(r.stdout)["files"]
    # Every restored or woken instance writes its own file under logs/sleepy/.
    assert any(f["instance"] for f in files), files
    assert all(f["path"].startswith(f"{torpord.state}/logs/sleepy/") for f in files), files
    assert torpord.request("GET", "/v1/functions/sleepy/logs?lines=0").status == 400
    assert torpord.request("GET", "/v1/functions/nope/logs").status == 404

    r = torpord.cli("rm", "sleepy")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert r.stdout.startswith("deleted sleepy"), r.stdout
    assert torpord.request("GET", "/v1/functions/sleepy").status == 404
    assert not list((torpord.state / "snapshots").glob("fn-sleepy-*"))
    assert not (torpord.state / "logs" / "sleepy").exists()
    # A hibernation under way when the function went is undone by its own task.
    deadline = time.monotonic() + 30
    while pids_with(f"{torpord.state}/") or hibernation_dirs(torpord):
        assert time.monotonic() < deadline, (pids_with(f"{torpord.state}/"), hibernation_dirs(torpord))
        time.sleep(0.05)
    r = torpord.cli("rm", "sleepy")
    assert r.returncode != 0 and "no function named" in r.stderr, (r.stdout, r.stderr)
