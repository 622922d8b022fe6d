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

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import FakeCuda

from .conftest import FUNCTIONS, Torpord, fake_gpu_env
from .test_daemon_adopt import kill_daemon, wait_log
from .test_daemon_crash import registry
from .test_daemon_split import expected_sha, twin
from .test_daemon_tenants import TOKENS, splitbuf_twin, tcp, tenants  # noqa: F401 (the fixture)

# Every cold start on device 0 (the deploy's), where these tests expect it: placement over the
# devices has tests of its own (test_daemon_placement.py).
TWO_DEVICES = "[restore_server]\nhost_devices = 2\nplacement = \"first\"\n"
RESIDUE_BYTES = 64 << 20


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
    # Its lazy pages all in: the crash tests kill the daemon and expect it re-adopted.
    d.wait_pages_in()
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
    """Waits until /metrics shows `metric{device}` at `want` (the keep-alive ticker sets it every
    200 ms; a loaded machine may take longer)."""
    deadline = time.monotonic() + 15
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
    assert not m["residue_moved"] and m["residue_bytes"] is None and 0 < m["stop_s"] < m["total_s"], m
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


def test_a_segment_the_worker_gave_back_since_its_restore_fails_the_move_not_the_instance(
    two: Torpord, tmp_path: Path
) -> None:
    """The worker's allocator gave back a segment torpord handed over at the restore (on the GPU:
    PyTorch emptying its cache; session 36 lost a sandbox at every GPU release that way, the
    worker exiting on torpord's `unmap`). The unmap is refused with nothing released: the move
    fails in one line and the instance serves on where it was, with its state."""
    d = two
    inst = deploy_one(d, tmp_path, "splitbuf-gone")
    renewed = d.invoke("splitbuf-gone", {"op": "renew_scratch"})
    assert renewed.status == 200, renewed.body
    r = migrate(d, inst["id"], 1)
    assert r.status == 500, (r.status, r.body, d.log_text())
    error = r.json()["error"]
    assert "failed at unmap" in error and f"unmap names {renewed.json()['freed']:#x}" in error, error
    assert "serves on, on GPU 0" in error and "\n" not in error, error
    (row,) = d.instances("splitbuf-gone")
    assert (row["id"], row["pid"], row["stage"]) == (inst["id"], inst["pid"], "warm"), row
    calls = renewed.json()["calls"]
    peek = d.invoke("splitbuf-gone", {"op": "peek"})
    assert peek.status == 200 and peek.json() == {"scratch": calls, "calls": calls}, peek.body
    r2 = d.invoke("splitbuf-gone", {"op": "compute", "x": 9})
    assert r2.status == 200 and r2.json() == {"sha": expected_sha(9), "calls": calls + 1}, r2.body


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


def gpu_splitbuf(tmp_path: Path, name: str) -> Path:
    """splitbuf as a `gpus = 1` function (its segments stay host ones: the handler runs no CUDA;
    the fake driver takes every process for a CUDA one), one instance."""
    fdir = twin(tmp_path, name)
    toml = fdir / "torpor.toml"
    text = toml.read_text().replace("max_instances = 2", "max_instances = 1")
    text = text.replace('timeout_s = 30', 'timeout_s = 30\ngpus = 1\ngpu_memory = "64MiB"')
    toml.write_text(text)
    return fdir


