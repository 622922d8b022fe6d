"""How much of a split worker's CPU side is written between a pre-copy and its hibernation's stop,
tracked without soft-dirty (issue 10; docs/checkpoints.md, "Written pages without soft-dirty").

    PYTHONPATH=$PWD/python TORPOR_HOOK_LIB=.gpu/libtorpor_hook.so \\
        python3 bench/concurrent/written_pages.py [--model gpt2-large|ctx] [--idle-s 2] \\
        [--requests 3] --out FILE
    python3 bench/concurrent/written_pages.py --table FILE   # the Markdown docs/checkpoints.md quotes

Neither kernel we have tracks soft-dirty bits, so CRIU refuses pre-dumps and copies a worker's
whole CPU side inside a hibernation's stop (0.71 s of GPT-2-Large's 1.23 s, session 26).
userfaultfd's asynchronous write-protection and PAGEMAP_SCAN's PAGE_IS_WRITTEN (Linux 6.7) track
written pages without soft-dirty (bench/concurrent/uffd_wp_probe.c). A CRIU taught to use them
would copy, in the stop, only what was written since a pre-copy. This probe measures how much
that is, without CRIU, on the GPU machine:

The child (the worker's side, the model built with the device-memory hook as a split worker's:
TORPOR_HOOK_CUDA=1) answers requests, then, at time zero, where a pre-copy would have copied
everything, registers its private writable mappings for write-protection (asynchronous: no
handler, the kernel only clears a page's protection on its first write) and protects them. It
then idles `--idle-s` seconds, answers `--requests` more (an instance used again before it
hibernates) and runs the hibernation's quiet point (sync, `gc.collect()`, the context's stack
limit to 0, its segments released). At each step the parent (torpord's side) counts what CRIU
would copy (present, anonymous, not the zero page, in private writable mappings that are not
devices) and how much of it was written since time zero. Then it takes the driver's checkpoint
(which moves the context's residue into the process: new pages, written by definition) and
counts again, then restores the driver state in place and ends the child.

Memory the tracking cannot see is counted as written: mappings made after time zero (never
registered) and every page of a mapping whose registration failed.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "coldstart"))
import residue  # noqa: E402 (its driver calls and socket helpers)

Json = dict[str, Any]

SYS_USERFAULTFD = 323  # x86_64
O_CLOEXEC, O_NONBLOCK = 0o2000000, 0o4000
UFFD_API = 0xAA
UFFD_FEATURE_WP_UNPOPULATED, UFFD_FEATURE_WP_ASYNC = 1 << 13, 1 << 15
UFFDIO_REGISTER_MODE_WP, UFFDIO_WRITEPROTECT_MODE_WP = 1 << 1, 1 << 0
PAGE_IS_WRITTEN, PAGE_IS_FILE, PAGE_IS_PRESENT, PAGE_IS_SWAPPED, PAGE_IS_PFNZERO = 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5
PAGE = 4096


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


class _UffdioApi(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _UffdioRange(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _UffdioRegister(ctypes.Structure):
    _fields_ = [("range", _UffdioRange), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _UffdioWriteprotect(ctypes.Structure):
    _fields_ = [("range", _UffdioRange), ("mode", ctypes.c_uint64)]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _PmScanArg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


UFFDIO_API = _iowr(0xAA, 0x3F, ctypes.sizeof(_UffdioApi))
UFFDIO_REGISTER = _iowr(0xAA, 0x00, ctypes.sizeof(_UffdioRegister))
UFFDIO_WRITEPROTECT = _iowr(0xAA, 0x06, ctypes.sizeof(_UffdioWriteprotect))
PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_PmScanArg))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def _ioctl(fd: int, request: int, arg: ctypes.Structure) -> int:
    return int(_libc.ioctl(fd, request, ctypes.addressof(arg)))


def private_writable(pid: int) -> list[tuple[int, int, str]]:
    """(start, end, path) of `pid`'s private writable mappings that are not devices: what CRIU
    dumps the anonymous pages of."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split(maxsplit=5)
        path = f[5] if len(f) == 6 else ""
        if f[1][1] != "w" or f[1][3] != "p" or path.startswith("/dev/"):
            continue
        a, b = (int(x, 16) for x in f[0].split("-"))
        out.append((a, b, path))
    return out


# -- the child: the worker's side ---------------------------------------------------------------


