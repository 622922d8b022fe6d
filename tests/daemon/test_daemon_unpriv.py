"""Unprivileged workers (issue 13, item 2; docs/security.md): each tenant's workers run as a user
of its own, with no capability, seeing the host read-only but for their own /tmp, /var/tmp and
/dev/shm; the state directory, the host's tmpfs files, the daemon and other processes are out of
their reach, through deploy, cold start (restore), hibernation and wake.

Every hostile probe here succeeds against a worker that runs as root (the behaviour before): root
writes / and /etc, reads the whole state directory that was bound in, and takes its own /proc and
/tmp away to find the host's procfs and /tmp below them, from which it reads the host's /dev/shm
(/proc/1/root) and signals any host pid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import FUNCTIONS, Torpord

PROBER = FUNCTIONS / "prober"
NO_CAPS = "0000000000000000"


@pytest.fixture(scope="module")
def torpord(torpor_bin: Path, criu_ready: None) -> Iterator[Torpord]:
    """A daemon whose root (state dir, sockets) is a 0700 directory on the host's disk, as
    /var/lib/torpor is: workers get only the pieces they need of it, through a tmpfs over it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = Path(tempfile.mkdtemp(prefix="torpor-unpriv-", dir="/var/lib"))
    d = Torpord(torpor_bin, root)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def function_dir(parent: Path, name: str, tenant: str) -> Path:
    d = parent / name
    shutil.copytree(PROBER, d)
    toml = d / "torpor.toml"
    text = toml.read_text().replace('name = "prober"', f'name = "{name}"\ntenant = "{tenant}"')
    toml.write_text(text)
    return d


