"""The holes a hostile-input probe found in torpord (issue 20), each closed and kept closed: a hung
deploy blocked every other deploy; idle connections were unbounded; smaller ones (a JSON array as
the deploy body, a NUL in `dir`, the invoke body limit, registry.db that never shrank, a worker
that inherited the daemon's whole environment). One daemon with TCP, a token and small bounds."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.conftest import Torpord
from torpor import client

TOKEN = "hostile-probe-token-0123456789"
# Small bounds so that the tests reach them quickly.
LOAD_TIMEOUT_S = 3  # [workers] load_timeout_s: a spec without load_timeout_s gets this
MAX_CONNECTIONS = 32  # [http] max_connections, per listener
HEADER_TIMEOUT_S = 2  # [http] header_timeout_s
BODY_TIMEOUT_S = 4  # [http] body_timeout_s (the 63 MiB invoke body below arrives well within it)
# In the daemon's environment: a worker must not see it.
SECRET = "TORPOR_TEST_ONLY_NOT_SECRET_BUT_CLOSE"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def hostile(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path_factory.mktemp("torpord-hostile")
    token = root / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    config = (
        f'tcp = "127.0.0.1:{port}"\ntoken_file = "{token}"\n'
        f"[workers]\nload_timeout_s = {LOAD_TIMEOUT_S}\n"
        f"[http]\nmax_connections = {MAX_CONNECTIONS}\nheader_timeout_s = {HEADER_TIMEOUT_S}\n"
        f"body_timeout_s = {BODY_TIMEOUT_S}\n"
    )
    d = Torpord(torpor_bin, root, config=config, env={"HOSTILE_SECRET_VAR": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET})
    d.port = port  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.stop()


def function_dir(root: Path, name: str, body: str, extra_toml: str = "") -> Path:
    """A function `name` whose module holds `body` (the class Fn is appended)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "torpor.toml").write_text(f'name = "{name}"\nentry = "handler:Fn"\ntimeout_s = 10\n{extra_toml}')
    (d / "handler.py").write_text(
        "from __future__ import annotations\nimport os, time\nfrom typing import Any\nimport torpor\n"
        f"{body}\n"
        "@torpor.function\nclass Fn:\n"
        "    def setup(self) -> None:\n        pass\n\n"
        "    def __call__(self, request: Any) -> Any:\n"
        "        if request == 'env':\n            return dict(os.environ)\n"
        "        return {'echo': request}\n"
    )
    return d


