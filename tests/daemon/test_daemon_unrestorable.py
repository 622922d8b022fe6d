"""GPU state the driver's checkpoint cannot restore, in a torpord function, without a GPU: every
GPU worker preloads the device-memory hook (crates/torpord/src/split/mod.rs, `worker_hook`;
watch-only here, with `split = false`), which records a CUDA IPC import, so that the deploy's
function snapshot, the GPU release and the hibernation refuse the worker before the driver is
touched, in the line `torpor snapshot` gives, and the instance goes on serving.

The GPU is tests/fakes/fake_libcuda.c: the worker warms CUDA through it (a `gpus = 1` function
without a framework) and its IPC calls reach it through the hook; the daemon's checkpoint calls
are logged by it, so the test sees the driver was never asked to lock the worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FAKES, FakeCuda, wait_until

from .conftest import FUNCTIONS, Torpord

GPUIPC = FUNCTIONS / "gpuipc"
IPC_LINE = "holds GPU memory of another process opened through CUDA IPC, which the CUDA driver's checkpoint cannot restore"


@pytest.fixture(scope="module")
def driver_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fake-driver") / "calls.log"


@pytest.fixture(scope="module")
def watching(
    torpor_bin: Path,
    criu_ready: None,
    fake_cuda: FakeCuda,
    driver_log: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    if not os.environ.get("TORPOR_HOOK_LIB") and not (torpor_bin.parent / "libtorpor_hook.so").is_file():
        pytest.fail("libtorpor_hook.so not found: build it (cargo build -p torpor-hook --lib)", pytrace=False)
    root = tmp_path_factory.mktemp("torpord-unrestorable")
    # Where the workers reach it: their /tmp is their own, the state directory is bound in.
    # With VMM, which brings the primary context the driver warm-up retains.
    lib = root / "state" / "fake-cuda" / "libcuda.so.1"
    lib.parent.mkdir(parents=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (the fake_cuda fixture has one)"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", lib, FAKES / "fake_libcuda.c"], check=True)
    env = {"TORPOR_LIBCUDA": str(lib), "TORPOR_LIBNVML": str(fake_cuda.nvml), "FAKE_CUDA_LOG": str(driver_log)}
    d = Torpord(torpor_bin, root, config="split = false\n", env=env)
    try:
        yield d
    finally:
        d.stop()


def driver_locks(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("lock ")] if log.exists() else []


def test_the_gpu_workers_preload_the_hook_to_watch(watching: Torpord) -> None:
    status = watching.request("GET", "/v1/status").json()["hook"]
    assert status["library"] and not status["split"] and status["gpu_workers"] == "watch", status


def test_an_instance_holding_cuda_ipc_is_neither_released_nor_hibernated_and_keeps_serving(
    watching: Torpord, driver_log: Path
) -> None:
    watching.deploy(GPUIPC)
    r = watching.invoke("gpuipc", {"op": "ipc-open"})
    # 200 with code 0: the call went through the preloaded hook to the (fake) driver.
    assert r.status == 200 and r.json() == {"calls": 1, "code": 0}, (r.status, r.body, watching.log_text())

    # gpu_release_s = 1, hibernate_s = 2: both steps come, and both refuse.
    def refused() -> bool:
        log = watching.log.read_text(errors="replace")
        return "hibernation refused" in log and "cannot release the GPU" in log

    wait_until(refused, 30, "the GPU release and the hibernation to be refused")
    log = watching.log.read_text(errors="replace")
    for step in ("cannot release the GPU", "hibernation refused"):
        line = next(line for line in log.splitlines() if step in line)
        assert IPC_LINE in line and "cudaIpcCloseMemHandle" in line, line
    assert driver_locks(driver_log) == [], "the driver must not be touched"
    (inst,) = watching.instances("gpuipc")
    assert inst["stage"] == "warm", inst
    r = watching.invoke("gpuipc", {"op": "count"})
    assert r.status == 200 and r.json()["calls"] == 2, r.body

    # Once the program lets go, the next hibernation goes through and the instance wakes with
    # its memory.
    assert watching.invoke("gpuipc", {"op": "ipc-close"}).json() == {"calls": 3, "code": 0}
    wait_until(lambda: [i["stage"] for i in watching.instances("gpuipc")] == ["hibernated"], 30, "the hibernation")
    r = watching.invoke("gpuipc", {"op": "count"})
    assert r.status == 200 and r.json()["calls"] == 4 and r.start == "restored", (r.body, r.headers)


def test_a_deploy_whose_setup_holds_cuda_ipc_is_refused_and_the_function_serves_on(
    watching: Torpord, tmp_path: Path
) -> None:
    # Another function serves beside the failing deploy (deployed here when this test runs alone).
    if watching.request("GET", "/v1/functions/gpuipc").status == 404:
        watching.deploy(GPUIPC)
    fdir = tmp_path / "gpuipc-setup"
    shutil.copytree(GPUIPC, fdir, ignore=shutil.ignore_patterns("__pycache__"))
    spec = (fdir / "torpor.toml").read_text()
    spec = spec.replace('name = "gpuipc"', 'name = "gpuipc-setup"').replace("handler:Ipc", "handler:IpcInSetup")
    (fdir / "torpor.toml").write_text(spec)
    started = time.monotonic()
    r = watching.cli("deploy", fdir)
    assert r.returncode != 0, r.stdout + r.stderr
    assert IPC_LINE in r.stderr and "cudaIpcCloseMemHandle" in r.stderr, r.stderr
    assert time.monotonic() - started < 60
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    failed = watching.request("GET", "/v1/functions/gpuipc-setup").json()
    assert failed["state"] == "failed" and failed["snapshot"] is None and failed["instances"] == [], failed
    # The other function is untouched.
    r = watching.invoke("gpuipc", {"op": "count"})
    assert r.status == 200, r.body
