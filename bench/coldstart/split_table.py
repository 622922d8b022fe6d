"""Renders a split benchmark JSON (bench/coldstart/split.py) as the Markdown the README quotes,
and its bar chart.

    python3 bench/coldstart/split_table.py RESULT.json             # the whole report
    python3 bench/coldstart/split_table.py --headline RESULT.json  # the README's table
    python3 bench/coldstart/split_table.py --chart OUT.png RESULT.json

The chart needs matplotlib (tests/requirements.txt has it; the GPU machine's image may not: render
it here from the JSON copied back).
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
    "standby-live": "split, live standby (context on the GPU)",
    "cold": "cold (split, GPU cache, best config)",
    "cold-disk": "cold from disk (no cache, page cache dropped)",
    "burst8": "burst of 8 (all answered)",
    "pooled": "new to the node, in a ready sandbox (setup run)",
    "pooled-later": "a later cold start, the faster way (pooled or restored)",
}
# The README's table: one row per mode, one column per model, the median of the client's wall time.
HEADLINE_NAMES = {
    "transparent": "transparent (`split = false`)",
    "host-cache": "split, segments from the host cache",
    "gpu-cache": "split, segments from the GPU cache",
    "second": "split, a second instance mapping the first's weights",
    "cold": "**cold** (split, GPU cache, best config)",
    "cold-disk": "cold from disk (no cache, page cache dropped)",
    "standby": "standby instance (split, GPU cache)",
    "standby-live": "live standby (`standby_gpu = \"live\"`)",
    "burst8": "burst: 8 cold starts at once, until all answered",
    "pooled": "new to the node, into a ready sandbox of the live-context pool (weights mapped, setup run)",
    "pooled-later": "a later cold start, the faster of the two (`sandbox_pool.starts = \"faster\"`)",
}
MODEL_NAMES = {"resnet152": "ResNet-152", "gpt2-large": "GPT-2-Large", "cpu": "CPU function"}
PHASES = (
    "restore", "restore.criu_restore", "restore.cuda_restore", "reconnect", "gpu_resume", "segments",
    "pooled_load.import", "pooled_load.setup", "pooled_load.pack", "pooled_load.warmup", "handler", "overhead",
)
# The restore's own phases (X-Torpor-Timings `restore.<phase>`), shorter in the header.
PHASE_NAMES = {
    "restore.criu_restore": "of which CRIU",
    "restore.cuda_restore": "of which driver",
    # A start in a ready sandbox (mode pooled): the function's import and setup(), weight
    # packing, its warm-up.
    "pooled_load.import": "import (pooled)",
    "pooled_load.setup": "setup (pooled)",
    "pooled_load.pack": "packing (pooled)",
    "pooled_load.warmup": "warm-up (pooled)",
}


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
        + " | ".join(PHASE_NAMES.get(p, p) for p in PHASES)
        + " | fills: source mean GB/s (segments) | outputs |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    link = (d.get("link") or {}).get("h2d_pinned_gbps")
    for r in d["results"]:
        mode = MODE_NAMES.get(r["mode"], r["mode"])
        if any(len(set(run.get("devices") or [])) > 1 for run in r.get("runs") or []):
            mode = "split, 2nd instance (placed on another GPU)"
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


def _medians(d: Json) -> tuple[list[str], list[str], dict[tuple[str, str], float]]:
    models: list[str] = []
    modes: list[str] = []
    got: dict[tuple[str, str], float] = {}
    for r in d["results"]:
        if not r.get("runs") or not r.get("wall_s"):
            continue
        models += [r["model"]] if r["model"] not in models else []
        modes += [r["mode"]] if r["mode"] not in modes else []
        got[(r["model"], r["mode"])] = r["wall_s"]["median"]
    order = list(HEADLINE_NAMES)
    # Variants (MODE@TAG) right after their mode.
    modes.sort(key=lambda m: (order.index(m.split("@")[0]) if m.split("@")[0] in order else len(order), "@" in m))
    return models, modes, got


def headline(d: Json) -> str:
    """Mode × model medians of request → first inference (what the README quotes)."""
    models, modes, got = _medians(d)
    out = [
        "| request → first inference | " + " | ".join(MODEL_NAMES.get(m, m) for m in models) + " |",
        "|---|" + "---|" * len(models),
    ]
    for mode in modes:
        cells = [f"{got[(m, mode)]:.2f} s" if (m, mode) in got else "–" for m in models]
        out.append(f"| {headline_name(mode)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def headline_name(mode: str) -> str:
    """A mode's row name; a variant (MODE@TAG: the mode with another daemon config) is its
    mode's name with the tag, which the text beside the table explains."""
    base, _, tag = mode.partition("@")
    name = HEADLINE_NAMES.get(base, base)
    return f"{name} [{tag}]" if tag else name


def chart(d: Json, png: str) -> None:
    """Grouped bars: one group per mode, one bar per model, median seconds (min–max whiskers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, modes, got = _medians(d)
    spans = {(r["model"], r["mode"]): r["wall_s"] for r in d["results"] if r.get("runs") and r.get("wall_s")}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(modes)), 4.0))
    width = 0.8 / max(1, len(models))
    for k, model in enumerate(models):
        xs = [i + k * width for i, mode in enumerate(modes) if (model, mode) in got]
        ys = [got[(model, mode)] for mode in modes if (model, mode) in got]
        lo = [got[(model, mode)] - spans[(model, mode)]["min"] for mode in modes if (model, mode) in got]
        hi = [spans[(model, mode)]["max"] - got[(model, mode)] for mode in modes if (model, mode) in got]
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=MODEL_NAMES.get(model, model))
    ax.set_xticks([i + width * (len(models) - 1) / 2 for i in range(len(modes))])
    ax.set_xticklabels([m for m in modes], rotation=20)
    ax.set_ylabel("request → first inference, s (median, min–max)")
    m = d["machine"]
    ax.set_title(f"Cold start through torpord, {m.get('device') or 'no GPU'}, commit {(m.get('torpor_commit') or '?')[:8]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


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


def runs_table(d: Json, mode: str) -> str:
    """Every run of `mode`, one row each, with its phases: for a mode whose runs differ for a
    reason the medians hide."""
    rows = [r for r in d["results"] if r["mode"] == mode]
    keys: list[str] = []
    for row in rows:
        for run in row.get("runs", []):
            keys += [k for k in run["timings"] if k not in keys and k not in ("queue", "total", "overhead")]
    out = ["| model | run | request → first answer | " + " | ".join(f"`{k}`" for k in keys) + " | outputs |"]
    out.append("|---" * (len(keys) + 4) + "|")
    for row in rows:
        for run in row.get("runs", []):
            cells = [f"{run['timings'][k]:.3f}" if k in run["timings"] else "–" for k in keys]
            same = "identical" if run.get("same") else "DIFFER"
            out.append(f"| {row['model']} | {run['run']} | {run['wall_s']:.3f} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--runs"] and len(argv) == 3:
        with open(argv[2]) as f:
            print(runs_table(json.load(f), argv[1]))
        return 0
    if argv[:1] == ["--chart"] and len(argv) == 3:
        with open(argv[2]) as f:
            chart(json.load(f), argv[1])
        return 0
    if argv[:1] == ["--headline"] and len(argv) == 2:
        with open(argv[1]) as f:
            print(headline(json.load(f)))
        return 0
    if len(argv) == 1:
        with open(argv[0]) as f:
            print(render(json.load(f)))
        return 0
    print("usage: split_table.py [--headline | --chart OUT.png | --runs MODE] RESULT.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
