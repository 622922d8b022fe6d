"""Replay synthetic invocation traces (traces.py) against torpord, with snapshots and without.

One replay, against a daemon that is already running:

    python3 bench/serverless/run.py --socket /run/torpor/torpord.sock --function resnet152 \\
        --pattern bursty --duration 60 [--seed 1] [--request '{"seed": 1}'] [--out FILE]

Every arrival of the trace is sent at its scheduled time from its own thread (so requests overlap
as they would from independent clients) as POST /v1/functions/NAME/invoke over the Unix socket.
Per request it records the scheduled and actual send time, the latency (send to the last byte of
the answer), the status, X-Torpor-Start (warm, restored, booted) and X-Torpor-Timings. The request
body is --request, else the function's warm-up request; a "seed" key in it is set to the request's
index + 1, so the requests differ.

The comparison, which starts its own daemons:

    python3 bench/serverless/run.py --compare --function-dir examples/resnet152 \\
        [--duration 60] [--patterns sporadic,periodic,bursty] [--keepalive G,H,E] [--out FILE]

For each mode, restore (cold starts restore the function snapshot) then boot (snapshots disabled:
every cold start boots a fresh worker and runs setup()), it starts `torpor serve --cold-start MODE`
with a fresh state directory and API socket, and, for each pattern, deploys the function (so that
each replay starts with no instance alive), replays the pattern's trace, and reads /metrics before
and after. A third mode, `sandbox` (`--modes restore,sandbox`; issue 11's throughput of sandboxes
against processes), restores like `restore` but deploys the function sandboxed (docs/sandboxes.md)
with the same number of requests at once: one sandbox (`max_instances = 1`) running
max_instances × requests_per_instance of the spec's requests as threads, on CUDA streams of one
context, where `restore` runs them as that many processes. Two more, `restore-graphs` and
`sandbox-graphs`, are `restore` and `sandbox` with the spec's entry replaced by
`--graphed-entry` (for examples/resnet152, `model:ResNet152Graphed`: its forward captured as
CUDA graphs by torpor.graphed; docs/sandboxes.md, "CUDA graphs"). The keep-alive delays of the deployed copy are scaled to the trace (default:
gpu_release = duration/30, hibernate = duration/10, evict = duration/2), so the replay exercises the
stepped-down stages as the hours-long Azure trace does against the default delays; both modes use
the same delays. If this torpor has no --cold-start flag, only the restore mode runs, and the JSON
says so.

It writes bench/results/serverless-<device>.json: machine (GPU, driver, kernel, versions, commit),
settings, and per mode and pattern the trace, p50/p99 latency, counts of starts by kind and of
statuses, GPU memory·seconds (torpor_gpu_memory_byte_seconds_total for the function over the
replay, in GiB·s, summed over every stage label, `starting` included; null when the daemon has no
such series), the same per stage and the instance-seconds per stage, and every request. It prints the table of
table.py at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT / "python"))

import table
from torpor import client
from traces import PATTERNS, Trace, generate, superposed

Json = dict[str, Any]
MODES = ("restore", "boot", "sandbox", "restore-graphs", "sandbox-graphs")
# What --compare runs unless told (the README's table): restore against boot.
DEFAULT_MODES = ("restore", "boot")
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# HTTP over the daemon's Unix socket


def request(
    sock: str, method: str, path: str, body: bytes | None, timeout: float
) -> tuple[int, dict[str, str], bytes]:
    r = client.request(sock, method, path, body, timeout)
    return r.status, r.headers, r.body


def invoke(sock: str, function: str, body: Any, timeout: float) -> Json:
    """One invoke: status, X-Torpor-Start, timings, latency; never raises."""
    data = json.dumps(body).encode()
    start = time.perf_counter()
    try:
        status, headers, raw = request(
            sock, "POST", f"/v1/functions/{function}/invoke", data, timeout
        )
    except (OSError, http.client.HTTPException) as e:
        return {
            "latency_s": time.perf_counter() - start,
            "status": None,
            "start": None,
            "timings": None,
            "error": f"{type(e).__name__}: {e}",
        }
    latency = time.perf_counter() - start
    try:
        timings = json.loads(headers.get("x-torpor-timings", "null"))
    except json.JSONDecodeError:
        timings = None
    out: Json = {
        "latency_s": latency,
        "status": status,
        "start": headers.get("x-torpor-start"),
        "timings": timings,
        "error": None,
    }
    if status != 200:
        out["error"] = raw[:300].decode(errors="replace")
    return out


def metrics(sock: str, function: str) -> dict[str, float] | None:
    """The function's torpor_* samples in /metrics, "name{labels}" -> value; None if unreachable."""
    try:
        status, _, raw = request(sock, "GET", "/metrics", None, 10)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    out: dict[str, float] = {}
    label = f'function="{function}"'
    for line in raw.decode(errors="replace").splitlines():
        # Histogram buckets are left out: their _sum and _count say enough over a replay.
        if line.startswith("torpor_") and label in line and "_bucket{" not in line:
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metrics_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """Counters over the replay: after - before (after alone for a series reset in between)."""
    if after is None:
        return None
    before = before or {}
    return {
        k: (v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v)
        for k, v in after.items()
    }


