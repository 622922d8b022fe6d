"""The cluster's placement rule (torpor.cluster.placement) and the simulator that runs it at scale
(bench/cluster/simulate.py). Pure Python: no Ray, no daemon. The rule is the one the ingress
calls; tests/test_cluster.py runs it on a real cluster."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
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
        # No instance up before its bytes were all there and its two parts ran; no answer before
        # its request arrived or before the instance that served it was up.
        assert r["starts_before_pull_end"] == 0 and r["answers_before_instance_up"] == 0, r
        assert 0 < r["p50_s"] <= r["p99_s"] <= r["max_s"], r
        assert 0 < r["instance_up_p50_s"] <= r["instance_up_p99_s"] <= r["instance_up_max_s"], r
    s = doc["summary"]
    assert s["bytes_moved"] < s["random_bytes_moved"], s
    assert s["burst_p99_ratio"] == pytest.approx(s["p99_s"] / s["one_cold_start_s"], rel=1e-2)
    assert s["instance_up_p99_ratio"] == pytest.approx(s["instance_up_p99_s"] / s["one_cold_start_s"], rel=1e-2)
    # The cold start the ratios divide by is the file's cold median of the mix's median function.
    assert s["one_cold_start_s"] in {m["cold_s"] for m in doc["measured"]["models"]}
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
    assert doc["measured"]["file"] == "bench/results/split-bench-burst-s17-final-h100.json"
    # The driver's turn is the file's own burst measurement, and the settings say which was used.
    turns = {m["name"]: m["driver_s"] for m in doc["measured"]["models"]}
    assert all(0.1 < d < 1.0 for d in turns.values()) and doc["settings"]["driver_s"] == turns, doc["measured"]
    assert doc["calibration"]["gpu_restores"] == doc["settings"]["gpu_restores"] == 2
    assert doc["machine"]["torpor_commit"] and "python" in doc["machine"]["versions"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--copies", "0", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2 and "--copies must be from 1" in r.stderr.strip().splitlines()[-1], r.stderr
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--gpu-restores", "-1", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2 and "--gpu-restores must be 0" in r.stderr.strip().splitlines()[-1], r.stderr


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


BURST_FILE = ROOT / "bench" / "results" / "split-bench-burst-s17-final-h100.json"


def file_burst8(model: str) -> tuple[float, float]:
    """The H100 file's burst of 8 on an idle GPU: median wall time until all 8 answered, median
    time until all 8 instances were up; read here, not through the simulator."""
    doc = json.loads(BURST_FILE.read_text())
    row = next(r for r in doc["results"] if r["model"] == model and r["mode"] == "burst8")
    return float(row["wall_s"]["median"]), statistics.median(run["all_up_s"] for run in row["runs"])


def test_the_model_reproduces_the_measured_burst_of_8_on_an_idle_node() -> None:
    """Calibration: 8 simultaneous starts of one model, staged, on an idle node, as the H100's
    burst8 (899f8ce). All answered within CALIBRATION_TOLERANCE (10 %) of the file's median
    wall time (the model leaves out the ~0.05 s the other starts' CRIU cost the first instance:
    resnet152 comes out 8 % early), all up within 1 % (the driver turn is derived from it)."""
    sim = load_simulator()
    models, _ = sim.measured_models()
    assert [m.name for m in models] == ["resnet152", "gpt2-large"]
    for m in models:
        wall, all_up = file_burst8(m.name)
        ups, answers = sim.burst_on_idle_node(m, 8)
        assert len(ups) == len(answers) == 8
        assert max(answers) == pytest.approx(wall, rel=sim.CALIBRATION_TOLERANCE), (m.name, answers, wall)
        assert max(ups) == pytest.approx(all_up, rel=0.01), (m.name, ups, all_up)
        # As on the H100 (starts: restored 1, warm 7): the first instance up answers all eight.
        assert min(answers) == pytest.approx(m.cold_s + m.handler_s)


def test_the_driver_lane_serialises_turns_and_the_slots_bound_restores_in_flight() -> None:
    sim = load_simulator()
    # Two starts at once on an idle node: the second is up one driver turn after the first,
    # whichever function each is (one GPU, one lane).
    node = sim.Node(0)
    a = node.add_start("f", 0.0, nondriver_s=0.25, driver_s=0.3)
    b = node.add_start("g", 0.0, nondriver_s=0.25, driver_s=0.3)
    node.up_times()
    assert (a.up, b.up) == (pytest.approx(0.55), pytest.approx(0.85))
    # The lane takes starts in the order they are ready for it, not the order they were placed:
    # a start placed later whose bytes were there sooner goes first.
    node = sim.Node(0)
    late = node.add_start("f", 2.0, nondriver_s=0.25, driver_s=0.3)
    soon = node.add_start("g", 0.0, nondriver_s=0.25, driver_s=0.3)
    node.up_times()
    assert (soon.up, late.up) == (pytest.approx(0.55), pytest.approx(2.55))
    # With a non-driver part longer than a turn, 2 slots make the third start wait for the
    # first's turn to end before its non-driver part begins; without the bound it does not.
    for slots, third in ((2, 1.3 + 1.0 + 0.3), (0, 1.0 + 0.3 + 0.3 + 0.3)):
        node = sim.Node(0, gpu_restores=slots)
        starts = [node.add_start("f", 0.0, nondriver_s=1.0, driver_s=0.3) for _ in range(3)]
        node.up_times()
        assert [s.up for s in starts][:2] == [pytest.approx(1.3), pytest.approx(1.6)]
        assert starts[2].up == pytest.approx(third), slots
    assert node.pending_starts(1.29) == 3 and node.pending_starts(1.6) == 1 and node.pending_starts(2.0) == 0


def test_late_binding_answers_no_request_before_its_arrival_or_an_instance_of_its_function_is_up() -> None:
    sim = load_simulator()
    node = sim.Node(0)
    h = 0.02
    plan = [(0.0, "f", 0.0), (0.05, "f", 0.0), (0.1, "g", 0.0), (0.2, "f", 0.0), (3.0, "f", 3.0), (3.0, "g", 3.5)]
    reqs = []
    for t, fn, pull_end in plan:
        r = sim.Request(t, fn, h, node=node.name)
        r.start = node.add_start(fn, pull_end, nondriver_s=0.25, driver_s=0.3)
        reqs.append(r)
    sim.answer(node, reqs)
    for r in reqs:
        served = node.starts[r.served_by]
        assert served.fn == r.fn, r  # only an instance of its own function, on its node
        assert r.answer >= r.t + h - 1e-12 and r.answer >= served.up + h - 1e-12, r
    f0, f1, g0, f2, f3, g1 = reqs
    # The first f instance (up 0.55) answers the first three f requests back to back, before
    # the second f start is up (0.85); g waits for its own start's turn (up 1.15).
    assert [r.served_by for r in (f0, f1, f2)] == [0, 0, 0]
    assert (f0.answer, f1.answer, f2.answer) == (pytest.approx(0.57), pytest.approx(0.59), pytest.approx(0.61))
    assert g0.served_by == 2 and g0.answer == pytest.approx(1.15 + h)
    # Arriving when instances are up and idle: answered at once, by an instance already there.
    assert f3.answer == pytest.approx(3.0 + h) and f3.served_by != f3.start.seq
    assert g1.answer == pytest.approx(3.0 + h) and g1.served_by == 2


def test_measured_names_its_file_and_fields() -> None:
    sim = load_simulator()
    models, source = sim.measured_models()
    assert source["file"] == "bench/results/split-bench-burst-s17-final-h100.json"
    assert source["commit"].startswith("899f8ce") and "H100" in source["device"]
    assert "results[mode=cold].wall_s.median" in source["cold_s"]
    assert "all_up_s" in source["driver_s"] and "/ 7" in source["driver_s"]
    assert "answers[].timings.handler" in source["handler_s"]
    for key in ("base_bytes", "own_bytes", "snapshot_dir_bytes"):
        assert source[key].startswith("deploys.split.<model>."), key
    assert "DESIGN.md" in source["gpu_bytes"]
    doc = json.loads(BURST_FILE.read_text())
    for m in models:
        cold = next(r for r in doc["results"] if r["model"] == m.name and r["mode"] == "cold")["wall_s"]["median"]
        wall, all_up = file_burst8(m.name)
        assert m.cold_s == cold and m.driver_s == pytest.approx((all_up - cold) / 7, abs=1e-4)
        assert m.base_bytes == doc["deploys"]["split"][m.name]["sizes"]["base_dir"]["bytes"]
        assert source["burst8_wall_s"][m.name] == wall


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
