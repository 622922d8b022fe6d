"""A gpu_released instance hibernates without its GPU being resumed (docs/checkpoints.md,
"Hibernating a released instance"), without a GPU: torpord's driver calls go to
tests/fakes/fake_libcuda.c (which logs each), NVML is tests/fakes/fake_nvml.c, the worker is the
real harness and CRIU is real.

While released, the worker's GPU state is in its own memory (the driver's checkpoint in place)
and, on the split path, the daemon holds a copy of each writable segment it handed over. So the
hibernation must not restore, unlock or lock the worker again: the quiet point makes no CUDA
call, the segments are stored from the release's copies, and the snapshot takes the process as
the driver left it. The snapshot must still record the GPU memory a restore needs, which NVML
stopped showing at the release (the test empties the fake NVML's list then, as the real driver
does), and the wake must bring back the same process state and the same segment contents.
Each hibernation here happens while the GPU is full (the driver refuses restores for lack of
memory): kept released it succeeds; resumed first (`hibernate_released = false`) it fails and
the instance is lost.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda, wait_until

from .conftest import FUNCTIONS, Torpord, fake_gpu_env
from .test_daemon_concurrent import wait_log
from .test_daemon_split import expected_sha, record

MIB = 1 << 20
WORKER_GPU_BYTES = 64 * MIB
# Released 2 s after a request: time for the test to list the worker in the fake NVML first.
KEEPALIVE = "\n[keepalive]\ngpu_release_s = 2\nhibernate_s = 4\nevict_s = 600\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torpord-hibernate-released")


def fake_gpu_daemon(
    torpor_bin: Path, fake_cuda: FakeCuda, root: Path, config: str = "", **extra: str
) -> Torpord:
    """A daemon on the fake GPU whose requests wait through a hibernation's stop (30 s queue)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    if not os.environ.get("TORPOR_HOOK_LIB") and not (torpor_bin.parent / "libtorpor_hook.so").is_file():
        pytest.fail("libtorpor_hook.so not found: build it (cargo build -p torpor-hook --lib)", pytrace=False)
    (root / "nvml-procs").write_text("")
    env = fake_gpu_env(
        root,
        fake_cuda,
        FAKE_CUDA_LOG=str(root / "driver-calls.log"),
        FAKE_NVML_PROCS_FILE=str(root / "nvml-procs"),
        **extra,
    )
    return Torpord(torpor_bin, root, env=env, config=config, queue_timeout_s=30)


@pytest.fixture(scope="module")
def daemon(torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, root: Path) -> Iterator[Torpord]:
    d = fake_gpu_daemon(torpor_bin, fake_cuda, root)
    try:
        yield d
    finally:
        d.stop()


def gpu_function(root: Path, source: Path, name: str) -> Path:
    """`source` deployed as `name`, a GPU function of one instance, released after 2 s idle,
    hibernated after 4."""
    fdir = root / "functions" / name
    shutil.copytree(source, fdir, ignore=shutil.ignore_patterns("__pycache__"))
    toml = fdir / "torpor.toml"
    spec = toml.read_text().split("\n[keepalive]")[0]
    spec = spec.replace(f'name = "{source.name}"', f'name = "{name}"')
    # One instance: a request during a hibernation waits for it instead of starting another.
    spec = spec.replace("max_instances = 2", "max_instances = 1")
    if "gpus = 1" not in spec:
        spec = spec.replace('timeout_s = 30', 'timeout_s = 30\ngpus = 1\ngpu_memory = "64MiB"')
    toml.write_text(spec + KEEPALIVE)
    return fdir


def worker_of(init: int) -> int:
    """The host pid of the worker under an instance's init."""
    children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
    assert children, f"no worker under init {init}"
    return int(children[0])


def driver_calls(root: Path) -> list[str]:
    return (root / "driver-calls.log").read_text().splitlines()


def calls_for(root: Path, pid: int) -> list[str]:
    """The driver calls on `pid`, each as "<call> <result>"."""
    out = []
    for line in driver_calls(root):
        fields = line.split()
        if fields[1] == str(pid):
            out.append(f"{fields[0]} {fields[-1]}")
    return out


OUT_OF_MEMORY = "2"  # CUDA_ERROR_OUT_OF_MEMORY


