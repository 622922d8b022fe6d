"""Concurrent snapshots and live migration of torpord instances (issue 10 items 1 and 3;
docs/checkpoints.md, docs/migration.md), measured through the real daemon.

Part `hibernate` (one GPU is enough): a function (default GPT-2-Large, bench/coldstart/functions)
is deployed on two daemons, one with `restore_server.concurrent_snapshot = false` (stop-the-world:
the whole capture in the stop) and one with it on (segments pre-copied while the instance serves,
the stop copies the blocks that changed). On each, `--runs` times: one request (the reference
output), idle until the instance hibernates (`hibernate_s`), the daemon's `hibernation stop` line
(stop_s, what the stop copied, its `phases`: seconds by step, the snapshot's own as `snapshot.*`), then a request that wakes it, whose output must equal the
reference bit for bit. The deploy's function snapshot stop (`stop_s` of `snapshot_function`) is
recorded for both too. Output: `--out-hibernate` (`concurrent-checkpoint-*.json`, top-level
`summary.stop_s` = the concurrent hibernation's median stop, `summary.stop_phases_s` its steps' medians).

Part `migrate` (two GPUs of one model; on the CPU, two host-backend devices): one instance serves
requests sent back to back by a client thread; after `--settle-s` the instance is moved to the
other GPU (`POST /v1/instances/ID/migrate`) and back, while the client goes on. Downtime is the
longest gap between two answers around each migration; every answer must equal the first. Output:
`--out-migrate` (`migration-*.json`, `summary.migration_downtime_s`, the worst of the runs, and
`summary.migration_total_s`).

`--dump-logs DIR` copies each hibernation's CRIU dump log (-v4, timestamped) into DIR before the
wake removes the snapshot: `python3 bench/coldstart/criu_log_gaps.py DIR/*.log` says where the
stop's dump spent its time.

Part `released` (a GPU function): the hibernation of an instance that released its GPU first (the
default delays, `gpu_release_s` < `hibernate_s`; here 1 s and `--hibernate-s`), on two daemons:
`restore_server.hibernate_released = true` (the default since session 42: snapshotted as it is,
its GPU not resumed) and `false` (resumed first, as before). Same runs as `hibernate`. Output:
`--out-released` (`hibernation-released-*.json`, `summary.stop_s` = the median stop without the
resume, `summary.stop_s_resumed_first` with it).

    python3 bench/concurrent/measure.py --model gpt2-large --parts hibernate,migrate \\
        --out-hibernate bench/results/concurrent-checkpoint-h100.json --out-migrate bench/results/migration-h200x2.json
    python3 bench/concurrent/measure.py --parts released --out-released bench/results/hibernation-released-h200.json
    python3 bench/concurrent/measure.py --model cpu --runs 1        # the CPU smoke test (tests/test_bench_concurrent.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "bench" / "coldstart"))

import split  # noqa: E402
from run import find_torpor, machine  # noqa: E402

Json = dict[str, Any]
PARTS = ("hibernate", "migrate", "released")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-large", choices=sorted(split.MODELS), help="a function of bench/coldstart/functions")
    p.add_argument("--parts", default="hibernate,migrate", help="comma list of: " + ", ".join(PARTS))
    p.add_argument("--runs", type=int, default=3, help="hibernations per mode; migrations (there and back count two)")
    p.add_argument("--hibernate-s", type=float, default=3.0, help="the function's keepalive.hibernate_s")
    p.add_argument("--settle-s", type=float, default=2.0, help="back-to-back requests before and after each migration")
    p.add_argument("--shrink-context", choices=("on", "off"), default="on",
                   help="the function's [gpu] shrink_context (off: the context's stack stays reserved at the "
                   "quiet points and at a migration's unmap, as before session 22), for an A/B")
    p.add_argument("--peer-copy", choices=("on", "off"), default="on",
                   help="restore_server.peer_copy: the migration's pre-copy moves read-only segments GPU to GPU "
                   "(off: all through host memory, as before session 23), for an A/B")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp/torpor-concurrent"))
    p.add_argument("--torpor", type=Path, default=None, help="the torpor binary (default: as bench/coldstart/run.py finds it)")
    p.add_argument("--out-hibernate", type=Path, default=None)
    p.add_argument("--out-migrate", type=Path, default=None)
    p.add_argument("--out-released", type=Path, default=None)
    p.add_argument("--dump-logs", type=Path, default=None,
                   help="copy each hibernation's CRIU dump log (timestamped, -v4) into this directory")
    a = p.parse_args(argv)
    a.parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    return a


def function_dir(
    model: split.Model,
    root: Path,
    say: Any,
    name: str,
    hibernate_s: float,
    shrink_context: bool = True,
    gpu_release_s: float | None = None,
) -> Path:
    """The benchmark's copy of the model's function, renamed, one instance, hibernating after
    `hibernate_s` idle from warm (gpu_release_s is as long unless given: the hibernation comes
    first)."""
    fdir = split.assemble(model.name, model, root, say)
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    fdir.rename(target)
    toml = target / "torpor.toml"
    text = toml.read_text()
    text = re.sub(r'^name = ".*"$', f'name = "{name}"', text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^max_instances = \d+$", "max_instances = 1", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^hibernate_s = [0-9.]+$", f"hibernate_s = {hibernate_s}", text, count=1, flags=re.MULTILINE)
    # Equal delays: the ticker hibernates a warm instance before it would release its GPU.
    release = hibernate_s if gpu_release_s is None else gpu_release_s
    text = re.sub(r"^gpu_release_s = [0-9.]+$", f"gpu_release_s = {release}", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^evict_s = [0-9.]+$", f"evict_s = {hibernate_s * 100}", text, count=1, flags=re.MULTILINE)
    if not shrink_context:
        assert "\n[gpu]" not in text, f"{toml} has a [gpu] table already"
        text += "\n[gpu]\nshrink_context = false\n"
    toml.write_text(text)
    return target


def stop_lines(log: Path) -> list[Json]:
    """The daemon's `hibernation stop` lines, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "hibernation stop" not in line:
            continue
        stop = re.search(r"stop_s=([0-9.e-]+)", line)
        conc = re.search(r"concurrent=(true|false)", line)
        delta = re.search(r"delta=(\{.*?\})", line)
        phases = re.search(r"phases=(\{.*?\})", line)
        out.append(
            {
                "stop_s": float(stop.group(1)) if stop else None,
                "concurrent": bool(conc and conc.group(1) == "true"),
                "delta": json.loads(delta.group(1)) if delta else None,
                "phases": json.loads(phases.group(1)) if phases else None,
            }
        )
    return out


