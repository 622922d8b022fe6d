"""kill -9 of the daemon in the middle of a deploy, a redeploy and a hibernation, through the
real daemon, real workers and real CRIU (docs/torpord.md, "Crash recovery").

Each case kills the daemon at one point (a deploy's NDJSON phase line, or inside a CRIU dump,
seen by its half-written `.<id>.partial-<pid>` directory), restarts it, checks that the restart
left no process of the daemon's but those it lists, no half-written or unregistered snapshot, and
the function serving (the previous deploy after an interrupted redeploy), then stops it
gracefully and checks that nothing of the daemon's is left. Every point runs three times.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from .conftest import FUNCTIONS, Torpord, daemon_processes, wait_for_starts

ECHOER = FUNCTIONS / "echoer"
ROUNDS = range(3)
# Stdlib modules a base may preload: each case that must boot a base of its own gets a preload
# set no other case has, so that its base key is new.
STDLIB = ["json", "csv", "decimal", "fractions", "statistics", "colorsys", "textwrap", "difflib", "shlex", "gzip"]


def describe(pids: list[int]) -> str:
    out = []
    for p in pids:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = dict(
                line.split(":\t", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines() if ":\t" in line
            )
            out.append(f"{p} (state {status.get('State', '?')}, parent {status.get('PPid', '?')}): {cmd}")
        except OSError:
            out.append(f"{p}: gone")
    return "; ".join(out)


def gone(pid: int) -> bool:
    """Whether `pid` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def registry(torpord: Torpord, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(torpord.state / "registry.db", timeout=10)
    try:
        return list(conn.execute(sql, args).fetchall())
    finally:
        conn.close()


def assert_no_stray_snapshots(torpord: Torpord) -> None:
    """No half-written snapshot directory, and no snapshot directory without a registry row."""
    known = {Path(p) for (p,) in registry(torpord, "SELECT path FROM snapshots")}
    for e in (torpord.state / "snapshots").iterdir():
        assert ".partial-" not in e.name, f"half-written snapshot {e} left\n{torpord.log_text()}"
        if e.name.startswith(("base-", "fn-", "hib-")):
            assert e in known, f"snapshot {e} has no registry row\n{torpord.log_text()}"


def listed_pids(torpord: Torpord) -> set[int]:
    """The init pids of the instances the daemon lists, once no start is in flight: a request
    answered by another instance (late binding) may have started one, whose processes exist
    before it is listed."""
    r = torpord.request("GET", "/v1/functions")
    assert r.status == 200, r.body
    pids: set[int] = set()
    for f in r.json()["functions"]:
        wait_for_starts(torpord, f["name"])
        for i in torpord.instances(f["name"]):
            if i.get("pid"):
                pids.add(int(i["pid"]))
    return pids


def in_tree(pid: int, roots: set[int]) -> bool:
    p = pid
    for _ in range(64):
        if p in roots:
            return True
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            return False
        p = int(stat.rsplit(")", 1)[1].split()[1])
        if p <= 1:
            return False
    return False


def running(pid: int) -> bool:
    """Whether `pid` is still a live process (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def assert_only_listed_processes(torpord: Torpord) -> None:
    # The running daemon's own children count as listed: the page server still serving a lazily
    # restored instance's memory, a CRIU at work (the `criu check` that makes CRIU's kernel
    # cache at start among them). What an earlier daemon left has lost its parent (it is the
    # init's, or a subreaper's), so it is never below this one. A process that ended between
    # the listing and the look at its parents leaked nothing: in_tree cannot place it, so it is
    # asked again whether it still runs (on CI, session 15, a `criu check` of the new daemon
    # ended in that window and was reported "gone").
    listed = listed_pids(torpord) | {torpord.proc.pid}
    stray = [
        p
        for p in daemon_processes(torpord.state)
        if p != torpord.proc.pid and not in_tree(p, listed) and running(p)
    ]
    assert not stray, f"processes of the daemon's it does not list: {describe(stray)}\n{torpord.log_text()}"


def kill_daemon(torpord: Torpord) -> None:
    torpord.proc.send_signal(signal.SIGKILL)
    torpord.proc.wait()


def restart_checked(torpord: Torpord) -> None:
    torpord.restart()
    assert_only_listed_processes(torpord)
    assert_no_stray_snapshots(torpord)


def stop_checked(torpord: Torpord, restart: bool = True) -> None:
    """A graceful stop leaves nothing of the daemon's running; the daemon starts again after
    (unless `restart` is false)."""
    torpord.proc.send_signal(signal.SIGTERM)
    assert torpord.proc.wait(timeout=30) == 0, torpord.log_text()
    # 30 s, the daemon's own bound for its stop: on a loaded 2-core CI run (session 8) some of
    # its processes once took longer than 10 s to go after it, and the message did not say which;
    # it now names them and the daemon's log tail. The cause, found under load: an instance of
    # the crashed daemon whose worker had not reconnected yet when the stop came was not stopped
    # (test_a_graceful_stop_kills_the_instances_of_an_earlier_daemon_that_have_not_reconnected).
    try:
        wait_until(lambda: not daemon_processes(torpord.state), 30, "the daemon's processes to exit after a graceful stop")
    except AssertionError as e:
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200] for p in daemon_processes(torpord.state)}
        raise AssertionError(f"{e}: {left}\n{torpord.log_text()[-4000:]}") from None
    assert_no_stray_snapshots(torpord)
    if restart:
        torpord.restart()


def remove(torpord: Torpord, name: str) -> None:
    """`torpor rm`, so that the module's daemon does not restage every earlier case's snapshot at
    each restart."""
    r = torpord.cli("rm", name)
    assert r.returncode == 0, r.stderr


def function_dir(tmp: Path, name: str, preload: list[str], version: int, keepalive: str = "") -> Path:
    """A copy of echoer named `name` whose answers carry `version`."""
    d = tmp / f"{name}-v{version}"
    shutil.copytree(ECHOER, d)
    handler = d / "handler.py"
    handler.write_text(handler.read_text().replace('return {"said": said}', f'return {{"said": said, "version": {version}}}'))
    (d / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "handler:Echoer"\npreload = {json.dumps(preload)}\ntimeout_s = 30\n{keepalive}'
    )
    return d


def poll(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Like conftest.wait_until, but every 5 ms: a CRIU dump of echoer lasts a few tenths."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.005)


def partial_in(torpord: Torpord, prefix: str) -> Callable[[], bool]:
    def seen() -> bool:
        return any(e.name.startswith(f".{prefix}") and ".partial-" in e.name for e in (torpord.state / "snapshots").iterdir())

    return seen


def deploy_until(torpord: Torpord, fdir: Path, point: str) -> None:
    """Runs `torpor deploy --json fdir` and kills the daemon at `point`: right after the phase
    line of that name, or inside the CRIU dump of the base (`dump_base`) or function
    (`dump_function`) snapshot."""
    p = subprocess.Popen(
        [str(torpord.binary), "deploy", "--json", str(fdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TORPOR_SOCKET=str(torpord.socket)),
    )
    try:
        assert p.stdout is not None
        if point.startswith("dump_"):
            prefix = "base-" if point == "dump_base" else "fn-"
            poll(partial_in(torpord, prefix), 60, f"the {prefix} CRIU dump to begin")
        else:
            for line in p.stdout:
                if json.loads(line).get("phase") == point:
                    break
            else:
                pytest.fail(f"the deploy ended before its {point} line\n{torpord.log_text()}")
        kill_daemon(torpord)
    finally:
        p.kill()
        p.wait()


def answers(torpord: Torpord, name: str) -> dict[str, Any]:
    r = torpord.invoke(name, {"say": "hi"})
    assert r.status == 200, f"{r.status} {r.body!r}\n{torpord.log_text()}"
    return dict(r.json())


def state_of(torpord: Torpord, name: str) -> str | None:
    """The function's state; None when the daemon does not know it."""
    r = torpord.request("GET", f"/v1/functions/{name}")
    if r.status == 404:
        return None
    assert r.status == 200, r.body
    return str(r.json()["state"])


# Points before the base snapshot is recorded: their deploy must boot a base of its own.
NEW_BASE = ["boot_base", "dump_base", "snapshot_base"]
# After the function snapshot is recorded, the deploy has taken effect.
TAKEN = {"snapshot_function", "stage", "profile"}


@pytest.mark.parametrize(
    "point", ["validate", *NEW_BASE, "restore_base", "load", "dump_function", "snapshot_function", "stage", "profile"]
)
def test_a_crashed_first_deploy_leaves_nothing_behind(torpord: Torpord, tmp_path: Path, point: str) -> None:
    for round_ in ROUNDS:
        name = f"first-{point.replace('_', '-')}-{round_}"
        # A preload set no other case has (a new base key) where the crash must come before the
        # base exists.
        preload: list[str] = []
        if point in NEW_BASE:
            k = NEW_BASE.index(point) * len(ROUNDS) + round_
            preload = [STDLIB[k % len(STDLIB)]]
        deploy_until(torpord, function_dir(tmp_path, name, preload, 1), point)
        restart_checked(torpord)
        state = state_of(torpord, name)
        if point in TAKEN:
            assert state == "ready"
            assert answers(torpord, name)["version"] == 1
        else:
            # Right after its validate line, the daemon may die before it recorded the function.
            assert state == "failed" or (point == "validate" and state is None), torpord.log_text()
            if state is not None:
                r = torpord.invoke(name, {"say": "hi"})
                assert r.status == 409, r.body
                assert b"interrupted" in r.body and b"torpord stopped" in r.body, r.body
        stop_checked(torpord)
        if round_ == 0 and point in ("dump_base", "load"):
            # A deploy after the crash works.
            torpord.deploy(function_dir(tmp_path, name, preload, 2))
            assert answers(torpord, name)["version"] == 2
        if state_of(torpord, name) is not None:
            remove(torpord, name)


@pytest.mark.parametrize("point", ["validate", "restore_base", "load", "dump_function", "snapshot_function", "stage", "profile"])
def test_a_crashed_redeploy_keeps_the_previous_deploy_serving(torpord: Torpord, tmp_path: Path, point: str) -> None:
    name = f"re-{point.replace('_', '-')}"
    serving = 1
    torpord.deploy(function_dir(tmp_path, name, [], serving))
    assert answers(torpord, name)["version"] == serving
    for round_ in ROUNDS:
        new = round_ + 2
        deploy_until(torpord, function_dir(tmp_path, name, [], new), point)
        restart_checked(torpord)
        assert state_of(torpord, name) == "ready", torpord.log_text()
        if point in TAKEN:
            serving = new
        assert answers(torpord, name)["version"] == serving
        assert_only_listed_processes(torpord)
        stop_checked(torpord)
    remove(torpord, name)


def test_a_graceful_stop_kills_the_instances_of_an_earlier_daemon_that_have_not_reconnected(torpord: Torpord, tmp_path: Path) -> None:
    """The slow exit seen in CI (a graceful stop that left a worker running for up to a minute):
    a restarted daemon waits up to 10 s for the workers of the live instances an earlier daemon
    left to reconnect, and no pool holds them meanwhile. A stop in that window stopped only the
    pools' instances, so such a worker reconnected to no daemon and retried for its reattach_s
    (60 s) before it exited. Held here deterministically: the worker is stopped (SIGSTOP) across
    the restart, so it cannot reconnect before the graceful stop."""
    name = "late-reattach"
    torpord.deploy(function_dir(tmp_path, name, [], 1))
    assert answers(torpord, name)["version"] == 1
    (inst,) = [i for i in torpord.instances(name) if i.get("pid")]
    init = int(inst["pid"])
    worker = int(Path(f"/proc/{init}/task/{init}/children").read_text().split()[0])
    kill_daemon(torpord)
    os.kill(worker, signal.SIGSTOP)
    try:
        torpord.restart()
        # Serving (its signal handlers are installed), the instance still not re-adopted.
        assert torpord.request("GET", "/v1/functions").status == 200
        # The log file may trail the daemon (its writer is non-blocking): under load the line
        # reached it after the first answer (CI, session 24). Well inside the 10 s window.
        wait_until(
            lambda: "waiting for the live instances of an earlier torpord to reconnect" in torpord.log_text(),
            5,
            "the daemon to log that it waits for the earlier instances",
        )
        assert "re-adopted an instance" not in torpord.log_text().split("torpord ready")[-1]
        torpord.proc.send_signal(signal.SIGTERM)
        assert torpord.proc.wait(timeout=30) == 0, torpord.log_text()
        wait_until(lambda: gone(init) and gone(worker), 5, "the tree that had not reconnected to be killed")
        assert not daemon_processes(torpord.state), describe(daemon_processes(torpord.state))
        assert not instance_rows(torpord, name), "the stopped instance's row is left"
    finally:
        if not gone(worker):
            os.kill(worker, signal.SIGCONT)
        if torpord.proc.poll() is not None:
            torpord.restart()
    remove(torpord, name)


def test_a_restore_that_ends_after_the_start_up_sweep_is_killed_when_its_worker_says_hello(torpord: Torpord, tmp_path: Path) -> None:
    """A restore an earlier daemon had in flight when it was killed (the deploy's profiling
    restore at its `profile` step, an instance's) may end after the next daemon's start-up
    sweep, which kills only what exists when it lists /proc: its worker, once woken, says hello
    as a restored instance that this daemon does not hold. Stood in for deterministically by
    the function snapshot restored by hand, once the daemon is up, and its worker woken. The
    daemon kills the tree as soon as the worker says hello (before the fix the connection
    waited unclaimed for 30 s, then the worker in its reconnect loop for reattach_s, and a
    graceful stop left it running)."""
    name = "late-restore"
    torpord.deploy(function_dir(tmp_path, name, [], 1))
    [(snap,)] = registry(torpord, "SELECT path FROM snapshots WHERE function = ? AND kind = 'function'", name)
    r = subprocess.run(
        [str(torpord.binary), "restore", snap, "--detach", "--key", str(torpord.state / "snapshot.key")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TORPOR_LOG_DIR=str(tmp_path / "logs")),
    )
    assert r.returncode == 0, r.stderr
    init = int(r.stdout.split()[0])
    try:
        children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        assert children, f"the restored init {init} has no worker"
        worker = int(children[0])
        assert init in daemon_processes(torpord.state), "the hand-restored tree is not marked as the daemon's"
        os.kill(worker, signal.SIGUSR2)
        wait_until(lambda: gone(init), 10, "the stray tree to be killed")
        # Logged just after the kill.
        torpord.log_line("killed a worker of an instance this torpord does not hold", timeout=10)
        assert_only_listed_processes(torpord)
        assert answers(torpord, name)["version"] == 1
        stop_checked(torpord)
    finally:
        if not gone(init):
            os.kill(init, signal.SIGKILL)
    remove(torpord, name)


# The steps of a hibernation's journal (crates/torpord/src/recovery.rs, hibernation_step), each
# recorded before it acts; `TORPORD_HOLD=hibernate:<step>` holds the daemon right after one so that
# the kill lands there. `in_dump`: inside CRIU's dump (its half-written directory seen), unheld.
HIBERNATION_POINTS = ["quiesce", "quiet", "dump", "in_dump", "record"]
# Up to these, the worker tree is alive: the restart undoes the hibernation. At `record` the
# snapshot is committed and the tree gone: the restart finishes it.
UNDONE = {"quiesce", "quiet", "dump", "in_dump"}
# What the daemon logs when it drops an instance whose hibernation was interrupted.
DROPPED = "a hibernation was interrupted by a torpord stop"
KEEPALIVE = "[keepalive]\ngpu_release_s = 0.2\nhibernate_s = 0.4\nevict_s = 600\n"


def journal_step(torpord: Torpord, step: str) -> Callable[[], bool]:
    return lambda: bool(registry(torpord, "SELECT 1 FROM journal WHERE op = 'hibernate' AND step = ?", step))


def instance_rows(torpord: Torpord, name: str) -> list[tuple[Any, ...]]:
    return registry(torpord, "SELECT id, stage, pid FROM instances WHERE function = ?", name)


def crash_hibernation(torpord: Torpord, name: str, point: str) -> tuple[str, int]:
    """Sends a request to `name`, lets its instance go idle, and kills the daemon at `point` of its
    hibernation. Returns the instance's id and init pid."""
    hold = "" if point == "in_dump" else f"hibernate:{point}"
    if torpord.env.get("TORPORD_HOLD", "") != hold:
        # Serving (its signal handlers are installed once it answers), then stopped.
        assert torpord.request("GET", "/v1/functions").status == 200
        torpord.proc.send_signal(signal.SIGTERM)
        assert torpord.proc.wait(timeout=30) == 0, torpord.log_text()
        torpord.env["TORPORD_HOLD"] = hold
        torpord.restart()
    assert answers(torpord, name)["version"] == 1
    rows = [r for r in instance_rows(torpord, name) if r[2] is not None]
    assert len(rows) == 1, rows
    seen = partial_in(torpord, "hib-") if point == "in_dump" else journal_step(torpord, point)
    poll(seen, 30, f"the hibernation's {point}")
    kill_daemon(torpord)
    return str(rows[0][0]), int(rows[0][2])


def test_an_interrupted_hibernation_loses_no_instance(torpord: Torpord, tmp_path: Path) -> None:
    """Issue 21: kill -9 at each step of a hibernation and inside its CRIU dump, three rounds each.
    While the worker tree lives the restart undoes the hibernation (the same process is taken
    back warm); once the snapshot is committed it finishes it (the instance sleeps). Either way
    the instance is listed and answers, a graceful stop leaves no process of the daemon's, and no
    half-written or unregistered snapshot is left."""
    name = "hib-crash"
    torpord.deploy(function_dir(tmp_path, name, [], 1, KEEPALIVE))
    try:
        for point in HIBERNATION_POINTS:
            for round_ in ROUNDS:
                undone_before = torpord.log.read_text(errors="replace").count("hibernation interrupted by a torpord stop was undone")
                iid, pid = crash_hibernation(torpord, name, point)
                torpord.env["TORPORD_HOLD"] = ""
                torpord.restart()
                log = torpord.log.read_text(errors="replace")
                what = f"{point}, round {round_}\n{torpord.log_text()}"
                if point in UNDONE:
                    assert log.count("hibernation interrupted by a torpord stop was undone") == undone_before + 1, what
                    # The very process is taken back (it may hibernate again 0.4 s later).
                    wait_until(
                        lambda: any(r[0] == iid and r[2] == pid for r in instance_rows(torpord, name))
                        and pid in listed_pids(torpord),
                        15,
                        f"instance {iid} (pid {pid}) to be re-adopted after a kill at {point}",
                    )
                else:
                    assert "had written and sealed its snapshot: finished" in log, what
                    rows = instance_rows(torpord, name)
                    assert [(r[0], r[1]) for r in rows] == [(iid, "hibernated")], (rows, what)
                listed = [i["id"] for i in torpord.instances(name)]
                assert iid in listed, (listed, what)
                assert not registry(torpord, "SELECT 1 FROM journal"), what
                assert_only_listed_processes(torpord)
                assert_no_stray_snapshots(torpord)
                assert answers(torpord, name)["version"] == 1
                assert DROPPED not in torpord.log.read_text(errors="replace"), what
                stop_checked(torpord)
    finally:
        torpord.env.pop("TORPORD_HOLD", None)
    remove(torpord, name)


# --------------------------------------------------------------------------------------------
# GPU: skipped without torch and a CUDA device; run on the GPU machine.

GPUSLEEPY = FUNCTIONS / "gpusleepy"


def gpu_apps() -> set[int]:
    """Host pids of the processes holding GPU memory (nvidia-smi --query-compute-apps)."""
    r = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60, check=True
    )
    return {int(line) for line in r.stdout.split() if line.strip().isdigit()}


