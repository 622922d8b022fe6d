"""Renders a coldstart result JSON as the Markdown table the README quotes.

    python3 bench/coldstart/table.py bench/results/coldstart-h100.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

Json = dict[str, Any]


def span(s: Json, unit: str = "s", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} {unit} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def phases(p: Json, names: list[str]) -> str:
    return ", ".join(f"{n} {p[n]['median']:.2f}" for n in names if n in p)


def render(d: Json) -> str:
    m = d["machine"]
    v = m["versions"]
    out = [
        f"{m['device']}, driver {m['driver']}, kernel {m['kernel']}, CRIU {m['criu_version']}, "
        f"torch {v['torch']}, transformers {v['transformers']}, torchvision {v['torchvision']}; "
        f"{d['settings']['runs']} runs each, median (min–max); page cache warm; "
        f"commit {(m.get('torpor_commit') or 'unknown')[:12]}, {m['date']}.",
        "",
        "| model | from scratch → first inference | `torpor restore` → first inference "
        "| CRIU + driver by hand → first inference | speedup over scratch "
        "| snapshot (leave-running) | source stopped | snapshot size | outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        scratch = r["from_scratch"]["first_response_s"]
        restore = r["restore"]["first_response_s"]
        snap = r["snapshot"]
        kept = [s for s in snap["runs"] if s["mode"] == "leave-running"]
        stop = snap["leave_running_phases"]["stop_time"]
        size = max(s["size"]["bytes"] for s in snap["runs"]) / 1e9
        same = all(x.get("digest_match") for x in r["restore"]["runs"]) and all(
            s.get("source_digest_match", True) for s in kept
        )
        by_hand = (r.get("by_hand_restore") or {}).get("first_response_s")
        if by_hand:
            same = same and all(x.get("digest_match") for x in r["by_hand_restore"]["runs"])
        out.append(
            f"| {r['model']} | {span(scratch)} | {span(restore)} | {span(by_hand) if by_hand else 'n/a'} "
            f"| {scratch['median'] / restore['median']:.1f}× "
            f"| {span(snap['leave_running_wall_s'])} | {span(stop)} | {size:.2f} GB "
            f"| {'bit-identical' if same else 'DIFFER'} |"
        )
    out += ["", "Phase medians (seconds):", ""]
    for r in d["results"]:
        rp = r["restore"]["phases"]
        sp = r["snapshot"]["leave_running_phases"]
        marks = r["from_scratch"]["marks"]
        out.append(
            f"- **{r['model']}** — restore: "
            f"{phases(rp, ['open', 'verify', 'gpu_checks', 'criu_restore', 'cuda_restore', 'cuda_unlock', 'total'])}. "
            f"Snapshot: {phases(sp, ['cuda_lock', 'cuda_checkpoint', 'criu_dump', 'cuda_restore', 'cuda_unlock', 'hash_and_write'])}. "
            f"From scratch (time since spawn): "
            f"{phases(marks, ['import_torch', 'cuda_ctx', 'import_model_lib', 'model_build', 'load_weights', 'to_gpu', 'first_infer'])}."
        )
        bh = (r.get("by_hand_restore") or {}).get("phases")
        if bh:
            out[-1] += f" By hand: {phases(bh, ['criu_restore', 'cuda_restore_and_unlock_process', 'driver_restore', 'driver_unlock'])}."
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
