"""Sandboxes (issue 11, item 1; docs/sandboxes.md) through the real daemon, real workers and
real CRIU, with CPU functions: the sandboxed functions of one tenant and workflow are served by
one worker process, each request on its own thread; more concurrent requests than its
requests_per_instance take another sandbox; another tenant's function with the same workflow
never shares it; a crash in one function's request fails the sandbox's other requests with 502
and the next request gets a new sandbox while the daemon lives on; a hibernated sandbox wakes
with every function's state; the communication store hands an object from one function to
another in the same sandbox without a copy. The tests run in file order and share one daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Answer, Torpord

SANDBOXED = FUNCTIONS / "sandboxed"


def make_function(
    root: Path,
    name: str,
    tenant: str,
    workflow: str | None,
    sandbox: bool = True,
    per_instance: int = 2,
    max_instances: int = 2,
    keepalive: str = "",
) -> Path:
    """A copy of tests/daemon/functions/sandboxed named `name` (its directory's name is the
    function's name, which the handler reports)."""
    d = root / name
    shutil.copytree(SANDBOXED, d, ignore=shutil.ignore_patterns("__pycache__"))
    lines = [f'name = "{name}"', f'tenant = "{tenant}"', 'entry = "handler:Sandboxed"', "timeout_s = 30"]
    if workflow is not None:
        lines.append(f'workflow = "{workflow}"')
    lines += [
        "[scaling]",
        f"max_instances = {max_instances}",
        f"requests_per_instance = {per_instance}",
        f"sandbox = {'true' if sandbox else 'false'}",
    ]
    if keepalive:
        lines += ["[keepalive]", keepalive]
    (d / "torpor.toml").write_text("\n".join(lines) + "\n")
    return d


@pytest.fixture(scope="module")
def fns(torpord: Torpord, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sandbox-fns")
    return {
        "sb-detect": make_function(root, "sb-detect", "team-a", "vision"),
        "sb-classify": make_function(root, "sb-classify", "team-a", "vision"),
        "sb-other": make_function(root, "sb-other", "team-b", "vision"),
        "sb-solo": make_function(root, "sb-solo", "team-a", "vision", sandbox=False),
    }


def ok(a: Answer) -> dict[str, Any]:
    assert a.status == 200, (a.status, a.body)
    return dict(a.json())


def test_the_sandboxed_functions_of_a_tenant_and_workflow_share_one_process(torpord: Torpord, fns: dict[str, Path]) -> None:
    for name in ("sb-detect", "sb-classify", "sb-other", "sb-solo"):
        lines = torpord.deploy(fns[name])
        phases = {line.get("phase"): line for line in lines if "phase" in line}
        if name == "sb-classify":
            # The second function of the sandbox is deployed with the first loaded beside it.
            assert phases["load_sandbox"]["functions"] == ["sb-detect"], lines
            assert phases["load_sandbox"]["sandbox"] == "team-a/vision"
            # CPU functions have no CUDA weights to pack (the GPU's case:
            # test_daemon_sandbox_gpu.py's vision-bert test).
            assert phases["load_sandbox"]["packed"] == {}, lines
        if name == "sb-other":
            # Another tenant's function of the same workflow: nothing of team-a joins it.
            assert phases["load_sandbox"]["functions"] == [], lines
        if name == "sb-solo":
            assert "load_sandbox" not in phases
    detect = ok(torpord.invoke("sb-detect", {}))
    classify = ok(torpord.invoke("sb-classify", {}))
    assert detect["fn"] == "sb-detect" and classify["fn"] == "sb-classify"
    # One process serves both (each function with its own module and state).
    assert detect["process"] == classify["process"]
    assert detect["calls"] == 1 and classify["calls"] == 1
    # Another tenant never shares it, nor does a function that did not ask for a sandbox.
    other = ok(torpord.invoke("sb-other", {}))
    solo = ok(torpord.invoke("sb-solo", {}))
    assert other["fn"] == "sb-other" and solo["fn"] == "sb-solo"
    assert len({detect["process"], other["process"], solo["process"]}) == 3
    # The sandbox is the host's instance (the most recently deployed member).
    assert len(torpord.instances("sb-classify")) == 1
    assert torpord.instances("sb-detect") == []
    # The listing says who serves the member, and `torpor ls` shows its sandbox's instances.
    listed = {f["name"]: f for f in torpord.request("GET", "/v1/functions").json()["functions"]}
    assert listed["sb-detect"]["sandbox_host"] == "sb-classify", listed["sb-detect"]
    for name in ("sb-classify", "sb-other", "sb-solo"):
        assert "sandbox_host" not in listed[name], listed[name]
    rows = {line.split()[0]: line for line in torpord.cli("ls").stdout.splitlines()[1:]}
    assert "in sb-classify's sandbox: 1 warm" in rows["sb-detect"], rows


def test_requests_take_threads_of_the_sandbox_first_then_another_sandbox(torpord: Torpord) -> None:
    def call(name: str) -> dict[str, Any]:
        return ok(torpord.invoke(name, {"op": "sleep", "s": 1.5}))

    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(call, n) for n in ("sb-detect", "sb-classify")]
        time.sleep(0.4)
        third = pool.submit(call, "sb-detect")
        answers = [f.result() for f in first] + [third.result()]
    took = time.monotonic() - t0
    # The first two ran side by side in one process (requests_per_instance = 2), each on its
    # own thread; the third found that sandbox full and took a second one.
    assert answers[0]["process"] == answers[1]["process"], answers
    assert answers[0]["thread"] != answers[1]["thread"]
    assert answers[2]["process"] != answers[0]["process"], answers
    assert took < 1.5 * 3, took


def test_the_store_hands_the_same_object_between_functions_of_a_sandbox(torpord: Torpord) -> None:
    put = ok(torpord.invoke("sb-detect", {"op": "put", "key": "frame-1/boxes", "n": 4}))
    got = ok(torpord.invoke("sb-classify", {"op": "get", "key": "frame-1/boxes"}))
    assert got["process"] == put["process"], (put, got)
    # The very object the other function put: no copy.
    assert got["id"] == put["id"]
    assert got["value"] == {"by": "sb-detect", "rows": [0, 1, 2, 3]}
    # Consumed by the get: the key is free again.
    again = torpord.invoke("sb-classify", {"op": "get", "key": "frame-1/boxes"})
    assert again.status == 500, again.body
    err = again.json()["error"]
    assert err["type"] == "KeyError" and "consumed" in err["message"], err
    # Keys are the sandbox's: team-b's function of the same workflow does not see team-a's.
    ok(torpord.invoke("sb-detect", {"op": "put", "key": "secret"}))
    theirs = torpord.invoke("sb-other", {"op": "get", "key": "secret"})
    assert theirs.status == 500 and theirs.json()["error"]["type"] == "KeyError", theirs.body


def test_the_store_hands_a_shared_value_to_another_sandbox_of_the_tenant_through_the_daemon(
    torpord: Torpord, tmp_path: Path
) -> None:
    # Another workflow of team-a: another sandbox, another process.
    torpord.deploy(make_function(tmp_path, "sb-reader", "team-a", "reading"))
    put = ok(torpord.invoke("sb-detect", {"op": "share", "key": "shared/1", "n": 40}))
    got = ok(torpord.invoke("sb-reader", {"op": "get_shared", "key": "shared/1", "keep": True}))
    assert got["process"] != put["process"]
    # The sealed memfd's pages, mapped read-only.
    assert got["type"] == "memoryview" and got["value"] == list(range(40)) and got["writeable"] is False
    got = ok(torpord.invoke("sb-reader", {"op": "get_shared", "key": "shared/1"}))
    assert got["value"] == list(range(40))
    # Consumed: gone for every sandbox.
    gone = torpord.invoke("sb-detect", {"op": "get_shared", "key": "shared/1"})
    assert gone.status == 500 and gone.json()["error"]["type"] == "KeyError", gone.body
    # A NumPy array arrives as a read-only array of its dtype and shape.
    ok(torpord.invoke("sb-reader", {"op": "share", "key": "shared/2", "array": True}))
    arr = ok(torpord.invoke("sb-detect", {"op": "get_shared", "key": "shared/2"}))
    assert arr["type"] == "ndarray" and arr["value"] == [[float(4 * r + c) for c in range(4)] for r in range(3)]
    assert arr["writeable"] is False
    # Another tenant's sandbox never sees team-a's keys.
    ok(torpord.invoke("sb-detect", {"op": "share", "key": "shared/3"}))
    theirs = torpord.invoke("sb-other", {"op": "get_shared", "key": "shared/3"})
    assert theirs.status == 500 and theirs.json()["error"]["type"] == "KeyError", theirs.body
    assert ok(torpord.invoke("sb-reader", {"op": "get_shared", "key": "shared/3"}))["value"] == list(range(16))
    # A function outside a sandbox cannot reach the daemon's store: one clear error.
    solo = torpord.invoke("sb-solo", {"op": "share", "key": "shared/4"})
    assert solo.status == 500, solo.body
    assert "sandbox = true" in solo.json()["error"]["message"], solo.body


def test_a_crash_in_one_function_fails_its_sandbox_only_and_the_next_request_gets_a_new_one(
    torpord: Torpord, tmp_path: Path
) -> None:
    # A sandbox group of its own, one sandbox at most: both requests land in it.
    for name in ("sb-crash-a", "sb-crash-b"):
        torpord.deploy(make_function(tmp_path, name, "team-a", "crashy", per_instance=2, max_instances=1))
    before = ok(torpord.invoke("sb-crash-a", {}))
    other = ok(torpord.invoke("sb-other", {}))
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(torpord.invoke, "sb-crash-a", {"op": "sleep", "s": 5})
        time.sleep(0.5)
        crash = torpord.invoke("sb-crash-b", {"op": "crash"})
        slow_answer = slow.result()
    assert crash.status == 502, crash.body
    # The other function's request in the same sandbox failed with it.
    assert slow_answer.status == 502, slow_answer.body
    # The daemon lives on, another tenant's sandbox too, and a new sandbox serves the group.
    assert torpord.proc.poll() is None
    assert ok(torpord.invoke("sb-other", {}))["process"] == other["process"]
    after = ok(torpord.invoke("sb-crash-a", {}))
    again = ok(torpord.invoke("sb-crash-b", {}))
    assert after["process"] == again["process"]
    assert after["process"] != before["process"]
    assert after["calls"] == 1, after


def test_a_request_whose_harness_part_fails_is_answered_not_left_waiting(torpord: Torpord, fns: dict[str, Path]) -> None:
    """Before session 34 an error in the harness around a sandbox's request (its memory pool,
    its stream) ended the request's thread without an answer: the daemon waited for it until
    timeout_s and held its slot meanwhile."""
    ok(torpord.invoke("sb-detect", {"op": "break_pool"}))
    t = time.monotonic()
    r = torpord.invoke("sb-detect", {})
    assert r.status == 500 and "memory pool broke" in r.body.decode(), (r.status, r.body)
    assert time.monotonic() - t < 10
    ok(torpord.invoke("sb-detect", {}))


def test_an_unknown_function_and_a_deleted_member(torpord: Torpord, fns: dict[str, Path]) -> None:
    assert torpord.invoke("sb-nothing", {}).status == 404
    r = torpord.cli("rm", "sb-detect")
    assert r.returncode == 0, r.stderr
    assert torpord.invoke("sb-detect", {}).status == 404
    # The rest of the sandbox serves on.
    assert ok(torpord.invoke("sb-classify", {}))["fn"] == "sb-classify"
    torpord.deploy(fns["sb-detect"])
    d, c = ok(torpord.invoke("sb-detect", {})), ok(torpord.invoke("sb-classify", {}))
    assert d["process"] == c["process"]


def test_a_hibernated_sandbox_wakes_with_every_function(torpord: Torpord, tmp_path: Path) -> None:
    keep = "gpu_release_s = 1\nhibernate_s = 2\nevict_s = 600"
    a = make_function(tmp_path, "sb-sleep-a", "team-c", "nap", per_instance=1, max_instances=1, keepalive=keep)
    b = make_function(tmp_path, "sb-sleep-b", "team-c", "nap", per_instance=1, max_instances=1, keepalive=keep)
    torpord.deploy(a)
    torpord.deploy(b)
    first_a = ok(torpord.invoke("sb-sleep-a", {}))
    first_b = ok(torpord.invoke("sb-sleep-b", {}))
    assert first_a["process"] == first_b["process"]
    deadline = time.monotonic() + 30
    while True:
        stages = [i["stage"] for i in torpord.instances("sb-sleep-b")]
        if stages == ["hibernated"]:
            break
        assert time.monotonic() < deadline, f"the sandbox did not hibernate: {stages}\n{torpord.log_text()}"
        time.sleep(0.1)
    # Woken from its hibernation snapshot: both functions, with their state.
    woke_a = torpord.invoke("sb-sleep-a", {})
    assert woke_a.status == 200 and woke_a.start == "restored", (woke_a.status, woke_a.body, woke_a.start)
    woke_b = ok(torpord.invoke("sb-sleep-b", {}))
    assert woke_a.json()["process"] == woke_b["process"] == first_a["process"]
    assert woke_a.json()["calls"] == 2 and woke_b["calls"] == 2


def test_a_sandbox_on_the_split_path_maps_every_functions_segments_back(torpord: Torpord, tmp_path: Path) -> None:
    # Each function's state in a torpor.buffer() segment: the sandbox's split snapshot stores
    # both outside the CRIU image, and a restore and a wake map both back.
    keep = "gpu_release_s = 1\nhibernate_s = 2\nevict_s = 600"
    dirs = [
        make_function(tmp_path, name, "team-d", "segments", per_instance=1, max_instances=1, keepalive=keep)
        for name in ("sb-seg-a", "sb-seg-b")
    ]
    for d in dirs:
        (d / "with_buffer").touch()
        lines = torpord.deploy(d)
    # The host's function snapshot stored both functions' segments outside its CRIU image.
    snap = next(line for line in lines if line.get("phase") == "snapshot_function")
    assert snap.get("segments") == 2, lines
    a, b = ok(torpord.invoke("sb-seg-a", {"op": "buffer"})), ok(torpord.invoke("sb-seg-b", {"op": "buffer"}))
    assert a["process"] == b["process"] and a["intact"] and b["intact"], (a, b)
    deadline = time.monotonic() + 30
    while [i["stage"] for i in torpord.instances("sb-seg-b")] != ["hibernated"]:
        assert time.monotonic() < deadline, f"the sandbox did not hibernate\n{torpord.log_text()}"
        time.sleep(0.1)
    a2, b2 = ok(torpord.invoke("sb-seg-a", {"op": "buffer"})), ok(torpord.invoke("sb-seg-b", {"op": "buffer"}))
    assert a2["process"] == b2["process"] == a["process"]
    # Each segment came back with its own bytes and the count written before the hibernation.
    assert a2["intact"] and b2["intact"] and a2["count"] == 1 and b2["count"] == 1, (a2, b2)


def test_the_spec_keys_are_strict(torpord: Torpord, tmp_path: Path) -> None:
    d = make_function(tmp_path, "sb-bad", "team-a", "vision")
    spec = (d / "torpor.toml").read_text()
    (d / "torpor.toml").write_text(spec.replace("sandbox = true", 'sandbox = "yes"'))
    r = torpord.cli("deploy", "--json", d)
    assert r.returncode != 0 and "scaling.sandbox must be true or false" in r.stdout + r.stderr, (r.stdout, r.stderr)
    (d / "torpor.toml").write_text(spec.replace('workflow = "vision"', 'workflow = "Vision!"'))
    r = torpord.cli("deploy", "--json", d)
    assert r.returncode != 0 and "workflow must be" in r.stdout + r.stderr, (r.stdout, r.stderr)
    json.dumps(r.stdout)


VISION = Path(__file__).resolve().parents[2] / "examples" / "vision-workflow"


def test_the_vision_workflow_runs_as_one_request_in_one_sandbox(torpord: Torpord, tmp_path: Path) -> None:
    # examples/vision-workflow as shipped (copied: a deploy writes nothing there, but the
    # test must not depend on that).
    root = tmp_path / "vision"
    shutil.copytree(VISION, root, ignore=shutil.ignore_patterns("__pycache__"))
    for stage in ("detect", "classify", "describe"):
        torpord.deploy(root / stage)
    r = torpord.cli("deploy", "--json", root)
    assert r.returncode == 0, (r.stdout, r.stderr)
    recorded = json.loads(r.stdout)
    assert recorded["one_sandbox"] is True
    assert [s["function"] for s in recorded["stages"]] == ["vision-detect", "vision-classify", "vision-describe"]
    a = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"seed": 3})
    assert a.status == 200, (a.status, a.body, torpord.log_text())
    value = a.json()
    assert value["caption"].startswith("a scene with ") and value["topic"] in ("nature", "city", "pets", "travel")
    assert len(value["boxes"]) == 4
    # Every stage ran in the one sandbox (stage 2 and 3 took their inputs from the store: a
    # get in another process would have failed the request).
    assert a.timings["sandbox"] == 1.0
    assert {"stage:vision-detect", "stage:vision-classify", "stage:vision-describe"} <= set(a.timings)
    # The same request, the same answer; through the CLI too.
    cli = torpord.cli("invoke", "--workflow", "vision-text", "--data", '{"seed": 3}')
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == value
    # A stage that raises: 500 with its error, which names the stage.
    bad = torpord.request("POST", "/v1/workflows/vision-text/invoke", {"image": [[1.0]]})
    assert bad.status == 500, bad.body
    err = bad.json()["error"]
    assert err["stage"] == "vision-detect" and "64" in err["message"], err
    cli = torpord.cli("invoke", "--workflow", "vision-text", "--data", '{"image": [[1]]}')
    assert cli.returncode != 0 and "stage vision-detect raised ValueError" in cli.stderr, cli.stderr
    assert torpord.request("GET", "/v1/workflows/vision-text").json()["tenant"] == "demo"


