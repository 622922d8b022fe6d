"""Cold start from scratch vs. restore from a Torpor snapshot, per model. Run on the GPU machine, as root.

    python3 bench/coldstart/run.py --runs 5 [--out bench/results/coldstart-<device>.json]

For each model:
  (a) from scratch: `torpor run -- python3 worker.py ...` until the first `infer` is answered,
      RUNS times, with the worker's own phase marks (import torch, CUDA context, weights, ...);
  (b) snapshot: the last booted worker is snapshotted with --leave-running, then without (kill
      mode): command time, torpor's -v phases, how long the worker was frozen (seen from
      /proc), snapshot size; --snapshot-runs N > 1 repeats the kill-mode snapshot on fresh boots;
  (c) restore: `torpor restore DIR --detach -v` until the first `infer` is answered, RUNS times,
      page cache warm (the snapshot's files are read once first), each instance killed after.
Every run is recorded, with medians, min and max, and the machine: GPU, driver, kernel, Python
package versions, CRIU version, torpor commit. A short table is printed at the end.

Outputs of restored instances are compared with the from-scratch ones (same weights, same input):
`digest_match` in each restore record.
"""

from __future__ import annotations

import argparse
import contextlib
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from models import MODELS  # noqa: E402

PYTHON = shutil.which("python3") or sys.executable
PHASE_RE = re.compile(r"^phase\s+(\S+)\s+([-+0-9.eE]+)\s*$")

Json = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="from-scratch starts and restores per model")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/coldstart-<device>.json)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--snapshot-runs", type=int, default=1, help="kill-mode snapshots, each of a fresh boot")
    p.add_argument("--weights-dir", type=Path, default=Path("/var/tmp/torpor-coldstart/weights"))
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp/torpor-coldstart/work"))
    p.add_argument("--torpor", type=Path, help="torpor binary (default $TORPOR_BIN, target/{release,debug})")
    p.add_argument("--boot-timeout", type=float, default=300.0, help="seconds for a worker to answer")
    p.add_argument("--budget-min", type=float, default=8.0, help="skip optional repeats past this")
    p.add_argument("--keep", action="store_true", help="keep the snapshots in --work-dir")
    p.add_argument(
        "--worker", type=Path, default=HERE / "worker.py", help=argparse.SUPPRESS
    )  # harness checks
    a = p.parse_args(argv)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in a.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; one of {', '.join(MODELS)}")
    if a.runs < 1 or a.snapshot_runs < 1:
        p.error("--runs and --snapshot-runs must be at least 1")
    return a


def find_torpor(given: Path | None) -> Path:
    candidates = [given] if given else []
    if os.environ.get("TORPOR_BIN"):
        candidates.append(Path(os.environ["TORPOR_BIN"]))
    candidates += [ROOT / "target" / "release" / "torpor", ROOT / "target" / "debug" / "torpor"]
    for c in candidates:
        if c is not None and c.is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit(f"torpor binary not found (looked at {', '.join(map(str, candidates))}); build it first")


# ----------------------------------------------------------------------------------------------
# Processes and sockets


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(")") + 2 :].split()[0]


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z", "X")


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


def kill_and_wait(pid: int, timeout: float = 60.0) -> None:
    """SIGKILL a worker tree (its init is PID 1 of its namespace: all of it goes) and wait."""
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children(p)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in tree):
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {pid} did not exit within {timeout} s of SIGKILL")
        time.sleep(0.01)


def request(sock: Path, words: list[str], timeout: float = 60.0) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall((" ".join(words) + "\n").encode())
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    if not data.endswith(b"\n"):
        raise ConnectionError(f"no complete answer from {sock}")
    return data.decode().strip()


def wait_answer(
    sock: Path, words: list[str], timeout: float, pid: int, log: Path | None
) -> tuple[str, float]:
    """Retry a request until the worker answers; returns the answer and the time it came."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer = request(sock, words)
            return answer, time.time()
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, ConnectionError):
            pass
        if not alive(pid):
            raise RuntimeError(f"worker {pid} exited before answering{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {pid} did not answer within {timeout:g} s{log_tail(log)}")
        time.sleep(0.002)


def log_tail(log: Path | None, n: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return f"\n--- {log} (tail)\n{log.read_text(errors='replace')[-n:]}"


class FreezeWatch:
    """Watches /proc/PID/stat while a snapshot runs: how long the worker was stopped (CRIU seizes
    it: state t or T), seen from outside, without talking to it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first: float | None = None
        self.last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FreezeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            state = proc_state(self.pid)
            now = time.monotonic()
            if state in ("t", "T"):
                if self.first is None:
                    self.first = now
                self.last = now
            elif state is None or state == "Z":
                if self.first is not None:
                    self.last = now
                return
            time.sleep(0.0005)

    @property
    def frozen_s(self) -> float | None:
        if self.first is None or self.last is None:
            return None
        return round(self.last - self.first, 4)


