"""Does torpord's driver work slow a worker's mapping of store memory down, and what does the
close of an exported fd cost while another process maps its memory? (issue 11's ≤ 1 ms for a
100 MB hand-off between sandboxes; docs/sandboxes.md, "A hand-off between sandboxes, step by
step").

`bench/sandbox/vmm_steps.py` times the VMM calls of a hand-off in one process. A real hand-off
runs them in two: torpord creates and exports the memory, the worker imports and maps the fd it
is sent; and right after answering, torpord makes the next put's memory (create, export) or
drops a consumed value (close its exported fd, release its handle) while the worker maps. This
probe runs the two roles as two processes on GPU 0 (the owner, torpord's role, sends each
export to the mapper over a Unix socket, SCM_RIGHTS) and times, `--rounds` times each:

- `quiet`: the mapper's import, reserve, map, set access, unmap, with the owner idle;
- `owner_busy`: the same while a thread of the owner makes and drops exported memory of the size
  back to back (create, export, close, release), as torpord's spares and releases do;
- the owner's close of its exported fd and release of its handle while the mapper still maps the
  memory (`close_while_mapped`, `release_while_mapped`) and after it let go of it
  (`close_after`, `release_after`).

    python3 bench/sandbox/vmm_contention.py [--mib 100] [--rounds 15] [--out FILE]
    python3 bench/sandbox/vmm_contention.py --table FILE     # the table of a JSON it wrote

Writes JSON (every round, medians) to --out, default bench/results/sandbox-vmm-contention-h100.json,
and prints the medians.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import vmm_steps  # noqa: E402  (the driver's VMM calls, typed)

u64 = ctypes.c_uint64


def context(cuda: vmm_steps.Driver) -> None:
    cuda("cuInit", 0)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cuda("cuDeviceGet", ctypes.byref(dev), 0)
    cuda("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cuda("cuCtxSetCurrent", ctx)


def prop_and_padded(cuda: vmm_steps.Driver, size: int) -> tuple[Any, int]:
    prop = vmm_steps.AllocProp()
    prop.type = vmm_steps.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = vmm_steps.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = vmm_steps.Location(vmm_steps.CU_MEM_LOCATION_TYPE_DEVICE, 0)
    gran = ctypes.c_size_t()
    cuda("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), vmm_steps.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    return prop, -(-size // gran.value) * gran.value


def exported(cuda: vmm_steps.Driver, size: int, prop: Any) -> tuple[int, int]:
    """New memory of `size` bytes and an fd of it: (handle, fd)."""
    handle, fd = u64(), ctypes.c_int()
    cuda("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
    cuda("cuMemExportToShareableHandle", ctypes.byref(fd), handle.value, vmm_steps.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    return handle.value, fd.value


def send(sock: socket.socket, msg: dict[str, Any], fd: int | None = None) -> None:
    data = (json.dumps(msg) + "\n").encode()
    if fd is None:
        sock.sendall(data)
    else:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv(sock: socket.socket) -> tuple[dict[str, Any], int | None]:
    data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4))
    fd = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fd = array.array("i", payload[:4])[0]
    if not data:
        raise EOFError("the other side went away")
    return json.loads(data), fd


def mapper(sock_fd: int) -> int:
    """The worker's role: maps every fd it is sent read-only, answers the times, and lets the
    mapping go when told."""
    cuda = vmm_steps.Driver()
    context(cuda)
    sock = socket.socket(fileno=sock_fd)
    held: tuple[int, int, int] | None = None
    while True:
        msg, fd = recv(sock)
        took: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            took[name] = now - t
            t = now

        if msg["do"] == "map":
            assert fd is not None
            size = int(msg["bytes"])
            h, va = u64(), u64()
            cuda("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd), vmm_steps.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            lap("import")
            cuda("cuMemAddressReserve", ctypes.byref(va), size, 0, 0, 0)
            lap("reserve")
            cuda("cuMemMap", va.value, size, 0, h.value, 0)
            lap("map")
            desc = vmm_steps.AccessDesc(vmm_steps.Location(vmm_steps.CU_MEM_LOCATION_TYPE_DEVICE, 0), vmm_steps.PROT_READ)
            cuda("cuMemSetAccess", va.value, size, ctypes.byref(desc), 1)
            lap("set_access")
            cuda("cuMemRelease", h.value)
            lap("release_import")
            held = (va.value, size, fd)
        elif msg["do"] == "unmap":
            assert held is not None
            va_, size, fd_ = held
            cuda("cuMemUnmap", va_, size)
            lap("unmap")
            cuda("cuMemAddressFree", va_, size)
            lap("address_free")
            os.close(fd_)
            lap("close_fd")
            held = None
        elif msg["do"] == "exit":
            return 0
        send(sock, took)


def let_go(cuda: vmm_steps.Driver, fd: int, handle: int, took: dict[str, float], when: str) -> None:
    """The owner closes its exported fd and releases its handle, each timed into `took`."""
    t = time.perf_counter()
    os.close(fd)
    took[f"close_{when}"] = time.perf_counter() - t
    t = time.perf_counter()
    cuda("cuMemRelease", handle)
    took[f"release_{when}"] = time.perf_counter() - t


def owner_noise(cuda: vmm_steps.Driver, size: int, prop: Any, stop: threading.Event, counted: list[int]) -> None:
    """torpord's background work, back to back: exported memory made and dropped."""
    while not stop.is_set():
        handle, fd = exported(cuda, size, prop)
        os.close(fd)
        cuda("cuMemRelease", handle)
        counted[0] += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT.parents[1] / "bench" / "results" / "sandbox-vmm-contention-h100.json")
    ap.add_argument("--table", type=Path, help="only print the table of this JSON")
    ap.add_argument("--role", choices=["owner", "mapper"], default="owner", help=argparse.SUPPRESS)
    ap.add_argument("--sock-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.role == "mapper":
        return mapper(args.sock_fd)
    cuda = vmm_steps.Driver()
    context(cuda)
    prop, size = prop_and_padded(cuda, args.mib << 20)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "mapper", "--sock-fd", str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    runs: dict[str, list[dict[str, float]]] = {"quiet": [], "owner_busy": []}
    noise_made = [0]
    try:
        for scenario in ("quiet", "owner_busy", "quiet"):
            stop = threading.Event()
            noise = None
            if scenario == "owner_busy":
                noise = threading.Thread(target=owner_noise, args=(cuda, size, prop, stop, noise_made), daemon=True)
                noise.start()
                time.sleep(0.05)
            for i in range(args.rounds + 1):
                handle, fd = exported(cuda, size, prop)
                send(ours, {"do": "map", "bytes": size}, fd)
                mapped, _ = recv(ours)
                round_: dict[str, float] = {f"map_{k}": v for k, v in mapped.items()}
                # Which close is the expensive one: with the other process still mapping, or after.
                close_first = scenario == "quiet" and i % 2 == 0
                if close_first:
                    let_go(cuda, fd, handle, round_, "while_mapped")
                send(ours, {"do": "unmap"})
                unmapped, _ = recv(ours)
                round_.update({f"unmap_{k}": v for k, v in unmapped.items()})
                if not close_first:
                    let_go(cuda, fd, handle, round_, "after")
                if i > 0:  # the first round of each scenario warms up
                    runs[scenario].append(round_)
            stop.set()
            if noise is not None:
                noise.join()
        send(ours, {"do": "exit"})
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    medians: dict[str, dict[str, float]] = {}
    for scenario, rs in runs.items():
        keys = sorted({k for r in rs for k in r})
        medians[scenario] = {k: round(statistics.median(r[k] for r in rs if k in r) * 1e3, 4) for k in keys}
    summary = {"median_ms": medians, "owner_busy_allocations": noise_made[0]}
    doc = vmm_steps.write_doc(args.out, summary, {"bytes": size, "rounds": args.rounds}, {"runs": runs})
    print(table(doc))
    return 0


# The rows of the table, in a hand-off's order.
ROWS = (
    "map_import", "map_reserve", "map_map", "map_set_access", "map_release_import", "unmap_unmap", "unmap_address_free",
    "unmap_close_fd", "close_while_mapped", "release_while_mapped", "close_after", "release_after",
)


def table(doc: dict[str, Any]) -> str:
    """The medians (ms) of each step, the owner idle and busy (docs/sandboxes.md quotes it)."""
    medians = doc["summary"]["median_ms"]
    lines = ["| step (ms) | owner idle | owner busy |", "|---|---|---|"]
    for k in ROWS:
        cells = [f"{medians[s][k]:.3f}" if k in medians[s] else "–" for s in ("quiet", "owner_busy")]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
