"""Tables of GPU hand-offs between sandboxes, from `bench/sandbox/run.py --handoff-only` JSONs
(docs/sandboxes.md quotes them; tests/test_bench_sandbox_handoff.py checks it does, verbatim).

    python3 bench/sandbox/handoff_table.py FILE [FILE ...]

One column per file (the binary's commit names it); rows: the best put + get and its median
(without the first, which loads the kernels), then the medians of
the put and of each of its steps, the same for the get (torpor.store_gpu.steps()), and a bare
round trip to the store (a get of a missing key), in ms.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

PUT_STEPS = (
    "put_request", "context", "import", "reserve", "map", "set_access", "sync_before", "copy", "unmap", "close_fd",
    "written_request",
)
GET_STEPS = ("get_request", "import", "reserve", "map", "set_access", "tensor", "close_fd")
# Since session 37 (docs/sandboxes.md, "Kept mappings and leases"): a kept mapping is "kept"
# instead of import … set_access, and a put into its lease "leased_request" instead of
# put_request … written_request; rows only where a file has them (older tables render as they
# did).
KEPT_STEPS = {"put": ("kept", "leased_request"), "get": ("kept",)}


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _median_step(runs: list[dict[str, Any]], side: str, step: str) -> str:
    """The step's median over the runs that took it, and how many those were when not all."""
    values = [r[f"{side}_steps"][step] for r in runs if step in (r.get(f"{side}_steps") or {})]
    if not values:
        return "–"
    some = "" if len(values) == len(runs) else f" ({len(values)} of {len(runs)})"
    return _ms(statistics.median(values)) + some


def table(paths: list[Path]) -> str:
    docs = [(p, json.loads(p.read_text())) for p in paths]
    names = [(d["machine"].get("commit") or p.stem)[:7] for p, d in docs]
    rows: list[tuple[str, list[str]]] = []
    runs_of = [d["sandbox"]["handoff"]["other_sandbox_gpu"] for _, d in docs]
    rows.append(("put + get, best", [_ms(min(r["put_s"] + r["get_s"] for r in runs)) for runs in runs_of]))
    # The first hand-off of a daemon loads the kernels (135-158 ms): not in the median.
    rows.append(("put + get, median", [_ms(statistics.median(r["put_s"] + r["get_s"] for r in runs[1:] or runs)) for runs in runs_of]))
    for side, steps in (("put", PUT_STEPS), ("get", GET_STEPS)):
        rows.append((f"{side}, median", [_ms(statistics.median(r[f"{side}_s"] for r in runs)) for runs in runs_of]))
        kept = [s for s in KEPT_STEPS[side] if any(s in (r.get(f"{side}_steps") or {}) for runs in runs_of for r in runs)]
        rows += [(f"{side}: {s}", [_median_step(runs, side, s) for runs in runs_of]) for s in (*steps, *kept)]
    rows.append(("a bare round trip to the store", [_ms(statistics.median(d["sandbox"]["handoff"]["round_trip_s"])) for _, d in docs]))
    # Since session 34: each request's answer and wake-up apart, and a bare round trip that is the
    # first of its invoke; rows only where a file has them (older tables render as they did).
    for side, requests in (("put", ("store_put", "store_written")), ("get", ("store_get",))):
        for part in (f"{r}.{p}" for r in requests for p in ("answer", "wake")):
            if any(part in (r.get(f"{side}_steps") or {}) for runs in runs_of for r in runs):
                rows.append((f"{side}: {part}", [_median_step(runs, side, part) for runs in runs_of]))
    firsts = [d["sandbox"]["handoff"].get("round_trip_first_s") for _, d in docs]
    if any(firsts):
        rows.append(("a bare round trip, the first of its invoke", [_ms(statistics.median(f)) if f else "–" for f in firsts]))
    lines = ["| ms | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(table([Path(a) for a in sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
