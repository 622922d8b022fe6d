"""The worker harness end to end: a real `python3 -m torpor.worker` process, the test as torpord."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torpor
from sdkd import ROOT, TINYMLP, Conn, Daemon, Spawned, Spawner, proc_state, wait_for, worker_env
from torpor.functions import resolve
from torpor.spec import parse_dir

EXIT_PROTOCOL = 3
EXIT_LOAD = 4
EXIT_CONNECT = 5
X = [0.5, -1.0, 2.0, 0.25]


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def expected_y(x: list[float]) -> list[float]:
    """The model's answer computed in this process through torpor.use_dir (same weights file)."""
    cls = resolve(str(TINYMLP), "model:TinyMLP")
    torpor.use_dir(TINYMLP)
    m = cls()
    m.setup()
    y = m({"x": x})["y"]
    assert isinstance(y, list)
    return y


def start_loaded(spawn: Spawner, daemon: Daemon, *args: str) -> tuple[Spawned, Conn]:
    """A base worker that has said hello and ready, then loaded tinymlp."""
    w = spawn("--role", "base", *args)
    c = daemon.accept()
    hello = c.expect("hello")
    assert hello == {
        "type": "hello",
        "pid": w.pid,
        "role": "base",
        "function": None,
        "resumed": False,
        "protocol": 5,
        "reattach": False,
    }
    assert c.peer_pid == w.pid
    ready = c.expect("ready")
    assert ready["ok"] is True and ready["setup_s"] >= 0 and ready["warmup_s"] >= 0, ready
    ready = c.load()
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    assert ready["setup_s"] > 0 and ready["warmup_s"] > 0 and "preload_s" not in ready, ready
    assert ready["map_s"] >= 0 and ready["import_s"] > 0 and ready["pack_s"] >= 0, ready
    return w, c


def test_base_load_invoke(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon, "--preload", "json,fractions")
    r = c.invoke(1, {"x": X})
    assert r["ok"] is True, r
    # calls == 2: the warm-up request from the spec ran once before.
    assert r["value"] == {"y": expected_y(X), "calls": 2}
    assert 0 < r["handler_s"] < 1
    r = c.invoke("req-b", {"echo": {"nested": ["ü", 1, None]}})
    assert r["value"] == {"echo": {"nested": ["ü", 1, None]}, "calls": 3}
    c.send({"type": "shutdown"})
    assert w.wait() == 0
    assert c.at_eof()


