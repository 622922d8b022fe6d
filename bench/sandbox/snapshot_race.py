"""Does counting a function pool's bytes kill a sandbox worker? (docs/sandboxes.md, "A pool's
bytes"). Two threads for 3 s, as two functions of a sandbox: one serves requests in its pool
(torpor.mempool.FunctionPool.request, which counts the pool's bytes at each request's end), the
other allocates in a pool of its own and gives it back after each request (release: the MemPool
dropped). Each variant runs N times in a fresh interpreter; a death by a signal is a crash.

    as_is        torpor.mempool as it is
    no_count     the count left out (_torch_pools_bytes answers 0)
    pool_snap    the count by MemPool.snapshot(), PyTorch's snapshot of one pool (before 1de50b8)
    gc_off       as_is with Python's cyclic GC off (is a MemPool dropped by the GC at a random time?)

    python3 bench/sandbox/snapshot_race.py [--runs N] [--variants as_is,pool_snap] [--out FILE]

Session 39 on the H100 (torch 2.11): MemPool.snapshot() crashed 9 of 18 runs (also with the GC
off: 4 of 8), none of 8 without the count, none of 10 with the allocator's whole snapshot.
Exits 2 with one line on stderr where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def commit() -> str | None:
    """The tree's commit: gpu-run.sh's $TORPOR_COMMIT, else what `make gpu-carry` recorded (the GPU
    machine's copy of the tree has no .git), else git's."""
    if os.environ.get("TORPOR_COMMIT"):
        return os.environ["TORPOR_COMMIT"]
    carried = ROOT / ".gpu" / "commit"
    if carried.is_file():
        return carried.read_text().strip() or None
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return r.stdout.strip() or None

PROGRAM = """
import threading, time, torch, gc, sys
from torpor import gpu, mempool
if 'gc_off' in sys.argv: gc.disable()
if 'no_count' in sys.argv: mempool._torch_pools_bytes = lambda ps: 0
if 'pool_snap' in sys.argv: mempool._torch_pools_bytes = lambda ps: sum(int(s['total_size']) for p in ps for s in p.snapshot())
busy, idle = mempool.FunctionPool('busy', 'cuda'), mempool.FunctionPool('idle', 'cuda')
stop = threading.Event(); done = {'busy': 0, 'released': 0, 'deferred': 0}
w = torch.randn(512, 512, device='cuda')
def serve():
    while not stop.is_set():
        with gpu.request_stream('torch'), busy.request():
            n = 64 + 64 * (done['busy'] % 7)
            (torch.ones(n, 512, device='cuda') @ w).sum().item()
        done['busy'] += 1
        time.sleep(0.002)
def give_back():
    while not stop.is_set():
        with gpu.request_stream('torch'), idle.request():
            torch.empty(8 << 20, dtype=torch.uint8, device='cuda').fill_(1)
        got = idle.release()
        done['deferred' if got == mempool.DEFERRED else 'released'] += 1
ts = [threading.Thread(target=serve), threading.Thread(target=give_back)]
[t.start() for t in ts]
time.sleep(3)
stop.set(); [t.join() for t in ts]
print('ok', done)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--variants", default="as_is,pool_snap")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    probe = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        print("snapshot_race: needs PyTorch with a CUDA GPU", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "PYTHONFAULTHANDLER": "1"}
    runs: dict[str, list[int]] = {}
    first_crash: dict[str, str] = {}
    for variant in a.variants.split(","):
        codes = []
        for _ in range(a.runs):
            r = subprocess.run([sys.executable, "-c", PROGRAM, variant], env=env,
                               capture_output=True, text=True, timeout=120, check=False)
            codes.append(r.returncode)
            if r.returncode != 0 and variant not in first_crash:
                first_crash[variant] = r.stderr[-4000:]
        runs[variant] = codes
        print(variant, codes, flush=True)
    import torch  # type: ignore[import-not-found,unused-ignore]

    doc = {
        "machine": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "commit": commit()},
        "runs": runs,
        "first_crash_stderr": first_crash,
        "summary": {v: f"{sum(c != 0 for c in codes)} of {len(codes)} crashed" for v, codes in runs.items()},
    }
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
