"""The hand-off tables (bench/sandbox/handoff_table.py, bench/sandbox/vmm_steps.py --table,
bench/sandbox/vmm_contention.py --table) and the memory ratio against the functions' size
(bench/sandbox/memory_table.py; all measured on a GPU only): docs/sandboxes.md quotes
what they render from the JSONs in bench/results, so a JSON and the page cannot drift apart; a
run without steps renders as such, not as zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

BENCH = ROOT / "bench" / "sandbox"
RESULTS = ROOT / "bench" / "results"
HANDOFFS = ("sandbox-handoff-s33-before-h100.json", "sandbox-handoff-s33-after-h100.json")
# Session 34's A/B, run in this order in one call.
HANDOFFS_S34 = tuple(f"sandbox-handoff-s34-{n}-h100.json" for n in ("before1", "after1", "before2", "after2"))
# Session 37's two A/Bs (kept mappings, then leases as well), each run in this order in one call.
HANDOFFS_S37 = tuple(
    tuple(f"sandbox-handoff-s37-{what}-{n}-h100.json" for n in ("before1", "after1", "before2", "after2"))
    for what in ("kept", "lease")
)
# Its requests timed apart (with the trial of a spinning wait between the two runs).
HANDOFFS_S34_REQUESTS = tuple(f"sandbox-handoff-s34-{n}-h100.json" for n in ("requests", "trial-spin", "requests2"))


def run(*args: str) -> str:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True).stdout.strip()


def test_the_docs_quote_the_tables_the_jsons_render() -> None:
    page = (ROOT / "docs" / "sandboxes.md").read_text()
    handoffs = run(str(BENCH / "handoff_table.py"), *(str(RESULTS / n) for n in HANDOFFS))
    assert handoffs in page, f"docs/sandboxes.md does not quote `handoff_table.py {' '.join(HANDOFFS)}`:\n{handoffs}"
    s34 = run(str(BENCH / "handoff_table.py"), *(str(RESULTS / n) for n in HANDOFFS_S34))
    assert s34 in page, f"docs/sandboxes.md does not quote `handoff_table.py {' '.join(HANDOFFS_S34)}`:\n{s34}"
    parts = run(str(BENCH / "handoff_table.py"), *(str(RESULTS / n) for n in HANDOFFS_S34_REQUESTS))
    assert parts in page, f"docs/sandboxes.md does not quote `handoff_table.py {' '.join(HANDOFFS_S34_REQUESTS)}`:\n{parts}"
    for names in HANDOFFS_S37:
        s37 = run(str(BENCH / "handoff_table.py"), *(str(RESULTS / n) for n in names))
        assert s37 in page, f"docs/sandboxes.md does not quote `handoff_table.py {' '.join(names)}`:\n{s37}"
    vmm = run(str(BENCH / "vmm_steps.py"), "--table", str(RESULTS / "sandbox-vmm-steps-h100.json"))
    assert vmm in page, f"docs/sandboxes.md does not quote `vmm_steps.py --table`:\n{vmm}"
    contention = run(str(BENCH / "vmm_contention.py"), "--table", str(RESULTS / "sandbox-vmm-contention-h100.json"))
    assert contention in page, f"docs/sandboxes.md does not quote `vmm_contention.py --table`:\n{contention}"


def test_the_docs_quote_the_memory_ratio_against_the_functions_size_as_rendered() -> None:
    page = (ROOT / "docs" / "sandboxes.md").read_text()
    s37 = ("sandbox-s37-w16-h100.json", "sandbox-s37-w32-h100.json", "sandbox-s33-h100.json")
    # Session 38: before the lanes, with them (16 MiB functions); then 64 MiB, before and with.
    s38 = (
        "sandbox-s38-before-w16-h100.json", "sandbox-s38-lanes-w16-h100.json",
        "sandbox-s33-h100.json", "sandbox-s38-lanes-w64-h100.json",
    )
    for names in (s37, s38):
        rendered = run(str(BENCH / "memory_table.py"), *(str(RESULTS / n) for n in names))
        assert rendered in page, rendered
        # Each row is its file's: the 16 MiB run's ratio as its summary says.
        doc = json.loads((RESULTS / names[0]).read_text())
        assert f"| 16 MiB | 3 808 MiB | 778 MiB | {doc['summary']['memory_ratio_8fn']:.2f} |" in rendered
    probe = run(str(BENCH / "handle_cost.py"), "--table", str(RESULTS / "sandbox-handle-cost-s38-torchstream-h100.json"))
    assert probe in page, probe


def test_every_step_has_a_row_and_a_missing_one_is_not_a_zero(tmp_path: Path) -> None:
    doc = json.loads((RESULTS / HANDOFFS[1]).read_text())
    for r in doc["sandbox"]["handoff"]["other_sandbox_gpu"]:
        r["put_steps"].pop("copy")
    path = tmp_path / "handoff.json"
    path.write_text(json.dumps(doc))
    rows = run(str(BENCH / "handoff_table.py"), str(path)).splitlines()
    steps = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in rows[2:]}
    assert steps["put: copy"] == "–", rows
    assert all(f"put: {s}" in steps for s in ("put_request", "import", "set_access", "unmap", "close_fd", "written_request"))
    assert all(f"get: {s}" in steps for s in ("get_request", "import", "set_access", "tensor", "close_fd"))
    # The after side is the faster: what the table is for.
    both = run(str(BENCH / "handoff_table.py"), *(str(RESULTS / n) for n in HANDOFFS)).splitlines()
    best = next(r for r in both if r.startswith("| put + get, best |")).split("|")[2:4]
    assert float(best[1]) < float(best[0]), both


def test_the_readmes_table_of_issue_11_is_what_the_json_says(tmp_path: Path) -> None:
    """The README's table of issue 11 is rendered from bench/results by bench/sandbox/table.py:
    it may not drift from the files, and a figure changed in the README is caught."""
    table = BENCH / "table.py"
    ok = subprocess.run([sys.executable, str(table), "--check", str(ROOT / "README.md")],
                        capture_output=True, text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text().replace("| 6.24 (6.41 idle", "| 6.42 (6.41 idle", 1))
    bad = subprocess.run([sys.executable, str(table), "--check", str(readme)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and "--readme" in bad.stderr, (bad.returncode, bad.stderr)
