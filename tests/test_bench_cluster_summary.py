"""bench/cluster/summary.py: the summary is assembled from its three sources as they are, the
targets are judged from the values, and the README's table is the rendering of the JSON kept in
bench/results/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

spec = importlib.util.spec_from_file_location("cluster_summary", ROOT / "bench" / "cluster" / "summary.py")
assert spec and spec.loader
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


def test_assemble_takes_each_figure_from_its_source_and_judges_the_targets() -> None:
    kill = {"requests": 40, "lost_requests": 1, "lost_ids": ["r3"], "duplicated_on_survivors": 0,
            "rerun_after_node_death": 2, "served_by": {}, "attempts_over_1": 3, "wall_s": 5.0}
    sim = {"summary": {"burst_p99_ratio": 2.9, "link_gbps": 25.0, "p99_s": 4.0, "one_cold_start_s": 1.38,
                       "random_burst_p99_ratio": 6.0}}
    pull = {"model": "gpt2-large", "machine": {"gpus": [{"name": "NVIDIA H100"}]},
            "summary": {"pull_efficiency": 0.85, "pull_gbps": 1.7, "transfer_gbps": 2.0}}
    doc = summary.assemble(kill, "k.json", sim, "s.json", pull, "p.json")
    assert doc["summary"] == {"lost_requests": 1, "burst_p99_ratio": 2.9, "pull_efficiency": 0.85}
    assert doc["meets"] == {"lost_requests": False, "burst_p99_ratio": True, "pull_efficiency": True,
                            "first_start": False}
    assert doc["sources"]["pull_efficiency"]["machine"] == "NVIDIA H100"
    assert "lost_ids" not in doc["sources"]["lost_requests"]
    text = summary.table(doc)
    assert "| `lost_requests` | 1 of 40 | 0 | **missed** |" in text, text
    assert "| `pull_efficiency` | 0.85 | ≥ 0.8 | met |" in text, text
    assert "first start" not in text, "no row without the pull's first-start figures"
    # The first start of a function new to the node, judged as pull.py judged it.
    pull["summary"].update(first_start_s=2.68, target_first_start_s=3.1, first_start_within_target=True,
                           pull_s=1.9, restore_to_first_answer_s=0.78, cold_start_s=2.62, pulled_bytes=3_099_000_000)
    doc = summary.assemble(kill, "k.json", sim, "s.json", pull, "p.json")
    assert doc["meets"]["first_start"] is True
    assert "| first start, function new to the node | 2.68 s | ≤ 3.1 s | met | pull 1.9 s + restore 0.78 s; the " \
        "target is its local cold start 2.62 s + 3.1 GB at 80 % of the raw GET (`p.json`) |" in summary.table(doc)
    # A simulation with the instances' figure (late binding) has it beside the requests' p99.
    assert "instances up" not in text
    sim["summary"]["instance_up_p99_ratio"] = 3.4
    doc = summary.assemble(kill, "k.json", sim, "s.json", pull, "p.json")
    assert doc["sources"]["burst_p99_ratio"]["instance_up_p99_ratio"] == 3.4
    assert "request p99 4.0 s ÷ 1.38 s; instances up p99 3.4× (random placement: 6.0;" in summary.table(doc)
    # ... and, once the simulator models torpord's refusals, those and the starts made.
    sim["summary"].update(refusals_429=250.5, queue_timeouts_503=0.0, starts_made=133.0)
    doc = summary.assemble(kill, "k.json", sim, "s.json", pull, "p.json")
    assert doc["sources"]["burst_p99_ratio"]["refusals_429"] == 250.5
    assert "instances up p99 3.4×; per run 133.0 starts, 250.5 429s (sent again elsewhere), 0.0 503s (random" in \
        summary.table(doc)


def test_the_readme_table_is_the_rendering_of_the_kept_json() -> None:
    kept = ROOT / "bench" / "results" / "cluster-summary.json"
    doc = json.loads(kept.read_text())
    assert set(doc["summary"]) == {"lost_requests", "burst_p99_ratio", "pull_efficiency"}
    # Each figure is its source file's.
    for key in ("burst_p99_ratio", "pull_efficiency"):
        src = json.loads((ROOT / doc["sources"][key]["file"]).read_text())
        assert src["summary"][key] == doc["summary"][key], key
    kill = json.loads((ROOT / doc["sources"]["lost_requests"]["file"]).read_text())
    assert kill["lost_requests"] == doc["summary"]["lost_requests"]
    r = subprocess.run([sys.executable, str(ROOT / "bench/cluster/summary.py"), "--table", str(kept)],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() in (ROOT / "README.md").read_text(), "re-render the README's cluster table"


def test_bad_arguments_are_one_usage_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "bench/cluster/summary.py"), "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "give --out, --pull and one of --kill FILE or --run-kill" in r.stderr, r.stderr


def test_readme_writing_replaces_only_the_table(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("intro\n\n| figure | value | target | | where from |\n|---|---|---|---|---|\n| old | 1 |\n\nafter\n")
    summary.write_readme("| figure | value | target | | where from |\n|---|---|---|---|---|\n| new | 2 |\n", readme)
    assert readme.read_text() == "intro\n\n| figure | value | target | | where from |\n|---|---|---|---|---|\n| new | 2 |\n\nafter\n"


def test_the_links_table_is_the_rendering_of_each_links_figures() -> None:
    pull = {"model": "gpt2-large", "parallel": 16, "machine": {"gpus": [{"name": "NVIDIA H200"}]}, "summary": {"by_link": {
        "veth": {"runs": 3, "transfer_gbps": 7.0, "pull_gbps": 2.1, "pull_efficiency": 0.3, "daemon_cores_busy": 7.0,
                 "first_start_s": 2.2, "target_first_start_s": 2.6},
        "10 Gbit/s": {"runs": 2, "transfer_gbps": 1.2, "pull_gbps": 1.08, "pull_efficiency": 0.9, "daemon_cores_busy": 3.0,
                      "first_start_s": 4.0, "target_first_start_s": 5.6}}}}
    rows = summary.links_table([(pull, "f.json"), (pull | {"parallel": 32}, "g.json")]).splitlines()
    assert rows[2] == ("| veth, unshaped | 16 | 7.0 GB/s | 2.1 GB/s | 0.3: **missed** | 7.0 | 2.2 s | 2.6 s | "
                       "`f.json` (gpt2-large, NVIDIA H200, 3 runs) |"), rows
    assert rows[3].startswith("| 10 Gbit/s | 16 | 1.2 GB/s | 1.08 GB/s | 0.9: met | 3.0 | 4.0 s | 5.6 s |"), rows
    assert len(rows) == 6 and rows[5].startswith("| 10 Gbit/s | 32 |") and rows[5].endswith("`g.json` (gpt2-large, NVIDIA H200, 2 runs) |"), rows


def test_the_readme_links_table_is_the_rendering_of_the_kept_json() -> None:
    kept = [ROOT / "bench" / "results" / f"cluster-pull-s46-{n}-h200.json" for n in ("links", "links-p32", "links25-p32", "ab-p16", "ab-p32")]
    for f in kept:
        doc = json.loads(f.read_text())
        # Per link, the pull against the raw GET over that same link.
        for name, b in doc["summary"]["by_link"].items():
            assert b["pull_efficiency"] == round(b["pull_gbps"] / doc["by_link"][name]["transfer"]["transfer_gbps"], 3), name
    r = subprocess.run([sys.executable, str(ROOT / "bench/cluster/summary.py"), "--links-table", *map(str, kept)],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() in (ROOT / "README.md").read_text(), "re-render the README's links table"
