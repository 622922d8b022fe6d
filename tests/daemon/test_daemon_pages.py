"""Torpor's page server through the real daemon (docs/lazy-pages.md): `restore_server.pages`'s
default serves CPU functions' restores with it; a deploy records the order its profiling
restore faults pages in, and later restores serve that as their hot set; a page server that
dies never leaves an instance running on missing memory.

tests/daemon/functions/ballast answers with the digest of 48 MiB of seeded random bytes, so an
answer is right only if every page came back intact (a uffd released with pages missing would
have the kernel fill them with zeros: a wrong digest).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import cmdline, pids_with, wait_until

from .conftest import Torpord
from .test_daemon_crash import in_tree
from .test_daemon_stage import BALLAST, EXPECTED, restores

STATS = "TORPOR_PAGE_SERVER_STATS"


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")


def stats_of(path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def page_servers(d: Torpord) -> list[int]:
    return [p for p in pids_with(f"{d.state}/logs/lazy-") if "__page-server" in cmdline(p)]


def phase(lines: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((line for line in lines if line.get("phase") == name and "error" not in line), None)


@pytest.mark.parametrize("threads", [None, 1])
def test_a_deploy_records_the_page_profile_and_later_restores_serve_it_first(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, threads: int | None
) -> None:
    """A deploy records its snapshot's page profile; a later restore serves it first, and the rest
    in the background: in batches on several threads by default, serially with
    `restore_server.background_threads = 1`."""
    needs_root()
    stats = tmp_path / "stats.jsonl"
    config = "[restore_server]\nstage_bytes = 1073741824\n"
    if threads is not None:
        config += f"background_threads = {threads}\n"
    d = Torpord(torpor_bin, tmp_path, config=config, env={STATS: str(stats)})
    try:
        lines = d.deploy(BALLAST)
        recorded = phase(lines, "profile")
        assert recorded is not None and recorded["ranges"] > 0 and recorded["bytes"] > 0, lines
        snap = lines[-1]["result"]["snapshot"]
        profile = d.state / "profiles" / f"{snap}.pages"
        assert profile.read_text().strip(), profile
        # The profiling restore: faults only, nothing copied in the background, no hot set yet.
        [profiling] = stats_of(stats)
        assert profiling["faults"] > 0 and profiling["hot_pages"] == 0 and profiling["background_pages"] == 0, profiling
        assert page_servers(d) == [], "the profiling restore's page server was left running"

        first = d.invoke("ballast", {})
        assert first.status == 200 and first.start == "restored", (first.status, first.body, d.log_text())
        assert first.json() == EXPECTED
        assert restores(d)[-1] == ("ballast", "Lazy", True), d.log_text()
        # The server appends its counters once every page is in.
        wait_until(lambda: len(stats_of(stats)) == 2, 30, "the restore's page server to end")
        served = stats_of(stats)[1]
        assert served["hot_pages"] > 0, served
        assert served["background_pages"] > 0, served
        assert (served["background_batches"] > 0) == (threads is None), served
        assert page_servers(d) == []

        # The profile goes with its snapshot.
        r = d.cli("rm", "ballast")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: not profile.exists(), 10, "the profile to be removed with its snapshot")
    finally:
        d.stop()


@pytest.mark.parametrize("when", ["before-the-wake", "mid-request"])
def test_a_page_server_that_dies_never_leaves_an_instance_on_missing_memory(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, when: str
) -> None:
    """Every page server of this daemon stops after a number of pages ($TORPOR_PAGE_SERVER_FAULT).
    before-the-wake: 2,048 (8 MiB of ballast's 48), which its background copy reaches within
    milliseconds of CRIU's restore: the restore fails with the server's one error line, its
    tree killed, and the request is served by a booted instance. mid-request: 4,096 without a
    background copy ($TORPOR_PAGE_SERVER_BACKGROUND=off), so the server dies while the restored
    instance reads ballast's data for the request; its uffds held by the daemon, the reading
    thread waits instead of reading zeros, and the instance is killed and removed with one line.
    Either way, never an answer from memory the server did not serve (a wrong digest)."""
    needs_root()
    env = {"TORPOR_PAGE_SERVER_FAULT": "2048"}
    if when == "mid-request":
        env = {"TORPOR_PAGE_SERVER_FAULT": "4096", "TORPOR_PAGE_SERVER_BACKGROUND": "off"}
    d = Torpord(torpor_bin, tmp_path, config="[restore_server]\nstage_bytes = 0\n", env=env)
    try:
        d.deploy(BALLAST)
        answer = d.invoke("ballast", {})
        if answer.status == 200:
            assert answer.json() == EXPECTED, "an instance answered from memory its page server never served"
        log = d.log.read_text(errors="replace")
        if when == "before-the-wake":
            assert answer.start == "booted", (answer.status, answer.start, answer.body, d.log_text())
        if answer.start == "booted":
            # The server died before the worker reconnected (where it dies on this machine: its
            # background copy reaches 8 MiB within milliseconds; mid-request, where the deploy's
            # profile took in ballast's pages and the hot set reaches the switch): the restore
            # failed as a whole.
            assert answer.status == 200, (answer.status, answer.body, d.log_text())
            failed = [line for line in log.splitlines() if "restoring the function snapshot failed" in line]
            assert len(failed) == 1, failed
            assert re.search(r"torpor's page server failed .*TORPOR_PAGE_SERVER_FAULT", failed[0]), failed[0]
        else:
            # After: the instance is removed with one line, its request failed with the cause.
            # (The whole log on failure: CI once saw a 200 here, not reproduced since.)
            assert answer.status != 200, (answer.status, answer.start, answer.body, d.log_text())
            # The cause, not a crash: the instance is removed before its tree is killed.
            assert b"its lazy pages failed" in answer.body, (answer.status, answer.start, answer.body, d.log_text())
            try:
                wait_until(lambda: d.log.read_text(errors="replace").count("its lazy pages failed") == 1, 15, "the removal")
            except AssertionError as e:
                raise AssertionError(f"{e}; the answer: {answer.status} {answer.body!r}\n{d.log_text()}") from None
            wait_until(lambda: d.instances("ballast") == [], 15, "the instance to go")
        wait_until(lambda: page_servers(d) == [], 10, "the page servers to be reaped")
        # Nothing of the failed restore is left: the daemon's processes are its instances'.
        inits = {int(i["pid"]) for i in d.instances("ballast")}
        strays = [p for p in pids_with(f"{d.state}/init/") if not in_tree(p, inits)]
        assert strays == [], [cmdline(p) for p in strays]
    finally:
        d.stop()


def test_an_instance_whose_pages_were_pending_when_the_daemon_died_is_not_re_adopted(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """The daemon's page servers run without their background copy
    ($TORPOR_PAGE_SERVER_BACKGROUND=off), so a restored instance's pages stay pending for as long
    as it lives. The daemon is killed; the next one kills the server (a process of the earlier
    daemon outside every instance tree), after which the kernel would fill the instance's
    unserved pages with zeros. So it kills that instance and removes its row instead of
    re-adopting it, with one line; the next request restores a fresh one."""
    needs_root()
    d = Torpord(torpor_bin, tmp_path, config="[restore_server]\nstage_bytes = 0\n", env={"TORPOR_PAGE_SERVER_BACKGROUND": "off"})
    try:
        d.deploy(BALLAST)
        first = d.invoke("ballast", {})
        assert first.status == 200 and first.start == "restored" and first.json() == EXPECTED, (first.status, first.body)
        (inst,) = d.instances("ballast")
        assert (d.state / "pages-pending" / inst["id"]).exists()
        d.proc.kill()
        d.proc.wait()
        again = d.restart()
        assert "killed an instance whose page server was still serving its memory" in again.log_text(), again.log_text()
        wait_until(lambda: not Path(f"/proc/{inst['pid']}").exists(), 10, "the instance's tree to be killed")
        assert again.instances("ballast") == []
        assert not (again.state / "pages-pending" / inst["id"]).exists()
        r = again.invoke("ballast", {})
        assert r.status == 200 and r.start == "restored" and r.json() == EXPECTED, (r.status, r.body)
    finally:
        d.stop()
