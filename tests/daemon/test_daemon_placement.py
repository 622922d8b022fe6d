"""Cold starts spread over the node's devices (`restore_server.placement`,
crates/torpord/src/runtime/device_choice.rs; docs/torpord.md, "Several GPUs"), through the real
daemon, real workers with the hook, real fds and CRIU: on the host backend with two devices
(`restore_server.host_devices = 2`), and on three fake GPUs of one model (tests/fakes), where the
driver's restore must carry the GPU pairs that move the CUDA state onto the chosen GPU.

`TORPORD_DELAY=restored:<ms>` holds every restore after CRIU, so that two requests sent together
have two starts in flight at once: the second must see the first's and go to the other device.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import FakeCuda

from .conftest import Answer, Torpord, fake_gpu_env
from .test_daemon_migrate import device_gauge, gpu_splitbuf
from .test_daemon_split import expected_sha, twin

HOLD_MS = 1500
# The fake GPUs' UUIDs (tests/fakes), and the GPU pairs of a restore onto GPU 1 as the
# fake driver logs them.
G0, G1, G2 = (f"GPU-fa4e0000-0000-0000-0000-00000000000{i}" for i in range(3))
SWAP = f"pairs=3 {G0}>{G1} {G1}>{G0} {G2}>{G2}"


def two_at_once(
    d: Torpord, name: str, request: Any = None, stagger_s: float = 0.05, timeout: float = 120
) -> list[Answer]:
    """Two requests sent `stagger_s` apart to `name` (`request`: a compute by default); with
    nothing live each starts an instance (one may be answered by the other's, which frees up
    first: late binding; both instances join), unless the request holds its instance busy."""
    out: dict[int, Answer] = {}
    body = {"op": "compute", "x": 9} if request is None else request

    def run(i: int) -> None:
        out[i] = d.invoke(name, body, timeout=timeout)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(timeout)
    return [out[0], out[1]]


def host_daemon(torpor_bin: Path, tmp_path: Path, placement: str | None = None) -> Torpord:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    config = "[restore_server]\nhost_devices = 2\n"
    if placement:
        config += f'placement = "{placement}"\n'
    return Torpord(torpor_bin, root, config=config, env={"TORPORD_DELAY": f"restored:{HOLD_MS}"}, queue_timeout_s=60)


def test_two_cold_starts_at_once_land_on_both_devices_and_a_restarted_daemon_keeps_them_there(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    d = host_daemon(torpor_bin, tmp_path)
    try:
        d.deploy(twin(tmp_path, "spread"))
        answers = two_at_once(d, "spread")
        for a in answers:
            assert a.status == 200 and a.start in ("restored", "warm"), (a.status, a.body, d.log_text())
            assert a.json()["sha"] == expected_sha(9), a.body
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
        # Where each is, in the function's listing too.
        assert sorted(i["device"] for i in d.instances("spread")) == [0, 1], d.instances("spread")
        placed = [line for line in d.log_text().splitlines() if "instance restored" in line]
        assert any("device=1" in line for line in placed) and any("device=0" in line for line in placed), placed
        # The one on device 1 is recorded there, for a daemon that re-adopts it after a crash.
        files = list((d.state / "placement").glob("*.json"))
        assert len(files) == 1, files
        assert json.loads(files[0].read_text()) == {"gpu": 1, "gpu_map": []}
        pids = sorted(i["pid"] for i in d.instances("spread") if i.get("pid"))
        d.wait_pages_in()  # else the restarted daemon rightly does not re-adopt them
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.restart()
        deadline = time.monotonic() + 30
        while sorted(i["pid"] for i in d.instances("spread") if i.get("pid")) != pids:
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.1)
        device_gauge(d, "torpor_device_instances", 1, 1)
        device_gauge(d, "torpor_device_instances", 0, 1)
    finally:
        d.stop()


def test_placement_first_keeps_every_cold_start_on_the_deploys_device(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    d = host_daemon(torpor_bin, tmp_path, placement="first")
    try:
        d.deploy(twin(tmp_path, "first"))
        for a in two_at_once(d, "first"):
            assert a.status == 200 and a.start in ("restored", "warm"), (a.status, a.body, d.log_text())
        device_gauge(d, "torpor_device_instances", 0, 2)
        assert not list((d.state / "placement").glob("*.json"))
    finally:
        d.stop()


def test_a_bad_placement_setting_is_one_line_naming_the_key(torpor_bin: Path, tmp_path: Path) -> None:
    config = tmp_path / "torpord.toml"
    for toml, expected in (('placement = "random"', '"spread" or "first"'), ('driver_lanes = 2', '"gpu" or "node"')):
        config.write_text(f"[restore_server]\n{toml}\n")
        r = subprocess.run(
            [torpor_bin, "serve", "--check", "--config", config], capture_output=True, text=True, timeout=30, check=False
        )
        key = toml.split(" ")[0]
        assert r.returncode != 0 and f"restore_server.{key}" in r.stderr and expected in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0, r.stderr


def fake_gpu_daemon(
    torpor_bin: Path, fake_cuda: FakeCuda, tmp_path: Path, delay: str = f"restored:{HOLD_MS}", **fake: str
) -> tuple[Torpord, Path]:
    """A daemon on fake GPUs (`fake`: FAKE_CUDA_* settings; every driver call logged), held at
    `delay` (TORPORD_DELAY)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    root = tmp_path / "daemon"
    root.mkdir()
    log = root / "cuda-calls.log"
    env = fake_gpu_env(root, fake_cuda, FAKE_CUDA_LOG=str(log), TORPORD_DELAY=delay, **fake)
    return Torpord(torpor_bin, root, env=env, queue_timeout_s=60), log


