"""bench/sandbox/first_request.py's tables (it runs on a GPU only): docs/sandboxes.md quotes the
tables it renders from the JSONs in bench/results, so a JSON and the page cannot drift apart, and
a rendering that dropped a step or a variant is caught here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

PROBE = ROOT / "bench" / "sandbox" / "first_request.py"
RESULTS = ("sandbox-first-request-s32-h100.json", "sandbox-first-request-mem-s32-h100.json")


def render(path: Path) -> str:
    return subprocess.run([sys.executable, str(PROBE), "--table", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_docs_quote_the_tables_the_jsons_render() -> None:
    page = (ROOT / "docs" / "sandboxes.md").read_text()
    for name in RESULTS:
        table = render(ROOT / "bench" / "results" / name)
        assert table in page, f"docs/sandboxes.md does not quote `first_request.py --table {name}`:\n{table}"


def test_each_variant_has_a_first_and_a_later_row_with_every_step(tmp_path: Path) -> None:
    doc = json.loads((ROOT / "bench" / "results" / RESULTS[1]).read_text())
    # A variant that failed is a row of its own, not a missing one.
    doc["variants"].append({"variant": "eager", "error": "CUDA_ERROR_OUT_OF_MEMORY"})
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    rows = render(path).splitlines()
    steps = len(rows[0].split("|")) - 2
    body = rows[2:]
    assert all(len(r.split("|")) - 2 == steps for r in body), rows
    ok = [v for v in doc["variants"] if "error" not in v]
    assert len(body) == 2 * len(ok) + 1, rows
    assert body[-1].startswith("| eager | failed |"), rows
    # The first request of the pool as it was is slower than after the common kernels were loaded.
    first = {r.split("|")[1].strip(): float(r.split("|")[-2].split()[0]) for r in body if "| first |" in r}
    assert first["common"] < first["pool"], first