def lines_of(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def deploy_in_background(torpord: Torpord, fdir: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, TORPOR_SOCKET=str(torpord.socket))
    return subprocess.Popen(
        [str(torpord.binary), "deploy", "--json", str(fdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def state_of(torpord: Torpord, name: str) -> str | None:
    r = torpord.request("GET", f"/v1/functions/{name}")
    return None if r.status == 404 else str(r.json()["state"])


def wait_deploying(torpord: Torpord, name: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while state_of(torpord, name) != "deploying":
        assert proc.poll() is None, f"deploy of {name} ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{name} never reached deploying"
        time.sleep(0.05)


# --- item 2: deploys that cannot block each other --------------------------------------------


def test_a_hung_deploy_blocks_no_other_and_is_killed_at_its_bound(hostile: Torpord, tmp_path: Path) -> None:
    quick = function_dir(tmp_path, "quick", "")
    hostile.deploy(quick)  # the base exists from here on: the timing below is a deploy's own
    # Order 1: the hung deploy first (its import sleeps; its own bound is 15 s), then another.
    hung = function_dir(tmp_path, "hung", "time.sleep(3600)\n", "load_timeout_s = 15\n")
    proc = deploy_in_background(hostile, hung)
    try:
        wait_deploying(hostile, "hung", proc)
        time.sleep(1.0)  # well inside the hung worker's import
        t = time.monotonic()
        lines = hostile.deploy(function_dir(tmp_path, "other", ""))
        took = time.monotonic() - t
        assert "result" in lines[-1], lines
        assert proc.poll() is None and state_of(hostile, "hung") == "deploying", "the hung deploy is still hung"
        assert took < 12, f"another function's deploy waited {took:.1f} s for the hung one"
        # Order 2: another deploy starts first, the hung one's redeploy right behind it.
        proc2 = deploy_in_background(hostile, function_dir(tmp_path, "other2", ""))
        out2, err2 = proc2.communicate(timeout=60)
        assert proc2.returncode == 0 and "result" in lines_of(out2)[-1], (out2, err2)
        assert proc.poll() is None, "the hung deploy is still hung after the second"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = lines_of(out)[-1]
    assert proc.returncode != 0 and last.get("phase") == "load", (out, err)
    assert "within 15 s (load_timeout_s)" in last["error"] and "was killed" in last["error"], last
    assert state_of(hostile, "hung") == "failed"
    assert not [c for c in pids_in_namespaces_of(hostile) if "torpor.worker" in c], "the hung worker was killed"


def test_a_deploy_without_load_timeout_gets_the_daemons(hostile: Torpord, tmp_path: Path) -> None:
    hung = function_dir(tmp_path, "hung-default", "time.sleep(3600)\n")
    t = time.monotonic()
    r = hostile.cli("deploy", "--json", hung)
    took = time.monotonic() - t
    last = lines_of(r.stdout)[-1]
    assert r.returncode != 0 and last.get("phase") == "load", r
    assert f"within {LOAD_TIMEOUT_S} s (load_timeout_s)" in last["error"], last
    assert took < LOAD_TIMEOUT_S + 20, took


def pids_in_namespaces_of(torpord: Torpord) -> list[str]:
    """Command lines of the daemon's descendant processes (workers and their inits)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if str(torpord.state).encode() in environ or str(torpord.state) in cmd:
            out.append(cmd)
    return out


# --- item 4: bounded connections ---------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the daemon closed this client socket (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def test_idle_tcp_connections_are_bounded_closed_and_leave_the_unix_socket_answering(hostile: Torpord) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    pid = hostile.proc.pid
    baseline = fd_count(pid)
    socks: list[socket.socket] = []
    most = 0
    try:
        for i in range(2000):
            s = socket.create_connection(("127.0.0.1", hostile.port), timeout=10)  # type: ignore[attr-defined]
            socks.append(s)
            if i % 100 == 0:
                most = max(most, fd_count(pid))
        most = max(most, fd_count(pid))
        # The cap holds: the daemon never had more than its connections' worth of extra files.
        assert most <= baseline + MAX_CONNECTIONS + 16, (baseline, most)
        # The Unix socket answers meanwhile, at once.
        t = time.monotonic()
        r = hostile.cli("ls", "--json", timeout=10)
        assert r.returncode == 0, r
        assert hostile.request("GET", "/v1/status", timeout=5).status == 200
        assert time.monotonic() - t < 5
        # All but the newest (at most max_connections) were closed already to make room. Some
        # may still wait in the kernel's accept backlog (neither the daemon's nor closed: seen on
        # a loaded 2-core CI run, 1944 of 2000): half the header timeout lets the daemon drain it.
        drained = time.monotonic() + HEADER_TIMEOUT_S / 2
        while (early := sum(closed_by_peer(s) for s in socks)) < len(socks) - MAX_CONNECTIONS:
            if time.monotonic() > drained:
                break
            time.sleep(0.05)
        assert early >= len(socks) - MAX_CONNECTIONS, early
        # The rest close themselves after the header timeout.
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 5
        while not all(closed_by_peer(s) for s in socks):
            assert time.monotonic() < deadline, "idle connections outlived the header timeout"
            time.sleep(0.2)
        assert fd_count(pid) <= baseline + 4, (baseline, fd_count(pid))
    finally:
        for s in socks:
            s.close()


def test_a_connection_that_sent_the_token_is_closed_last(hostile: Torpord) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", hostile.port, timeout=10)  # type: ignore[attr-defined]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    conn.request("GET", "/v1/status", headers=auth)
    r = conn.getresponse()
    assert r.status == 200
    r.read()
    flood = [socket.create_connection(("127.0.0.1", hostile.port), timeout=10) for _ in range(4 * MAX_CONNECTIONS)]  # type: ignore[attr-defined]
    try:
        # Kept alive, within the header timeout: the same connection serves again.
        conn.request("GET", "/v1/status", headers=auth)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
        # An unauthenticated request is still refused, and a wrong token does not protect.
        bad = http.client.HTTPConnection("127.0.0.1", hostile.port, timeout=10)  # type: ignore[attr-defined]
        bad.request("GET", "/v1/status", headers={"Authorization": "Bearer wrong"})
        assert bad.getresponse().status == 401
        bad.close()
        assert sum(closed_by_peer(s) for s in flood) >= 3 * MAX_CONNECTIONS - 1
    finally:
        conn.close()
        for s in flood:
            s.close()


def trickle(sock: socket.socket, head: bytes, every_s: float = 0.5, limit_s: float = 30) -> tuple[bytes, float]:
    """Sends `head` (a request's headers, announcing a body), then its body one byte every
    `every_s` until the daemon answers: the answer (read until the daemon closes) and the time it
    took from the headers."""
    import select

    sock.sendall(head)
    t = time.monotonic()
    answer = b""
    while time.monotonic() - t < limit_s:
        readable, _, _ = select.select([sock], [], [], every_s)
        if readable:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
            continue
        if answer:
            continue
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b" ")
    return answer, time.monotonic() - t


def test_a_slow_body_is_refused_408_after_the_body_timeout(hostile: Torpord) -> None:
    """Issue 13 item 5: an authenticated client that trickles an invoke body (a byte every 0.5 s,
    so the connection never idles) is answered 408 with one JSON line once body_timeout_s has
    passed, and its connection is closed; the Unix socket's routes have the same deadline."""
    head = (
        b"POST /v1/functions/anything/invoke HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 100000\r\n\r\n".encode()
    )
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=30) as s:  # type: ignore[attr-defined]
        answer, took = trickle(s, head)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer[:300]
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower(), headers
    assert body.count(b"\n") == 0 and "body_timeout_s" in json.loads(body)["error"], body
    assert BODY_TIMEOUT_S - 0.5 <= took <= BODY_TIMEOUT_S + 5, took
    # The deploy route, on the Unix socket.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(hostile.socket))
        answer, took = trickle(
            s, b"POST /v1/functions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n{"
        )
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert took <= BODY_TIMEOUT_S + 5, took
    # A body sent at once is not affected, and the daemon serves on.
    status, body = raw_request(hostile, "POST", "/v1/functions/anything/invoke", b"{}")
    assert status == 404, (status, body)


# --- item 5: the smaller holes -----------------------------------------------------------------


def raw_request(torpord: Torpord, method: str, path: str, body: bytes, timeout: float = 30) -> tuple[int, Any]:
    r = client.request(torpord.socket, method, path, body, timeout)
    try:
        return r.status, json.loads(r.body)
    except ValueError:
        return r.status, r.body


def test_a_deploy_body_must_be_an_object_without_nul(hostile: Torpord, tmp_path: Path) -> None:
    fdir = function_dir(tmp_path, "arrayed", "")
    status, body = raw_request(hostile, "POST", "/v1/functions", json.dumps([str(fdir)]).encode())
    assert status == 400 and "got an array, not an object" in body["error"], (status, body)
    assert state_of(hostile, "arrayed") is None, "nothing was deployed"
    status, body = raw_request(hostile, "POST", "/v1/functions", json.dumps({"dir": f"{fdir}\0x"}).encode())
    assert status == 400 and "NUL" in body["error"] and "\n" not in body["error"], (status, body)
    status, body = raw_request(hostile, "POST", "/v1/functions", b'{"dir": "' + b"a" * (100 << 10) + b'"}')
    assert status == 413 and "KiB" in body["error"], (status, body)


def test_invoke_bodies_up_to_the_documented_limit(hostile: Torpord, tmp_path: Path) -> None:
    hostile.deploy(function_dir(tmp_path, "big-bodies", ""))
    # 8 MiB passes (it was refused past 2 MiB); 63 MiB is the documented limit; past it, 413.
    payload = b'"' + b"x" * (8 << 20) + b'"'
    status, body = raw_request(hostile, "POST", "/v1/functions/big-bodies/invoke", payload, timeout=120)
    assert status == 200 and len(body["echo"]) == 8 << 20, status
    # One byte past the limit: 413, with the error as JSON.
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(str(hostile.socket))
        too_big = b'"' + b"x" * ((63 << 20) - 1) + b'"'
        # The daemon answers once the limit is passed and closes: the rest may not be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(
                b"POST /v1/functions/big-bodies/invoke HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(too_big)}\r\n\r\n".encode()
                + too_big
            )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    assert "63 MiB limit" in json.loads(rest)["error"], rest
    doc = (Path(__file__).resolve().parents[2] / "docs" / "torpord.md").read_text()
    assert "over 63 MiB" in doc and "64 MiB and 400" not in doc


def test_a_worker_gets_a_minimal_environment(hostile: Torpord, tmp_path: Path) -> None:
    hostile.deploy(function_dir(tmp_path, "envprobe", ""))
    r = hostile.invoke("envprobe", "env")
    assert r.status == 200, r.body
    env = r.json()["echo"] if "echo" in r.json() else r.json()
    assert SECRET not in json.dumps(env), sorted(env)
    assert "HOSTILE_SECRET_VAR" not in env and "AWS_SECRET_ACCESS_KEY" not in env and "TORPOR_SOCKET" not in env
    assert env.get("TORPOR_WORKER_SOCKET") and env.get("PYTHONPATH") and "PATH" in env
    allowed = {"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "LD_PRELOAD"}
    # What Torpor itself sets: the owner marker of crash recovery (crate::launcher::OWNER_ENV),
    # libuv off io_uring (torpor_snapshot::launch), JAX's preallocation off (python/torpor/gpu.py).
    allowed |= {"TORPORD_STATE_DIR", "UV_USE_IO_URING", "USE_LIBUV", "XLA_PYTHON_CLIENT_PREALLOCATE"}
    # An unprivileged worker's user has no passwd entry: its name, torpor-UID (crate::launcher).
    allowed |= {"USER", "LOGNAME", "PYENV_ROOT", "PYENV_VERSION"}
    assert env["USER"] == env["LOGNAME"] and env["USER"].startswith("torpor-"), env
    # Python itself may add LC_CTYPE when it coerces the C locale.
    odd = [k for k in env if k not in allowed and not k.startswith(("LC_", "CUDA_", "NVIDIA_", "TORPOR_"))]
    assert not odd, odd


def test_the_registry_shrinks_when_functions_are_removed(hostile: Torpord, tmp_path: Path) -> None:
    pad = "x" * (700 << 10)
    fdir = function_dir(tmp_path, "bulky", "", f'[warmup]\nrequest = {{ pad = "{pad}" }}\n')
    db = hostile.state / "registry.db"

    def size() -> int:
        wal = db.with_name("registry.db-wal")
        return db.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

    hostile.deploy(fdir)
    grown = size()
    assert grown > 700 << 10, grown
    r = hostile.cli("rm", "bulky")
    assert r.returncode == 0, r
    assert size() < grown - (500 << 10), (grown, size())