def precopy_lines(log: Path) -> list[float]:
    return [
        float(m.group(1))
        for m in re.finditer(r"segments pre-copied while the instance serves.*?seconds=([0-9.e-]+)", log.read_text(errors="replace"))
    ]


def stages(d: split.Daemon, name: str) -> list[str]:
    status, _, body = d.request("GET", f"/v1/functions/{name}", timeout=30)
    if status != 200:
        raise RuntimeError(f"GET /v1/functions/{name} answered {status}")
    return [i["stage"] for i in json.loads(body)["instances"]]


def wait_for(what: str, cond: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def median_or_none(values: list[Any]) -> float | None:
    """The median of the values that are numbers; None when none is."""
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def phase_medians(runs: list[Json]) -> Json | None:
    """Each step of the stop (the daemon's `phases`), its median over the runs that logged it."""
    names: list[str] = []
    for r in runs:
        names += [k for k in (r.get("phases") or {}) if k not in names]
    if not names:
        return None
    return {k: round(statistics.median(r["phases"][k] for r in runs if k in (r.get("phases") or {})), 4) for k in names}


def hibernate_part(a: argparse.Namespace, torpor: Path, model: split.Model, work: Path, say: Any) -> Json:
    modes: Json = {}
    for mode, concurrent in (("stop-the-world", False), ("concurrent", True)):
        config = {"restore_server": {"concurrent_snapshot": concurrent, "host_cache_bytes": split.HOST_CACHE_BYTES}}
        modes[mode] = hibernations(a, torpor, model, work, say, mode, config, None)
    conc, stw = modes["concurrent"], modes["stop-the-world"]
    return {
        "benchmark": "concurrent-hibernation",
        "summary": {
            "model": model.name,
            "stop_s": conc["stop_s_median"],
            "stop_s_stop_the_world": stw["stop_s_median"],
            "stop_phases_s": conc["stop_phases_median_s"],
            "deploy_stop_s": conc["deploy_stop_s"],
            "deploy_stop_s_stop_the_world": stw["deploy_stop_s"],
            "identical": conc["identical"] and stw["identical"],
            "migration_downtime_s": None,
            "training_overhead_pct": None,
        },
        "modes": modes,
    }


def released_part(a: argparse.Namespace, torpor: Path, model: split.Model, work: Path, say: Any) -> Json:
    if not model.gpu:
        raise ValueError(f"--parts released needs a GPU function (only those release their GPU); {model.name} is not")
    modes: Json = {}
    for mode, keep_released in (("resumed-first", False), ("released", True)):
        config = {"restore_server": {"hibernate_released": keep_released, "host_cache_bytes": split.HOST_CACHE_BYTES}}
        modes[mode] = hibernations(a, torpor, model, work, say, mode, config, 1.0)
        if any(r["resumed_first"] == keep_released for r in modes[mode]["runs"]):
            raise RuntimeError(f"{mode}: a hibernation {'was' if keep_released else 'was not'} resumed first: {modes[mode]['runs']}")
    rel, res = modes["released"], modes["resumed-first"]
    return {
        "benchmark": "hibernation-from-gpu-released",
        "summary": {
            "model": model.name,
            "stop_s": rel["stop_s_median"],
            "stop_s_resumed_first": res["stop_s_median"],
            "stop_phases_s": rel["stop_phases_median_s"],
            "stop_phases_s_resumed_first": res["stop_phases_median_s"],
            "identical": rel["identical"] and res["identical"],
        },
        "modes": modes,
    }


def hibernations(
    a: argparse.Namespace,
    torpor: Path,
    model: split.Model,
    work: Path,
    say: Any,
    mode: str,
    config: Json,
    gpu_release_s: float | None,
) -> Json:
    """`--runs` hibernations of one instance on a daemon of its own (`config`): each a reference
    request, the hibernation's stop line and a wake whose output must equal the reference."""
    state = work / f"hib-{mode}"
    d = split.Daemon(torpor, state, f"hib-{mode}", config, work / "logs")
    name = f"{model.name}-hib"
    try:
        fdir = function_dir(model, work / "functions", say, name, a.hibernate_s, a.shrink_context == "on", gpu_release_s)
        dep = d.deploy(fdir)
        snap = dep["snapshot_function"] or {}
        say(f"{mode}: deployed in {dep['wall_s']} s; deploy stop_s {snap.get('stop_s')}")
        runs = []
        for i in range(a.runs):
            ref = d.invoke(name, model.request)
            if gpu_release_s is not None:
                wait_for("the GPU release", lambda: stages(d, name) == ["gpu_released"], 60 + gpu_release_s)
            wait_for("the hibernation", lambda: stages(d, name) == ["hibernated"], 120 + a.hibernate_s)
            wait_for("the hibernation's stop line", lambda: len(stop_lines(d.log)) > i, 30)
            stop = stop_lines(d.log)[i]
            if a.dump_logs:
                # CRIU's timestamped dump log, before the wake removes the hibernation snapshot.
                a.dump_logs.mkdir(parents=True, exist_ok=True)
                for log in sorted(state.glob("snapshots/hib-*/dump.log")):
                    shutil.copy(log, a.dump_logs / f"{mode}-{i}-dump.log")
            woken = d.invoke(name, model.request)
            runs.append(
                {
                    "stop_s": stop["stop_s"],
                    "delta": stop["delta"],
                    "phases": stop["phases"],
                    "concurrent": stop["concurrent"],
                    "resumed_first": "gpu_resume" in (stop["phases"] or {}),
                    "reference_start": ref["start"],
                    "woken_start": woken["start"],
                    "wake_wall_s": woken["wall_s"],
                    "identical": woken["value"] == ref["value"],
                }
            )
            say(f"{mode} run {i}: stop {stop['stop_s']:.3f} s, delta {stop['delta']}, woken {woken['start']} identical {runs[-1]['identical']}")
        stops = [r["stop_s"] for r in runs if r["stop_s"] is not None]
        return {
            "deploy_stop_s": snap.get("stop_s"),
            "deploy_changed_blocks": snap.get("changed_blocks"),
            "segment_bytes": snap.get("segment_bytes"),
            "runs": runs,
            "precopy_s": precopy_lines(d.log),
            "stop_s_median": statistics.median(stops) if stops else None,
            "stop_s_max": max(stops) if stops else None,
            "stop_phases_median_s": phase_medians(runs),
            "identical": all(r["identical"] for r in runs),
        }
    finally:
        d.stop()


def gpu_count() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in r.stdout.splitlines() if line.startswith("GPU "))


