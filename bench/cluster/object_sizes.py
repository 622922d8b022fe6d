"""The store's speed by object size: how fast SeaweedFS on loopback serves the same bytes as
objects of 4 to 128 MiB, GET whole `--streams` at a time (nothing of Torpor involved).

Why: a pull fetches a snapshot as ranged GETs of its packs (32 MiB objects, `objstore.range_bytes`
at most a pack). In session 55 (`bench/results/cluster-pull-s55-ranges-h200.json`) the store
served those packs in 32 MiB ranges at 5.4 GB/s, in 8 MiB ranges at 3.4 and in 4 MiB ranges at
2.2, against 7.6 GB/s for one 2 GiB object in 32 ranges: the store's cost per request, not per
byte, sets what a pull can get from it. This probe asks what larger packs would give.

    python3 bench/cluster/object_sizes.py [--sizes-mib 8,32,64,128] [--total-mib 2048] [--streams 32] --out FILE

Each size: `--total-mib` of random bytes PUT as objects of that size, then every object GET
whole, `--streams` at a time, best of `--repeats`; the bytes are dropped. `summary.by_object_mib`:
GB/s per size, and `summary.one_object_ranges_gbps`, one object of `--total-mib` GET in
`--streams` ranges (pull.py's raw transfer speed). Run as root or not; needs `weed` on PATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "cluster"))

import pull  # noqa: E402  (bench/cluster/pull.py: its signed requests, the store server)

Json = dict[str, object]


def sizes_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= 1024 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: takes MiB from 1 to 1024, comma-separated (e.g. 8,32,128)")
    return values


def one_size(port: int, mib: int, total: int, streams: int, repeats: int) -> Json:
    size = mib << 20
    count = max(1, total // size)
    body = os.urandom(size)
    keys = [f"sizes/{mib}/{i:05d}" for i in range(count)]
    t0 = time.perf_counter()
    for k in keys:
        pull.s3_request(port, "PUT", k, body=body)
    put_s = time.perf_counter() - t0
    rates = []
    for _ in range(repeats):
        got, wall = pull.parallel_gets(port, keys, streams)
        assert got == count * size, (got, count * size)
        rates.append(got / wall / 1e9)
    return {"object_bytes": size, "objects": count, "streams": streams, "put_gbps": round(count * size / put_s / 1e9, 3),
            "gbps_runs": [round(r, 3) for r in rates], "gbps": round(max(rates), 3),
            "gbps_median": round(statistics.median(rates), 3)}


def size_table(result: Json) -> str:
    """The markdown table of a run (docs/cluster.md, "Range sizes"), from its JSON."""
    by = result["by_object_mib"]
    assert isinstance(by, dict)
    one = result["summary"]["one_object_ranges_gbps"]  # type: ignore[index]
    head = "| objects of | " + " | ".join(f"{k} MiB" for k in by) + f" | one object in {result['streams']} ranges |"
    rows = [head, "|---" * (len(by) + 2) + "|",
            "| GB/s, best of 3 | " + " | ".join(f"{v['gbps']:.2f}" for v in by.values()) + f" | {one:.2f} |"]
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=sizes_list, default=[8, 32, 64, 128])
    p.add_argument("--total-mib", type=int, default=2048)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.total_mib < max(args.sizes_mib) or args.streams < 1 or args.repeats < 1:
        print("bench/cluster/object_sizes.py: --total-mib must hold one object of the largest size; "
              "--streams and --repeats at least 1", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="torpor-sizes-", dir="/var/tmp"))
    (work / "seaweed").mkdir()
    seaweed = pull.Seaweed(work / "seaweed", volumes=64, volume_mb=1024)
    pull.S3_HOST = seaweed.ip
    result: Json = {
        "what": "the store's speed by object size: SeaweedFS on loopback, the same bytes as objects of each size, GET whole",
        "machine": pull.machine(),
        "torpor_commit": os.environ.get("TORPOR_COMMIT"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "total_bytes": args.total_mib << 20,
        "streams": args.streams,
    }
    try:
        seaweed.create_bucket(pull.BUCKET)
        pull.STREAMS = args.streams
        one = pull.transfer_speed(seaweed.s3_port, args.total_mib << 20)
        by = {}
        for mib in args.sizes_mib:
            print(f"[sizes] objects of {mib} MiB", flush=True)
            by[str(mib)] = one_size(seaweed.s3_port, mib, args.total_mib << 20, args.streams, args.repeats)
            print(f"[sizes] {mib} MiB: {by[str(mib)]['gbps']} GB/s (runs {by[str(mib)]['gbps_runs']})", flush=True)
        result["one_object"] = one
        result["by_object_mib"] = by
        result["summary"] = {
            "one_object_ranges_gbps": one[f"get_{args.streams}_streams_gbps"],
            "by_object_mib": {k: v["gbps"] for k, v in by.items()},
        }
        print(f"[sizes] summary: {json.dumps(result['summary'])}", flush=True)
    finally:
        seaweed.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
