"""Deploy and invoke a GPU function through the real daemon: the base boots with torch and warms
CUDA, the function snapshot holds CUDA state, and instances restore onto the GPU. Skipped where
torch or a CUDA device is missing.

The module's `torpord` runs with the defaults, so GPU functions take the split path (the hook
preloaded, big CUDA allocations as segments, docs/split.md); `transparent_gpu_daemon` runs with
`split_gpu = false`."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from .conftest import Torpord

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")

TORCHMM = ROOT / "tests" / "sdk" / "functions" / "torchmm"
X = [0.5, -1.0, 2.0, 0.0]


def expected_y() -> list[float]:
    code = (
        "import json, torch; g = torch.Generator().manual_seed(0); w = torch.randn(4, 4, generator=g); "
        f"print(json.dumps(torch.softmax(torch.tensor([{X}]) @ w, dim=-1)[0].tolist()))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return list(json.loads(r.stdout))


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) for x, y in zip(a, b))


def test_gpu_function_deploys_restores_and_answers(cuda: None, torpord: Torpord) -> None:
    lines = torpord.deploy(TORCHMM)
    by_phase: dict[str, Any] = {line["phase"]: line for line in lines if "phase" in line}
    # `profile`: the deploy records the hot set a GPU function's restores serve first (docs/split.md).
    assert list(by_phase) == ["validate", "boot_base", "snapshot_base", "restore_base", "load", "snapshot_function", "stage", "profile"]
    assert by_phase["boot_base"]["gpu_warmup_s"] > 0, by_phase["boot_base"]
    assert "|torch|gpu" in by_phase["boot_base"]["key"], by_phase["boot_base"]
    snap = by_phase["snapshot_function"]
    print("snapshot_function:", snap)
    # A GPU worker's snapshots archive its own tmpfs mounts (/dev/shm and /tmp; an unprivileged
    # worker's, the default, also /var/tmp and /run), nothing of the host's (issue 19).
    manifests = list((torpord.state / "snapshots").glob("*/manifest.json"))
    assert len(manifests) >= 2, manifests
    for manifest in manifests:
        archived = [m["path"] for m in json.loads(manifest.read_text())["archived_mounts"]]
        assert sorted(archived) == ["/dev/shm", "/run", "/tmp", "/var/tmp"], (manifest, archived)
    for p, line in by_phase.items():
        print(f"{p:<18} {line['s']:.3f} s")

    want = expected_y()
    first = torpord.invoke("torchmm", {"x": X}, timeout=180)
    assert first.status == 200 and first.start == "restored", (first.status, first.body, torpord.log_text())
    print("restored:", first.timings)
    # The warm-up request ran before the snapshot; on the split path (docs/split.md) it ran
    # once more, for the read-only probe.
    warmups = 2 if snap.get("segments") else 1
    assert first.json()["calls"] == 1 + warmups and close(first.json()["y"], want), (first.json(), want)
    second = torpord.invoke("torchmm", {"x": X})
    assert second.status == 200 and second.start == "warm", second.body
    print("warm:", second.timings)
    assert close(second.json()["y"], want)


def daemon_with(torpor_bin: Path, tmp_path: Path, config: str) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    d = Torpord(torpor_bin, tmp_path, config=config)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture()
def split_gpu_daemon(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Iterator[Torpord]:
    """A fresh daemon with the defaults (split_gpu = true)."""
    yield from daemon_with(torpor_bin, tmp_path, "")


@pytest.fixture()
def transparent_gpu_daemon(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> Iterator[Torpord]:
    yield from daemon_with(torpor_bin, tmp_path, "split_gpu = false\n")


def hook_or_skip(torpord: Torpord) -> None:
    hook = os.environ.get("TORPOR_HOOK_LIB") or str(torpord.binary.resolve().parent / "libtorpor_hook.so")
    if not os.path.isfile(hook):
        pytest.skip(f"torpord runs without the hook ({hook} does not exist; cargo build --workspace)")


def test_gpu_function_takes_the_split_path_with_the_hook(cuda: None, split_gpu_daemon: Torpord) -> None:
    """With split_gpu and the hook preloaded, PyTorch's cudaMalloc blocks are cuda segments:
    captured at the deploy, filled by the restore server into the restored instance at their
    addresses."""
    torpord = split_gpu_daemon
    lines = torpord.deploy(TORCHMM)
    (snap,) = [line for line in lines if line.get("phase") == "snapshot_function"]
    hook_or_skip(torpord)
    assert snap["split"] is True and snap["segments"] >= 1, snap
    want = expected_y()
    r = torpord.invoke("torchmm", {"x": X}, timeout=180)
    assert r.status == 200 and r.start == "restored", (r.status, r.body, torpord.log_text())
    assert "segments" in r.timings, r.timings
    print("split restore:", r.timings)
    assert close(r.json()["y"], want), (r.json(), want)
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert "torpor_restore_fill_gbps_count" in metrics


GPUSTATE = ROOT / "tests" / "daemon" / "functions" / "gpustate"


def test_a_tensor_the_function_holds_and_its_warm_up_only_reads_stays_writable(
    cuda: None, split_gpu_daemon: Torpord
) -> None:
    """gpustate keeps its state in a bare 64 MiB CUDA tensor (no module) and its warm-up request
    only reads it, so the read-only probe finds it unchanged. It must not be shared read-only:
    until session 21 torpor.shareable vouched for tensors the function holds directly, the
    segment was mapped read-only, and the first write after the restore died with CUDA "an
    illegal memory access" (seen first on two H100s, then on one)."""
    torpord = split_gpu_daemon
    lines = torpord.deploy(GPUSTATE)
    hook_or_skip(torpord)
    (snap,) = [line for line in lines if line.get("phase") == "snapshot_function"]
    assert snap["split"] is True, snap
    spec = importlib.util.spec_from_file_location("gpustate_model_single", GPUSTATE / "model.py")
    assert spec and spec.loader
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    for ks in ([3], [3, 11]):
        r = torpord.invoke("gpustate", {"op": "step", "k": ks[-1]}, timeout=180)
        assert r.status == 200, (r.status, r.body, torpord.log_text())
        assert r.json()["sha"] == model.expected_sha(ks), (r.json(), ks)


