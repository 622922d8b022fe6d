"""GPU memory exhausted at a cold start (issue 13): a restore whose snapshot needs more GPU
memory than the node has free is refused by the restore's own check before any process is
restored; torpord then neither boots instead (a boot needs the same memory) nor counts the
snapshot as failing: the request waits, within its queue timeout, for an instance of the function
to free up or for the memory, and is answered 503 with Retry-After and one line naming the numbers
and the fix when neither comes. Nothing is left behind.

The GPU is tests/fakes: fake_libcuda.c for the worker and the driver calls, fake_nvml.c for the
memory the restore checks. Every worker of the daemon counts 64 MiB on a 160 MiB GPU
(FAKE_NVML_PROCS_MATCH), and a file names another process's use of the rest (FAKE_NVML_PROCS_FILE).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda

from .conftest import Torpord, fake_gpu_env

MIB = 1 << 20
HANDLER = '''
import time

import torpor


@torpor.function
class Mem:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: dict) -> dict:
        self.calls += 1
        time.sleep(float(request.get("sleep", 0)))
        return {"calls": self.calls, "pid": __import__("os").getpid()}
'''
SPEC = """name = "gpumem"
entry = "handler:Mem"
gpus = 1
gpu_memory = "64MiB"
timeout_s = 30

[scaling]
max_instances = 2
requests_per_instance = 1

[keepalive]
gpu_release_s = 600
hibernate_s = 600
evict_s = 600
"""


@pytest.fixture(scope="module")
def others(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file naming the GPU memory other processes hold (pid 1, a stand-in)."""
    f = tmp_path_factory.mktemp("nvml") / "procs"
    f.write_text("")
    return f


@pytest.fixture(scope="module")
def daemon(
    torpor_bin: Path,
    criu_ready: None,
    fake_cuda: FakeCuda,
    others: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path_factory.mktemp("torpord-gpumem")
    env = fake_gpu_env(
        root,
        fake_cuda,
        FAKE_CUDA_TOTAL_MEM=str(160 * MIB),
        FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 * MIB}",
        FAKE_NVML_PROCS_FILE=str(others),
    )
    d = Torpord(torpor_bin, root, config="split = false\n", env=env, queue_timeout_s=3)
    try:
        fdir = root / "gpumem"
        fdir.mkdir()
        (fdir / "handler.py").write_text(HANDLER)
        (fdir / "torpor.toml").write_text(SPEC)
        d.deploy(fdir)
        yield d
    finally:
        d.stop()


def both(d: Torpord, first: dict[str, float], second: dict[str, float]) -> tuple[object, object]:
    """Two requests at once, the second sent once the first holds the one instance."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(d.invoke, "gpumem", first)
        import time

        time.sleep(0.5)
        b = pool.submit(d.invoke, "gpumem", second)
        return a.result(timeout=60), b.result(timeout=60)


def test_a_request_without_gpu_memory_for_a_new_instance_waits_for_one_to_free_up(
    daemon: Torpord, others: Path
) -> None:
    others.write_text("")
    r = daemon.invoke("gpumem", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, daemon.log_text())
    # Now 64 MiB for the instance, 40 MiB for another process: 56 MiB free, the snapshot needs 64.
    others.write_text(f"1:{40 * MIB}")
    try:
        a, b = both(daemon, {"sleep": 1.5}, {})
        assert a.status == 200 and b.status == 200, (a.status, a.body, b.status, b.body)  # type: ignore[attr-defined]
        assert b.start == "warm", b.start  # type: ignore[attr-defined]
        assert len(daemon.instances("gpumem")) == 1
        log = daemon.log_text()
        assert "too little free GPU memory to start an instance" in log, log
        # Not a failing snapshot: no boot instead, no pause of restores.
        assert "booting an instance instead" not in log, log
    finally:
        others.write_text("")


def test_a_request_that_never_gets_gpu_memory_is_answered_503_in_one_line(daemon: Torpord, others: Path) -> None:
    assert daemon.invoke("gpumem", {}).status == 200
    before = sorted(i["pid"] for i in daemon.instances("gpumem"))
    # The instance's 64 MiB and another process's 96 MiB: nothing free; the instance stays busy
    # past the queue timeout (3 s).
    others.write_text(f"1:{96 * MIB}")
    try:
        a, b = both(daemon, {"sleep": 5}, {})
        assert a.status == 200, (a.status, a.body)  # type: ignore[attr-defined]
        assert b.status == 503, (b.status, b.body)  # type: ignore[attr-defined]
        msg = b.body.decode()  # type: ignore[attr-defined]
        assert "GPU 0 has 0 MiB free but the snapshot needs 64 MiB" in msg, msg
        assert "free GPU memory on this node" in msg and "\n" not in msg.strip(), msg
        assert b.headers.get("retry-after") == "1", b.headers  # type: ignore[attr-defined]
        # Nothing was started or left behind.
        assert sorted(i["pid"] for i in daemon.instances("gpumem")) == before
    finally:
        others.write_text("")
    assert daemon.invoke("gpumem", {}).status == 200