def hibernate_released(d: Torpord, root: Path, name: str, request: dict) -> tuple[dict, int, Path]:
    """One request, then waits for the GPU release (the fake NVML listing the worker's memory
    until then, as the real one does) and the hibernation. Meanwhile the GPU is full: another
    process took the memory the release gave back, and the driver answers a restore with
    CUDA_ERROR_OUT_OF_MEMORY (a switch file of the fake), which a hibernation that resumed the
    GPU first would run into. Returns the answer, the worker's pid and the hibernation
    snapshot."""
    first = d.invoke(name, request)
    assert first.status == 200, (first.status, first.body, d.log_text())
    (inst,) = d.instances(name)
    worker = worker_of(inst["pid"])
    (root / "nvml-procs").write_text(f"{worker}:{WORKER_GPU_BYTES}\n")
    wait_until(lambda: [i["stage"] for i in d.instances(name)] == ["gpu_released"], 30, "the GPU release")
    # The driver's checkpoint gave the GPU memory back: NVML no longer lists the worker.
    (root / "nvml-procs").write_text("")
    full = root / "state" / "fake-cuda" / "FAKE_CUDA_RESTORE_RESULT"
    full.write_text(OUT_OF_MEMORY)
    try:
        wait_until(lambda: [i["stage"] for i in d.instances(name)] != ["gpu_released"], 30, "the hibernation")
    finally:
        full.unlink()
    assert [i["stage"] for i in d.instances(name)] == ["hibernated"], (d.instances(name), d.log_text())
    d.hibernation_stop_of(inst["id"])  # check_not_resumed reads it
    (snap,) = (d.state / "snapshots").glob(f"hib-{name}-*")
    return first.json(), worker, snap


def check_not_resumed(d: Torpord, root: Path, worker: int, snap: Path) -> None:
    # Restored and unlocked at its start, locked and checkpointed at the release; never
    # restored, unlocked or locked again.
    calls = calls_for(root, worker)
    assert calls == ["restore result=0", "unlock result=0", "lock result=0", "checkpoint result=0"], driver_calls(root)
    stop = next(x for x in d.log.read_text().splitlines() if "hibernation stop" in x)
    assert "gpu_resume" not in stop, stop
    # What a restore needs on the GPU: the worker's use before its release, not NVML's now.
    manifest = json.loads((snap / "manifest.json").read_text())
    (gpu,) = manifest["gpu"]["gpus"]
    assert gpu["used_by_snapshot"] == WORKER_GPU_BYTES, manifest["gpu"]


def check_woken(d: Torpord, root: Path, name: str, worker: int) -> int:
    """The wake restored a new process and the driver resumed it; returns its worker pid."""
    (inst,) = d.instances(name)
    assert inst["stage"] == "warm", inst
    woken = worker_of(inst["pid"])
    assert woken != worker
    assert calls_for(root, woken)[:2] == ["restore result=0", "unlock result=0"], driver_calls(root)
    return woken


def test_a_released_instance_hibernates_without_a_gpu_resume_and_wakes_with_its_state(
    daemon: Torpord, root: Path
) -> None:
    # gpuipc has no segments: the transparent path.
    daemon.deploy(gpu_function(root, FUNCTIONS / "gpuipc", "gpuhib"))
    first, worker, snap = hibernate_released(daemon, root, "gpuhib", {"op": "count"})
    check_not_resumed(daemon, root, worker, snap)
    woken = daemon.invoke("gpuhib", {"op": "count"})
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body, daemon.log_text())
    assert woken.json()["calls"] == first["calls"] + 1, (first, woken.json())
    check_woken(daemon, root, "gpuhib", worker)


def test_a_released_split_instance_hibernates_from_the_copies_its_release_kept(daemon: Torpord, root: Path) -> None:
    daemon.deploy(gpu_function(root, FUNCTIONS / "splitbuf", "splitgpu"))
    first, worker, snap = hibernate_released(daemon, root, "splitgpu", {"op": "compute", "x": 7})
    assert first["sha"] == expected_sha(7), first
    check_not_resumed(daemon, root, worker, snap)
    line = next(x for x in daemon.log.read_text().splitlines() if "segments stored from the GPU release" in x)
    assert "segments=3" in line, line
    # The record: the weights and the table by the function snapshot's recipes, the scratch the
    # request wrote from the release's copy.
    names = {r["name"] for r in record(daemon, snap.name)["recipes"]}
    assert len(names) == 4 and "segments.json" in names, names
    # The scratch as the request before the hibernation left it (each request writes its count
    # there: one restored from the function snapshot would hold the warm-up's), and the count.
    peek = daemon.invoke("splitgpu", {"op": "peek"})
    assert peek.status == 200 and peek.start == "restored", (peek.status, peek.body, daemon.log_text())
    assert peek.json() == {"scratch": first["calls"], "calls": first["calls"]}, (first, peek.json())
    check_woken(daemon, root, "splitgpu", worker)
    again = daemon.invoke("splitgpu", {"op": "compute", "x": 7})
    assert again.json() == {"sha": expected_sha(7), "calls": first["calls"] + 1}, again.body


