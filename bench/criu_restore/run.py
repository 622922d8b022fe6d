"""CRIU restore → first answer, by where the pages come from. Run as root.

    TORPOR_BIN=target/debug/torpor python3 bench/criu_restore/run.py --mib 1536 --runs 5 \
        [--out bench/results/criu-restore-<host>.json] [--worker bench/criu_restore/worker.py]

A worker holding MIB MiB of distinct data (worker.py; any program speaking its protocol, e.g. a
GPU worker, can be given with --worker) is started with `torpor run` and snapshotted once
(`torpor snapshot`, kill mode) onto disk; `torpor stage` copies the snapshot into tmpfs once.
Then for each page source and each touch pattern, RUNS times:
  `torpor restore DIR --detach -v [--pages lazy]` is started, and as soon as it prints the
  restored PID a request `touch P` (read one byte of every page of the first P % of the data) is
  sent; the time from starting `torpor restore` to the answer is "restore → first answer".
Page sources: disk-cold (page cache dropped before each run), disk-warm (the images read once
first), tmpfs (the staged copy in --stage-base, /dev/shm: 4 KiB pages), lazy-tmpfs (the same with
--pages lazy: Torpor's page server), criu-lazy-tmpfs (--pages criu-lazy: CRIU's lazy-pages
daemon), hot-lazy-tmpfs (Torpor's page server given a hot set: the profile a first, untimed
restore of the staged copy recorded while the worker answered `touch 10`, as torpord records one
at deploy); with --huge-stage-base (a tmpfs mounted huge=always) also tmpfs-huge,
lazy-tmpfs-huge, hot-lazy-tmpfs-huge and criu-lazy-tmpfs-huge. A source of Torpor's page server
may end in @N: its background copy on N threads ($TORPOR_PAGE_SERVER_BACKGROUND_THREADS; 1 is the
serial copy, the server's default 8), e.g. --sources lazy-tmpfs@1,lazy-tmpfs@8; each of its runs
records the server's counters ($TORPOR_PAGE_SERVER_STATS) under "page_server". Touch patterns: 10 % and 100 %. Rounds are interleaved (run i of every cell,
then run i+1), so background load on a shared machine spreads over all cells alike. Every answer
is checked against the worker's own answer before the snapshot. Every run is recorded with
torpor's phases; medians, min and max per cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
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
PHASE_RE = re.compile(r"^phase\s+(\S+)\s+([-+0-9.eE]+)\s*$")
SOURCES = (
    "disk-cold", "disk-warm", "tmpfs", "lazy-tmpfs", "criu-lazy-tmpfs",
    "tmpfs-huge", "lazy-tmpfs-huge", "criu-lazy-tmpfs-huge",
    "hot-lazy-tmpfs", "hot-lazy-tmpfs-huge",
)
DEFAULT_SOURCES = SOURCES[:5]
TOUCH = (10, 100)

Json = dict[str, Any]


def base_of(source: str) -> str:
    """A source without its @N (background threads of Torpor's page server)."""
    return source.partition("@")[0]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1536, help="MiB of distinct data the worker holds")
    p.add_argument("--vmas", type=int, default=0, help="one-page VMAs the worker holds besides (worker.py VMAS)")
    p.add_argument("--runs", type=int, default=5, help="restores per page source and touch pattern")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/criu-restore-<host>.json)")
    p.add_argument("--worker", type=Path, default=HERE / "worker.py", help="worker program (SOCKET MIB)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp/torpor-criu-restore"))
    p.add_argument("--stage-base", type=Path, default=Path("/dev/shm/torpor"), help="tmpfs for the staged copy")
    p.add_argument(
        "--huge-stage-base",
        type=Path,
        help="a tmpfs mounted with huge=always (or within_size) for the *-huge sources",
    )
    p.add_argument("--sources", help=f"comma list of {', '.join(SOURCES)} (default: the first four, "
                   "plus the -huge ones with --huge-stage-base)")
    p.add_argument("--answer-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.sources is None:
        a.sources = ",".join(SOURCES if a.huge_stage_base else DEFAULT_SOURCES)
    a.sources = [s.strip() for s in a.sources.split(",") if s.strip()]
    for s in a.sources:
        base, _, threads = s.partition("@")
        if threads and not (base.startswith(("lazy-", "hot-lazy-")) and threads.isdigit() and 1 <= int(threads) <= 64):
            p.error(f"{s!r}: @N (background threads, 1 to 64) is for Torpor's page server's sources (lazy-*, hot-lazy-*)")
    if any(base_of(s).endswith("-huge") for s in a.sources) and a.huge_stage_base is None:
        p.error("the -huge sources need --huge-stage-base (mount -t tmpfs -o huge=always tmpfs DIR)")
    for s in a.sources:
        if base_of(s) not in SOURCES:
            p.error(f"unknown source {s!r}; one of {', '.join(SOURCES)}")
    if a.runs < 1 or a.mib < 1:
        p.error("--runs and --mib must be at least 1")
    return a


def find_torpor() -> Path:
    candidates = [Path(os.environ["TORPOR_BIN"])] if os.environ.get("TORPOR_BIN") else []
    candidates += [ROOT / "target" / "release" / "torpor", ROOT / "target" / "debug" / "torpor"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit(f"torpor binary not found (looked at {', '.join(map(str, candidates))}); build it first")


# ----------------------------------------------------------------------------------------------
# Processes


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def kill_tree(pid: int) -> None:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.001)


def ask(sock: Path, words: str, timeout: float) -> str:
    """One request; retries while the restored listener is not there yet."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(str(sock))
            s.sendall(words.encode() + b"\n")
            chunks = []
            while not chunks or not chunks[-1].endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks).decode().strip()
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.0005)
        finally:
            s.close()


def run_text(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_all(d: Path) -> None:
    for f in d.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(8 << 20):
                    pass


# ----------------------------------------------------------------------------------------------
# The benchmark


class Bench:
    def __init__(self, a: argparse.Namespace, torpor: Path) -> None:
        self.a = a
        self.torpor = torpor
        self.start = time.monotonic()
        self.sock = a.work_dir / "worker.sock"
        self.env = {**os.environ, "TORPOR_LOG_DIR": str(a.work_dir / "logs")}

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def tp(self, *args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [str(self.torpor), *map(str, args)], capture_output=True, text=True, env=self.env, timeout=600
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"torpor {' '.join(map(str, args))} failed: {r.stderr.strip()}")
        return r

    def snapshot(self) -> tuple[Path, dict[int, str], Json]:
        """Boot the worker, record its answers, snapshot it onto disk."""
        snap = self.a.work_dir / "snap"
        shutil.rmtree(snap, ignore_errors=True)
        ready = Path(f"{self.sock}.ready")
        ready.unlink(missing_ok=True)
        extra = [str(self.a.vmas)] if self.a.vmas else []
        r = self.tp("run", "--log", self.a.work_dir / "worker.log", "--", PYTHON, self.a.worker, self.sock,
                    str(self.a.mib), *extra)
        pid = int(r.stdout.strip())
        try:
            wait_for(lambda: ready.exists() or gone(pid), 600, "the worker to hold its data")
            if not ready.exists():
                raise RuntimeError(f"the worker exited; see {self.a.work_dir / 'worker.log'}")
            expected = {p: ask(self.sock, f"touch {p}", 60) for p in TOUCH}
            t = time.monotonic()
            self.tp("snapshot", "--pid", pid, "--out", snap)
            snap_s = time.monotonic() - t
        except BaseException:
            kill_tree(pid)
            raise
        size = sum(f.stat().st_size for f in snap.rglob("*") if f.is_file())
        return snap, expected, {"snapshot_s": round(snap_s, 3), "bytes": size}

    def record_profile(self, snap: Path, out: Path, expected: str) -> None:
        """An untimed restore of `snap` by Torpor's page server recording the order the worker
        touches its pages (faults only: $TORPOR_PAGE_SERVER_BACKGROUND=off) while it answers
        `touch 10`, as torpord's profiling restore at deploy does; the profile goes to `out`."""
        out.unlink(missing_ok=True)
        env = dict(self.env, TORPOR_PAGE_PROFILE_OUT=str(out), TORPOR_PAGE_SERVER_BACKGROUND="off")
        self.restore_once(snap, "lazy", 10, expected, env)

    def restore_once(self, snap: Path, pages: str, touch: int, expected: str, env: dict[str, str] | None = None) -> Json:
        args = [str(self.torpor), "restore", str(snap), "--detach", "-v", "--pages", pages]
        server_stats = self.a.work_dir / "page-server-stats.jsonl"
        server_stats.unlink(missing_ok=True)
        if pages == "lazy":
            env = dict(env or self.env, TORPOR_PAGE_SERVER_STATS=str(server_stats))
        with tempfile.TemporaryFile("w+") as err:
            t0 = time.monotonic()
            p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, env=env or self.env, text=True)
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            t_pid = time.monotonic()
            if not line.isdigit():
                p.wait()
                err.seek(0)
                raise RuntimeError(f"torpor restore failed: {err.read().strip()}")
            pid = int(line)
            try:
                answer = ask(self.sock, f"touch {touch}", self.a.answer_timeout)
                t_answer = time.monotonic()
                if answer != expected:
                    raise RuntimeError(f"restored worker answered {answer!r}, expected {expected!r}")
                if (env or {}).get("TORPOR_PAGE_SERVER_BACKGROUND") == "off":
                    kill_tree(pid)  # faults only: the server ends once the tree is gone
                code = p.wait(timeout=600)  # lazy: torpor waits for the daemon to serve every page
                t_done = time.monotonic()
            finally:
                kill_tree(pid)
                if p.poll() is None:
                    p.kill()
                    p.wait()
            err.seek(0)
            text = err.read()
        if code != 0:
            raise RuntimeError(f"torpor restore exited {code}: {text.strip()}")
        phases = {m.group(1): float(m.group(2)) for m in map(PHASE_RE.match, text.splitlines()) if m}
        wait_for(lambda: gone(pid), 30, "the restored worker to go")
        out: Json = {
            "first_answer_s": round(t_answer - t0, 4),
            "pid_printed_s": round(t_pid - t0, 4),
            "torpor_exit_s": round(t_done - t0, 4),
            "phases": phases,
        }
        if server_stats.exists():
            out["page_server"] = json.loads(server_stats.read_text().splitlines()[-1])
        return out


