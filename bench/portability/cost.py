#!/usr/bin/env python3
"""What snapshot portability (issue 12 item 2) costs: hashing the files a restore reopens by path.

A snapshot records each reopened file's SHA-256 (torpor_image::reopened) and every restore checks
them through the node's hash cache. This measures, on one real program (tests/compat/programs,
default `sdpa_generate`: PyTorch and transformers on the GPU), side by side in one run:

- `identify_reopened_cold_s` / `_warm_s`: the snapshot's hashing with an empty cache (a node's
  first snapshot of such a worker) and with the cache the first one filled;
- `check_reopened_cold_s` / `_cached_s`: a restore's check with the cache deleted (another node's
  first restore) and with it kept (every later one);
- the restore's total both ways, and that the restored program answers its `check` identically.

    python3 bench/portability/cost.py [--program sdpa_generate] [--runs 3] [--out FILE]

Writes bench/results/portability-<device>.json (device, driver, versions, commit, every run,
medians, `summary`). On the GPU machine: `bash scripts/gpu-run.sh portability`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "compat"), str(ROOT / "tests")]

from run import PYTHON, Endpoint, Torpor, _machine, alive, ask  # noqa: E402

PHASE = re.compile(r"^phase (\S+) ([0-9.]+)$", re.MULTILINE)


def phases(stderr: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in PHASE.finditer(stderr)}


def kill_tree(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def one_run(torpor: Torpor, program: Path, work: Path, cache: Path) -> dict[str, Any]:
    endpoint = Endpoint(unix=str(work / "ctl.sock"))
    ready = work / "ready"
    r = torpor("run", "--log", work / "program.log", "--", PYTHON, str(program), "--unix", endpoint.unix or "",
               "--ready", str(ready), timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    source = int(r.stdout.split()[0])
    restored: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and alive(source) and time.monotonic() < deadline:
            time.sleep(0.2)
        before = ask(endpoint, "check", wait=5, timeout=120)
        assert before.startswith("ok "), before
        cache.unlink(missing_ok=True)
        row: dict[str, Any] = {"before": before}
        for name, extra in (("cold", ["--leave-running"]), ("warm", [])):
            snap = work / f"snap-{name}"
            t0 = time.monotonic()
            r = torpor("snapshot", "--pid", source, "--out", snap, "-v", *extra, timeout=600)
            assert r.returncode == 0, r.stderr
            row[f"snapshot_{name}_cache_s"] = round(time.monotonic() - t0, 3)
            row[f"identify_reopened_{name}_s"] = phases(r.stderr).get("identify_reopened")
        inspect = json.loads(torpor("inspect", work / "snap-warm", "--json", timeout=60).stdout)
        files = inspect.get("reopened_files") or []
        row["reopened_files"] = len(files)
        row["reopened_bytes"] = sum(int(f.get("size", 0)) for f in files)
        for name in ("cold", "cached"):
            if name == "cold":
                cache.unlink(missing_ok=True)
            t0 = time.monotonic()
            r = torpor("restore", work / "snap-warm", "--detach", "-v", timeout=600)
            assert r.returncode == 0, r.stderr
            row[f"restore_{name}_s"] = round(time.monotonic() - t0, 3)
            p = phases(r.stderr)
            row[f"check_reopened_{name}_s"] = p.get("check_reopened")
            pid = int(r.stdout.split()[0])
            restored.append(pid)
            after = ask(endpoint, "check", wait=5, timeout=120)
            row[f"after_{name}"] = after
            row[f"identical_{name}"] = after == before
            kill_tree(pid)
            time.sleep(1)
        return row
    finally:
        for pid in [source, *restored]:
            kill_tree(pid)


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 4) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="sdpa_generate")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--torpor", default=os.environ.get("TORPOR_BIN", str(ROOT / "target/release/torpor")))
    args = ap.parse_args()
    program = ROOT / "tests" / "compat" / "programs" / f"{args.program}.py"
    work = Path(tempfile.mkdtemp(prefix="torpor-portability-"))
    cache = work / "file-hashes.json"
    torpor = Torpor(Path(args.torpor), {**os.environ, "TORPOR_HASH_CACHE": str(cache)})
    rows = []
    try:
        for i in range(args.runs):
            run_dir = work / f"run{i}"
            run_dir.mkdir()
            rows.append(one_run(torpor, program, run_dir, cache))
            print(f"portability: run {i + 1}: {json.dumps(rows[-1])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("identify_reopened_cold_s", "identify_reopened_warm_s", "check_reopened_cold_s", "check_reopened_cached_s",
            "restore_cold_s", "restore_cached_s", "snapshot_cold_cache_s", "snapshot_warm_cache_s")  # fmt: skip
    summary: dict[str, Any] = {k: median(rows, k) for k in keys}
    summary["reopened_files"] = rows[-1]["reopened_files"] if rows else None
    summary["reopened_bytes"] = rows[-1]["reopened_bytes"] if rows else None
    summary["identical"] = all(r["identical_cold"] and r["identical_cached"] for r in rows)
    doc = {
        "what": "cost of the snapshot portability check (hashing reopened files), cold and cached",
        "program": args.program,
        "machine": _machine(),
        "commit": os.environ.get("TORPOR_COMMIT", ""),
        "runs": rows,
        "summary": summary,
    }
    out = args.out or ROOT / "bench" / "results" / "portability.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
