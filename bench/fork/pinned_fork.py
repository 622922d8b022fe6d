"""Does pinned host memory make fork() slow or copied? (session 29, docs/gpu-machine.md)

torpord pins its host cache (4 GiB by default) with cuMemHostAlloc at start, and then forks
workers, CRIU and page servers. A private anonymous mapping pinned for DMA is copied page by page
at fork (the kernel cannot share a page a device writes); this measures what the driver's mapping
is and what a fork costs beside it:

    python3 bench/fork/pinned_fork.py    # on a machine with an NVIDIA GPU; prints JSON

Measured on the H100: the mapping is shared (`rw-s`, /dev/zero), so fork shares it, and a fork
took 1.3-1.8 ms against 1.0-1.7 ms before the pin (bench/results/pinned-fork-facts-s29-h100.txt).
"""

from __future__ import annotations

import ctypes
import json
import os
import time

GIB = 1 << 30


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what}: CUresult {rc}")


def fork_ms(n: int = 5) -> list[tuple[float, float]]:
    """(fork, fork + waitpid) in ms, n times; the child exits at once."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        t1 = time.perf_counter()
        os.waitpid(pid, 0)
        t2 = time.perf_counter()
        out.append((round((t1 - t) * 1e3, 2), round((t2 - t) * 1e3, 2)))
    return out


def vma_of(addr: int) -> tuple[str, str, str] | None:
    """The /proc/self/smaps header, size and VmFlags of the mapping holding `addr`."""
    cur: tuple[int, int, str] | None = None
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            cur = (lo, hi, line.strip())
        elif line.startswith("VmFlags") and cur and cur[0] <= addr < cur[1]:
            return (cur[2], hex(cur[1] - cur[0]), line.strip())
    return None


def main() -> None:
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    res: dict[str, object] = {"no_pin_fork_ms(fork, fork+wait)": fork_ms()}
    p = ctypes.c_void_p()
    t = time.perf_counter()
    check(cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(4 * GIB), 0), "cuMemHostAlloc")
    res["pin_s"] = round(time.perf_counter() - t, 3)
    res["pinned_vma"] = vma_of(p.value or 0)
    res["pin_fork_ms(fork, fork+wait)"] = fork_ms()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
