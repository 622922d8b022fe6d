"""Renders bench/results/compat-h100.json (tests/compat/run.py) as the Markdown tables that the
README and docs/compat.md quote: one row per program, one per function, then the summary.

    python3 tests/compat/table.py [bench/results/compat-h100.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# A program's EXPECT (tests/compat/programs) and the outcome that meets it.
EXPECTED = {"identical": "restored_identical", "refused": "refused_cleanly"}


def seconds(v: Any) -> str:
    return f"{v:.2f} s" if isinstance(v, (int, float)) else "—"


def millis(v: Any) -> str:
    return f"{v * 1e3:.1f} ms" if isinstance(v, (int, float)) else "—"


def render(doc: dict[str, Any]) -> str:
    out = [
        f"{doc.get('machine', '?')}; binary {str(doc.get('commit', '?'))[:12]}; "
        f"whole run {seconds(doc.get('wall_s'))}.",
        "",
        "| program | outcome | snapshot | restore | image | driver restores |",
        "|---|---|---|---|---|---|",
    ]
    for p in doc["programs"]:
        size = p.get("snapshot_bytes")
        out.append(
            f"| {p['program']} | {p['outcome']}"
            + ("" if EXPECTED.get(p.get("expect", ""), p["outcome"]) == p["outcome"] else f" (expected {p['expect']})")
            + f" | {seconds(p.get('snapshot_s'))} | {seconds(p.get('restore_s'))} | "
            + (f"{size / 1e9:.2f} GB" if isinstance(size, int) else "—")
            + f" | {', '.join(map(str, p.get('attempts') or [])) or '—'} |"
        )
    out += [
        "",
        "| function | path | outcome | deploy | cold | warm | handler after restore | handler warm | answers identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in doc["functions"]:
        answers = f.get("answers") or []
        same = all(a.get("ok") for a in answers) and bool(answers)
        out.append(
            f"| {f['function']} | {f.get('path', 'transparent')} | {f['outcome']} | {seconds(f.get('deploy_s'))} | "
            f"{seconds(f.get('cold_s'))} | {millis(f.get('warm_s'))} | {millis(f.get('cold_handler_s'))} | "
            f"{millis(f.get('warm_handler_s'))} | {'yes' if same else 'no'} |"
        )
    s = doc["summary"]
    out += [
        "",
        "summary: " + ", ".join(f"{k} {s[k]}" for k in (
            "programs", "restored_identical", "refused_cleanly", "unhandled", "harmed_sources", "deployable_functions"
        )),
    ]
    return "\n".join(out)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench/results/compat-h100.json"
    print(render(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
