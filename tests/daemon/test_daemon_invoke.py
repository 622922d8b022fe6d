"""Deploy and invoke through the real daemon (`torpor serve`), real workers and real CRIU.

One daemon serves the whole module; the tests run in file order and build on each other's
deploys: examples/cpu-mlp (boots the shared base), then tests/daemon/functions/faulty on the
same base (boots no Python), then tests/sdk/functions/tinymlp (another base).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from typing import Any

from conftest import ROOT, alive

from .conftest import FUNCTIONS, QUEUE_LENGTH, Torpord

CPU_MLP = ROOT / "examples" / "cpu-mlp"
TINYMLP = ROOT / "tests" / "sdk" / "functions" / "tinymlp"
FAULTY = FUNCTIONS / "faulty"
X16 = [float(i % 5) - 2.0 for i in range(16)]


def phases(lines: list[dict[str, Any]]) -> list[str]:
    return [line["phase"] for line in lines if "phase" in line and "error" not in line]


def test_deploy_reports_phases_and_a_second_function_reuses_the_base(torpord: Torpord) -> None:
    lines = torpord.deploy(CPU_MLP)
    assert phases(lines) == [
        "validate",
        "boot_base",
        "snapshot_base",
        "restore_base",
        "load",
        "snapshot_function",
        "stage",
        "profile",
    ], lines
    result = lines[-1]["result"]
    assert result["function"] == "cpu-mlp" and result["base_reused"] is False, lines
    assert all(line["s"] >= 0 for line in lines if "phase" in line)

    # Same interpreter, same (empty) preload set, no GPU: the base is reused, no Python boots.
    r = torpord.cli("deploy", FAULTY)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    shown = [line.split()[0] for line in r.stdout.splitlines()]
    assert "boot_base" not in shown and "restore_base" in shown, r.stdout
    assert f"base {result['base']}, reused" in r.stdout, r.stdout

    listed = torpord.request("GET", "/v1/functions").json()["functions"]
    assert {f["name"]: f["state"] for f in listed} == {"cpu-mlp": "ready", "faulty": "ready"}
    status = torpord.request("GET", "/v1/status").json()
    assert status["snapshots"]["base"] == 1 and status["snapshots"]["function"] == 2, status


def test_first_invoke_restores_then_warm_and_matches_a_local_run(torpord: Torpord) -> None:
    request = {"x": X16}
    local = subprocess.run(
        ["python3", str(CPU_MLP / "model.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "python")),
        check=True,
    )
    expected = json.loads(local.stdout)

    first = torpord.invoke("cpu-mlp", request)
    assert first.status == 200, first.body
    assert first.start == "restored", first.headers
    assert first.json() == expected
    assert {"queue", "restore", "handler", "total"} <= set(first.timings), first.timings
    # The restore's own phases say where its time went; none takes longer than the whole.
    phases = {k: v for k, v in first.timings.items() if k.startswith("restore.")}
    assert {"restore.open", "restore.criu_restore", "restore.criu_start", "restore.criu_finish"} <= set(
        phases
    ), first.timings
    assert all(0 <= v <= first.timings["restore"] for v in phases.values()), first.timings
    # CRIU's start (until its first notification) and finish (after its last) are parts of it.
    criu = phases["restore.criu_restore"]
    assert phases["restore.criu_start"] + phases["restore.criu_finish"] <= criu, first.timings

    second = torpord.invoke("cpu-mlp", request)
    assert second.status == 200 and second.start == "warm", (second.status, second.headers)
    assert second.json() == expected
    assert "restore" not in second.timings

    # The CLI prints the value.
    r = torpord.cli("invoke", "cpu-mlp", "--data", json.dumps(request))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == expected

    instances = torpord.instances("cpu-mlp")
    assert len(instances) == 1 and instances[0]["stage"] == "warm", instances
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert 'torpor_starts_total{function="cpu-mlp",kind="restored"} 1' in metrics
    assert 'torpor_starts_total{function="cpu-mlp",kind="warm"} 2' in metrics
    assert 'torpor_invocations_total{function="cpu-mlp",outcome="ok"} 3' in metrics


def test_a_user_exception_is_a_500_with_traceback_and_the_instance_stays_warm(torpord: Torpord) -> None:
    ok = torpord.invoke("faulty", {"echo": 1})
    assert ok.status == 200 and ok.start == "restored", ok.body
    pid = torpord.instances("faulty")[0]["pid"]

    r = torpord.invoke("faulty", {"raise": "no such label"})
    assert r.status == 500, r.body
    err = r.json()["error"]
    assert err["type"] == "ValueError" and err["message"] == "no such label", err
    assert "handler.py" in err["traceback"] and "raise ValueError" in err["traceback"], err

    after = torpord.invoke("faulty", {"echo": 2})
    assert after.status == 200 and after.start == "warm", after.body
    assert after.json() == {"echo": 2, "calls": 3}
    assert [i["pid"] for i in torpord.instances("faulty")] == [pid]

    cli = torpord.cli("invoke", "faulty", "--data", '{"raise": "from the CLI"}')
    assert cli.returncode == 1 and "ValueError" in cli.stderr and "from the CLI" in cli.stderr, cli.stderr


def test_a_worker_crash_fails_its_request_and_the_next_one_restores(torpord: Torpord) -> None:
    assert torpord.invoke("faulty", {"echo": 0}).start == "warm"
    old = torpord.instances("faulty")[0]["pid"]
    r = torpord.invoke("faulty", {"exit": 7})
    assert r.status == 502, r.body
    msg = r.json()["error"]
    assert "faulty" in msg and "connection closed" in msg and "removed" in msg, msg
    deadline = time.monotonic() + 5
    while alive(old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(old), "the crashed instance's tree was left behind"

    nxt = torpord.invoke("faulty", {"echo": 3})
    assert nxt.status == 200 and nxt.start == "restored", nxt.body
    assert nxt.json() == {"echo": 3, "calls": 1}, "a new instance, from the function snapshot"


def test_a_hung_handler_is_killed_at_timeout_s_with_504(torpord: Torpord) -> None:
    assert torpord.invoke("faulty", {"echo": 0}).status == 200
    instances = torpord.instances("faulty")
    old = [i["pid"] for i in instances]
    t = time.monotonic()
    r = torpord.invoke("faulty", {"sleep": 60})
    took = time.monotonic() - t
    assert r.status == 504, r.body
    assert 2.9 < took < 8, took
    error = r.json()["error"]
    assert "timeout_s" in error and "stacks" in error, error
    # Where it hung: every thread's stack, written to the instance's log before the kill.
    (hung,) = (i["id"] for i in instances if i["id"] in error)
    log = torpord.state / "logs" / "faulty" / f"{hung}.log"
    deadline = time.monotonic() + 5
    while "in __call__" not in (text := log.read_text(errors="replace") if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "thread 0x" in text.lower() and "faulty/handler.py" in text and "in __call__" in text, text[-3000:]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in old), "the hung worker was not killed"
    nxt = torpord.invoke("faulty", {"echo": 4})
    assert nxt.status == 200 and nxt.start == "restored", nxt.body


def test_a_bad_spec_is_a_400_naming_the_key(torpord: Torpord) -> None:
    r = torpord.request("POST", "/v1/functions", {"dir": str(FUNCTIONS / "badspec")})
    assert r.status == 400, r.body
    assert "scaling.max_instances" in r.json()["error"], r.body
    cli = torpord.cli("deploy", FUNCTIONS / "badspec")
    assert cli.returncode == 1 and "scaling.max_instances" in cli.stderr, cli.stderr
    names = [f["name"] for f in torpord.request("GET", "/v1/functions").json()["functions"]]
    assert "badspec" not in names


def test_a_failing_setup_fails_the_deploy_with_its_phase_and_error(torpord: Torpord) -> None:
    r = torpord.cli("deploy", "--json", FUNCTIONS / "badsetup")
    assert r.returncode == 1, r.stdout
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["phase"] == "load", last
    assert last["worker_error"]["phase"] == "setup", last
    assert last["worker_error"]["error"]["type"] == "RuntimeError", last
    assert "the model file is corrupt" in last["error"] and "setup" in last["error"], last
    r = torpord.cli("deploy", FUNCTIONS / "badsetup")
    assert "deploy failed in load" in r.stderr and "corrupt" in r.stderr, r.stderr
    assert "raise RuntimeError" in r.stderr, "the worker's traceback is shown"
    f = torpord.request("GET", "/v1/functions/badsetup").json()
    assert f["state"] == "failed" and f["instances"] == [], f
    r2 = torpord.invoke("badsetup", {})
    assert r2.status == 409 and "failed" in r2.json()["error"], r2.body


def _burst(torpord: Torpord, n: int, request: dict[str, Any]) -> tuple[list[Any], int]:
    """n concurrent invokes of faulty; the answers, and the most instances seen meanwhile."""
    answers: list[Any] = [None] * n
    done = threading.Event()
    most = 0

    def one(i: int) -> None:
        answers[i] = torpord.invoke("faulty", request)

    def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, len(torpord.instances("faulty")))
            time.sleep(0.02)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    return answers, most


def test_concurrent_invokes_never_exceed_max_instances(torpord: Torpord) -> None:
    # 2 instances (max_instances) serve, the rest wait in the queue (length 3) and are served.
    answers, most = _burst(torpord, 2 + QUEUE_LENGTH, {"sleep": 0.3})
    assert [a.status for a in answers] == [200] * (2 + QUEUE_LENGTH), [a.body for a in answers]
    assert most <= 2, most
    assert len(torpord.instances("faulty")) == 2
    assert {a.start for a in answers} <= {"warm", "restored"}


def test_over_capacity_is_429_when_the_queue_is_full_and_503_after_waiting(torpord: Torpord) -> None:
    # Both instances busy for 2.5 s (< timeout_s 3); 3 requests wait 1.5 s and get 503; 2 more get 429.
    answers, most = _burst(torpord, 7, {"sleep": 2.5})
    statuses = sorted(a.status for a in answers)
    assert statuses == [200, 200, 429, 429, 503, 503, 503], [(a.status, a.body) for a in answers]
    assert most <= 2, most
    for a in answers:
        if a.status == 503:
            assert int(a.headers["retry-after"]) >= 1, a.headers
        if a.status == 429:
            assert "queue is full" in a.json()["error"]


def test_garbage_from_a_worker_drops_only_that_connection(torpord: Torpord) -> None:
    import socket
    import struct

    path = torpord.state / "workers.sock"
    for junk in [b"\xff\xff\xff\xff", struct.pack(">I", 3) + b"[1]", struct.pack(">I", 2) + b"{}"]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.sendall(junk)
        s.settimeout(5)
        assert s.recv(1) == b"", "the daemon kept a connection that sent garbage"
        s.close()
    assert torpord.invoke("cpu-mlp", {"x": X16}).status == 200


def test_a_function_with_another_preload_gets_its_own_base(torpord: Torpord) -> None:
    lines = torpord.deploy(TINYMLP)
    assert "boot_base" in phases(lines), lines
    r = torpord.invoke("tinymlp", {"echo": "hi"})
    assert r.status == 200 and r.start == "restored", r.body
    # The warm-up request ran before the snapshot: the restored instance counted it.
    assert r.json() == {"echo": "hi", "calls": 2}
    assert torpord.request("GET", "/v1/status").json()["snapshots"]["base"] == 2


def test_a_redeploy_retires_the_old_instances(torpord: Torpord) -> None:
    assert torpord.invoke("cpu-mlp", {"x": X16}).start == "warm"
    old = [i["pid"] for i in torpord.instances("cpu-mlp")]
    lines = torpord.deploy(CPU_MLP)
    assert phases(lines)[1] == "restore_base", lines
    deadline = time.monotonic() + 5
    while any(alive(p) for p in old) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in old), "the idle instance of the old deploy was kept"
    r = torpord.invoke("cpu-mlp", {"x": X16})
    assert r.status == 200 and r.start == "restored", r.body
    snaps = torpord.request("GET", "/v1/functions/cpu-mlp").json()["snapshots"]
    assert [s["id"] for s in snaps] == [lines[-1]["result"]["snapshot"]], snaps


def test_delete_stops_the_live_instances(torpord: Torpord) -> None:
    assert torpord.invoke("faulty", {"echo": 0}).status == 200
    pids = [i["pid"] for i in torpord.instances("faulty")]
    assert pids
    r = torpord.request("DELETE", "/v1/functions/faulty")
    assert r.status == 200, r.body
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    r = torpord.invoke("faulty", {"echo": 0})
    assert r.status == 404, r.body
