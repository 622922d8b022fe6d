"""This disk's raw streaming read, the ceiling of a restore from disk (mode `cold-disk` of
split.py, and the peer benchmark's): one file read start to end in 4 MiB blocks, by 1 and by N
readers at once (each its own contiguous range), with O_DIRECT (no page cache) and buffered with
the page cache dropped first (root). Run as root on the machine to measure:

    python3 bench/coldstart/disk_read.py FILE [--readers 1,8,16] [--repeats 3] [--out JSON]

FILE should be at least a few GiB and on the disk the chunk store lives on (e.g. a model's
weights). Prints GB/s per (mode, readers): the median of the repeats, and each repeat.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

BLOCK = 4 << 20


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def read_range(path: Path, start: int, end: int, direct: bool, errors: list[BaseException]) -> None:
    try:
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags)
        # Page-aligned, as O_DIRECT requires.
        buf = mmap.mmap(-1, BLOCK)
        view = memoryview(buf)
        try:
            at = start
            while at < end:
                n = os.preadv(fd, [view[: min(BLOCK, end - at) if not direct else BLOCK]], at)
                if n <= 0:
                    break
                at += n
        finally:
            view.release()
            buf.close()
            os.close(fd)
    except BaseException as e:  # reported by the caller
        errors.append(e)


def one(path: Path, size: int, readers: int, direct: bool) -> float:
    """GB/s of one read of the whole file by `readers` threads."""
    per = -(-size // readers)
    per = -(-per // BLOCK) * BLOCK
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=read_range, args=(path, k * per, min(size, (k + 1) * per), direct, errors))
        for k in range(readers)
        if k * per < size
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return size / secs / 1e9


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path)
    p.add_argument("--readers", default="1,8,16", help="comma list of reader counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    a = p.parse_args(argv)
    try:
        readers = [int(r) for r in a.readers.split(",") if r.strip()]
    except ValueError:
        p.error(f"--readers {a.readers!r}: a comma list of integers, e.g. 1,8,16")
    if not readers or min(readers) < 1 or a.repeats < 1:
        p.error("--readers takes counts >= 1 and --repeats a count >= 1")
    if not a.file.is_file():
        p.error(f"{a.file}: no such file (give a large file on the disk to measure)")
    size = a.file.stat().st_size
    results: list[dict[str, Any]] = []
    for mode in ("direct", "buffered"):
        for n in readers:
            runs = []
            for _ in range(a.repeats):
                dropped = drop_page_cache() if mode == "buffered" else None
                runs.append(round(one(a.file, size, n, mode == "direct"), 3))
            row: dict[str, Any] = {"mode": mode, "readers": n, "gbps_median": statistics.median(runs), "gbps": runs}
            if mode == "buffered":
                row["page_cache_dropped"] = dropped
            results.append(row)
            print(f"{mode:8} {n:3} reader(s): {row['gbps_median']:.2f} GB/s  (runs {runs})", flush=True)
    if a.out:
        doc = {"benchmark": "disk-read", "file": str(a.file), "bytes": size, "block": BLOCK, "results": results}
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
