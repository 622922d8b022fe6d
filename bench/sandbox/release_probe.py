"""Does a process survive the CUDA driver's checkpoint in place (torpord's GPU release), after
requests ran the way a sandbox runs them?

On the H200 (session 35) restored sandbox workers died, SIGSEGV in libcuda, within 0.1-0.3 s of
their GPU release, while single-function workers in the same runs did not. A sandbox differs in
how it runs a request: on a thread of its own, on a CUDA stream of its own
(torpor.gpu.request_stream), with a memory pool of its own (torpor.mempool) that an idle timer or
torpord's `release_memory` gives back. This probe takes those apart in a plain process (no CRIU,
no daemon): a child runs rounds of work in one of several ways, and the parent locks and
checkpoints it, waits, checks the child is alive, restores and unlocks it, and asks for the next
round. The last variant frees CUDA memory while the driver holds the child checkpointed, as the
sandboxes' pool release did.

    python3 bench/sandbox/release_probe.py [--cycles 3] [--variants main,threads,...] [--out F]

Writes JSON: per variant, per cycle, whether the child lived through the checkpoint, its exit
signal if not, and the NVRM lines the kernel log gained (where dmesg can be read).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

Json = dict[str, Any]

# How each variant runs one round of work in the child: threads (0: the main thread), whether
# each thread takes a stream of its own, whether the threads stay alive after their work.
VARIANTS: dict[str, Json] = {
    "main": {"threads": 0, "streams": False, "conv": True, "keep_threads": False},
    "threads": {"threads": 4, "streams": False, "conv": True, "keep_threads": False},
    "threads-streams": {"threads": 4, "streams": True, "conv": True, "keep_threads": False},
    "threads-streams-matmul": {"threads": 4, "streams": True, "conv": False, "keep_threads": False},
    "kept-threads-streams": {"threads": 4, "streams": True, "conv": True, "keep_threads": True},
    "main-streams": {"threads": 0, "streams": True, "conv": True, "keep_threads": False},
    # What the sandboxes did: the harness gave a pool's memory back (PyTorch frees its blocks,
    # cudaFree) while the driver held the process checkpointed.
    "free-while-checkpointed": {"threads": 0, "streams": False, "conv": True, "keep_threads": False,
                                "free_while_checkpointed": True},
    # The same through the device-memory hook, as in a split worker: LD_PRELOAD=$TORPOR_HOOK_LIB
    # with TORPOR_HOOK_CUDA=1, so the kept 256 MiB block is a hook segment whose cudaFree the
    # hook serves with VMM calls (the likelier difference from a plain process; not run yet).
    "hook-free-while-checkpointed": {"threads": 0, "streams": False, "conv": True, "keep_threads": False,
                                     "free_while_checkpointed": True, "hook": True},
}


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _Args64(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def child(variant: str) -> None:
    """Runs a round of work per line read from stdin, answering `done` (or the error)."""
    import torch

    v = VARIANTS[variant]
    x = torch.randn(2048, 2048, device="cuda")
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
    img = torch.randn(8, 64, 56, 56, device="cuda")
    parked: list[threading.Event] = []

    def work() -> None:
        ctx = torch.cuda.stream(torch.cuda.Stream()) if v["streams"] else contextlib.nullcontext()
        with ctx:
            for _ in range(20):
                y = x @ x
                if v["conv"]:
                    y = conv(img)
            torch.cuda.current_stream().synchronize()
        del y

    def work_then_park(ev: threading.Event) -> None:
        work()
        ev.wait()

    kept: list[Any] = []
    for line in sys.stdin:
        if line.strip() == "free":
            # Asked while checkpointed: drop what the last round kept and empty the cache.
            kept.clear()
            torch.cuda.empty_cache()
            print("freed", flush=True)
            continue
        if line.strip() != "round":
            break
        try:
            if v.get("free_while_checkpointed"):
                kept.append(torch.randn(64 << 20, device="cuda"))
            if v["threads"] == 0:
                work()
            else:
                ts = []
                for _ in range(v["threads"]):
                    if v["keep_threads"]:
                        ev = threading.Event()
                        parked.append(ev)
                        ts.append(threading.Thread(target=work_then_park, args=(ev,), daemon=True))
                    else:
                        ts.append(threading.Thread(target=work))
                for t in ts:
                    t.start()
                if not v["keep_threads"]:
                    for t in ts:
                        t.join()
                else:
                    time.sleep(0.5)
            torch.cuda.synchronize()
            print("done", flush=True)
        except Exception as e:  # the parent records it
            print(f"error {type(e).__name__}: {e}", flush=True)


def nvrm_lines() -> list[str]:
    r = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    return [x for x in r.stdout.splitlines() if "NVRM" in x or "segfault" in x]


def check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def child_env(variant: str) -> dict[str, str]:
    """The child's environment: the hook preloaded for a variant that asks for it."""
    env = dict(os.environ)
    if VARIANTS[variant].get("hook"):
        env["LD_PRELOAD"] = os.environ["TORPOR_HOOK_LIB"]
        env["TORPOR_HOOK_CUDA"] = "1"
    return env


