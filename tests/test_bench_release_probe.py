"""bench/sandbox/release_probe.py without a GPU: its arguments, and what its kept H100 run says
(docs/sandboxes.md, "The GPU release of a sandbox": a plain process's `empty_cache()` waits for
the driver's restore instead of crashing)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = ROOT / "bench" / "sandbox" / "release_probe.py"


def test_an_unknown_variant_is_one_line_naming_the_choices() -> None:
    r = subprocess.run(
        [sys.executable, str(PROBE), "--variants", "main,nope"], capture_output=True, text=True, check=False, timeout=60
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "unknown variant 'nope'" in line and "free-while-checkpointed" in line, line


def test_the_kept_run_freed_after_the_restore_and_every_variant_survived() -> None:
    doc = json.loads((ROOT / "bench" / "results" / "sandbox-release-probe-s35-h100.json").read_text())
    assert doc["machine"]["gpu"].startswith("NVIDIA H100") and all(doc["summary"].values()), doc["summary"]
    (free,) = [r for r in doc["results"] if r["variant"] == "free-while-checkpointed"]
    for cycle in free["cycles"]:
        assert cycle["free_answer_while_checkpointed"] is None, cycle
        assert cycle["free_answer_after_restore"] == "freed", cycle
