"""bench/peers: the peer benchmark on the CPU with a tiny Llama (every peer path a real fresh
process running torch and transformers; the loaders that are installed; Torpor's modes skipped
with their reason), the JSON's schema, that the digests are compared (a differing one is
reported), the merge of parts, the table and chart, and the README's block against the H100
JSON."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import ROOT

PEERS = ROOT / "bench" / "peers"
CPU_JSON = ROOT / "bench" / "results" / "peers-cpu.json"
H100_JSON = ROOT / "bench" / "results" / "peers-h100.json"
MODES = [
    "scratch", "scratch-disk", "pool", "built-safetensors", "built-runai", "built-fastsafetensors",
    "built-disk", "transparent", "cold", "cold-disk", "standby",
]  # fmt: skip
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = load("run")
table = load("table")
merge = load("merge")


def check_schema(d: dict[str, Any]) -> None:
    """What every peers JSON holds, whichever machine made it."""
    assert d["benchmark"] == "peers"
    assert {"device", "driver", "kernel", "torpor_commit", "versions", "date"} <= set(d["machine"]), d["machine"]
    assert {"torch", "transformers", "safetensors", "runai-model-streamer", "fastsafetensors"} <= set(d["machine"]["versions"])
    for r in d["results"]:
        assert r["mode"] in MODES and r["model"] in run.MODELS, r
        assert isinstance(r["runs"], list)
        if r.get("skipped"):
            assert r["runs"] == [] and r["median"] is None and len(r["skipped"]) > 20, r
            continue
        for x in r["runs"]:
            assert x["wall_s"] > 0 and HEX64.match(x["digest"]), x
        assert r["wall_s"]["n"] == len(r["runs"]) and r["median"] == r["wall_s"]["median"], r
    s = d["summary"]
    assert set(s) >= {"medians", "digests_identical", "digests", "targets", "resident_idle", "skipped"}
    assert [(t["model"], t["mode"]) for t in s["targets"]] == [
        ("llama-8b", "cold"), ("llama-8b", "standby"), ("gpt2-large", "cold"), ("llama-8b", "cold-disk"),
    ]  # fmt: skip
    for model, medians in s["medians"].items():
        for mode, median in medians.items():
            assert median == next(r["median"] for r in d["results"] if r["model"] == model and r["mode"] == mode)


def test_the_cpu_smoke_run_measures_every_peer_path_with_one_digest(tmp_path: Path) -> None:
    for module in ("torch", "transformers", "safetensors"):
        # find_spec, not importorskip: torch is never imported into pytest's own process (the
        # SDK's packing tests skip once it is).
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the peer paths run {module}, which is not installed here (the GPU machine's image has it)")
    out = tmp_path / "peers.json"
    r = subprocess.run(
        [
            sys.executable, str(PEERS / "run.py"),
            "--models", "tiny-llama",
            "--modes", ",".join(run.PEER_MODES),
            "--runs", "1",
            "--device", "cpu",
            # The page cache of a shared machine is left alone: the *-disk rows say so.
            "--no-drop-cache",
            "--weights-dir", str(tmp_path / "weights"),
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    d = json.loads(out.read_text())
    check_schema(d)
    assert d["errors"] == [] and d["settings"]["device"] == "cpu"
    rows = {x["mode"]: x for x in d["results"]}
    assert list(rows) == [m for m in run.ORDER if m in run.PEER_MODES], list(rows)
    digests = set()
    for mode in run.PEER_MODES:
        row = rows[mode]
        if row.get("skipped"):
            # Only an optional loader that is not installed may skip, and it says how to get it.
            assert mode in ("built-runai", "built-fastsafetensors") and "not installed" in row["skipped"], row
            continue
        assert len(row["runs"]) == 1 and row["digests_identical"] is True, row
        digests.update(row["digests"])
        [x] = row["runs"]
        assert x["exit"] == 0 and x["answer"]["device"] == "cpu"
        if mode.startswith("scratch"):
            assert {"import", "context", "build", "load", "assign", "answer"} == set(x["phases"]), x
        else:
            # A kept process: idle before the request, measured from the outside.
            assert x["idle"]["host_rss_bytes"] > 100 << 20 and x["idle"]["gpu_bytes"] == 0, x["idle"]
            assert ("build" in x["phases"]) == (mode == "pool"), x["phases"]
        if mode.endswith("-disk"):
            assert x["page_cache_dropped"] is False and x["why"] == "--no-drop-cache", x
    assert len(digests) == 1, digests
    assert d["summary"]["digests_identical"] is True and d["summary"]["digests"]["tiny-llama"]["digests"] == sorted(digests)
    idle = d["summary"]["resident_idle"]["tiny-llama"]
    assert idle["scratch"]["host_bytes"] == 0 and idle["pool"]["host_bytes"] > 100 << 20, idle
    assert rows["scratch"]["loader"] == rows["pool"]["loader"] == rows["built-disk"]["loader"]
    assert "fastest built-* median" in rows["scratch"]["loader_choice"]
    text = table.headline(d)
    assert "| from scratch (exec → first answer), best loader, page cache warm | " in text and "identical on every path" in text


def test_torpors_modes_on_the_cpu_answer_what_the_peers_answer(torpor_bin: Path, criu_ready: None, tmp_path: Path) -> None:
    """tiny-llama through torpord (bench/coldstart/functions/tiny-llama: the llama-8b function's
    code on the CPU), transparent, cold, standby and cold from disk, beside a pre-built peer, in
    one run: the same digest on every path, and what the node keeps while idle."""
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    for module in ("torch", "transformers", "safetensors"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the function runs {module}, which is not installed here (the GPU machine's image has it)")
    out = tmp_path / "peers.json"
    # The daemons' sockets live in the work dir: pytest's tmp_path may be too long for them.
    work = Path(tempfile.mkdtemp(prefix="peers-", dir="/tmp"))
    # The functions' `python = "python3"` is this interpreter.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    r = subprocess.run(
        [
            sys.executable, str(PEERS / "run.py"),
            "--models", "tiny-llama",
            "--modes", "built-safetensors,transparent,cold,standby,cold-disk",
            "--runs", "1",
            "--device", "cpu",
            "--no-drop-cache",
            "--torpor", str(torpor_bin),
            "--work-dir", str(work),
            "--weights-dir", str(tmp_path / "weights"),
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=600, check=False, env=env,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}\n(work dir kept: {work})"
    d = json.loads(out.read_text())
    check_schema(d)
    rows = {x["mode"]: x for x in d["results"]}
    assert list(rows) == ["built-safetensors", "transparent", "cold", "standby", "cold-disk"], list(rows)
    for mode, row in rows.items():
        assert len(row["runs"]) == 1 and not row.get("skipped") and not row.get("error"), row
    # One digest across the peer and every Torpor path.
    assert d["summary"]["digests_identical"] is True and len(d["summary"]["digests"]["tiny-llama"]["digests"]) == 1
    assert [rows[m]["runs"][0]["start"] for m in ("transparent", "cold", "standby", "cold-disk")] == ["restored", "restored", "standby", "restored"]
    assert rows["cold-disk"]["runs"][0]["page_cache_dropped"] is False and rows["cold-disk"]["runs"][0]["why"] == "--no-drop-cache"
    assert rows["transparent"]["torpor"]["daemon_config"] == {"split": False}
    idle = d["summary"]["resident_idle"]["tiny-llama"]
    # A CPU function's standby is a whole restored process: its memory shows.
    assert idle["standby"]["standby_host_bytes"] > 10 << 20 and idle["cold"]["standby_host_bytes"] == 0, idle
    assert idle["cold"]["host_bytes"] > 10 << 20 and "torpord" in idle["cold"]["what"], idle
    assert set(d["torpor"]["deploys"]) == {"transparent", "split"} and d["torpor"]["errors"] == []
    assert not work.exists() or not any(work.iterdir()), "the work dir is removed after a run without errors"
    shutil.rmtree(work, ignore_errors=True)


def test_the_committed_cpu_run_has_the_schema_and_its_table_renders(tmp_path: Path) -> None:
    d = json.loads(CPU_JSON.read_text())
    check_schema(d)
    assert d["summary"]["digests_identical"] is True
    text = table.render(d)
    for mode in ("pool", "built-safetensors", "built-disk", "standby"):
        assert table.MODE_NAMES[mode] in text
    assert "DIFFER" not in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "peers.png"
    table.chart(d, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_differing_digest_is_reported_not_hidden() -> None:
    d = copy.deepcopy(json.loads(CPU_JSON.read_text()))
    row = next(r for r in d["results"] if r["mode"] == "built-safetensors" and r["runs"])
    row["runs"][0]["digest"] = "0" * 64
    run.finish_row(row)
    d["summary"] = run.make_summary(d["results"])
    assert row["digests_identical"] is (len(row["runs"]) == 1)
    assert d["summary"]["digests_identical"] is False
    assert d["summary"]["digests"][row["model"]]["identical"] is False
    assert "**DIFFER**" in table.headline(d)


def test_targets_say_met_missed_or_not_measured() -> None:
    medians = {"llama-8b": {"cold": 0.5, "standby": 0.3, "built-disk": 9.0, "cold-disk": 4.5}, "gpt2-large": {}}
    got = {(t["model"], t["mode"]): t for t in run.targets(medians)}
    assert got[("llama-8b", "cold")]["met"] is True
    assert got[("llama-8b", "standby")]["met"] is False and got[("llama-8b", "standby")]["by"] == 1.5
    assert got[("gpt2-large", "cold")]["met"] is None
    # cold-disk against a third of built-disk in the same run.
    assert got[("llama-8b", "cold-disk")]["limit_s"] == 3.0 and got[("llama-8b", "cold-disk")]["met"] is False


def test_parts_of_one_run_merge_and_parts_of_two_binaries_are_refused() -> None:
    d = json.loads(CPU_JSON.read_text())
    a = {**d, "results": [r for r in d["results"] if r["mode"] in ("scratch", "pool")]}
    b = {**d, "results": [r for r in d["results"] if r["mode"] in ("built-safetensors", "built-disk")]}
    merged = merge.merge([b, a])
    modes = [r["mode"] for r in merged["results"] if r["model"] == d["results"][0]["model"]]
    assert modes == ["built-safetensors", "scratch", "pool", "built-disk"], modes
    assert merged["settings"]["merged_from"] == 2
    assert merged["summary"]["medians"] == run.make_summary(merged["results"])["medians"]
    assert merged["summary"]["digests_identical"] is True
    other = {**b, "machine": {**b["machine"], "torpor_commit": "0" * 40}}
    with pytest.raises(merge.MergeError, match="one machine and one binary"):
        merge.merge([a, other])


def test_the_readme_holds_the_rendered_peer_table_or_says_it_is_not_measured() -> None:
    """The README's peers block is table.py's rendering of the H100 JSON, never typed by hand;
    while that JSON does not exist, the block says so instead of quoting numbers."""
    text = (ROOT / "README.md").read_text()
    assert table.BEGIN in text and table.END in text, "the README lost its peers block"
    block = text.split(table.BEGIN, 1)[1].split(table.END, 1)[0]
    if not H100_JSON.is_file():
        # No table: not one measured row quoted.
        assert "Not measured yet" in block and "|" not in block, block
        return
    d = json.loads(H100_JSON.read_text())
    check_schema(d)
    assert {r["model"] for r in d["results"]} == {"gpt2-large", "llama-8b"}
    assert table.readme_block(d) in text, "re-render it: python3 bench/peers/table.py --readme README.md bench/results/peers-h100.json"


def test_torpor_idle_cost_adds_the_daemon_its_stage_area_and_the_standby() -> None:
    """split.py --idle's record of a standby mode (the shape its CPU smoke test checks) as the
    summary's resident figure: host = the daemon's RSS + the stage tmpfs + the standby's memory;
    GPU = the daemon's NVML figure, at least the GPU cache, + the standby's."""
    idle = {
        "metrics": {
            'torpor_restore_cache_bytes{cache="gpu"}': 16e9,
            'torpor_restore_cache_bytes{cache="host"}': 16e9,
            "torpor_stage_bytes": 1.5e9,
            'torpor_standby_host_memory_bytes{function="llama-8b-standby"}': 2e9,
            'torpor_standby_gpu_memory_bytes{function="llama-8b-standby"}': 0.5e9,
        },
        "daemon_rss_bytes": int(16.2e9),
        "daemon_gpu_bytes": int(0.6e9),  # only its context: the cache is counted from its gauge
    }
    cost = run.resident({"model": "llama-8b", "mode": "standby", "runs": [{}], "idle": idle})
    assert cost["host_bytes"] == int(16.2e9 + 1.5e9 + 2e9) and cost["gpu_bytes"] == int(16e9 + 0.5e9), cost
    assert cost["standby_host_bytes"] == int(2e9) and "standby" in cost["what"]
    assert run.resident({"model": "llama-8b", "mode": "cold", "runs": [], "idle": idle}) is None
    assert run.resident({"model": "x", "mode": "scratch", "runs": [{}]})["host_bytes"] == 0


def test_a_missing_loader_makes_a_skipped_row_that_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "runai_model_streamer" else real(name, *a))
    why = run.loaders.missing("runai")
    assert why is not None and "runai-model-streamer==0.16.1" in why and "make gpu-carry" in why, why
    bench = run.Bench(run.parse_args(["--models", "tiny-llama", "--device", "cpu", "--weights-dir", str(tmp_path), "--out", str(tmp_path / "p.json")]))
    row = run.finish_row(bench.peer_row("tiny-llama", "built-runai"))
    assert row["skipped"] == why and row["runs"] == [] and row["median"] is None, row
    # Never silently dropped: the summary lists it, the table shows it.
    assert run.make_summary([row])["skipped"] == {"tiny-llama/built-runai": why}
    doc = {**json.loads(CPU_JSON.read_text()), "results": [row]}
    assert "| … Run:ai Model Streamer (`SafetensorsStreamer`) | skipped |" in table.headline(doc)
    assert not (tmp_path / "tiny-llama.safetensors").exists(), "a skipped mode writes no weights"


def test_the_per_size_phase_table_in_docs_is_the_rendering_of_the_h100_jsons() -> None:
    """docs/split.md's per-size breakdown (issue 18) is bench/peers/phases.py's output, never typed."""
    results = ROOT / "bench" / "results"
    # The merged run (0.8 B and 8 B) and the same binary's 3 B part (issue 18: at least three sizes).
    parts = [results / "peers-h100.json", results / "peers-s24-e-h100.json"]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not measured yet (docs/gpu-machine.md, 'The peer benchmark')")
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    import phases

    table = phases.render([json.loads(p.read_text()) for p in parts])
    assert all(f"| {m} | cold |" in table for m in ("gpt2-large", "llama-3b", "llama-8b")), table
    assert table in (ROOT / "docs" / "split.md").read_text(), "re-render docs/split.md's per-size table (bench/peers/phases.py)"