def test_user_exception_is_a_result_and_the_worker_lives(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    r = c.invoke(7, {"fail": "boom"})
    assert r["ok"] is False and "value" not in r, r
    err = r["error"]
    assert err["type"] == "ValueError" and err["message"] == "boom", err
    assert 'model.py", line' in err["traceback"] and "raise ValueError" in err["traceback"], err["traceback"]
    assert "torpor/worker.py" not in err["traceback"], "the harness's own frames leak into the traceback"
    r = c.invoke(8, {"bad_value": True})
    assert r["ok"] is False and r["error"]["type"] == "ResultError", r
    assert "model:TinyMLP" in r["error"]["message"] and "set" in r["error"]["message"], r
    r = c.invoke(9, {"weird": True})
    assert r["ok"] is False and r["error"]["type"] == "model.WeirdError", r
    assert r["error"]["message"] == "<str() of the exception failed: RuntimeError>", r
    r = c.invoke(10, {"x": X})
    assert r["ok"] is True and r["value"]["calls"] == 5, r
    assert w.proc.poll() is None


def test_quiesce_close_sigusr2_resume(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    assert c.invoke(1, {"x": X})["value"]["calls"] == 2
    c.send({"type": "quiesce"})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": False}
    assert c.at_eof(), "the worker must close its connection after quiet"
    # It now sleeps in sigwait and does not come back on its own.
    wait_for(lambda: proc_state(w.pid) == "S", 5, "the worker to block in sigwait")
    assert daemon.no_connection(within=0.3), "the worker reconnected before SIGUSR2"
    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.peer_pid == w.pid
    hello = c2.expect("hello")
    assert hello == {
        "type": "hello",
        "pid": w.pid,
        "role": "function",
        "function": "tinymlp",
        "resumed": True,
        "protocol": 5,
        "reattach": False,
    }
    r = c2.invoke(2, {"x": X})
    assert r["ok"] is True and r["value"] == {"y": expected_y(X), "calls": 3}, r
    # A second quiet point works the same way.
    c2.send({"type": "quiesce"})
    c2.expect("quiet")
    assert c2.at_eof()
    os.kill(w.pid, signal.SIGUSR2)
    c3 = daemon.accept()
    assert c3.expect("hello")["resumed"] is True
    assert c3.invoke(3, {"echo": 1})["value"] == {"echo": 1, "calls": 4}


def test_a_released_quiesce_makes_no_gpu_call_and_the_next_request_ends_the_release(
    spawn: Spawner, daemon: Daemon
) -> None:
    """`quiesce` {released: true} (protocol 5): after `release_gpu`, a quiet point that leaves the
    release standing (no `gpu_back` on the quiesce), then the wake and the first request end it."""
    w, c = start_loaded(spawn, daemon)
    c.send({"type": "release_gpu"})
    assert c.expect("gpu_quiet") == {"type": "gpu_quiet", "bytes": 0}
    c.send({"type": "quiesce", "released": True})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": False, "released": True}
    assert c.at_eof(), "the worker must close its connection after quiet"
    wait_for(lambda: proc_state(w.pid) == "S", 5, "the worker to block in sigwait")
    os.kill(w.pid, signal.SIGUSR2)
    c2 = daemon.accept()
    assert c2.expect("hello")["resumed"] is True
    r = c2.invoke(2, {"x": X})
    assert r["ok"] is True and r["value"] == {"y": expected_y(X), "calls": 2}, r


def test_a_released_quiesce_of_a_worker_never_released_is_a_protocol_error(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    c.send({"type": "quiesce", "released": True})
    assert w.wait() == 3
    assert "quiesce {released: true}, but torpord did not release this worker's GPU" in w.stderr(), w.stderr()


def test_sigusr2_before_quiesce_is_not_lost_or_fatal(spawn: Spawner, daemon: Daemon) -> None:
    """A stray SIGUSR2 while serving neither kills the worker nor skips the next quiet point."""
    w, c = start_loaded(spawn, daemon)
    os.kill(w.pid, signal.SIGUSR2)
    assert c.invoke(1, {"echo": 0})["ok"] is True
    c.send({"type": "quiesce"})
    c.expect("quiet")
    assert c.at_eof()
    assert daemon.no_connection(within=0.3), "a stale SIGUSR2 woke the worker at once"
    os.kill(w.pid, signal.SIGUSR2)
    assert daemon.accept().expect("hello")["resumed"] is True


def test_role_function_waits_for_load(spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "function", "--preload", "json")
    c = daemon.accept()
    assert c.expect("hello") == {
        "type": "hello",
        "pid": w.pid,
        "role": "function",
        "function": None,
        "resumed": False,
        "protocol": 5,
        "reattach": False,
    }
    ready = c.load()
    assert ready["ok"] is True and ready["preload_s"] >= 0, ready
    assert c.invoke(1, {"x": X})["value"]["y"] == expected_y(X)


def test_announce_warm_sends_warmed_after_the_preloads_then_waits_for_load(spawn: Spawner, daemon: Daemon) -> None:
    # --announce-warm (torpord's live-context pool): `warmed` after hello, once the preloads are
    # imported, then the function loads and serves as without the flag.
    w = spawn("--role", "function", "--preload", "json,fractions", "--announce-warm")
    c = daemon.accept()
    assert c.expect("hello")["role"] == "function"
    warmed = c.expect("warmed")
    assert set(warmed) == {"type", "preload_s", "warmup_s", "warm_requests"}, warmed
    assert warmed["preload_s"] >= 0 and warmed["warmup_s"] >= 0, warmed
    # No GPU, no kernels to load: the pool's request warm-up (torpor.gpu.warm_requests) is torch's.
    assert warmed["warm_requests"] == 0, warmed
    ready = c.load()
    assert ready["ok"] is True and ready["preload_s"] >= 0, f"{ready}\n{w.stderr()}"
    assert c.invoke(1, {"x": X})["value"]["y"] == expected_y(X)
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_announce_warm_reports_a_failed_preload_as_ready_not_ok(spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "function", "--preload", "no_such_module_xyz", "--announce-warm")
    c = daemon.accept()
    c.expect("hello")
    ready = c.expect("ready")
    assert ready["ok"] is False and ready["phase"] == "preload", ready
    assert w.wait() == EXIT_LOAD
    # A base announces itself with ready: the flag is a usage error there.
    w = spawn("--role", "base", "--announce-warm")
    assert w.wait() == 2 and "--announce-warm is for --role function" in w.stderr(), w.stderr()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (frame(b"not json!"), "not valid JSON"),
        (frame(b"[1]"), "not an object"),
        (frame(b'"\xff"'), "not valid UTF-8"),
        (frame(b"NaN"), "not valid JSON"),
        (struct.pack(">I", (64 << 20) + 1), "over the"),
        (frame(b'{"type":"dance"}'), "unknown frame type 'dance'"),
        (frame(b'{"type":"invoke"}'), "lacks id"),
        (struct.pack(">I", 30) + b'{"type":"load"}', "inside a frame"),  # then EOF
        (b"\x00\x00", "inside a frame header"),  # then EOF
    ],
    ids=[
        "not-json",
        "array",
        "bad-utf8",
        "nan",
        "oversize",
        "unknown-type",
        "missing-field",
        "truncated",
        "short-header",
    ],
)
def test_garbage_from_daemon_exits_3(spawn: Spawner, daemon: Daemon, raw: bytes, reason: str) -> None:
    w, c = start_loaded(spawn, daemon)
    c.send_raw(raw)
    if "inside a frame" in reason:
        c.sock.shutdown(2)
    assert w.wait() == EXIT_PROTOCOL, w.stderr()
    assert "protocol error" in w.stderr() and reason in w.stderr(), w.stderr()


def test_invoke_before_load_exits_3(spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "invoke", "id": 1, "request": {}, "timeout_s": 1})
    assert w.wait() == EXIT_PROTOCOL
    assert "invoke before load" in w.stderr()


