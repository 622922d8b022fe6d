"""GPU memory·seconds through the real daemon, without a GPU: tests/fakes/fake_nvml.c stands in
for NVML and reports memory for the processes a test names in a file it rereads at each call.

The daemon runs with `--cold-start boot`, the benchmark's baseline, whose cold starts boot a
worker and run a setup() that takes 2.5 s (tests/daemon/functions/slowstart). Once the booting
worker exists the test lists it as holding GPU_BYTES; from then on the daemon must charge that
memory in every stage, `starting` included, so the sum over stages is GPU_BYTES times the time
since, within the ticker's 200 ms sampling.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeCuda, cmdline, pids_with

from .conftest import FUNCTIONS, Answer, Torpord

SLOWSTART = FUNCTIONS / "slowstart"
SETUP_S = 2.5
GPU_BYTES = 3 << 30
TICK_S = 0.2
STAGES = ("starting", "warm", "gpu_released", "hibernating", "hibernated", "evicted")


@pytest.fixture(scope="module")
def procs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fake-nvml") / "procs"


@pytest.fixture(scope="module")
def booting(
    torpor_bin: Path, criu_ready: None, fake_cuda: FakeCuda, procs_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Torpord]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    env = {"TORPOR_LIBNVML": str(fake_cuda.nvml), "FAKE_NVML_PROCS_FILE": str(procs_file)}
    d = Torpord(torpor_bin, tmp_path_factory.mktemp("torpord-gpums"), "--cold-start", "boot", env=env)
    try:
        yield d
    finally:
        d.stop()


def series(torpord: Torpord, name: str, function: str) -> dict[str, float]:
    """`name{function, stage}` per stage, from /metrics."""
    text = torpord.request("GET", "/metrics").body.decode()
    found = {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf'^{re.escape(name)}{{function="{function}",stage="([a-z_]+)"}} (\S+)$', text, re.MULTILINE)
    }
    assert set(found) == set(STAGES), f"{name} for {function}: {found}\n{text}"
    return found


def booting_worker(torpord: Torpord, before: set[int], timeout: float = 20.0) -> int:
    """The host pid of the worker of the instance being booted (the child of its init)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for init in set(pids_with(f"{torpord.state}/")) - before:
            if "--role function" not in cmdline(init):
                continue
            try:
                children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
            except OSError:
                continue
            if children:
                return int(children[0])
        time.sleep(0.01)
    raise AssertionError(f"no booting worker within {timeout} s\n{torpord.log_text()}")


def test_a_booting_instance_is_charged_as_starting_and_the_stages_add_up(booting: Torpord, procs_file: Path) -> None:
    procs_file.write_text("")
    booting.deploy(SLOWSTART)
    before = set(pids_with(f"{booting.state}/"))
    answers: list[Answer] = []
    invoke = threading.Thread(target=lambda: answers.append(booting.invoke("slowstart", {})))
    t_invoke = time.monotonic()
    invoke.start()
    worker = booting_worker(booting, before)
    # From here on, NVML says the worker holds GPU_BYTES.
    procs_file.write_text(f"{worker}:{GPU_BYTES}")
    t_listed = time.monotonic()
    invoke.join(timeout=60)
    assert answers and answers[0].status == 200, (answers, booting.log_text())
    assert answers[0].start == "booted" and answers[0].json() == {"calls": 1}
    t_answered = time.monotonic()
    time.sleep(1.5)  # some warm time too

    t_before = time.monotonic()
    seconds = series(booting, "torpor_instance_stage_seconds_total", "slowstart")
    byte_s = series(booting, "torpor_gpu_memory_byte_seconds_total", "slowstart")
    t_after = time.monotonic()
    gib_s = {k: v / GPU_BYTES for k, v in byte_s.items()}
    print(f"listed {t_listed - t_invoke:.3f} s after the invoke; seconds {seconds}; GiB·s / GiB {gib_s}")

    # The start took the setup's 2.5 s at least, and all of it was metered as starting.
    assert SETUP_S <= seconds["starting"] <= t_answered - t_invoke + TICK_S, seconds
    # Charged from the first tick after the worker was listed until the instance was live.
    assert gib_s["starting"] >= SETUP_S - 2 * TICK_S, gib_s
    assert gib_s["starting"] <= seconds["starting"] - (t_listed - t_invoke) + TICK_S, (gib_s, seconds)
    assert gib_s["warm"] > 0, gib_s
    assert all(gib_s[s] == 0 for s in ("gpu_released", "hibernating", "hibernated", "evicted")), gib_s
    # Every interval since the listing is charged once: the sum over stages is the memory times
    # the time since, less at most the tick before the first reading and the one after the last.
    total = sum(gib_s.values())
    assert t_before - t_listed - 2 * TICK_S - 0.3 <= total <= t_after - t_listed + 0.05, (total, t_listed, gib_s)

    # NVML no longer lists it: nothing more is charged.
    procs_file.write_text("")
    time.sleep(3 * TICK_S)
    settled = sum(series(booting, "torpor_gpu_memory_byte_seconds_total", "slowstart").values())
    time.sleep(1.0)
    assert sum(series(booting, "torpor_gpu_memory_byte_seconds_total", "slowstart").values()) == settled