class Client(threading.Thread):
    """Sends the request back to back and records when each answer came and whether it equals
    the first."""

    def __init__(self, d: split.Daemon, name: str, request: Json) -> None:
        super().__init__(daemon=True)
        self.d, self.name, self.request = d, name, request
        self.done: list[tuple[float, bool, int]] = []
        self.reference: Any = None
        self.stopping = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        while not self.stopping.is_set():
            t0 = time.perf_counter()
            status, _, body = self.d.request("POST", f"/v1/functions/{self.name}/invoke", self.request, timeout=600)
            t1 = time.perf_counter()
            if status != 200:
                self.error = f"an answer {status}: {body[:300]!r}"
                self.done.append((t1, False, status))
                continue
            value = json.loads(body)
            if self.reference is None:
                self.reference = value
            self.done.append((t1, value == self.reference, status))
            del t0


def migrate_part(a: argparse.Namespace, torpor: Path, model: split.Model, work: Path, say: Any) -> Json:
    gpus = gpu_count() if model.gpu else 2
    if gpus < 2:
        return {
            "benchmark": "migration",
            "summary": {"model": model.name, "migration_downtime_s": None, "skipped": f"{gpus} GPU(s) on this machine: the migration needs two of one model (nvidia-h200-x2)"},
        }
    state = work / "migrate"
    config = {
        "restore_server": {
            "host_devices": 2,
            "host_cache_bytes": split.HOST_CACHE_BYTES,
            "peer_copy": a.peer_copy == "on",
        }
    }
    d = split.Daemon(torpor, state, "migrate", config, work / "logs")
    name = f"{model.name}-mig"
    runs = []
    try:
        d.deploy(function_dir(model, work / "functions", say, name, 3600, a.shrink_context == "on"))
        d.invoke(name, model.request)
        status, _, body = d.request("GET", f"/v1/functions/{name}")
        (inst,) = [i for i in json.loads(body)["instances"] if i.get("pid")]
        client = Client(d, name, model.request)
        client.start()
        time.sleep(a.settle_s)
        at = 0
        for i in range(a.runs):
            to = 1 - at
            t0 = time.perf_counter()
            status, _, body = d.request("POST", f"/v1/instances/{inst['id']}/migrate", {"gpu": to}, timeout=600)
            t1 = time.perf_counter()
            answer = json.loads(body)
            if status != 200:
                raise RuntimeError(f"migrate to GPU {to} answered {status}: {answer}")
            at = to
            time.sleep(a.settle_s)
            # Answers from just before the migration began to the first after it ended.
            times = [t for t, _, _ in client.done]
            before = [t for t in times if t <= t0]
            after = [t for t in times if t >= t1]
            window = ([before[-1]] if before else []) + [t for t in times if t0 < t < t1] + (after[:1])
            gaps = [y - x for x, y in zip(window, window[1:])]
            steady = [y - x for x, y in zip(before, before[1:])][-50:]
            runs.append(
                {
                    "from": answer["from"],
                    "to": answer["to"],
                    "downtime_s": max(gaps) if gaps else None,
                    "total_s": t1 - t0,
                    "daemon": answer,
                    "steady_gap_median_s": statistics.median(steady) if steady else None,
                }
            )
            say(f"migration {i}: GPU {answer['from']} -> {answer['to']}: downtime {runs[-1]['downtime_s']}, total {t1 - t0:.3f} s, stop {answer['stop_s']:.3f} s, precopy {answer['precopy_s']:.3f} s ({answer.get('peer_bytes', 0)} of {answer['bytes']} bytes GPU to GPU), stop phases {answer.get('stop_phases')}")
        client.stopping.set()
        client.join(120)
    finally:
        d.stop()
    downtimes = [r["downtime_s"] for r in runs if r["downtime_s"] is not None]
    speeds = [r["daemon"]["bytes"] / r["daemon"]["precopy_s"] / 1e9 for r in runs if r["daemon"]["precopy_s"] > 0]
    identical = all(ok for _, ok, _ in client.done) and client.error is None
    return {
        "benchmark": "migration",
        "summary": {
            "model": model.name,
            "migration_downtime_s": max(downtimes) if downtimes else None,
            "migration_downtime_s_median": statistics.median(downtimes) if downtimes else None,
            "migration_total_s": max(r["total_s"] for r in runs) if runs else None,
            "shrink_context": a.shrink_context,
            "peer_copy": a.peer_copy,
            "precopy_s_median": statistics.median(r["daemon"]["precopy_s"] for r in runs) if runs else None,
            # Bytes of segments over the pre-copy's seconds: the move's own speed.
            "precopy_gbps_median": statistics.median(speeds) if speeds else None,
            "precopy_peer_bytes": runs[-1]["daemon"].get("peer_bytes") if runs else None,
            # Each stop phase's median over the migrations (a daemon of before session 22: none).
            "stop_phases_median_s": {
                k: statistics.median(r["daemon"]["stop_phases"][k] for r in runs)
                for k in (runs[0]["daemon"].get("stop_phases") or {} if runs else {})
            },
            # What the driver's checkpoint moved (NVML, session 42 on): what the residue's time grows with.
            "residue_bytes_median": median_or_none([r["daemon"].get("residue_bytes") for r in runs]),
            "answers": len(client.done),
            "identical": identical,
            "client_error": client.error,
            "stop_s": None,
            "training_overhead_pct": None,
        },
        "runs": runs,
    }


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("measure.py: run as root: torpord starts workers in namespaces and runs CRIU")
    torpor = find_torpor(a.torpor)
    model = split.MODELS[a.model]
    work = a.work_dir.resolve() / f"run-{int(time.time() * 1000)}"
    (work / "logs").mkdir(parents=True)
    (work / "functions").mkdir()

    def say(msg: str) -> None:
        print(f"[concurrent] {msg}", flush=True)

    info = machine()
    rc = 0
    parts = {"hibernate": (hibernate_part, a.out_hibernate), "migrate": (migrate_part, a.out_migrate), "released": (released_part, a.out_released)}
    for part, (run_part, out) in parts.items():
        if part not in a.parts:
            continue
        try:
            doc = run_part(a, torpor, model, work, say)
        except Exception as e:  # the JSON says what failed
            say(f"{part}: FAILED: {e}")
            doc = {"benchmark": part, "summary": {"model": model.name, "error": f"{type(e).__name__}: {e}"}}
            rc = 1
        doc["machine"] = info
        doc["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
        text = json.dumps(doc, indent=2)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")
        print(json.dumps(doc["summary"]))
    shutil.rmtree(work / "functions", ignore_errors=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
