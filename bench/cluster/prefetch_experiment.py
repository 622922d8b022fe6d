"""Issue 12 item 5's question: does a placement-side change get the simulated burst under 3x one
cold start? An experiment on bench/cluster/simulate.py's model, not the cluster's behaviour:

    python3 bench/cluster/prefetch_experiment.py [--out bench/results/cluster-sim-prefetch.json]

Three things, each on the simulator's model and figures unchanged (links, the nodes' late binding,
driver lane and max_instances, torpord's 429s and the ingress's retries, cold starts, the same
seeds):

- `place` as the ingress runs it (the simulator's `locality` policy), for reference;
- the lane bound: every snapshot already on every node (`--copies` = nodes), so no start ever
  pulls and `place` only spreads starts over the nodes' driver lanes: what placement could at
  best reach (at this scale: `place` is greedy);
- proactive replication ("prefetch"): after each placement, if the chosen start is estimated to
  wait more than `slack` seconds longer than a pull of the snapshot onto the best node without
  it (the link backlog, the bytes it lacks, its starts under way), that node starts pulling the
  snapshot now, for the requests that follow (no request goes with it). Swept over slack; the
  rule is applied at each attempt of a request (again after a 429).

It answers with the request p99 ratio (the simulator's headline), the instance-up p99 and the
bytes moved at each link. The ingress does not prefetch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import simulate as S  # noqa: E402
from torpor.cluster.bookkeeping import Bookkeeping  # noqa: E402
from torpor.cluster.placement import Costs, FunctionNeeds, NodeView, Placement, StartKind, place, start_kind  # noqa: E402,F401

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


def run_once(
    args: argparse.Namespace,
    models: list[S.Model],
    link_gbps: float,
    seed: int,
    slack: float | None,
) -> dict[str, Any]:
    """simulate.run_once's burst (same draws, same node model), placed by `place`, with prefetch
    when slack is set."""
    rng = random.Random(seed)
    nodes, fns, sizes = S.make_cluster(args, models, rng)
    link_bps = link_gbps * 1e9 / 8
    by_name = {n.name: n for n in nodes}
    book = Bookkeeping()  # the ingress's, as in simulate.run_once
    prefetched: list[int] = []  # the bytes of each prefetch

    def prefetch(f: S.Fn, t: float, views: list[NodeView], p: Placement | None) -> bool:
        if slack is None:
            return False
        q = prefetch_node(S.needs_of(f), views, S.costs_for(args, f.model, link_bps), p, slack)
        if q is None:
            return False
        prefetched.append(S.pull_onto(by_name[q], f, sizes, link_bps, t))
        return True

    requests, _ = S.burst(args, "locality", nodes, fns, sizes, link_bps, S.draws(args, len(fns), rng), book,
                          random.Random(0), prefetch)
    moved = sum(r.pulled_bytes for r in requests) + sum(prefetched)
    prefetches = len(prefetched)
    out = S.summarize("prefetch" if slack is not None else "locality", link_gbps, seed, requests, moved, nodes)
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
        variants.append(("lane bound (every snapshot on every node)", S.parse(["--copies", str(base.nodes)]), None))
        variants += [(f"place + prefetch, slack {s:+.1f} s", base, s) for s in SLACKS]
        for label, args, slack in variants:
            runs = [run_once(args, models, link, seed, slack) for seed in base.seeds]

            def mean(key: str) -> float:
                return sum(float(r[key]) for r in runs) / len(runs)

            rows.append({
                "link_gbps": link, "variant": label, "slack_s": slack,
                "p50_s": round(mean("p50_s"), 4), "p99_s": round(mean("p99_s"), 4),
                "burst_p99_ratio": round(mean("p99_s") / cold, 3),
                "instance_up_p99_s": round(mean("instance_up_p99_s"), 4),
                "instance_up_p99_ratio": round(mean("instance_up_p99_s") / cold, 3),
                "bytes_moved": int(mean("bytes_moved")), "prefetches": mean("prefetches"),
                "starts_made": mean("starts_made"), "refusals_429": mean("refusals_429"),
                "queue_timeouts_503": mean("queue_timeouts_503"),
                "max_starts_on_one_node": max(r["max_starts_on_one_node"] for r in runs),
            })
            r = rows[-1]
            print(f"{link:>5g} Gb/s  {label:<42} p99 {r['p99_s']:.2f} s  ratio {r['burst_p99_ratio']:.2f}  "
                  f"up p99 {r['instance_up_p99_s']:.2f} s  "
                  f"{r['bytes_moved'] / 1e9:7.0f} GB  prefetches {r['prefetches']:.0f}  starts {r['starts_made']:.0f}  "
                  f"429s {r['refusals_429']:.0f}")
    doc = {"what": __doc__.split("\n\n")[0], "machine": S.machine(), "one_cold_start_s": cold,
           "measured": source, "seeds": base.seeds, "rows": rows}
    ns.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
