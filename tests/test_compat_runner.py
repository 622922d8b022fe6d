"""tests/compat/run.py on this machine: the programs that need no GPU restore identically, the
GPU ones are reported as skipped (not passed), and the JSON has the summary the GPU run fills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, Torpor


def test_compat_runner_restores_the_cpu_program_and_skips_gpu_ones(
    torpor: Torpor, criu_ready: None, tmp_path: Path
) -> None:
    out = tmp_path / "compat.json"
    r = subprocess.run(
        [sys.executable, ROOT / "tests/compat/run.py", "--only", "cpu_pool_http,dataloader_workers",
         "--no-functions", "--out", out],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "TORPOR_BIN": str(torpor.binary)},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    rows = {p["program"]: p for p in doc["programs"]}
    cpu = rows["cpu_pool_http"]
    assert cpu["outcome"] == "restored_identical", cpu
    assert cpu["before"] == cpu["after"] and cpu["before"].startswith("ok 200:"), cpu
    gpu = rows["dataloader_workers"]
    if not Path("/dev/nvidiactl").exists():
        assert gpu["outcome"] == "skipped", gpu
    s = doc["summary"]
    assert set(s) >= {"programs", "restored_identical", "refused_cleanly", "unhandled", "harmed_sources",
                      "deployable_functions"}  # fmt: skip
    assert s["unhandled"] == 0 and s["harmed_sources"] == 0, s


def test_the_committed_gpu_results_render_as_the_readme_quotes_them() -> None:
    """The README's compatibility table is tests/compat/table.py's rendering of the JSON in
    bench/results, not typed by hand: a change to either shows here."""
    r = subprocess.run(
        [sys.executable, ROOT / "tests/compat/table.py", ROOT / "bench/results/compat-h100.json"],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads((ROOT / "bench/results/compat-h100.json").read_text())["summary"]
    assert f"programs {summary['programs']}" in r.stdout
    assert r.stdout.strip() in (ROOT / "README.md").read_text(), "re-render the README's compat table"