GPUSLEEPY = ROOT / "tests" / "daemon" / "functions" / "gpusleepy"


def _wait_stage(torpord: Torpord, stage: str, timeout: float = 60.0) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        instances = torpord.instances("gpusleepy")
        if instances and instances[0]["stage"] == stage:
            return instances[0]
        assert time.monotonic() < deadline, f"no {stage} instance: {instances}\n{torpord.log_text()}"
        time.sleep(0.05)


def test_gpu_instance_releases_its_gpu_in_place_then_hibernates(cuda: None, transparent_gpu_daemon: Torpord) -> None:
    """The transparent path: the driver's in-place checkpoint holds all the GPU memory."""
    torpord = transparent_gpu_daemon
    lines = torpord.deploy(GPUSLEEPY)
    (snap,) = [line for line in lines if line.get("phase") == "snapshot_function"]
    assert snap["split"] is False, snap
    want = expected_y()
    first = torpord.invoke("gpusleepy", {"x": X}, timeout=180)
    assert first.status == 200 and first.start == "restored", (first.status, first.body, torpord.log_text())
    assert first.json()["calls"] == 1 and close(first.json()["y"], want)

    inst = _wait_stage(torpord, "gpu_released")
    assert inst["pid"] is not None, inst  # the process stays
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert 'torpor_instances{stage="gpu_released"} 1' in metrics
    resumed = torpord.invoke("gpusleepy", {"x": X})
    assert resumed.status == 200 and resumed.start == "warm", (resumed.status, resumed.body, torpord.log_text())
    assert "gpu_resume" in resumed.timings, resumed.timings
    print("gpu_resume:", resumed.timings)
    assert resumed.json()["calls"] == 2 and close(resumed.json()["y"], want)

    _wait_stage(torpord, "hibernated")
    # From gpu_released, without its GPU resumed (protocol 5; docs/checkpoints.md).
    stop = torpord.hibernation_stop_of(inst["id"])
    assert "gpu_resume" not in stop, stop
    woken = torpord.invoke("gpusleepy", {"x": X}, timeout=180)
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body, torpord.log_text())
    print("woken from hibernation:", woken.timings)
    assert woken.json()["calls"] == 3 and close(woken.json()["y"], want)

    _wait_stage(torpord, "evicted")
    cold = torpord.invoke("gpusleepy", {"x": X}, timeout=180)
    assert cold.status == 200 and cold.start == "restored", (cold.status, cold.body)
    print("woken from eviction:", cold.timings)
    assert cold.json()["calls"] == 4 and close(cold.json()["y"], want)
    metrics = torpord.request("GET", "/metrics").body.decode()
    charged = {
        stage: float(v)
        for stage, v in re.findall(
            r'^torpor_gpu_memory_byte_seconds_total\{function="gpusleepy",stage="([a-z_]+)"\} (\S+)$', metrics, re.M
        )
    }
    assert charged.get("warm", 0) > 0 and "starting" in charged, charged


