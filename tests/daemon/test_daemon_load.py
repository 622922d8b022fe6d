"""bench/reliability/load.py at a size for CI: mixed functions at the node's full concurrency with a
daemon restart in the middle, through the real daemon, workers and CRIU. Its clients send every
request with an Idempotency-Key and retry a reset one with it. A graceful restart (SIGTERM, then
`torpor serve` again) loses, duplicates and alters nothing; so does a kill -9: the requests in flight
at the kill are retried, and answered from the run that already happened (or run once, if the dead
daemon never handed them to a worker). The 10 000-invocation run is the benchmark's
(docs/reliability.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import ROOT


def load_bench() -> ModuleType:
    path = ROOT / "bench" / "reliability" / "load.py"
    spec = importlib.util.spec_from_file_location("reliability_load", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


load = load_bench()


def run(torpor_bin: Path, restart: str, invocations: int, seed: int) -> dict:
    args = argparse.Namespace(
        torpor=str(torpor_bin), invocations=invocations, concurrency=0, restart=restart, restart_at=0.5, seed=seed,
        keys=True,
    )
    return dict(load.run(args))


@pytest.fixture(autouse=True)
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")


def test_a_graceful_restart_under_load_loses_duplicates_and_alters_nothing(torpor_bin: Path, criu_ready: None) -> None:
    r = run(torpor_bin, "graceful", 800, seed=3)
    s = r["summary"]
    assert (s["lost_requests"], s["duplicated_requests"], s["wrong_answers"], s["unaccounted_errors"]) == (0, 0, 0, 0), r
    # Every request was answered 200: the restart's refusals were retried before anything was sent.
    assert s["errors"] == 0, r["errors"]
    assert sum(c.get("ok", 0) for c in r["per_function"].values()) == 800
    assert r["settings"]["restart"]["answered_before"] == 400


def test_a_killed_daemon_under_load_loses_duplicates_and_alters_nothing_for_keyed_clients(
    torpor_bin: Path, criu_ready: None
) -> None:
    r = run(torpor_bin, "kill", 600, seed=4)
    s = r["summary"]
    assert (s["lost_requests"], s["duplicated_requests"], s["wrong_answers"], s["unaccounted_errors"]) == (0, 0, 0, 0), r
    # The requests in flight at the kill (the clients keep 28 in flight) were retried with their
    # keys, and every one answered.
    assert r["requests_retried_after_reset"] > 0, r
    assert s["errors"] == 0, (r["errors"], r["error_samples"])
    assert sum(c.get("ok", 0) for c in r["per_function"].values()) == 600
    assert r["resets_sent_after_the_stop"] == 0, r
