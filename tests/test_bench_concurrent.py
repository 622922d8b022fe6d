"""bench/concurrent/measure.py on the CPU (`--model cpu`: host-backend segments, two host
devices for the migration) with the real daemon, workers and CRIU: both parts run, every woken
or migrated answer equals the reference, and the JSONs carry the summary keys the README table
and issue 10 read (`summary.stop_s`, `summary.migration_downtime_s`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT


def measure(torpor_bin: Path, work: Path, hib: Path, mig: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "concurrent" / "measure.py"), "--model", "cpu", "--runs", "1",
         "--hibernate-s", "1", "--settle-s", "0.5", "--work-dir", str(work), "--torpor", str(torpor_bin),
         "--out-hibernate", str(hib), "--out-migrate", str(mig)],
        capture_output=True, text=True, timeout=600, check=False,
    )


def test_the_cpu_smoke_run_measures_both_parts_with_identical_outputs(
    torpor_bin: Path, criu_ready: None, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    hib, mig = tmp_path / "concurrent-checkpoint-cpu.json", tmp_path / "migration-cpu.json"
    # A short work directory: the daemons' sockets live under it (SUN_LEN).
    work = Path(tempfile.mkdtemp(prefix="tc-", dir="/tmp"))
    try:
        r = measure(torpor_bin, work, hib, mig)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    h = json.loads(hib.read_text())
    s = h["summary"]
    assert s["identical"] is True, h
    assert s["stop_s"] > 0 and s["stop_s_stop_the_world"] > 0, s
    (run,) = h["modes"]["concurrent"]["runs"]
    # The stop kept both read-only segments by recipe and compared the pre-copied one.
    assert run["concurrent"] and run["delta"]["read_only_kept"] == 2 and run["delta"]["pre_copied"] == 1, run
    # Where the stop went: the daemon's steps add up to no more than the stop; the snapshot's
    # own steps (`snapshot.*`) fit inside its `snapshot` step.
    steps = run["phases"]
    assert {"quiesce", "close", "snapshot", "record", "snapshot.criu_dump", "snapshot.hash_and_write"} <= set(steps), steps
    assert sum(v for k, v in steps.items() if not k.startswith("snapshot.")) <= run["stop_s"] + 0.01, run
    assert steps["snapshot.criu_dump"] + steps["snapshot.hash_and_write"] <= steps["snapshot"] + 0.01, steps
    assert set(s["stop_phases_s"]) == set(steps), s
    (stw,) = h["modes"]["stop-the-world"]["runs"]
    assert not stw["concurrent"] and stw["delta"] is None, stw
    m = json.loads(mig.read_text())
    ms = m["summary"]
    assert ms["identical"] is True and ms["client_error"] is None, ms
    assert 0 < ms["migration_downtime_s"] < 30 and ms["answers"] > 2, ms
    (one,) = m["runs"]
    assert (one["from"], one["to"]) == (0, 1) and one["daemon"]["segments"] == 3, one
    # Where the stop went, step by step (no driver on the CPU: no residue).
    phases = one["daemon"]["stop_phases"]
    assert phases["unmap_s"] > 0 and phases["map_s"] > 0 and phases["residue_checkpoint_s"] == 0, phases
    assert sum(phases.values()) <= one["daemon"]["stop_s"] + 0.01, one
    assert set(ms["stop_phases_median_s"]) == set(phases), ms


def test_the_readmes_table_is_what_the_json_says(tmp_path: Path) -> None:
    """The README's tables of issue 10 (concurrent snapshots and migrations; training with
    checkpoints) are rendered from bench/results by bench/concurrent/table.py: they may not
    drift from the files, and a changed figure in either is caught."""
    table = ROOT / "bench" / "concurrent" / "table.py"
    ok = subprocess.run([sys.executable, str(table), "--check", str(ROOT / "README.md")],
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text().replace("0.053 s (59 GB/s", "0.050 s (59 GB/s", 1))
    bad = subprocess.run([sys.executable, str(table), "--check", str(readme)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and "--readme" in bad.stderr, (bad.returncode, bad.stderr)
    readme.write_text((ROOT / "README.md").read_text().replace("| 58.2 it/s |", "| 60.0 it/s |", 1))
    bad = subprocess.run([sys.executable, str(table), "--check", str(readme)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1, (bad.returncode, bad.stderr)