def two_gpu_starts(d: Torpord, log: Path, tmp_path: Path, name: str, keepalive: str = "") -> list[str]:
    """Deploys splitbuf as a `gpus = 1` function of two instances (`keepalive`: a
    `[keepalive]` table to append), starts both at once (each answer checked) and returns the
    driver's restore calls they made."""
    fdir = gpu_splitbuf(tmp_path, name)
    toml = fdir / "torpor.toml"
    toml.write_text(toml.read_text().replace("max_instances = 1", "max_instances = 2") + keepalive)
    d.deploy(fdir)
    before = log.read_text() if log.exists() else ""
    for a in two_at_once(d, name):
        assert a.status == 200 and a.start in ("restored", "warm"), (a.status, a.body, d.log_text())
        assert a.json()["sha"] == expected_sha(9), a.body
    return [line for line in log.read_text()[len(before):].splitlines() if line.startswith("restore ")]


def test_a_gpu_function_placed_on_another_gpu_is_restored_with_the_pairs_that_move_it_there(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    d, log = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, FAKE_CUDA_DEVICES="3", FAKE_CUDA_SAME_MODEL="1")
    try:
        restores = two_gpu_starts(d, log, tmp_path, "gpuspread")
        assert len(restores) == 2, restores
        # One stays on the deploy's GPU (no pairs); the other's pairs swap GPUs 0 and 1.
        assert sum("pairs=0" in r for r in restores) == 1, restores
        assert sum(SWAP in r for r in restores) == 1, restores
        assert all(r.endswith("result=0") for r in restores), restores
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
        # The first start of the function (nothing live) leads: its driver restore goes alone.
        restored = [line for line in d.log_text().splitlines() if "instance restored" in line]
        assert sorted("leads=true" in line for line in restored) == [False, True], restored
        # Both serve on (warm), each with its own state.
        for _ in range(2):
            r = d.invoke("gpuspread", {"op": "compute", "x": 9})
            assert r.status == 200 and r.json()["sha"] == expected_sha(9), r.body
    finally:
        d.stop()


def test_a_gpu_of_another_model_takes_no_cold_start(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    d, log = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, FAKE_CUDA_DEVICES="2")
    try:
        restores = two_gpu_starts(d, log, tmp_path, "gpumodel")
        assert len(restores) == 2 and all("pairs=0" in r for r in restores), restores
        device_gauge(d, "torpor_device_instances", 0, 2)
    finally:
        d.stop()