def test_a_workflow_across_instances_passes_values_as_json_and_stages_must_be_the_tenants(
    torpord: Torpord, tmp_path: Path
) -> None:
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "workflow.toml").write_text(
        'name = "mixed"\ntenant = "team-a"\n[[stage]]\nfunction = "sb-solo"\n'
        '[[stage]]\nfunction = "sb-classify"\nafter = ["sb-solo"]\n'
    )
    r = torpord.cli("deploy", "--json", d)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["one_sandbox"] is False
    a = torpord.request("POST", "/v1/workflows/mixed/invoke", {})
    assert a.status == 200, a.body
    assert a.json()["fn"] == "sb-classify" and a.timings["sandbox"] == 0.0
    # A stage of another tenant is refused as if it did not exist.
    (d / "workflow.toml").write_text('name = "mixed"\ntenant = "team-a"\n[[stage]]\nfunction = "sb-other"\n')
    r = torpord.cli("deploy", d)
    assert r.returncode != 0 and "stage sb-other is no function of tenant \"team-a\"" in r.stderr, r.stderr
    # A cycle is refused by the checker, with the fix.
    (d / "workflow.toml").write_text(
        'name = "cyc"\n[[stage]]\nfunction = "a"\nafter = ["b"]\n[[stage]]\nfunction = "b"\nafter = ["a"]\n'
    )
    r = torpord.cli("deploy", d)
    assert r.returncode != 0 and "cycle among a, b" in r.stderr, r.stderr
    # Forgotten: its invoke is 404.
    assert torpord.request("DELETE", "/v1/workflows/mixed").status == 200
    assert torpord.request("POST", "/v1/workflows/mixed/invoke", {}).status == 404


