"""bench/results/reliability.json (bench/reliability/run.py) has what issue 13 asks for, and the
README's and docs/reliability.md's tables are bench/reliability/table.py's rendering of it, never
typed by hand: a change to either shows here. Reads files only (milliseconds)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

JSON = ROOT / "bench/results/reliability.json"


def test_the_report_has_every_fault_and_the_totals() -> None:
    doc = json.loads(JSON.read_text())
    assert {"machine", "settings", "faults", "fuzz", "load", "summary"} <= set(doc)
    assert doc["machine"]["commit"] and doc["machine"]["torpor"].startswith("torpor ")
    for name, f in doc["faults"].items():
        assert f["runs"] == len(f["every_run"]) >= 1, name
        for key in ("harmed_sources", "invalid_snapshots_accepted", "lost_requests"):
            assert f[key] == sum(r[key] for r in f["every_run"]), (name, key)
    s = doc["summary"]
    for key in ("harmed_sources", "invalid_snapshots_accepted", "lost_requests"):
        assert isinstance(s[key], int), key
    assert s["runs"] == sum(f["runs"] for f in doc["faults"].values())
    assert s["fuzz_executions"] == doc["fuzz"]["executions"] > 0
    # The load runs whose clients retry with Idempotency-Keys count; the run without keys is the
    # baseline, apart.
    keyed = [v for v in doc["load"].values() if v["idempotency_keys"]]
    assert keyed, "no load run with Idempotency-Keys: run bench/reliability/load.py"
    assert s["lost_requests"] == s["lost_requests_under_faults"] + sum(v["lost_requests"] for v in keyed)
    assert s["lost_requests_without_keys"] == sum(
        v["lost_requests"] for v in doc["load"].values() if not v["idempotency_keys"]
    )


def test_the_readme_and_the_doc_quote_the_rendered_table() -> None:
    r = subprocess.run(
        [sys.executable, ROOT / "bench/reliability/table.py", JSON], capture_output=True, text=True, check=True
    )
    table = r.stdout.strip()
    assert "summary: runs" in table
    assert table in (ROOT / "README.md").read_text(), "re-render the README's reliability table"
    assert table in (ROOT / "docs/reliability.md").read_text(), "re-render docs/reliability.md's table"
