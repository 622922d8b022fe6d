"""What a fork costs a process that holds memory: fork + exec + wait against posix_spawn + wait.

    python3 bench/coldstart/forkcost.py GIB [GIB ...]

For each size, a process touching GIB GiB of private memory (4 KiB pages) starts `/bin/true`
five times each way and prints the medians. torpord started CRIU by fork until session 49
(docs/lazy-pages.md, "CRIU started without a fork"); this is the measurement behind that.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable


def median_ms(f: Callable[[], None], n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def fork_exec() -> None:
    pid = os.fork()
    if pid == 0:
        os.execv("/bin/true", ["/bin/true"])
    os.waitpid(pid, 0)


def spawn() -> None:
    pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
    os.waitpid(pid, 0)


def main(sizes: list[float]) -> None:
    for gib in sizes:
        held = bytearray(int(gib * (1 << 30)))
        for i in range(0, len(held), 4096):
            held[i] = 1
        print(f"{gib} fork+exec+wait {median_ms(fork_exec):.2f} ms posix_spawn+wait {median_ms(spawn):.2f} ms", flush=True)
        del held


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]] or [0.0, 1.0])
