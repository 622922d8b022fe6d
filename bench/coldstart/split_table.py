"""Renders a split benchmark JSON (bench/coldstart/split.py) as the Markdown the README quotes.

    python3 bench/coldstart/split_table.py RESULT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

Json = dict[str, Any]

MODE_NAMES = {
    "transparent": "transparent (`split = false`)",
    "host-cache": "split, host cache",
    "gpu-cache": "split, GPU cache",
    "second": "split, 2nd instance (shared read-only)",
    "standby": "split, standby instance (GPU cache)",
}
PHASES = ("restore", "reconnect", "gpu_resume", "segments", "handler", "overhead")


def span(s: Json | None, digits: int = 3) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def median(s: Json | None, digits: int = 3) -> str:
    return "–" if not s else f"{s['median']:.{digits}f}"


def gb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.2f} GB"


def fills(f: Json | None, link_gbps: float | None = None) -> str:
    """Per source: mean GB/s (segments); for copies over the link, its share of the link."""
    if not f:
        return "–"
    parts = []
    for src, v in sorted(f.items()):
        part = f"{src} {v['mean_gbps']:.1f} ({v['segments']})"
        if link_gbps and src in ("host", "store"):
            part += f" = {100 * v['mean_gbps'] / link_gbps:.0f} % of link"
        parts.append(part)
    return ", ".join(parts)


def header(d: Json) -> str:
    m = d["machine"]
    v = m.get("versions") or {}
    link = d.get("link") or {}
    parts = [
        (
            f"{m.get('device') or 'no GPU'}, driver {m.get('driver')}, kernel {m.get('kernel')}, "
            f"CRIU {m.get('criu_version')}, torch {v.get('torch')}"
        ),
        f"{d['settings']['runs']} fresh restores per row (`torpor stop` before each), median (min–max) in seconds",
        f"commit {(m.get('torpor_commit') or 'unknown')[:12]}, {m.get('date')}",
    ]
    if link.get("h2d_pinned_gbps"):
        parts.append(f"link host→device {link['h2d_pinned_gbps']:.1f} GB/s pinned (fill_bw)")
    return "; ".join(parts) + "."


def results_table(d: Json) -> list[str]:
    out = [
        "| model | path | restore → first inference (client) | "
        + " | ".join(PHASES)
        + " | fills: source mean GB/s (segments) | outputs |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    link = (d.get("link") or {}).get("h2d_pinned_gbps")
    for r in d["results"]:
        mode = MODE_NAMES.get(r["mode"], r["mode"])
        if "error" in r and not r.get("runs"):
            out.append(f"| {r['model']} | {mode} | error: {r['error'].splitlines()[0][:120]} |" + " |" * (len(PHASES) + 2))
            continue
        t = r.get("timings") or {}
        same = "bit-identical" if r.get("all_same") else "DIFFER"
        if "error" in r:
            same += f" ({len(r['runs'])} runs, then: {r['error'].splitlines()[0][:80]})"
        out.append(
            f"| {r['model']} | {mode} | {span(r.get('wall_s'))} | "
            + " | ".join(median(t.get(p)) for p in PHASES)
            + f" | {fills(r.get('fills'), link)} | {same} |"
        )
    return out


def sizes_table(d: Json) -> list[str]:
    out = [
        "| function | path | snapshot dir | segments | segment bytes | read-only | new in chunk store | stop time (deploy `stop_s`) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for state, deps in (d.get("deploys") or {}).items():
        for name, dep in deps.items():
            snap = dep.get("snapshot_function") or {}
            sizes = dep.get("sizes") or {}
            out.append(
                f"| {name} | {state} | {gb((sizes.get('snapshot_dir') or {}).get('bytes'))} "
                f"| {snap.get('segments', '–')} | {gb(snap.get('segment_bytes'))} "
                f"| {snap.get('readonly_segments', '–')} | {gb(snap.get('stored_bytes'))} "
                f"| {snap.get('stop_s', float('nan')):.2f} s |"
            )
    return out


def render(d: Json) -> str:
    out = [header(d), "", *results_table(d), "", *sizes_table(d)]
    for x in d.get("dedup") or []:
        out += [
            "",
            (
                f"Dedup, {x['functions'][0]} and {x['functions'][1]} on one base with the same weights: "
                f"{gb(x['logical_bytes'])} of segments, {gb(x['stored_bytes_apart'])} if stored apart, "
                f"{gb(x['unique_bytes_together'])} distinct ({x['dedup_ratio']}× by dedup), "
                f"{gb(x['stored_bytes_together'])} in the chunk store with zstd ({x['ratio']}×)."
            ),
        ]
    outputs = d.get("outputs") or {}
    if outputs:
        verdict = {True: "identical", False: "DIFFER", None: "no run"}
        same = ", ".join(f"{m}: {verdict[o['identical_across_modes']]}" for m, o in outputs.items())
        out += ["", f"Outputs across every run and path: {same}."]
    if d.get("errors"):
        out += ["", "Errors: " + "; ".join(e.splitlines()[0][:200] for e in d["errors"])]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
