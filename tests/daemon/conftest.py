"""A real `torpor serve` for the daemon tests: its own state directory, API socket and config,
and an HTTP client over the socket. Every worker it started is killed at teardown."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FAKES, FakeCuda, cmdline, kill_tree, pids_with
from torpor import client

HERE = Path(__file__).resolve().parent
FUNCTIONS = HERE / "functions"

# The marker every process the daemon starts carries (crates/torpord/src/recovery.rs).
OWNER_ENV = "TORPORD_STATE_DIR"

# Small so the over-capacity paths are quick to reach: 3 waiting requests, 1.5 s in the queue.
QUEUE_LENGTH = 3
QUEUE_TIMEOUT_S = 1.5


class Answer(client.Response):
    """An answer, with the daemon's start and timings headers read."""

    @property
    def start(self) -> str | None:
        return self.headers.get("x-torpor-start")

    @property
    def timings(self) -> dict[str, float]:
        return dict(json.loads(self.headers.get("x-torpor-timings", "{}")))


def cgroup_tag(state: Path) -> str:
    """The name torpord gives its cgroups' directory for a state directory (crate::cgroup::tag:
    FNV-1a of the path, its upper 32 bits)."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(str(state)):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"torpor-{h >> 32:08x}"


def cgroup_dirs(lines: list[str] | str) -> list[Path]:
    """The directories of the cgroups that /proc/PID/cgroup `lines` name, in the memory, cpu and
    pids hierarchies of cgroup v1 (where those are mounted) else in cgroup v2."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    root = Path("/sys/fs/cgroup")
    dirs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if controllers == "" and (root / "cgroup.controllers").is_file():
            dirs.append(root / path.lstrip("/"))
        elif any(n in ("memory", "cpu", "pids") for n in names):
            mount = next((root / m for m in (controllers, *names) if (root / m / "cgroup.procs").is_file()), None)
            if mount is not None:
                dirs.append(mount / path.lstrip("/"))
    return dirs


def cgroup_bases(state: Path) -> list[Path]:
    """The directories of the cgroups of the daemon of `state`, where they exist (under the test
    process's own cgroups, which the daemon it started shares)."""
    tag = cgroup_tag(state)
    return [d / tag for d in cgroup_dirs(Path("/proc/self/cgroup").read_text()) if (d / tag).is_dir()]


def remove_cgroups(state: Path) -> None:
    """Removes what a daemon of `state` that did not stop cleanly left in the cgroup file system
    (its trees must be gone)."""
    for base in cgroup_bases(state):
        for child in base.iterdir():
            if child.is_dir():
                with contextlib.suppress(OSError):
                    child.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()


# One init copy per binary for the whole session, hard-linked into each daemon's state/init.
_INIT_COPIES: dict[Path, Path] = {}


def share_init_copy(binary: Path, state: Path, *, before: bool) -> None:
    """Each daemon copies its binary, content-addressed, into `state/init` (launch.rs's
    init_binary): ~220 MB of debug binary per daemon, ~24 GB over the suite. The copy's name is
    its hash, and the daemon keeps one that exists: so `before` the start the session's copy is
    hard-linked in, and after the first start that copy is remembered. Nothing writes to it."""
    init = state / "init"
    if before:
        copy = _INIT_COPIES.get(binary)
        if copy is not None and copy.exists() and not (init / copy.name).exists():
            # As the daemon makes them (0700; it opens `init` to 0755 itself).
            state.mkdir(mode=0o700, parents=True, exist_ok=True)
            init.mkdir(mode=0o700, exist_ok=True)
            with contextlib.suppress(OSError):
                os.link(copy, init / copy.name)
    elif binary not in _INIT_COPIES:
        made = sorted(init.glob("torpor-init-*"))
        if made:
            _INIT_COPIES[binary] = made[0]


