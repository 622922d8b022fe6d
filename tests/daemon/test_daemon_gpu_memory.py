"""GPU memory exhausted at a cold start (issue 13): a restore whose snapshot needs more GPU
memory than the node has free is refused by the restore's own check before any process is
restored; torpord then neither boots instead (a boot needs the same memory) nor counts the
snapshot as failing: the request waits, within its queue timeout, for an instance of the function
to free up or for the memory, and is answered 503 with Retry-After and one line naming the numbers
and the fix when neither comes. Nothing is left behind.

The same holds when the memory goes after that check: the driver's restore answering
CUDA_ERROR_OUT_OF_MEMORY kills what was restored and the request waits as above. A deploy whose
setup finds the GPU full fails in one line that says so and what to do, and leaves no worker.

The GPU is tests/fakes: fake_libcuda.c for the worker and the driver calls, fake_nvml.c for the
memory the restore checks. Every worker of the daemon counts 64 MiB on a 160 MiB GPU
(FAKE_NVML_PROCS_MATCH), and a file names another process's use of the rest (FAKE_NVML_PROCS_FILE).
The driver's failures are switch files beside the fake library (fake_libcuda.c's header), which
the daemon and its workers read at each call.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda, cmdline, pids_with

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
        assert "--gpu" not in msg, "the CLI's advice, which a request cannot follow"
        assert b.headers.get("retry-after") == "1", b.headers  # type: ignore[attr-defined]
        # Nothing was started or left behind.
        assert sorted(i["pid"] for i in daemon.instances("gpumem")) == before
    finally:
        others.write_text("")
    assert daemon.invoke("gpumem", {}).status == 200


def test_a_deploy_whose_base_finds_gpu_0_full_fails_in_one_line_naming_it(daemon: Torpord, others: Path) -> None:
    """A second function on gpumem's base restores that base on GPU 0: with GPU 0 full the
    deploy fails there in one line that names the GPU and the numbers and what to do, without
    the CLI's `--gpu` (a deploy cannot choose its GPU), and leaves no process behind."""
    fdir = daemon.root / "gpumem2"
    fdir.mkdir(exist_ok=True)
    (fdir / "handler.py").write_text(HANDLER)
    (fdir / "torpor.toml").write_text(SPEC.replace('name = "gpumem"', 'name = "gpumem2"'))
    before = workers_of(daemon)
    others.write_text(f"1:{150 * MIB}")
    try:
        r = daemon.cli("deploy", fdir, timeout=120)
        # Through the API: the last line says the node's GPU was the cause (a cluster then
        # deploys on another node: torpor.cluster.ingress).
        api = daemon.request("POST", "/v1/functions", {"dir": str(fdir)}, timeout=120)
    finally:
        others.write_text("")
    assert r.returncode != 0, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert "restore_base" in line and re.search(r"GPU 0 has \d+ MiB free but the base snapshot needs 64 MiB", line), line
    assert "deploy again" in line and "--gpu" not in line, line
    last = json.loads(api.body.decode().strip().splitlines()[-1])
    assert last["phase"] == "restore_base" and last["cause"] == "gpu_memory", last
    deadline = time.monotonic() + 15
    while workers_of(daemon) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers_of(daemon) == before


