"""An A/B of split-bench calls: the runs of each arm pooled over its calls, medians side by side.

    python3 bench/coldstart/split_ab.py --mode cold ARM=FILE.json[,FILE.json...] ARM=...

An A/B alternates the arms over several calls of `scripts/gpu-run.sh split-bench` in one device
call (machines differ by more than the effect between calls), so each arm's runs come from
several JSON files; split_merge.py keeps one part per row instead. Prints a Markdown table per
model: the client's restore → first inference (median, min-max, runs), then the restore's CRIU
and driver phases, and whether every run's answer was the reference's.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

PHASES = (("CRIU", "restore.criu_restore"), ("driver", "restore.cuda_restore"), ("hot set wait", "restore.hot_set"))


def runs_by_model(files: list[str], mode: str) -> dict[str, list[dict[str, Any]]]:
    """Every run of `mode` in `files`, by model."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        with open(path) as f:
            doc = json.load(f)
        for row in doc["results"]:
            if row["mode"] == mode:
                out.setdefault(row["model"], []).extend(row["runs"])
    return out


def cell(runs: list[dict[str, Any]]) -> list[str]:
    walls = [float(r["wall_s"]) for r in runs]
    cells = [f"{statistics.median(walls):.3f} ({min(walls):.3f}-{max(walls):.3f}, {len(walls)} runs)"]
    for _, key in PHASES:
        values = [float(r["timings"][key]) for r in runs if key in r.get("timings", {})]
        cells.append(f"{statistics.median(values):.3f}" if values else "-")
    cells.append("bit-identical" if all(r.get("same") for r in runs) else "**differ**")
    return cells


def table(arms: dict[str, list[str]], mode: str) -> str:
    by_arm = {arm: runs_by_model(files, mode) for arm, files in arms.items()}
    models = sorted({m for runs in by_arm.values() for m in runs})
    header = ["model", "arm", f"{mode}: request → first inference, median (min-max)"]
    header += [name for name, _ in PHASES] + ["outputs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model in models:
        for arm, runs in by_arm.items():
            if runs.get(model):
                lines.append("| " + " | ".join([model, arm, *cell(runs[model])]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    mode = "cold"
    if argv[:1] == ["--mode"] and len(argv) > 1:
        mode, argv = argv[1], argv[2:]
    arms: dict[str, list[str]] = {}
    for spec in argv:
        arm, sep, files = spec.partition("=")
        if not sep or not files:
            print(f"split_ab.py: {spec!r} is not ARM=FILE.json[,FILE.json...]", file=sys.stderr)
            return 2
        arms[arm] = files.split(",")
    if not arms:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(arms, mode))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