@pytest.fixture
def fake_gpus(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path) -> Any:
    """A daemon on three fake GPUs of one model (tests/fakes: every driver call logged)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    log = root / "cuda-calls.log"
    env = fake_gpu_env(
        root, fake_cuda, FAKE_CUDA_DEVICES="3", FAKE_CUDA_SAME_MODEL="1", FAKE_CUDA_LOG=str(log),
        # NVML lists every worker with 64 MiB: the residue a migration reports.
        FAKE_NVML_PROCS_MATCH=f"torpor.worker:{RESIDUE_BYTES}",
        # Armed by creating its directory: the first driver restore after that fails.
        FAKE_CUDA_RESTORE_FLAKY=str(root / "flaky" / "used"),
    )
    d = Torpord(torpor_bin, root, env=env, queue_timeout_s=30)
    try:
        yield d, log, root / "flaky" / "used"
    finally:
        d.stop()


def test_a_gpu_instance_moves_its_cuda_state_with_the_gpu_pairs_and_a_driver_failure_is_undone(
    fake_gpus: tuple[Torpord, Path, Path], tmp_path: Path
) -> None:
    d, log, flaky = fake_gpus
    fdir = gpu_splitbuf(tmp_path, "gpubuf")
    d.deploy(fdir)
    r = d.invoke("gpubuf", {"op": "compute", "x": 9})
    assert r.status == 200, (r.status, r.body, d.log_text())
    (inst,) = d.instances("gpubuf")
    calls = r.json()["calls"]
    # The first driver restore fails (FAKE_CUDA_RESTORE_FLAKY): the move onto GPU 1 fails at the
    # residue, the driver puts the state back on GPU 0 (a restore without pairs), the old
    # segments are mapped back.
    before = log.read_text() if log.exists() else ""
    flaky.parent.mkdir()
    first = migrate(d, inst["id"], 1)
    assert first.status == 500, first.body
    assert "failed at residue" in first.json()["error"] and "serves on, on GPU 0" in first.json()["error"], first.body
    assert flaky.exists()
    calls_log = log.read_text()[len(before):].splitlines()
    assert [line.split()[0] for line in calls_log] == ["lock", "checkpoint", "restore", "restore", "unlock"], calls_log
    assert "flaky" in calls_log[2], calls_log
    assert any(line.startswith("restore ") and "pairs=0" in line and line.endswith("result=0") for line in calls_log), calls_log
    assert calls_log[-1].endswith("result=0"), calls_log
    r2 = d.invoke("gpubuf", {"op": "compute", "x": 9})
    assert r2.status == 200 and r2.start == "warm" and r2.json()["calls"] == calls + 1, (r2.status, r2.body)
    # Now it moves: lock, checkpoint, restore with a pair for every GPU (0 and 1 swap, 2 stays),
    # unlock.
    before = log.read_text()
    ok = migrate(d, inst["id"], 1)
    assert ok.status == 200, (ok.status, ok.body, d.log_text())
    assert ok.json()["residue_moved"] is True and ok.json()["to"] == 1, ok.body
    assert ok.json()["residue_bytes"] == RESIDUE_BYTES, ok.body
    moved = log.read_text()[len(before):].splitlines()
    ops = [line.split()[0] for line in moved]
    assert ops == ["lock", "checkpoint", "restore", "unlock"], moved
    restore = moved[2]
    g0, g1, g2 = (f"GPU-fa4e0000-0000-0000-0000-00000000000{i}" for i in range(3))
    assert f"pairs=3 {g0}>{g1} {g1}>{g0} {g2}>{g2}" in restore and restore.endswith("result=0"), restore
    r3 = d.invoke("gpubuf", {"op": "compute", "x": 9})
    assert r3.status == 200 and r3.json() == {"sha": expected_sha(9), "calls": calls + 2}, r3.body
    device_gauge(d, "torpor_device_instances", 1, 1)


def test_a_gpu_of_another_model_is_refused(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    d = Torpord(torpor_bin, root, env=fake_gpu_env(root, fake_cuda, FAKE_CUDA_DEVICES="2"), queue_timeout_s=30)
    try:
        d.deploy(gpu_splitbuf(tmp_path, "gpubuf2"))
        assert d.invoke("gpubuf2", {"op": "compute", "x": 9}).status == 200
        (inst,) = d.instances("gpubuf2")
        r = migrate(d, inst["id"], 1)
        assert r.status == 409, r.body
        assert r.json()["error"] == (
            f"instance {inst['id']} is on a Fake NVIDIA GPU 0, but GPU 1 is a Fake NVIDIA GPU 1: the driver "
            "restores only onto the same model; choose a GPU of the same model"
        )
    finally:
        d.stop()


def test_a_request_in_flight_finishes_and_one_sent_meanwhile_waits_for_the_moved_instance(
    two: Torpord, tmp_path: Path
) -> None:
    d = two
    inst = deploy_one(d, tmp_path, "splitbuf-drain")
    out: dict[str, Any] = {}
    slow = threading.Thread(target=lambda: out.update(slow=d.invoke("splitbuf-drain", {"op": "info", "sleep": 1.5})))
    slow.start()
    time.sleep(0.4)
    mover = threading.Thread(target=lambda: out.update(moved=migrate(d, inst["id"], 1)))
    mover.start()
    time.sleep(0.4)
    # Draining: this request is not routed to the instance until it has moved.
    t0 = time.monotonic()
    late = d.invoke("splitbuf-drain", {"op": "compute", "x": 9})
    waited = time.monotonic() - t0
    slow.join(30)
    mover.join(30)
    assert out["slow"].status == 200, out["slow"].body
    assert out["moved"].status == 200, out["moved"].body
    assert late.status == 200 and late.start == "warm", (late.status, late.body)
    # It ran after the slow one (its calls count) on the moved instance, having waited.
    assert late.json() == {"sha": expected_sha(9), "calls": inst["calls"] + 2}
    assert waited > 0.5, waited
    # The stop counted from when routing to the instance ended: the slow request's rest.
    assert out["moved"].json()["stop_s"] >= 0.5, out["moved"].body


def test_another_tenants_instance_answers_as_if_it_did_not_exist(tenants: Torpord, tmp_path: Path) -> None:  # noqa: F811 (the fixture)
    tenants.deploy(splitbuf_twin(tmp_path, "sb-mig-a", "team-a"))
    status, _ = tcp(tenants, TOKENS["team-a"], "POST", "/v1/functions/sb-mig-a/invoke", {"op": "compute", "x": 1})
    assert status == 200
    (inst,) = tenants.instances("sb-mig-a")
    got = tcp(tenants, TOKENS["team-b"], "POST", f"/v1/instances/{inst['id']}/migrate", {"gpu": 1})
    missing = tcp(tenants, TOKENS["team-b"], "POST", "/v1/instances/sb-nosuch-1/migrate", {"gpu": 1})
    assert got[0] == missing[0] == 404, (got, missing)
    assert got[1]["error"] == missing[1]["error"].replace("sb-nosuch-1", inst["id"]), (got, missing)
    # Its own tenant reaches it (one host device here: the target does not exist).
    own = tcp(tenants, TOKENS["team-a"], "POST", f"/v1/instances/{inst['id']}/migrate", {"gpu": 1})
    assert own[0] == 400 and "GPU 1 does not exist" in own[1]["error"], own


def test_a_daemon_restarted_after_a_migration_re_adopts_the_instance_where_it_moved(two: Torpord, tmp_path: Path) -> None:
    d = two
    inst = deploy_one(d, tmp_path, "splitbuf-readopt")
    r = migrate(d, inst["id"], 1)
    assert r.status == 200, r.body
    placement = d.state / "placement" / f"{inst['id']}.json"
    assert json.loads(placement.read_text()) == {"gpu": 1, "gpu_map": []}
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    d.restart()
    deadline = time.monotonic() + 30
    while [i["pid"] for i in d.instances("splitbuf-readopt") if i.get("pid")] != [inst["pid"]]:
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    device_gauge(d, "torpor_device_instances", 1, 1)
    answer = d.invoke("splitbuf-readopt", {"op": "compute", "x": 9})
    assert answer.status == 200 and answer.start == "warm", (answer.status, answer.body)
    assert answer.json() == {"sha": expected_sha(9), "calls": inst["calls"] + 1}
    # Gone with the instance.
    assert d.cli("stop", "splitbuf-readopt").returncode == 0
    deadline = time.monotonic() + 15
    while placement.exists():
        assert time.monotonic() < deadline, "the placement file outlived its instance"
        time.sleep(0.1)


def test_a_daemon_killed_in_a_migration_re_adopts_before_the_stop_and_removes_the_instance_after(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """kill -9 of the daemon in a migration. In the pre-copy (held 8 s by TORPORD_DELAY) the
    worker is as it was: the next daemon re-adopts it, same process, same state. In the stop
    (held by TORPORD_HOLD right after the journal recorded `copy`: the worker has unmapped its
    segments, whose memory only the daemon held) the next daemon removes the instance instead of
    taking back a worker that would fail its first request; the next request restores another."""
    env = {"TORPORD_DELAY": "migrate-precopy:8000", "TORPORD_HOLD": "migrate:copy"}
    d = daemon(torpor_bin, tmp_path, env=env)
    name = "splitbuf-cut"
    try:
        inst = deploy_one(d, tmp_path, name)

        def migrate_in_background() -> None:
            iid = inst["id"]

            def send() -> None:
                try:
                    migrate(d, iid, 1)
                except OSError:
                    pass  # the daemon is killed under it

            threading.Thread(target=send, daemon=True).start()

        # In the pre-copy: re-adopted, with its state.
        migrate_in_background()
        wait_log(d, "segments pre-copied while the instance serves", 30)
        kill_daemon(d)
        d.restart()
        deadline = time.monotonic() + 30
        while [i["pid"] for i in d.instances(name) if i.get("pid")] != [inst["pid"]]:
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.1)
        warm = d.invoke(name, {"op": "compute", "x": 9})
        assert warm.status == 200 and warm.start == "warm", (warm.status, warm.body)
        assert warm.json() == {"sha": expected_sha(9), "calls": inst["calls"] + 1}
        assert not registry(d, "SELECT 1 FROM journal")

        # In the stop, past the unmap: removed. (An instance of a function deployed now: a
        # re-adopted one holds no segments from this daemon and cannot migrate: docs/migration.md.)
        name = "splitbuf-cut2"
        inst = deploy_one(d, tmp_path, name)
        migrate_in_background()
        deadline = time.monotonic() + 60
        while not registry(d, "SELECT 1 FROM journal WHERE op = 'migrate' AND step = 'copy'"):
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        kill_daemon(d)
        d.env.pop("TORPORD_HOLD")
        d.env.pop("TORPORD_DELAY")
        d.restart()
        wait_log(d, "a migration was interrupted by a torpord stop in its copy step and its instance removed", 30)
        assert not registry(d, "SELECT 1 FROM journal")
        assert not registry(d, "SELECT 1 FROM instances WHERE id = ?", inst["id"])
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{inst['pid']}"):
            assert time.monotonic() < deadline, "the removed instance's tree is still alive"
            time.sleep(0.1)
        fresh = d.invoke(name, {"op": "compute", "x": 9})
        assert fresh.status == 200 and fresh.start == "restored", (fresh.status, fresh.body)
        # A new instance from the function snapshot: the count starts again.
        assert fresh.json() == {"sha": expected_sha(9), "calls": inst["calls"]}
        assert [i["id"] for i in d.instances(name)] != [inst["id"]]
    finally:
        d.stop()