def two_gpu_daemon(torpor_bin: Path, fake_cuda: FakeCuda, tmp_path: Path, others: Path) -> Torpord:
    """A daemon on two fake GPUs of one model, 1 GiB each (room beside the workers of this
    module's other daemons, which count 64 MiB each on GPU 0), `others` naming other processes'
    use; gpumem deployed."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    others.write_text("")
    env = fake_gpu_env(
        tmp_path,
        fake_cuda,
        FAKE_CUDA_DEVICES="2",
        FAKE_CUDA_SAME_MODEL="1",
        FAKE_CUDA_TOTAL_MEM=str(1024 * MIB),
        FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 * MIB}",
        FAKE_NVML_PROCS_FILE=str(others),
    )
    d = Torpord(torpor_bin, tmp_path, config="split = false\n", env=env, queue_timeout_s=4)
    fdir = tmp_path / "gpumem"
    fdir.mkdir()
    (fdir / "handler.py").write_text(HANDLER)
    (fdir / "torpor.toml").write_text(SPEC)
    try:
        d.deploy(fdir)
    except BaseException:
        d.stop()
        raise
    return d


def test_a_restore_that_finds_its_gpu_full_starts_again_at_once_on_another(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """GPU 0 full, GPU 1 free: the first restore is placed on GPU 0 (the lowest ordinal), finds
    no room, and the request starts again at once on GPU 1 instead of waiting a second for a
    GPU it has not tried."""
    others = tmp_path / "procs"
    d = two_gpu_daemon(torpor_bin, fake_cuda, tmp_path, others)
    try:
        others.write_text(f"1:{1000 * MIB}@0")
        r = d.invoke("gpumem", {})
        assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
        assert [int(i["device"]) for i in d.instances("gpumem")] == [1], d.instances("gpumem")
        log = d.log_text()
        assert "starting again at once on another GPU" in log, log
        assert "the request waits for one to free up" not in log, log
    finally:
        d.stop()


def test_a_request_that_finds_every_gpu_full_is_answered_503_naming_each_gpu(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """On a node of two GPUs of one model, each full: the request's restore placed on one finds
    no room, that GPU is passed over and the retry goes to the other; the 503 names both, with
    the latest figures of each (runtime::start::GpuShortfalls)."""
    others = tmp_path / "procs"
    d = two_gpu_daemon(torpor_bin, fake_cuda, tmp_path, others)
    try:
        others.write_text(f"1:{1000 * MIB}@0,1:{990 * MIB}@1")
        r = d.invoke("gpumem", {})
        assert r.status == 503, (r.status, r.body, d.log_text())
        msg = r.body.decode()
        assert re.search(r"GPU 0 has \d+ MiB free but the snapshot needs 64 MiB", msg), msg
        assert "GPU 1 has 34 MiB free but the snapshot needs 64 MiB" in msg, msg
        assert msg.count("GPU 0 has") == 1, msg
        assert "free GPU memory on this node" in msg and "\n" not in msg.strip(), msg
        assert d.instances("gpumem") == []
        # The memory back: served on either.
        others.write_text("")
        r = d.invoke("gpumem", {})
        assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
    finally:
        d.stop()


ALLOC_HANDLER = '''
import ctypes

import torpor
from torpor import gpu


@torpor.function
class Alloc:
    def setup(self) -> None:
        # 32 MiB of device memory through the driver, as a framework's allocator would.
        driver = gpu.Driver.loaded
        self.ptr = ctypes.c_uint64()
        driver.check("cuMemAlloc_v2", driver.lib.cuMemAlloc_v2(ctypes.byref(self.ptr), ctypes.c_size_t(32 << 20)))

    def __call__(self, request: dict) -> dict:
        return {"ptr": self.ptr.value != 0}
'''


@pytest.fixture(scope="module")
def roomy(
    torpor_bin: Path,
    criu_ready: None,
    fake_cuda: FakeCuda,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Torpord]:
    """A daemon on a fake GPU with room for every instance: its GPU memory runs out only when a
    switch says so."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path_factory.mktemp("torpord-gpuoom")
    env = fake_gpu_env(
        root,
        fake_cuda,
        FAKE_CUDA_TOTAL_MEM=str(1024 * MIB),
        FAKE_NVML_PROCS_MATCH=f"torpor.worker:{64 * MIB}",
    )
    d = Torpord(torpor_bin, root, config="split = false\n", env=env, queue_timeout_s=3)
    try:
        yield d
    finally:
        d.stop()


def switch(d: Torpord, name: str, value: str | None) -> None:
    """Turns a fake driver switch (a file beside the fake libcuda) on (`value`) or off."""
    f = d.state / "fake-cuda" / name
    if value is None:
        f.unlink(missing_ok=True)
    else:
        f.write_text(value)


def workers_of(d: Torpord) -> list[int]:
    """The daemon's processes (instance trees, CRIU): those whose command line names its state
    directory."""
    return sorted(pids_with(f"{d.state}/"))