# ---------------------------------------------------------------------------------------------
# Replay and summary


def request_body(template: Any, index: int) -> Any:
    if isinstance(template, dict) and "seed" in template:
        return {**template, "seed": index + 1}
    return template


def replay(
    sock: str, function: str, trace: Trace, template: Any, timeout: float
) -> list[Json]:
    """Send every arrival at its time, each from its own thread; the records in arrival order."""
    records: list[Json] = [{} for _ in trace.arrivals_s]
    threads: list[threading.Thread] = []
    t0 = time.perf_counter()

    def one(i: int, at: float) -> None:
        sent = time.perf_counter() - t0
        r = invoke(sock, function, request_body(template, i), timeout)
        records[i] = {
            "index": i,
            "scheduled_s": round(at, 6),
            "sent_s": round(sent, 6),
            **r,
        }

    for i, at in enumerate(trace.arrivals_s):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, at), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return records


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarise(records: list[Json]) -> Json:
    ok = [r for r in records if r["status"] == 200]
    lat = [r["latency_s"] for r in ok]
    starts: dict[str, int] = {}
    statuses: dict[str, int] = {}
    for r in records:
        starts[str(r["start"])] = starts.get(str(r["start"]), 0) + 1
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    cold = [r["latency_s"] for r in ok if r["start"] not in (None, "warm")]
    # Requests answered per second, from the first send to the last answer.
    span = max((r["sent_s"] + r["latency_s"] for r in ok), default=0.0) - min((r["sent_s"] for r in ok), default=0.0)
    warm = [r["latency_s"] for r in ok if r["start"] == "warm"]
    # The handler's own time (X-Torpor-Timings): what a request computes, apart from its wait.
    handler = [float(r["timings"]["handler"]) for r in ok if isinstance(r.get("timings"), dict) and "handler" in r["timings"]]

    def rnd(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    return {
        "requests": len(records),
        "ok": len(ok),
        "p50_s": rnd(quantile(lat, 0.5)),
        "p99_s": rnd(quantile(lat, 0.99)),
        "mean_s": rnd(sum(lat) / len(lat)) if lat else None,
        "max_s": rnd(max(lat)) if lat else None,
        "starts": dict(sorted(starts.items())),
        "cold_starts": sum(1 for r in ok if r["start"] not in (None, "warm")),
        "cold_p50_s": rnd(quantile(cold, 0.5)),
        "warm_p50_s": rnd(quantile(warm, 0.5)),
        "statuses": dict(sorted(statuses.items())),
        "throughput_rps": rnd(len(ok) / span) if span > 0 else None,
        "handler_p50_s": rnd(quantile(handler, 0.5)),
    }


def warmup_request(fdir: Path) -> Any:
    with open(fdir / "torpor.toml", "rb") as f:
        spec = tomllib.load(f)
    return (spec.get("warmup") or {}).get("request")


# ---------------------------------------------------------------------------------------------
# Machine information


def run_text(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine(torpor_bin: Path) -> Json:
    gpus = []
    smi = run_text(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader",
        ]
    )
    for line in (smi or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "driver": parts[1], "memory": parts[2]})
    versions: Json = {"python": platform.python_version()}
    for dist in ("torch", "torchvision", "transformers", "safetensors", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    commit = os.environ.get("TORPOR_COMMIT") or run_text(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"]
    )
    # `make gpu-carry` writes `git status --porcelain` beside the binary and gpu-run.sh passes
    # it on: any line is a change (empty: a clean tree); 0/false/no say clean explicitly.
    dirty_env = os.environ.get("TORPOR_DIRTY")
    dirty: bool | None = None
    if dirty_env is not None:
        text = dirty_env.strip()
        dirty = bool(text) and text.lower() not in ("0", "false", "no")
    if dirty is None and commit and not os.environ.get("TORPOR_COMMIT"):
        status = run_text(["git", "-C", str(ROOT), "status", "--porcelain"])
        dirty = None if status is None else bool(status)
    return {
        "gpus": gpus,
        "device": gpus[0]["name"]
        if gpus
        else f"CPU ({platform.processor() or platform.machine()})",
        "driver": gpus[0]["driver"] if gpus else None,
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "torpor_version": run_text([str(torpor_bin), "--version"]),
        "torpor_binary": str(torpor_bin),
        "torpor_commit": commit,
        "torpor_dirty": dirty,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": versions,
    }


def device_slug(m: Json) -> str:
    if not m["gpus"]:
        return "cpu"
    name = m["gpus"][0]["name"]
    hit = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    slug = (
        hit.group(1) if hit else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    ).lower()
    return slug if len(m["gpus"]) == 1 else f"{len(m['gpus'])}x{slug}"


# ---------------------------------------------------------------------------------------------
# Daemons for the comparison


def find_torpor() -> Path:
    env = os.environ.get("TORPOR_BIN")
    for c in (
        [Path(env)]
        if env
        else [ROOT / "target/release/torpor", ROOT / "target/debug/torpor"]
    ):
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise SystemExit(
        "run.py: no torpor binary: set TORPOR_BIN or build it (cargo build --release)"
    )


def has_cold_start_flag(torpor_bin: Path) -> bool:
    return "--cold-start" in (run_text([str(torpor_bin), "serve", "--help"]) or "")


def scaled_keepalive(duration: float) -> tuple[float, float, float]:
    return (round(duration / 30, 3), round(duration / 10, 3), round(duration / 2, 3))


def replace_table(text: str, header: str, body: str) -> str:
    """`text` (a torpor.toml) with its `[header]` table replaced by `body` (appended if absent)."""
    new = f"[{header}]\n{body}"
    # The table up to the next table header or the end of the file.
    text, n = re.subn(rf"(?ms)^\[{re.escape(header)}\][^\n]*\n.*?(?=^\[|\Z)", lambda _: new + "\n", text)
    return text if n else text.rstrip("\n") + "\n\n" + new


def sandboxed_scaling(spec: Json) -> str:
    """The [scaling] of a function deployed sandboxed for the comparison: one sandbox running as
    many requests at once as the spec's instances did."""
    sc = spec.get("scaling") or {}
    at_once = int(sc.get("max_instances", 4)) * int(sc.get("requests_per_instance", 1))
    return f"sandbox = true\nmax_instances = 1\nrequests_per_instance = {at_once}\n"


def function_copy(
    src: Path,
    dest: Path,
    keepalive: tuple[float, float, float] | None,
    sandbox: bool = False,
    entry: str | None = None,
) -> Path:
    """A copy of the function dir (files hard-linked where possible, so large weights cost nothing)
    with its [keepalive] replaced, with `sandbox` its [scaling] made a sandbox's
    (sandboxed_scaling), and with `entry` its entry replaced; the copy is what gets deployed."""
    if dest.exists():
        shutil.rmtree(dest)

    def link_or_copy(s: str, d: str) -> object:
        try:
            os.link(s, d)
            return d
        except OSError:
            return shutil.copy2(s, d)

    shutil.copytree(
        src,
        dest,
        copy_function=link_or_copy,
        ignore=shutil.ignore_patterns("__pycache__", ".*"),
    )
    if keepalive is not None or sandbox or entry:
        spec = dest / "torpor.toml"
        text = spec.read_text()
        if keepalive is not None:
            g, h, e = keepalive
            text = replace_table(text, "keepalive", f"gpu_release_s = {g}\nhibernate_s = {h}\nevict_s = {e}\n")
        if sandbox:
            text = replace_table(text, "scaling", sandboxed_scaling(tomllib.loads(text)))
        if entry:
            text, n = re.subn(r"(?m)^entry\s*=.*$", lambda _: f"entry = {json.dumps(entry)}", text, count=1)
            if n != 1:
                raise SystemExit(f"run.py: {src / 'torpor.toml'} has no top-level entry to replace")
        spec.unlink()  # a hard link: never write through it
        spec.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "torpor.spec", str(dest)],
        capture_output=True,
        text=True,
        check=False,
        env=dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")])
            ),
        ),
    )
    if r.returncode != 0:
        raise SystemExit(
            f"run.py: the copied spec does not validate: {r.stderr.strip()}"
        )
    return dest


