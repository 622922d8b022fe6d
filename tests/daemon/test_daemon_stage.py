"""Staged function snapshots and lazy pages (crates/torpord/src/staging.rs) through the real
daemon, real workers and real CRIU.

The module's daemon stages into a 1 GiB area and restores with lazy pages (the defaults, but for
the size). tests/daemon/functions/ballast holds 48 MiB of seeded random bytes and answers with
their digest, so an instance answers right only if every page came back intact. The tests run in
file order and build on each other's deploys.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import random
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cmdline, kill_tree, pids_with, wait_until

from .conftest import FUNCTIONS, Torpord

BALLAST = FUNCTIONS / "ballast"
# What tests/daemon/functions/ballast/handler.py computes.
EXPECTED = {"sha256": hashlib.sha256(random.Random(20261122).randbytes(48 << 20)).hexdigest(), "mib": 48}
STAGE_SOURCE = "torpor-stage"


@pytest.fixture(scope="module")
def staged(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces, runs CRIU and mounts a tmpfs")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("staged"), config="[restore_server]\nstage_bytes = 1073741824\n")
    try:
        yield d
    finally:
        d.stop()


def daemon(torpor_bin: Path, root: Path, restore_server: str) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces, runs CRIU and mounts a tmpfs")
    return Torpord(torpor_bin, root, config=f"[restore_server]\n{restore_server}\n")


def stage_dir(d: Torpord) -> Path:
    return d.state / "stage"


def mounts_at(path: Path, mountinfo: str | None = None) -> list[tuple[str, str, str]]:
    """(fstype, source, super options) of every mount at `path`, bottom first."""
    text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    found = []
    for line in text.splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[4] == str(path):
            found.append((fields[sep + 1], fields[sep + 2], fields[sep + 3]))
    return found


def copies(d: Torpord) -> list[str]:
    return sorted(p.name for p in stage_dir(d).iterdir()) if stage_dir(d).is_dir() else []


def snapshot_of(lines: list[dict[str, Any]]) -> str:
    return str(lines[-1]["result"]["snapshot"])


def phases(lines: list[dict[str, Any]]) -> list[str]:
    return [line["phase"] for line in lines if "phase" in line]


def metric(d: Torpord, name: str) -> float:
    text = d.request("GET", "/metrics").body.decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def restores(d: Torpord) -> list[tuple[str, str, bool]]:
    """(function, pages, staged) of every `instance restored` line of the daemon's log."""
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        m = re.search(r'instance restored function="([^"]+)".* pages=(\w+) staged=(\w+)', line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3) == "true"))
    return out


def fresh_restore(d: Torpord, name: str) -> dict[str, Any]:
    """Kills the function's live instances, then invokes it: a new instance is restored."""
    for inst in d.instances(name):
        kill_tree(inst["pid"])
    wait_until(lambda: d.instances(name) == [], 15, f"{name}'s instances to go")
    before = len(restores(d))
    answer = d.invoke(name, {})
    assert answer.status == 200 and answer.start == "restored", (answer.status, answer.body, d.log_text())
    assert len(restores(d)) == before + 1, d.log_text()
    return dict(answer.json())


def same_files(a: Path, b: Path) -> None:
    # CRIU writes stats-restore into the images directory at every restore.
    names = sorted(p.name for p in a.iterdir() if p.name != "stats-restore")
    assert names == sorted(p.name for p in b.iterdir() if p.name != "stats-restore")
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], []), (mismatch, errors)