def function_dir(root: Path, name: str, handler: str, entry: str, max_instances: int = 1) -> Path:
    fdir = root / name
    fdir.mkdir(exist_ok=True)
    (fdir / "handler.py").write_text(handler)
    spec = SPEC.replace('name = "gpumem"', f'name = "{name}"').replace('entry = "handler:Mem"', f'entry = "{entry}"')
    spec = spec.replace("max_instances = 2", f"max_instances = {max_instances}")
    (fdir / "torpor.toml").write_text(spec)
    return fdir


def fallbacks(d: Torpord, name: str) -> str:
    metrics = d.request("GET", "/metrics").body.decode()
    found = re.search(rf'torpor_restore_fallbacks_total{{function="{name}"}} (\S+)', metrics)
    return found.group(1) if found else "0"


def test_a_driver_restore_out_of_gpu_memory_waits_for_the_memory_and_leaves_nothing(roomy: Torpord) -> None:
    fdir = function_dir(roomy.root, "gpuoom", HANDLER, "handler:Mem")
    roomy.deploy(fdir)
    assert roomy.instances("gpuoom") == []
    before = workers_of(roomy)
    # NVML shows room, but the driver's restore finds the memory gone (another process took it
    # after the check): CUDA_ERROR_OUT_OF_MEMORY, for as long as the request may wait (3 s).
    switch(roomy, "FAKE_CUDA_RESTORE_RESULT", "2")
    try:
        t0 = time.monotonic()
        r = roomy.invoke("gpuoom", {})
        waited = time.monotonic() - t0
    finally:
        switch(roomy, "FAKE_CUDA_RESTORE_RESULT", None)
    assert r.status == 503, (r.status, r.body, roomy.log_text())
    msg = r.body.decode()
    assert "CUDA_ERROR_OUT_OF_MEMORY" in msg and "free GPU memory on this node" in msg, msg
    assert "\n" not in msg.strip(), msg
    assert r.headers.get("retry-after") == "1", r.headers
    assert waited >= 2.5, waited  # it waited for the memory, within its queue timeout
    # Nothing left: no instance, no restored tree, no boot instead, restores not paused.
    assert roomy.instances("gpuoom") == []
    assert workers_of(roomy) == before
    log = roomy.log_text()
    assert "booting an instance instead" not in log, log
    assert fallbacks(roomy, "gpuoom") == "0"
    # Once the memory is back the function restores at once (a paused restore would boot).
    r = roomy.invoke("gpuoom", {})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, roomy.log_text())


def test_a_request_waiting_out_a_driver_restore_out_of_memory_is_served_when_the_memory_comes(roomy: Torpord) -> None:
    fdir = function_dir(roomy.root, "gpuoom2", HANDLER, "handler:Mem")
    roomy.deploy(fdir)
    switch(roomy, "FAKE_CUDA_RESTORE_RESULT", "2")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(roomy.invoke, "gpuoom2", {})
            time.sleep(1.0)
            assert not waiting.done()
            switch(roomy, "FAKE_CUDA_RESTORE_RESULT", None)
            r = waiting.result(timeout=30)
    finally:
        switch(roomy, "FAKE_CUDA_RESTORE_RESULT", None)
    assert r.status == 200 and r.start == "restored", (r.status, r.body, roomy.log_text())
    assert len(roomy.instances("gpuoom2")) == 1


