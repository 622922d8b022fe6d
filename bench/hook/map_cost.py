"""What mapping a restored instance's segments costs the worker, call by call (issue 18: the
`segments` phase of an 8B cold start, 0.09-0.12 s for 68 segments, is on its critical path).

The split restore hands each segment to the worker as an fd of the daemon's device memory; the
worker's hook imports it (cuMemImportFromShareableHandle), maps it at the segment's address
(cuMemMap) and grants access (cuMemSetAccess). This measures those three calls with the driver
alone (ctypes, no torch, no Torpor code), in the same shape: an exporter process creates and
exports N allocations and passes the fds over a Unix socket (SCM_RIGHTS) to an importer process
that maps them into one reserved range, back to back. Per layout it reports each call's total and
per-call median, serial and with 2 and 4 threads mapping at once (disjoint segments), and one
cuMemSetAccess over the whole range instead of one per segment.

    python3 bench/hook/map_cost.py [--layouts 64x256,64x16,8x2048] [--ordinal 0] > map-cost.json

Needs a CUDA GPU (libcuda.so.1); prints one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


class Driver:
    """The few driver calls used here; every failure raises with the call's name and code."""

    def __init__(self, ordinal: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.ordinal = ordinal
        self.check("cuInit", self.lib.cuInit(0))
        dev = ctypes.c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        self.ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self.current()

    @staticmethod
    def check(name: str, code: int) -> None:
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")

    def current(self) -> None:
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))

    def prop(self) -> AllocationProp:
        p = AllocationProp()
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        p.location = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal)
        return p

    def granularity(self) -> int:
        g = ctypes.c_size_t()
        p = self.prop()
        self.check(
            "cuMemGetAllocationGranularity",
            self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(p), CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        )
        return g.value

    def create(self, size: int) -> int:
        h = ctypes.c_ulonglong()
        p = self.prop()
        self.check("cuMemCreate", self.lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(p), ctypes.c_ulonglong(0)))
        return h.value

    def export(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.check(
            "cuMemExportToShareableHandle",
            self.lib.cuMemExportToShareableHandle(
                ctypes.byref(fd), ctypes.c_ulonglong(handle), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0)
            ),
        )
        return fd.value

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_ulonglong()
        self.check(
            "cuMemImportFromShareableHandle",
            self.lib.cuMemImportFromShareableHandle(
                ctypes.byref(h), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
        )
        return h.value

    def reserve(self, size: int, align: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.check(
            "cuMemAddressReserve",
            self.lib.cuMemAddressReserve(
                ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(align), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
            ),
        )
        return ptr.value

    def map(self, at: int, size: int, handle: int) -> None:
        self.check(
            "cuMemMap",
            self.lib.cuMemMap(ctypes.c_ulonglong(at), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)),
        )

    def set_access(self, at: int, size: int, flags: int) -> None:
        d = AccessDesc(MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal), flags)
        self.check(
            "cuMemSetAccess",
            self.lib.cuMemSetAccess(ctypes.c_ulonglong(at), ctypes.c_size_t(size), ctypes.byref(d), ctypes.c_size_t(1)),
        )

    def unmap(self, at: int, size: int) -> None:
        self.check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_ulonglong(at), ctypes.c_size_t(size)))

    def release(self, handle: int) -> None:
        self.check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_ulonglong(handle)))


def exporter(sock: socket.socket, ordinal: int, layouts: list[tuple[int, int]]) -> None:
    """Creates each layout's allocations once and sends their fds; waits for the importer."""
    drv = Driver(ordinal)
    for count, mib in layouts:
        size = mib << 20
        handles = [drv.create(size) for _ in range(count)]
        fds = [drv.export(h) for h in handles]
        for fd in fds:
            socket.send_fds(sock, [json.dumps({"size": size}).encode()], [fd])
            os.close(fd)
        sock.recv(1)  # the importer is done with this layout
        for h in handles:
            drv.release(h)
    sock.sendall(b"x")


