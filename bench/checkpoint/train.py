"""Training throughput with periodic checkpoints: none vs stop-the-world vs concurrent. Run as root.

    TORPOR_BIN=target/release/torpor python3 bench/checkpoint/train.py --kind torch \
        --steps 600 --every-iters 10 --out bench/results/checkpoint-train-h100.json
    TORPOR_BIN=target/debug/torpor python3 bench/checkpoint/train.py --kind numpy --sleep 0.02 \
        --steps 400 --out bench/results/concurrent-checkpoint-cpu.json

The training loop is bench/checkpoint/workload.py (a small transformer on the GPU, or the numpy
MLP on the CPU), started with `torpor run`:

- none: no checkpoints; its mean iteration time (after --warmup iterations) sets the interval;
- stop-the-world: `torpor run --checkpoint-every S --keep 2 --checkpoints DIR`, S = --every-iters
  iterations of the none run: every checkpoint stops the job for the driver's checkpoint (GPU
  state into host memory) and CRIU's dump, then stores the changed chunks while it runs on;
- concurrent: the same with `--concurrent-rounds R` (CRIU pre-dump rounds while it runs; the stop
  copies only what changed). Needs the kernel's soft-dirty tracking: where it has none the mode
  is recorded as unavailable with torpor's one-line refusal.

Throughput is iterations per second from the loop's own per-step timestamps after the warm-up;
overhead is the loss of throughput against none, in percent. Every mode's loss curve is checked
against the none run's, bit for bit (a checkpoint must not change the training). The JSON's
`summary` holds `training_overhead_pct` (concurrent where measured, else stop-the-world, named by
`training_overhead_mode`), `stop_s` and `migration_downtime_s` (not measured here: null).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PYTHON = shutil.which("python3") or sys.executable
WORKLOAD = HERE / "workload.py"
CKPT_RE = re.compile(r"torpor: checkpoint (ckpt-\d+): job stopped ([\d.]+) s; .* took ([\d.]+) s")
Json = dict[str, Any]


def torpor_bin() -> Path:
    env = os.environ.get("TORPOR_BIN")
    if env:
        return Path(env)
    for profile in ("release", "debug"):
        p = ROOT / "target" / profile / "torpor"
        if p.is_file():
            return p
    sys.exit("torpor binary not found: set TORPOR_BIN or build it")


def soft_dirty() -> bool:
    """CRIU's probe (as tests/test_concurrent_snapshot.py): does the kernel track written pages?"""
    import ctypes
    import mmap

    m = mmap.mmap(-1, mmap.PAGESIZE)
    m[0] = 1
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("4")
    m[0] = 2
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // mmap.PAGESIZE * 8)
        return bool(int.from_bytes(f.read(8), "little") >> 55 & 1)


def parse_steps(log: Path) -> list[tuple[int, str, float]]:
    out = []
    for line in log.read_text().splitlines():
        p = line.split()
        if len(p) == 6 and p[0] == "step" and p[2] == "loss" and p[4] == "t":
            out.append((int(p[1]), p[3], float(p[5])))
    return out


def throughput(steps: list[tuple[int, str, float]], warmup: int) -> float:
    timed = [s for s in steps if s[0] > warmup]
    if len(timed) < 2:
        raise SystemExit(f"too few steps after a warm-up of {warmup}: raise --steps")
    return (len(timed) - 1) / (timed[-1][2] - timed[0][2])


