"""`torpor push` and `torpor pull` against a real SeaweedFS on loopback: a snapshot pushed from
one chunk store and pulled into another restores and carries on; chunks travel once in each
direction; credentials errors are one line. (Corrupt objects and a server that goes away
mid-pull: crates/torpor-objstore/tests/seaweedfs.rs.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Endpoint, Torpor, Workers
from objstore_server import Seaweed, running_seaweed


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    yield from running_seaweed(tmp_path_factory.mktemp("seaweedfs"), "snapshots")


def report(torpor: Torpor, *args: object) -> dict[str, object]:
    r = torpor.ok(*args, "--json")
    doc = json.loads(r.stdout)
    assert isinstance(doc, dict), r.stdout
    return doc


def test_push_pull_restore_on_another_store(
    torpor: Torpor, workers: Workers, seaweed: Seaweed, tmp_path: Path
) -> None:
    config = seaweed.config(tmp_path, "snapshots")
    w = workers.server()
    assert [w.ask("incr") for _ in range(3)] == ["1", "2", "3"]
    digest = w.ask("digest")
    first = tmp_path / "first"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", first, "--leave-running")
    assert w.ask("incr") == "4"
    second = tmp_path / "second"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", second)
    w.wait_gone()

    node1 = tmp_path / "node1-store"
    pushed = report(torpor, "push", first, "--store", node1, "--objstore", config)
    assert pushed["uploaded"] == pushed["chunks"] and pushed["chunks"] > 0, pushed
    again = report(torpor, "push", first, "--store", node1, "--objstore", config)
    assert again["uploaded"] == 0 and again["already_pushed"] is True, again
    # The second snapshot of the same process shares most of its pages with the first.
    pushed2 = report(torpor, "push", second, "--store", node1, "--objstore", config)
    assert 0 < pushed2["uploaded"] < pushed2["chunks"], pushed2

    node2 = tmp_path / "node2-store"
    pulled = report(torpor, "pull", "first", "--store", node2, "--objstore", config, "--out", tmp_path / "p1")
    assert pulled["fetched"] == pushed["chunks"], pulled
    pulled2 = report(torpor, "pull", "second", "--store", node2, "--objstore", config, "--out", tmp_path / "p2")
    assert pulled2["fetched"] == pushed2["uploaded"], pulled2
    assert pulled2["local"] == pulled2["chunks"] - pulled2["fetched"], pulled2
    torpor.ok("verify", tmp_path / "p2")

    r = workers.restore(tmp_path / "p1", endpoint=w.endpoint)
    assert r.ask("get") == "3"
    assert r.ask("digest") == digest
    assert r.ask("incr") == "4"


def test_push_and_pull_errors_are_one_line(
    torpor: Torpor, workers: Workers, seaweed: Seaweed, tmp_path: Path
) -> None:
    good = seaweed.config(tmp_path, "snapshots")
    w = workers.start(["sleep", "600"], endpoint=Endpoint(), ready=None, name="sleeper")
    snap = tmp_path / "sleeper"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    store = tmp_path / "store"

    bad = seaweed.config(tmp_path, "snapshots", secret="wrong", name="bad")
    line = torpor.fails("push", snap, "--store", store, "--objstore", bad)
    assert "refused the credentials" in line and "bad.credentials" in line, line

    (tmp_path / "bad.credentials").unlink()
    line = torpor.fails("pull", "sleeper", "--store", store, "--objstore", bad, "--out", tmp_path / "x")
    assert "cannot read the object store credentials file" in line, line

    secret_in_config = tmp_path / "leaky.toml"
    secret_in_config.write_text(good.read_text() + 'secret_access_key = "x"\n')
    line = torpor.fails("pull", "sleeper", "--store", store, "--objstore", secret_in_config, "--out", tmp_path / "x")
    assert "credentials never go in the configuration" in line, line

    line = torpor.fails("pull", "nope", "--store", store, "--objstore", good, "--out", tmp_path / "x")
    assert "snapshot nope is not in bucket snapshots" in line, line
    assert not (tmp_path / "x").exists()