def stats(xs: list[float]) -> Json | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def machine(torpor: Path) -> Json:
    gpus = []
    for line in (run_text(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]) or "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2:
            gpus.append({"name": parts[0], "driver": parts[1]})
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), None)
    mem = next((ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), "0")
    # The binary's commit first: the GPU machine's copy of the tree may carry a stale .git.
    commit = os.environ.get("TORPOR_COMMIT") or run_text(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    dirty = os.environ.get("TORPOR_DIRTY")
    if dirty is None:
        dirty = run_text(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {
        "host": os.uname().nodename,
        "device": gpus[0]["name"] if gpus else f"cpu: {cpu}",
        "gpus": gpus,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_gib": round(int(mem) / (1 << 20), 1),
        "kernel": os.uname().release,
        "versions": {
            "python": sys.version.split()[0],
            "criu": (run_text(["sh", "-c", "${TORPOR_CRIU:-$HOME/.local/share/torpor/criu/bin/criu} --version"])
                     or "").replace("\n", " "),
            "torpor": run_text([str(torpor), "--version"]),
        },
        "torpor_binary": str(torpor),
        "torpor_commit": commit,
        "torpor_dirty": bool(dirty) if dirty is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def table(results: Json) -> str:
    lines = [f"{'source':<12} {'touch':>6} {'first answer (s) median [min-max]':>36} {'criu_restore':>13}"]
    for source, by_touch in results.items():
        for touch, cell in by_touch.items():
            s, c = cell["first_answer_s"], cell["phases"].get("criu_restore")
            lines.append(
                f"{source:<12} {touch:>5}% {s['median']:>14.3f} [{s['min']:.3f}-{s['max']:.3f}]"
                f"{'':>6} {c['median'] if c else float('nan'):>12.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: torpor creates namespaces and runs CRIU")
    torpor = find_torpor()
    a.work_dir.mkdir(parents=True, exist_ok=True)
    info = machine(torpor)
    load_start = list(os.getloadavg())
    out = a.out or ROOT / "bench" / "results" / f"criu-restore-{re.sub(r'[^a-z0-9]+', '-', info['host'].lower())}.json"
    bench = Bench(a, torpor)
    bench.say(f"torpor {torpor}; {a.mib} MiB; runs {a.runs}; sources {', '.join(a.sources)}")
    snap, expected, snap_info = bench.snapshot()
    bench.say(f"snapshot {snap_info}")
    staged = {
        "": a.stage_base / f"bench-{os.getpid()}",
        "-huge": (a.huge_stage_base or a.stage_base) / f"bench-huge-{os.getpid()}",
    }
    results: Json = {}
    runs: dict[tuple[str, int], list[Json]] = {(s, t): [] for s in a.sources for t in TOUCH}
    try:
        for suffix, target in staged.items():
            bases = [base_of(s) for s in a.sources]
            if any(s.startswith(("tmpfs", "lazy-tmpfs", "criu-lazy-tmpfs", "hot-lazy-tmpfs")) and s.endswith(suffix) and
                   (suffix or not s.endswith("-huge")) for s in bases):
                t = time.monotonic()
                bench.tp("stage", snap, "--to", target)
                snap_info[f"stage{suffix}_s"] = round(time.monotonic() - t, 3)
        profiles: dict[str, Path] = {}
        for suffix, target in staged.items():
            if f"hot-lazy-tmpfs{suffix}" in map(base_of, a.sources):
                profiles[suffix] = a.work_dir / f"profile{suffix or '-small'}"
                t = time.monotonic()
                bench.record_profile(target, profiles[suffix], expected[10])
                lines = profiles[suffix].read_text().splitlines() if profiles[suffix].exists() else []
                snap_info[f"profile{suffix}"] = {"s": round(time.monotonic() - t, 3), "ranges": len(lines)}
                bench.say(f"profile{suffix}: {len(lines)} ranges")
        for i in range(a.runs):
            for source in a.sources:
                base, _, threads = source.partition("@")
                d = snap if base.startswith("disk") else staged["-huge" if base.endswith("-huge") else ""]
                for touch in TOUCH:
                    if source == "disk-cold":
                        drop_caches()
                    elif source == "disk-warm":
                        read_all(d)
                    pages = "criu-lazy" if base.startswith("criu-lazy") else "lazy" if "lazy" in base else "copy"
                    env = None
                    if base.startswith("hot-lazy"):
                        profile = profiles["-huge" if base.endswith("-huge") else ""]
                        env = dict(bench.env, TORPOR_PAGE_PROFILE_IN=str(profile))
                    if threads:
                        env = dict(env or bench.env, TORPOR_PAGE_SERVER_BACKGROUND_THREADS=threads)
                    r = bench.restore_once(d, pages, touch, expected[touch], env)
                    bench.say(f"{source} touch {touch}% run {i + 1}: first answer {r['first_answer_s']:.3f} s")
                    runs[(source, touch)].append(r)
        for source in a.sources:
            results[source] = {}
            for touch in TOUCH:
                cell = runs[(source, touch)]
                phase_names = sorted({k for r in cell for k in r["phases"]})
                results[source][f"{touch}"] = {
                    "first_answer_s": stats([r["first_answer_s"] for r in cell]),
                    "pid_printed_s": stats([r["pid_printed_s"] for r in cell]),
                    "torpor_exit_s": stats([r["torpor_exit_s"] for r in cell]),
                    "phases": {k: stats([r["phases"][k] for r in cell if k in r["phases"]]) for k in phase_names},
                    "runs": cell,
                }
    finally:
        for target in staged.values():
            shutil.rmtree(target, ignore_errors=True)
    doc = {
        "benchmark": "criu_restore",
        "machine": info,
        "settings": {
            "mib": a.mib,
            "vmas": a.vmas,
            "runs": a.runs,
            "worker": str(a.worker),
            "stage_base": str(a.stage_base),
            "huge_stage_base": str(a.huge_stage_base) if a.huge_stage_base else None,
            "order": "interleaved rounds: run i of every source and touch pattern, then run i+1",
            "touch_percent": list(TOUCH),
            "measure": "start of `torpor restore --detach` to the restored worker's answer to `touch P`",
            "snapshot": snap_info,
        },
        "elapsed_s": round(time.monotonic() - bench.start, 1),
        # Other work on the machine: the 1-, 5- and 15-minute load averages at the start and the end.
        "loadavg": {"start": load_start, "end": list(os.getloadavg())},
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(f"\n{out} ({doc['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