def arm(pid: int) -> Json:
    """Registers this process's private writable mappings for asynchronous write-protection and
    protects them. Returns the uffd and what it covers."""
    uffd = _libc.syscall(SYS_USERFAULTFD, O_CLOEXEC | O_NONBLOCK)
    if uffd < 0:
        raise OSError(ctypes.get_errno(), "userfaultfd")
    api = _UffdioApi(UFFD_API, UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, 0)
    if _ioctl(uffd, UFFDIO_API, api) < 0:
        raise OSError(ctypes.get_errno(), "UFFDIO_API (WP_ASYNC needs Linux 6.7)")
    registered = failed = 0
    failed_paths: dict[str, int] = {}
    t = time.perf_counter()
    for a, b, path in private_writable(pid):
        reg = _UffdioRegister(_UffdioRange(a, b - a), UFFDIO_REGISTER_MODE_WP, 0)
        wp = _UffdioWriteprotect(_UffdioRange(a, b - a), UFFDIO_WRITEPROTECT_MODE_WP)
        if _ioctl(uffd, UFFDIO_REGISTER, reg) < 0 or _ioctl(uffd, UFFDIO_WRITEPROTECT, wp) < 0:
            failed += b - a
            key = path or "[anon]"
            failed_paths[key] = failed_paths.get(key, 0) + (b - a)
            continue
        registered += b - a
    return {"uffd": uffd, "registered_bytes": registered, "failed_bytes": failed,
            "failed_by_path": failed_paths, "arm_s": time.perf_counter() - t}


def child(model: str, idle_s: float, requests: int, fd: int) -> None:
    import torch

    from torpor import hook as torpor_hook

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd)
    h = torpor_hook.get()
    answer = residue.build(model)
    for _ in range(3):
        answer()
    torch.cuda.synchronize()
    # The deploy's quiet point, as torpor.worker runs it: what lived through it is frozen.
    gc.collect()
    gc.freeze()
    armed = arm(os.getpid())
    residue._send(sock, {"step": "armed"} | {k: v for k, v in armed.items() if k != "uffd"})
    residue._recv(sock)
    time.sleep(idle_s)
    residue._send(sock, {"step": "idle"})
    residue._recv(sock)
    t = time.perf_counter()
    for _ in range(requests):
        answer()
    torch.cuda.synchronize()
    residue._send(sock, {"step": "served", "requests_s": time.perf_counter() - t})
    residue._recv(sock)
    # The hibernation's quiet point (torpor.worker; torpor.gpu.shrink_context), then the
    # segments go (torpord holds their fds across the snapshot; here nobody needs them again).
    t = time.perf_counter()
    torch.cuda.synchronize()
    gc.collect()
    residue._set_limit(residue._cuda(), residue.CU_LIMIT_STACK_SIZE, 0)
    torch.cuda.synchronize()
    h.release_all()
    torch.cuda.synchronize()
    residue._send(sock, {"step": "quiet", "quiet_s": time.perf_counter() - t})
    # After the driver's checkpoint: the tracking ends before its restore in place, or not.
    msg, _ = residue._recv(sock)
    if msg.get("disarm"):
        os.close(armed["uffd"])
        residue._send(sock, {"disarmed": True})
        residue._recv(sock)  # the end


# -- the parent: torpord's side -----------------------------------------------------------------


def _scan(pagemap: int, start: int, end: int, written: bool) -> int:
    """Bytes of [start, end) that CRIU would dump (present, anonymous, not the zero page), and
    with `written` only those written since they were protected. Present only: a protected page
    never touched carries a PTE marker, which the scan reports as swapped (and neither machine
    swaps)."""
    cap = 4096
    vec = (_PageRegion * cap)()
    inverted = PAGE_IS_FILE | PAGE_IS_PFNZERO
    mask = inverted | PAGE_IS_PRESENT | (PAGE_IS_WRITTEN if written else 0)
    total, seen = 0, start
    while start < end:
        arg = _PmScanArg(ctypes.sizeof(_PmScanArg), 0, start, end, 0, ctypes.addressof(vec), cap, 0,
                         inverted, mask, 0, PAGE_IS_PRESENT | PAGE_IS_WRITTEN)
        n = _ioctl(pagemap, PAGEMAP_SCAN, arg)
        if n < 0:
            raise OSError(ctypes.get_errno(), "PAGEMAP_SCAN")
        for r in vec[:n]:
            # 6.18 can return the walk's tail again (bench/concurrent/uffd_wp_probe.c): skip it.
            lo = max(r.start, seen)
            if r.end > lo:
                total += r.end - lo
                seen = r.end
        if arg.walk_end <= start:
            break
        start = arg.walk_end
    return total