# ----------------------------------------------------------------------------------------------
# torpor


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    wall_s: float

    def phases(self) -> dict[str, float]:
        """torpor -v timings: lines 'phase NAME SECONDS' on stderr."""
        out: dict[str, float] = {}
        for line in self.stderr.splitlines():
            m = PHASE_RE.match(line.strip())
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def check(self, what: str) -> Result:
        if self.code != 0:
            raise RuntimeError(f"{what} exited {self.code}: {self.stderr.strip()[-2000:]}")
        return self


class Torpor:
    def __init__(self, binary: Path) -> None:
        self.binary = binary

    def __call__(self, *args: str | Path, env: dict[str, str] | None = None, timeout: float = 600) -> Result:
        """Run torpor; output goes through files, so a process it leaves running cannot hold a pipe open."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            start = time.monotonic()
            p = subprocess.Popen(
                [str(self.binary), *map(str, args)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={**os.environ, **(env or {})},
            )
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise RuntimeError(
                    f"torpor {' '.join(map(str, args))} did not finish within {timeout} s"
                ) from None
            wall = round(time.monotonic() - start, 4)
            out.seek(0)
            err.seek(0)
            return Result(code, out.read(), err.read(), wall)


# ----------------------------------------------------------------------------------------------
# Measurements


def disk_usage(path: Path) -> Json:
    apparent = allocated = files = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            apparent += st.st_size
            allocated += st.st_blocks * 512
            files += 1
    return {"bytes": apparent, "allocated_bytes": allocated, "files": files}


def warm_page_cache(path: Path) -> float:
    start = time.monotonic()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(8 << 20):
                    pass
    return round(time.monotonic() - start, 3)


def summary(values: list[float | None]) -> Json | None:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {
        "median": round(statistics.median(xs), 4),
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
        "n": len(xs),
    }


def phase_summary(records: list[Json], key: str) -> Json:
    names: list[str] = []
    for r in records:
        for n in r.get(key) or {}:
            if n not in names:
                names.append(n)
    return {n: summary([(r.get(key) or {}).get(n) for r in records]) for n in names}


class Bench:
    def __init__(self, a: argparse.Namespace, torpor: Torpor) -> None:
        self.a = a
        self.torpor = torpor
        self.start = time.monotonic()
        self.work = a.work_dir
        self.errors: list[str] = []

    def elapsed_min(self) -> float:
        return (time.monotonic() - self.start) / 60

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def weights(self, model: str) -> tuple[Path, Json]:
        path = self.a.weights_dir / f"{model}.safetensors"
        info: Json = {"path": str(path), "made_now": False}
        if not path.is_file():
            self.say(f"{model}: writing weights to {path}")
            start = time.monotonic()
            subprocess.run([PYTHON, str(HERE / "make_weights.py"), model, str(path)], check=True)
            info.update(made_now=True, make_s=round(time.monotonic() - start, 2))
        info["bytes"] = path.stat().st_size
        return path, info

    def boot(self, model: str, weights: Path, tag: str) -> tuple[int, Path, Path, Json]:
        """Start a worker from scratch; returns its init pid, socket, log and the measurement."""
        sock = self.work / f"{model}-{tag}.sock"
        log = self.work / f"{model}-{tag}.log"
        t0 = time.time()
        r = self.torpor(
            "run", "--log", log, "--", PYTHON, self.a.worker, model, weights, sock, env={"T0": repr(t0)}
        ).check("torpor run")
        pid = int(r.stdout.strip())
        try:
            answer, t_answer = wait_answer(sock, ["infer"], self.a.boot_timeout, pid, log)
            phases = json.loads(request(sock, ["phases"]))
        except BaseException:
            kill_and_wait(pid)
            raise
        infer = json.loads(answer)
        record: Json = {
            "first_response_s": round(t_answer - t0, 4),
            "torpor_run_s": r.wall_s,
            "marks": phases.get("marks"),
            "build": phases.get("build"),
            "infer": infer,
        }
        return pid, sock, log, {"record": record, "versions": phases.get("versions")}

    def from_scratch(self, model: str, weights: Path) -> tuple[list[Json], Json, tuple[int, Path, Path]]:
        runs: list[Json] = []
        versions: Json = {}
        kept: tuple[int, Path, Path] | None = None
        for i in range(self.a.runs):
            pid, sock, log, m = self.boot(model, weights, f"scratch-{i}")
            versions = m["versions"] or versions
            runs.append({"run": i, **m["record"]})
            self.say(f"{model}: from scratch #{i}: first response {m['record']['first_response_s']:.2f} s")
            if i == self.a.runs - 1:
                kept = (pid, sock, log)
            else:
                kill_and_wait(pid)
        assert kept is not None
        return runs, versions, kept

    def snapshot(self, pid: int, out: Path, leave_running: bool, child: int | None) -> Json:
        args: list[str | Path] = ["snapshot", "--pid", str(pid), "--out", out, "-v"]
        if leave_running:
            args.append("--leave-running")
        watch = FreezeWatch(child) if child is not None else None
        with watch if watch is not None else contextlib.nullcontext():
            r = self.torpor(*args)
        r.check(f"torpor snapshot{' --leave-running' if leave_running else ''}")
        return {
            "mode": "leave-running" if leave_running else "kill",
            "wall_s": r.wall_s,
            "frozen_s": watch.frozen_s if watch else None,
            "phases": r.phases(),
            "size": disk_usage(out),
            "summary": r.stdout.strip(),
        }

    def restores(self, model: str, snap: Path, sock: Path, reference: str | None) -> list[Json]:
        runs: list[Json] = []
        for i in range(self.a.runs):
            t0 = time.time()
            r = self.torpor("restore", snap, "--detach", "-v").check("torpor restore")
            pid = int(r.stdout.strip())
            try:
                answer, t_answer = wait_answer(sock, ["infer"], self.a.boot_timeout, pid, None)
            finally:
                kill_and_wait(pid)
            infer = json.loads(answer)
            runs.append(
                {
                    "run": i,
                    "first_response_s": round(t_answer - t0, 4),
                    "restore_cmd_s": r.wall_s,
                    "phases": r.phases(),
                    "infer": infer,
                    "digest_match": infer.get("digest") == reference if reference else None,
                }
            )
            self.say(f"{model}: restore #{i}: first response {runs[-1]['first_response_s']:.3f} s")
        return runs

    def by_hand_restores(self, model: str, snap: Path, sock: Path, reference: str | None, manifest: Json) -> list[Json]:
        """The same snapshot restored the way it is done by hand: `criu restore` (the CLI, same
        options as torpor) then the driver's restore + unlock from a separate ctypes process.
        No verification, no GPU checks: the floor torpor's own restore is compared with."""
        criu = os.environ.get("TORPOR_CRIU") or str(Path.home() / ".local/share/torpor/criu/bin/criu")
        ext: list[str] = []
        for m in manifest.get("external_mounts") or []:
            ext += ["--external", f"mnt[{m['key']}]:{m['path']}"]
        runs: list[Json] = []
        for i in range(self.a.runs):
            work = Path(tempfile.mkdtemp(prefix="byhand-", dir=self.work))
            pidfile = work / "pid"
            t0 = time.time()
            subprocess.run(
                [criu, "restore", "-D", str(snap), "-W", str(work), "-o", "restore.log", "-d",
                 "--root", "/", *ext, "--empty-ns", "net", "--network-lock", "skip", "--file-locks",
                 "--pidfile", str(pidfile)],
                check=True, capture_output=True,
            )
            t_criu = time.time()
            pid = int(pidfile.read_text())
            try:
                kids = children(pid)
                gpu = subprocess.run([PYTHON, str(HERE / "by_hand.py"), str(kids[0]), "restore", "unlock"],
                                     check=True, capture_output=True, text=True)
                t_gpu = time.time()
                answer, t_answer = wait_answer(sock, ["infer"], self.a.boot_timeout, pid, None)
            finally:
                kill_and_wait(pid)
                shutil.rmtree(work, ignore_errors=True)
            infer = json.loads(answer)
            runs.append({
                "run": i,
                "first_response_s": round(t_answer - t0, 4),
                "phases": {"criu_restore": round(t_criu - t0, 4), "cuda_restore_and_unlock_process": round(t_gpu - t_criu, 4),
                           **{f"driver_{k}": round(v, 4) for k, v in json.loads(gpu.stdout).items()}},
                "digest_match": infer.get("digest") == reference if reference else None,
            })
            self.say(f"{model}: by hand #{i}: first response {runs[-1]['first_response_s']:.3f} s")
        return runs

    def model(self, model: str) -> Json:
        out: Json = {"model": model}
        weights, out["weights"] = self.weights(model)
        scratch, out["versions"], (pid, sock, log) = self.from_scratch(model, weights)
        out["from_scratch"] = {
            "runs": scratch,
            "first_response_s": summary([r["first_response_s"] for r in scratch]),
        }
        out["from_scratch"]["marks"] = phase_summary(scratch, "marks")
        reference = scratch[0]["infer"].get("digest")
        out["from_scratch"]["digests_agree"] = len({r["infer"].get("digest") for r in scratch}) == 1

        child = children(pid)[0] if children(pid) else None
        snaps: list[Json] = []
        # Leave-running snapshots of the same booted worker: RUNS measurements of snapshot time,
        # stop time and size without re-booting; the worker must keep answering identically.
        for k in range(self.a.runs):
            lr = self.work / f"{model}-snap-leave-running-{k}"
            try:
                snaps.append(self.snapshot(pid, lr, True, child))
                answer = json.loads(request(sock, ["infer"]))
                snaps[-1]["source_digest_match"] = answer.get("digest") == reference
                self.say(f"{model}: snapshot --leave-running {snaps[-1]['wall_s']:.2f} s")
            finally:
                if not self.a.keep:
                    shutil.rmtree(lr, ignore_errors=True)
        snap = self.work / f"{model}-snap"
        try:
            snaps.append(self.snapshot(pid, snap, False, child))
        finally:
            if alive(pid):
                kill_and_wait(pid)
        self.say(
            f"{model}: snapshot (kill) {snaps[-1]['wall_s']:.2f} s, {snaps[-1]['size']['bytes'] / 1e9:.2f} GB"
        )
        for k in range(1, self.a.snapshot_runs):
            if self.elapsed_min() > self.a.budget_min * 0.6:
                self.say(f"{model}: skipping further snapshot repeats (time budget)")
                break
            p2, _s2, _l2, _m = self.boot(model, weights, f"snapboot-{k}")
            extra = self.work / f"{model}-snap-{k}"
            c2 = children(p2)[0] if children(p2) else None
            try:
                snaps.append(self.snapshot(p2, extra, False, c2))
            finally:
                if alive(p2):
                    kill_and_wait(p2)
                shutil.rmtree(extra, ignore_errors=True)
        kill_snaps = [s for s in snaps if s["mode"] == "kill"]
        kept_snaps = [s for s in snaps if s["mode"] == "leave-running"]
        out["snapshot"] = {
            "runs": snaps,
            "kill_wall_s": summary([s["wall_s"] for s in kill_snaps]),
            "kill_phases": phase_summary(kill_snaps, "phases"),
            "leave_running_wall_s": summary([s["wall_s"] for s in kept_snaps]),
            "leave_running_phases": phase_summary(kept_snaps, "phases"),
        }

        inspect = self.torpor("inspect", snap, "--json")
        if inspect.code == 0:
            try:
                manifest = json.loads(inspect.stdout)
                manifest["files"] = len(manifest.get("files") or [])  # the count, not every hash
                out["manifest"] = manifest
            except json.JSONDecodeError:
                out["manifest"] = None
        out["page_cache_warm_s"] = warm_page_cache(snap)
        try:
            restores = self.restores(model, snap, sock, reference)
            if out.get("manifest") and out["manifest"].get("gpu"):
                try:
                    by_hand = self.by_hand_restores(model, snap, sock, reference, out["manifest"])
                    out["by_hand_restore"] = {
                        "how": "criu restore CLI (same options) + cuCheckpointProcessRestore/Unlock "
                        "via ctypes in a new process",
                        "runs": by_hand,
                        "first_response_s": summary([r["first_response_s"] for r in by_hand]),
                        "phases": phase_summary(by_hand, "phases"),
                    }
                except (subprocess.CalledProcessError, OSError, ValueError, IndexError) as e:
                    detail = getattr(e, "stderr", "") or ""
                    out["by_hand_restore"] = {"error": f"{e!r} {str(detail)[-2000:]}"}
                    self.say(f"{model}: by-hand baseline failed: {e!r}")
        finally:
            if not self.a.keep:
                shutil.rmtree(snap, ignore_errors=True)
        out["restore"] = {
            "runs": restores,
            "first_response_s": summary([r["first_response_s"] for r in restores]),
            "restore_cmd_s": summary([r["restore_cmd_s"] for r in restores]),
            "phases": phase_summary(restores, "phases"),
            "all_digests_match": all(r["digest_match"] for r in restores),
        }
        return out


