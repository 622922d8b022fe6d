"""The sandbox probes without a GPU: their arguments, and what their kept H100 runs say.

bench/sandbox/release_probe.py (docs/sandboxes.md, "The GPU release of a sandbox": a plain
process's `empty_cache()` waits for the driver's restore instead of crashing) and
bench/sandbox/gil_probe.py ("Why overlapping requests are slower in a sandbox": its table as the
docs quote it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


def test_the_docs_quote_the_gil_probe_as_its_table_renders_it() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sandbox" / "gil_probe.py"), "--table",
         str(ROOT / "bench" / "results" / "sandbox-gil-probe-h100.json")],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert r.stdout.strip() and r.stdout.strip() in (ROOT / "docs" / "sandboxes.md").read_text()


def test_an_unknown_gil_probe_mode_is_one_line_naming_the_choices() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sandbox" / "gil_probe.py"), "--modes", "threads-3"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "unknown mode 'threads-3'" in line and "threads-4-graphs" in line, line


def test_a_hook_variant_without_the_hook_library_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORPOR_HOOK_LIB", raising=False)
    r = subprocess.run(
        [sys.executable, str(PROBE), "--variants", "hook-free-while-checkpointed"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "needs TORPOR_HOOK_LIB" in line, line
