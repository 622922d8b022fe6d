"""`torpor stop NAME` (POST /v1/functions/{name}/stop) through the real daemon, real workers and
real CRIU: every live instance of a function goes, the deploy stays, and the next request
restores a fresh instance from the function snapshot.

One daemon serves the module; the tests build on each other's deploys: examples/cpu-mlp (boots
the shared base), then tests/daemon/functions/echoer and sleepy on the same base.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from conftest import ROOT, alive

from .conftest import FUNCTIONS, Answer, Torpord

CPU_MLP = ROOT / "examples" / "cpu-mlp"
X16 = [float(i % 5) - 2.0 for i in range(16)]


def wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), f"still alive: {[p for p in pids if alive(p)]}"


def test_stop_ends_the_idle_instance_and_the_next_invoke_restores_again(torpord: Torpord) -> None:
    torpord.deploy(CPU_MLP)
    first = torpord.invoke("cpu-mlp", {"x": X16})
    assert first.status == 200 and first.start == "restored", first.body
    assert torpord.invoke("cpu-mlp", {"x": X16}).start == "warm"
    [inst] = torpord.instances("cpu-mlp")
    before = torpord.request("GET", "/v1/functions/cpu-mlp").json()

    r = torpord.cli("stop", "cpu-mlp")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("stopped cpu-mlp: 1 idle instance stopped"), r.stdout
    assert inst["id"] in r.stdout, r.stdout
    wait_gone([inst["pid"]])
    assert torpord.instances("cpu-mlp") == []

    # The deploy is untouched: the same snapshot serves a freshly restored instance.
    again = torpord.invoke("cpu-mlp", {"x": X16})
    assert again.status == 200 and again.start == "restored", (again.status, again.body)
    assert again.json() == first.json()
    assert "restore" in again.timings, again.timings
    after = torpord.request("GET", "/v1/functions/cpu-mlp").json()
    assert after["state"] == "ready" and after["snapshot"] == before["snapshot"], (before, after)

    # With nothing live, stop answers empty lists.
    torpord.cli("stop", "cpu-mlp")
    empty = torpord.cli("stop", "cpu-mlp", "--json")
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout) == {"function": "cpu-mlp", "stopped": [], "retiring": [], "discarded": []}


def test_a_busy_instance_finishes_its_request_then_stops(torpord: Torpord) -> None:
    torpord.deploy(FUNCTIONS / "echoer")
    answers: list[Answer] = []
    slow = threading.Thread(target=lambda: answers.append(torpord.invoke("echoer", {"say": "slow", "sleep": 2.0})))
    slow.start()
    deadline = time.monotonic() + 20
    while not any(i["stage"] == "warm" and i["pid"] for i in torpord.instances("echoer")):
        assert time.monotonic() < deadline, torpord.log_text()
        time.sleep(0.05)
    time.sleep(0.3)  # its request is in the handler's sleep now
    [busy] = torpord.instances("echoer")

    r = torpord.request("POST", "/v1/functions/echoer/stop", {})
    assert r.status == 200, r.body
    assert r.json() == {"function": "echoer", "stopped": [], "retiring": [busy["id"]], "discarded": []}
    assert alive(busy["pid"]), "a busy instance must finish its request first"

    slow.join(timeout=30)
    assert answers and answers[0].status == 200 and answers[0].json() == {"said": "slow"}, answers
    wait_gone([busy["pid"]])
    nxt = torpord.invoke("echoer", {"say": "next"})
    assert nxt.status == 200 and nxt.start == "restored", (nxt.status, nxt.body)
    assert [i["id"] for i in torpord.instances("echoer")] != [busy["id"]]


def wait_hibernated(torpord: Torpord, name: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        instances = torpord.instances(name)
        if len(instances) == 1 and instances[0]["stage"] == "hibernated":
            return instances[0]
        assert time.monotonic() < deadline, f"no hibernated instance: {instances}\n{torpord.log_text()}"
        time.sleep(0.05)


def test_stop_discards_hibernated_instances_unless_told_to_keep_them(torpord: Torpord) -> None:
    torpord.deploy(FUNCTIONS / "sleepy")
    assert torpord.invoke("sleepy", {"add": 5}).json() == {"calls": 1, "total": 5}
    inst = wait_hibernated(torpord, "sleepy")
    hib = sorted((torpord.state / "snapshots").glob("hib-sleepy-*"))
    assert len(hib) == 1, hib

    kept = torpord.cli("stop", "sleepy", "--keep-hibernated", "--json")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["discarded"] == []
    assert [i["id"] for i in torpord.instances("sleepy")] == [inst["id"]] and hib[0].exists()

    r = torpord.cli("stop", "sleepy")
    assert r.returncode == 0, r.stderr
    assert f"1 hibernated discarded ({inst['id']})" in r.stdout, r.stdout
    assert torpord.instances("sleepy") == []
    assert not hib[0].exists(), "the hibernation snapshot was left on disk"

    # Not woken (it would remember its calls): a fresh restore of the function snapshot.
    fresh = torpord.invoke("sleepy", {"add": 1})
    assert fresh.status == 200 and fresh.start == "restored", fresh.body
    assert fresh.json() == {"calls": 1, "total": 1}


def test_stop_of_an_unknown_function_is_one_clear_line(torpord: Torpord) -> None:
    r = torpord.cli("stop", "no-such-fn")
    assert r.returncode == 1, r
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "no function named \"no-such-fn\"" in r.stderr and "torpor ls" in r.stderr, r.stderr
    http = torpord.request("POST", "/v1/functions/no-such-fn/stop")
    assert http.status == 404, http.body

    bad = torpord.request("POST", "/v1/functions/cpu-mlp/stop", {"keep": True})
    assert bad.status == 400 and "keep_hibernated" in bad.json()["error"], bad.body