def assert_gpu_held_only_by_listed(torpord: Torpord, before: set[int], settle_s: float = 20.0) -> None:
    """No process the daemon does not list holds GPU memory. The driver frees a killed process's
    GPU memory after the process is gone from the process table, and nvidia-smi lists it until
    then, so strays get `settle_s` to go; one still there after that fails the test. The daemon
    itself counts as listed: on the split GPU path its restore server keeps segments in a GPU
    cache of its own (`gpu_cache_bytes`), which a restarted daemon fills again as it stages."""
    listed = listed_pids(torpord) | {torpord.proc.pid}
    deadline = time.monotonic() + settle_s
    while True:
        stray = [p for p in gpu_apps() - before if not in_tree(p, listed)]
        if not stray or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not stray, f"GPU memory held by processes the daemon does not list: {describe(stray)}\n{torpord.log_text()}"


@pytest.mark.parametrize("point", ["dump_base", "load", "dump_function", "hibernation"])
def test_a_crashed_gpu_deploy_or_hibernation_holds_no_gpu_memory(
    torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory, point: str
) -> None:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi and a CUDA device")
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True, text=True, timeout=120, check=False
    )
    if r.stdout.strip() != "True":
        pytest.skip("needs PyTorch with a CUDA device")
    before = gpu_apps()
    tmp = tmp_path_factory.mktemp("gpu-crash")
    d = Torpord(torpor_bin, tmp)
    try:
        fdir = tmp / "gpusleepy"
        shutil.copytree(GPUSLEEPY, fdir)
        if point == "hibernation":
            d.deploy(fdir)
            assert d.invoke("gpusleepy", {"x": [0.5, -1.0, 2.0, 0.0]}).status == 200
            # gpusleepy hibernates 4 s after its request.
            poll(partial_in(d, "hib-"), 30, "the hibernation's CRIU dump")
            kill_daemon(d)
            # Killed inside the dump. Transparent path: the worker's CUDA state was checkpointed
            # by the driver; the restart restores and unlocks it and takes the very process back
            # (issue 21). Split path: the worker had released its segments, and what the daemon
            # saved of them went with it: the instance is dropped, saying so.
            d.restart()
            log = lambda: d.log.read_text(errors="replace")  # noqa: E731
            undone = "hibernation interrupted by a torpord stop was undone"
            dropped = "handed its segments over"
            wait_until(lambda: undone in log() or dropped in log(), 20, "the interrupted hibernation to be settled")
            if undone in log():
                wait_until(lambda: bool(listed_pids(d)), 20, "the interrupted instance to be re-adopted")
            assert_only_listed_processes(d)
            assert_no_stray_snapshots(d)
            r = d.invoke("gpusleepy", {"x": [0.5, -1.0, 2.0, 0.0]})
            assert r.status == 200, f"{r.status} {r.body!r}\n{d.log_text()}"
            # Undone: the same process, its state kept (its second call); else a fresh restore.
            assert r.json()["calls"] == (2 if undone in log() else 1), (r.json(), d.log_text())
        else:
            deploy_until(d, fdir, point)
            restart_checked(d)
        assert_gpu_held_only_by_listed(d, before)
        # Not started again: a new daemon opens the GPU at its start (its context and pinned
        # host cache, crate::split::Split::open_gpus_at_start), which is not what this waits for.
        # With the restart the check passed only when nvidia-smi looked before the new daemon's
        # GPU was open (session 30: all four cases failed in the module's run on an H200).
        stop_checked(d, restart=False)
        try:
            wait_until(lambda: not (gpu_apps() - before), 20, "the GPU memory of the daemon's processes to be freed")
        except AssertionError as e:
            # Which processes, what they hold, and what the daemon said as it stopped.
            held = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=60, check=False,
            ).stdout.strip()
            left = sorted(gpu_apps() - before)
            raise AssertionError(f"{e}: {describe(left)}\nnvidia-smi: {held}\n{d.log_text()[-3000:]}") from None
    finally:
        d.stop()
