"""Live migration of a torpord instance between the devices of this node (issue 10 item 3;
docs/migration.md), through the real daemon, a real worker with the hook, real fds and CRIU, on
the host backend with two devices (`restore_server.host_devices = 2`).

The instance's segments are copied to new memory while it serves, then it stops taking
requests, the worker unmaps its segments, the blocks that changed are copied, and the new memory
is mapped at the same addresses: same id, same process, same state, new memory (the memfds
behind its mappings change). `TORPORD_FAULT=migrate:<step>` forces a failure at each step; the
instance must then serve on, on its old device, with its old memory.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord
from .test_daemon_split import expected_sha, twin

TWO_DEVICES = "[restore_server]\nhost_devices = 2\n"


def daemon(torpor_bin: Path, tmp_path: Path, config: str = TWO_DEVICES, env: dict[str, str] | None = None) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    return Torpord(torpor_bin, root, config=config, env=env or {}, queue_timeout_s=30)


def deploy_one(d: Torpord, tmp_path: Path, name: str) -> dict[str, Any]:
    """splitbuf as `name`, one instance at most, never stepped down; serves one request. Returns
    the instance's row (id, pid) and the answer's calls count."""
    fdir = twin(tmp_path, name)
    toml = fdir / "torpor.toml"
    toml.write_text(toml.read_text().replace("max_instances = 2", "max_instances = 1"))
    d.deploy(fdir)
    r = d.invoke(name, {"op": "compute", "x": 9})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
    (inst,) = d.instances(name)
    return {**inst, "calls": r.json()["calls"]}


def migrate(d: Torpord, instance: str, gpu: Any) -> Any:
    return d.request("POST", f"/v1/instances/{instance}/migrate", {"gpu": gpu})


def inodes(d: Torpord, name: str) -> dict[str, int]:
    """The memfd inode behind each segment's mapping in the worker."""
    info = d.invoke(name, {"op": "info"})
    assert info.status == 200, info.body
    return {k: m["inode"] for k, m in info.json()["maps"].items()}


def device_gauge(d: Torpord, metric: str, device: int, want: float) -> None:
    """Waits until /metrics shows `metric{device}` at `want` (the keep-alive ticker sets it)."""
    deadline = time.monotonic() + 5
    while True:
        text = d.request("GET", "/metrics").body.decode()
        m = re.search(rf'^{metric}{{device="{device}"}} (\S+)$', text, re.MULTILINE)
        if m and float(m.group(1)) == want:
            return
        assert time.monotonic() < deadline, f"{metric} for device {device}: {m and m.group(1)}, not {want}"
        time.sleep(0.05)


