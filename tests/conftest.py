"""Shared fixtures for Torpor's integration tests.

Everything here drives the real `torpor` binary, real CRIU and real processes. Workers are started
with `torpor run`, talked to over their sockets, and always killed at teardown (SIGKILL to the init
and every descendant, for restored instances too).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "programs"
FAKES = ROOT / "tests" / "fakes"
sys.path.insert(0, str(PROGRAMS))
# The SDK of this checkout (torpor.client, the daemon tests' HTTP client).
if str(ROOT / "python") not in sys.path:
    sys.path.insert(1, str(ROOT / "python"))

from linesrv import Endpoint, request  # noqa: E402

ERROR_PREFIX = "torpor: error:"
SERVER = PROGRAMS / "stateful_server.py"
CLIENT = PROGRAMS / "client.py"
TCP_PORT = 7000  # every worker has its own network namespace, so one fixed port serves them all
PYTHON = shutil.which("python3") or sys.executable

Arg = str | os.PathLike[str] | int


# --------------------------------------------------------------------------------------------
# Processes


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3, the state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(")") + 2 :].split()


def proc_state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def proc_start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def alive(pid: int) -> bool:
    """Exists and has not exited (a zombie has exited: its memory and files are gone)."""
    return proc_state(pid) not in (None, "Z", "X")


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        # A process that is exiting lists ESRCH rather than ENOENT.
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def pids_with(token: str) -> list[int]:
    """PIDs of live processes whose command line contains `token`."""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me and token in cmdline(int(name)) and alive(int(name)):
            out.append(int(name))
    return out


def nspid(pid: int) -> list[int]:
    """The NSpid line of a host PID: [host pid, ..., pid in its innermost namespace]."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid line for {pid}")