def test_second_load_exits_3(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    c.send({"type": "load", "spec": {}, "dir": "/", "data": {}})
    assert w.wait() == EXIT_PROTOCOL
    assert "second load" in w.stderr()


def test_a_malformed_gpu_table_in_load_exits_3(spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "function")
    c = daemon.accept()
    c.expect("hello")
    spec = parse_dir(TINYMLP).to_json() | {"gpu": {"pack_weights": "yes"}}
    c.send({"type": "load", "spec": spec, "dir": str(TINYMLP), "data": {"weights": str(TINYMLP / "weights.f32")}})
    assert w.wait() == EXIT_PROTOCOL
    assert "spec.gpu must be absent or {pack_weights: true|false, shrink_context: true|false}" in w.stderr()


def test_weight_packing_without_torch_packs_nothing(spawn: Spawner, daemon: Daemon) -> None:
    # TORPOR_HOOK_CUDA=1 asks for packing, but a function that never imported torch has no
    # CUDA weights: ready carries no `packed`, and the function runs as always.
    w = spawn("--role", "function", env=worker_env(daemon.path, TORPOR_HOOK_CUDA="1"))
    c = daemon.accept()
    c.expect("hello")
    ready = c.load()
    assert ready["ok"] is True and "packed" not in ready, f"{ready}\n{w.stderr()}"
    assert c.invoke(1, {"x": X})["value"]["y"] == expected_y(X)
    assert "packed" not in w.stderr() and "not packed" not in w.stderr()


IDENTITY = (
    "@torpor.function\nclass F:\n    def setup(self):\n        pass\n"
    "    def __call__(self, r):\n        return r\n"
)


def write_function(d: Path, model: str, toml_extra: str = "") -> Path:
    d.mkdir()
    (d / "torpor.toml").write_text(f'name = "broken"\nentry = "m:F"\n{toml_extra}')
    (d / "m.py").write_text("import torpor\n" + model)
    return d


@pytest.mark.parametrize(
    ("model", "toml", "phase", "etype", "words"),
    [
        (
            "@torpor.function\nclass F:\n    def setup(self):\n        raise OSError('no weights here')\n"
            "    def __call__(self, r):\n        return r\n",
            "",
            "setup",
            "OSError",
            "no weights here",
        ),
        (
            "class F:\n    def setup(self):\n        pass\n    def __call__(self, r):\n        return r\n",
            "",
            "import",
            "torpor.errors.DefinitionError",
            "add @torpor.function above class F",
        ),
        ("import not_a_module_anywhere\n", "", "import", "ModuleNotFoundError", "not_a_module_anywhere"),
        (
            "@torpor.function\nclass F:\n    def setup(self):\n        pass\n"
            "    def __call__(self, r):\n        return r['missing']\n",
            "[warmup]\nrequest = {}\n",
            "warmup",
            "KeyError",
            "missing",
        ),
    ],
    ids=["setup-raises", "not-decorated", "import-error", "warmup-raises"],
)
def test_load_failure_is_reported_then_exit_4(
    spawn: Spawner, daemon: Daemon, tmp_path: Path, model: str, toml: str, phase: str, etype: str, words: str
) -> None:
    fdir = write_function(tmp_path / "fn", model, toml)
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    ready = c.load(fdir)
    assert ready["ok"] is False and ready["phase"] == phase, ready
    assert ready["error"]["type"] == etype and words in ready["error"]["message"], ready
    assert ready["error"]["traceback"], ready
    assert w.wait() == EXIT_LOAD
    assert f"{phase} failed" in w.stderr()


def test_data_changed_after_validation_fails_load(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    fdir = write_function(
        tmp_path / "fn",
        IDENTITY,
        '[[data]]\nname = "w"\npath = "w.bin"\n',
    )
    (fdir / "w.bin").write_bytes(b"1234")
    from torpor.spec import parse_dir

    spec = parse_dir(fdir)
    (fdir / "w.bin").write_bytes(b"12345")  # changed after the daemon validated the spec
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec.to_json(), "dir": str(fdir), "data": {"w": str(fdir / "w.bin")}})
    ready = c.expect("ready")
    assert ready["ok"] is False and ready["phase"] == "data", ready
    assert "has 5 bytes, the spec says 4" in ready["error"]["message"], ready
    assert w.wait() == EXIT_LOAD


