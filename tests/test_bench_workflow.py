"""bench/sandbox/workflow.py, the workflow's end-to-end latency with the communication store
against JSON (issue 11), run on the CPU with a real torpord, real CRIU and real workers: both
workflows answer the same sums, the store's ran in one sandbox and JSON's across processes (the
bench checks both on every run and fails otherwise), and the summary is the runs' medians."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
from conftest import ROOT


def test_the_cpu_run_times_both_ways_with_the_same_answers(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    out = tmp_path / "workflow.json"
    r = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "sandbox" / "workflow.py"),
            "--cpu", "--sizes-kib", "16,256", "--runs", "2", "--torpor", str(torpor_bin), "--out", str(out),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-4000:]}"
    d = json.loads(out.read_text())
    s = d["summary"]
    assert d["settings"]["sizes_kib"] == [16, 256] and s["identical"] is True
    assert {"commit", "kernel", "numpy"} <= set(d["machine"])
    for row in d["results"]:
        k = str(row["size_kib"])
        assert len(row["store"]) == len(row["json"]) == 2
        for a, b in zip(row["store"], row["json"], strict=True):
            assert a["sum"] == b["sum"] and a["floats"] == b["floats"] == row["floats"]
            assert a["timings"]["sandbox"] == 1.0 and b["timings"]["sandbox"] == 0.0
            # Each stage's own time is in the timings, under its function's name.
            assert {f"stage:wf-store-{st}" for st in ("make", "scale", "reduce")} <= set(a["timings"])
        store_ms = median(x["wall_s"] for x in row["store"]) * 1e3
        json_ms = median(x["wall_s"] for x in row["json"]) * 1e3
        assert s["workflow_store_ms"][k] == round(store_ms, 3) and s["workflow_json_ms"][k] == round(json_ms, 3)
        assert s["json_over_store"][k] == round(json_ms / store_ms, 2)


def test_the_docs_quote_the_table_the_jsons_render() -> None:
    results = ROOT / "bench" / "results"
    names = ("sandbox-workflow-s45-h200.json", "sandbox-workflow-cpu.json")
    rendered = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sandbox" / "workflow.py"), "--table", *(str(results / n) for n in names)],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert rendered in (ROOT / "docs" / "sandboxes.md").read_text(), f"docs/sandboxes.md does not quote:\n{rendered}"