def test_a_hibernated_instance_wakes_on_its_gpu_and_counts_there_after_a_restart_too(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """A wake restores where the hibernation was taken (the driver keeps the GPUs a process was
    checkpointed on: no pairs) and keeps the instance's id, so the placement file its placed
    start wrote says where it is, through the hibernation and a daemon's restart. Before, an
    instance whose segments are not CUDA ones (these are host ones, as a transparent GPU
    function has none) woke counted on GPU 0."""
    d, log = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, FAKE_CUDA_DEVICES="3", FAKE_CUDA_SAME_MODEL="1")
    try:
        keepalive = "\n[keepalive]\ngpu_release_s = 1\nhibernate_s = 2\nevict_s = 600\n"
        restores = two_gpu_starts(d, log, tmp_path, "gpuwake", keepalive)
        assert sum("pairs=3" in r for r in restores) == 1, restores
        device_gauge(d, "torpor_device_instances", 1, 1)
        on_gpu1 = [p.stem for p in (d.state / "placement").glob("*.json")]
        assert len(on_gpu1) == 1, on_gpu1

        deadline = time.monotonic() + 60
        while sorted(i["stage"] for i in d.instances("gpuwake")) != ["hibernated", "hibernated"]:
            assert time.monotonic() < deadline, (d.instances("gpuwake"), d.log_text())
            time.sleep(0.1)
        ids = sorted(i["id"] for i in d.instances("gpuwake"))
        assert on_gpu1[0] in ids, (on_gpu1, ids)
        # Listed where their wakes will restore them.
        assert {i["id"]: i["device"] for i in d.instances("gpuwake")}[on_gpu1[0]] == 1, d.instances("gpuwake")
        assert sorted(i["device"] for i in d.instances("gpuwake")) == [0, 1], d.instances("gpuwake")
        device_gauge(d, "torpor_device_instances", 1, 0)

        # A crash while both sleep: the restarted daemon's sweep keeps the sleeper's file. Its
        # wakes are held after CRIU, so that two requests wake both.
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.env["TORPORD_DELAY"] = f"woken:{HOLD_MS}"
        d.restart()
        assert (d.state / "placement" / f"{on_gpu1[0]}.json").is_file(), d.log_text()
        before = log.read_text()
        for a in two_at_once(d, "gpuwake"):
            # One may be answered by the other's instance, woken first (late binding).
            assert a.status == 200 and a.start in ("restored", "warm"), (a.status, a.body, d.log_text())
            assert a.json()["sha"] == expected_sha(9), a.body
        deadline = time.monotonic() + 30
        while sorted(i["id"] for i in d.instances("gpuwake") if i.get("pid")) != ids:
            assert time.monotonic() < deadline, (d.instances("gpuwake"), d.log_text())
            time.sleep(0.1)
        wakes = [line for line in log.read_text()[len(before):].splitlines() if line.startswith("restore ")]
        assert len(wakes) == 2 and all("pairs=0" in w for w in wakes), wakes
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
    finally:
        d.stop()


def standby_function(tmp_path: Path, name: str, kind: str) -> Path:
    """A `gpus = 1` SlowCounter with two instances, both standbys of `kind`."""
    fdir = tmp_path / name
    fdir.mkdir()
    (fdir / "handler.py").write_text(SLOW_COUNTER)
    (fdir / "torpor.toml").write_text(
        f'name = "{name}"\nentry = "handler:SlowCounter"\ngpus = 1\ngpu_memory = "64MiB"\ntimeout_s = 30\n'
        f'\n[scaling]\nmax_instances = 2\nstandby = 2\nstandby_gpu = "{kind}"\n'
        "\n[keepalive]\ngpu_release_s = 600\nhibernate_s = 600\nevict_s = 600\n"
    )
    return fdir