# ----------------------------------------------------------------------------------------------
# Machine description


def run_text(argv: list[str]) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine() -> Json:
    gpus = []
    text = run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    for line in (text or "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    # The GPU machine gets a copy of the tree without .git: `make gpu-carry` records the commit.
    # The binary's commit first: the GPU machine's copy of the tree may carry a stale .git.
    commit = os.environ.get("TORPOR_COMMIT") or run_text(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    dirty = os.environ.get("TORPOR_DIRTY")
    if dirty is None:
        dirty = run_text(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
    return {
        "gpus": gpus,
        "device": gpus[0]["name"] if gpus else None,
        "driver": gpus[0]["driver"] if gpus else None,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "torpor_commit": commit,
        "torpor_dirty": bool(dirty) if dirty is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def table(results: list[Json]) -> str:
    def fmt(s: Json | None, unit: str = "s", digits: int = 2) -> str:
        if not s:
            return "-"
        return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    header = (
        f"{'model':<12} {'from scratch':>22} {'restore':>22} {'speedup':>8} {'snapshot':>9} "
        f"{'stopped':>8} {'size':>8} {'same':>5}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['model']:<12} error: {r['error'].splitlines()[0][:100]}")
            continue
        scratch = r["from_scratch"]["first_response_s"]
        restore = r["restore"]["first_response_s"]
        speedup = (
            f"{scratch['median'] / restore['median']:.1f}x"
            if scratch and restore and restore["median"]
            else "-"
        )
        kill = [s for s in r["snapshot"]["runs"] if s["mode"] == "kill"]
        kept = [s for s in r["snapshot"]["runs"] if s["mode"] == "leave-running"]
        snap_s = f"{kill[0]['wall_s']:.2f}s" if kill else "-"
        # How long a source that is kept running was unavailable (torpor's own measure).
        stopped = kept[0]["phases"].get("stop_time") if kept else None
        size = f"{kill[0]['size']['bytes'] / 1e9:.2f}GB" if kill else "-"
        same = "yes" if r["restore"]["all_digests_match"] else "NO"
        lines.append(
            f"{r['model']:<12} {fmt(scratch):>22} {fmt(restore, digits=3):>22} {speedup:>8} {snap_s:>9} "
            f"{(f'{stopped:.2f}s' if stopped is not None else '-'):>8} {size:>8} {same:>5}"
        )
        phases = r["restore"]["phases"]
        if phases:
            listed = ", ".join(f"{k} {v['median']:.3f}" for k, v in phases.items() if v)
            lines.append(f"    restore phases (median s): {listed}")
        marks = r["from_scratch"]["marks"]
        if marks:
            listed = ", ".join(f"{k} {v['median']:.2f}" for k, v in marks.items() if v)
            lines.append(f"    from-scratch marks (median s since spawn): {listed}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("run as root: torpor creates namespaces and runs CRIU")
    torpor = Torpor(find_torpor(a.torpor))
    a.work_dir.mkdir(parents=True, exist_ok=True)
    a.weights_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    out = a.out or ROOT / "bench" / "results" / f"coldstart-{slug(info['device'] or 'unknown')}.json"
    bench = Bench(a, torpor)
    bench.say(f"torpor {torpor.binary}; device {info['device']}; models {', '.join(a.models)}; runs {a.runs}")

    results: list[Json] = []
    for model in a.models:
        try:
            results.append(bench.model(model))
        except Exception as e:  # record and go on: one batch on the GPU machine should say as much as it can
            bench.say(f"{model}: FAILED: {e}")
            results.append({"model": model, "error": f"{type(e).__name__}: {e}"})

    criu = None
    for r in results:
        host = (r.get("manifest") or {}).get("host") or {}
        criu = criu or host.get("criu_version")
    versions = next((r["versions"] for r in results if r.get("versions")), None)
    doc = {
        "benchmark": "coldstart",
        "machine": {**info, "criu_version": criu, "versions": versions, "torpor_binary": str(torpor.binary)},
        "settings": {
            "runs": a.runs,
            "snapshot_runs": a.snapshot_runs,
            "page_cache": "warm (snapshot files read once before the restores)",
            "weights": "safetensors, random init with a fixed seed (make_weights.py)",
        },
        "elapsed_s": round(time.monotonic() - bench.start, 1),
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(f"\n{out} ({doc['elapsed_s']:.0f} s)")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
