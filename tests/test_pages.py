"""Where a restore's memory comes from: copied by CRIU (default), from a snapshot staged in tmpfs
(`torpor stage`), or lazily over userfaultfd (`--pages lazy`). All three give the same process;
a lazy-pages daemon that fails gives one error line and leaves nothing running."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PYTHON, ROOT, Torpor, Worker, Workers, cmdline, parse_pid, pids_with, wait_until
from linesrv import Endpoint

WORKER = ROOT / "bench" / "criu_restore" / "worker.py"
MIB = 48
# One-page VMAs the worker holds besides, like a GPU worker's driver residue: lazy runs that end
# at every page, which the page server must copy across and find without scanning them all.
VMAS = 3000
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Source:
    snap: Path
    sock: Path
    token: str
    checksum: str  # SHA-256 of the worker's data before the snapshot


def ask(sock: Path, words: str, timeout: float = 30.0) -> str:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(str(sock))
            s.sendall(words.encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data.decode().strip()
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        finally:
            s.close()


@pytest.fixture(scope="module")
def source(torpor: Torpor, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    base = tmp_path_factory.mktemp("pages")
    ws = Workers(torpor, base)
    sock = base / "worker.sock"
    try:
        w = ws.start(
            [PYTHON, WORKER, sock, MIB, VMAS],
            endpoint=Endpoint(unix=str(sock)),
            ready=Path(f"{sock}.ready"),
            name="worker",
        )
        checksum = ask(sock, "sum")
        assert len(checksum) == 64, checksum
        snap = base / "snap"
        torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
        w.wait_gone()
        yield Source(snap, sock, ws.token, checksum)
    finally:
        ws.cleanup()


@pytest.fixture
def staged_dir() -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm tmpfs on this machine")
    d = SHM / f"torpor-test-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    try:
        yield d / "snap"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def lazy_daemons(snap: Path) -> list[int]:
    """CRIU's lazy-pages daemons and Torpor's page servers serving `snap`."""
    return [p for p in pids_with("lazy-pages") + pids_with("__page-server") if str(snap) in cmdline(p)]


def restored_checksum(torpor: Torpor, workers: Workers, src: Source, snap: Path, *extra: str) -> str:
    r = torpor("restore", snap, "--detach", *extra)
    w = workers.adopt(parse_pid(r), Endpoint(unix=str(src.sock)), "restored")
    try:
        return ask(src.sock, "sum")
    finally:
        workers.cleanup()
        w.wait_gone()


def test_copy_staged_and_lazy_restores_give_the_same_memory(
    torpor: Torpor, workers: Workers, source: Source, staged_dir: Path
) -> None:
    assert restored_checksum(torpor, workers, source, source.snap) == source.checksum

    out = torpor.ok("stage", source.snap, "--to", staged_dir).stdout
    assert "staged" in out and str(staged_dir) in out, out
    torpor.ok("verify", staged_dir)
    assert restored_checksum(torpor, workers, source, staged_dir) == source.checksum

    # Lazy: `restore --detach` returns only once the daemon served every page and was reaped.
    for snap in (staged_dir, source.snap):
        for pages in ("lazy", "criu-lazy"):
            assert restored_checksum(torpor, workers, source, snap, "--pages", pages) == source.checksum
            assert lazy_daemons(snap) == [], f"a {pages} daemon outlived its restore"
    # Restoring left the snapshot as it was.
    torpor.ok("verify", source.snap)


def test_staging_a_corrupt_snapshot_is_refused(torpor: Torpor, source: Source, tmp_path: Path, staged_dir: Path) -> None:
    copy = tmp_path / "snap"
    shutil.copytree(source.snap, copy)
    pages = max((p for p in copy.iterdir() if p.name.startswith("pages-")), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    line = torpor.fails("stage", copy, "--to", staged_dir)
    assert "hash mismatch" in line and pages.name in line, line
    assert not staged_dir.exists(), "a half-staged copy was left behind"


def criu_wrapper(tmp_path: Path, lazy_part: str) -> dict[str, str]:
    """TORPOR_CRIU pointing at a wrapper that runs the real CRIU, except for `lazy-pages`,
    which runs `lazy_part` (shell) instead."""
    real = os.environ.get("TORPOR_CRIU") or str(
        Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "torpor/criu/bin/criu"
    )
    if not os.access(real, os.X_OK):
        pytest.skip(f"no provisioned CRIU at {real}")
    wrapper = tmp_path / "criu"
    wrapper.write_text(
        f'#!/bin/sh\nREAL="{real}"\nif [ "$1" = lazy-pages ]; then\n{lazy_part}\nfi\nexec "$REAL" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return {"TORPOR_CRIU": str(wrapper), "TORPOR_LOG_DIR": str(tmp_path / "logs")}


def test_a_lazy_pages_daemon_that_cannot_start_is_one_error(
    torpor: Torpor, workers: Workers, source: Source, tmp_path: Path
) -> None:
    env = criu_wrapper(tmp_path, '  echo "lazy-pages: userfaultfd is not allowed here" >&2; exit 1')
    line = torpor.fails("restore", source.snap, "--detach", "--pages", "criu-lazy", env=env)
    assert "criu lazy-pages" in line and "userfaultfd is not allowed here" in line, line
    assert pids_with(source.token) == [], "a failed lazy restore left a process"


def test_a_lazy_pages_daemon_missing_pages_is_one_error_and_kills_the_restore(
    torpor: Torpor, workers: Workers, source: Source, tmp_path: Path
) -> None:
    # The daemon is given a copy of the images without the pages: it cannot serve any fault.
    broken = tmp_path / "no-pages"
    env = criu_wrapper(
        tmp_path,
        f'  rm -rf "{broken}"; mkdir -p "{broken}"\n'
        f'  for f in "$3"/*; do case "$(basename "$f")" in pages-*) ;; *) cp "$f" "{broken}/";; esac; done\n'
        '  shift 3\n'
        f'  exec "$REAL" lazy-pages -D "{broken}" "$@"',
    )
    line = torpor.fails("restore", source.snap, "--detach", "--pages", "criu-lazy", env=env, timeout=120)
    assert "lazy-pages" in line or "CRIU restore failed" in line, line
    wait_until(lambda: pids_with(source.token) == [], 15, "the restored tree to be killed")
    assert lazy_daemons(broken) == [], "the lazy-pages daemon was left running"


def stats_of(path: Path) -> list[dict[str, int]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_torpors_page_server_serves_faults_in_runs_records_a_profile_and_serves_it_first(
    torpor: Torpor, workers: Workers, source: Source, tmp_path: Path
) -> None:
    """Torpor's page server (torpor_criu::page_server), whose counters and profile it writes
    where $TORPOR_PAGE_SERVER_STATS and $TORPOR_PAGE_PROFILE_OUT say: a first restore records the
    ranges faulted in; a second one given them copies them as its hot set at the end of CRIU's
    restore, before the process runs, and the rest in the background. Same memory both times."""
    stats, profile = tmp_path / "stats.jsonl", tmp_path / "profile"
    env = {"TORPOR_PAGE_SERVER_STATS": str(stats), "TORPOR_PAGE_PROFILE_OUT": str(profile)}
    with_env = dict(os.environ, **env)
    r = torpor("restore", source.snap, "--detach", "--pages", "lazy", env=with_env)
    w = workers.adopt(parse_pid(r), Endpoint(unix=str(source.sock)), "restored")
    assert ask(source.sock, "sum") == source.checksum
    workers.cleanup()
    w.wait_gone()
    [first] = stats_of(stats)
    assert first["tasks"] >= 1 and first["faults"] > 0 and first["background_pages"] > 0, first
    ranges = profile.read_text().splitlines()
    assert ranges, "no fault was recorded"
    # The faults in the one-page VMAs are recorded as adjacent ranges; written coalesced.
    assert len(ranges) < VMAS // 20, f"{len(ranges)} profile ranges: not coalesced"
    assert first["hot_pages"] == 0, first

    stats.unlink()
    again = dict(os.environ, TORPOR_PAGE_SERVER_STATS=str(stats), TORPOR_PAGE_PROFILE_IN=str(profile))
    r = torpor("restore", source.snap, "--detach", "--pages", "lazy", env=again)
    w = workers.adopt(parse_pid(r), Endpoint(unix=str(source.sock)), "restored")
    assert ask(source.sock, "sum") == source.checksum
    workers.cleanup()
    w.wait_gone()
    [second] = stats_of(stats)
    assert second["hot_pages"] > 0, second
    assert lazy_daemons(source.snap) == []


def test_the_parallel_background_copy_serves_every_page_in_batches(
    torpor: Torpor, workers: Workers, source: Source, tmp_path: Path
) -> None:
    """What the worker does not fault is copied in the background: on several threads, batch by
    batch (the default, 8 threads: at most the machine's cores), or serially with one
    ($TORPOR_PAGE_SERVER_BACKGROUND_THREADS=1). `restore --detach` returns once every page is
    in; the idle worker faulted few of its data's pages, so the background copied the rest, and
    the memory is the source's either way."""
    data_pages = MIB * 256
    for threads, parallel in ((None, True), ("1", False)):
        stats = tmp_path / f"stats-{threads}.jsonl"
        env = dict(os.environ, TORPOR_PAGE_SERVER_STATS=str(stats))
        env.pop("TORPOR_PAGE_SERVER_BACKGROUND_THREADS", None)
        if threads is not None:
            env["TORPOR_PAGE_SERVER_BACKGROUND_THREADS"] = threads
        r = torpor("restore", source.snap, "--detach", "--pages", "lazy", env=env)
        [s] = stats_of(stats)
        w = workers.adopt(parse_pid(r), Endpoint(unix=str(source.sock)), "restored")
        assert ask(source.sock, "sum") == source.checksum, threads
        workers.cleanup()
        w.wait_gone()
        assert s["background_pages"] + s["fault_pages"] >= data_pages, s
        assert s["background_pages"] > 10 * s["fault_pages"], f"the background copied little: {s}"
        assert (s["background_batches"] > 0) == parallel, s
    assert lazy_daemons(source.snap) == []


@pytest.mark.parametrize("bad", ["0", "65", "eight"])
def test_a_bad_background_thread_count_is_one_error_naming_it(
    torpor: Torpor, source: Source, tmp_path: Path, bad: str
) -> None:
    env = dict(os.environ, TORPOR_PAGE_SERVER_BACKGROUND_THREADS=bad, TORPOR_LOG_DIR=str(tmp_path / "logs"))
    line = torpor.fails("restore", source.snap, "--detach", "--pages", "lazy", env=env, timeout=120)
    assert "TORPOR_PAGE_SERVER_BACKGROUND_THREADS must be a number from 1 to 64" in line and f'got "{bad}"' in line, line
    wait_until(lambda: pids_with(source.token) == [], 15, "the restored tree to be killed")
    assert lazy_daemons(source.snap) == []


def test_a_page_server_that_stops_half_way_is_one_error_and_kills_the_restore(
    torpor: Torpor, workers: Workers, source: Source, tmp_path: Path
) -> None:
    env = dict(os.environ, TORPOR_PAGE_SERVER_FAULT="1", TORPOR_LOG_DIR=str(tmp_path / "logs"))
    line = torpor.fails("restore", source.snap, "--detach", "--pages", "lazy", env=env, timeout=120)
    assert "torpor's page server failed" in line and "TORPOR_PAGE_SERVER_FAULT" in line, line
    wait_until(lambda: pids_with(source.token) == [], 15, "the restored tree to be killed")
    assert lazy_daemons(source.snap) == [], "the page server was left running"


LAZY_MEM = ROOT / "tests" / "programs" / "lazy_mem.py"


@pytest.mark.parametrize("background", ["off", "parallel"])
def test_fork_and_mremap_of_memory_still_on_the_page_server_keep_its_contents(
    torpor: Torpor, workers: Workers, criu_ready: None, tmp_path: Path, background: str
) -> None:
    """A restored worker forks a child that reads memory the page server has not served yet
    (the child's faults come on the uffd the kernel made at fork, which the server must serve
    from the parent's remaining ranges), and moves a lazy area with mremap (the server must
    serve its pages at their new address). `off`: the server runs without its background copy
    ($TORPOR_PAGE_SERVER_BACKGROUND=off), so the memory is still lazy when the worker does both.
    `parallel`: the background copy's batches race the fork and the mremap (the kernel refuses
    copies while their events wait to be read: those pieces stay lazy for the next batch); the
    test's switch $TORPOR_PAGE_SERVER_FAULT=slow-background spaces the batches 200 ms apart, so
    the fork comes while memory is still lazy.
    Every checksum matches the source's; the server ends once the tree is gone."""
    mib = 16 if background == "off" else 128
    sock, data_sum, area_sum, snap = lazy_mem_snapshot(torpor, workers, tmp_path, mib)

    stats = tmp_path / "stats.jsonl"
    env = {"TORPOR_PAGE_SERVER_STATS": str(stats), "TORPOR_LOG_DIR": str(tmp_path / "logs")}
    if background == "off":
        env["TORPOR_PAGE_SERVER_BACKGROUND"] = "off"
    else:
        env["TORPOR_PAGE_SERVER_BACKGROUND_THREADS"] = "8"
        env["TORPOR_PAGE_SERVER_FAULT"] = "slow-background"
    p, err, restored = restored_lazily(workers, snap, sock, env)
    assert ask(sock, "forksum").split() == [data_sum, area_sum]
    assert ask(sock, "remap") == area_sum
    assert ask(sock, "sum").split() == [data_sum, area_sum]
    if background == "parallel":
        # Every page in: the server ends while the tree lives.
        assert p.wait(timeout=60) == 0, err.read_text()
        assert ask(sock, "forksum").split() == [data_sum, area_sum]
        os.kill(restored.init_pid, 9)
        [s] = stats_of(stats)
        assert s["forks"] >= 1 and s["background_pages"] > 0 and s["background_batches"] >= 2, s
        assert lazy_daemons(snap) == []
        return
    assert p.poll() is None, "the page server ended while the tree lives (it has no background copy)"
    # Killing the tree ends the server (it probes its tasks), and with it `torpor restore`.
    os.kill(restored.init_pid, 9)
    assert p.wait(timeout=30) == 0, err.read_text()
    [s] = stats_of(stats)
    assert s["forks"] >= 1 and s["faults"] > 0 and s["background_pages"] == 0, s
    assert lazy_daemons(snap) == []


def lazy_mem_snapshot(torpor: Torpor, workers: Workers, tmp_path: Path, mib: int) -> tuple[Path, str, str, Path]:
    """lazy_mem.py holding `mib` MiB, snapshotted (the source gone): its socket, its data and
    area checksums, and the snapshot."""
    sock = tmp_path / "lazy.sock"
    w = workers.start(
        [PYTHON, LAZY_MEM, sock, mib], endpoint=Endpoint(unix=str(sock)), ready=Path(f"{sock}.ready"), name="lazy-mem"
    )
    data_sum, area_sum = ask(sock, "sum").split()
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()
    return sock, data_sum, area_sum, snap


def restored_lazily(workers: Workers, snap: Path, sock: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path, Worker]:
    """`torpor restore --detach --pages lazy` of `snap` with `env`: the restore (it waits for
    its page server after printing the pid), its stderr file, and the adopted worker."""
    p, out, err = workers.popen_torpor("restore", snap, "--detach", "--pages", "lazy", env=env)
    # The pid comes out as soon as CRIU is done; torpor then waits for its page server.
    wait_until(lambda: out.read_text().strip().isdigit() or p.poll() is not None, 60, "the restored pid")
    assert out.read_text().strip().isdigit(), err.read_text()
    return p, err, workers.adopt(int(out.read_text().strip()), Endpoint(unix=str(sock)), "restored")


def served_without_background(
    torpor: Torpor, workers: Workers, tmp_path: Path, mib: int, check: Callable[[Path, str, str], None]
) -> None:
    """lazy_mem.py holding `mib` MiB, snapshotted, then restored lazily with no background copy
    ($TORPOR_PAGE_SERVER_BACKGROUND=off), so its memory stays on the page server until touched;
    `check(socket, data_sum, area_sum)` runs against the restored worker. Then the tree is
    killed, the server ends without error, and its counters show faults and no background copy."""
    sock, data_sum, area_sum, snap = lazy_mem_snapshot(torpor, workers, tmp_path, mib)
    stats = tmp_path / "stats.jsonl"
    env = {"TORPOR_PAGE_SERVER_STATS": str(stats), "TORPOR_LOG_DIR": str(tmp_path / "logs"),
           "TORPOR_PAGE_SERVER_BACKGROUND": "off"}
    p, err, restored = restored_lazily(workers, snap, sock, env)
    check(sock, data_sum, area_sum)
    assert p.poll() is None, "the page server ended while the tree lives (it has no background copy)"
    os.kill(restored.init_pid, 9)
    assert p.wait(timeout=30) == 0, err.read_text()
    [s] = stats_of(stats)
    assert s["faults"] > 0 and s["background_pages"] == 0, s
    assert lazy_daemons(snap) == []


def test_memory_an_mprotect_split_while_on_the_page_server_is_still_served(
    torpor: Torpor, workers: Workers, criu_ready: None, tmp_path: Path
) -> None:
    """A restored worker makes a few pages in the middle of a lazy area read-only before reading
    it (mprotect splits the area's VMA in three; the kernel sends the page server no event), so
    the 1 MiB run the server copies around one of its faults crosses the new VMA boundaries and
    the kernel refuses it whole (ENOENT). The server copies that run page by page and serves
    every later fault. Before session 47 it took ENOENT for the task's end and stopped serving
    it: the worker hung on its next fault."""

    def check(sock: Path, data_sum: str, area_sum: str) -> None:
        assert ask(sock, "protect", timeout=20) == area_sum
        assert ask(sock, "sum", timeout=20).split() == [data_sum, area_sum]

    served_without_background(torpor, workers, tmp_path, 16, check)


def test_a_fault_that_meets_a_pending_event_is_served_once_the_event_is_read(
    torpor: Torpor, workers: Workers, criu_ready: None, tmp_path: Path
) -> None:
    """A restored worker reads lazy memory while another of its threads gives pages back again
    and again (madvise MADV_DONTNEED: a REMOVE event each, and until the server has read it the
    kernel refuses its copies with EAGAIN). A fault whose copy met such an event is served again
    once the event is read. Before session 47 it was dropped: served later by the background
    copy, or, with none (a deploy's profiling restore; here none either), never, and the worker
    hung (GPU workers' profiling restores on the H200 did)."""

    def check(sock: Path, data_sum: str, area_sum: str) -> None:
        assert ask(sock, "churn", timeout=30).split() == [data_sum, area_sum]

    served_without_background(torpor, workers, tmp_path, 32, check)