@pytest.mark.parametrize("kind", ["live", "released"])
def test_standbys_spread_over_the_gpus_and_serve_where_they_were_placed(
    kind: str, torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """Standbys are placed as cold starts are: one on GPU 1 counts there and keeps a placement
    file, and the driver's restore that puts its CUDA state back passes the pairs of its CRIU
    restore: at once for a live standby, at the first request's resume for a released one,
    which owes them meanwhile, in its placement file too (the daemon is killed and restarted
    while it waits). Before, every standby (and so every instance a burst took from them) sat
    on GPU 0."""
    d, log = fake_gpu_daemon(torpor_bin, fake_cuda, tmp_path, FAKE_CUDA_DEVICES="3", FAKE_CUDA_SAME_MODEL="1")
    try:
        before = log.read_text() if log.exists() else ""
        d.deploy(standby_function(tmp_path, "sbspread", kind))
        deadline = time.monotonic() + 60
        while len([i for i in d.instances("sbspread") if i.get("pid")]) != 2:
            assert time.monotonic() < deadline, (d.instances("sbspread"), d.log_text())
            time.sleep(0.1)
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
        restores = [line for line in log.read_text()[len(before):].splitlines() if line.startswith("restore ")]
        (placed,) = list((d.state / "placement").glob("*.json"))
        placement = json.loads(placed.read_text())
        assert placement["gpu"] == 1, placement
        assert {i["id"]: i["device"] for i in d.instances("sbspread")}[placed.stem] == 1, d.instances("sbspread")
        if kind == "live":
            assert sum(SWAP in r for r in restores) == 1 and all(r.endswith("result=0") for r in restores), restores
            assert "owed_gpu_pairs" not in placement, placement
        else:
            # No driver restore of a standby before a request (the deploy's own ones are in).
            assert not any(SWAP in r for r in restores), restores
            assert placement["owed_gpu_pairs"] == [[G0, G1], [G1, G0], [G2, G2]], placement
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            d.restart()
            deadline = time.monotonic() + 30
            while len([i for i in d.instances("sbspread") if i.get("pid")]) != 2:
                assert time.monotonic() < deadline, (d.instances("sbspread"), d.log_text())
                time.sleep(0.1)
            device_gauge(d, "torpor_device_instances", 1, 1)

        before = log.read_text()
        # Each held a while, so that the second cannot be answered by the first's instance.
        out = two_at_once(d, "sbspread", {"sleep_s": 1}, stagger_s=0, timeout=60)
        # Re-adopted after the restart, a released standby is resumed as any released instance.
        starts = ["standby"] if kind == "live" else ["standby", "warm"]
        assert all(a.status == 200 and a.start in starts for a in out), [(a.start, a.body) for a in out]
        assert all(a.json()["calls"] == 1 for a in out), [a.body for a in out]
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
        if kind == "released":
            resumes = [line for line in log.read_text()[len(before):].splitlines() if line.startswith("restore ")]
            assert sorted(SWAP in r for r in resumes) == [False, True], resumes
            assert all(r.endswith("result=0") for r in resumes), resumes
            # Paid: a daemon restarted now must not pass them again.
            assert "owed_gpu_pairs" not in json.loads(placed.read_text()), placed.read_text()
    finally:
        d.stop()


SLOW_COUNTER = """
import time

import torpor


@torpor.function
class SlowCounter:
    def setup(self) -> None:
        self.calls = 0

    def __call__(self, request: dict) -> dict:
        self.calls += 1
        time.sleep(request.get("sleep_s", 0))
        return {"calls": self.calls}
"""


def test_a_live_standby_is_listed_gpu_released_on_its_gpu_until_its_driver_restore_and_a_crash_then_leaves_it_owing(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, tmp_path: Path
) -> None:
    """A live standby between its CRIU restore and its driver restore (held there with
    `TORPORD_DELAY=standby-driver`) is listed as what it is: gpu_released, on the GPU it was
    placed on, and its placement file says it owes the GPU pairs. Before, its row read warm and,
    in no pool yet, GPU 0; a daemon killed then re-adopted it as a live instance on GPU 0 whose
    CUDA state was in fact still checkpointed. Now the restarted daemon takes it as released,
    and the first request's resume pays the pairs, once."""
    d, log = fake_gpu_daemon(
        torpor_bin, fake_cuda, tmp_path, delay="standby-driver:60000", FAKE_CUDA_DEVICES="3", FAKE_CUDA_SAME_MODEL="1"
    )
    try:
        d.deploy(standby_function(tmp_path, "sbheld", "live"))
        deadline = time.monotonic() + 60
        while d.log.read_text(errors="replace").count("TORPORD_DELAY delays this point") < 2:
            assert time.monotonic() < deadline, d.log_text()
            time.sleep(0.05)
        rows = d.instances("sbheld")
        assert sorted((r["stage"], r["device"]) for r in rows) == [("gpu_released", 0), ("gpu_released", 1)], rows
        (placed,) = list((d.state / "placement").glob("*.json"))
        assert json.loads(placed.read_text())["owed_gpu_pairs"] == [[G0, G1], [G1, G0], [G2, G2]], placed.read_text()
        before = log.read_text()
        assert not any(SWAP in line for line in before.splitlines() if line.startswith("restore ")), before

        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        d.restart()
        deadline = time.monotonic() + 30
        while sorted((r["stage"], r["device"]) for r in d.instances("sbheld") if r.get("pid")) != [("gpu_released", 0), ("gpu_released", 1)]:
            assert time.monotonic() < deadline, (d.instances("sbheld"), d.log_text())
            time.sleep(0.1)
        device_gauge(d, "torpor_device_instances", 1, 1)

        out = two_at_once(d, "sbheld", {"sleep_s": 1}, stagger_s=0, timeout=60)
        assert all(a.status == 200 and a.json()["calls"] == 1 for a in out), [(a.status, a.body) for a in out]
        resumes = [line for line in log.read_text()[len(before):].splitlines() if line.startswith("restore ")]
        assert sorted(SWAP in r for r in resumes) == [False, True], resumes
        assert all(r.endswith("result=0") for r in resumes), resumes
        assert "owed_gpu_pairs" not in json.loads(placed.read_text()), placed.read_text()
        device_gauge(d, "torpor_device_instances", 0, 1)
        device_gauge(d, "torpor_device_instances", 1, 1)
    finally:
        d.stop()