class Daemon:
    def __init__(
        self, torpor_bin: Path, mode: str | None, root: Path, queue_timeout_s: float, extra_config: str = ""
    ) -> None:
        self.bin = torpor_bin
        self.root = root
        self.state = root / "state"
        self.sock = str(root / "torpord.sock")
        self.log = root / "torpord.log"
        config = root / "torpord.toml"
        # The extra top-level keys first: they must not land in the [queue] table.
        config.write_text(f"{extra_config}[queue]\nlength = 1024\ntimeout_s = {queue_timeout_s}\n")
        cmd = [
            str(torpor_bin),
            "serve",
            "--config",
            str(config),
            "--state-dir",
            str(self.state),
            "--socket",
            self.sock,
        ]
        if mode is not None:
            cmd += ["--cold-start", mode]
        env = {k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, env=env
            )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"run.py: torpor serve exited {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(
                    f"run.py: torpor serve did not listen in 30 s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def deploy(self, fdir: Path) -> Json:
        env = dict(os.environ, TORPOR_SOCKET=self.sock)
        start = time.perf_counter()
        r = subprocess.run(
            [str(self.bin), "deploy", "--json", str(fdir)],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
            check=False,
        )
        lines = [
            json.loads(x) for x in r.stdout.splitlines() if x.strip().startswith("{")
        ]
        result = next((x["result"] for x in lines if "result" in x), None)
        if r.returncode != 0 or result is None:
            raise SystemExit(
                f"run.py: deploy of {fdir} failed\n{r.stdout}\n{r.stderr}\n{self.log_tail()}"
            )
        return {
            "wall_s": round(time.perf_counter() - start, 3),
            "phases": {x["phase"]: x.get("s") for x in lines if "phase" in x},
            "result": result,
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Workers exit when the daemon goes; kill any left, found by our own state dir in their cmdline.
        for pid in pids_with(str(self.state) + "/"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def pids_with(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"
                ):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


STAGE_LABEL = re.compile(r'stage="([^"]*)"')


def by_stage(delta: dict[str, float] | None, name: str, scale: float) -> dict[str, float] | None:
    """The function's `name` series over the replay, per `stage` label (a daemon from before the
    label existed gives one "all" entry), divided by `scale`; None when it has no such series."""
    if delta is None:
        return None
    out: dict[str, float] = {}
    for k, v in delta.items():
        if not k.startswith(name + "{"):
            continue
        m = STAGE_LABEL.search(k)
        stage = m.group(1) if m else "all"
        out[stage] = out.get(stage, 0.0) + v / scale
    return {k: round(v, 6) for k, v in sorted(out.items())} if out else None


def gib_seconds_by_stage(delta: dict[str, float] | None) -> dict[str, float] | None:
    """GPU memory·seconds per stage (starting, warm, gpu_released, hibernating, ...), in GiB·s."""
    return by_stage(delta, "torpor_gpu_memory_byte_seconds_total", GIB)


def stage_seconds(delta: dict[str, float] | None) -> dict[str, float] | None:
    """Instance-seconds per stage over the replay."""
    return by_stage(delta, "torpor_instance_stage_seconds_total", 1.0)


def gib_seconds(delta: dict[str, float] | None) -> float | None:
    """GPU memory·seconds over the replay, all stages (starting included), in GiB·s."""
    stages = gib_seconds_by_stage(delta)
    return None if stages is None else round(sum(stages.values()), 6)


def compare(a: argparse.Namespace) -> int:
    torpor_bin = find_torpor()
    src = a.function_dir.resolve()
    with open(src / "torpor.toml", "rb") as f:
        name = tomllib.load(f)["name"]
    flag = has_cold_start_flag(torpor_bin)
    modes = [m for m in a.modes.split(",") if m] if flag else [m for m in a.modes.split(",") if m in ("restore", "sandbox")]
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"run.py: unknown mode {mode!r}; of {', '.join(MODES)}")
    note = (
        None
        if flag
        else "this torpor serve has no --cold-start flag: only the restore mode (the default) ran"
    )
    if note:
        print(f"run.py: {note}", file=sys.stderr)
    patterns = [p for p in a.patterns.split(",") if p]
    for p in patterns:
        if p not in PATTERNS:
            raise SystemExit(
                f"run.py: unknown pattern {p!r}; one of {', '.join(PATTERNS)}"
            )
    keepalive = (
        None
        if a.keepalive == "spec"
        else (
            scaled_keepalive(a.duration)
            if a.keepalive == "scaled"
            else tuple(float(x) for x in a.keepalive.split(","))
        )
    )
    if keepalive is not None and len(keepalive) != 3:
        raise SystemExit("run.py: --keepalive is G,H,E (seconds), 'scaled' or 'spec'")
    work = HERE / ".work"
    work.mkdir(exist_ok=True)
    fdir = function_copy(src, work / name, keepalive)
    fdirs = {m: fdir for m in modes}
    graphed = [m for m in modes if m.endswith("-graphs")]
    if graphed and not a.graphed_entry:
        raise SystemExit(
            f"run.py: mode {graphed[0]} needs --graphed-entry (e.g. model:ResNet152Graphed for examples/resnet152)"
        )
    for m in modes:
        if m.startswith("sandbox") or m in graphed:
            fdirs[m] = function_copy(
                src, work / f"{name}-{m}", keepalive, sandbox=m.startswith("sandbox"),
                entry=a.graphed_entry if m in graphed else None,
            )
    template = json.loads(a.request) if a.request else warmup_request(fdir)
    m = machine(torpor_bin)
    started = time.time()
    results: list[Json] = []
    daemons: dict[str, Json] = {}
    try:
        for mode in modes:
            root = Path(tempfile.mkdtemp(prefix=f"torpor-serverless-{mode}-"))
            # A sandbox's cold starts restore, as in `restore`, and so do the graphed modes'.
            cold_start = "boot" if mode == "boot" else "restore"
            how = table.mode_label(mode)
            print(f"== {name}, cold start by {how}: torpor serve in {root}", flush=True)
            d = Daemon(torpor_bin, cold_start if flag else None, root, a.queue_timeout, "".join(f"{c}\n" for c in a.daemon_config))
            try:
                for pattern in patterns:
                    dep = d.deploy(fdirs[mode])
                    print(
                        f"   deployed in {dep['wall_s']:.1f} s; replaying {pattern} for {a.duration:g} s",
                        flush=True,
                    )
                    trace = superposed(pattern, a.duration, a.seed, a.clients)
                    before = metrics(d.sock, name)
                    t = time.perf_counter()
                    records = replay(d.sock, name, trace, template, a.timeout)
                    wall = time.perf_counter() - t
                    after = metrics(d.sock, name)
                    delta = metrics_delta(before, after)
                    s = summarise(records)
                    # A daemon that ignored --cold-start would make the comparison meaningless.
                    wrong = "restored" if cold_start == "boot" else "booted"
                    s["mode_violations"] = s["starts"].get(wrong, 0)
                    if s["mode_violations"]:
                        print(
                            f"   WARNING: {s['mode_violations']} starts were {wrong} in mode {mode}",
                            flush=True,
                        )
                    results.append(
                        {
                            "mode": mode,
                            "pattern": pattern,
                            "function": name,
                            "trace": {
                                "params": trace.params,
                                "seed": trace.seed,
                                "duration_s": trace.duration_s,
                                "requests": len(trace.arrivals_s),
                            },
                            "deploy": dep,
                            "replay_wall_s": round(wall, 3),
                            "summary": s,
                            "gpu_memory_gib_s": gib_seconds(delta),
                            "gpu_memory_gib_s_by_stage": gib_seconds_by_stage(delta),
                            "stage_seconds": stage_seconds(delta),
                            "metrics_delta": delta,
                            "requests": records,
                        }
                    )
                    print(
                        f"   {pattern}: {s['ok']}/{s['requests']} ok, p50 {s['p50_s']} s, p99 {s['p99_s']} s, "
                        f"starts {s['starts']}",
                        flush=True,
                    )
            finally:
                d.stop()
                logs = d.log_tail()
                if a.keep_state:
                    print(f"   state kept in {root}")
                else:
                    shutil.rmtree(root, ignore_errors=True)
            daemons[mode] = {"state_dir": str(root), "log_tail": logs[-1500:]}
    finally:
        for d_ in {fdir, *fdirs.values()}:
            shutil.rmtree(d_, ignore_errors=True)
        try:
            work.rmdir()
        except OSError:
            pass
    out_doc: Json = {
        "benchmark": "serverless",
        "machine": m,
        "settings": {
            "duration_s": a.duration,
            "seed": a.seed,
            "patterns": patterns,
            "modes": modes,
            "graphed_entry": a.graphed_entry,
            "daemon_config": a.daemon_config,
            "cold_start_flag": flag,
            "note": note,
            "keepalive": None
            if keepalive is None
            else dict(zip(("gpu_release_s", "hibernate_s", "evict_s"), keepalive)),
            "client_timeout_s": a.timeout,
            "clients": a.clients,
            "queue_timeout_s": a.queue_timeout,
        },
        "functions": {name: {"dir": str(src), "request_template": template}},
        "daemons": {f"{name}/{k}": v for k, v in daemons.items()},
        "elapsed_s": round(time.time() - started, 3),
        "results": results,
    }
    out = a.out or ROOT / "bench" / "results" / f"serverless-{device_slug(m)}.json"
    if (
        a.merge and out.exists()
    ):  # one file for several functions: keep the other functions' results
        old = json.loads(out.read_text())
        out_doc["results"] = [
            r for r in old.get("results", []) if r.get("function") != name
        ] + results
        out_doc["functions"] = {**old.get("functions", {}), **out_doc["functions"]}
        out_doc["daemons"] = {**old.get("daemons", {}), **out_doc["daemons"]}
        out_doc["elapsed_s"] = round(out_doc["elapsed_s"] + old.get("elapsed_s", 0), 3)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(out_doc, indent=1) + "\n")
    print(f"wrote {out}\n")
    print(table.render(out_doc))
    return 0


