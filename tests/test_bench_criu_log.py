"""bench/coldstart/criu_log_gaps.py --steps: a dump's time by memory-dumping step, read from a log
of the CRIU that `make` provisions (so a change in CRIU's log lines shows here, not on the GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from conftest import Torpor, Workers

ROOT = Path(__file__).resolve().parent.parent


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("criu_log_gaps", ROOT / "bench/coldstart/criu_log_gaps.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_steps_add_up_to_the_logs_span_and_count_the_parasites_round_trips(tmp_path: Path) -> None:
    gaps = load()
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.010000) Dumping pages (type: 59 pid: 7)\n"
        "(00.012000) page-pipe: Add iov to page pipe (0 iovs, 0/9 total)\n"
        "(00.013000) Pagemap generated: 3 pages (0 lazy) 0 holes\n"
        "(00.014000) PPB: 3 pages 1 segs 16 pipe 0 off\n"
        "(00.015000) Wait for ack 66 on daemon socket\n"
        "pie: 2: __fetched msg: 66 0 0\n"
        "(00.019000) Fetched ack: 66 66 0\n"
        "(00.020000) page-xfer: Transferring pages:\n"
        "(00.050000) page-xfer: \tp 0x1000 - 0x4000\n"
        "(00.051000) page-pipe: Clean up page pipe\n"
        "(00.061000) Writing image inventory (version 1)\n"
    )
    lines = gaps.parse(log)
    steps = gaps.steps(lines)
    assert abs(sum(steps.values()) - 0.061) < 1e-9, steps
    assert abs(steps["choose pages"] - 0.003) < 1e-9, steps
    assert abs(steps["drain into pipes (parasite)"] - 0.006) < 1e-9, steps
    assert abs(steps["write the image"] - 0.032) < 1e-9, steps
    assert abs(steps["everything else"] - 0.020) < 1e-9, steps
    out = gaps.report(log, 0, 5.0, by_step=True)
    assert "step write the image: 0.032 s" in out and "parasite round trips: 1" in out, out


def test_a_real_dumps_log_is_mostly_its_memory_steps(torpor: Torpor, workers: Workers, tmp_path: Path) -> None:
    gaps = load()
    w = workers.server(abstract=True)
    assert w.ask("incr") == "1"
    snap = tmp_path / "snap"
    torpor.ok("snapshot", "--pid", w.init_pid, "--out", snap, "--leave-running")
    logs = sorted(tmp_path.rglob("dump.log"))
    assert logs, sorted(str(p) for p in tmp_path.rglob("*.log"))
    lines = gaps.parse(logs[0])
    assert lines, "torpor's dumps log at -v4 with timestamps"
    steps = gaps.steps(lines)
    # Each memory step is met in a real dump: CRIU still logs them as this reads them.
    for name in ("choose pages", "drain into pipes (parasite)", "write the image"):
        assert steps.get(name, 0.0) > 0.0, (name, steps)
    trips = sum(1 for _, text in lines if text.startswith(gaps.ROUND_TRIP))
    assert trips >= 1, "the parasite drains pages at least once"