def test_hibernate_released_false_resumes_the_gpu_first(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """The switch of the benchmark's A/B (`restore_server.hibernate_released = false`): the
    hibernation resumes the GPU first, as before, and the snapshot then checkpoints it itself;
    with the GPU full meanwhile that resume fails and the instance is lost (the next request
    starts another), which keeping it released avoids (the tests above)."""
    d = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, config="[restore_server]\nhibernate_released = false\n")
    try:
        d.deploy(gpu_function(tmp_path, FUNCTIONS / "gpuipc", "gpuhib"))
        assert d.invoke("gpuhib", {"op": "count"}).status == 200
        (inst,) = d.instances("gpuhib")
        worker = worker_of(inst["pid"])
        wait_until(lambda: [i["stage"] for i in d.instances("gpuhib")] == ["gpu_released"], 30, "the GPU release")
        full = tmp_path / "state" / "fake-cuda" / "FAKE_CUDA_RESTORE_RESULT"
        full.write_text(OUT_OF_MEMORY)
        try:
            wait_until(lambda: d.instances("gpuhib") == [], 30, "the instance to be removed")
        finally:
            full.unlink()
        assert "hibernation failed" in d.log.read_text(), d.log_text()
        assert calls_for(tmp_path, worker)[2:] == [
            "lock result=0",  # the release
            "checkpoint result=0",
            "restore result=2",  # the resume, refused
        ], driver_calls(tmp_path)

        # With room again: resumed first, then the snapshot's own lock and checkpoint.
        first = d.invoke("gpuhib", {"op": "count"})
        assert first.status == 200 and first.start == "restored", (first.status, first.body)
        (inst,) = d.instances("gpuhib")
        worker = worker_of(inst["pid"])
        wait_until(lambda: [i["stage"] for i in d.instances("gpuhib")] == ["hibernated"], 30, "the hibernation")
        assert calls_for(tmp_path, worker)[2:] == [
            "lock result=0",  # the release
            "checkpoint result=0",
            "restore result=0",  # the resume
            "unlock result=0",
            "lock result=0",  # the snapshot
            "checkpoint result=0",
        ], driver_calls(tmp_path)
        stop = d.hibernation_stop_of(inst["id"])
        assert "gpu_resume" in stop, stop
        woken = d.invoke("gpuhib", {"op": "count"})
        assert woken.status == 200 and woken.json()["calls"] == first.json()["calls"] + 1, woken.body
    finally:
        d.stop()


def test_a_request_during_a_released_stop_waits_and_is_answered_by_the_woken_instance(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """The stop held open for 2 s (`TORPORD_DELAY=hibernate-stop`): a request that comes then
    neither resumes the released GPU under the snapshot nor fails; it waits and wakes the
    hibernated instance, with its state."""
    d = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, TORPORD_DELAY="hibernate-stop:2000")
    try:
        d.deploy(gpu_function(tmp_path, FUNCTIONS / "splitbuf", "splitgpu"))
        first = d.invoke("splitgpu", {"op": "compute", "x": 5}).json()
        wait_log(d, r"TORPORD_DELAY delays this point.*hibernate-stop|point=\"?hibernate-stop")
        t0 = time.monotonic()
        during = d.invoke("splitgpu", {"op": "peek"})
        waited = time.monotonic() - t0
        assert during.status == 200 and during.start == "restored", (during.status, during.body, d.log_text())
        assert during.json() == {"scratch": first["calls"], "calls": first["calls"]}, (first, during.json())
        assert waited > 0.5, waited
        assert "segments stored from the GPU release" in d.log.read_text(), d.log_text()
    finally:
        d.stop()
