"""Renders bench/results/reliability.json (bench/reliability/run.py) as the Markdown table the README
and docs/reliability.md quote: one row per fault, then fuzz, load and the summary.

    python3 bench/reliability/table.py [bench/results/reliability.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def seconds(v: Any) -> str:
    return f"{v:.2f} s" if isinstance(v, (int, float)) else "—"


def render(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    out = [
        f"{m.get('cpus', '?')} cpus, kernel {m.get('kernel', '?')}; {m.get('torpor', '?')} at "
        f"{str(m.get('commit') or '?')[:12]}; {doc['settings']['runs']} runs per fault; whole run "
        f"{seconds(doc.get('wall_s'))}.",
        "",
        "| fault | runs | harmed sources | invalid snapshots accepted | lost requests | outcomes | median recovery |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in doc["faults"].items():
        outcomes: dict[str, int] = {}
        for r in f["every_run"]:
            outcomes[str(r["outcome"])] = outcomes.get(str(r["outcome"]), 0) + 1
        out.append(
            f"| {name} | {f['runs']} | {f['harmed_sources']} | {f['invalid_snapshots_accepted']} | "
            f"{f['lost_requests']} | {', '.join(f'{k} {v}' for k, v in outcomes.items())} | "
            f"{seconds(f.get('median_recovery_s'))} |"
        )
    fuzz = doc.get("fuzz")
    out.append("")
    if fuzz:
        out.append(
            f"fuzz: {fuzz['executions']} executions over {fuzz['targets']} targets, {fuzz['findings']} findings "
            f"this run ({fuzz['fixed_findings']} found and fixed earlier, each a regression test)."
        )
    for name, ld in doc.get("load", {}).items():
        out.append(
            f"load ({name}, {ld['restart']} restart, "
            f"{'Idempotency-Keys, a reset request retried' if ld.get('idempotency_keys') else 'no keys, a reset request not retried'}): "
            f"{ld['invocations']} invocations, "
            f"{ld['lost_requests']} lost, {ld['duplicated_requests']} duplicated, {ld['wrong_answers']} wrong, "
            f"{ld['throughput_rps']} requests/s, p50 {ld['p50_ms']} ms, p99 {ld['p99_ms']} ms."
        )
    s = doc["summary"]
    out += [
        "",
        "summary: " + ", ".join(f"{k} {s[k]}" for k in (
            "runs", "harmed_sources", "invalid_snapshots_accepted", "lost_requests", "lost_requests_under_faults",
            "lost_requests_without_keys",
        ) if k in s),
    ]
    return "\n".join(out)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench/results/reliability.json"
    print(render(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
