"""bench/serverless reads GPU memory·seconds from /metrics over every stage label, `starting`
included, and records the per-stage breakdown (pure functions of a metrics delta)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from conftest import ROOT

GIB = 1 << 30


def load(name: str) -> ModuleType:
    path = ROOT / "bench" / "serverless" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"serverless_{name}", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = load("run")
table = load("table")


def test_the_total_is_the_sum_over_every_stage_starting_included() -> None:
    delta = {
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="starting"}': 6 * GIB,
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="warm"}': 4 * GIB,
        'torpor_gpu_memory_byte_seconds_total{function="f",stage="hibernating"}': GIB // 2,
        'torpor_instance_stage_seconds_total{function="f",stage="starting"}': 3.0,
        'torpor_starts_total{function="f",kind="booted"}': 2.0,
    }
    assert run.gib_seconds_by_stage(delta) == {"hibernating": 0.5, "starting": 6.0, "warm": 4.0}
    assert run.gib_seconds(delta) == 10.5
    assert run.stage_seconds(delta) == {"starting": 3.0}
    row = {"gpu_memory_gib_s": 10.5, "gpu_memory_gib_s_by_stage": run.gib_seconds_by_stage(delta)}
    assert table.gib_s(row) == "10.5 (6.0 starting)"


def test_a_daemon_without_the_stage_label_or_the_series_still_reads() -> None:
    old = {'torpor_gpu_memory_byte_seconds_total{function="f"}': 2 * GIB}
    assert run.gib_seconds_by_stage(old) == {"all": 2.0}
    assert run.gib_seconds(old) == 2.0
    assert table.gib_s({"gpu_memory_gib_s": 2.0}) == "2.0"
    assert run.gib_seconds({'torpor_starts_total{function="f",kind="warm"}': 1.0}) is None
    assert run.gib_seconds(None) is None
    assert table.gib_s({"gpu_memory_gib_s": None}) == "n/a"
