"""Issue 12 item 5's question: does a placement-side change get the simulated burst under 3x one
cold start? An experiment on bench/cluster/simulate.py's model, not the cluster's behaviour:

    python3 bench/cluster/prefetch_experiment.py [--out bench/results/cluster-sim-prefetch.json]

Three things, each on the simulator's model and figures unchanged (links, contention, restore
times, the same seeds):

- `place` as the ingress runs it (the simulator's `locality` policy), for reference;
- the contention bound: every snapshot already on every node (`--copies` = nodes), so no start
  ever pulls and `place` only spreads restores: what placement could at best reach;
- proactive replication ("prefetch"): after each placement, if the chosen start is estimated to
  wait more than `slack` seconds longer than a pull of the snapshot onto the best node without
  it (the link backlog, the bytes it lacks, its starts under way), that node starts pulling the
  snapshot now, for the requests that follow (no request goes with it). Swept over slack.

It answers with the p99 ratio and the bytes moved at each link. The ingress does not prefetch.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import simulate as S  # noqa: E402
from torpor.cluster.placement import Costs, FunctionNeeds, NodeView, Placement, StartKind, place, start_kind  # noqa: E402

SLACKS = (0.0, -0.5, -1.0, -1.5)


def prefetch_node(fn: FunctionNeeds, views: list[NodeView], costs: Costs, chosen: Placement | None, slack: float) -> str | None:
    """The node that should start pulling `fn`'s snapshot now, or None (the module doc's rule)."""
    if chosen is None or chosen.kind is StartKind.WARM:
        return None
    best: tuple[float, str] | None = None
    for v in views:
        if not v.alive or start_kind(v) is not StartKind.PULL:
            continue
        missing = fn.snapshot_bytes if v.missing_bytes is None else v.missing_bytes
        if missing == 0:  # already pulling it
            continue
        if fn.gpu_bytes > 0 and v.gpu_free_bytes is not None and v.gpu_free_bytes < fn.gpu_bytes:
            continue
        score = (v.pull_backlog_bytes + missing) / costs.link_bytes_per_s + v.starting * costs.start_contention_s
        if best is None or (score, v.node) < best:
            best = (score, v.node)
    if best is not None and chosen.estimate_s - costs.restore_staged_s > best[0] + slack:
        return best[1]
    return None


def pull_onto(node: S.Node, f: S.Fn, sizes: dict[str, int], link_bps: float, t: float) -> int:
    moved = 0
    for piece in (f.base, f.name):
        if piece not in node.have:
            begin = max(t, node.link_free_at)
            node.link_free_at = begin + sizes[piece] / link_bps
            node.have[piece] = node.link_free_at
            moved += sizes[piece]
    return moved


def run_once(
    args: argparse.Namespace,
    models: list[S.Model],
    link_gbps: float,
    seed: int,
    slack: float | None,
    contention_s: float = S.CONTENTION_S,
) -> dict[str, Any]:
    """simulate.run_once's burst (same draws), placed by `place`, with prefetch when slack is set."""
    rng = random.Random(seed)
    nodes, fns, sizes = S.make_cluster(args, models, rng)
    weights = [1 / (k + 1) ** 1.1 for k in range(len(fns))]
    arrivals = sorted(rng.uniform(0, args.window_s) for _ in range(args.starts))
    picks = rng.choices(range(len(fns)), weights=weights, k=args.starts)
    link_bps = link_gbps * 1e9 / 8
    by_name = {n.name: n for n in nodes}
    starts: list[dict[str, Any]] = []
    moved = prefetches = 0
    for t, k in zip(arrivals, picks, strict=True):
        f, m = fns[k], fns[k].model
        costs = Costs(
            restore_staged_s=m.restore_s,
            restore_local_extra_s=m.snapshot_dir_bytes / (args.disk_gbps * 1e9),
            link_bytes_per_s=link_bps,
            start_contention_s=contention_s,
        )
        need = FunctionNeeds(f.name, gpu_bytes=m.gpu_bytes, snapshot_bytes=m.own_bytes + m.base_bytes)
        views = [S.view(n, f, sizes, link_bps, t) for n in nodes]
        p = place(need, views, costs)
        if slack is not None:
            q = prefetch_node(need, views, costs, p, slack)
            if q is not None:
                prefetches += 1
                moved += pull_onto(by_name[q], f, sizes, link_bps, t)
                views = [S.view(n, f, sizes, link_bps, t) for n in nodes]
                p = place(need, views, costs)
        assert p is not None
        node = by_name[p.node]
        pulled = pull_onto(node, f, sizes, link_bps, t)
        moved += pulled
        pull_end = max(t, *(node.have[piece] for piece in (f.base, f.name)))
        duration = m.restore_s + (0.0 if f.name in node.staged else costs.restore_local_extra_s)
        duration += contention_s * node.restoring_at(pull_end)
        end = pull_end + duration
        i = bisect.bisect_right(node.restore_ends, end)
        node.restore_ends.insert(i, end)
        node.restores.insert(i, (pull_end, end))
        node.gpu_used += m.gpu_bytes
        starts.append({"t": t, "function": f.name, "placed": node.name, "kind": p.kind.value, "pulled_bytes": pulled,
                       "pull_end": pull_end, "restore_start": pull_end, "ready": end, "start_s": end - t})
    out = S.summarize("prefetch" if slack is not None else "locality", link_gbps, seed, starts, moved, nodes)
    out["prefetches"] = prefetches
    out.pop("trace_head", None)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=S.ROOT / "bench" / "results" / "cluster-sim-prefetch.json")
    ns = ap.parse_args(argv)
    base = S.parse(["--out", "/dev/null"])
    models, source = S.measured_models()
    cold = S.one_cold_start_s(models, base.functions)
    rows = []
    for link in base.link_gbps:
        variants: list[tuple[str, argparse.Namespace, float | None]] = [("place", base, None)]
        variants.append(("contention bound (every snapshot on every node)", S.parse(["--copies", str(base.nodes)]), None))
        variants += [(f"place + prefetch, slack {s:+.1f} s", base, s) for s in SLACKS]
        for label, args, slack in variants:
            runs = [
                run_once(args, models, link, seed, slack, source["contention_s_per_restore"])
                for seed in base.seeds
            ]
            mean = lambda key: sum(float(r[key]) for r in runs) / len(runs)  # noqa: E731
            rows.append({
                "link_gbps": link, "variant": label, "slack_s": slack,
                "p50_s": round(mean("p50_s"), 4), "p99_s": round(mean("p99_s"), 4),
                "burst_p99_ratio": round(mean("p99_s") / cold, 3),
                "bytes_moved": int(mean("bytes_moved")), "prefetches": mean("prefetches"),
                "max_starts_on_one_node": max(r["max_starts_on_one_node"] for r in runs),
            })
            r = rows[-1]
            print(f"{link:>5g} Gb/s  {label:<48} p99 {r['p99_s']:.2f} s  ratio {r['burst_p99_ratio']:.2f}  "
                  f"{r['bytes_moved'] / 1e9:7.0f} GB  prefetches {r['prefetches']:.0f}")
    doc = {"what": __doc__.split("\n\n")[0], "machine": S.machine(), "one_cold_start_s": cold,
           "measured": source, "seeds": base.seeds, "rows": rows}
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