def test_preload_failure_and_gpu_without_a_driver(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    w = spawn("--role", "base", "--preload", "json,no_such_module_xyz")
    c = daemon.accept()
    c.expect("hello")
    ready = c.expect("ready")
    assert (
        ready["ok"] is False
        and ready["phase"] == "preload"
        and "no_such_module_xyz" in ready["error"]["message"]
    )
    assert w.wait() == EXIT_LOAD
    # No framework preloaded: the warm-up goes through the driver, here one that is absent.
    missing = str(tmp_path / "no-such-libcuda.so.1")
    w = spawn("--role", "base", "--gpu", env={**worker_env(daemon.path), "TORPOR_LIBCUDA": missing})
    c = daemon.accept()
    c.expect("hello")
    ready = c.expect("ready")
    assert ready["ok"] is False and ready["phase"] == "gpu_warmup", ready
    assert "warms CUDA through the driver" in ready["error"]["message"], ready
    assert missing in ready["error"]["message"], ready
    assert w.wait() == EXIT_LOAD


def test_a_loaded_worker_that_loses_its_daemon_exits_after_reattach_s(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    c.send({"type": "attached", "reattach_s": 1})
    c.close()
    assert w.wait() == 0
    assert "no torpord took this instance back within 1 s" in w.stderr()


def test_a_loaded_worker_that_loses_its_daemon_reattaches_with_its_state(spawn: Spawner, daemon: Daemon) -> None:
    w, c = start_loaded(spawn, daemon)
    first = c.invoke(1, {"x": [1.0, 2.0, 3.0, 4.0]})
    c.close()
    again = daemon.accept()
    hello = again.expect("hello")
    assert hello["resumed"] is True and hello["reattach"] is True and hello["protocol"] == 5, hello
    assert hello["role"] == "function", hello
    again.send({"type": "attached", "reattach_s": 5})
    # The same process, its memory kept: the call counter goes on.
    second = again.invoke(1, {"x": [1.0, 2.0, 3.0, 4.0]})
    assert second["value"]["y"] == first["value"]["y"], (first, second)
    assert second["value"]["calls"] == first["value"]["calls"] + 1, (first, second)
    again.send({"type": "shutdown"})
    assert w.wait() == 0
    assert "took this instance back" in w.stderr()


def test_a_reattaching_worker_names_and_settles_the_keyed_requests_it_ran_and_no_other(
    spawn: Spawner, daemon: Daemon
) -> None:
    """Idempotency keys (docs/torpord.md, "Retries"): request `a` ran and was answered; `b` was
    still in the socket when the daemon went, so its `started` found no daemon and it never ran.
    The reattach hello names `a` only, and `a` is settled with its answer and without the lost
    daemon's id. A `b` named there would have its retry wait for an answer that never comes."""
    w, c = start_loaded(spawn, daemon)
    c.send({"type": "attached", "reattach_s": 5})
    x = {"x": [1.0, 2.0, 3.0, 4.0]}
    c.send({"type": "invoke", "id": 1, "request": x, "timeout_s": 5, "key": "a", "fingerprint": "fa"})
    c.expect("started")
    answered = c.expect("result")
    # The daemon stops reading before `b` goes out, so the worker's `started` for it finds no
    # daemon however soon it reads `b` (a plain close after the send raced the worker on a
    # loaded machine, which then ran `b` and kept it).
    c.sock.shutdown(socket.SHUT_RD)
    c.send({"type": "invoke", "id": 2, "request": x, "timeout_s": 5, "key": "b", "fingerprint": "fb"})
    c.close()
    again = daemon.accept()
    hello = again.expect("hello")
    assert hello["reattach"] is True and hello["keys"] == [{"key": "a", "fingerprint": "fa"}], hello
    again.send({"type": "attached", "reattach_s": 5})
    settled = again.expect("settled")
    assert settled == {
        "type": "settled", "key": "a", "fingerprint": "fa", "ok": True,
        "value": answered["value"], "handler_s": answered["handler_s"],
    }, settled
    # `b` runs when the new daemon sends it, once.
    assert again.invoke(3, x)["value"]["calls"] == answered["value"]["calls"] + 1
    again.send({"type": "shutdown"})
    assert w.wait() == 0


def test_a_worker_that_loses_its_daemon_before_load_exits(spawn: Spawner, daemon: Daemon) -> None:
    w = spawn("--role", "function")
    c = daemon.accept()
    c.expect("hello")
    c.close()
    assert w.wait() == 0
    assert "closed the connection" in w.stderr()


def test_no_socket_env_and_unreachable_socket(spawn: Spawner, tmp_path: Path) -> None:
    env = worker_env("x")
    del env["TORPOR_WORKER_SOCKET"]
    w = spawn("--role", "base", env=env)
    assert w.wait() == 2 and "TORPOR_WORKER_SOCKET is not set" in w.stderr()
    w = spawn("--role", "base", env=worker_env("/etc/hostname/not-a-dir.sock"))
    assert w.wait() == EXIT_CONNECT and "cannot connect" in w.stderr(), w.stderr()
    w = spawn("--role", "sideways")
    assert w.wait() == 2 and "invalid choice" in w.stderr()


def test_warm_invoke_round_trip_is_well_under_a_millisecond(spawn: Spawner, daemon: Daemon) -> None:
    """The harness's in-process cost per invoke: round trips of a trivial request over the socket."""
    _, c = start_loaded(spawn, daemon)
    for i in range(200):  # warm up caches and the allocator
        c.invoke(i, {"echo": i})
    rtts = []
    overheads = []
    for i in range(2000):
        t0 = time.perf_counter()
        r = c.invoke(i, {"echo": i})
        rtt = time.perf_counter() - t0
        rtts.append(rtt)
        overheads.append(rtt - r["handler_s"])
    med = statistics.median(rtts)
    over = statistics.median(overheads)
    print(f"warm invoke round trip: median {med * 1e6:.0f} us, harness+socket overhead {over * 1e6:.0f} us")
    assert med < 1e-3, f"median round trip {med * 1e6:.0f} us"


def test_example_cpu_mlp_through_the_harness(spawn: Spawner, daemon: Daemon) -> None:
    """examples/cpu-mlp answers through the harness exactly as it does run locally (model.py's main)."""
    import json
    import subprocess
    import sys

    example = ROOT / "examples" / "cpu-mlp"
    x = [float(i % 5) - 2.0 for i in range(16)]
    local = subprocess.run(
        [sys.executable, str(example / "model.py"), json.dumps({"x": x})],
        capture_output=True, text=True, env=worker_env("unused"), timeout=30,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    assert c.load(example)["ok"] is True, w.stderr()
    r = c.invoke(1, {"x": x})
    assert r["ok"] is True and r["value"] == json.loads(local.stdout), r
    assert abs(sum(r["value"]["probs"]) - 1) < 1e-9
    bad = c.invoke(2, {"x": [1, 2]})
    assert (
        bad["ok"] is False
        and bad["error"]["type"] == "ValueError"
        and "16 numbers" in bad["error"]["message"]
    )


def test_the_quiet_point_shrinks_the_cuda_context(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    """At quiesce, after syncing the GPU, the harness sets the current context's stack limit to 0
    (spec.gpu.shrink_context, on by default): the fake driver (with its contexts: FAKE_CUDA_VMM)
    logs the call."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", str(lib), str(ROOT / "tests" / "fakes" / "fake_libcuda.c")], check=True)
    log = tmp_path / "cuda.log"
    env = {**worker_env(daemon.path), "TORPOR_LIBCUDA": str(lib), "FAKE_CUDA_LOG": str(log)}
    w = spawn("--role", "base", "--gpu", env=env)
    c = daemon.accept()
    c.expect("hello")
    ready = c.expect("ready")
    assert ready["ok"] is True, ready
    assert not log.exists() or "limit" not in log.read_text(), "shrunk before the quiet point"
    c.send({"type": "quiesce"})
    assert c.expect("quiet") == {"type": "quiet", "cuda_synced": True}
    assert f"limit {w.pid} 0=0" in log.read_text().splitlines(), log.read_text()
    os.kill(w.pid, signal.SIGKILL)
    w.wait()


SOURCED = (
    "@torpor.function\nclass F:\n"
    "    def setup(self):\n"
    "        self.w = torpor.load_bytes('w')\n"
    "    def __call__(self, r):\n"
    "        torpor.dump('out', {'got': r['x'].decode()})\n"
    "        return {'w': self.w.decode(), 'x': r['x'].decode(), 'y': r['y']}\n"
)
SOURCED_DATA = (
    '[[data]]\nname = "w"\nsource = "s3://b-b/w.bin"\nsize = 5\n'
    '[[data]]\nname = "out"\nsource = "s3://b-b/out.json"\nsize = 64\naccess = "writable"\n'
)


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("test-data")
    os.write(fd, data)
    return fd


def test_source_data_comes_as_data_fd_frames_and_refs_and_dumps_pass(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    import base64
    import json

    fdir = write_function(tmp_path / "fn", SOURCED, SOURCED_DATA)
    spec = parse_dir(fdir).to_json()
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec, "dir": str(fdir), "data": {"w": {"fd": True}, "out": {"fd": True}}})
    for name, data in (("w", b"hello"), ("out", b"{}")):
        fd = memfd_with(data)
        c.send_with_fd({"type": "data_fd", "name": name, "fd": True}, fd)
        os.close(fd)
    ready = c.expect("ready")
    assert ready["ok"] is True, ready
    c.send({"type": "invoke", "id": 1, "timeout_s": 10,
            "request": {"x": {"$ref": "s3://b-b/x", "data": base64.b64encode(b"ref!").decode()}, "y": {"$ref": "s3://b-b/y"}}})
    c.expect("started")
    dump = c.expect("dump")
    assert dump["name"] == "out" and json.loads(base64.b64decode(dump["data"])) == {"got": "ref!"}, dump
    result = c.expect("result")
    assert result["ok"] is True, result
    # A reference torpord did not load (no data) is left as it came.
    assert result["value"] == {"w": "hello", "x": "ref!", "y": {"$ref": "s3://b-b/y"}}, result
    c.send({"type": "shutdown"})
    assert w.wait() == 0


def test_a_missing_data_fd_frame_exits_3(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    fdir = write_function(tmp_path / "fn", SOURCED, SOURCED_DATA)
    spec = parse_dir(fdir).to_json()
    w = spawn("--role", "base")
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec, "dir": str(fdir), "data": {"w": {"fd": True}, "out": {"fd": True}}})
    c.send({"type": "data_fd", "name": "w", "fd": True})  # no fd attached
    assert w.wait() == EXIT_PROTOCOL
    assert "expected data_fd 'w' with its memfd after load" in w.stderr(), w.stderr()


GPU_DATA_FN = (
    "@torpor.function\nclass F:\n"
    "    def setup(self):\n"
    "        self.w = torpor.load('w', device='cuda')\n"
    "    def __call__(self, r):\n"
    "        return {}\n"
)


def test_gpu_data_comes_in_gpu_data_frames_and_a_worker_without_cuda_says_so(
    spawn: Spawner, daemon: Daemon, tmp_path: Path
) -> None:
    """Platform-managed GPU data (docs/sandboxes.md): after load, one gpu_data frame per
    device = "cuda" entry, its fd attached. A worker without a GPU fails its load with one line
    naming the data and the cause; a frame without its fd is a protocol error."""
    toml_data = '[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n'
    fdir = write_function(tmp_path / "fn", GPU_DATA_FN, "gpus = 1\n" + toml_data)
    (fdir / "w.bin").write_bytes(b"x" * 4096)
    spec = parse_dir(fdir).to_json()
    env = {**worker_env(daemon.path), "TORPOR_LIBCUDA": str(tmp_path / "no-libcuda.so")}
    w = spawn("--role", "base", env=env)
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec, "dir": str(fdir), "data": {"w": str(fdir / "w.bin")}})
    fd = memfd_with(b"x" * 4096)
    c.send_with_fd({"type": "gpu_data", "name": "w", "size": 4096, "padded": 4096, "readonly": True, "fd": True}, fd)
    os.close(fd)
    ready = c.expect("ready")
    assert ready["ok"] is False and ready["phase"] == "data", ready
    message = ready["error"]["message"]
    assert "mapping the GPU data 'w' (4096 bytes)" in message and "\n" not in message, message
    assert w.wait() == EXIT_LOAD

    w = spawn("--role", "base", env=env)
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec, "dir": str(fdir), "data": {"w": str(fdir / "w.bin")}})
    c.send({"type": "gpu_data", "name": "w", "size": 4096, "padded": 4096, "readonly": True, "fd": True})
    assert w.wait() == EXIT_PROTOCOL
    assert "expected gpu_data 'w' with its fd after load" in w.stderr(), w.stderr()


GPU_DATA_READER = (
    "import ctypes\n"
    "from torpor import data\n"
    "@torpor.function\nclass F:\n"
    "    def setup(self):\n"
    "        self.g = data.gpu_data('w')\n"
    "        try:\n"
    "            torpor.load('w', device='cuda')\n"
    "            self.err = None\n"
    "        except Exception as e:\n"
    "            self.err = str(e)\n"
    "    def __call__(self, r):\n"
    "        # The fake driver's device memory is host memory: read it where it is mapped.\n"
    "        raw = ctypes.string_at(self.g.va, self.g.size)\n"
    "        return {'data': raw.decode(), 'size': self.g.size, 'padded': self.g.padded,\n"
    "                'readonly': self.g.readonly, 'err': self.err}\n"
)


def test_gpu_data_is_mapped_into_a_segment_of_the_hook(spawn: Spawner, daemon: Daemon, tmp_path: Path) -> None:
    """The worker's side of platform-managed GPU data on the fake driver (its VMM memory is
    memfd memory; tests/fakes/fake_libcuda.c): the harness reserves a segment's addresses through
    the preloaded hook (no memory of its own) and maps the daemon's there, read-only; the function
    reads the bytes at the segment's address, and the segment is one the split capture sees."""
    from sdkd import hook_lib

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcuda")
    fake = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", str(fake), str(ROOT / "tests" / "fakes" / "fake_libcuda.c")], check=True)
    lib = str(hook_lib())
    # The driver refuses to make memory: mapping the daemon's needs addresses only (the hook's
    # torpor_hook_cuda_reserve), never an allocation of the data's size on top of it.
    env = worker_env(
        daemon.path, LD_PRELOAD=lib, TORPOR_HOOK_LIB=lib, TORPOR_HOOK_CUDA="1", TORPOR_LIBCUDA=str(fake),
        FAKE_CUDA_MEM_CREATE_RESULT="2",
    )
    fdir = write_function(tmp_path / "fn", GPU_DATA_READER, 'gpus = 1\n[[data]]\nname = "w"\npath = "w.bin"\ndevice = "cuda"\n')
    payload = b"platform-filled weights"
    (fdir / "w.bin").write_bytes(payload)
    spec = parse_dir(fdir).to_json()
    w = spawn("--role", "base", env=env)
    c = daemon.accept()
    c.expect("hello")
    c.expect("ready")
    c.send({"type": "load", "spec": spec, "dir": str(fdir), "data": {"w": str(fdir / "w.bin")}})
    padded = 2 << 20
    fd = os.memfd_create("gpu-data")
    os.write(fd, payload)
    os.ftruncate(fd, padded)
    c.send_with_fd(
        {"type": "gpu_data", "name": "w", "size": len(payload), "padded": padded, "readonly": True, "fd": True}, fd
    )
    os.close(fd)
    ready = c.expect("ready")
    assert ready["ok"] is True, f"{ready}\n{w.stderr()}"
    got = c.invoke(1, {})
    assert got["ok"] is True, got
    v = got["value"]
    assert v["data"] == payload.decode() and v["size"] == len(payload) and v["padded"] == padded, v
    assert v["readonly"] is True
    # Without PyTorch the tensor view is one line naming the address.
    assert "needs PyTorch" in v["err"] and "\n" not in v["err"], v
    # The split capture sees it as a read-only cuda segment of its padded size.
    c.send({"type": "quiesce", "split": True})
    quiet, _ = c.recv_with_fd(timeout=30)
    segs = [s for s in quiet["segments"] if s["size"] == padded and s["backend"] == "cuda"]
    assert len(segs) == 1 and segs[0]["readonly"] is True, quiet
    os.kill(w.pid, signal.SIGKILL)
    w.wait()
