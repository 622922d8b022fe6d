#!/usr/bin/env python3
"""The bursts of a split-bench run (`burst8` and its `burst8@TAG` variants) as a Markdown table:
per model and setting, the medians of the first answer, all eight answered and all eight
instances up, and where the instances landed (`restore_server.placement`; docs/split.md,
"Bursts", "Several GPUs").

    python3 bench/coldstart/burst_table.py                       # the table of RESULT
    python3 bench/coldstart/burst_table.py --readme docs/split.md  # its block there, replaced
    python3 bench/coldstart/burst_table.py --check docs/split.md   # exit 1 when it differs
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from readme_block import readme_cli, replaced  # noqa: E402 (bench/ is put on the path above)

# The two-GPU run the docs quote (docs/split.md, "Bursts").
RESULT = ROOT / "bench" / "results" / "split-bench-s51-alone2-h200x2.json"
BEGIN = "<!-- burst-table: rendered by bench/coldstart/burst_table.py -->"
END = "<!-- /burst-table -->"

def setting(result: dict[str, Any], mode: str) -> str:
    """What the mode's daemon set beyond the plain `burst8`'s config: `placement` and
    `driver_lanes` lines, or "the run's defaults"."""
    configs = result.get("settings", {}).get("daemon_config", {})
    base = set(configs.get("burst8", "").splitlines())
    extra = [line.strip() for line in configs.get(mode, "").splitlines() if line not in base]
    return f"`{mode}`: " + (", ".join(f"`{x}`" for x in extra) if extra else "the run's defaults")


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "–"


def rows(result: dict[str, Any]) -> list[str]:
    out = []
    for r in result["results"]:
        mode = r["mode"]
        if not mode.startswith("burst8"):
            continue
        runs = [x for x in r.get("runs", []) if "wall_s" in x]
        if not runs:
            continue
        devices = sorted({json.dumps(x.get("devices", {}), sort_keys=True) for x in runs})
        out.append(
            f"| {r['model']} | {setting(result, mode)} | "
            f"{median([x['first_answer_s'] for x in runs])} | {median([x['wall_s'] for x in runs])} | "
            f"{median([x['all_up_s'] for x in runs if x.get('all_up_s') is not None])} | "
            f"{', '.join(devices)} | {len(runs)} |"
        )
    return out


def table(path: Path) -> str:
    result = json.loads(path.read_text())
    m = result["machine"]
    head = [
        "| model | setting | first answer (s) | all 8 answered (s) | all 8 up (s) | live instances per GPU | bursts |",
        "|---|---|---|---|---|---|---|",
    ]
    foot = (
        f"\n{len(m.get('gpus', []))}× {m.get('device')}, driver {m.get('driver')}, commit "
        f"{str(m.get('torpor_commit'))[:12]}; medians; the instances per GPU include the other "
        f"functions' live ones; rendered from `{path.name}` by `bench/coldstart/burst_table.py`."
    )
    return "\n".join(head + rows(result)) + "\n" + foot


def main(argv: list[str] | None = None) -> int:
    return readme_cli(argv, doc=__doc__, script="bench/coldstart/burst_table.py", what="the table of bursts",
                      rendered=lambda text: replaced(text, BEGIN, END, table(RESULT)), shown=lambda: table(RESULT))


if __name__ == "__main__":
    sys.exit(main())
