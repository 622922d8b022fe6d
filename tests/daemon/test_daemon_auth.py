"""Only snapshots the daemon sealed are restored (issue 20, item 1), through the real daemon, real
workers and real CRIU.

Another writer (issue 20 found function code running as root doing this) rewrites a byte of a
deployed function's page file and recomputes its hash in manifest.json, or changes a manifest
field no file hash covers, or removes the MAC: every listed hash still agrees, so only the MAC
under the daemon's key (<state>/snapshot.key) can tell. The restore is refused with one line and
the function boots instead; it never runs the planted memory. tests/daemon/functions/ballast
answers with the digest of 48 MiB of seeded random bytes, so a planted page would show.
The tests run in file order and share one daemon and one deploy.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import kill_tree, wait_until

from .conftest import Torpord
from .test_daemon_stage import BALLAST, EXPECTED, copies, largest_pages_file, phases, stage_dir

REFUSED = "changed after its writer sealed it"


@pytest.fixture(scope="module")
def sealed(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces, runs CRIU and mounts a tmpfs")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("sealed"), config="[restore_server]\nstage_bytes = 1073741824\n")
    try:
        d.deploy(BALLAST)
        yield d
    finally:
        d.stop()


def function_snapshot(d: Torpord) -> Path:
    (snap,) = [p for p in (d.state / "snapshots").iterdir() if p.name.startswith("fn-ballast-")]
    return snap


def staged_copy(d: Torpord) -> Path:
    (copy,) = copies(d)
    return stage_dir(d) / copy


def refusals(d: Torpord, snap: Path) -> list[str]:
    """The daemon's log lines that say a restore of `snap` was refused by its MAC."""
    return [
        line
        for line in d.log.read_text(errors="replace").splitlines()
        if str(snap) in line and ("no MAC" in line or REFUSED in line)
    ]


def invoke_fresh(d: Torpord) -> tuple[str | None, dict[str, Any]]:
    """Kills ballast's live instances, invokes it once: (how the instance started, its answer)."""
    for inst in d.instances("ballast"):
        kill_tree(inst["pid"])
    wait_until(lambda: d.instances("ballast") == [], 15, "ballast's instances to go")
    answer = d.invoke("ballast", {})
    assert answer.status == 200, (answer.status, answer.body, d.log_text())
    return answer.start, dict(answer.json())


def forge_page(d: Torpord, snap: Path) -> None:
    """Flips a byte in the middle of the biggest page file, then writes the changed file's hash
    (as `torpor verify --unkeyed` reports it: what any writer can compute) into the manifest."""
    pages = largest_pages_file(snap)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    r = d.cli("verify", "--unkeyed", snap)
    found = re.search(r"hash mismatch \(expected ([0-9a-f]{64}), got ([0-9a-f]{64})\)", r.stderr)
    assert r.returncode == 1 and found, r.stderr
    manifest = snap / "manifest.json"
    doc = json.loads(manifest.read_text())
    (entry,) = [f for f in doc["files"] if f["path"] == pages.name]
    entry["blake3"] = found.group(2)
    manifest.write_text(json.dumps(doc, indent=2) + "\n")


def saved(snap: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in snap.iterdir() if p.is_file()}


def put_back(files: dict[Path, bytes]) -> None:
    for path, data in files.items():
        path.write_bytes(data)


def test_the_key_is_private_and_every_snapshot_is_sealed(sealed: Torpord) -> None:
    key = sealed.state / "snapshot.key"
    st = key.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0 and st.st_size == 32, st
    snapshots = list((sealed.state / "snapshots").iterdir())
    assert any(p.name.startswith("base-") for p in snapshots), snapshots
    for snap in [*snapshots, staged_copy(sealed)]:
        r = sealed.cli("verify", "--key", key, snap)
        assert r.returncode == 0 and "sealed by key" in r.stdout, (snap, r.stdout, r.stderr)
    start, answer = invoke_fresh(sealed)
    assert (start, answer) == ("restored", EXPECTED)


def test_a_staged_copy_with_a_changed_field_is_refused_and_the_function_boots(sealed: Torpord) -> None:
    copy = staged_copy(sealed)
    files = saved(copy)
    manifest = copy / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["host"]["criu_version"] = "9.9.9"
    doc["stdio_files"] = [{"path": "/etc/shadow", "key": "etc/shadow"}]
    manifest.write_text(json.dumps(doc, indent=2) + "\n")
    try:
        start, answer = invoke_fresh(sealed)
        assert (start, answer) == ("booted", EXPECTED)
        assert len(refusals(sealed, copy)) == 1, sealed.log_text()
    finally:
        put_back(files)


def test_a_staged_copy_without_its_mac_is_refused_and_the_function_boots(sealed: Torpord) -> None:
    copy = staged_copy(sealed)
    files = saved(copy)
    (copy / "manifest.mac").unlink()
    try:
        start, answer = invoke_fresh(sealed)
        assert (start, answer) == ("booted", EXPECTED)
        (line,) = [x for x in refusals(sealed, copy) if "no MAC" in x]
        assert "deploy the function again" in line, line
    finally:
        put_back(files)
    start, answer = invoke_fresh(sealed)
    assert (start, answer) == ("restored", EXPECTED), "the untouched copy restores again"


def test_a_page_rewritten_and_rehashed_by_another_writer_is_never_restored(sealed: Torpord) -> None:
    """The issue's reproduction: the disk copy forged, then a daemon restart (which stages the
    disk copy again), then an invoke."""
    snap = function_snapshot(sealed)
    files = saved(snap)
    forge_page(sealed, snap)
    try:
        # Every listed hash agrees: integrity alone accepts the forgery.
        r = sealed.cli("verify", "--unkeyed", snap)
        assert r.returncode == 0 and "unkeyed" in r.stdout, r.stderr
        r = sealed.cli("verify", "--key", sealed.state / "snapshot.key", snap)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and REFUSED in lines[0], r.stderr
        sealed.proc.send_signal(signal.SIGTERM)
        sealed.proc.wait(timeout=30)
        again = sealed.restart()
        wait_until(
            lambda: "cannot stage the function snapshot again" in again.log.read_text(errors="replace"),
            30,
            "the refused re-staging",
        )
        assert copies(again) == []
        start, answer = invoke_fresh(again)
        assert (start, answer) == ("booted", EXPECTED), "the planted page must never run"
        # Refused when staging and when restoring, one line each.
        assert len(refusals(again, snap)) >= 2, again.log_text()
    finally:
        put_back(files)


def test_a_base_the_key_did_not_seal_is_booted_again_at_the_next_deploy(sealed: Torpord) -> None:
    """A refused base would fail every deploy on it: the deploy boots a new one instead."""
    (base,) = [p for p in (sealed.state / "snapshots").iterdir() if p.name.startswith("base-")]
    manifest = base / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["host"]["kernel"] = "0.0.0"
    manifest.write_text(json.dumps(doc, indent=2) + "\n")
    lines = sealed.deploy(BALLAST)
    assert phases(lines)[:3] == ["validate", "boot_base", "snapshot_base"], lines
    assert "not reusing the base snapshot" in sealed.log.read_text(errors="replace")
    r = sealed.cli("verify", "--key", sealed.state / "snapshot.key", base)
    assert r.returncode == 0, r.stderr
    start, answer = invoke_fresh(sealed)
    assert (start, answer) == ("restored", EXPECTED)
