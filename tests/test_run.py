"""`torpor run`: the command runs under an init at PID 1 of its own namespaces, ready to snapshot."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from conftest import (
    PYTHON,
    SERVER,
    Torpor,
    Workers,
    alive,
    children,
    ns_id,
    nspid,
    parse_pid,
    wait_until,
)


def fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            pass
    return out


def test_run_starts_command_in_its_own_namespaces(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    # An fd the caller leaves open must not reach the command (CRIU could not dump it).
    leak = tmp_path / "inherited"
    leak.write_text("x")
    fd = os.open(leak, os.O_RDONLY)
    ready, sock, log = tmp_path / "ready", tmp_path / "s.sock", tmp_path / "run.log"
    try:
        p = subprocess.run(
            [str(torpor.binary), "run", "--log", str(log), "--", PYTHON, str(SERVER)]
            + ["--ready", str(ready), "--unix", str(sock)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(fd)
    init = parse_pid(p)
    workers.track(init)
    wait_until(ready.exists, 30, "the command to be ready")
    assert children(init) and len(children(init)) == 1, f"init {init} has children {children(init)}"
    child = children(init)[0]
    workers.track(child)

    assert nspid(init)[-1] == 1, "the init is not PID 1 of its PID namespace"
    assert len(nspid(child)) == 2
    me = os.getpid()
    for kind in ("pid", "mnt", "net"):
        assert ns_id(init, kind) != ns_id(me, kind), f"no new {kind} namespace"
        assert ns_id(child, kind) == ns_id(init, kind)

    targets = fd_targets(child)
    assert targets.get(0) == "/dev/null"
    assert targets.get(1) == str(log) and targets.get(2) == str(log)
    assert str(leak) not in targets.values(), f"inherited fd reached the command: {targets}"
    assert str(leak) not in fd_targets(init).values(), "inherited fd reached the init"
    # A new session led inside the tree (CRIU refuses a session leader outside it).
    assert os.getsid(child) != os.getsid(me)


def test_run_forwards_sigterm_and_init_exits_with_command(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = workers.server()
    child = w.child_pid
    os.kill(w.init_pid, signal.SIGTERM)
    wait_until(lambda: not alive(child), 10, "SIGTERM to reach the command")
    w.wait_gone(10)


def test_restore_without_detach_forwards_sigterm(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    w = workers.server(data_file=False)
    assert w.ask("incr") == "1"
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()
    p, _out, err = workers.popen_torpor("restore", snap)
    assert w.ask("get", wait=30) == "1"
    # A signal before restore says it waits interrupts the restore itself; after, it is forwarded.
    wait_until(lambda: "waiting" in err.read_text(), 30, "restore to say it waits for the restored tree")
    p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=30)
    # The command dies of SIGTERM; the init reports it shell-style, and restore passes it on.
    assert code == 128 + signal.SIGTERM, f"restore exited {code}\n{err.read_text()}"


# rt_sigtimedwait, the system call `supervise` waits in, by machine.
SIGTIMEDWAIT = {"x86_64": 128, "aarch64": 137}


def waiting_in_sigtimedwait(tid_dir: Path) -> bool:
    fields = (tid_dir / "syscall").read_text().split()
    return bool(fields) and fields[0] == str(SIGTIMEDWAIT[os.uname().machine])


def blocked_signals(tid_dir: Path) -> int:
    for line in (tid_dir / "status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk in {tid_dir}/status")


def test_restore_without_detach_leaves_no_thread_that_could_take_its_signals(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    """The kernel gives a process's signal to any of its threads that does not block it. While
    restore waits for the tree, every thread but the one in sigwaitinfo must block the signals it
    forwards and SIGCHLD: a pool thread that did not would take the SIGTERM (or the SIGCHLD of
    the tree's exit), and restore would wait for ever. This checks the masks, which is
    deterministic; the hang itself only shows under load."""
    w = workers.server(data_file=False)
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()
    p, _out, err = workers.popen_torpor("restore", snap)
    assert w.ask("get", wait=30) == "0"
    wait_until(lambda: "waiting" in err.read_text(), 30, "restore to say it waits for the restored tree")
    tasks = sorted(Path(f"/proc/{p.pid}/task").iterdir())
    wait_until(lambda: any(waiting_in_sigtimedwait(t) for t in tasks), 30, "restore to wait in sigwaitinfo")
    others = [t for t in tasks if not waiting_in_sigtimedwait(t)]
    # Restore hashes the snapshot on a thread pool, whose threads outlive the hashing.
    assert others, "restore runs no other thread, so this test checks nothing: start one another way"
    must_block = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD]
    for t in others:
        blocked = blocked_signals(t)
        free = [s.name for s in must_block if not blocked & (1 << (s - 1))]
        assert not free, f"thread {t.name} of restore does not block {free} (SigBlk {blocked:016x})"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM, err.read_text()


def test_run_of_missing_program_fails_cleanly(torpor: Torpor, tmp_path: Path) -> None:
    line = torpor.fails("run", "--log", tmp_path / "log", "--", "/nonexistent/program")
    assert "/nonexistent/program" in line, line


def test_restore_log_gives_each_copy_its_own_stdout_and_a_bad_path_one_error(
    torpor: Torpor, workers: Workers, tmp_path: Path
) -> None:
    w = workers.server(data_file=False)
    old = Path(fd_targets(w.child_pid)[1])
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap)
    w.wait_gone()
    assert torpor.inspect_json(snap)["stdio_files"] == [{"path": str(old), "key": str(old).lstrip("/")}]

    bad = tmp_path / "file"
    bad.write_text("")
    line = torpor.fails("restore", snap, "--detach", "--log", bad / "x.log")
    assert str(bad / "x.log") in line and "--log" in line, line

    size = old.stat().st_size
    copy = tmp_path / "copy" / "out.log"
    restored = workers.restore(snap, "--log", copy, endpoint=w.endpoint, name="copy", wait=30)
    # The init and the command both hold stdout and stderr: every descriptor moved.
    for pid in (restored.init_pid, restored.child_pid):
        targets = fd_targets(pid)
        assert targets.get(1) == str(copy) and targets.get(2) == str(copy), (pid, targets)
    assert old.stat().st_size == size, "the restored copy wrote to the snapshot's log"