def run_mode(
    torpor: Path, argv: list[str], work: Path, name: str, every: float | None, rounds: int, timeout: float
) -> Json:
    log = work / f"{name}.log"
    ckpts = work / f"{name}-ckpts"
    shutil.rmtree(ckpts, ignore_errors=True)
    log.unlink(missing_ok=True)  # torpor run appends
    cmd = [str(torpor), "run", "--log", str(log)]
    if every is not None:
        cmd += ["--checkpoint-every", f"{every:.4f}", "--keep", "2", "--checkpoints", str(ckpts)]
        if rounds:
            cmd += ["--concurrent-rounds", str(rounds)]
    cmd += ["--", *argv]
    start = time.monotonic()
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {"ok": False, "error": (r.stderr.strip().splitlines() or ["?"])[-1], "command": cmd}
    if every is None:
        # torpor run returns at once: wait for the job to finish its loop.
        pid = int(r.stdout.strip())
        while Path(f"/proc/{pid}").exists() and time.monotonic() - start < timeout:
            time.sleep(0.05)
    wall = time.monotonic() - start
    if "done" not in log.read_text().split():
        tail = log.read_text().strip().splitlines()[-3:]
        return {"ok": False, "error": f"the training loop did not finish: {' | '.join(tail)}", "command": cmd}
    taken = [m for m in map(CKPT_RE.search, r.stderr.splitlines()) if m]
    steps = parse_steps(log)
    shutil.rmtree(ckpts, ignore_errors=True)
    return {
        "ok": True,
        "command": cmd,
        "wall_s": wall,
        "steps": steps,
        "checkpoints": len(taken),
        "stop_s": [float(m.group(2)) for m in taken],
        "checkpoint_s": [float(m.group(3)) for m in taken],
        "failed_checkpoints": r.stderr.count("checkpoint failed"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("torch", "numpy"), default="torch")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--every-iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="pre-dump rounds of the concurrent mode")
    ap.add_argument("--sleep", type=float, default=0.0, help="per-step sleep of the workload (a longer iteration)")
    ap.add_argument("--hold-mb", type=int, default=0, help="torch: a GPU buffer rewritten every step")
    ap.add_argument("--size", choices=("small", "large"), default="small", help="torch: the model (workload.py)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/torpor-checkpoint-bench"))
    ap.add_argument("--timeout", type=float, default=500.0, help="seconds per mode")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torpor = torpor_bin()
    args.work.mkdir(parents=True, exist_ok=True)
    argv = [PYTHON, str(WORKLOAD), "--kind", args.kind, "--steps", str(args.steps), "--sleep", str(args.sleep)]
    if args.hold_mb:
        argv += ["--hold-mb", str(args.hold_mb)]
    if args.kind == "torch":
        argv += ["--size", args.size]

    modes: Json = {}
    none = run_mode(torpor, argv, args.work, "none", None, 0, args.timeout)
    if not none["ok"]:
        sys.exit(f"the run without checkpoints failed: {none['error']}")
    ips_none = throughput(none["steps"], args.warmup)
    every = args.every_iters / ips_none
    ref = [loss for _, loss, _ in none["steps"]]
    modes["none"] = none
    tracking = soft_dirty()
    for name, rounds in (("stop_the_world", 0), ("concurrent", args.rounds)):
        m = run_mode(torpor, argv, args.work, name, every, rounds, args.timeout)
        modes[name] = m
        if not m["ok"]:
            print(f"{name}: unavailable: {m['error']}", file=sys.stderr)
            continue
        m["same_losses_as_none"] = [loss for _, loss, _ in m["steps"]] == ref
    result: Json = {
        "benchmark": "bench/checkpoint/train.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(torpor, tracking),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "interval_s": every,
        "modes": {},
    }
    for name, m in modes.items():
        row: Json = {k: v for k, v in m.items() if k != "steps"}
        if m["ok"]:
            ips = throughput(m["steps"], args.warmup)
            row["iters_per_s"] = ips
            row["overhead_pct"] = (ips_none - ips) / ips_none * 100
            row["iterations"] = len(m["steps"])
            if m["stop_s"]:
                row["stop_s_median"] = statistics.median(m["stop_s"])
                row["stop_s_max"] = max(m["stop_s"])
        result["modes"][name] = row
    conc, stw = result["modes"]["concurrent"], result["modes"]["stop_the_world"]
    best = conc if conc.get("ok") else stw
    result["summary"] = {
        "training_overhead_pct": best.get("overhead_pct"),
        "training_overhead_mode": "concurrent" if conc.get("ok") else "stop-the-world",
        "stop_the_world_overhead_pct": stw.get("overhead_pct"),
        "concurrent_overhead_pct": conc.get("overhead_pct"),
        "concurrent_unavailable": None if conc.get("ok") else conc.get("error"),
        "stop_s": None,
        "migration_downtime_s": None,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps(result["summary"], indent=2))
    for name, row in result["modes"].items():
        if row.get("ok"):
            print(
                f"{name:15} {row['iters_per_s']:8.2f} it/s  overhead {row['overhead_pct']:6.2f} %  "
                f"checkpoints {row['checkpoints']}  stop median {row.get('stop_s_median', 0):.3f} s",
                file=sys.stderr,
            )


def machine(torpor: Path, tracking: bool) -> Json:
    def out(cmd: list[str]) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            return None

    return {
        "kernel": os.uname().release,
        "soft_dirty_tracking": tracking,
        "cpus": os.cpu_count(),
        "gpu": out(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
        "torpor": out([str(torpor), "--version"]),
        # The binary's commit where gpu-run.sh says it (the GPU machine's copy of .git can be older).
        "commit": os.environ.get("TORPOR_COMMIT") or out(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "tmp": tempfile.gettempdir(),
    }


if __name__ == "__main__":
    main()
