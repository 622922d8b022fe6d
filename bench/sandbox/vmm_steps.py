"""What each CUDA driver call of a GPU hand-off between sandboxes costs, alone (issue 11's
≤ 1 ms for 100 MB on one GPU; docs/sandboxes.md, "A hand-off between sandboxes, step by step").

torpord's store puts a CUDA value into memory it creates exportable (`cuMemCreate` with a POSIX
fd handle, `cuMemExportToShareableHandle`: torpor-device's cuda backend); the putter imports
that fd, reserves addresses, maps, grants itself read-write, copies the value in, synchronises
and unmaps; the getter imports, reserves, maps read-only. This probe runs exactly those calls in
one process on GPU 0, each timed on its own (`--rounds` times for each size), with a device to
device copy of the size in the middle, and the calls around them that a hand-off also makes
(the primary context made current and released, an idle `cuCtxSynchronize`).

    python3 bench/sandbox/vmm_steps.py [--sizes-mib 2,100,1024] [--rounds 10] [--out FILE]
    python3 bench/sandbox/vmm_steps.py --table FILE     # the table of a JSON it wrote

Writes JSON (every round, medians per step and size) to --out, default
bench/results/sandbox-vmm-steps-h100.json; prints a table of the medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# The driver's VMM structs, as bench/hook/map_cost.py declares them.
sys.path.insert(0, str(ROOT / "bench" / "hook"))
import map_cost  # type: ignore[import-not-found]  # noqa: E402

Location, AllocProp, AccessDesc = map_cost.MemLocation, map_cost.AllocationProp, map_cost.AccessDesc
PROT_READ, PROT_READWRITE = map_cost.CU_MEM_ACCESS_FLAGS_PROT_READ, map_cost.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
CU_MEM_ALLOCATION_TYPE_PINNED = map_cost.CU_MEM_ALLOCATION_TYPE_PINNED
CU_MEM_LOCATION_TYPE_DEVICE = map_cost.CU_MEM_LOCATION_TYPE_DEVICE
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = map_cost.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
CU_MEM_ALLOC_GRANULARITY_MINIMUM = map_cost.CU_MEM_ALLOC_GRANULARITY_MINIMUM


class Driver:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL(os.environ.get("TORPOR_LIBCUDA") or "libcuda.so.1")
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        lib = self.lib
        lib.cuMemCreate.argtypes = [ctypes.POINTER(u64), size, ctypes.POINTER(AllocProp), u64]
        lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, u64, ctypes.c_int, u64]
        lib.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
        lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size, size, u64, u64]
        lib.cuMemAddressFree.argtypes = [u64, size]
        lib.cuMemMap.argtypes = [u64, size, size, u64, u64]
        lib.cuMemUnmap.argtypes = [u64, size]
        lib.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(AccessDesc), size]
        lib.cuMemRelease.argtypes = [u64]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, size, ctypes.c_void_p]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), size]
        lib.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(size), ctypes.POINTER(AllocProp), ctypes.c_int]

    def __call__(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")


def one_round(cuda: Driver, size: int, src: int, prop: Any) -> dict[str, float]:
    """Every call of one hand-off of `size` bytes, timed apart (seconds)."""
    took: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        took[name] = took.get(name, 0.0) + now - t
        t = now

    u64 = ctypes.c_uint64
    # The daemon: create and export.
    handle = u64()
    cuda("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
    lap("create")
    fd = ctypes.c_int()
    cuda("cuMemExportToShareableHandle", ctypes.byref(fd), handle.value, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    lap("export")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    # The putter: its GPU's primary context current (torpor.cuda_driver.on_device).
    cuda("cuDeviceGet", ctypes.byref(dev), 0)
    cuda("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cuda("cuCtxSetCurrent", ctx)
    lap("put_context")
    for writable in (True, False):
        side = "put" if writable else "get"
        imported = u64()
        cuda("cuMemImportFromShareableHandle", ctypes.byref(imported), ctypes.c_void_p(fd.value), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        lap(f"{side}_import")
        va = u64()
        cuda("cuMemAddressReserve", ctypes.byref(va), size, 0, 0, 0)
        lap(f"{side}_reserve")
        cuda("cuMemMap", va.value, size, 0, imported.value, 0)
        lap(f"{side}_map")
        desc = AccessDesc(Location(CU_MEM_LOCATION_TYPE_DEVICE, 0), PROT_READWRITE if writable else PROT_READ)
        cuda("cuMemSetAccess", va.value, size, ctypes.byref(desc), 1)
        lap(f"{side}_set_access")
        cuda("cuMemRelease", imported.value)
        lap(f"{side}_release_import")
        if writable:
            cuda("cuCtxSynchronize")
            lap("put_sync_before")
            cuda("cuMemcpyDtoDAsync_v2", va.value, src, size, None)
            cuda("cuCtxSynchronize")
            lap("put_copy")
        cuda("cuCtxSynchronize")
        lap(f"{side}_sync_unmap")
        cuda("cuMemUnmap", va.value, size)
        lap(f"{side}_unmap")
        cuda("cuMemAddressFree", va.value, size)
        lap(f"{side}_address_free")
    cuda("cuDevicePrimaryCtxRelease_v2", dev)
    lap("put_context_release")
    os.close(fd.value)
    lap("close_exported_fd")
    cuda("cuMemRelease", handle.value)
    lap("release")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="2,100,1024")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sandbox-vmm-steps-h100.json")
    ap.add_argument("--table", type=Path, help="only print the table of this JSON")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    sizes = [int(x) << 20 for x in args.sizes_mib.split(",")]
    cuda = Driver()
    cuda("cuInit", 0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cuda("cuDeviceGet", ctypes.byref(dev), 0)
    cuda("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cuda("cuCtxSetCurrent", ctx)
    prop = AllocProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = Location(CU_MEM_LOCATION_TYPE_DEVICE, 0)
    gran = ctypes.c_size_t()
    cuda("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    src = ctypes.c_uint64()
    cuda("cuMemAlloc_v2", ctypes.byref(src), max(sizes))
    results: list[dict[str, Any]] = []
    for size in sizes:
        padded = -(-size // gran.value) * gran.value
        one_round(cuda, padded, src.value, prop)  # first use of the size: not counted
        runs = [one_round(cuda, padded, src.value, prop) for _ in range(args.rounds)]
        medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append({"bytes": padded, "runs": runs, "median_s": medians})
    summary = {f"{r['bytes'] >> 20}MiB_ms": {k: round(v * 1e3, 4) for k, v in r["median_s"].items()} for r in results}
    doc = write_doc(args.out, summary, {"rounds": args.rounds, "granularity": gran.value}, {"results": results})
    print(table(doc))
    return 0


def write_doc(out: Path, summary: dict[str, Any], settings: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """Writes a probe's JSON to `out` (the summary, the machine, the settings, every run, the
    commit, the date) and returns it."""
    doc = {
        "summary": summary,
        "machine": {"device": device_name(), "kernel": platform.release(), "python": platform.python_version()},
        "settings": settings,
        **runs,
        "commit": os.environ.get("TORPOR_COMMIT"),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def device_name() -> str:
    """The GPU's name and driver, as nvidia-smi gives them."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return os.environ.get("TORPOR_LIBCUDA", "unknown")  # the tests' fake driver, or no nvidia-smi


def table(doc: dict[str, Any]) -> str:
    """The medians of every step, one column per size (docs/sandboxes.md quotes it)."""
    results = doc["results"]
    lines = [
        "| step | " + " | ".join(f"{r['bytes'] >> 20} MiB (ms)" for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for k in results[0]["median_s"]:
        lines.append(f"| {k} | " + " | ".join(f"{r['median_s'][k] * 1e3:.3f}" for r in results) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
