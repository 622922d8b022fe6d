"""The cluster's placement rule (torpor.cluster.placement) and the simulator that runs it at scale
(bench/cluster/simulate.py). Pure Python: no Ray, no daemon. The rule is the one the ingress
calls; tests/test_cluster.py runs it on a real cluster."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import ROOT
from torpor.cluster.placement import Costs, FunctionNeeds, NodeView, StartKind, place, place_random

FN = FunctionNeeds("f", gpu_bytes=4 * 2**30, snapshot_bytes=2 * 10**9)


def load_simulator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cluster_simulate", ROOT / "bench" / "cluster" / "simulate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_warm_first_then_staged_then_local_then_pull() -> None:
    nodes = [
        NodeView("a", in_bucket=True),
        NodeView("b", local_snapshot=True, in_bucket=True),
        NodeView("c", staged=True, local_snapshot=True, in_bucket=True),
        NodeView("d", warm_idle=1, local_snapshot=True, in_bucket=True),
    ]
    assert place(FN, nodes, Costs()) == place(FN, nodes, Costs())  # pure
    order = []
    for _ in range(4):
        p = place(FN, nodes, Costs(), exclude=order)
        assert p is not None
        order.append(p.node)
    assert order == ["d", "c", "b", "a"]
    assert place(FN, nodes, Costs(), exclude=order) is None


def test_gpu_memory_dead_nodes_and_no_snapshot_are_never_chosen() -> None:
    small = NodeView("small", staged=True, gpu_free_bytes=2**30)
    dead = NodeView("dead", staged=True, alive=False)
    nothing = NodeView("nothing", gpu_free_bytes=80 * 2**30)
    far = NodeView("far", in_bucket=True, gpu_free_bytes=80 * 2**30)
    p = place(FN, [small, dead, nothing, far], Costs())
    assert p is not None and (p.node, p.kind) == ("far", StartKind.PULL)
    # A warm instance already holds its GPU memory.
    warm = NodeView("warm", warm_idle=1, gpu_free_bytes=0)
    p = place(FN, [warm, far], Costs())
    assert p is not None and (p.node, p.kind) == ("warm", StartKind.WARM)
    assert place(FN, [small, dead, nothing], Costs()) is None


def test_a_burst_spreads_as_starts_pile_up() -> None:
    """Each start placed on a node makes it slower for the next: a staged node takes a few,
    then local copies, then pulls; a big pull backlog pushes the next pull elsewhere."""
    costs = Costs(restore_staged_s=1.0, restore_local_extra_s=0.3, link_bytes_per_s=1e9, start_contention_s=0.2)
    starting = {"s": 0, "l": 0, "p": 0}
    chosen = []
    for _ in range(20):
        views = [
            NodeView("s", staged=True, in_bucket=True, starting=starting["s"]),
            NodeView("l", local_snapshot=True, in_bucket=True, starting=starting["l"]),
            NodeView("p", in_bucket=True, missing_bytes=10**9, starting=starting["p"]),
        ]
        p = place(FN, views, costs)
        assert p is not None
        starting[p.node] += 1
        chosen.append(p.node)
    assert chosen[0] == "s" and set(chosen) == {"s", "l", "p"}, chosen
    assert chosen.count("s") > chosen.count("l") > chosen.count("p"), chosen
    busy = NodeView("p1", in_bucket=True, missing_bytes=10**9, pull_backlog_bytes=10 * 10**9)
    idle = NodeView("p2", in_bucket=True, missing_bytes=10**9)
    p = place(FN, [busy, idle], costs)
    assert p is not None and p.node == "p2"


def test_random_placement_is_seeded_and_ignores_locality() -> None:
    nodes = [NodeView(f"n{i}", staged=i == 0, in_bucket=True) for i in range(20)]
    a = [place_random(FN, nodes, random.Random(5)) for _ in range(3)]
    assert len({p.node for p in a if p}) == 1
    picks = {p.node for p in (place_random(FN, nodes, random.Random(s)) for s in range(50)) if p}
    assert len(picks) > 10


def small_args(sim: ModuleType, out: Path, *extra: str) -> object:
    return sim.parse(
        ["--nodes", "12", "--starts", "80", "--functions", "4", "--link-gbps", "25", "--seeds", "1", "2",
         "--out", str(out), *extra]
    )


def test_simulation_invariants_and_determinism(tmp_path: Path) -> None:
    sim = load_simulator()
    doc = sim.simulate(small_args(sim, tmp_path / "a.json"))
    again = sim.simulate(small_args(sim, tmp_path / "b.json"))
    assert doc["runs"] == again["runs"] and doc["summary"] == again["summary"]
    assert len(doc["runs"]) == 4
    for r in doc["runs"]:
        assert r["starts"] == 80 and r["unplaced"] == 0, r
        assert r["starts_before_pull_end"] == 0, r
        assert 0 < r["p50_s"] <= r["p99_s"] <= r["max_s"], r
    s = doc["summary"]
    assert s["bytes_moved"] < s["random_bytes_moved"], s
    assert s["burst_p99_ratio"] == pytest.approx(s["p99_s"] / s["one_cold_start_s"], rel=1e-2)
    # Every start waits for its bytes: none is ready before its pull (if any) ended.
    other = sim.simulate(small_args(sim, tmp_path / "c.json", "--seeds", "3"))
    assert other["runs"] != doc["runs"][:2]


def test_simulator_writes_its_json_and_refuses_bad_arguments(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--nodes", "5", "--starts", "20",
         "--functions", "2", "--copies", "2", "--link-gbps", "25", "--seeds", "1", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert {"machine", "settings", "measured", "runs", "summary"} <= doc.keys()
    assert doc["measured"]["file"] == "bench/results/split-bench-session15-h100.json"
    # The contention is the file's own burst measurement, and the settings say which was used.
    burst = doc["measured"]["contention_s_per_restore"]
    assert 0.1 < burst < 1.0 and doc["settings"]["contention_s_per_restore"] == burst, doc["measured"]
    assert doc["machine"]["torpor_commit"] and "python" in doc["machine"]["versions"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--copies", "0", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2 and "--copies must be from 1" in r.stderr.strip().splitlines()[-1], r.stderr


def test_cluster_code_is_typed() -> None:
    if subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True, check=False).returncode:
        pytest.skip("mypy is not installed here (make pytest installs it)")
    if importlib.util.find_spec("ray") is None:
        pytest.skip('Ray is not installed: pip install "ray[serve]>=2.40,<3" (make test does)')
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         str(ROOT / "python" / "torpor" / "cluster"), str(ROOT / "bench" / "cluster" / "simulate.py")],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_contention_is_measured_where_the_file_has_a_burst_and_the_old_constant_where_not() -> None:
    sim = load_simulator()
    walls = {("resnet152", "cold"): 0.5, ("resnet152", "burst8"): 2.6, ("gpt2-large", "cold"): 0.6,
             ("gpt2-large", "burst8"): 2.0}
    s, how = sim.measured_contention(walls)
    assert s == round(((2.6 - 0.5) / 7 + (2.0 - 0.6) / 7) / 2, 4) and "burst8" in how
    s, how = sim.measured_contention({("gpt2-large", "cold"): 0.6})
    assert s == sim.CONTENTION_S and "DESIGN.md" in how


def test_the_simulation_tables_in_readme_and_docs_are_the_rendering_of_the_json() -> None:
    """README.md and docs/cluster.md quote bench/cluster/sim_table.py's output, never typed."""
    spec = importlib.util.spec_from_file_location("sim_table", ROOT / "bench" / "cluster" / "sim_table.py")
    assert spec and spec.loader
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = json.loads((ROOT / "bench" / "results" / "cluster-sim.json").read_text())
    for path, link in ((ROOT / "README.md", 25.0), (ROOT / "docs" / "cluster.md", None)):
        block = table.render(doc, link)
        assert block in path.read_text(), f"re-render {path.name}: python3 bench/cluster/sim_table.py --into {path.name} …"
    # A file without the block's marker is refused in one line naming it.
    with pytest.raises(ValueError, match="no block starting with"):
        table.replace_block("no table here", table.render(doc, 25.0))
