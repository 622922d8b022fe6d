"""The mount namespace of `torpor run` (issue 19): the command has a /dev/shm of its own, which
its snapshot archives; the host's tmpfs mounts are external, so no snapshot carries their files
and no restored copy gets a stale private copy of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import PYTHON, HostFiles, Torpor, Workers, parse_pid, wait_until
from linesrv import Endpoint

LOOK = """
import os, sys, time
out, markers = sys.argv[1], sys.argv[2:]
open("/dev/shm/own-file", "w").write("mine")
def look(tag):
    seen = {m: os.path.exists(m) for m in markers}
    with open(out, "a") as f:
        f.write(f"{tag} {sorted(os.listdir('/dev/shm'))} {seen}\\n")
look("start")
while True:
    time.sleep(0.2)
    if os.path.exists(out + ".again"):
        os.unlink(out + ".again")
        look("again")
"""


def test_a_commands_snapshot_archives_its_own_shm_and_nothing_of_the_hosts(
    torpor: Torpor, workers: Workers, host_files: HostFiles, tmp_path: Path
) -> None:
    script = tmp_path / "look.py"
    script.write_text(LOOK)
    out = tmp_path / "seen.txt"
    markers = [str(m) for m in host_files.markers]
    w = workers.start([PYTHON, script, out, *markers], endpoint=Endpoint(), ready=out, name="look")
    first = out.read_text()
    assert "['own-file']" in first, first
    shm_marker = str(host_files.shm_marker)
    assert f"'{shm_marker}': False" in first, first
    # A tmpfs of the host elsewhere stays visible to a command (it may need it), live.
    assert f"'{host_files.other_tmpfs / 'marker'}': True" in first, first

    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    assert host_files.files_holding_secret(snap) == []
    tars = sum(p.stat().st_size for p in snap.glob("tmpfs-*.img"))
    assert tars < 1 << 20, f"{tars} bytes of archived tmpfs: the host's /dev/shm went in"
    inspect = torpor.ok("inspect", snap).stdout
    archived = next(line for line in inspect.splitlines() if line.startswith("archived"))
    assert archived.split()[1:] == ["/dev/shm", "(tmpfs)"], inspect
    assert str(host_files.other_tmpfs) in next(line for line in inspect.splitlines() if line.startswith("external"))

    # The host changes its tmpfs; the restored copy sees today's files, never a stale copy.
    (host_files.other_tmpfs / "new-file").write_text("written after the snapshot")
    try:
        r = workers.adopt(parse_pid(torpor.ok("restore", snap, "--detach")), Endpoint(), "restored")
        Path(f"{out}.again").write_text("")
        wait_until(lambda: "again" in out.read_text(), 15, "the restored copy to look again")
        again = out.read_text().splitlines()[-1]
        assert "['own-file']" in again, again
        assert f"'{shm_marker}': False" in again, again
        assert r.init_pid != w.init_pid
    finally:
        (host_files.other_tmpfs / "new-file").unlink()


def test_a_full_filesystem_is_named_with_the_bytes_needed_and_available(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = workers.server(hold_mb=32)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "torpor-test-small", str(small)], check=True)
    try:
        line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", small / "snap")
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=False)
    assert f"no space for the snapshot in {small}" in line, line
    assert "needs at least" in line and "MB available" in line, line
    assert f"pid {w.init_pid} keeps running" in line, line
    assert w.ask("ping") == "pong"


def test_a_log_in_the_commands_own_shm_is_refused(torpor: Torpor, tmp_path: Path) -> None:
    log = Path(f"/dev/shm/torpor-test-{tmp_path.name}.log")
    line = torpor.fails("run", "--log", log, "--", "true")
    assert f"the log file {log} would be out of the command's reach" in line, line
    assert "pass --log with a path elsewhere" in line, line
    assert not log.exists()


def test_a_command_in_the_commands_own_shm_is_refused_with_one_line(torpor: Torpor, tmp_path: Path) -> None:
    program = Path(f"/dev/shm/torpor-test-{tmp_path.name}.sh")
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    try:
        line = torpor.fails("run", "--log", tmp_path / "run.log", "--", program)
        assert f"the command {program} would be out of the command's reach" in line, line
        assert "virtual environment" in line, line
    finally:
        program.unlink()


SHARED = """
import mmap, os, sys, time
m = mmap.mmap(-1, 32 << 20)  # shared anonymous memory: dumped by CRIU, not "Anonymous" in smaps
for i in range(32):
    m[i << 20 : (i + 1) << 20] = os.urandom(1 << 20)
open(sys.argv[1], "w").write("ready")
time.sleep(600)
"""


def test_a_filesystem_filled_during_the_dump_is_named_with_a_log_that_exists(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    script, ready = tmp_path / "shared.py", tmp_path / "shared.ready"
    script.write_text(SHARED)
    w = workers.start([PYTHON, script, ready], endpoint=Endpoint(), ready=ready, name="shared")
    small = tmp_path / "small"
    small.mkdir()
    # Room for the least the check before the dump asks (the process's own anonymous memory),
    # not for the 32 MB of shared memory CRIU writes as well.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "torpor-test-small", str(small)], check=True)
    try:
        env = {"TORPOR_LOG_DIR": str(tmp_path / "logs")}
        line = torpor.fails("snapshot", "--pid", w.init_pid, "--out", small / "snap", env=env)
        left = list(small.iterdir())
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=False)
    assert f"no space for the snapshot in {small}: CRIU filled the filesystem during the dump" in line, line
    log = line.split("CRIU's log: ")[1].split(")")[0]
    assert Path(log).is_file() and Path(log).parent == tmp_path / "logs", line
    assert left == [], left
    assert f"pid {w.init_pid} keeps running" in line
