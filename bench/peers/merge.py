"""Merges peer benchmark JSONs of one machine and one binary (several device calls, each within
the 10-minute limit) into one, as if one run had made them all:

    python3 bench/peers/merge.py OUT.json PART.json [PART.json ...]

As bench/coldstart/split_merge.py (whose checks and row merge it uses): the parts must share
the device and the commit; a (model, mode) measured in two parts keeps the later part's row;
the summary (medians, digests across every part, targets, resident cost) is computed again
over the merged rows.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

Json = dict[str, Any]


def _load(name: str, path: Path) -> Any:
    """A module by path: bench/peers/run.py and bench/coldstart/run.py share a name."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


run = _load("peers_run", HERE / "run.py")
split_merge = _load("split_merge", HERE.parent / "coldstart" / "split_merge.py")
MergeError = split_merge.MergeError


def merge(parts: list[Json]) -> Json:
    split_merge.check_one_machine(parts)
    bad = [i for i, p in enumerate(parts) if p.get("benchmark") != "peers"]
    if bad:
        raise MergeError(f"part {bad[0] + 1} is not a peer benchmark JSON (benchmark {parts[bad[0]].get('benchmark')!r})")
    results = split_merge.merge_rows(parts, run.ORDER)
    models: list[str] = []
    for p in parts:
        models += [m for m in p["settings"]["models"] if m not in models]
    # Models in the order the parts named them, each model's modes in run.ORDER.
    results.sort(key=lambda r: models.index(r["model"]) if r["model"] in models else len(models))
    first = parts[0]
    settings = dict(first["settings"])
    settings["models"] = models
    settings["modes"] = [m for m in run.ORDER if any(r["mode"] == m for r in results)]
    settings["runs"] = {k: v for p in parts for k, v in (p["settings"].get("runs") or {}).items()}
    settings["weights_bytes"] = {k: v for p in parts for k, v in (p["settings"].get("weights_bytes") or {}).items()}
    settings["merged_from"] = len(parts)
    torpor: Json = {"deploys": {}, "errors": []}
    for p in parts:
        for state, funcs in ((p.get("torpor") or {}).get("deploys") or {}).items():
            torpor["deploys"].setdefault(state, {}).update(funcs)
        torpor["errors"] += (p.get("torpor") or {}).get("errors") or []
    return {
        **first,
        "settings": settings,
        "results": results,
        "summary": run.make_summary(results),
        "torpor": torpor,
        "errors": [e for p in parts for e in p.get("errors") or []],
        "elapsed_s": round(sum(p.get("elapsed_s") or 0 for p in parts), 1),
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: merge.py OUT.json PART.json [PART.json ...]", file=sys.stderr)
        return 2
    try:
        doc = merge([json.loads(Path(p).read_text()) for p in argv[1:]])
    except (MergeError, OSError, json.JSONDecodeError, KeyError) as e:
        print(f"merge.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    Path(argv[0]).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