def timed(fn: Any, *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def summary(xs: list[float]) -> dict[str, float]:
    return {"total_s": round(sum(xs), 6), "median_ms": round(statistics.median(xs) * 1e3, 4), "max_ms": round(max(xs) * 1e3, 4)}


def one_pass(drv: Driver, fds: list[int], size: int, base: int, threads: int, flags: int) -> dict[str, Any]:
    """Imports, maps and grants access to every fd at base + i * size, `threads` at a time;
    then unmaps and releases the imports (kept out of the figures)."""
    calls: dict[str, list[float]] = {"import": [], "map": [], "set_access": []}
    lock = threading.Lock()
    handles: list[int] = [0] * len(fds)

    def work(idx: list[int]) -> None:
        drv.current()
        mine: dict[str, list[float]] = {"import": [], "map": [], "set_access": []}
        for i in idx:
            t0 = time.perf_counter()
            h = drv.import_fd(fds[i])
            t1 = time.perf_counter()
            drv.map(base + i * size, size, h)
            t2 = time.perf_counter()
            drv.set_access(base + i * size, size, flags)
            t3 = time.perf_counter()
            handles[i] = h
            mine["import"].append(t1 - t0)
            mine["map"].append(t2 - t1)
            mine["set_access"].append(t3 - t2)
        with lock:
            for k, v in mine.items():
                calls[k] += v

    t = time.perf_counter()
    if threads == 1:
        work(list(range(len(fds))))
    else:
        ts = [threading.Thread(target=work, args=(list(range(k, len(fds), threads)),)) for k in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
    wall = time.perf_counter() - t
    unmap_s = timed(drv.unmap, base, size * len(fds))
    for h in handles:
        drv.release(h)
    return {"threads": threads, "wall_s": round(wall, 6), **{k: summary(v) for k, v in calls.items()}, "unmap_whole_s": round(unmap_s, 6)}


def one_access_pass(drv: Driver, fds: list[int], size: int, base: int, flags: int) -> dict[str, Any]:
    """Import and map each, then one cuMemSetAccess over the whole range."""
    t = time.perf_counter()
    handles = []
    for i, fd in enumerate(fds):
        h = drv.import_fd(fd)
        drv.map(base + i * size, size, h)
        handles.append(h)
    t_maps = time.perf_counter() - t
    access_s = timed(drv.set_access, base, size * len(fds), flags)
    wall = time.perf_counter() - t
    drv.unmap(base, size * len(fds))
    for h in handles:
        drv.release(h)
    return {"wall_s": round(wall, 6), "import_and_map_s": round(t_maps, 6), "one_set_access_s": round(access_s, 6)}


def importer(sock: socket.socket, ordinal: int, layouts: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    drv = Driver(ordinal)
    out: list[dict[str, Any]] = []
    for count, mib in layouts:
        fds: list[int] = []
        size = 0
        for _ in range(count):
            msg, got, _flags, _addr = socket.recv_fds(sock, 4096, 1)
            size = json.loads(msg)["size"]
            fds += got
        gran = drv.granularity()
        base = drv.reserve(size * count, max(gran, 2 << 20))
        passes: list[dict[str, Any]] = []
        for _ in range(repeats):
            for threads in (1, 2, 4):
                for flags, name in ((CU_MEM_ACCESS_FLAGS_PROT_READ, "read"), (CU_MEM_ACCESS_FLAGS_PROT_READWRITE, "readwrite")):
                    p = one_pass(drv, fds, size, base, threads, flags)
                    p["access"] = name
                    passes.append(p)
            p = one_access_pass(drv, fds, size, base, CU_MEM_ACCESS_FLAGS_PROT_READ)
            p["access"] = "read"
            p["threads"] = "one_set_access"
            passes.append(p)
        for fd in fds:
            os.close(fd)
        sock.sendall(b"x")
        out.append({"segments": count, "segment_mib": mib, "total_gib": round(count * size / 2**30, 3), "passes": passes})
    sock.recv(1)
    return {"layouts": out}


def medians(doc: dict[str, Any]) -> dict[str, Any]:
    """Per layout and way, the median wall over the repeats."""
    res: dict[str, Any] = {}
    for lay in doc["layouts"]:
        key = f"{lay['segments']}x{lay['segment_mib']}MiB"
        ways: dict[str, list[float]] = {}
        for p in lay["passes"]:
            ways.setdefault(f"{p['threads']}/{p['access']}", []).append(p["wall_s"])
        res[key] = {w: round(statistics.median(v), 6) for w, v in ways.items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="64x256,64x16,8x2048", help="COUNTxMIB,... segments to map")
    ap.add_argument("--ordinal", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", choices=("importer", "exporter"), help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    layouts = [(int(c), int(m)) for c, m in (x.split("x") for x in args.layouts.split(","))]
    if args.role == "exporter":
        exporter(socket.socket(fileno=args.fd), args.ordinal, layouts)
        return 0
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "exporter", "--fd", str(theirs.fileno()), "--layouts", args.layouts, "--ordinal", str(args.ordinal)],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    try:
        doc = importer(mine, args.ordinal, layouts, args.repeats)
    finally:
        if child.wait(timeout=120) != 0:
            print(f"map_cost: the exporter exited with {child.returncode}", file=sys.stderr)
    doc["median_wall_s"] = medians(doc)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