def test_a_booted_sandbox_loads_every_function_of_its_group(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    # cold_start = "boot": no snapshot is restored; the host boots and loads the others.
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    (tmp_path / "boot").mkdir()
    d = Torpord(torpor_bin, tmp_path / "boot", "--cold-start", "boot")
    try:
        for name in ("sb-boot-a", "sb-boot-b"):
            d.deploy(make_function(tmp_path, name, "team-a", "booted", per_instance=2, max_instances=1))
        first = d.invoke("sb-boot-a", {})
        assert first.status == 200 and first.start == "booted", (first.status, first.body, first.start)
        b = ok(d.invoke("sb-boot-b", {}))
        assert b["fn"] == "sb-boot-b" and b["process"] == first.json()["process"]
    finally:
        d.stop()


def test_a_daemon_killed_and_started_again_takes_the_sandbox_back(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    (tmp_path / "adopt").mkdir()
    d = Torpord(torpor_bin, tmp_path / "adopt")
    try:
        for name in ("sb-adopt-a", "sb-adopt-b"):
            d.deploy(make_function(tmp_path, name, "team-a", "adopted"))
        a, b = ok(d.invoke("sb-adopt-a", {})), ok(d.invoke("sb-adopt-b", {}))
        assert a["process"] == b["process"]
        # Killed only once its page server is done: one still serving when the daemon dies has
        # its instance killed at the restart, by design (test_daemon_pages.py), which a loaded CI
        # machine met here once (session 47).
        pending = d.state / "pages-pending"
        deadline = time.monotonic() + 30
        while pending.is_dir() and any(pending.iterdir()):
            assert time.monotonic() < deadline, f"the sandbox's pages never all came in: {list(pending.iterdir())}"
            time.sleep(0.05)
        d.proc.kill()
        d.proc.wait()
        d.restart()
        # Re-adoption runs beside the first requests: wait for it (as test_daemon_adopt does).
        deadline = time.monotonic() + 20
        while "re-adopted an instance of an earlier torpord" not in d.log_text():
            assert time.monotonic() < deadline, f"the sandbox was not re-adopted\n{d.log_text()}"
            time.sleep(0.05)
        # The same process, re-adopted with both functions and their state.
        again_a, again_b = d.invoke("sb-adopt-a", {}), ok(d.invoke("sb-adopt-b", {}))
        assert again_a.status == 200 and again_a.start == "warm", (again_a.status, again_a.body, again_a.start)
        assert again_a.json()["process"] == again_b["process"] == a["process"]
        assert again_a.json()["calls"] == 2 and again_b["calls"] == 2
    finally:
        d.stop()