def probe(variant: str, cycles: int, idle_s: float, wait_s: float) -> Json:
    p = subprocess.Popen(
        [sys.executable, __file__, "--child", variant],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(variant),
    )
    assert p.stdin is not None and p.stdout is not None
    lib = ctypes.CDLL("libcuda.so.1")
    check(lib, lib.cuInit(0), "cuInit")
    runs: list[Json] = []
    out: Json = {"variant": variant, "how": VARIANTS[variant], "cycles": runs}
    try:
        for cycle in range(cycles):
            p.stdin.write("round\n")
            p.stdin.flush()
            answer = p.stdout.readline().strip()
            run: Json = {"cycle": cycle, "round": answer}
            runs.append(run)
            if answer != "done":
                run["exit"] = p.poll()
                break
            time.sleep(idle_s)
            before = len(nvrm_lines())
            lock = _LockArgs(timeout_ms=10000)
            check(lib, lib.cuCheckpointProcessLock(p.pid, ctypes.byref(lock)), "lock")
            check(lib, lib.cuCheckpointProcessCheckpoint(p.pid, ctypes.byref(_Args64())), "checkpoint")
            if VARIANTS[variant].get("free_while_checkpointed"):
                p.stdin.write("free\n")
                p.stdin.flush()
                # The child either crashes, waits for the restore, or frees: read its answer
                # in a thread, with the checkpoint still held for wait_s.
                got: list[str] = []
                reader = threading.Thread(target=lambda: got.append(p.stdout.readline().strip()), daemon=True)
                reader.start()
                reader.join(wait_s)
                run["free_answer_while_checkpointed"] = got[0] if got else None
            else:
                time.sleep(wait_s)
            run["alive_after_checkpoint"] = p.poll() is None
            run["nvrm_lines"] = len(nvrm_lines()) - before
            if not run["alive_after_checkpoint"]:
                rc = p.returncode
                run["exit"] = rc
                run["signal"] = signal.Signals(-rc).name if rc is not None and rc < 0 else None
                break
            check(lib, lib.cuCheckpointProcessRestore(p.pid, None), "restore")
            check(lib, lib.cuCheckpointProcessUnlock(p.pid, None), "unlock")
            if VARIANTS[variant].get("free_while_checkpointed") and run["free_answer_while_checkpointed"] is None:
                # It waited: its answer comes after the restore.
                reader.join(10)
                run["free_answer_after_restore"] = got[0] if got else None
    except RuntimeError as e:
        out["error"] = str(e)
        out["exit"] = p.poll()
    finally:
        p.kill()
        p.wait()
    out["survived"] = all(r.get("alive_after_checkpoint") for r in runs) and len(runs) == cycles and "error" not in out
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=0.3, help="idle between a round and its checkpoint")
    ap.add_argument("--wait-s", type=float, default=0.5, help="checkpointed this long before the check")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return 0
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"release_probe.py: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    hook = os.environ.get("TORPOR_HOOK_LIB")
    if any(VARIANTS[v].get("hook") for v in variants) and not (hook and os.path.isfile(hook)):
        print(
            "release_probe.py: a hook variant needs TORPOR_HOOK_LIB naming libtorpor_hook.so "
            "(cargo build -p torpor-hook --lib, or the carried .gpu/libtorpor_hook.so)",
            file=sys.stderr,
        )
        return 2
    import torch

    results = []
    for v in variants:
        r = probe(v, a.cycles, a.idle_s, a.wait_s)
        print(json.dumps({k: r[k] for k in ("variant", "survived")} | {"cycles": r["cycles"]}), flush=True)
        results.append(r)
    doc: Json = {
        "benchmark": "sandbox-release-probe",
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "driver": subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, check=False,
            ).stdout.strip(),
        },
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
        or os.environ.get("TORPOR_COMMIT", ""),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"cycles": a.cycles, "idle_s": a.idle_s, "wait_s": a.wait_s},
        "results": results,
        "summary": {r["variant"]: r["survived"] for r in results},
    }
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