def test_a_deploy_out_of_gpu_memory_fails_in_one_line_and_leaves_no_worker(roomy: Torpord) -> None:
    fdir = function_dir(roomy.root, "gpualloc", ALLOC_HANDLER, "handler:Alloc")
    before = workers_of(roomy)
    # The GPU is full: every device allocation fails, through the hook (cuMemCreate) or not.
    switch(roomy, "FAKE_CUDA_MEM_ALLOC_RESULT", "2")
    switch(roomy, "FAKE_CUDA_MEM_CREATE_RESULT", "2")
    try:
        r = roomy.cli("deploy", fdir)
    finally:
        switch(roomy, "FAKE_CUDA_MEM_ALLOC_RESULT", None)
        switch(roomy, "FAKE_CUDA_MEM_CREATE_RESULT", None)
    assert r.returncode != 0, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "CUDA_ERROR_OUT_OF_MEMORY" in err and "the GPU ran out of memory: free GPU memory" in err, err
    assert "setup" in err, err
    # The API's last line names the node's GPU as the cause; a failure of the function's own
    # (its setup raising) does not.
    switch(roomy, "FAKE_CUDA_MEM_ALLOC_RESULT", "2")
    switch(roomy, "FAKE_CUDA_MEM_CREATE_RESULT", "2")
    try:
        api = roomy.request("POST", "/v1/functions", {"dir": str(fdir)}, timeout=120)
    finally:
        switch(roomy, "FAKE_CUDA_MEM_ALLOC_RESULT", None)
        switch(roomy, "FAKE_CUDA_MEM_CREATE_RESULT", None)
    last = json.loads(api.body.decode().strip().splitlines()[-1])
    assert last.get("cause") == "gpu_memory" and last["phase"] == "load", last
    broken = function_dir(roomy.root, "gpubroken", ALLOC_HANDLER.replace("def setup(self) -> None:", "def setup(self) -> None:\n        raise ValueError('bad weights')"), "handler:Alloc")
    api = roomy.request("POST", "/v1/functions", {"dir": str(broken)}, timeout=120)
    last = json.loads(api.body.decode().strip().splitlines()[-1])
    assert "bad weights" in last["error"] and "cause" not in last, last
    # No worker of the failed deploy is left, and none holds GPU memory.
    deadline = time.monotonic() + 10
    while workers_of(roomy) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers_of(roomy) == before, [cmdline(p) for p in workers_of(roomy)]
    # With the memory back the same function deploys and serves.
    roomy.deploy(fdir)
    r2 = roomy.invoke("gpualloc", {})
    assert r2.status == 200 and r2.json() == {"ptr": True}, (r2.status, r2.body)


def test_a_wake_that_finds_its_gpu_full_is_served_at_once_on_another(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """An instance hibernated on GPU 0, then GPU 0 filled by another process: the request that
    would wake it there is served from GPU 1 at once. A wake restores where its hibernation was
    taken; it fails the memory check there, the hibernated instance is discarded (as for any
    failed wake) and the function snapshot restored, placed past the GPU the wake found full."""
    others = tmp_path / "procs"
    d = two_gpu_daemon(torpor_bin, fake_cuda, tmp_path, others)
    try:
        fdir = tmp_path / "gpuhib"
        fdir.mkdir()
        (fdir / "handler.py").write_text(HANDLER)
        (fdir / "torpor.toml").write_text(
            SPEC.replace('name = "gpumem"', 'name = "gpuhib"')
            .replace("gpu_release_s = 600", "gpu_release_s = 1")
            .replace("hibernate_s = 600", "hibernate_s = 2")
        )
        d.deploy(fdir)
        r = d.invoke("gpuhib", {})
        assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
        assert [int(i["device"]) for i in d.instances("gpuhib")] == [0], d.instances("gpuhib")
        deadline = time.monotonic() + 60
        while [i["stage"] for i in d.instances("gpuhib")] != ["hibernated"]:
            assert time.monotonic() < deadline, (d.instances("gpuhib"), d.log_text())
            time.sleep(0.1)
        others.write_text(f"1:{1000 * MIB}@0")
        r = d.invoke("gpuhib", {})
        assert r.status == 200 and r.start == "restored", (r.status, r.body, d.log_text())
        assert [int(i["device"]) for i in d.instances("gpuhib") if i.get("pid")] == [1], d.instances("gpuhib")
        log = d.log_text()
        assert "cannot wake the hibernated instance; discarding it" in log, log
        # The wake's GPU passed over by the cold start that replaced it: no second try on GPU
        # 0, no wait (before: placed on GPU 0 again, then a wait of a second).
        assert "the request waits for one to free up" not in log, log
        assert "starting again at once on another GPU" not in log, log
    finally:
        others.write_text("")
        d.stop()
