"""The sandbox probes without a GPU: their arguments, and what their kept H100 runs say.

bench/sandbox/release_probe.py (docs/sandboxes.md, "The GPU release of a sandbox": a plain
process's `empty_cache()` waits for the driver's restore instead of crashing) and
bench/sandbox/gil_probe.py ("Why overlapping requests are slower in a sandbox": its table as the
docs quote it), bench/sandbox/placed_pointer_probe.py ("On a node of several GPUs": the driver's
ordinal for VMM memory in a process restored onto GPU 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


PLACED = ROOT / "bench" / "sandbox" / "placed_pointer_probe.py"


def test_the_placed_pointer_probe_without_a_binary_is_one_line_naming_it(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(PLACED), "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, check=False, timeout=60,
        env={**os.environ, "TORPOR_BIN": str(tmp_path / "none")},
    )
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "no torpor binary at" in line and "TORPOR_BIN" in line, line
    assert not (tmp_path / "out.json").exists()


def test_the_kept_placed_pointer_run_is_what_the_docs_say() -> None:
    """docs/sandboxes.md, "On a node of several GPUs": restored onto GPU 1, the process's GPUs
    0 and 1 swapped, the driver gave the node's ordinal (1) for VMM memory on the process's 0;
    torch through DLPack used it on cuda:0, through the array interface it failed."""
    doc = json.loads((ROOT / "bench" / "results" / "placed-pointer-s54-h200x2.json").read_text())
    assert "H200" in doc["machine"]["gpus"] and "580.159.04" in doc["machine"]["gpus"]
    before, after = doc["before"], doc["after"]
    assert after["uuids"] == before["uuids"][::-1], (before["uuids"], after["uuids"])
    assert after["torch_allocation_pointer_ordinal"] == [0, 0]
    assert after["vmm_pointer_ordinal"] == [0, 1]
    assert after["dlpack_cuda0"].startswith("cuda:0 sum="), after
    assert after["array_interface_to_cuda"].startswith("error:"), after
    page = (ROOT / "docs" / "sandboxes.md").read_text()
    assert "placed-pointer" in (ROOT / "docs" / "gpu-machine.md").read_text()
    assert "`cuPointerGetAttribute(DEVICE_ORDINAL)` gave 1" in page
