"""Renders the cluster simulator's JSON (bench/cluster/simulate.py) as the Markdown tables the
README and docs/cluster.md quote: means over the seeds, per link and placement, of the requests'
answer times (the headline) and, beside them, the instances' up times.

    python3 bench/cluster/sim_table.py bench/results/cluster-sim.json              # every link
    python3 bench/cluster/sim_table.py --link 25 bench/results/cluster-sim.json    # one link
    python3 bench/cluster/sim_table.py --link 25 --into README.md bench/results/cluster-sim.json

`--into FILE` replaces the block of FILE that starts with this rendering's marker line
(`<!-- cluster-sim-table: … -->`, naming the options) and ends with `<!-- /cluster-sim-table -->`.
Never typed by hand: tests/test_cluster_placement.py checks both files against the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from readme_block import replaced  # noqa: E402 (bench/ is put on the path above)

Json = dict[str, Any]
END = "<!-- /cluster-sim-table -->"
POLICIES = (("locality", "locality (`place`)"), ("random", "random"))


def marker(link: float | None) -> str:
    """The first line of a rendered block: which options made it."""
    opts = f" --link {link:g}" if link is not None else ""
    return f"<!-- cluster-sim-table: rendered by bench/cluster/sim_table.py{opts} bench/results/cluster-sim.json -->"


def means(doc: Json, policy: str, link: float) -> Json:
    """Request p50 and p99, instance-up p99 and bytes moved of `policy` at `link`, means over the
    runs' seeds."""
    runs = [r for r in doc["runs"] if r["policy"] == policy and r["link_gbps"] == link]
    if not runs:
        raise ValueError(f"no {policy} run at {link:g} Gb/s in the JSON")
    keys = ("p50_s", "p99_s", "instance_up_p99_s", "bytes_moved")
    return {k: sum(float(r[k]) for r in runs) / len(runs) for k in keys}


def render(doc: Json, link: float | None = None) -> str:
    """The table (one link, or every link the JSON has), with its marker and end lines."""
    cold = float(doc["summary"]["one_cold_start_s"])
    links = [link] if link is not None else [float(x) for x in doc["settings"]["link_gbps"]]
    head = ["placement"] if link is not None else ["link", "placement"]
    lines = [
        marker(link),
        "| " + " | ".join([*head, "request p50", "request p99", f"p99 ÷ one cold start ({cold:.2f} s)",
                             "instance up p99 (÷ cold)", "bytes moved"]) + " |",
        "|" + "---|" * (len(head) + 5),
    ]
    for g in links:
        for policy, name in POLICIES:
            m = means(doc, policy, g)
            ratio = f"{m['p99_s'] / cold:.2f}"
            if policy == "locality" and g == float(doc["summary"]["link_gbps"]):
                ratio = f"**{ratio}**"
            cells = [name] if link is not None else [f"{g:g} Gb/s", name]
            up = f"{m['instance_up_p99_s']:.2f} s ({m['instance_up_p99_s'] / cold:.2f})"
            cells += [f"{m['p50_s']:.2f} s", f"{m['p99_s']:.2f} s", ratio, up, f"{m['bytes_moved'] / 1e9:.0f} GB"]
            lines.append("| " + " | ".join(cells) + " |")
    seeds = ", ".join(str(s) for s in doc["settings"]["seeds"])
    turns = ", ".join(f"{name} {d:.2f} s" for name, d in doc["settings"]["driver_s"].items())
    lines.append("")
    lines.append(
        f"Means over seeds {seeds}; requests bound late; one driver turn per start on a node's GPU ({turns}; "
        f"`measured.driver_s`), {doc['settings']['gpu_restores']} restores in flight per node; "
        # The JSON's own values (3 decimals): at 2, 3.945 would print 3.94 beside the row's 3.95.
        f"`summary.burst_p99_ratio` = {doc['summary']['burst_p99_ratio']}, "
        f"`summary.instance_up_p99_ratio` = {doc['summary']['instance_up_p99_ratio']}."
    )
    lines.append(END)
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with the block that starts with `block`'s marker line replaced by `block`."""
    begin, *body, end = block.splitlines()
    return replaced(text, begin, end, "\n".join(body))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--link", type=float, help="one link's rows (Gb/s), without the link column")
    ap.add_argument("--into", type=Path, help="replace this rendering's block in FILE")
    a = ap.parse_args(argv)
    try:
        block = render(json.loads(a.json.read_text()), a.link)
        if a.into is not None:
            a.into.write_text(replace_block(a.into.read_text(), block))
        else:
            print(block)
    except (OSError, ValueError, KeyError) as e:
        print(f"sim_table: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