@pytest.fixture(scope="module")
def deployed(torpord: Torpord, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two tenants' probers: alpha's directory under /tmp (the worker's /tmp is its own), beta's
    under the daemon's 0700 root (reached through a tmpfs made over it)."""
    a = function_dir(tmp_path_factory.mktemp("unpriv"), "prober-a", "alpha")
    b = function_dir(torpord.root, "prober-b", "beta")
    a2 = function_dir(tmp_path_factory.mktemp("unpriv2"), "prober-a2", "alpha")
    for d in (a, b, a2):
        torpord.deploy(d)
    return {"a": a, "b": b}


def call(torpord: Torpord, name: str, request: Any) -> tuple[str | None, Any]:
    r = torpord.invoke(name, request)
    assert r.status == 200, (r.status, r.body, torpord.log_text())
    return r.start, r.json()


def ids(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k != "calls"}


def wait_stage(torpord: Torpord, name: str, stage: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(i["stage"] == stage for i in torpord.instances(name)):
        assert time.monotonic() < deadline, f"no {stage} instance of {name}\n{torpord.log_text()}"
        time.sleep(0.05)


def worker_pids(uid: int) -> list[int]:
    """Host pids of torpor workers running as `uid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        if b"torpor.worker" in cmdline and int(uids[0]) == uid:
            out.append(int(name))
    return out


def test_each_tenant_runs_as_a_user_of_its_own_through_restore_hibernation_and_wake(
    torpord: Torpord, deployed: dict[str, Any]
) -> None:
    start, a = call(torpord, "prober-a", {"op": "whoami"})
    assert start == "restored" and a["calls"] == 1, (start, a)
    assert a["uid"] != 0 and a["uid"] == a["euid"] == a["gid"] == a["egid"], a
    assert a["groups"] == [], a
    status = a["status"]
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[cap] == NO_CAPS, (cap, a)
    assert status["NoNewPrivs"] == "1", a

    _, b = call(torpord, "prober-b", {"op": "whoami"})
    assert b["uid"] != 0 and b["uid"] != a["uid"] and b["gid"] != a["gid"], (a, b)
    assert ids(b) == {**ids(a), "uid": b["uid"], "euid": b["uid"], "gid": b["gid"], "egid": b["gid"]}
    _, a2 = call(torpord, "prober-a2", {"op": "whoami"})
    assert ids(a2) == ids(a), (a, a2)  # one tenant, one user

    # Hibernated (CRIU dumps it) and woken (CRIU restores its credentials): the same answer.
    wait_stage(torpord, "prober-a", "hibernated")
    start, woken = call(torpord, "prober-a", {"op": "whoami"})
    assert woken["calls"] == 2, (start, woken)  # its memory came back from the hibernation
    assert ids(woken) == ids(a), (a, woken)


def test_a_function_cannot_write_the_hosts_files_and_can_write_its_scratch(
    torpord: Torpord, deployed: dict[str, Any]
) -> None:
    tag = f"torpor-unpriv-{os.getpid()}"
    # World-writable, on the host's disk: only a read-only view keeps a user out of it.
    open_dir = Path(tempfile.mkdtemp(prefix=tag, dir="/var/lib"))
    open_dir.chmod(0o1777)
    host = [Path("/") / tag, Path("/etc") / tag, open_dir / "x"]
    scratch = [Path("/var/tmp") / tag, Path("/tmp") / tag, Path("/dev/shm") / tag]
    try:
        _, wrote = call(torpord, "prober-a", {"op": "write", "paths": [str(p) for p in host + scratch]})
        for p in host:
            assert wrote[str(p)] in ("EROFS", "EACCES", "EPERM"), (p, wrote)
            assert not p.exists(), p
        for p in scratch:
            assert wrote[str(p)] == "ok", (p, wrote)
            assert not p.exists(), f"{p}: the function's write reached the host"
        _, read = call(torpord, "prober-a", {"op": "read", "paths": [str(p) for p in scratch]})
        assert all(v.startswith("ok:written by a function") for v in read.values()), read
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)
        for p in host + scratch:
            if p.is_file():
                p.unlink()


def test_a_function_cannot_reach_the_state_directory(torpord: Torpord, deployed: dict[str, Any]) -> None:
    state = torpord.state
    assert (state / "snapshot.key").is_file(), sorted(os.listdir(state))
    secrets = [
        *[p for p in state.iterdir() if p.is_file()],  # the snapshot key, the registry
        state / "snapshots",
        state / "logs",
        state / "functions",
        next(state.joinpath("snapshots").rglob("manifest.json")),
    ]
    _, read = call(torpord, "prober-b", {"op": "read", "paths": [str(p) for p in secrets]})
    for p, v in read.items():
        assert not v.startswith("ok"), (p, v)
    writes = [state / "x", state / "sock" / "x", state / "init" / "x", state / "snapshots" / "x"]
    _, wrote = call(torpord, "prober-b", {"op": "write", "paths": [str(p) for p in writes]})
    for p in writes:
        assert wrote[str(p)] != "ok" and not p.exists(), (p, wrote)


def test_a_function_cannot_reach_host_tmpfs_files_or_signal_the_daemon_or_others(
    torpord: Torpord, deployed: dict[str, Any]
) -> None:
    tag = f"torpor-unpriv-secret-{os.getpid()}"
    # /run is a directory of the root filesystem on this machine (a tmpfs on most nodes).
    planted = [Path("/dev/shm") / tag, Path("/tmp") / tag, Path("/run") / tag]
    for p in planted:
        p.write_text("host secret\n")
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        _, b = call(torpord, "prober-b", {"op": "whoami"})
        others = worker_pids(b["uid"])
        assert others, "no worker of tenant beta found"
        paths = [*map(str, planted), *(f"/proc/1/root{p}" for p in planted)]
        targets = [[torpord.proc.pid, 0], [sleeper.pid, signal.SIGKILL], [others[0], 0]]
        _, out = call(torpord, "prober-a", {"op": "escape", "read": paths, "signal": targets})
        assert all(v != "ok" for v in out["umount"].values()), out
        for p, v in out["read"].items():
            assert not v.startswith("ok"), (p, out)
        for pid, how in out["signal"].items():
            assert how["kill"] != "ok" and how["pidfd"] != "ok", (pid, out)
        assert sleeper.poll() is None, "the function killed a host process"
        assert torpord.proc.poll() is None
        # Its own /proc and /tmp are still there: it serves on.
        _, again = call(torpord, "prober-a", {"op": "read", "paths": ["/proc/self/status"]})
        assert again["/proc/self/status"].startswith("ok:Name:"), again
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in planted:
            p.unlink(missing_ok=True)


def test_an_impossible_uid_range_is_refused_in_one_line(torpor_bin: Path, tmp_path: Path) -> None:
    config = tmp_path / "torpord.toml"
    config.write_text("[workers]\nuid_base = 4294967000\nuid_count = 1000\n")
    r = subprocess.run(
        [torpor_bin, "serve", "--config", config, "--state-dir", tmp_path / "state", "--socket", tmp_path / "s.sock"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "workers.uid_base + workers.uid_count - 1 must be ≤ 4294967294" in lines[0], lines
    assert "lower uid_base or uid_count" in lines[0], lines


def test_a_function_directory_its_user_cannot_read_is_refused_in_one_line(
    torpord: Torpord, deployed: dict[str, Any], tmp_path: Path
) -> None:
    d = function_dir(tmp_path, "prober-closed", "alpha")
    d.chmod(0o700)
    r = torpord.cli("deploy", d)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, (r.stdout, r.stderr)
    assert f"the function directory {d} (mode 700, owner 0:0) cannot be read by its workers" in lines[0], lines
    assert "chmod o+rX" in lines[0], lines


def test_a_data_file_its_user_cannot_read_is_refused_in_one_line(
    torpord: Torpord, deployed: dict[str, Any], tmp_path: Path
) -> None:
    """A declared data file written under a umask of 077 (mode 600, root's): refused at deploy with
    the file, its mode and the fix, not left to fail in setup() (safetensors would say "No such
    file or directory" for a file it may not open)."""
    d = function_dir(tmp_path, "prober-data", "alpha")
    weights = d / "weights.bin"
    weights.write_bytes(b"\0" * 4096)
    weights.chmod(0o600)
    toml = d / "torpor.toml"
    text = toml.read_text().replace(
        "[scaling]", '[[data]]\nname = "weights"\npath = "weights.bin"\nsize = "auto"\naccess = "read-only"\n\n[scaling]', 1
    )
    toml.write_text(text)
    r = torpord.cli("deploy", d)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, (r.stdout, r.stderr)
    assert f'the data "weights" of the function, {weights} (mode 600, owner 0:0) cannot be read by its workers' in lines[0], lines
    assert "chmod o+r;" in lines[0] and "umask of 077" in lines[0], lines
    weights.chmod(0o644)
    torpord.deploy(d)


def test_with_unprivileged_off_workers_run_as_root_as_before(
    torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("asroot"), config="[workers]\nunprivileged = false\n")
    try:
        d.deploy(function_dir(tmp_path_factory.mktemp("asroot-fn"), "prober-root", "alpha"))
        start, who = call(d, "prober-root", {"op": "whoami"})
        assert start == "restored" and who["uid"] == who["gid"] == 0, (start, who)
        assert "workers run as root (workers.unprivileged = false)" in d.log_text()
    finally:
        d.stop()


def test_a_function_deployed_when_workers_ran_as_root_is_booted_unprivileged_until_redeployed(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    """Issue 13: a function snapshot (and a hibernation) taken while workers ran as root keeps
    root's credentials, which a restore brings back. After the switch to unprivileged workers the
    daemon never restores it: it boots the function's instances as the tenant's user, discards
    the hibernated instances of before, and says so once, naming the function and the fix; a
    redeploy restores again, unprivileged."""
    root = Path(tempfile.mkdtemp(prefix="torpor-unpriv-old-", dir="/var/lib"))
    d = Torpord(torpor_bin, root, config="[workers]\nunprivileged = false\n")
    try:
        fdir = function_dir(tmp_path, "prober-old", "alpha")
        d.deploy(fdir)
        start, before = call(d, "prober-old", {"op": "whoami"})
        assert start == "restored" and before["uid"] == 0, (start, before)
        wait_stage(d, "prober-old", "hibernated")
        d.stop()
        d.config.write_text(d.config.read_text().replace("unprivileged = false", "unprivileged = true"))
        d.restart()

        start, after = call(d, "prober-old", {"op": "whoami"})
        # Booted (not restored, not woken: a woken instance would count its second call).
        assert start == "booted" and after["calls"] == 1, (start, after)
        assert after["uid"] != 0 and after["euid"] != 0 and after["gid"] != 0, after
        log = d.log_text()
        lines = [line for line in log.splitlines() if "was deployed when its workers ran as root" in line]
        assert len(lines) == 1, log
        assert '"prober-old"' in lines[0] and "torpor deploy" in lines[0], lines[0]
        assert not any(i["stage"] in ("hibernated", "evicted") for i in d.instances("prober-old")), d.instances("prober-old")
        assert not worker_pids(0), "a worker runs as root"

        d.deploy(fdir)
        start, redeployed = call(d, "prober-old", {"op": "whoami"})
        assert start in ("restored", "warm") and redeployed["uid"] == after["uid"], (start, redeployed)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