@pytest.fixture
def two(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Any:
    d = daemon(torpor_bin, tmp_path)
    try:
        yield d
    finally:
        d.stop()


def test_an_instance_moves_to_the_other_device_and_serves_on_with_its_state(two: Torpord, tmp_path: Path) -> None:
    d = two
    inst = deploy_one(d, tmp_path, "splitbuf-mig")
    before = inodes(d, "splitbuf-mig")
    calls = inst["calls"] + 1  # the info request counted
    device_gauge(d, "torpor_device_instances", 0, 1)
    r = migrate(d, inst["id"], 1)
    assert r.status == 200, (r.status, r.body, d.log_text())
    m = r.json()
    assert (m["instance"], m["from"], m["to"], m["model"]) == (inst["id"], 0, 1, "host"), m
    assert m["segments"] == 3 and m["bytes"] == 16 * 4096 + 12288 + 2 * 4096, m
    assert not m["residue_moved"] and 0 < m["stop_s"] < m["total_s"], m
    # No request ran since the pre-copy: nothing changed, nothing copied in the stop.
    assert m["changed_blocks"] == 0, m
    # The same instance, the same process, its state; its segments are new memory.
    (after_row,) = d.instances("splitbuf-mig")
    assert (after_row["id"], after_row["pid"]) == (inst["id"], inst["pid"])
    peek = d.invoke("splitbuf-mig", {"op": "peek"})
    assert peek.status == 200 and peek.start == "warm", (peek.status, peek.start)
    assert peek.json() == {"scratch": calls, "calls": calls}
    r2 = d.invoke("splitbuf-mig", {"op": "compute", "x": 9})
    assert r2.json() == {"sha": expected_sha(9), "calls": calls + 1}
    after = inodes(d, "splitbuf-mig")
    assert all(after[k] != before[k] for k in before), (before, after)
    # The accounting follows it.
    device_gauge(d, "torpor_device_instances", 1, 1)
    device_gauge(d, "torpor_device_instances", 0, 0)
    device_gauge(d, "torpor_device_segment_bytes", 1, m["bytes"])
    # And back, with the CLI.
    back = d.cli("migrate", "--instance", inst["id"], "--gpu", "0")
    assert back.returncode == 0, back.stderr
    assert f"instance {inst['id']} (splitbuf-mig) moved from GPU 1 to GPU 0" in back.stdout, back.stdout
    assert d.invoke("splitbuf-mig", {"op": "compute", "x": 9}).json() == {"sha": expected_sha(9), "calls": calls + 3}


def test_refusals_are_one_line_and_leave_the_instance_alone(two: Torpord, tmp_path: Path) -> None:
    d = two
    inst = deploy_one(d, tmp_path, "splitbuf-ref")
    cases = [
        (inst["id"], 0, 409, "is on GPU 0 already"),
        (inst["id"], 7, 400, "GPU 7 does not exist on this node (2 device(s): 0 (host), 1 (host))"),
        (inst["id"], "one", 400, 'is not {"gpu": N}'),
        ("no-such-instance", 1, 404, "no live instance no-such-instance"),
        ("../etc", 1, 404, ""),
    ]
    for instance, gpu, status, words in cases:
        r = migrate(d, instance, gpu)
        assert r.status == status, (instance, gpu, r.status, r.body)
        error = r.json()["error"]
        assert words in error and "\n" not in error, error
    # A function without segments is not a split worker.
    d.deploy(FUNCTIONS / "echoer")
    assert d.invoke("echoer", {"x": 1}).status == 200
    (echo,) = d.instances("echoer")
    r = migrate(d, echo["id"], 1)
    assert r.status == 409 and "not a split worker" in r.json()["error"], r.body
    cli = d.cli("migrate", "--instance", inst["id"], "--gpu", "0")
    assert cli.returncode != 0 and "already" in cli.stderr, (cli.returncode, cli.stderr)
    assert d.invoke("splitbuf-ref", {"op": "compute", "x": 9}).json()["sha"] == expected_sha(9)
    device_gauge(d, "torpor_device_instances", 0, 2)


def test_a_target_without_room_is_refused(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    d = daemon(torpor_bin, tmp_path, config=TWO_DEVICES + "host_device_bytes = 65536\n")
    try:
        inst = deploy_one(d, tmp_path, "splitbuf-room")
        r = migrate(d, inst["id"], 1)
        assert r.status == 409, r.body
        assert r.json()["error"] == (
            f"GPU 1 has 0 MiB free but instance {inst['id']} needs 1 MiB: free memory on it or choose another GPU"
        )
        assert d.invoke("splitbuf-room", {"op": "compute", "x": 9}).status == 200
    finally:
        d.stop()


@pytest.mark.parametrize("step", ["precopy", "unmap", "copy", "residue", "map"])
def test_a_failure_at_each_step_leaves_the_instance_serving_on_its_old_device(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, step: str
) -> None:
    d = daemon(torpor_bin, tmp_path, env={"TORPORD_FAULT": f"migrate:{step}"})
    try:
        inst = deploy_one(d, tmp_path, "splitbuf-fail")
        before = inodes(d, "splitbuf-fail")
        r = migrate(d, inst["id"], 1)
        assert r.status == 500, (r.status, r.body)
        error = r.json()["error"]
        name = "pre-copy" if step == "precopy" else step
        assert f"failed at {name}: forced by TORPORD_FAULT; it serves on, on GPU 0" in error, error
        # Serving, the same process, its old memory, its state.
        (row,) = d.instances("splitbuf-fail")
        assert (row["id"], row["pid"], row["stage"]) == (inst["id"], inst["pid"], "warm"), row
        assert inodes(d, "splitbuf-fail") == before
        r2 = d.invoke("splitbuf-fail", {"op": "compute", "x": 9})
        assert r2.status == 200 and r2.start == "warm", (r2.status, r2.body)
        assert r2.json() == {"sha": expected_sha(9), "calls": inst["calls"] + 3}
        device_gauge(d, "torpor_device_instances", 0, 1)
    finally:
        d.stop()


def test_a_request_during_the_stop_waits_and_is_answered_by_the_moved_instance(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    d = daemon(torpor_bin, tmp_path, env={"TORPORD_DELAY": "migrate-stop:1500"})
    try:
        inst = deploy_one(d, tmp_path, "splitbuf-wait")
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(r=migrate(d, inst["id"], 1)))
        t.start()
        deadline = time.monotonic() + 30
        while "TORPORD_DELAY delays this point" not in d.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.02)
        t0 = time.monotonic()
        during = d.invoke("splitbuf-wait", {"op": "compute", "x": 9})
        waited = time.monotonic() - t0
        t.join(30)
        assert result["r"].status == 200, result["r"].body
        assert during.status == 200 and during.start == "warm", (during.status, during.body)
        assert during.json() == {"sha": expected_sha(9), "calls": inst["calls"] + 1}
        assert waited > 0.5, waited
        (row,) = d.instances("splitbuf-wait")
        assert row["pid"] == inst["pid"]
        assert result["r"].json()["stop_s"] >= 1.5
    finally:
        d.stop()