def single(a: argparse.Namespace) -> int:
    if not a.socket or not a.function or not a.pattern:
        raise SystemExit(
            "run.py: a replay needs --socket, --function and --pattern (or use --compare)"
        )
    template: Any = json.loads(a.request) if a.request else None
    if template is None and a.function_dir:
        template = warmup_request(a.function_dir)
    trace = generate(a.pattern, a.duration, a.seed)
    before = metrics(a.socket, a.function)
    records = replay(a.socket, a.function, trace, template, a.timeout)
    delta = metrics_delta(before, metrics(a.socket, a.function))
    doc = {
        "function": a.function,
        "pattern": a.pattern,
        "trace": trace.to_json(),
        "summary": summarise(records),
        "gpu_memory_gib_s": gib_seconds(delta),
        "gpu_memory_gib_s_by_stage": gib_seconds_by_stage(delta),
        "stage_seconds": stage_seconds(delta),
        "metrics_delta": delta,
        "requests": records,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        json.dumps(
            {"summary": doc["summary"], "gpu_memory_gib_s": doc["gpu_memory_gib_s"]},
            indent=1,
        )
    )
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--compare", action="store_true", help="start daemons, compare restore and boot"
    )
    ap.add_argument("--socket", help="API socket of a running daemon (replay mode)")
    ap.add_argument("--function", help="function name (replay mode)")
    ap.add_argument(
        "--function-dir",
        type=Path,
        help="function dir (--compare; in replay mode, for its warm-up request)",
    )
    ap.add_argument("--pattern", choices=PATTERNS, help="replay mode")
    ap.add_argument(
        "--patterns", default=",".join(PATTERNS), help="--compare: comma-separated"
    )
    ap.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="--compare: comma-separated, of restore,boot,sandbox,restore-graphs,sandbox-graphs "
        "(default restore,boot)",
    )
    ap.add_argument(
        "--daemon-config",
        action="append",
        default=[],
        help="--compare: a top-level key = value line for every daemon's config (e.g. 'split_gpu = false'); repeatable",
    )
    ap.add_argument(
        "--graphed-entry",
        help="--compare: the entry the *-graphs modes deploy (model:ResNet152Graphed for examples/resnet152)",
    )
    ap.add_argument(
        "--duration", type=float, default=60.0, help="seconds per replay (default 60)"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--clients",
        type=int,
        default=1,
        help="--compare: independent traces of each pattern superposed (seeds seed, seed+1, ...): "
        "the same shape, that many times the load (default 1)",
    )
    ap.add_argument(
        "--request", help="request JSON (default: the function's warm-up request)"
    )
    ap.add_argument(
        "--keepalive",
        default="scaled",
        help="--compare: G,H,E seconds, 'scaled' (default: duration/30, /10, /2) or 'spec' (as deployed)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="client timeout per request, seconds",
    )
    ap.add_argument(
        "--queue-timeout",
        type=float,
        default=600.0,
        help="--compare: the daemons' queue.timeout_s",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="result JSON (default for --compare: bench/results/serverless-<device>.json)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="--compare: keep other functions' results already in --out",
    )
    ap.add_argument(
        "--keep-state",
        action="store_true",
        help="--compare: keep the daemons' state dirs",
    )
    a = ap.parse_args(argv)
    if a.clients < 1:
        raise SystemExit(f"run.py: --clients must be at least 1, got {a.clients}")
    if a.compare:
        if a.function_dir is None:
            raise SystemExit("run.py: --compare needs --function-dir")
        return compare(a)
    return single(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
