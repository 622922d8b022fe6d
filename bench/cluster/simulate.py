"""A burst of cold starts on a simulated Torpor cluster, placed by the cluster's own rule.

    python3 bench/cluster/simulate.py [--nodes 100] [--starts 1000] [--functions 20] [--window-s 1]
        [--link-gbps 25 100 10] [--seeds 1 2 3] [--out bench/results/cluster-sim.json]

Every simulated cold start is placed by `torpor.cluster.placement.place`, the function the
ingress calls for real requests (`place_random` is the baseline), on views of the nodes built the
way torpord's placement answer describes them. What the simulation models, and where each figure
comes from:

- Functions: `--functions` functions, alternately shaped like the two measured models of
  bench/results/split-bench-session15-h100.json (split path, H100, one machine, one call):
  resnet152 and GPT-2-Large. A fresh restore to the first answer takes the measured `host-cache`
  wall median (0.68 s, 0.91 s) when the snapshot is staged; one read from the local disk adds its snapshot directory's size at
  `--disk-gbps` (assumed 5 GB/s NVMe; not measured there).
- Bytes: a node pulls the base snapshot once (its `base_dir` bytes, 1.29-1.35 GB) for every
  function on that base, and per function the bytes that are its own: its segments (`stored_bytes`
  of its split snapshot: the weights) plus its snapshot directory less the base's (the CRIU pages
  it adds; content-defined chunks share the rest with the base: an assumption, the H100 runs did
  not measure the overlap). Two bases: even functions on one, odd on the other.
- Links: each node pulls over its own link at `--link-gbps` (no network was measured on the H100;
  10, 25 and 100 Gb/s are swept), its pulls one after another (FIFO), a second start that needs a
  pull under way waiting for it rather than pulling again. The bucket's own throughput is not a
  limit. A start never begins before every byte it needs is on the node.
- Contention: each restore under way on a node when another begins adds to it what one more
  simultaneous restore added in the same file's measurement, `(burst8 - cold) / 7` averaged over
  the two models (0.29 s: the driver's restores of a burst take turns, 1.9-2.2 s of a burst's
  2.7-2.9 s); a file without burst rows gets 0.21 s (8 simultaneous restores of a 4.9 GB
  snapshot: 6.3 s against 4.8 s for one; DESIGN.md §1).
- GPU: each node has one 80 GB GPU; an instance holds the model's NVML figure (resnet152 ~1.3 GB,
  GPT-2-Large 3.89 GB, DESIGN.md §1) from its placement on.
- Initial state: every function's snapshot is in the bucket, staged on its home node (where it
  was deployed) and in the local store of `--copies` nodes in all (earlier traffic).
- Arrivals: `--starts` cold starts (no warm instance is free: each needs a new one) at uniform
  random times within `--window-s`, the function drawn from a Zipf(1.1) popularity.

The JSON (`--out`) records the machine, the commit, the versions, the figures taken from which
file, every run (policy x link x seed) and a top-level `summary` of the default link (25 Gb/s):
`burst_p99_ratio` (the locality policy's p99 start time over one cold start: a staged restore of
the mix's median function, on an idle node), p50/p99 start times, bytes moved, and the same for
random placement.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from torpor.cluster.placement import (  # noqa: E402
    Costs,
    FunctionNeeds,
    NodeView,
    Placement,
    StartKind,
    place,
    place_random,
)

SPLIT_BENCH = ROOT / "bench" / "results" / "split-bench-session15-h100.json"
GPU_BYTES = 80 * 10**9
# NVML's per-process GPU memory of a restored instance (DESIGN.md §1: GPT-2-Large 3.89 GB; the
# resnet152 figure is its weights plus the ~1 GB context of a PyTorch process, same table).
INSTANCE_GPU_BYTES = {"resnet152": 1_300_000_000, "gpt2-large": 3_890_000_000}
# Without a measured burst in the split benchmark's file (DESIGN.md §1).
CONTENTION_S = 0.21
BURST = 8
DEFAULT_LINK_GBPS = 25.0


@dataclass(frozen=True)
class Model:
    """A measured model: its restore time (staged), its snapshot's pieces, its GPU memory."""

    name: str
    restore_s: float
    base_bytes: int
    own_bytes: int
    snapshot_dir_bytes: int
    gpu_bytes: int


