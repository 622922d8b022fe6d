"""Merges split benchmark JSONs of one machine and one binary (several device calls, each within
the 10-minute limit) into one, as if one run had made them all:

    python3 bench/coldstart/split_merge.py OUT.json PART.json [PART.json ...]

Results keep their parts' order; a (model, mode) measured twice keeps the later part's row.
The parts must share the device and the commit (runs of different binaries are not one run); the
summary is computed again over the merged rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from split import MODES, headline_summary, identical  # noqa: E402

Json = dict[str, Any]


class MergeError(ValueError):
    pass


def check_one_machine(parts: list[Json]) -> None:
    """Parts of one run come from one machine and one binary (bench/peers/merge.py too)."""
    if not parts:
        raise MergeError("no part to merge")
    first = parts[0]
    for p in parts[1:]:
        for key in ("device", "torpor_commit"):
            if p["machine"].get(key) != first["machine"].get(key):
                raise MergeError(
                    f"the parts differ in machine.{key} ({first['machine'].get(key)!r} vs "
                    f"{p['machine'].get(key)!r}): merge only runs of one machine and one binary"
                )


def merge_rows(parts: list[Json], modes: tuple[str, ...]) -> list[Json]:
    """The parts' result rows, one per (model, mode) (a later part's row replaces an earlier
    one's), sorted by `modes`' order (stable: the models keep their parts' order)."""
    rows: dict[tuple[str, str], Json] = {}
    for p in parts:
        for r in p["results"]:
            rows[(r["model"], r["mode"])] = r
    return sorted(rows.values(), key=lambda r: (modes.index(r["mode"]) if r["mode"] in modes else len(modes)))


def merge(parts: list[Json]) -> Json:
    check_one_machine(parts)
    first = parts[0]
    results = merge_rows(parts, MODES)
    models: list[str] = []
    for p in parts:
        models += [m for m in p["settings"]["models"] if m not in models]
    deploys: Json = {}
    for p in parts:
        for state, funcs in (p.get("deploys") or {}).items():
            deploys.setdefault(state, {}).update(funcs)
    settings = dict(first["settings"])
    settings["models"] = models
    settings["modes"] = [m for m in MODES if any(r["mode"] == m for r in results)]
    settings["daemon_config"] = {k: v for p in parts for k, v in p["settings"].get("daemon_config", {}).items()}
    settings["merged_from"] = len(parts)
    references = {m: next((p["outputs"][m]["reference"] for p in parts if m in p.get("outputs", {})), None) for m in models}
    # One run's reference per model: a part whose reference differs makes the merge say DIFFER.
    same_refs = {
        m: all(p["outputs"][m]["reference"] == references[m] for p in parts if m in p.get("outputs", {})) for m in models
    }
    return {
        **first,
        "summary": headline_summary(results, models),
        "settings": settings,
        "deploys": deploys,
        "dedup": [x for p in parts for x in p.get("dedup") or []],
        "results": results,
        "outputs": {
            m: {
                "reference": references[m],
                "identical_across_modes": (identical(results, m) is True) and same_refs[m],
            }
            for m in models
        },
        "errors": [e for p in parts for e in p.get("errors") or []],
        "elapsed_s": round(sum(p.get("elapsed_s") or 0 for p in parts), 1),
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: split_merge.py OUT.json PART.json [PART.json ...]", file=sys.stderr)
        return 2
    try:
        doc = merge([json.loads(Path(p).read_text()) for p in argv[1:]])
    except MergeError as e:
        print(f"split_merge: {e}", file=sys.stderr)
        return 1
    Path(argv[0]).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
