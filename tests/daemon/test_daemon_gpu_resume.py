"""The GPU resume in place of a gpu_released instance, without a GPU: torpord's driver calls go
to tests/fakes/fake_libcuda.c, the worker is the real harness.

Before the driver's checkpoint the worker is told (`release_gpu`, answered `gpu_quiet`): on the
H200 a sandbox's timed pool release ran into its checkpointed context and killed it, and the
resume then found "not a CUDA process" (docs/sandboxes.md, session 35). A worker that dies
while released costs its next request a restore, not an error; a resume the driver refuses is
answered 500 naming the instance and its log, the instance goes with its threads' stacks in that
log, and the next request starts a new one.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda, wait_until

from .conftest import FUNCTIONS, Torpord, fake_gpu_env

GPUIPC = FUNCTIONS / "gpuipc"
NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: the driver's word for "not a CUDA process"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torpord-gpu-resume")


@pytest.fixture(scope="module")
def driver_dir(root: Path) -> Path:
    """Where the fake driver lives, and its switches (files read at each call)."""
    return root / "state" / "fake-cuda"


@pytest.fixture(scope="module")
def resuming(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, root: Path, driver_dir: Path
) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    if not os.environ.get("TORPOR_HOOK_LIB") and not (torpor_bin.parent / "libtorpor_hook.so").is_file():
        pytest.fail("libtorpor_hook.so not found: build it (cargo build -p torpor-hook --lib)", pytrace=False)
    env = fake_gpu_env(root, fake_cuda, FAKE_CUDA_LOG=str(root / "driver-calls.log"))
    d = Torpord(torpor_bin, root, config="split = false\n", env=env)
    try:
        d.deploy(released_copy(root))
        yield d
    finally:
        d.stop()


def released_copy(root: Path) -> Path:
    """gpuipc as `gpuresume`: released after 1 s idle and kept so (no hibernation meanwhile)."""
    fdir = root / "gpuresume"
    shutil.copytree(GPUIPC, fdir, ignore=shutil.ignore_patterns("__pycache__"))
    spec = (fdir / "torpor.toml").read_text()
    spec = spec.replace('name = "gpuipc"', 'name = "gpuresume"').replace("hibernate_s = 2", "hibernate_s = 600")
    (fdir / "torpor.toml").write_text(spec)
    return fdir


def released(d: Torpord) -> dict:
    """Serves one request, then waits until the instance is gpu_released."""
    r = d.invoke("gpuresume", {"op": "count"})
    assert r.status == 200, (r.status, r.body, d.log_text())
    wait_until(lambda: [i["stage"] for i in d.instances("gpuresume")] == ["gpu_released"], 30, "the GPU release")
    (inst,) = d.instances("gpuresume")
    return inst


def driver_calls(root: Path) -> list[str]:
    return (root / "driver-calls.log").read_text().splitlines()


def test_a_worker_that_dies_while_released_costs_its_next_request_a_restore_not_an_error(
    resuming: Torpord,
) -> None:
    inst = released(resuming)
    # The worker (protocol 3) was told first, and gave its idle pools back (`release_gpu`).
    line = resuming.log_line("GPU released in place", inst["id"])
    assert "pools_released=Some(" in line, line
    os.kill(inst["pid"], signal.SIGKILL)  # its tree's init: the whole tree goes
    wait_until(lambda: resuming.instances("gpuresume") == [], 15, "the dead instance to be removed")
    r = resuming.invoke("gpuresume", {"op": "count"})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, r.headers)


def test_a_resume_that_fails_for_good_answers_500_leaves_the_stacks_and_the_next_request_starts_anew(
    resuming: Torpord, root: Path, driver_dir: Path
) -> None:
    inst = released(resuming)
    switch = driver_dir / "FAKE_CUDA_RESTORE_RESULT"
    switch.write_text(f"{NOT_INITIALIZED}\n")
    try:
        r = resuming.invoke("gpuresume", {"op": "count"})
    finally:
        switch.unlink()
    assert r.status == 500, (r.status, r.body)
    body = r.json()["error"]
    assert f"cannot resume the GPU of instance {inst['id']}" in body and "not a CUDA process" in body, body
    assert f"torpor logs gpuresume --instance {inst['id']}" in body, body
    assert "the next request starts a new one" in body, body
    # The driver's and the kernel's view of the live process it refused, in the daemon's log.
    line = next(x for x in resuming.log_text().splitlines() if "refused to restore a live process" in x)
    assert "kernel_state=Some(" in line and "driver_state=" in line, line
    # One attempt, then out of service.
    tried = [c for c in driver_calls(root) if c.startswith("restore ") and c.endswith(" pairs=0 result=3")]
    assert len(tried) == 1, driver_calls(root)

    # The worker's threads' stacks, written before its tree was killed.
    def stacks() -> bool:
        out = resuming.cli("logs", "gpuresume", "--instance", inst["id"])
        return "most recent call first" in out.stdout

    wait_until(stacks, 15, "the worker's stacks in its log")
    r = resuming.invoke("gpuresume", {"op": "count"})
    assert r.status == 200 and r.start == "restored", (r.status, r.body, r.headers)
    (new,) = resuming.instances("gpuresume")
    assert new["id"] != inst["id"], new