def measured_models(path: Path = SPLIT_BENCH) -> tuple[list[Model], dict[str, Any]]:
    """The two models of the split benchmark on the H100, and where each figure came from."""
    doc = json.loads(path.read_text())
    walls = {(r["model"], r["mode"]): r["wall_s"]["median"] for r in doc["results"]}
    models = []
    for name in ("resnet152", "gpt2-large"):
        d = doc["deploys"]["split"][name]
        snap = int(d["snapshot_function"]["bytes"])
        base = int(d["sizes"]["base_dir"]["bytes"])
        segments = int(d["snapshot_function"]["stored_bytes"])
        models.append(
            Model(name, float(walls[(name, "host-cache")]), base, segments + max(0, snap - base), snap,
                  INSTANCE_GPU_BYTES[name])
        )
    source = {
        "file": str(path.relative_to(ROOT)),
        "device": doc["machine"]["device"],
        "commit": doc["machine"]["torpor_commit"],
        "restore_s": "results[mode=host-cache].wall_s.median (a fresh restore to the first answer, split path)",
        "base_bytes": "deploys.split.<model>.sizes.base_dir.bytes",
        "own_bytes": "deploys.split.<model>.snapshot_function.stored_bytes + (snapshot_function.bytes - base_dir.bytes)",
        "models": [m.__dict__ for m in models],
    }
    contention, how = measured_contention(walls)
    source["contention_s_per_restore"] = contention
    source["contention"] = how
    return models, source


def measured_contention(walls: dict[tuple[str, str], float]) -> tuple[float, str]:
    """What one more simultaneous restore adds to each on a node: `(burst8 - cold) / 7` per model
    measured both ways, averaged; [`CONTENTION_S`] where none was (and how it was got)."""
    per = [
        (walls[(name, "burst8")] - walls[(name, "cold")]) / (BURST - 1)
        for name in ("resnet152", "gpt2-large")
        if (name, "burst8") in walls and (name, "cold") in walls
    ]
    if not per:
        return CONTENTION_S, "no burst8 and cold rows: DESIGN.md §1's 0.21 s"
    return round(sum(per) / len(per), 4), "results[mode=burst8 and cold].wall_s.median: (burst8 - cold) / 7, mean over the models"


@dataclass
class Fn:
    name: str
    model: Model
    base: str
    home: int


@dataclass
class Node:
    """A simulated node: when each snapshot piece is (or will be) on it, its link, its restores."""

    index: int
    have: dict[str, float] = field(default_factory=dict)  # piece -> time it is all on the node
    staged: set[str] = field(default_factory=set)
    link_free_at: float = 0.0
    restores: list[tuple[float, float]] = field(default_factory=list)  # (start, end), sorted by end
    restore_ends: list[float] = field(default_factory=list)
    gpu_used: int = 0

    @property
    def name(self) -> str:
        return f"node-{self.index:03d}"

    def restoring_at(self, t: float) -> int:
        """Restores begun by `t` and not over."""
        i = bisect.bisect_right(self.restore_ends, t)
        return sum(1 for s, _ in self.restores[i:] if s <= t)

    def pending_starts(self, t: float) -> int:
        """Starts placed here that are not over at `t` (pulling, waiting or restoring)."""
        return len(self.restore_ends) - bisect.bisect_right(self.restore_ends, t)


def make_cluster(
    args: argparse.Namespace, models: list[Model], rng: random.Random
) -> tuple[list[Node], list[Fn], dict[str, int]]:
    nodes = [Node(i) for i in range(args.nodes)]
    fns: list[Fn] = []
    sizes: dict[str, int] = {}
    for i in range(args.functions):
        m = models[i % len(models)]
        base = f"base-{i % 2}"
        f = Fn(f"fn-{i:02d}-{m.name}", m, base, rng.randrange(args.nodes))
        fns.append(f)
        sizes[f.name] = m.own_bytes
        sizes[base] = max(sizes.get(base, 0), m.base_bytes)
    for f in fns:
        holders = [f.home, *rng.sample([n for n in range(args.nodes) if n != f.home], max(0, args.copies - 1))]
        for n in holders:
            nodes[n].have[f.name] = 0.0
            nodes[n].have[f.base] = 0.0
        nodes[f.home].staged.add(f.name)
    return nodes, fns, sizes