GPUPACKED = ROOT / "tests" / "daemon" / "functions" / "gpupacked"
SHARED_FILLS = re.compile(r'^torpor_restore_fill_gbps_count\{source="shared"\} (\S+)$', re.M)
SHARED_BYTES = re.compile(r"^torpor_restore_shared_bytes (\S+)$", re.M)


@functools.cache
def packed_reference() -> str:
    """gpupacked's output in a plain process (no hook, no packing, no snapshot)."""
    code = f"import sys; sys.path.insert(0, {str(GPUPACKED)!r}); import model; print(model.digest(model.build()))"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TORPOR_HOOK_LIB", "TORPOR_HOOK_CUDA")}
    env["PYTHONPATH"] = str(ROOT / "python")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def at_once(torpord: Torpord, name: str, requests: list[Any], stagger_s: float = 1.0) -> list[Any]:
    """Invokes each request from its own thread, `stagger_s` apart, so that each finds the
    instances before it busy; the answers in request order."""
    answers: list[Any] = [None] * len(requests)

    def call(i: int) -> None:
        answers[i] = torpord.invoke(name, requests[i], timeout=240)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    for t in threads:
        t.join()
    return answers


def metric(pattern: re.Pattern[str], text: str) -> float:
    m = pattern.search(text)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def packed(
    cuda: None, torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Torpord, dict[str, Any]]]:
    """A split_gpu daemon with gpupacked deployed once; the deploy's lines by phase."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    # Every instance on GPU 0: the read-only copies are shared per GPU, and on a node of two
    # placement would start the second instance on GPU 1, with a copy of its own.
    config = 'split_gpu = true\n[restore_server]\nplacement = "first"\n'
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("packed"), config=config)
    try:
        hook = os.environ.get("TORPOR_HOOK_LIB") or str(torpor_bin.resolve().parent / "libtorpor_hook.so")
        if not os.path.isfile(hook):
            pytest.skip(f"torpord runs without the hook ({hook} does not exist; cargo build --workspace)")
        lines = d.deploy(GPUPACKED)
        yield d, {line["phase"]: line for line in lines if "phase" in line}
    finally:
        d.stop()


def test_packed_weights_are_mapped_read_only_once_for_two_instances(packed: tuple[Torpord, dict[str, Any]]) -> None:
    torpord, phases = packed
    info = phases["load"].get("packed")
    print("load:", phases["load"], "\nsnapshot_function:", phases["snapshot_function"])
    # ~97 MB of weights (the tied head adds a tensor, not bytes) in one whole segment, nothing left behind.
    assert info is not None and info["segments"] == 1 and info["whole"] is True, phases["load"]
    assert info["bytes"] >= 90_000_000 and info["left_bytes"] == 0, info
    snap = phases["snapshot_function"]
    assert snap["split"] is True and snap["readonly_segments"] >= info["segments"], snap

    want = packed_reference()
    # The first request restores an instance and keeps it busy; the second needs another.
    answers = at_once(torpord, "gpupacked", [{"op": "forward", "sleep": 3}] * 2)
    assert all(a.status == 200 for a in answers), ([a.body for a in answers], torpord.log_text())
    assert [a.start for a in answers] == ["restored", "restored"], [a.headers for a in answers]
    for a in answers:
        print("restore:", a.timings)
    # Bit-identical to the unpacked model in a plain process; one request each (the warm-up ran
    # twice before the snapshot on the split path).
    assert [a.json() for a in answers] == [{"sha": want, "calls": 3}] * 2, [a.json() for a in answers]
    assert len(torpord.instances("gpupacked")) == 2

    metrics = torpord.request("GET", "/metrics").body.decode()
    # The second instance mapped the copy the first one made: fills from source "shared", and
    # the resident shared copies hold at least the packs.
    assert metric(SHARED_FILLS, metrics) >= info["segments"], metrics
    assert metric(SHARED_BYTES, metrics) >= info["segment_bytes"], metrics


def test_a_write_to_shared_weights_fails_and_corrupts_no_other_instance(
    packed: tuple[Torpord, dict[str, Any]],
) -> None:
    torpord, _ = packed
    want = packed_reference()
    if len(torpord.instances("gpupacked")) < 2:
        at_once(torpord, "gpupacked", [{"op": "forward", "sleep": 3}] * 2)
    # One instance reads its weights after a pause; meanwhile the other writes into them (the
    # shared read-only copy) and stays busy a while, so that a third request gets a new instance,
    # restored while the writer's fault has already happened.
    reader, writer, fresh = at_once(
        torpord,
        "gpupacked",
        [{"op": "forward", "sleep": 6}, {"op": "write", "sleep": 4}, {"op": "forward"}],
        stagger_s=1.0,
    )
    print("write:", writer.status, writer.body[:2000])
    print("fresh:", fresh.status, fresh.start, fresh.timings)
    assert writer.status != 200, ("the write into shared read-only weights succeeded", writer.body)
    assert reader.status == 200 and reader.json()["sha"] == want, (reader.status, reader.body, torpord.log_text())
    assert fresh.status == 200 and fresh.start == "restored", (fresh.status, fresh.headers, torpord.log_text())
    assert fresh.json()["sha"] == want, fresh.body


def test_pack_weights_false_leaves_the_weights_where_setup_put_them(
    packed: tuple[Torpord, dict[str, Any]], tmp_path: Path
) -> None:
    torpord, phases = packed
    fdir = tmp_path / "gpupacked-off"
    shutil.copytree(GPUPACKED, fdir)
    toml = fdir / "torpor.toml"
    text = toml.read_text().replace('name = "gpupacked"', 'name = "gpupacked-off"')
    toml.write_text(text + "\n[gpu]\npack_weights = false\n")
    lines = torpord.deploy(fdir)
    off = {line["phase"]: line for line in lines if "phase" in line}
    print("unpacked:", off["load"], off["snapshot_function"])
    assert "packed" not in off["load"], off["load"]
    # Unpacked, every segment of weights has a free block (a freed staging block, a free tail):
    # none can be shared (gpupacked/model.py picks its sizes so).
    on_ro, off_ro = phases["snapshot_function"]["readonly_segments"], off["snapshot_function"].get("readonly_segments", 0)
    assert off_ro == 0 < on_ro, (off["snapshot_function"], phases["snapshot_function"])
    r = torpord.invoke("gpupacked-off", {"op": "forward"}, timeout=240)
    assert r.status == 200 and r.json()["sha"] == packed_reference(), (r.status, r.body)


def test_split_gpu_instance_releases_its_gpu_and_maps_its_segments_back(cuda: None, torpord: Torpord) -> None:
    """The split path (the default): before the in-place checkpoint the worker unmaps its
    segments and the daemon saves the writable ones; the resume maps them back (timing
    `segments`) and the answers are bit-identical. A gpu_released instance then hibernates (its
    GPU not resumed: the segments from the release's copies) and wakes with its state."""
    lines = torpord.deploy(GPUSLEEPY)
    (snap,) = [line for line in lines if line.get("phase") == "snapshot_function"]
    hook_or_skip(torpord)
    assert snap["split"] is True and snap["segments"] >= 1, snap
    # Computed first: it imports torch in a new process (seconds), longer than gpusleepy stays
    # in gpu_released.
    want = expected_y()
    first = torpord.invoke("gpusleepy", {"x": X}, timeout=180)
    assert first.status == 200 and first.start == "restored", (first.status, first.body, torpord.log_text())
    assert "segments" in first.timings, first.timings
    y = first.json()["y"]
    assert close(y, want), y

    inst = _wait_stage(torpord, "gpu_released")
    assert inst["pid"] is not None, inst
    resumed = torpord.invoke("gpusleepy", {"x": X})
    assert resumed.status == 200 and resumed.start == "warm", (resumed.status, resumed.body, torpord.log_text())
    assert "gpu_resume" in resumed.timings and "segments" in resumed.timings, resumed.timings
    print("split gpu_resume:", resumed.timings)
    assert resumed.json() == {"y": y, "calls": first.json()["calls"] + 1}, (resumed.json(), y)
    assert "cannot release the GPU" not in torpord.log_text()

    # Released again, then hibernated from gpu_released without a resume: its segments stored
    # from the copies the release kept.
    inst = _wait_stage(torpord, "gpu_released")
    _wait_stage(torpord, "hibernated")
    stop = torpord.hibernation_stop_of(inst["id"])
    assert "segments stored from the GPU release" in torpord.log.read_text(), torpord.log_text()
    assert "gpu_resume" not in stop, stop
    woken = torpord.invoke("gpusleepy", {"x": X}, timeout=180)
    assert woken.status == 200 and woken.start == "restored", (woken.status, woken.body, torpord.log_text())
    assert woken.json() == {"y": y, "calls": first.json()["calls"] + 2}, woken.json()


def _standby_copy(
    tmp_path: Path, name: str, standby: int, kind: str = "released", evict_s: int | None = None
) -> Path:
    """gpusleepy as `name`, two instances, `standby` of them standing by (`standby_gpu = kind`),
    its hibernated instances evicted after `evict_s` (gpusleepy's 6 s when None)."""
    fdir = tmp_path / name
    shutil.copytree(GPUSLEEPY, fdir)
    toml = fdir / "torpor.toml"
    text = toml.read_text().replace('name = "gpusleepy"', f'name = "{name}"')
    text = text.replace("max_instances = 1", f'max_instances = 2\nstandby = {standby}\nstandby_gpu = "{kind}"')
    if evict_s is not None:
        assert "evict_s = 6" in text, text
        text = text.replace("evict_s = 6", f"evict_s = {evict_s}")
    toml.write_text(text)
    return fdir


def _wait_standby(
    torpord: Torpord, name: str, not_ids: set[str], timeout: float = 120.0, stage: str = "gpu_released"
) -> dict[str, Any]:
    """An instance of `name` in `stage` that is none of `not_ids` (a standby)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [i for i in torpord.instances(name) if i["stage"] == stage and i["id"] not in not_ids]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no standby of {name}: {torpord.instances(name)}\n{torpord.log_text()}"
        time.sleep(0.1)


@pytest.mark.parametrize("daemon", ["split_gpu_daemon", "transparent_gpu_daemon"])
def test_a_standby_gpu_instance_serves_like_a_restored_one(
    cuda: None, daemon: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`standby = 1`: an instance restored by CRIU without the driver restore waits in
    gpu_released (no GPU memory); a request takes it through the GPU resume (timings gpu_resume,
    and segments on the split path) with `X-Torpor-Start: standby`, answers bit-identically to an
    instance restored on demand, and another standby takes its place."""
    torpord: Torpord = request.getfixturevalue(daemon)
    split = daemon == "split_gpu_daemon"
    # The reference: the same function without standbys, restored for its first request.
    torpord.deploy(_standby_copy(tmp_path, "gpusleepy-ref", 0))
    ref = torpord.invoke("gpusleepy-ref", {"x": X}, timeout=180)
    assert ref.status == 200 and ref.start == "restored", (ref.status, ref.body, torpord.log_text())
    # Evicted long after it hibernated: the used instance must be seen hibernated below, and on
    # the H100 the next standby's restore took longer than gpusleepy's 2 s from hibernated to
    # evicted (session 15).
    lines = torpord.deploy(_standby_copy(tmp_path, "gpusleepy-standby", 1, evict_s=120))
    (snap,) = [line for line in lines if line.get("phase") == "snapshot_function"]
    if split:
        hook_or_skip(torpord)
    assert snap["split"] is split, snap

    standby = _wait_standby(torpord, "gpusleepy-standby", set())
    assert standby["pid"] is not None, standby
    # Past hibernate_s (4 s) unused: still standing by, same process.
    time.sleep(5)
    now = [(i["id"], i["stage"]) for i in torpord.instances("gpusleepy-standby")]
    assert now == [(standby["id"], "gpu_released")], now
    metrics = torpord.request("GET", "/metrics").body.decode()
    assert 'torpor_standby_instances{function="gpusleepy-standby"} 1' in metrics, metrics

    r = torpord.invoke("gpusleepy-standby", {"x": X}, timeout=180)
    assert r.status == 200 and r.start == "standby", (r.status, r.headers, r.body, torpord.log_text())
    print("standby:", r.timings, "restored:", ref.timings)
    assert "gpu_resume" in r.timings and "restore" not in r.timings, r.timings
    assert ("segments" in r.timings) is split, r.timings
    assert r.json() == ref.json(), (r.json(), ref.json())
    assert close(r.json()["y"], expected_y())

    # Another standby comes; the used instance is an ordinary one: it steps down to hibernated.
    again = _wait_standby(torpord, "gpusleepy-standby", {standby["id"]})
    assert again["pid"] not in (None, standby["pid"]), again
    deadline = time.monotonic() + 60
    while {i["id"]: i["stage"] for i in torpord.instances("gpusleepy-standby")}.get(standby["id"]) != "hibernated":
        assert time.monotonic() < deadline, (torpord.instances("gpusleepy-standby"), torpord.log_text())
        time.sleep(0.1)


@pytest.mark.parametrize("daemon", ["split_gpu_daemon", "transparent_gpu_daemon"])
def test_a_live_standby_holds_its_context_and_serves_without_the_driver_restore(
    cuda: None, daemon: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`standby_gpu = "live"`: the standby's driver restore is done ahead (it waits warm, holding
    its CUDA context's GPU memory, in /metrics); a request pays only the segments (split) and
    answers bit-identically to an instance restored on demand."""
    torpord: Torpord = request.getfixturevalue(daemon)
    split = daemon == "split_gpu_daemon"
    torpord.deploy(_standby_copy(tmp_path, "gpusleepy-lref", 0))
    ref = torpord.invoke("gpusleepy-lref", {"x": X}, timeout=180)
    assert ref.status == 200 and ref.start == "restored", (ref.status, ref.body, torpord.log_text())
    torpord.deploy(_standby_copy(tmp_path, "gpusleepy-live", 1, "live"))
    if split:
        hook_or_skip(torpord)
    standby = _wait_standby(torpord, "gpusleepy-live", set(), stage="warm")
    assert standby["pid"] is not None, standby
    deadline = time.monotonic() + 10
    while True:
        metrics = torpord.request("GET", "/metrics").body.decode()
        held = re.search(r'^torpor_standby_gpu_memory_bytes\{function="gpusleepy-live"\} (\S+)$', metrics, re.MULTILINE)
        if held and float(held.group(1)) > 0:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)
    print("live standby holds", float(held.group(1)) / 2**20, "MiB of GPU memory")
    r = torpord.invoke("gpusleepy-live", {"x": X}, timeout=180)
    assert r.status == 200 and r.start == "standby", (r.status, r.headers, r.body, torpord.log_text())
    print("live standby:", r.timings, "restored:", ref.timings)
    assert "gpu_resume" not in r.timings and "restore" not in r.timings, r.timings
    assert ("segments" in r.timings) is split, r.timings
    assert r.json() == ref.json(), (r.json(), ref.json())
