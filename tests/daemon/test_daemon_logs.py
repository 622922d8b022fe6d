"""Per-instance logs through the real daemon, real workers and real CRIU: every restored
instance gets its own stdout and stderr, so functions that share a base, and instances of one
function, never see each other's output."""

from __future__ import annotations

import json
import threading
from typing import Any

from .conftest import FUNCTIONS, Answer, Torpord

SLEEPY = FUNCTIONS / "sleepy"
ECHOER = FUNCTIONS / "echoer"


def logs(torpord: Torpord, name: str, query: str = "") -> list[dict[str, Any]]:
    r = torpord.request("GET", f"/v1/functions/{name}/logs{query}")
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["function"] == name, doc
    return list(doc["files"])


def test_functions_on_one_base_and_instances_of_one_function_have_separate_logs(torpord: Torpord) -> None:
    torpord.deploy(SLEEPY)
    lines = torpord.deploy(ECHOER)
    assert lines[-1]["result"]["base_reused"] is True, lines  # the two share a base

    assert torpord.invoke("sleepy", {"add": 1}).json() == {"calls": 1, "total": 1}
    # Two overlapping requests with a pause: the second cannot wait for the first's instance.
    answers: dict[str, Answer] = {}

    def say(word: str) -> None:
        answers[word] = torpord.invoke("echoer", {"say": word, "sleep": 2.0})

    threads = [threading.Thread(target=say, args=(w,)) for w in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert {w: a.json() for w, a in answers.items()} == {"alpha": {"said": "alpha"}, "beta": {"said": "beta"}}, {
        w: a.body for w, a in answers.items()
    }
    instances = {i["id"] for i in torpord.instances("echoer")}
    assert len(instances) == 2, instances

    files = logs(torpord, "echoer")
    by_instance = {f["instance"]: f for f in files if f["instance"] is not None}
    assert set(by_instance) == instances, files
    said = {}
    for inst, f in by_instance.items():
        assert f["path"] == str(torpord.state / "logs" / "echoer" / f"{inst}.log"), f
        words = [w for w in ("alpha", "beta") if f"echoer says {w}" in f["tail"]]
        assert len(words) == 1, f  # each instance shows its own request, not the other's
        assert f"echoer stderr {words[0]}" in f["tail"], f  # stderr goes there too
        assert "sleepy" not in f["tail"], f
        said[inst] = words[0]
    assert sorted(said.values()) == ["alpha", "beta"], said
    # The deploy's load phase (setup) has its own file; instances restored from the function
    # snapshot do not repeat it.
    deploys = [f for f in files if f["instance"] is None]
    assert len(deploys) == 1 and "echoer setup" in deploys[0]["tail"], files
    assert all("echoer setup" not in f["tail"] for f in by_instance.values()), files
    # Most recently written first.
    assert [f["modified_ms"] for f in files] == sorted((f["modified_ms"] for f in files), reverse=True), files

    sleepy = logs(torpord, "sleepy")
    assert [f for f in sleepy if f["instance"] is not None], sleepy
    for f in sleepy:
        assert "echoer" not in f["tail"], f
    assert any("sleepy call 1" in f["tail"] for f in sleepy if f["instance"]), sleepy

    # --instance shows one instance's file; the CLI names the instance in each header.
    one, word = next(iter(said.items()))
    r = torpord.cli("logs", "echoer", "--instance", one)
    assert r.returncode == 0, r.stderr
    assert f"==> instance {one}: " in r.stdout and f"echoer says {word}" in r.stdout, r.stdout
    assert r.stdout.count("==> ") == 1, r.stdout
    r = torpord.cli("logs", "echoer", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["files"]) == 3, r.stdout
    r = torpord.cli("logs", "echoer", "--instance", "echoer-0-0")
    assert r.returncode == 1 and "no log of an instance" in r.stderr, (r.stdout, r.stderr)
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert torpord.request("GET", "/v1/functions/echoer/logs?bogus=1").status == 400

    r = torpord.cli("rm", "echoer")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert not (torpord.state / "logs" / "echoer").exists()
    assert (torpord.state / "logs" / "sleepy").is_dir()  # the other function's logs stay