class Torpord:
    def __init__(
        self,
        binary: Path,
        root: Path,
        *extra: str,
        config: str = "",
        env: dict[str, str] | None = None,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        launcher: tuple[str, ...] = (),
    ) -> None:
        """`extra`: more `torpor serve` flags; `config`: more TOML for its config file; `env`: more
        environment for the daemon; `queue_timeout_s`: its queue.timeout_s; `launcher`: a
        command that execs the daemon (`nsenter --net=…`: a node of the cluster test in a
        network namespace of its own), so that its process is still the daemon."""
        self.binary = binary
        self.launcher = list(launcher)
        self.extra = list(extra)
        self.env = dict(env or {})
        self.root = root
        self.state = root / "state"
        self.socket = root / "torpord.sock"
        self.log = root / "torpord.log"
        self.config = root / "torpord.toml"
        root.mkdir(parents=True, exist_ok=True)
        # `config` first: its top-level keys must not land in the [queue] table.
        self.config.write_text(f"{config}\n[queue]\nlength = {QUEUE_LENGTH}\ntimeout_s = {queue_timeout_s}\n")
        self._spawn()

    def _spawn(self) -> None:
        share_init_copy(self.binary, self.state, before=True)
        self.proc = subprocess.Popen(
            [*self.launcher, self.binary, "serve", "--config", self.config, "--state-dir", self.state, "--socket", self.socket, *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),  # noqa: SIM115 (closed with the process)
            env={**{k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"}, **self.env},
        )
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            assert self.proc.poll() is None, f"torpor serve exited\n{self.log_text()}{lock_holders(self.state)}"
            assert time.monotonic() < deadline, "torpor serve did not listen"
            time.sleep(0.02)
        share_init_copy(self.binary, self.state, before=False)

    def restart(self) -> Torpord:
        """Starts the daemon again on the same state directory, after its process ended
        (however it ended); the fixture's teardown stops the new one."""
        assert self.proc.poll() is not None, "stop or kill the daemon first"
        self.socket.unlink(missing_ok=True)
        self._spawn()
        return self

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_pages_in(self, timeout: float = 30.0) -> None:
        """Until no restored instance still has lazy pages to come (torpord's
        `<state>/pages-pending` markers): a daemon killed before that does not re-adopt such an
        instance (its pages would read as zeros), so a test that kills it to see a re-adoption
        waits here first."""
        pending = self.state / "pages-pending"
        deadline = time.monotonic() + timeout
        while pending.is_dir() and any(pending.iterdir()):
            assert time.monotonic() < deadline, f"lazy pages still pending: {sorted(p.name for p in pending.iterdir())}"
            time.sleep(0.05)

    def log_line(self, *parts: str, timeout: float = 30.0) -> str:
        """The first line of the log holding every one of `parts`, waited for: the daemon logs
        some steps (a hibernation's stop, a GPU release) just after the instance shows their
        stage, so a test that saw the stage must not read the log at once."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log.read_text(errors="replace").splitlines():
                if all(p in line for p in parts):
                    return line
            assert time.monotonic() < deadline, f"no line with {parts} in the log\n{self.log_text()}"
            time.sleep(0.05)

    def hibernation_stop_of(self, instance: str, timeout: float = 30.0) -> str:
        """The `hibernation stop` line of `instance` (see `log_line`)."""
        return self.log_line("hibernation stop", instance, timeout=timeout)

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 60.0, headers: dict[str, str] | None = None
    ) -> Answer:
        """`body` as JSON (`None`: no body)."""
        r = client.request(
            self.socket, method, path, None if body is None else json.dumps(body).encode(), timeout, headers
        )
        return Answer(r.status, r.headers, r.body)

    def invoke(self, name: str, request: Any, timeout: float = 60.0, key: str | None = None) -> Answer:
        """`key`: its Idempotency-Key."""
        headers = {"Idempotency-Key": key} if key is not None else None
        return self.request("POST", f"/v1/functions/{name}/invoke", request, timeout, headers)

    def cli(self, *args: str | Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, TORPOR_SOCKET=str(self.socket))
        return subprocess.run(
            [str(self.binary), *map(str, args)], check=False, capture_output=True, text=True, timeout=timeout, env=env
        )

    def deploy(self, fdir: Path) -> list[dict[str, Any]]:
        """`torpor deploy --json DIR`: the NDJSON lines; asserts it succeeded."""
        r = self.cli("deploy", "--json", fdir)
        assert r.returncode == 0, f"deploy {fdir} failed\n{r.stdout}\n{r.stderr}\n{self.log_text()}"
        return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]

    def instances(self, name: str) -> list[dict[str, Any]]:
        r = self.request("GET", f"/v1/functions/{name}")
        assert r.status == 200, r.body
        return list(r.json()["instances"])

    def stop_instances(self, name: str) -> None:
        """`torpor stop NAME`, then until none of its instances has a process: the next request
        starts (restores) one."""
        r = self.cli("stop", name, "--json")
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 30
        while any(i.get("pid") for i in self.instances(name)):
            assert time.monotonic() < deadline, self.instances(name)
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Workers exit when the daemon's connection goes; anything left is killed.
        for pid in pids_with(f"{self.state}/"):
            kill_tree(pid)
        # A daemon killed (not stopped) leaves its cgroups: the killed trees take a moment to go.
        for _ in range(50):
            remove_cgroups(self.state)
            if not cgroup_bases(self.state):
                break
            time.sleep(0.1)
        # A daemon killed (not stopped) leaves its stage area mounted: detach it.
        stage = str(self.state / "stage")
        for _ in range(16):
            mounted = any(line.split()[4] == stage for line in Path("/proc/self/mountinfo").read_text().splitlines())
            if not mounted or subprocess.run(["umount", "--lazy", stage], check=False).returncode != 0:
                break


def lock_holders(state: Path) -> str:
    """The processes that have the state directory's lock file open, the lock's owner (named in
    the "in use by another torpord" refusal) among them: pid, state, wait channels, command
    line. What a refused restart's message adds: which process it was and where it waits."""
    lock = str(state / "torpord.lock")
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if not any(os.readlink(f"/proc/{name}/fd/{fd}") == lock for fd in fds):
                continue
            status = dict(line.split(":", 1) for line in Path(f"/proc/{name}/status").read_text().splitlines() if ":" in line)
            wchan = Path(f"/proc/{name}/wchan").read_text()
            threads = {t: Path(f"/proc/{name}/task/{t}/wchan").read_text() for t in os.listdir(f"/proc/{name}/task")}
        except OSError:
            continue
        out.append(f"pid {name} ({status.get('State', '?').strip()}, ppid {status.get('PPid', '?').strip()}, wchan {wchan}, threads' wchans {sorted(set(threads.values()))}): {cmdline(int(name))[:200]}")
    return "\nholders of " + lock + ":\n" + ("\n".join(out) or "none") + "\n"


def daemon_processes(state: Path) -> list[int]:
    """Live processes the daemon of `state` started: its marker in their environment, or the
    state directory on their command line."""
    owner = f"{OWNER_ENV}={os.path.realpath(state)}".encode()
    path = str(state).encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if owner in environ or path in cmdline:
            found.append(int(name))
    return sorted(found)


def wait_for_starts(d: Torpord, name: str, timeout: float = 60) -> None:
    """Until the daemon has no start of `name` in flight (its placement answer's `starting`)."""
    deadline = time.monotonic() + timeout
    while True:
        r = d.request("GET", f"/v1/functions/{name}/placement")
        assert r.status == 200, r.body
        if r.json()["starting"] == 0:
            return
        assert time.monotonic() < deadline, f"{name} still has starts in flight after {timeout:g} s\n{d.log_text()}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def torpord(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord"))
    try:
        yield d
    finally:
        d.stop()