def count(pid: int) -> Json:
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        dumpable = written = 0
        t = time.perf_counter()
        for a, b, _path in private_writable(pid):
            dumpable += _scan(fd, a, b, written=False)
            written += _scan(fd, a, b, written=True)
        return {"dumpable_bytes": dumpable, "written_bytes": written, "rss_anon": residue._rss_anon(pid),
                "scan_s": round(time.perf_counter() - t, 4)}
    finally:
        os.close(fd)


def one(model: str, idle_s: float, requests: int, disarm: bool) -> Json:
    parent, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = os.environ | {"LD_PRELOAD": os.environ["TORPOR_HOOK_LIB"], "TORPOR_HOOK_CUDA": "1"}
    p = subprocess.Popen(
        [sys.executable, __file__, "--child", model, str(idle_s), str(requests), str(child_sock.fileno())],
        pass_fds=[child_sock.fileno()], env=env,
    )
    child_sock.close()
    lib = residue._cuda()
    residue._check(lib, lib.cuInit(0), "cuInit")
    steps: list[Json] = []
    out: Json = {"model": model, "idle_s": idle_s, "requests": requests, "disarmed_before_restore": disarm,
                 "steps": steps}
    try:
        for step in ("armed", "idle", "served", "quiet"):
            msg, _fds = residue._recv(parent)
            steps.append(msg | count(p.pid))
            if step != "quiet":
                residue._send(parent, {"go": True})
        lock, args = residue._LockArgs(timeout_ms=10000), residue._Args64()
        residue._check(lib, lib.cuCheckpointProcessLock(p.pid, ctypes.byref(lock)), "lock")
        t = time.perf_counter()
        residue._check(lib, lib.cuCheckpointProcessCheckpoint(p.pid, ctypes.byref(args)), "checkpoint")
        steps.append({"step": "driver_checkpoint", "checkpoint_s": time.perf_counter() - t} | count(p.pid))
        if disarm:
            residue._send(parent, {"disarm": True})
            residue._recv(parent)
        # Whether the driver restores in place a process whose memory is write-protected.
        try:
            residue._check(lib, lib.cuCheckpointProcessRestore(p.pid, None), "restore")
            residue._check(lib, lib.cuCheckpointProcessUnlock(p.pid, None), "unlock")
            out["restore"] = "ok"
        except RuntimeError as e:
            out["restore"] = str(e)
        residue._send(parent, {"end": True})
    finally:
        p.kill()
        p.wait()
        parent.close()
    last = steps[-1]
    out["summary"] = {
        "dumpable_bytes_at_stop": last["dumpable_bytes"],
        "written_bytes_at_stop": last["written_bytes"],
        "written_share_at_stop": round(last["written_bytes"] / max(1, last["dumpable_bytes"]), 4),
        "residue_bytes": last["dumpable_bytes"] - steps[-2]["dumpable_bytes"],
        "written_before_driver_checkpoint": steps[-2]["written_bytes"],
    }
    return out


STEP_NAMES = {"armed": "protected", "idle": "idle", "served": "requests", "quiet": "hibernation's quiet point",
              "driver_checkpoint": "driver's checkpoint"}


def table(doc: Json) -> str:
    """The Markdown table docs/checkpoints.md quotes: the first run's steps."""
    run = doc["runs"][0]
    rows = ["| step | CRIU would copy | written since the protection |", "|---|---|---|"]
    for st in run["steps"]:
        name = STEP_NAMES.get(st["step"], st["step"])
        if st["step"] == "idle":
            name = f"idle {run['idle_s']:g} s"
        elif st["step"] == "served":
            name = f"{run['requests']} requests"
        rows.append(f"| {name} | {st['dumpable_bytes'] / 1e9:.2f} GB | {st['written_bytes'] / 1e9:.3f} GB |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1], float(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    if argv[:1] == ["--table"]:
        print(table(json.loads(Path(argv[1]).read_text())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=residue.MODELS, default="gpt2-large")
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--restore-armed", action="store_true",
                    help="restore the driver state in place with the tracking still on (default: ended first)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    runs = []
    for i in range(a.runs):
        r = one(a.model, a.idle_s, a.requests, disarm=not a.restore_armed)
        print(f"run {i + 1}: restore {r['restore']}; {json.dumps(r['summary'])}", flush=True)
        runs.append(r)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False).stdout.strip()
    doc = {
        "what": "bytes a split worker writes between a pre-copy and its hibernation's stop (uffd-wp async)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": smi, "kernel": os.uname().release},
        "torpor_commit": os.environ.get("TORPOR_COMMIT", ""),
        "runs": runs,
        # Medians over the runs.
        "summary": {k: statistics.median(r["summary"][k] for r in runs) for k in runs[0]["summary"]} if runs else {},
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
