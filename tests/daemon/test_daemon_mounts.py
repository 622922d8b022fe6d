"""A worker's mount namespace (issue 19), through the real daemon with its state dir on a tmpfs:
the worker has its own /dev/shm and /tmp and none of the host's memory filesystems; the state
dir and the function's directory (here under /tmp) reach it as bind mounts CRIU leaves out; no
snapshot file carries a byte of the host's tmpfs, whatever the host keeps there."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HostFiles, Torpor

from .conftest import FUNCTIONS, Torpord


@pytest.fixture(scope="module")
def torpord(torpor_bin: Path, criu_ready: None, host_files: HostFiles) -> Iterator[Torpord]:
    """A daemon whose whole root (state dir, sockets) is a tmpfs of its own."""
    root = Path(tempfile.mkdtemp(prefix="torpord-tmpfs-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "torpor-test-state", str(root)], check=True)
    d = Torpord(torpor_bin, root)
    try:
        yield d
    finally:
        d.stop()
        subprocess.run(["umount", "--lazy", str(root)], check=False)
        root.rmdir()


def wait_stage(torpord: Torpord, stage: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(i["stage"] == stage for i in torpord.instances("peek")):
        assert time.monotonic() < deadline, f"no {stage} instance\n{torpord.log_text()}"
        time.sleep(0.05)


def peek(torpord: Torpord, host_files: HostFiles) -> tuple[str | None, Any]:
    r = torpord.invoke("peek", {"paths": [str(m) for m in host_files.markers]})
    assert r.status == 200, (r.status, r.body, torpord.log_text())
    return r.start, r.json()


def assert_sees_only_its_own(answer: Any, host_files: HostFiles) -> None:
    assert answer["seen"] == {str(m): None for m in host_files.markers}, answer
    assert answer["shm"] == ["peek-own"], answer
    assert "peek-own" in answer["tmp"] and not any(n.startswith("torpor-host-tmpfs-") for n in answer["tmp"]), answer


def test_on_a_tmpfs_state_dir_a_worker_deploys_restores_and_hibernates_seeing_nothing_of_the_host(
    torpord: Torpord, host_files: HostFiles, tmp_path: Path, torpor: Torpor
) -> None:
    fdir = tmp_path / "peek"  # under /tmp, which the worker has a tmpfs of its own over
    shutil.copytree(FUNCTIONS / "peek", fdir)
    torpord.deploy(fdir)

    start, first = peek(torpord, host_files)
    assert start == "restored" and first["calls"] == 1, (start, first)
    assert_sees_only_its_own(first, host_files)

    wait_stage(torpord, "hibernated")
    snapshots = torpord.state / "snapshots"
    assert host_files.files_holding_secret(snapshots) == []
    dirs = [p.parent for p in snapshots.rglob("manifest.json")]
    assert len(dirs) >= 3, dirs  # base, function, hibernation (consumed when it wakes)
    for d in dirs:
        tars = sum(p.stat().st_size for p in d.glob("tmpfs-*.img"))
        assert tars < 1 << 20, f"{d}: {tars} bytes of archived tmpfs"
        lines = torpor.ok("inspect", d).stdout.splitlines()
        archived = next(line for line in lines if line.startswith("archived"))
        points = {p.removesuffix(" (tmpfs)") for p in archived.removeprefix("archived  ").split(", ")}
        # The unprivileged worker's own tmpfs (its scratch /var/tmp and its /run too), and its veils: a tmpfs
        # over each directory others cannot enter on the way to what it needs (docs/security.md;
        # here /root, where pyenv keeps the interpreter).
        own = {"/dev/shm", "/tmp", "/var/tmp", "/run"}
        assert own <= points, (d, lines)
        for veil in points - own:
            assert os.stat(veil).st_mode & 0o001 == 0, (veil, d, lines)
        external = next((line for line in lines if line.startswith("external")), "")
        for host in ("/dev/shm ", str(host_files.tmp_tmpfs), str(host_files.other_tmpfs)):
            assert host not in external, (d, external)
        assert str(torpord.state) in external, (d, external)

    start, woken = peek(torpord, host_files)
    assert woken["calls"] == 2, (start, woken)  # its memory came back from the hibernation
    assert_sees_only_its_own(woken, host_files)


def test_serve_refuses_a_noexec_state_dir_in_one_line_with_the_fix(torpor_bin: Path, tmp_path: Path) -> None:
    point = tmp_path / "noexec"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=1m", "torpor-test-noexec", str(point)], check=True)
    try:
        r = subprocess.run(
            [torpor_bin, "serve", "--state-dir", point / "state", "--socket", tmp_path / "s.sock"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        subprocess.run(["umount", "--lazy", str(point)], check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "is mounted noexec" in lines[0] and f"mount -o remount,exec {point}" in lines[0], lines
