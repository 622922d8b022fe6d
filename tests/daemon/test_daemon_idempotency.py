"""Idempotency-Key on invoke, through the real daemon, real workers and a real kill -9 of the
daemon: a request runs once for its key. A retry gets the first run's answer (marked
`Idempotent-Replayed: true`), joins the run while it is under way, and after the daemon died
mid-request gets the answer the worker kept for the daemon that re-adopted it.

tests/daemon/functions/once prints `once-ran TAG` on its stdout for every call, so how many
times a request ran is read from the instance's log, not taken from the answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Answer, Torpord

ONCE = FUNCTIONS / "once"
REATTACH_S = 30


@pytest.fixture(scope="module")
def torpord(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord-idem"), config=f"[workers]\nreattach_s = {REATTACH_S}\n")
    d.deploy(ONCE)
    try:
        yield d
    finally:
        d.stop()


def ran(torpord: Torpord, tag: str) -> int:
    """How many times the function ran the request tagged `tag` (its instances' logs)."""
    logs = torpord.state / "logs" / "once"
    return sum(
        line.strip() == f"once-ran {tag}"
        for log in logs.glob("*.log")
        for line in log.read_text(errors="replace").splitlines()
    )


def invoke_in_thread(torpord: Torpord, request: Any, key: str) -> tuple[threading.Thread, list[Answer | BaseException]]:
    return invoke_in_thread_of(torpord, "once", request, key)


def kill_daemon(torpord: Torpord) -> None:
    torpord.proc.send_signal(signal.SIGKILL)
    torpord.proc.wait()


def test_a_retry_gets_the_first_answer_and_the_function_runs_once(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    first = torpord.invoke("once", {"tag": key}, key=key)
    assert first.status == 200, first.body
    assert "idempotent-replayed" not in first.headers
    again = torpord.invoke("once", {"tag": key}, key=key)
    assert again.status == 200, again.body
    assert again.json() == first.json()
    assert again.headers.get("idempotent-replayed") == "true"
    assert ran(torpord, key) == 1
    # The same key with another request is refused, and does not run.
    other = torpord.invoke("once", {"tag": key, "more": 1}, key=key)
    assert other.status == 422, other.body
    assert "another request body" in other.json()["error"], other.body
    assert ran(torpord, key) == 1
    # Without a key every request runs.
    plain = str(uuid.uuid4())
    for _ in range(2):
        assert torpord.invoke("once", {"tag": plain}).status == 200
    assert ran(torpord, plain) == 2


@pytest.mark.parametrize("key", ["", "has space", "k" * 256, "café"])
def test_a_malformed_key_is_refused_with_the_fix(torpord: Torpord, key: str) -> None:
    if key.isascii():
        r = torpord.request("POST", "/v1/functions/once/invoke", {"tag": "bad"}, headers={"Idempotency-Key": key})
    else:
        r = bad_header_request(torpord, key.encode())
    assert r.status == 400, r.body
    assert "Idempotency-Key header must be 1 to 255 visible ASCII characters" in r.json()["error"], r.body
    assert ran(torpord, "bad") == 0


def bad_header_request(torpord: Torpord, key: bytes) -> Answer:
    """A key with bytes that are not ASCII (http.client refuses to send one)."""
    body = b'{"tag": "bad"}'
    head = (
        b"POST /v1/functions/once/invoke HTTP/1.1\r\nHost: torpord\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nIdempotency-Key: " + key + b"\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(torpord.socket))
        s.sendall(head + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    status = int(raw.split(b" ", 2)[1])
    return Answer(status, {}, raw.split(b"\r\n\r\n", 1)[1])


def test_an_exception_is_the_functions_answer_and_is_kept_too(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    first = torpord.invoke("once", {"tag": key, "raise": True}, key=key)
    assert first.status == 500, first.body
    assert first.json()["error"]["type"] == "ValueError"
    again = torpord.invoke("once", {"tag": key, "raise": True}, key=key)
    assert (again.status, again.json()) == (500, first.json())
    assert again.headers.get("idempotent-replayed") == "true"
    assert ran(torpord, key) == 1


def test_a_retry_while_the_first_runs_joins_it(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    t1, out1 = invoke_in_thread(torpord, {"tag": key, "sleep": 1.5}, key)
    time.sleep(0.4)
    t2, out2 = invoke_in_thread(torpord, {"tag": key, "sleep": 1.5}, key)
    t1.join(60)
    t2.join(60)
    a, b = out1[0], out2[0]
    assert isinstance(a, Answer) and isinstance(b, Answer), (a, b)
    assert (a.status, b.status) == (200, 200), (a.body, b.body)
    assert a.json() == b.json()
    assert b.headers.get("idempotent-replayed") == "true"
    assert ran(torpord, key) == 1


def test_a_client_that_goes_away_does_not_cancel_the_run_its_retry_joins(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    body = f'{{"tag": "{key}", "sleep": 1.5}}'.encode()
    head = (
        f"POST /v1/functions/once/invoke HTTP/1.1\r\nHost: torpord\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(torpord.socket))
        s.sendall(head + body)
        time.sleep(0.4)
    # The client is gone; the request runs on, and the retry gets its answer.
    retry = torpord.invoke("once", {"tag": key, "sleep": 1.5}, key=key)
    assert retry.status == 200, retry.body
    assert retry.json()["tag"] == key
    assert retry.headers.get("idempotent-replayed") == "true"
    assert ran(torpord, key) == 1


@pytest.mark.parametrize("restart", ["after-the-handler-ended", "while-the-handler-runs"])
def test_a_retry_after_the_daemon_was_killed_mid_request_runs_nothing_again(torpord: Torpord, restart: str) -> None:
    """kill -9 of the daemon while the handler sleeps. The worker outlives it, finishes the
    request and keeps its answer. The retry, sent to the restarted daemon at once, waits for the
    worker to be re-adopted and gets that answer, from the same process. The request ran once."""
    pid_before = torpord.invoke("once", {"tag": "warm"}).json()["pid"]
    key = str(uuid.uuid4())
    request = {"tag": key, "sleep": 2.0}
    t, out = invoke_in_thread(torpord, request, key)
    time.sleep(0.5)
    kill_daemon(torpord)
    t.join(30)
    assert isinstance(out[0], BaseException), f"the killed daemon answered: {out[0]}"
    if restart == "after-the-handler-ended":
        # The handler ends, its result finds no daemon: the worker keeps it and reattaches.
        deadline = time.monotonic() + 10
        while ran(torpord, key) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ran(torpord, key) == 1
    torpord.restart()
    retry = torpord.invoke("once", request, timeout=60, key=key)
    assert retry.status == 200, (retry.body, torpord.log_text())
    assert retry.json()["tag"] == key and retry.json()["pid"] == pid_before, retry.body
    assert retry.headers.get("idempotent-replayed") == "true"
    assert ran(torpord, key) == 1, torpord.log_text()
    # Replayed from the new daemon's table from now on.
    assert torpord.invoke("once", request, key=key).json() == retry.json()
    assert ran(torpord, key) == 1


def test_a_keyed_request_runs_once_across_a_kill_even_on_an_instance_whose_lazy_pages_still_came(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """A restart kills, never re-adopts, an instance whose lazy pages were still coming when the
    daemon died (recovery::drop_pages_pending), and the answers its worker kept go with it. So a
    keyed request waits for the pages before it goes to such an instance: the worker that runs
    it is one a restart re-adopts, and the retry after a kill -9 gets its answer. Before, the
    request ran at once, the restart killed its instance, and the retry ran it a second time
    (bench/reliability/load.py --restart kill: duplicated 1, where a tally instance restored
    just before the kill). `TORPORD_DELAY=pages-served` holds the window open: the pages are
    in, the instance's pages-pending marker is not removed yet."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    held_ms = 3000
    d = Torpord(
        torpor_bin, tmp_path / "d", config=f"[workers]\nreattach_s = {REATTACH_S}\n", queue_timeout_s=30,
        env={"TORPORD_DELAY": f"pages-served:{held_ms}"},
    )
    try:
        d.deploy(ONCE)
        key = str(uuid.uuid4())
        request = {"tag": key}
        first = d.invoke("once", request, key=key)
        assert first.status == 200 and first.start == "restored", (first.status, first.body, d.log_text())
        d.proc.kill()
        d.proc.wait()
        d.restart()
        retry = d.invoke("once", request, timeout=60, key=key)
        assert retry.status == 200, (retry.body, d.log_text())
        assert ran(d, key) == 1, d.log_text()
        assert retry.headers.get("idempotent-replayed") == "true", (retry.headers, d.log_text())
        assert retry.json() == first.json(), (retry.body, first.body)
        assert "page server was still serving" not in d.log.read_text(errors="replace")
        # The first went once the pages were in (and the marker gone, which the delay held).
        assert first.timings.get("pages", 0) >= held_ms / 1000 * 0.8, first.timings
        # An unkeyed request does not wait for the pages.
        d.stop_instances("once")
        plain = d.invoke("once", {"tag": "plain"})
        assert plain.status == 200 and plain.start == "restored", (plain.status, plain.body)
        assert "pages" not in plain.timings, plain.timings
    finally:
        d.stop()


def test_a_request_the_killed_daemon_never_handed_to_a_worker_runs_once_when_retried(torpord: Torpord) -> None:
    """One instance, one request at a time: the second keyed request waits in the daemon's
    queue behind a slow one when the daemon is killed. It never reached the worker, so its
    retry runs it — once."""
    slow, queued = str(uuid.uuid4()), str(uuid.uuid4())
    t1, _ = invoke_in_thread(torpord, {"tag": slow, "sleep": 2.0}, slow)
    time.sleep(0.3)
    t2, out2 = invoke_in_thread(torpord, {"tag": queued}, queued)
    time.sleep(0.3)
    kill_daemon(torpord)
    t1.join(30)
    t2.join(30)
    assert isinstance(out2[0], BaseException), f"the killed daemon answered: {out2[0]}"
    torpord.restart()
    retry = torpord.invoke("once", {"tag": queued}, timeout=60, key=queued)
    assert retry.status == 200, (retry.body, torpord.log_text())
    assert "idempotent-replayed" not in retry.headers
    assert ran(torpord, queued) == 1
    assert ran(torpord, slow) == 1


def test_the_cli_with_a_key_retries_across_a_daemon_killed_mid_request(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    env = dict(os.environ, TORPOR_SOCKET=str(torpord.socket))
    cli = subprocess.Popen(
        [str(torpord.binary), "invoke", "once", "--data", json.dumps({"tag": key, "sleep": 1.5}), "--idempotency-key", key],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    time.sleep(0.5)
    kill_daemon(torpord)
    time.sleep(0.5)
    torpord.restart()
    out, err = cli.communicate(timeout=90)
    assert cli.returncode == 0, (err, torpord.log_text())
    assert json.loads(out)["tag"] == key
    assert ran(torpord, key) == 1


def test_the_cli_sends_the_key_and_says_when_an_answer_is_replayed(torpord: Torpord) -> None:
    key = str(uuid.uuid4())
    data = f'{{"tag": "{key}"}}'
    first = torpord.cli("invoke", "once", "--data", data, "--idempotency-key", key, "-v")
    assert first.returncode == 0, first.stderr
    assert "replayed" not in first.stderr
    again = torpord.cli("invoke", "once", "--data", data, "--idempotency-key", key, "-v")
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert "replayed: the answer of an earlier run of this key" in again.stderr
    assert ran(torpord, key) == 1


@pytest.mark.parametrize("restart", ["after-the-handler-ended", "while-the-handler-runs"])
def test_a_sandbox_keeps_a_keyed_answer_across_a_kill_of_the_daemon(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, restart: str
) -> None:
    """A sandbox runs each request on a thread of its own, which may end after its worker
    reattached to the new daemon: the thread must then send its `settled` frame, not its
    `result` (whose id was the dead daemon's). The function counts its calls: the retry's answer
    is the first run's, and the next request is only the function's third call."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    from .test_daemon_sandbox import make_function

    (tmp_path / "d").mkdir()
    d = Torpord(torpor_bin, tmp_path / "d", config=f"[workers]\nreattach_s = {REATTACH_S}\n")
    try:
        d.deploy(make_function(tmp_path, "sb-keyed", "team-a", "keyed", max_instances=1))
        first = d.invoke("sb-keyed", {})
        assert first.status == 200 and first.json()["calls"] == 1, first.body
        key = str(uuid.uuid4())
        sleep = 2.0 if restart == "after-the-handler-ended" else 3.0
        request = {"op": "sleep", "s": sleep, "tag": key}
        t, out = invoke_in_thread_of(d, "sb-keyed", request, key)
        time.sleep(0.5)
        d.proc.kill()
        d.proc.wait()
        t.join(30)
        assert isinstance(out[0], BaseException), f"the killed daemon answered: {out[0]}"
        if restart == "after-the-handler-ended":
            time.sleep(sleep)
        d.restart()
        retry = d.invoke("sb-keyed", request, timeout=60, key=key)
        assert retry.status == 200, (retry.body, d.log_text())
        assert retry.headers.get("idempotent-replayed") == "true", (retry.headers, d.log_text())
        assert retry.json()["calls"] == 2 and retry.json()["process"] == first.json()["process"], retry.body
        after = d.invoke("sb-keyed", {})
        assert after.status == 200 and after.json()["calls"] == 3, after.body
    finally:
        d.stop()


def test_a_sandbox_request_the_killed_daemon_handed_over_but_that_had_not_started_runs_once(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """A sandbox's request starts on a lane: keyed request B reached the worker before the kill
    but waits for its lane (behind A, whose handler gave the lane back and holds: the `hold`
    op) until the worker has reattached to the new daemon. B's key is not in that hello, so B
    must not start then: its retry runs it (once), and its `started` and `result` would carry
    the killed daemon's id to the new one. A and B each count as a call when they run."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    from .test_daemon_sandbox import make_function

    (tmp_path / "d").mkdir()
    d = Torpord(torpor_bin, tmp_path / "d", config=f"[workers]\nreattach_s = {REATTACH_S}\n")
    try:
        fdir = make_function(tmp_path, "sb-lane", "team-a", "lane", max_instances=1)
        d.deploy(fdir)
        first = d.invoke("sb-lane", {})
        assert first.status == 200 and first.json()["calls"] == 1, first.body
        # In the function's directory, which the worker sees at its own path (docs/mounts.md).
        release = fdir / "release"
        ta, _ = invoke_in_thread_of(d, "sb-lane", {"op": "hold", "until": str(release)}, None)
        wait_for_log(d, "sb-lane", "hold-began")
        key = str(uuid.uuid4())
        tb, out = invoke_in_thread_of(d, "sb-lane", {"tag": key}, key)
        # torpord hands B to the worker (requests_per_instance = 2), which queues it on A's lane.
        time.sleep(1.0)
        kill_daemon(d)
        ta.join(30)
        tb.join(30)
        assert isinstance(out[0], BaseException), f"the killed daemon answered: {out[0]}"
        d.restart()
        wait_for_log(d, "sb-lane", "torpor worker: a torpord took this instance back")
        release.touch()
        wait_for_log(d, "sb-lane", "hold-ended")
        # B, if it started, starts on A's lane right after A's handler returned.
        time.sleep(0.5)
        retry = d.invoke("sb-lane", {"tag": key}, timeout=60, key=key)
        assert retry.status == 200, (retry.body, d.log_text())
        assert retry.json()["process"] == first.json()["process"], retry.body
        after = d.invoke("sb-lane", {})
        assert after.status == 200, after.body
        # first, A, the retry and this one: B's frame from the killed daemon never ran.
        assert (retry.json()["calls"], after.json()["calls"]) == (3, 4), (retry.body, after.body)
    finally:
        d.stop()


def wait_for_log(d: Torpord, function: str, line: str, timeout: float = 30.0) -> None:
    """Until an instance of `function` printed `line` (its log has its stdout and stderr)."""
    deadline = time.monotonic() + timeout
    logs = d.state / "logs" / function
    while not any(line in log.read_text(errors="replace").splitlines() for log in logs.glob("*.log")):
        assert time.monotonic() < deadline, f"no {line!r} from {function} within {timeout} s\n{d.log_text()}"
        time.sleep(0.05)


def invoke_in_thread_of(
    d: Torpord, name: str, request: Any, key: str | None
) -> tuple[threading.Thread, list[Answer | BaseException]]:
    out: list[Answer | BaseException] = []

    def go() -> None:
        try:
            out.append(d.invoke(name, request, timeout=60, key=key))
        except BaseException as e:  # noqa: BLE001 (the test reads what happened)
            out.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, out