@contextlib.contextmanager
def two_daemons(
    torpor_bin: Path, roots: tuple[Path, Path], configs: tuple[str, str], envs: tuple[dict[str, str] | None, dict[str, str] | None] = (None, None)
) -> Iterator[tuple[Torpord, Torpord]]:
    """Two daemons on this machine, each with its own state directory (two nodes of one
    bucket, say), both stopped at the end whatever happened."""
    a = Torpord(torpor_bin, roots[0], env=envs[0], config=configs[0])
    try:
        b = Torpord(torpor_bin, roots[1], env=envs[1], config=configs[1])
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


def fake_gpu_env(root: Path, fake_cuda: FakeCuda, **extra: str) -> dict[str, str]:
    """The environment of a daemon whose GPU is tests/fakes (no real driver involved): the fake
    driver built with VMM under the state directory (where the workers reach it: their /tmp is
    their own), every process that maps it a CUDA process in whatever state a call needs, and
    fake NVML. `extra` adds or overrides variables (FAKE_NVML_PROCS_MATCH, FAKE_CUDA_LOG...)."""
    lib = root / "state" / "fake-cuda" / "libcuda.so.1"
    lib.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (the fake_cuda fixture has one)"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", lib, FAKES / "fake_libcuda.c"], check=True)
    return {
        "TORPOR_LIBCUDA": str(lib),
        "TORPOR_LIBNVML": str(fake_cuda.nvml),
        "FAKE_CUDA_PIDS": "*",
        "FAKE_CUDA_DEFAULT_STATE": "any",
        **extra,
    }


@pytest.fixture(scope="module")
def cuda() -> None:
    """Skips unless torch sees a CUDA device (the GPU machine's tests)."""
    r = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.stdout.strip() != "True":
        pytest.skip(f"needs a CUDA device visible to torch ({r.stdout.strip() or r.stderr.strip()[-200:]})")
