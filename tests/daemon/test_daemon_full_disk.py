"""The daemon on a full disk: its state directory on a small loop-mounted ext4 filled to the last
block. Removing an instance still removes its registry row (the registry's disk reserve,
crates/torpord/src/registry/reserve.rs), so the listed instances always match the processes, and
the errors say what happened. Needs root, losetup and mkfs.ext4; the filesystem is unmounted
and its loop device freed whatever happens."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import loop_ext4, wait_until

from .conftest import Torpord
from .test_daemon_crash import (
    assert_only_listed_processes,
    daemon_processes,
    function_dir,
)

# Room, besides the init binary the daemon copies into its state directory (sized from the
# binary under test: the debug build grew from ~130 to ~230 MB), for the base and function
# snapshots of two echoers (13 MB each), logs and the registry.
ROOM_MIB = 190
RESERVE_BYTES = 8 << 20


@pytest.fixture
def small_state(torpor_bin: Path, tmp_path: Path) -> Iterator[Path]:
    """`tmp_path/root/state` on an ext4 of its own: the init binary's size and ROOM_MIB."""
    (tmp_path / "root").mkdir()
    fs_mib = -(-torpor_bin.stat().st_size // (1 << 20)) + ROOM_MIB
    with loop_ext4(tmp_path / "root" / "state", fs_mib) as state:
        yield state


def fill(directory: Path) -> Path:
    """Fills the filesystem of `directory` to its last block; returns the filler file."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    # The last partial chunk's room too. Creating that file can itself fail for want of room
    # (a new directory block: mkfs.ext4 of Ubuntu 24.04 on the GPU machine), which is as full.
    try:
        with open(directory / "filler-tail", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    return filler


def fill_leaving(directory: Path, room: int) -> None:
    """Fills the filesystem of `directory` but for about `room` bytes."""
    st = os.statvfs(directory)
    with open(directory / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(st.f_bavail * st.f_frsize - room, 1))


def free(directory: Path) -> None:
    (directory / "filler").unlink(missing_ok=True)
    (directory / "filler-tail").unlink(missing_ok=True)


def listed(torpord: Torpord, name: str) -> list[dict[str, object]]:
    return [i for i in torpord.instances(name) if i.get("stage") != "hibernated"]


def reserve_back(d: Torpord, reserve: Path) -> None:
    """Waits for the daemon to make its reserve again, which it tries (at most every 5 s) when a
    registry query succeeds: the listing queries it."""

    def back() -> bool:
        d.instances("full-stop")
        return reserve.exists() and reserve.stat().st_size == RESERVE_BYTES

    wait_until(back, 15, "the registry's disk reserve to be made again")


def test_instances_leave_the_registry_with_their_processes_on_a_full_disk(
    torpor_bin: Path, criu_ready: None, small_state: Path, tmp_path: Path
) -> None:
    d = Torpord(torpor_bin, small_state.parent)
    try:
        reserve = small_state / "registry.reserve"
        assert reserve.stat().st_size == RESERVE_BYTES
        stop_fn = function_dir(tmp_path, "full-stop", [], 1)
        hib_fn = function_dir(tmp_path, "full-hib", [], 1, "[keepalive]\ngpu_release_s = 1\nhibernate_s = 1.5\nevict_s = 600\n")
        d.deploy(stop_fn)
        d.deploy(hib_fn)
        assert d.invoke("full-stop", {"say": "a"}).status == 200
        assert len(listed(d, "full-stop")) == 1
        fill(small_state)

        # `torpor stop` on a full disk: the instance goes, and with it its row.
        r = d.cli("stop", "full-stop")
        assert r.returncode == 0, r.stderr
        assert "1 idle instance stopped" in r.stdout, r.stdout
        wait_until(lambda: not listed(d, "full-stop"), 10, "the stopped instance to leave the listing")
        assert_only_listed_processes(d)
        assert "cannot remove the instance's registry row" not in d.log_text()

        # A cold start on the full disk fails, saying what happened (not naming TORPOR_LOG_DIR,
        # which the daemon does not use), or succeeds; either way the listing is true.
        cold = d.invoke("full-stop", {"say": "b"})
        assert b"TORPOR_LOG_DIR" not in cold.body, cold.body
        if cold.status != 200:
            assert b"space" in cold.body.lower(), cold.body
        assert_only_listed_processes(d)

        # A hibernation whose snapshot would not fit is refused before the instance is touched
        # (torpor_snapshot::space::check_tree): it stays warm, listed and answering; the refusal
        # is logged with the numbers and counted; nothing is left in the snapshots directory.
        free(small_state)
        reserve_back(d, reserve)
        assert d.invoke("full-hib", {"say": "c"}).status == 200
        fill(small_state)
        wait_until(lambda: "hibernation refused" in d.log.read_text(errors="replace"), 20, "the hibernation to be refused")
        refusal = next(line for line in d.log.read_text(errors="replace").splitlines() if "hibernation refused" in line)
        assert "no space for the snapshot in" in refusal and "it needs at least" in refusal, refusal
        [warm] = listed(d, "full-hib")
        assert warm.get("stage") == "warm", warm
        assert d.invoke("full-hib", {"say": "still"}).status == 200
        metrics = d.request("GET", "/metrics").body.decode()
        assert 'torpor_hibernations_refused_total{function="full-hib"}' in metrics, metrics[-2000:]
        assert_only_listed_processes(d)
        assert not [p.name for p in (small_state / "snapshots").iterdir() if p.name.lstrip(".").startswith("hib-")]

        # A redeploy whose function snapshot would not fit fails with that line, before the
        # snapshot is taken, and the previous deploy keeps serving.
        free(small_state)
        reserve_back(d, reserve)
        fill_leaving(small_state, 3 << 20)
        r = d.cli("deploy", hib_fn)
        assert r.returncode != 0, r.stdout
        assert "no space for the snapshot in" in r.stdout + r.stderr, r.stdout + r.stderr
        free(small_state)
        assert d.invoke("full-hib", {"say": "previous"}).status == 200
        assert_only_listed_processes(d)

        # With room again, the reserve comes back and the functions serve.
        free(small_state)
        assert d.invoke("full-stop", {"say": "d"}).status == 200
        assert d.cli("stop", "full-stop").returncode == 0
        reserve_back(d, reserve)
        assert d.invoke("full-hib", {"say": "e"}).status == 200
    finally:
        free(small_state)
        d.stop()
    assert not daemon_processes(small_state)