def view(node: Node, f: Fn, sizes: dict[str, int], link_bps: float, t: float) -> NodeView:
    """The node as torpord's placement answer (plus the link backlog the simulator knows)."""
    parts = (f.base, f.name)
    missing = sum(sizes[p] for p in parts if p not in node.have)
    if missing:
        backlog = max(0.0, node.link_free_at - t)
    else:
        backlog = max(0.0, max(node.have[p] for p in parts) - t)
    local = all(node.have.get(p, float("inf")) <= t for p in parts)
    return NodeView(
        node=node.name,
        known=local,
        staged=f.name in node.staged,
        local_snapshot=local,
        in_bucket=True,
        gpu_free_bytes=GPU_BYTES - node.gpu_used,
        missing_bytes=missing,
        pull_backlog_bytes=int(backlog * link_bps),
        starting=node.pending_starts(t),
    )


def run_once(
    args: argparse.Namespace,
    models: list[Model],
    policy: str,
    link_gbps: float,
    seed: int,
    contention_s: float = CONTENTION_S,
) -> dict[str, Any]:
    rng = random.Random(seed)
    nodes, fns, sizes = make_cluster(args, models, rng)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(fns))]
    arrivals = sorted(rng.uniform(0, args.window_s) for _ in range(args.starts))
    picks = rng.choices(range(len(fns)), weights=weights, k=args.starts)
    choose = random.Random(seed * 7919 + 1)  # the random policy's own draws
    link_bps = link_gbps * 1e9 / 8
    by_name = {n.name: n for n in nodes}
    starts: list[dict[str, Any]] = []
    moved = 0
    for t, k in zip(arrivals, picks, strict=True):
        f = fns[k]
        m = f.model
        costs = Costs(
            restore_staged_s=m.restore_s,
            restore_local_extra_s=m.snapshot_dir_bytes / (args.disk_gbps * 1e9),
            link_bytes_per_s=link_bps,
            start_contention_s=contention_s,
        )
        need = FunctionNeeds(f.name, gpu_bytes=m.gpu_bytes, snapshot_bytes=m.own_bytes + m.base_bytes)
        views = [view(n, f, sizes, link_bps, t) for n in nodes]
        p: Placement | None = place(need, views, costs) if policy == "locality" else place_random(need, views, choose)
        if p is None:
            starts.append({"t": t, "function": f.name, "placed": None})
            continue
        node = by_name[p.node]
        pulled = 0
        pull_end = t
        for piece in (f.base, f.name):
            if piece not in node.have:
                begin = max(t, node.link_free_at)
                node.link_free_at = begin + sizes[piece] / link_bps
                node.have[piece] = node.link_free_at
                pulled += sizes[piece]
            pull_end = max(pull_end, node.have[piece])
        moved += pulled
        staged = f.name in node.staged
        duration = m.restore_s + (0.0 if staged else costs.restore_local_extra_s)
        duration += contention_s * node.restoring_at(pull_end)
        end = pull_end + duration
        i = bisect.bisect_right(node.restore_ends, end)
        node.restore_ends.insert(i, end)
        node.restores.insert(i, (pull_end, end))
        node.gpu_used += m.gpu_bytes
        starts.append(
            {
                "t": t, "function": f.name, "placed": node.name, "kind": p.kind.value,
                "estimate_s": p.estimate_s, "pulled_bytes": pulled, "pull_end": pull_end,
                "restore_start": pull_end, "ready": end, "start_s": end - t,
            }
        )
    return summarize(policy, link_gbps, seed, starts, moved, nodes)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q * len(s)))]) if s else float("nan")


def summarize(
    policy: str, link_gbps: float, seed: int, starts: list[dict[str, Any]], moved: int, nodes: list[Node]
) -> dict[str, Any]:
    placed = [s for s in starts if s["placed"] is not None]
    times = [s["start_s"] for s in placed]
    kinds: dict[str, int] = {}
    for s in placed:
        kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
    used = {s["placed"] for s in placed}
    return {
        "policy": policy,
        "link_gbps": link_gbps,
        "seed": seed,
        "starts": len(starts),
        "unplaced": len(starts) - len(placed),
        "p50_s": round(pct(times, 0.50), 4),
        "p99_s": round(pct(times, 0.99), 4),
        "max_s": round(max(times), 4) if times else None,
        "bytes_moved": moved,
        "nodes_used": len(used),
        "max_starts_on_one_node": max((sum(1 for s in placed if s["placed"] == n) for n in used), default=0),
        "kinds": dict(sorted(kinds.items())),
        # Invariant, checked by the tests: no restore began before its pull ended.
        "starts_before_pull_end": sum(1 for s in placed if s["restore_start"] < s["pull_end"] - 1e-12),
        "trace_head": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in starts[:5]],
    }


