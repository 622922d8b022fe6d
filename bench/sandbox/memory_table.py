"""The memory ratio of bench/sandbox/run.py's runs against their functions' size, as
docs/sandboxes.md quotes it ("The memory ratio against the functions' size"):

    python3 bench/sandbox/memory_table.py bench/results/sandbox-s37-w16-h100.json …

One row per file, in the order given: the file, the weights a function holds, the GPU memory of
the 8 processes and of the one sandbox (1 s after the requests), `memory_ratio_8fn`, the ratio
once idle, and how far the sandbox is above one context and the functions' weights (a process's
context taken as its memory less its weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _mib(x: float) -> str:
    return f"{x:,.0f}".replace(",", " ") + " MiB"


def row(name: str, doc: dict[str, Any]) -> str:
    weights = int(doc["settings"]["weights_mib"])
    n = int(doc["settings"]["functions"])
    processes, sandbox = float(doc["processes"]["gpu_mib"]), float(doc["sandbox"]["gpu_mib"])
    context = processes / n - weights
    above = sandbox - context - n * weights
    s = doc["summary"]
    ratio, idle = s[f"memory_ratio_{n}fn"], s[f"memory_ratio_{n}fn_idle"]
    return f"| `{name}` | {weights} MiB | {_mib(processes)} | {_mib(sandbox)} | {ratio:.2f} | {idle:.2f} | {_mib(above)} |"


def table(paths: list[Path]) -> str:
    docs = [json.loads(p.read_text()) for p in paths]
    n = docs[0]["settings"]["functions"]
    lines = [
        f"| file | weights a function | {n} processes | one sandbox | `memory_ratio_{n}fn` | once idle | above one context + {n} × weights |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [row(p.name, d) for p, d in zip(paths, docs, strict=True)])


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(table([Path(a) for a in sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
