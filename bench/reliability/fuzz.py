#!/usr/bin/env python3
"""Runs the fuzz campaign (docs/fuzzing.md) and writes bench/results/fuzz.json: per target, the
cases asked for, the executions run (cases + replayed regressions + shrinking steps) and the
findings of this run, plus the findings fixed so far (each kept as a regression test).

    python3 bench/reliability/fuzz.py                   # the bounded campaign of `make test`
    PROPTEST_CASES=100000 TORPOR_FUZZ_EXAMPLES=20000 python3 bench/reliability/fuzz.py  # longer

Each fuzz test appends one JSON line per target to the file named by TORPOR_FUZZ_REPORT
(crates/torpor-image/tests/fuzz_support/mod.rs, tests/sdk/test_fuzz_spec.py); this script only
runs them and gathers the lines, so the counts are the tests' own.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "fuzz.json"

# Findings of the campaign so far, each fixed and kept by a regression test.
FIXED: list[dict[str, str]] = [
    {
        "target": "frames",
        "finding": "the worker frame codec allocated a frame's announced length (up to 64 MiB) before "
        "its bytes arrived: a worker could make the daemon hold 64 MiB per connection with 4 bytes",
        "fix": "crates/torpord/src/frames.rs grows the payload as bytes arrive",
        "regression": "crates/torpord/tests/fuzz_input.rs::a_frame_header_alone_does_not_allocate_its_length, "
        "crates/torpord/tests/fuzz-regressions/frames.txt",
    },
    {
        "target": "daemon_api",
        "finding": "a function name in a route's path was not checked: one axum could not decode was "
        "answered with axum's plain-text 400 instead of one JSON error line, and '..' or '/' reached "
        "the registry lookup",
        "fix": "crates/torpord/src/api/mod.rs FunctionName: spec.py's NAME_RE, else 400 in JSON",
        "regression": "crates/torpord/tests/fuzz_input.rs::fuzz_daemon_api, "
        "api::tests::function_names_are_spec_names_and_nothing_that_walks_a_path",
    },
    {
        "target": "daemon_api (slow client)",
        "finding": "no body read deadline: an authenticated client could trickle an invoke body for ever",
        "fix": "crates/torpord/src/api/body_deadline.rs: http.body_timeout_s, 408 with one JSON line",
        "regression": "tests/daemon/test_daemon_hostile.py::test_a_slow_body_is_refused_408_after_the_body_timeout",
    },
]


def run(cmd: list[str], env: dict[str, str]) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "fuzz.jsonl"
        env = dict(os.environ, TORPOR_FUZZ_REPORT=str(report))
        t = time.monotonic()
        rcs = {
            "cargo": run(
                ["cargo", "test", "-q", "-p", "torpord", "--test", "fuzz_input",
                 "-p", "torpor-image", "--test", "fuzz_image"],
                env,
            ),
            "pytest": run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sdk/test_fuzz_spec.py",
                 "tests/sdk/test_fuzz_workflow.py"],
                env,
            ),
        }
        elapsed = time.monotonic() - t
        lines = report.read_text().splitlines() if report.exists() else []
    targets: dict[str, Any] = {}
    for line in lines:
        row = json.loads(line)
        targets[row.pop("target")] = row
    doc = {
        "what": "fuzz campaign of every parser of untrusted bytes (docs/fuzzing.md)",
        "tools": {"rust": "proptest 1 (stable, inside cargo test)", "python": "Hypothesis"},
        "env": {
            "PROPTEST_CASES": os.environ.get("PROPTEST_CASES"),
            "TORPOR_FUZZ_EXAMPLES": os.environ.get("TORPOR_FUZZ_EXAMPLES"),
        },
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "seconds": round(elapsed, 1),
        "targets": targets,
        "executions": sum(int(t["executions"]) for t in targets.values()),
        "findings": sum(int(t["findings"]) for t in targets.values()),
        "fixed_findings": FIXED,
        "exit_codes": rcs,
    }
    OUT.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(targets)} targets, {doc['executions']} executions, "
          f"{doc['findings']} findings")
    return 0 if all(rc == 0 for rc in rcs.values()) and doc["findings"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
