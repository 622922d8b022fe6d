#!/usr/bin/env python3
"""Does a page-faulting copy into fresh shared memory hold up another thread's mmap? The fair PCIe
test's small fill waited on the H100 machine in its `map` (a reserve and a MAP_FIXED mmap) for
the whole 1 GiB copy of a large fill into a new memfd (docs/sandboxes.md, "Fair PCIe"); this
takes the daemon out of it: one thread copies `--gib` into a new MAP_SHARED memfd mapping, in 16
MiB memmoves (ctypes releases the GIL), while the main thread times a 4 MiB PROT_NONE reserve
followed by a MAP_FIXED map of another memfd into it, every 10 ms. Prints one JSON line with the
copy's time, the mmap latencies (max, p50) and the machine's THP settings.

    python3 bench/pcie/mmap_contention.py [--gib 1]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import threading
import time
from pathlib import Path

PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
PIECE, SMALL = 16 << 20, 4 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    a = p.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    n = int(a.gib * (1 << 30)) // PIECE * PIECE
    src = mmap.mmap(-1, n)
    for off in range(0, n, PIECE):
        src[off : off + PIECE] = b"\x02" * PIECE
    src_at = ctypes.addressof(ctypes.c_char.from_buffer(src))
    big = os.memfd_create("copy-target")
    os.ftruncate(big, n)
    dst = libc.mmap(None, n, PROT_RW, MAP_SHARED, big, 0)
    small = os.memfd_create("small")
    os.ftruncate(small, SMALL)
    took: dict[str, float] = {}

    def copy() -> None:
        t = time.monotonic()
        for off in range(0, n, PIECE):
            ctypes.memmove(dst + off, src_at + off, PIECE)
        took["copy_s"] = time.monotonic() - t

    th = threading.Thread(target=copy)
    th.start()
    time.sleep(0.02)
    reserve, fixed = [], []
    while th.is_alive():
        t0 = time.monotonic()
        at = libc.mmap(None, SMALL, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        t1 = time.monotonic()
        libc.mmap(at, SMALL, PROT_RW, MAP_SHARED | MAP_FIXED, small, 0)
        t2 = time.monotonic()
        libc.munmap(at, SMALL)
        reserve.append(t1 - t0)
        fixed.append(t2 - t1)
        time.sleep(0.01)
    th.join()

    def thp(name: str) -> str:
        try:
            return Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError:
            return "?"

    out = {
        "bytes": n,
        **took,
        "samples": len(reserve),
        "reserve_max_s": max(reserve, default=0.0),
        "reserve_p50_s": statistics.median(reserve) if reserve else 0.0,
        "map_fixed_max_s": max(fixed, default=0.0),
        "map_fixed_p50_s": statistics.median(fixed) if fixed else 0.0,
        "thp": {k: thp(k) for k in ("enabled", "shmem_enabled", "defrag")},
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
