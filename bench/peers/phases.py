"""Where Torpor's cold start and standby spend their time, per model size, rendered from peer
benchmark JSONs (bench/peers/run.py; issue 18's per-size breakdown):

    python3 bench/peers/phases.py RESULT.json [RESULT.json ...]

One row per (model, mode) of Torpor's cold and standby rows, models ordered by their segment
bytes: the client's wall time and the daemon's phases (X-Torpor-Timings medians: the restore's
own CRIU and driver parts, the segments after the worker's hello, the handler), with the
function snapshot's CPU-side image (the snapshot directory CRIU restores) and its segment bytes.
Never typed by hand: docs/split.md quotes this output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

Json = dict[str, Any]

MODES = ("cold", "standby")
PHASES = (
    ("restore.criu_restore", "CRIU restore"),
    ("restore.cuda_restore", "driver restore"),
    ("segments", "segments"),
    ("handler", "handler"),
)


def median(timings: Json, phase: str) -> str:
    s = timings.get(phase)
    return "–" if not s else f"{s['median']:.3f}"


def gb(n: float | None) -> str:
    return "–" if n is None else f"{n / 1e9:.2f} GB"


def deploy_of(doc: Json, model: str) -> Json:
    """The split deploy of `model` (its function snapshot's sizes)."""
    return ((doc.get("torpor") or {}).get("deploys") or {}).get("split", {}).get(model) or {}


def rows(docs: list[Json]) -> list[tuple[float, str]]:
    out: list[tuple[float, str]] = []
    for doc in docs:
        for r in doc["results"]:
            if r["mode"] not in MODES or not r.get("runs"):
                continue
            dep = deploy_of(doc, r["model"])
            snap = dep.get("snapshot_function") or {}
            image = ((dep.get("sizes") or {}).get("snapshot_dir") or {}).get("bytes")
            seg = snap.get("segment_bytes")
            t = (r.get("torpor") or {}).get("timings") or {}
            walls = sorted(x["wall_s"] for x in r["runs"])
            wall = walls[len(walls) // 2] if len(walls) % 2 else sum(walls[len(walls) // 2 - 1 : len(walls) // 2 + 1]) / 2
            cells = [r["model"], r["mode"], f"{wall:.3f}", *(median(t, p) for p, _ in PHASES), gb(image), gb(seg)]
            out.append((float(seg or 0) + MODES.index(r["mode"]), "| " + " | ".join(cells) + " |"))
    return sorted(out)


def render(docs: list[Json]) -> str:
    head = ["model", "mode", "request → answer (s)", *(f"{name} (s)" for _, name in PHASES), "CPU-side image", "segments"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [line for _, line in rows(docs)]
    commits = sorted({(d.get("machine") or {}).get("torpor_commit", "?")[:12] for d in docs})
    devices = sorted({(d.get("machine") or {}).get("device") or "no GPU" for d in docs})
    lines.append("")
    lines.append(f"{', '.join(devices)}; binary {', '.join(commits)}; medians of each row's runs.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: phases.py RESULT.json [RESULT.json ...]", file=sys.stderr)
        return 2
    print(render([json.loads(Path(a).read_text()) for a in argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
