"""Renders a serverless result JSON (run.py --compare) as the Markdown table the README quotes.

python3 bench/serverless/table.py bench/results/serverless-h100.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

Json = dict[str, Any]


def ms(x: float | None) -> str:
    if x is None:
        return "–"
    if x < 0.1:
        return f"{x * 1000:.1f} ms"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def starts(s: Json) -> str:
    kinds = s["starts"]
    order = ["warm", "restored", "booted"]
    parts = [f"{kinds[k]} {k}" for k in order if k in kinds]
    parts += [f"{v} {k}" for k, v in kinds.items() if k not in order]
    return ", ".join(parts)


def gib_s(r: Json) -> str:
    """The total over every stage, with the part charged while instances were starting (booting
    or restoring) where the JSON has the per-stage breakdown."""
    total = r.get("gpu_memory_gib_s")
    if total is None:
        return "n/a"
    starting = (r.get("gpu_memory_gib_s_by_stage") or {}).get("starting")
    return f"{total:.1f}" + ("" if starting is None else f" ({starting:.1f} starting)")


def mode_label(mode: str) -> str:
    """How a mode of run.py reads in the table's "cold start by" column."""
    return {
        "sandbox": "restore, sandboxed",
        "restore-graphs": "restore, CUDA graphs",
        "sandbox-graphs": "restore, sandboxed, CUDA graphs",
    }.get(mode, mode)


def render(d: Json) -> str:
    m = d["machine"]
    v = m["versions"]
    st = d["settings"]
    ka = st.get("keepalive")
    keep = (
        f"keep-alive {ka['gpu_release_s']:g}/{ka['hibernate_s']:g}/{ka['evict_s']:g} s "
        "(GPU release/hibernate/evict)"
        if ka
        else "keep-alive as in each torpor.toml"
    )
    lib = ", ".join(
        f"{k} {v[k]}" for k in ("torch", "torchvision", "transformers") if v.get(k)
    )
    out = [
        f"{m['device']}"
        + (f", driver {m['driver']}" if m.get("driver") else "")
        + f", kernel {m['kernel']}"
        + (f", {lib}" if lib else "")
        + f"; {st['duration_s']:g} s per trace (seed {st['seed']})"
        + (f", {st['clients']} clients superposed" if st.get("clients", 1) > 1 else "")
        + f", {keep}; "
        f"commit {(m.get('torpor_commit') or 'unknown')[:12]}{' (dirty)' if m.get('torpor_dirty') else ''}, {m['date']}.",
    ]
    if st.get("note"):
        out.append(f"Note: {st['note']}.")
    # Requests answered per second: a column only where the JSON has it (since session 34).
    rps = any("throughput_rps" in r["summary"] for r in d["results"])
    # The handler's p50: a column only where the JSON has it (since session 36).
    handler = any("handler_p50_s" in r["summary"] for r in d["results"])
    out += [
        "",
        (
            "| function | pattern | cold start by | requests | p50 | p99 | cold starts | starts | "
            "cold p50 | GPU memory·s (GiB·s) | errors |" + (" answered/s |" if rps else "")
            + (" handler p50 |" if handler else "")
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if rps else "") + ("---|" if handler else ""),
    ]
    for r in d["results"]:
        s = r["summary"]
        errors = s["requests"] - s["ok"]
        bad = ", ".join(f"{n}× {k}" for k, n in s["statuses"].items() if k != "200")
        mode = mode_label(r["mode"])
        row = (
            f"| {r['function']} | {r['pattern']} | {mode} | {s['requests']} | {ms(s['p50_s'])} "
            f"| {ms(s['p99_s'])} | {s['cold_starts']} | {starts(s)} | {ms(s['cold_p50_s'])} "
            f"| {gib_s(r)} | {errors}{f' ({bad})' if bad else ''} |"
        )
        if rps:
            t = s.get("throughput_rps")
            row += f" {'–' if t is None else f'{t:.2f}'} |"
        if handler:
            row += f" {ms(s.get('handler_p50_s'))} |"
        out.append(row)
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
