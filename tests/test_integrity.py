"""A damaged or forged snapshot is refused before anything is restored."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Torpor, Workers, pids_with


@dataclass(frozen=True)
class Pristine:
    snap: Path
    token: str  # appears in the command line of anything restored from this snapshot


@pytest.fixture(scope="module")
def pristine(
    torpor: Torpor, criu_ready: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pristine]:
    base = tmp_path_factory.mktemp("integrity")
    ws = Workers(torpor, base)
    try:
        w = ws.server()
        assert w.ask("incr") == "1"
        snap = base / "snap"
        torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
        w.wait_gone()
        yield Pristine(snap, ws.token)
    finally:
        ws.cleanup()


@pytest.fixture
def snap(pristine: Pristine, tmp_path: Path) -> Path:
    """A private copy of the snapshot, free to damage."""
    copy = tmp_path / "snap"
    shutil.copytree(pristine.snap, copy)
    return copy


def biggest_file(snap: Path) -> Path:
    files = [p for p in snap.rglob("*") if p.is_file() and p.name != "manifest.json"]
    return max(files, key=lambda p: p.stat().st_size)


def assert_refused(torpor: Torpor, snap: Path, pristine: Pristine, *must_name: str) -> None:
    """verify fails and restore refuses, each with one error line naming `must_name`, and no
    process was started."""
    for args in (("verify", snap), ("restore", snap, "--detach")):
        line = torpor.fails(*args)
        for word in must_name:
            assert word in line, f"`torpor {args[0]}` error does not name {word!r}: {line}"
    assert pids_with(pristine.token) == [], "a refused restore started a process"


def test_untouched_copy_verifies(torpor: Torpor, snap: Path) -> None:
    assert "ok" in torpor.ok("verify", snap).stdout.lower()


def test_flipped_byte_is_refused(torpor: Torpor, snap: Path, pristine: Pristine) -> None:
    victim = biggest_file(snap)
    assert victim.name.startswith("pages-"), f"expected CRIU pages to be the biggest file, got {victim}"
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert_refused(torpor, snap, pristine, victim.name)


def test_truncated_file_is_refused(torpor: Torpor, snap: Path, pristine: Pristine) -> None:
    victim = biggest_file(snap)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    assert_refused(torpor, snap, pristine, victim.name, "size")


def test_missing_manifest_is_not_a_snapshot(torpor: Torpor, snap: Path, pristine: Pristine) -> None:
    (snap / "manifest.json").unlink()
    assert_refused(torpor, snap, pristine, "not a torpor snapshot")
    assert "not a torpor snapshot" in torpor.fails("inspect", snap)


def test_path_outside_the_snapshot_is_refused(torpor: Torpor, snap: Path, pristine: Pristine) -> None:
    manifest = snap / "manifest.json"
    doc = json.loads(manifest.read_text())
    files = doc["files"]
    files[0]["path"] = "../etc/passwd"
    manifest.write_text(json.dumps(doc, indent=2))
    assert_refused(torpor, snap, pristine)


def test_gpu_map_for_a_cpu_snapshot_is_refused(torpor: Torpor, snap: Path, pristine: Pristine) -> None:
    """An option that cannot apply is rejected, never silently ignored."""
    line = torpor.fails("restore", snap, "--detach", "--gpu", "0=0")
    assert "--gpu" in line and "no GPU state" in line, line
    line = torpor.fails("restore", snap, "--detach", "--gpu", "zero")
    assert "OLD=NEW" in line, line
    assert pids_with(pristine.token) == [], "a refused restore started a process"


def forge_page(torpor: Torpor, snap: Path) -> Path:
    """What a writer without the key does (issue 20): rewrite a byte of the biggest page file and
    recompute its hash in the manifest, so that every listed hash agrees again. The new hash is
    the one `torpor verify` reports for the changed file (what any writer can compute)."""
    victim = max(snap.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    line = torpor.fails("verify", snap)
    found = re.search(r"hash mismatch \(expected ([0-9a-f]{64}), got ([0-9a-f]{64})\)", line)
    assert found, "verify did not report the changed file's hash"
    manifest = snap / "manifest.json"
    doc = json.loads(manifest.read_text())
    rel = str(victim.relative_to(snap))
    (entry,) = [f for f in doc["files"] if f["path"] == rel]
    assert entry["blake3"] == found.group(1)
    entry["blake3"] = found.group(2)
    manifest.write_text(json.dumps(doc, indent=2) + "\n")
    return victim


def test_a_page_rewritten_with_its_hash_recomputed_is_refused(
    torpor: Torpor, snap: Path, pristine: Pristine
) -> None:
    forge_page(torpor, snap)
    assert_refused(torpor, snap, pristine, "changed after", str(snap))
    # Unkeyed, the forgery passes (the hashes agree), and the output says what was not checked.
    out = torpor.ok("verify", "--unkeyed", snap).stdout
    assert "ok" in out and "unkeyed" in out, out


@pytest.mark.parametrize(
    "field",
    ["criu_version", "stdio_files", "external_mounts", "root_pid", "kernel"],
)
def test_a_changed_field_no_hash_covers_is_refused(
    torpor: Torpor, snap: Path, pristine: Pristine, field: str
) -> None:
    manifest = snap / "manifest.json"
    doc = json.loads(manifest.read_text())
    if field == "criu_version":
        doc["host"]["criu_version"] = "9.9.9"
    elif field == "kernel":
        doc["host"]["kernel"] = "0.0.0"
    elif field == "stdio_files":
        doc["stdio_files"] = [{"path": "/etc/shadow", "key": "etc/shadow"}]
    elif field == "external_mounts":
        doc["external_mounts"] = [{"key": "planted", "path": "/"}]
    else:
        doc["source"]["root_pid"] = 1
    manifest.write_text(json.dumps(doc, indent=2) + "\n")
    assert_refused(torpor, snap, pristine, "changed after")


def test_a_snapshot_without_its_mac_is_refused_unless_unkeyed(
    torpor: Torpor, snap: Path, pristine: Pristine
) -> None:
    inspected = torpor.ok("inspect", snap).stdout
    assert "seal" in inspected and "authentic" in inspected, inspected
    (snap / "manifest.mac").unlink()
    assert_refused(torpor, snap, pristine, "no MAC", "--unkeyed")
    assert "unkeyed" in torpor.ok("inspect", snap).stdout
    out = torpor.ok("verify", "--unkeyed", snap).stdout
    assert "unkeyed" in out, out


def test_a_snapshot_sealed_by_another_key_is_refused(
    torpor: Torpor, snap: Path, pristine: Pristine, tmp_path: Path
) -> None:
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    for args in (("verify", "--key", other, snap), ("restore", "--key", other, snap, "--detach")):
        line = torpor.fails(*args)
        assert "another key" in line and str(other) in line, line
    assert pids_with(pristine.token) == [], "a refused restore started a process"
    # A key others can read is no key.
    other.chmod(0o644)
    line = torpor.fails("verify", "--key", other, snap)
    assert "chmod 600" in line, line