def ns_id(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@dataclass(frozen=True)
class ProcRef:
    """A PID plus its start time, so that a recycled PID is never signalled."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcRef | None:
        start = proc_start_time(pid)
        return None if start is None else cls(pid, start)

    def kill(self) -> None:
        if proc_start_time(self.pid) == self.start:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def gone(self) -> bool:
        return proc_start_time(self.pid) != self.start or not alive(self.pid)


def kill_tree(pid: int) -> list[ProcRef]:
    """SIGKILL a process and all its descendants; returns what was signalled."""
    refs = [r for r in (ProcRef.of(p) for p in [pid, *descendants(pid)]) if r is not None]
    for r in refs:
        r.kill()
    return refs


def in_netns(pid: int, argv: Sequence[Arg], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run argv inside the network namespace of `pid` (nsenter --net=/proc/PID/ns/net)."""
    return subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# --------------------------------------------------------------------------------------------
# The torpor binary


def describe(r: subprocess.CompletedProcess[str]) -> str:
    args = r.args if isinstance(r.args, str) else shlex.join(map(str, r.args))
    return f"`{args}` exited {r.returncode}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}"


def error_line(r: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """Assert the failure form of the CLI: exit `code` and exactly one stderr line, 'torpor: error: ...'."""
    assert r.returncode == code, f"expected exit {code}\n{describe(r)}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1 and len(lines) == 1, (
        f"expected exactly one stderr line, starting with {ERROR_PREFIX!r}\n{describe(r)}"
    )
    return errors[0]


def parse_pid(r: subprocess.CompletedProcess[str]) -> int:
    """The one line a successful `run` or `restore --detach` prints on stdout: a PID."""
    assert r.returncode == 0, describe(r)
    out = r.stdout.strip()
    assert out.isdigit() and "\n" not in out, f"stdout must be exactly one PID\n{describe(r)}"
    return int(out)


def find_torpor() -> Path | None:
    env = os.environ.get("TORPOR_BIN")
    if env:
        return Path(env)
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "torpor"
        if p.is_file():
            return p
    return None


class Torpor:
    """Runs the torpor binary. Output goes through files, never pipes, so a process the command
    leaves behind (a restored tree, a forgotten fd) cannot make the call hang."""

    def __init__(self, binary: Path) -> None:
        self.binary = binary

    def argv(self, args: Sequence[Arg], user: int | None = None) -> list[str]:
        argv = [str(self.binary), *map(str, args)]
        if user is not None:
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
        return argv

    def __call__(
        self,
        *args: Arg,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        user: int | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = self.argv(args, user)
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={**os.environ, **(env or {})}
            )
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
                p.wait()
                code = None
            out.seek(0)
            err.seek(0)
            r = subprocess.CompletedProcess(argv, code if code is not None else -9, out.read(), err.read())
        if code is None:
            raise AssertionError(f"timed out after {timeout:g} s\n{describe(r)}")
        return r

    def ok(
        self, *args: Arg, env: dict[str, str] | None = None, timeout: float = 120.0, user: int | None = None
    ) -> subprocess.CompletedProcess[str]:
        r = self(*args, env=env, timeout=timeout, user=user)
        assert r.returncode == 0, describe(r)
        return r

    def fails(
        self,
        *args: Arg,
        code: int = 1,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        user: int | None = None,
    ) -> str:
        """Run a command that must fail; returns its one 'torpor: error:' line."""
        return error_line(self(*args, env=env, timeout=timeout, user=user), code)

    def inspect_json(self, snap: Path) -> dict[str, object]:
        r = self.ok("inspect", snap, "--json")
        try:
            doc = json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise AssertionError(f"inspect --json is not JSON: {e}\n{describe(r)}") from e
        assert isinstance(doc, dict), describe(r)
        return doc


def manifest_files(doc: dict[str, object]) -> list[dict[str, object]]:
    """The manifest's file list: [{"path", "size", "blake3"}, ...]."""
    files = doc.get("files")
    assert isinstance(files, list) and files, f"manifest has no 'files' list: {json.dumps(doc)[:2000]}"
    for f in files:
        assert isinstance(f, dict) and {"path", "size", "blake3"} <= f.keys(), f"bad file entry {f!r}"
    return files


# --------------------------------------------------------------------------------------------
# Workers


class Worker:
    """A process tree started by `torpor run` (or restored by `torpor restore`), reached through
    its endpoint: a path socket directly, an abstract socket or TCP from inside its netns."""

    def __init__(self, init_pid: int, endpoint: Endpoint, name: str, log: Path | None) -> None:
        self.init_pid = init_pid
        self.endpoint = endpoint
        self.name = name
        self.log = log

    def __repr__(self) -> str:
        return f"Worker({self.name}, init={self.init_pid})"

    @property
    def child_pid(self) -> int:
        """Host PID of CMD, the init's only child."""
        path = f"/proc/{self.init_pid}/task/{self.init_pid}/children"
        found: list[int] = []

        def has_child() -> bool:
            try:
                with open(path) as f:
                    found[:] = [int(x) for x in f.read().split()]
            except FileNotFoundError:
                return False
            return bool(found)

        wait_until(has_child, 10, f"a child of {self}")
        assert len(found) == 1, f"{self}: init has children {found}, expected exactly one"
        return found[0]

    def alive(self) -> bool:
        return alive(self.init_pid)

    def wait_gone(self, timeout: float = 15.0) -> None:
        wait_until(lambda: not alive(self.init_pid), timeout, f"{self} to exit")

    def ask(self, *words: str, wait: float = 0.0, timeout: float = 10.0, fds: Sequence[int] = ()) -> str:
        """One request over the Unix socket (from the host for a path socket, else via nsenter)."""
        if self.endpoint.unix is not None:
            return request(self.endpoint, words, timeout=timeout, wait=wait, fds=fds)
        assert not fds, "passing fds needs a path socket"
        return self.ask_netns(*words, wait=wait, timeout=timeout)

    def ask_netns(self, *words: str, tcp: bool = False, wait: float = 0.0, timeout: float = 10.0) -> str:
        """One request from inside the worker's network namespace (abstract socket or TCP)."""
        if tcp:
            assert self.endpoint.port is not None
            target = ["--tcp", str(self.endpoint.port)]
        elif self.endpoint.abstract is not None:
            target = ["--abstract", self.endpoint.abstract]
        else:
            assert self.endpoint.unix is not None
            target = ["--unix", self.endpoint.unix]
        argv: list[Arg] = [PYTHON, CLIENT, *target, "--wait", str(wait), "--timeout", str(timeout), *words]
        r = in_netns(self.init_pid, argv, timeout=wait + timeout + 30)
        assert r.returncode == 0, f"{self}: request {words} failed\n{describe(r)}\n{self.log_tail()}"
        return r.stdout.strip()

    def ask_json(self, *words: str, wait: float = 0.0, timeout: float = 10.0) -> dict[str, object]:
        answer = self.ask(*words, wait=wait, timeout=timeout)
        doc = json.loads(answer)
        assert isinstance(doc, dict), answer
        return doc

    def log_tail(self, n: int = 4000) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return f"--- {self.log} (tail)\n{self.log.read_text(errors='replace')[-n:]}"


class Workers:
    """Starts and adopts workers under `base` and kills every one of them at cleanup."""

    def __init__(self, torpor: Torpor, base: Path) -> None:
        self.torpor = torpor
        self.base = base
        self.token = f"{base}/"  # every worker started here has a path under base in its argv
        self._refs: list[ProcRef] = []
        self._popens: list[subprocess.Popen[bytes]] = []

    def track(self, pid: int) -> None:
        ref = ProcRef.of(pid)
        if ref is not None:
            self._refs.append(ref)

    def start(
        self,
        argv: Sequence[Arg],
        *,
        endpoint: Endpoint,
        ready: Path | None,
        name: str,
        timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> Worker:
        """`torpor run --log LOG -- ARGV`, then wait for the ready file."""
        log = self.base / f"{name}.log"
        r = self.torpor("run", "--log", log, "--", *argv, env=env)
        pid = parse_pid(r)
        self.track(pid)
        w = Worker(pid, endpoint, name, log)
        if ready is not None:
            wait_until(lambda: ready.exists() or not alive(pid), timeout, f"{w} to be ready")
            assert ready.exists(), f"{w} exited before it was ready\n{w.log_tail()}"
        for child in children(pid):
            self.track(child)
        return w

    def server(
        self,
        name: str = "server",
        *,
        abstract: bool = False,
        port: int | None = TCP_PORT,
        data_file: bool = True,
        hold_mb: int = 0,
        load_lib: Path | None = None,
        threads: int = 0,
        timeout: float = 30.0,
    ) -> Worker:
        """Start tests/programs/stateful_server.py."""
        if abstract:
            endpoint = Endpoint(abstract=f"torpor-test-{name}", port=port)
            where = ["--abstract", endpoint.abstract or ""]
        else:
            endpoint = Endpoint(unix=str(self.base / f"{name}.sock"), port=port)
            where = ["--unix", endpoint.unix or ""]
        ready = self.base / f"{name}.ready"
        argv: list[Arg] = [PYTHON, SERVER, "--ready", ready, *where]
        if port is not None:
            argv += ["--port", port]
        if data_file:
            argv += ["--data-file", self.base / f"{name}.data"]
        if hold_mb:
            argv += ["--hold-mb", hold_mb]
        if load_lib is not None:
            argv += ["--load-lib", load_lib]
        if threads:
            argv += ["--threads", threads]
        return self.start(argv, endpoint=endpoint, ready=ready, name=name, timeout=timeout)

    def adopt(self, init_pid: int, endpoint: Endpoint, name: str) -> Worker:
        """Track a restored instance (killed at cleanup like the others)."""
        self.track(init_pid)
        for d in descendants(init_pid):
            self.track(d)
        return Worker(init_pid, endpoint, name, None)

    def restore(
        self,
        snap: Path,
        *extra: Arg,
        endpoint: Endpoint,
        name: str = "restored",
        env: dict[str, str] | None = None,
        wait: float = 15.0,
    ) -> Worker:
        """`torpor restore SNAP --detach`, then wait until the instance answers 'ping'."""
        r = self.torpor("restore", snap, "--detach", *extra, env=env)
        w = self.adopt(parse_pid(r), endpoint, name)
        assert w.ask("ping", wait=wait) == "pong"
        return w

    def popen_torpor(
        self, *args: Arg, env: dict[str, str] | None = None, new_session: bool = False
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Start torpor in the background; returns the process and its stdout and stderr files."""
        n = len(self._popens)
        out, err = self.base / f"torpor-{n}.out", self.base / f"torpor-{n}.err"
        with open(out, "wb") as o, open(err, "wb") as e:
            p = subprocess.Popen(
                self.torpor.argv(args),
                stdin=subprocess.DEVNULL,
                stdout=o,
                stderr=e,
                env={**os.environ, **(env or {})},
                start_new_session=new_session,
            )
        self._popens.append(p)
        return p, out, err

    def track_popen(self, p: subprocess.Popen[bytes]) -> None:
        self._popens.append(p)

    def cleanup(self) -> None:
        signalled: list[ProcRef] = []
        for p in self._popens:
            if p.poll() is None:  # not reaped yet, so the PID is still this process's
                signalled += kill_tree(p.pid)
        for ref in self._refs:
            signalled += kill_tree(ref.pid) if not ref.gone() else []
        for pid in pids_with(self.token):
            signalled += kill_tree(pid)
        for p in self._popens:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        wait_until(lambda: all(r.gone() for r in signalled), 15, "killed workers to exit")


# --------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def torpor_bin() -> Path:
    binary = find_torpor()
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        pytest.fail(
            "torpor binary not found: set TORPOR_BIN or build it (cargo build [--release]); looked for "
            f"{os.environ.get('TORPOR_BIN') or ROOT / 'target/{release,debug}/torpor'}",
            pytrace=False,
        )
    return binary


@pytest.fixture(scope="session")
def torpor(torpor_bin: Path) -> Torpor:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpor creates namespaces and runs CRIU")
    return Torpor(torpor_bin)


@pytest.fixture(scope="session")
def criu_ready(torpor: Torpor, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Snapshot a trivial `torpor run` process once; if that fails because of CRIU, stop with the fix."""
    base = tmp_path_factory.mktemp("criu-probe")
    probe = Workers(torpor, base)
    try:
        w = probe.start(["sleep", "600"], endpoint=Endpoint(), ready=None, name="probe")
        r = torpor("snapshot", "--pid", w.init_pid, "--out", base / "snap")
        if r.returncode != 0 and "criu" in r.stderr.lower():
            pytest.fail(
                f"CRIU is not provisioned or not usable: run `make criu`.\n{describe(r)}", pytrace=False
            )
    finally:
        probe.cleanup()


@pytest.fixture
def workers(torpor: Torpor, criu_ready: None, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(torpor, tmp_path)
    try:
        yield w
    finally:
        w.cleanup()


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Last line of defence: nothing started from the test directories outlives the session."""
    yield
    token = f"{tmp_path_factory.getbasetemp()}/"
    for pid in pids_with(token):
        kill_tree(pid)


@dataclass(frozen=True)
class FakeCuda:
    """tests/fakes/fake_libcuda.c built with the checkpoint API and without it, and
    tests/fakes/fake_nvml.c describing the same GPUs (so no real driver is ever involved)."""

    lib: Path
    lib_no_ckpt: Path
    nvml: Path

    def env(
        self,
        lib: Path,
        pids: Sequence[int],
        log: Path,
        state_dir: Path,
        gpu_bytes: int = 1 << 30,
        **extra: str,
    ) -> dict[str, str]:
        """Environment for torpor: `pids` are CUDA processes using `gpu_bytes` each on GPU 0."""
        state_dir.mkdir(parents=True, exist_ok=True)
        return {
            "TORPOR_LIBCUDA": str(lib),
            "TORPOR_LIBNVML": str(self.nvml),
            "FAKE_CUDA_PIDS": ",".join(map(str, pids)),
            "FAKE_CUDA_LOG": str(log),
            "FAKE_CUDA_STATE_DIR": str(state_dir),
            "FAKE_NVML_PROCS": ",".join(f"{p}:{gpu_bytes}" for p in pids),
            **extra,
        }


def fake_calls(log: Path, pid: int) -> list[str]:
    """The checkpoint-API calls the fake driver logged for `pid`, in order: "lock", "checkpoint",
    "restore", "unlock" for a call that succeeded, "lock=909" (op=result) for one that failed."""
    if not log.exists():
        return []
    ops = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if (
            len(parts) < 2
            or parts[1] != str(pid)
            or parts[0] not in ("lock", "checkpoint", "restore", "unlock")
        ):
            continue
        result = next((p.split("=", 1)[1] for p in parts[2:] if p.startswith("result=")), "?")
        ops.append(parts[0] if result == "0" else f"{parts[0]}={result}")
    return ops


def fake_state(state_dir: Path, pid: int) -> str:
    """The fake driver's checkpoint state of `pid` ("running" when it never acted on it)."""
    f = state_dir / str(pid)
    return f.read_text().strip() if f.exists() else "running"


def fake_log(log: Path) -> str:
    return f"--- fake driver log {log}\n" + (log.read_text() if log.exists() else "(none written)\n")


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> FakeCuda:
    sources = {"cuda": FAKES / "fake_libcuda.c", "nvml": FAKES / "fake_nvml.c"}
    for src in sources.values():
        if not src.is_file():
            pytest.fail(f"{src} is missing", pytrace=False)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the fake driver in tests/fakes")
    base = tmp_path_factory.mktemp("fake-cuda")

    def build(src: Path, out: Path, *flags: str) -> Path:
        out.parent.mkdir(exist_ok=True)
        r = subprocess.run(
            [cc, "-shared", "-fPIC", *flags, "-o", str(out), str(src)], capture_output=True, text=True
        )
        assert r.returncode == 0, f"building {src.name} failed\n{describe(r)}"
        return out

    # Named like the real libraries, so a worker that loads the fake libcuda looks like a CUDA
    # process to torpor (which looks for libcuda.so in a process's maps).
    return FakeCuda(
        lib=build(sources["cuda"], base / "ckpt" / "libcuda.so.1"),
        lib_no_ckpt=build(
            sources["cuda"], base / "no-ckpt" / "libcuda.so.1", "-DFAKE_CUDA_NO_CHECKPOINT", "-DNO_CKPT"
        ),
        nvml=build(sources["nvml"], base / "nvml" / "libnvidia-ml.so.1"),
    )


# --------------------------------------------------------------------------------------------
# The host's memory filesystems (issue 19: a snapshot holds the process and nothing of the node)


@dataclass(frozen=True)
class HostFiles:
    """Marker files the host keeps in memory filesystems: in /dev/shm (with a big file beside
    it), in a tmpfs under /tmp and in a tmpfs elsewhere (/var/tmp). Each marker's contents hold
    `secret` (which no path holds), so a snapshot file that carried one is found by its bytes."""

    secret: str
    shm_marker: Path
    shm_big: Path
    tmp_tmpfs: Path
    other_tmpfs: Path

    @property
    def markers(self) -> list[Path]:
        return [self.shm_marker, self.tmp_tmpfs / "marker", self.other_tmpfs / "marker"]

    def files_holding_secret(self, root: Path) -> list[Path]:
        needle = self.secret.encode()
        return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def _mount_tmpfs(parent: str, prefix: str) -> Path:
    point = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "torpor-test-host", str(point)], check=True)
    return point


@pytest.fixture(scope="session")
def host_files() -> Iterator[HostFiles]:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts tmpfs filesystems")
    name = f"torpor-host-{os.getpid()}"
    files = HostFiles(
        secret=os.urandom(16).hex(),
        shm_marker=Path(f"/dev/shm/{name}.txt"),
        shm_big=Path(f"/dev/shm/{name}.big"),
        tmp_tmpfs=_mount_tmpfs("/tmp", "torpor-host-tmpfs-"),
        other_tmpfs=_mount_tmpfs("/var/tmp", "torpor-host-tmpfs-"),
    )
    try:
        for marker in files.markers:
            marker.write_text(f"{files.secret}\n")
        # Incompressible, so that a snapshot carrying it could not hide it by compression.
        files.shm_big.write_bytes(os.urandom(24 << 20))
        yield files
    finally:
        for p in (files.shm_marker, files.shm_big):
            p.unlink(missing_ok=True)
        for point in (files.tmp_tmpfs, files.other_tmpfs):
            subprocess.run(["umount", "--lazy", str(point)], check=False)
            point.rmdir()


# --------------------------------------------------------------------------------------------
# A small filesystem of its own (issue 13: the snapshot's preflight and a dump that fills the disk)


def _mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


@contextlib.contextmanager
def loop_ext4(where: Path, mib: int, reserved_pct: int = 0) -> Iterator[Path]:
    """`where` (created) on an ext4 of `mib` MiB of its own, `reserved_pct` % of its blocks
    reserved for root (none by default); skips without root, losetup or mkfs.ext4. Unmounted,
    and its loop device freed, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("needs root: loop mounts")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    image = where.parent / f"{where.name}.img"
    with open(image, "wb") as f:
        f.truncate(mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", str(reserved_pct), str(image)], check=True, capture_output=True)
    where.mkdir(parents=True, exist_ok=True)
    # `-o loop`: the loop device is freed (autoclear) when the filesystem is unmounted.
    r = subprocess.run(["mount", "-o", "loop", str(image), str(where)], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        for _ in range(8):
            if not _mounted(where):
                break
            if subprocess.run(["umount", str(where)], check=False, capture_output=True).returncode != 0:
                time.sleep(0.5)
                subprocess.run(["umount", "--lazy", str(where)], check=False, capture_output=True)
        image.unlink(missing_ok=True)


def a_library() -> Path:
    """A real shared library of this machine (libm), for tests that copy one to change it."""
    import ctypes.util

    name = ctypes.util.find_library("m") or "libm.so.6"
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        if (Path(d) / name).is_file():
            return Path(d) / name
    raise AssertionError(f"no {name} found to copy")