def one_cold_start_s(models: list[Model], functions: int) -> float:
    """A staged restore on an idle node, the median over the functions of the mix."""
    xs = sorted(models[i % len(models)].restore_s for i in range(functions))
    return xs[len(xs) // 2]


def machine() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        r = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    cpu = None
    try:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
            None,
        )
    except OSError:
        pass
    return {
        "device": f"simulation on the CPU ({cpu or platform.machine()}, {os.cpu_count()} cpus); no GPU used",
        "torpor_commit": git("rev-parse", "HEAD"),
        "torpor_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "versions": {"python": platform.python_version()},
        "kernel": platform.release(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    models, source = measured_models(Path(args.split_bench))
    t0 = time.monotonic()
    runs = [
        run_once(args, models, policy, link, seed, source["contention_s_per_restore"])
        for link in args.link_gbps
        for seed in args.seeds
        for policy in ("locality", "random")
    ]
    cold = one_cold_start_s(models, args.functions)

    def mean(policy: str, key: str) -> float:
        xs = [float(r[key]) for r in runs if r["policy"] == policy and r["link_gbps"] == args.summary_link_gbps]
        return sum(xs) / len(xs)

    loc_p99, rnd_p99 = mean("locality", "p99_s"), mean("random", "p99_s")
    loc_bytes, rnd_bytes = mean("locality", "bytes_moved"), mean("random", "bytes_moved")
    return {
        "benchmark": "cluster-sim",
        "machine": machine(),
        "settings": {
            "nodes": args.nodes, "starts": args.starts, "functions": args.functions, "window_s": args.window_s,
            "link_gbps": args.link_gbps, "seeds": args.seeds, "copies": args.copies, "disk_gbps": args.disk_gbps,
            "gpu_bytes_per_node": GPU_BYTES, "contention_s_per_restore": source["contention_s_per_restore"], "popularity": "zipf 1.1",
            "placement": "torpor.cluster.placement.place (locality) vs place_random (random)",
        },
        "measured": source,
        "elapsed_s": round(time.monotonic() - t0, 3),
        "runs": runs,
        "summary": {
            "link_gbps": args.summary_link_gbps,
            "one_cold_start_s": cold,
            "burst_p99_ratio": round(loc_p99 / cold, 3),
            "p50_s": round(mean("locality", "p50_s"), 4),
            "p99_s": round(loc_p99, 4),
            "bytes_moved": int(loc_bytes),
            "random_p50_s": round(mean("random", "p50_s"), 4),
            "random_p99_s": round(rnd_p99, 4),
            "random_bytes_moved": int(rnd_bytes),
            "random_burst_p99_ratio": round(rnd_p99 / cold, 3),
            "bytes_moved_locality_over_random": round(loc_bytes / rnd_bytes, 4) if rnd_bytes else None,
            "target_burst_p99_ratio": 3.0,
            "meets_target": loc_p99 / cold <= 3.0,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--starts", type=int, default=1000)
    ap.add_argument("--functions", type=int, default=20)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--copies", type=int, default=3, help="nodes that hold each snapshot at the start (home included)")
    ap.add_argument("--disk-gbps", type=float, default=5.0, help="GB/s a local snapshot is read at (assumed)")
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[DEFAULT_LINK_GBPS, 100.0, 10.0])
    ap.add_argument("--summary-link-gbps", type=float, default=DEFAULT_LINK_GBPS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--split-bench", default=str(SPLIT_BENCH))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster-sim.json"))
    args = ap.parse_args(argv)
    for key in ("nodes", "starts", "functions"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be at least 1, got {getattr(args, key)}")
    if args.copies < 1 or args.copies > args.nodes:
        ap.error(f"--copies must be from 1 to --nodes ({args.nodes}), got {args.copies}")
    if args.summary_link_gbps not in args.link_gbps:
        ap.error(f"--summary-link-gbps {args.summary_link_gbps} is not one of --link-gbps {args.link_gbps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    doc = simulate(args)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["summary"]
    print(
        f"{args.starts} cold starts on {args.nodes} nodes within {args.window_s:g} s, link {s['link_gbps']:g} Gb/s: "
        f"locality p50 {s['p50_s']:.3f} s p99 {s['p99_s']:.3f} s ({s['burst_p99_ratio']:.2f}x one cold start "
        f"{s['one_cold_start_s']:.2f} s), {s['bytes_moved'] / 1e9:.1f} GB moved; random p50 {s['random_p50_s']:.3f} s "
        f"p99 {s['random_p99_s']:.3f} s, {s['random_bytes_moved'] / 1e9:.1f} GB moved -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