def flip_byte(path: Path, at: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def largest_pages_file(snapshot: Path) -> Path:
    return max(snapshot.glob("pages-*.img"), key=lambda p: p.stat().st_size)


def test_a_deploy_stages_the_function_snapshot_on_a_private_tmpfs(staged: Torpord) -> None:
    lines = staged.deploy(BALLAST)
    assert phases(lines)[-3:] == ["snapshot_function", "stage", "profile"], lines
    snap = snapshot_of(lines)
    # A tmpfs of the daemon's own, root-only, with huge pages, on a private bind of its directory.
    stacked = mounts_at(stage_dir(staged))
    assert [m[:2] for m in stacked][-1] == ("tmpfs", STAGE_SOURCE), stacked
    # 1 GiB for the copies, and an eighth more for copies dropped while a restore still reads them.
    assert "mode=700" in stacked[-1][2] and "size=1179648k" in stacked[-1][2], stacked
    assert "huge=within_size" in stacked[-1][2] or "refuses huge pages" in staged.log_text(), stacked
    assert stage_dir(staged).stat().st_mode & 0o777 == 0o700
    # One copy, file for file what the disk holds (hashed against the manifest as it was copied).
    (copy,) = copies(staged)
    assert copy.startswith(f"{snap}.")
    same_files(stage_dir(staged) / copy, staged.state / "snapshots" / snap)
    disk_bytes = sum(p.stat().st_size for p in (staged.state / "snapshots" / snap).iterdir())
    assert metric(staged, "torpor_stage_bytes") >= disk_bytes


def test_invokes_restore_the_staged_copy_with_lazy_pages_bit_identically(staged: Torpord) -> None:
    first = staged.invoke("ballast", {})
    assert first.status == 200 and first.start == "restored", (first.status, first.body)
    assert first.json() == EXPECTED
    assert restores(staged)[-1] == ("ballast", "Lazy", True), staged.log_text()
    assert {"restore", "reconnect", "start"} <= set(first.timings), first.timings
    assert fresh_restore(staged, "ballast") == EXPECTED
    assert restores(staged)[-1] == ("ballast", "Lazy", True)


def test_the_stage_area_is_in_no_worker_namespace_nor_snapshot(staged: Torpord) -> None:
    # The function snapshot was taken after the area was mounted, from a worker restored from the
    # base: neither the restored instance nor the snapshots see the mount.
    (inst,) = staged.instances("ballast")
    mountinfo = Path(f"/proc/{inst['pid']}/mountinfo").read_text()
    assert STAGE_SOURCE not in mountinfo and str(stage_dir(staged)) not in mountinfo, mountinfo
    for images in (staged.state / "snapshots").glob("*/mountpoints-*.img"):
        assert str(stage_dir(staged)).encode() not in images.read_bytes(), images


def test_a_corrupt_disk_copy_does_not_matter_while_staged(staged: Torpord) -> None:
    (snap,) = [p for p in (staged.state / "snapshots").iterdir() if p.name.startswith("fn-ballast-")]
    pages = largest_pages_file(snap)
    original = pages.read_bytes()
    flip_byte(pages)
    try:
        assert fresh_restore(staged, "ballast") == EXPECTED
        assert restores(staged)[-1] == ("ballast", "Lazy", True)
    finally:
        pages.write_bytes(original)


def test_a_redeploy_replaces_the_staged_copy(staged: Torpord) -> None:
    (old,) = copies(staged)
    lines = staged.deploy(BALLAST)
    snap = snapshot_of(lines)
    wait_until(lambda: len(copies(staged)) == 1, 10, "the old copy to go")
    (new,) = copies(staged)
    assert new != old and new.startswith(f"{snap}."), (old, new)
    assert fresh_restore(staged, "ballast") == EXPECTED
    assert restores(staged)[-1] == ("ballast", "Lazy", True)


def test_a_restarted_daemon_stages_again_and_never_reads_a_copy_it_did_not_stage(staged: Torpord) -> None:
    (copy,) = copies(staged)
    staged.proc.send_signal(signal.SIGKILL)
    staged.proc.wait()
    # The killed daemon's tmpfs is still mounted. Tamper with its copy without changing a size: a
    # restore that trusted it (sizes checked only) would answer wrong.
    flip_byte(largest_pages_file(stage_dir(staged) / copy))
    again = staged.restart()
    wait_until(lambda: "staged the function snapshots again" in again.log.read_text(errors="replace"), 30, "re-staging")
    stacked = mounts_at(stage_dir(again))
    assert [m[1] for m in stacked].count(STAGE_SOURCE) == 1, stacked
    (fresh,) = copies(again)
    (snap,) = [p for p in (again.state / "snapshots").iterdir() if p.name.startswith("fn-ballast-")]
    same_files(stage_dir(again) / fresh, snap)
    assert fresh_restore(again, "ballast") == EXPECTED
    assert restores(again)[-1] == ("ballast", "Lazy", True)


def lazy_pages_daemons(d: Torpord) -> list[int]:
    """Torpor's page servers (and CRIU's lazy-pages daemons) serving `d`'s restores."""
    token = f"{d.state}/logs/lazy-"
    return [pid for pid in pids_with(token) if "__page-server" in cmdline(pid) or "lazy-pages" in cmdline(pid)]


def restored_and_untraced(d: Torpord, before: set[int]) -> bool:
    """Whether a new instance init under `d`'s state directory exists that CRIU no longer traces
    (CRIU's restore of it has ended)."""
    for pid in set(pids_with(f"{d.state}/init/")) - before:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if re.search(r"^TracerPid:\s+0$", status, re.MULTILINE):
            return True
    return False


@pytest.mark.parametrize("when", ["while-it-starts", "once-it-listens"])
def test_a_failing_lazy_pages_daemon_leaves_no_instance_serving(staged: Torpord, when: str) -> None:
    """SIGKILL to Torpor's page server. As it starts: the restore fails and an instance is
    booted instead. Once it listens (stopped first, so that it serves nothing more, and killed
    once CRIU no longer traces the restored init, or after 3 s): the restored tree is killed.
    Where that happens before the worker reconnected (as on the CPU VM: CRIU waits for the
    daemon), the restore fails and an instance is booted; after, the instance is removed with
    one log line. Nothing restored serves without every page."""
    for inst in staged.instances("ballast"):
        kill_tree(inst["pid"])
    wait_until(lambda: staged.instances("ballast") == [], 15, "ballast's instances to go")
    before = set(pids_with(f"{staged.state}/init/"))
    killed: list[int] = []
    stop = threading.Event()

    def kill_lazy_pages() -> None:
        while not stop.is_set() and not killed:
            daemons = lazy_pages_daemons(staged)
            if daemons and when == "while-it-starts":
                os.kill(daemons[0], signal.SIGKILL)
                killed.append(daemons[0])
            elif daemons and any((staged.state / "logs").glob("lazy-*/lazy-pages.socket")):
                # Listening: stopped, it can serve no more pages; killed once CRIU is done.
                os.kill(daemons[0], signal.SIGSTOP)
                deadline = time.monotonic() + 3
                while not restored_and_untraced(staged, before) and time.monotonic() < deadline:
                    time.sleep(0.002)
                os.kill(daemons[0], signal.SIGKILL)
                killed.append(daemons[0])
            time.sleep(0.002)

    killer = threading.Thread(target=kill_lazy_pages)
    killer.start()
    try:
        answer = staged.invoke("ballast", {})
    finally:
        stop.set()
        killer.join()
    assert killed, f"the lazy-pages daemon was not seen at the right time\n{staged.log_text()}"
    if when == "while-it-starts":
        assert answer.start == "booted", (answer.status, answer.start, answer.body)
        assert answer.json() == EXPECTED
        assert "restoring the function snapshot failed; booting an instance instead" in staged.log_text()
    elif answer.start == "booted":
        # The daemon failed before the worker reconnected: the restore failed as a whole.
        assert answer.json() == EXPECTED
        assert "restoring the function snapshot failed; booting an instance instead" in staged.log_text()
        assert "its lazy pages failed" not in staged.log_text()
    else:
        wait_until(
            lambda: staged.log.read_text(errors="replace").count("instance removed: its lazy pages failed") == 1,
            15,
            "the instance's removal",
        )
        wait_until(lambda: staged.instances("ballast") == [], 15, "the instance to go")
    again = staged.invoke("ballast", {})
    assert again.status == 200 and again.json() == EXPECTED, (again.status, again.body)
    # No lazy-pages daemon is left behind, whichever way its restore ended.
    wait_until(lambda: lazy_pages_daemons(staged) == [], 10, "the lazy-pages daemons to be reaped")


def test_rm_removes_the_staged_copy(staged: Torpord) -> None:
    r = staged.cli("rm", "ballast")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    wait_until(lambda: copies(staged) == [], 10, "the staged copy to go")
    assert metric(staged, "torpor_stage_bytes") == 0
    # A graceful stop unmounts the area.
    staged.stop()
    assert mounts_at(stage_dir(staged)) == []


@pytest.mark.parametrize(
    ("restore_server", "pages", "is_staged"),
    [
        ('pages = "copy"', "Copy", True),
        ("stage_bytes = 0", "Lazy", False),
        ("stage_bytes = 1048576", "Lazy", False),
    ],
    ids=["copy", "staging-off", "larger-than-the-area"],
)
def test_copy_pages_and_no_staging_restore_bit_identically(
    torpor_bin: Path, criu_ready: None, tmp_path: Path, restore_server: str, pages: str, is_staged: bool
) -> None:
    d = daemon(torpor_bin, tmp_path, restore_server)
    try:
        lines = d.deploy(BALLAST)
        assert ("stage" in phases(lines)) == is_staged, lines
        assert (copies(d) != []) == is_staged
        if restore_server == "stage_bytes = 0":
            assert mounts_at(stage_dir(d)) == [] and "staging is off" in d.log_text()
        if restore_server == "stage_bytes = 1048576":
            assert d.log_text().count("larger than the stage area") == 1, d.log_text()
        first = d.invoke("ballast", {})
        assert first.status == 200 and first.start == "restored", (first.status, first.body)
        assert first.json() == EXPECTED
        assert restores(d)[-1] == ("ballast", pages, is_staged), d.log_text()
    finally:
        d.stop()


def test_a_full_stage_area_drops_the_least_recently_used_copy(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    other = tmp_path / "ballast2"
    shutil.copytree(BALLAST, other)
    toml = other / "torpor.toml"
    toml.write_text(toml.read_text().replace('name = "ballast"', 'name = "ballast2"'))
    (tmp_path / "d").mkdir()
    d = daemon(torpor_bin, tmp_path / "d", "stage_bytes = 1073741824")
    try:
        first = snapshot_of(d.deploy(BALLAST))
        one = int(metric(d, "torpor_stage_bytes"))
        # Room for one copy and a half, then start again: the restart stages ballast again.
        d.stop()
        d.config.write_text(d.config.read_text().replace("stage_bytes = 1073741824", f"stage_bytes = {one * 3 // 2}"))
        d.restart()
        wait_until(lambda: "staged the function snapshots again" in d.log.read_text(errors="replace"), 30, "re-staging")
        assert [c.split(".")[0] for c in copies(d)] == [first]
        second = snapshot_of(d.deploy(other))
        log = d.log.read_text(errors="replace")
        assert "staging the function snapshot failed" not in log, log
        assert log.count("stage area full: dropped the least recently used staged copy") == 1, log
        wait_until(lambda: [c.split(".")[0] for c in copies(d)] == [second], 10, "ballast's copy to go")
        # ballast's restores read its disk copy again (hashed), ballast2's its staged copy.
        assert d.invoke("ballast", {}).json() == EXPECTED
        assert restores(d)[-1] == ("ballast", "Lazy", False)
        assert d.invoke("ballast2", {}).json() == EXPECTED
        assert restores(d)[-1] == ("ballast2", "Lazy", True)
    finally:
        d.stop()
