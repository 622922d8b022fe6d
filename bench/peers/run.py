"""The peer benchmark: the ways a user starts the same model, side by side, each answering the same
request with the same digest. Run on the GPU machine as root (scripts/gpu-run.sh peers):

    python3 bench/peers/run.py [--models gpt2-large,llama-8b] [--modes MODE,...] [--runs N] --out FILE

Models (bench/peers/lm.py): `gpt2-large` (the examples/gpt2-large function's model and weights,
fp32, 3.1 GB) and `llama-8b` (Llama-3-8B's shape, bf16, 16.1 GB of random weights that
bench/peers/make_weights.py writes on the machine, on the GPU, into --weights-dir, when absent);
`tiny-gpt2` and `tiny-llama` for the CPU test (tests/test_bench_peers.py; tiny-llama has a Torpor
function too, bench/coldstart/functions/tiny-llama, so Torpor's modes run on the CPU as well).

Modes, each run a fresh process (bench/peers/worker.py) or a fresh restore:
  scratch                a fresh python: import torch and transformers, make the CUDA context,
                         build the model on the meta device, load the weights with the best
                         loader, answer; timed from exec to the answer read;
  scratch-disk           the same after the kernel's page cache was dropped;
  pool                   a pre-imported interpreter (torch + transformers imported, CUDA context
                         made) kept alive; timed from the request written to the answer read:
                         build + load + answer;
  built-safetensors      a pre-built process (model on the meta device, CUDA context made):
                         safetensors `load_file(device=...)` + assign + answer;
  built-runai            ... Run:ai Model Streamer's `SafetensorsStreamer`;
  built-fastsafetensors  ... fastsafetensors' `fastsafe_open` (no GDS);
  built-disk             ... the best loader after the page cache was dropped;
  transparent, cold, cold-disk, standby
                         Torpor through torpord: bench/coldstart/split.py's modes of the same name
                         (its Bench, daemons and functions: bench/coldstart/functions/<model>),
                         with the same request.
The best loader is the fastest built-* median of the model in this run (--best-loader to name
one, e.g. in a part without the built-* rows). Loaders that are not installed (runai,
fastsafetensors: optional benchmark dependencies, bench/peers/carry.sh) make their mode a
skipped row with the reason; so do Torpor's modes without root or a torpor binary, and for a
GPU model without a GPU. --no-drop-cache leaves the page cache alone (a shared machine): the
*-disk runs, Torpor's cold-disk included, then record page_cache_dropped false and why.

Per pool and built run, what the kept process holds while idle, before the request: its
resident host memory (VmRSS) and GPU memory (NVML, the CUDA context included); per Torpor mode
what the node keeps while the function is idle (split.py --idle: the daemon's /metrics gauges,
its RSS and GPU memory). The summary has each model's medians, whether every digest is
identical, the issue's targets with met/missed, and the resident cost of each peer.

Runs in parts (each device call is limited to 10 minutes): --models/--modes pick a part, every
part writes its own JSON, bench/peers/merge.py joins them. Render with bench/peers/table.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
COLDSTART = ROOT / "bench" / "coldstart"
sys.path.insert(0, str(HERE))
import lm  # noqa: E402
import loaders  # noqa: E402
import table  # noqa: E402  (before split.py puts bench/coldstart, which has a table.py too, first)


def _coldstart_run() -> ModuleType:
    """bench/coldstart/run.py, as the module `run` that split.py imports (this file has the
    same name: loaded by path)."""
    have = sys.modules.get("run")
    if have is not None and Path(str(getattr(have, "__file__", ""))).resolve() == COLDSTART / "run.py":
        return have
    sys.path.insert(1, str(COLDSTART))  # its own import of models.py
    spec = importlib.util.spec_from_file_location("run", COLDSTART / "run.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["run"] = module
    spec.loader.exec_module(module)
    return module


coldstart = _coldstart_run()
import split  # noqa: E402  (bench/coldstart/split.py: Torpor's modes)

Json = dict[str, Any]

PEER_MODES = ("scratch", "scratch-disk", "pool", "built-safetensors", "built-runai", "built-fastsafetensors", "built-disk")
TORPOR_MODES = ("transparent", "cold", "cold-disk", "standby")
MODES = PEER_MODES + TORPOR_MODES
# The order a model's modes run in: the built-* rows first (they choose the best loader), the
# page-cache-dropping modes after the warm ones, Torpor's last, cold and standby side by side
# (one daemon config: its warmed GPU cache serves both) and cold-disk (no cache) after them.
ORDER = (
    "built-safetensors",
    "built-runai",
    "built-fastsafetensors",
    "scratch",
    "pool",
    "scratch-disk",
    "built-disk",
    "transparent",
    "cold",
    "standby",
    "cold-disk",
)
# Torpor's standby is its default kind, `standby_gpu = "live"` (split.py's standby-live row).
SPLIT_MODE = {"standby": "standby-live"}
BUILT_LOADER = {"built-safetensors": "safetensors", "built-runai": "runai", "built-fastsafetensors": "fastsafetensors"}
MODELS = tuple(lm.SPECS)
# A scratch start of llama-8b takes 20-35 s: two runs there.
DEFAULT_RUNS = {"gpt2-large": 3, "llama-3b": 2, "llama-8b": 2, "tiny-gpt2": 1, "tiny-llama": 1}
REQUEST: Json = {"seed": 1}
GIB = 1 << 30
# llama-8b's segments (16.1 GB) do not fit split.py's 8 GiB caches: the cold and standby daemons
# get caches that hold them.
CACHE_BYTES = {"llama-8b": 24 * GIB}
# The issue's targets (H100, medians of one run).
TARGETS: list[Json] = [
    {"model": "llama-8b", "mode": "cold", "limit_s": 0.60},
    {"model": "llama-8b", "mode": "standby", "limit_s": 0.20},
    {"model": "gpt2-large", "mode": "cold", "limit_s": 0.30},
    {"model": "llama-8b", "mode": "cold-disk", "limit_of": "built-disk", "divisor": 3},
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2-large,llama-8b", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--runs", type=int, help=f"runs per model and mode (default {DEFAULT_RUNS})")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--weights-dir",
        type=Path,
        default=Path(os.environ.get("TORPOR_PEERS_DIR", "/var/tmp/torpor-peers")),
        help="generated weights (llama-8b, tiny-*): written here when absent ($TORPOR_PEERS_DIR)",
    )
    p.add_argument("--best-loader", choices=("auto", *loaders.LOADERS), default="auto")
    p.add_argument("--no-drop-cache", action="store_true", help="never drop the page cache (the *-disk runs say so)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the peer processes")
    p.add_argument("--timeout-s", type=float, default=300, help="longest one peer run may take")
    p.add_argument("--torpor", type=Path, help="torpor binary (Torpor's modes; default $TORPOR_BIN)")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp/torpor-split"), help="Torpor's modes: split.py's work dir")
    p.add_argument(
        "--budget-min",
        type=float,
        default=8.0,
        help="past this many minutes, rows get one run each (Torpor's deploys always run); the JSON is rewritten after every row",
    )
    a = p.parse_args(argv)
    a.models = split.choose(p, a.models, MODELS, "model")
    a.modes = split.choose(p, a.modes, MODES, "mode")
    a.modes = [m for m in ORDER if m in a.modes]
    if a.runs is not None and a.runs < 1:
        p.error("--runs must be at least 1")
    return a


def summary(values: list[float]) -> Json | None:
    out: Json | None = coldstart.summary(list(values))
    return out


def read_file(path: Path) -> float:
    """Reads `path` once, so its pages are in the page cache; returns the seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return round(time.perf_counter() - t0, 3)


class PeerProcess:
    """A bench/peers/worker.py process and its `PEER` messages."""

    def __init__(self, argv: list[str], log: IO[str]) -> None:
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        self.messages: queue.Queue[Json | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                self.messages.put(json.loads(line[5:]))
        self.messages.put(None)

    def message(self, timeout: float) -> Json:
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no answer from the peer process within {timeout:.0f} s") from None
        if msg is None:
            raise RuntimeError(f"the peer process exited ({self.proc.wait()}) without an answer (see the log)")
        if "error" in msg:
            raise RuntimeError(f"the peer process failed: {msg['error']}\n{msg.get('trace', '')}")
        return msg

    def send(self, obj: Json) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t0 = time.monotonic()
        self.device = a.device
        if self.device == "auto":
            self.device = "cuda" if shutil.which("nvidia-smi") and gpu_present() else "cpu"
        self.results: list[Json] = []
        self.errors: list[str] = []
        self.best: dict[str, Json] = {}
        self.cache_dropped = False
        self.weight_bytes: dict[str, int] = {}
        self.torpor: Json = {}
        self.torpor_doc: Json | None = None
        self.info: Json = machine()
        a.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = a.out.with_suffix(".workers.log")
        self.log = open(self.log_path, "a")

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def over_budget(self) -> bool:
        return bool((time.monotonic() - self.t0) / 60 > self.a.budget_min)

    def runs(self, model: str) -> int:
        return int(self.a.runs or DEFAULT_RUNS.get(model, 2))

    # -----------------------------------------------------------------------------------------
    # Weights

    def weights(self, model: str) -> Path:
        """The model's safetensors file, written first where absent."""
        if model == "gpt2-large":
            path = ROOT / "examples" / "gpt2-large" / "weights.safetensors"
            maker = [self.a.python, str(ROOT / "examples" / "gpt2-large" / "make_weights.py")]
        else:
            path = self.a.weights_dir / f"{model}.safetensors"
            maker = [self.a.python, str(HERE / "make_weights.py"), model, str(path)]
            if self.device == "cpu":
                maker += ["--device", "cpu"]
        if not path.is_file():
            self.say(f"{model}: writing {path}")
            t0 = time.perf_counter()
            r = subprocess.run(maker, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"writing {path} failed:\n{r.stdout}\n{r.stderr[-3000:]}")
            self.say(f"{r.stdout.strip()} ({time.perf_counter() - t0:.1f} s)")
        self.weight_bytes[model] = path.stat().st_size
        return path

    # -----------------------------------------------------------------------------------------
    # The peers

    def worker_argv(self, role: str, model: str, weights: Path, loader: str) -> list[str]:
        return [
            self.a.python,
            str(HERE / "worker.py"),
            "--role", role,
            "--model", model,
            "--weights", str(weights),
            "--loader", loader,
            "--device", self.device,
            "--request", json.dumps(REQUEST),
        ]  # fmt: skip

    def scratch_run(self, model: str, weights: Path, loader: str, disk: bool) -> Json:
        dropped = split.drop_page_cache(not self.a.no_drop_cache) if disk else None
        if dropped is not None:
            self.cache_dropped = True
        p = PeerProcess(self.worker_argv("scratch", model, weights, loader), self.log)
        try:
            msg = p.message(self.a.timeout_s)
            wall = time.perf_counter() - p.t0
        finally:
            rc = p.close()
        run: Json = {"wall_s": round(wall, 6), "digest": msg["answer"]["digest"], "answer": msg["answer"], "phases": msg["phases"], "exit": rc}
        if dropped is not None:
            run.update(dropped)
        return run

    def gpu_bytes(self, pid: int, baseline: int | None) -> tuple[int | None, str]:
        """The GPU memory of process `pid`: NVML's per-process figure, else (a PID namespace
        can hide it) the device's used memory above `baseline`, taken before the process
        started (nothing else runs on the GPU meanwhile)."""
        if self.device != "cuda":
            return 0, "no GPU"
        got = split.gpu_memory_by_pid().get(pid)
        if got is not None:
            return got, "nvml-process"
        used = device_used_bytes()
        if used is None or baseline is None:
            return None, "unknown"
        return max(0, used - baseline), "nvml-device-delta"

    def served_run(self, model: str, weights: Path, role: str, loader: str, disk: bool) -> Json:
        baseline = device_used_bytes() if self.device == "cuda" else None
        p = PeerProcess(self.worker_argv(role, model, weights, loader), self.log)
        try:
            ready = p.message(self.a.timeout_s)["ready"]
            pid = p.proc.pid
            gpu, source = self.gpu_bytes(pid, baseline)
            idle = {
                "host_rss_bytes": split.process_rss(pid),
                "gpu_bytes": gpu,
                "gpu_bytes_source": source,
                "torch_reserved_bytes": ready.get("torch_reserved_bytes"),
                "setup_s": ready.get("setup_s"),
            }
            dropped = split.drop_page_cache(not self.a.no_drop_cache) if disk else None
            if dropped is not None:
                self.cache_dropped = True
            t0 = time.perf_counter()
            p.send({"request": REQUEST})
            msg = p.message(self.a.timeout_s)
            wall = time.perf_counter() - t0
            # What it holds once it answered (weights on the device): a warm process's cost.
            idle["after_answer"] = {"host_rss_bytes": split.process_rss(pid), "gpu_bytes": self.gpu_bytes(pid, baseline)[0]}
        finally:
            rc = p.close()
        run: Json = {
            "wall_s": round(wall, 6),
            "digest": msg["answer"]["digest"],
            "answer": msg["answer"],
            "phases": msg["phases"],
            "idle": idle,
            "exit": rc,
        }
        if dropped is not None:
            run.update(dropped)
        return run

    def best_loader(self, model: str) -> Json:
        """The loader of scratch, pool and built-disk: --best-loader, else the fastest built-*
        median of this model in this run, else safetensors (and the row says why)."""
        if self.a.best_loader != "auto":
            return {"loader": self.a.best_loader, "why": "--best-loader"}
        got = {
            BUILT_LOADER[r["mode"]]: r["median"]
            for r in self.results
            if r["model"] == model and r["mode"] in BUILT_LOADER and r.get("median") is not None
        }
        if not got:
            return {"loader": "safetensors", "why": "no built-* row measured in this part (pass --best-loader)"}
        best = min(got, key=lambda k: got[k])
        return {"loader": best, "why": f"fastest built-* median in this run: {got}"}

    def peer_row(self, model: str, mode: str) -> Json:
        row: Json = {"model": model, "mode": mode, "runs": []}
        if mode in BUILT_LOADER:
            loader = BUILT_LOADER[mode]
        else:
            choice = self.best.setdefault(model, self.best_loader(model))
            loader = choice["loader"]
            row["loader_choice"] = choice["why"]
        row["loader"] = loader
        why = loaders.missing(loader)
        if why is not None:
            row["skipped"] = why
            return row
        weights = self.weights(model)
        disk = mode.endswith("-disk")
        if not disk and self.cache_dropped:
            row["page_cache_warmed_s"] = read_file(weights)
            self.cache_dropped = False
        role = "scratch" if mode.startswith("scratch") else "pool" if mode == "pool" else "built"
        for i in range(self.runs(model)):
            if i > 0 and self.over_budget():
                row["skipped_runs"] = self.runs(model) - i
                self.say(f"{model}/{mode}: time budget spent after {i} runs")
                break
            try:
                if role == "scratch":
                    r = self.scratch_run(model, weights, loader, disk)
                else:
                    r = self.served_run(model, weights, role, loader, disk)
            except (RuntimeError, OSError) as e:
                row["error"] = f"run {i}: {type(e).__name__}: {e}"
                self.errors.append(f"{model}/{mode}: {row['error']}")
                self.say(f"{model}/{mode}: FAILED: {row['error'][:2000]}")
                break
            r["run"] = i
            row["runs"].append(r)
            self.say(f"{model}/{mode} #{i}: {r['wall_s']:.3f} s ({loader}), phases {r['phases']}, digest {r['digest'][:12]}")
        return row

    # -----------------------------------------------------------------------------------------
    # Torpor, through bench/coldstart/split.py

    def torpor_skip(self, model: str) -> str | None:
        if model not in split.MODELS:
            return f"{model} has no Torpor function in bench/coldstart/functions/ (tiny-llama is the CPU one)"
        if split.MODELS[model].gpu and self.device != "cuda":
            return f"{model}'s Torpor function needs a GPU (on the CPU: tiny-llama)"
        if os.geteuid() != 0:
            return "needs root: torpord starts workers in namespaces and runs CRIU"
        try:
            coldstart.find_torpor(self.a.torpor)
        except SystemExit as e:
            return f"{e} (make build, or on the GPU machine make gpu-carry)"
        return None

    def add(self, row: Json) -> None:
        """Records a finished row and rewrites the JSON (a part cut off at the device's time
        limit keeps every row it finished)."""
        if row.get("skipped"):
            self.say(f"{row['model']}/{row['mode']}: skipped: {row['skipped']}")
        self.results.append(finish_row(row))
        self.save()

    def torpor_rows(self, model: str, modes: list[str]) -> None:
        why = self.torpor_skip(model)
        if why is not None:
            for m in modes:
                self.add({"model": model, "mode": m, "runs": [], "skipped": why})
            return
        self.weights(model)
        bench = self.split_bench()
        size = CACHE_BYTES.get(model)
        # Torpor at its best: huge pages for CRIU's fill (split-bench: GPT-2-Large cold 1.05 s
        # with THP always, 1.44 s with madvise); the same config for the standby's daemon, so
        # that the two share one daemon and its warmed GPU cache.
        items = [f"{SPLIT_MODE.get(m, m)}:restore_server.transparent_hugepage=always" for m in ("cold", "standby")] + [
            f"{SPLIT_MODE.get(m, m)}:restore_server.{k}={size}"
            for m in ("cold", "standby")
            for k in ("host_cache_bytes", "gpu_cache_bytes")
            if size
        ]
        bench.a.extra = split.parse_daemon_config(items)
        bench.a.runs = self.runs(model)
        for mode in modes:
            self.say(f"{model}/{mode}: through torpord (bench/coldstart/split.py)")
            try:
                out = bench.mode(SPLIT_MODE.get(mode, mode), split.MODELS[model])
            except Exception as e:  # one failed mode must not lose the others
                out = {"model": model, "mode": mode, "runs": [], "error": f"{type(e).__name__}: {e}"}
                bench.errors.append(f"{model}/{mode}: {out['error']}")
                self.say(f"{model}/{mode}: FAILED: {out['error'][:2000]}")
            self.add(self.torpor_row(bench, model, mode, out))
        if bench.daemon is not None:
            # Its caches (GPU and pinned host memory) must not sit beside the next model's peers;
            # the state directory stays, so a later mode restarts a daemon on the same deploys.
            bench.daemon.stop()
            bench.daemon = None

    def split_bench(self) -> Any:
        """One split.Bench for the whole part (its daemons restart per model and mode config)."""
        if "bench" in self.torpor:
            return self.torpor["bench"]
        argv = [
            "--models", ",".join(m for m in self.a.models if m in split.MODELS) or "gpt2-large",
            "--modes", ",".join(SPLIT_MODE.get(m, m) for m in self.a.modes if m in TORPOR_MODES),
            "--runs", "1",
            "--out", str(self.a.out),
            "--work-dir", str(self.a.work_dir),
            "--budget-min", str(max(0.5, self.a.budget_min - (time.monotonic() - self.t0) / 60)),
            "--no-dedup",
            "--idle",
        ]  # fmt: skip
        if self.a.no_drop_cache:
            argv.append("--no-drop-cache")
        if self.a.torpor:
            argv += ["--torpor", str(self.a.torpor)]
        sa = split.parse_args(argv)
        sa.work_dir = sa.work_dir.resolve() / f"run-{int(time.time() * 1000)}"
        (sa.work_dir / "logs").mkdir(parents=True)
        bench = split.Bench(sa, coldstart.find_torpor(sa.torpor))
        self.torpor["bench"] = bench
        return bench

    def torpor_row(self, bench: Any, model: str, mode: str, out: Json) -> Json:
        runs = []
        for r in out.get("runs") or []:
            value = r.get("value") or {}
            runs.append(
                {
                    "run": r.get("run"),
                    "wall_s": r["wall_s"],
                    "digest": value.get("digest") if isinstance(value, dict) else None,
                    "answer": value,
                    "start": r.get("start"),
                    "timings": r.get("timings"),
                    "fills": r.get("fills"),
                    **{k: r[k] for k in ("page_cache_dropped", "why", "standby_wait_s") if k in r},
                }
            )
            self.say(f"{model}/{mode} #{r.get('run')}: {r['wall_s']:.3f} s, timings {r.get('timings')}")
        row: Json = {
            "model": model,
            "mode": mode,
            "runs": runs,
            "torpor": {
                "split_mode": SPLIT_MODE.get(mode, mode),
                "daemon_config": out.get("config"),
                "warmups": len(out.get("warmups") or []),
                "timings": out.get("timings"),
                "fills": out.get("fills"),
            },
        }
        if out.get("idle") is not None:
            row["idle"] = out["idle"]
        if out.get("error"):
            row["error"] = out["error"]
            if not any(e.startswith(f"{model}/{mode}") for e in self.errors):
                self.errors.append(f"{model}/{mode}: {out['error']}")
        if out.get("skipped_runs"):
            row["skipped_runs"] = out["skipped_runs"]
        return row

    def close_torpor(self) -> Json | None:
        bench = self.torpor.pop("bench", None)
        if bench is None:
            return None
        if bench.daemon is not None:
            bench.daemon.stop()
        self.errors += [e for e in bench.errors if not any(e.split(":", 1)[0] == x.split(":", 1)[0] for x in self.errors)]
        if bench.errors:
            print(f"Torpor's work dir kept: {bench.work}", file=sys.stderr)
        else:
            shutil.rmtree(bench.work, ignore_errors=True)
        return {"deploys": bench.deployed, "errors": bench.errors}

    # -----------------------------------------------------------------------------------------

    def run(self) -> None:
        for model in self.a.models:
            torpor_modes = [m for m in self.a.modes if m in TORPOR_MODES]
            for mode in self.a.modes:
                if mode in TORPOR_MODES:
                    continue
                try:
                    row = self.peer_row(model, mode)
                except Exception as e:  # record and go on: one GPU call should say all it can
                    row = {"model": model, "mode": mode, "runs": [], "error": f"{type(e).__name__}: {e}"}
                    self.errors.append(f"{model}/{mode}: {row['error']}")
                    self.say(f"{model}/{mode}: FAILED: {row['error'][:2000]}")
                self.add(row)
            if torpor_modes:
                try:
                    self.torpor_rows(model, torpor_modes)
                except Exception as e:
                    err = f"{type(e).__name__}: {e}"
                    self.errors.append(f"{model}/torpor: {err}")
                    self.say(f"{model}/torpor: FAILED: {err[:2000]}")
                    done = {r["mode"] for r in self.results if r["model"] == model}
                    for m in torpor_modes:
                        if m not in done:
                            self.add({"model": model, "mode": m, "runs": [], "error": err})

    def document(self) -> Json:
        a = self.a
        return {
            "benchmark": "peers",
            "machine": self.info,
            "settings": {
                "models": a.models,
                "modes": a.modes,
                "runs": {m: self.runs(m) for m in a.models},
                "request": REQUEST,
                "device": self.device,
                "best_loader": a.best_loader,
                "drop_cache": not a.no_drop_cache,
                "weights": {m: lm.SPECS[m].dtype for m in a.models},
                "weights_bytes": self.weight_bytes,
                "each run": "a fresh process (peers) or a fresh restore (Torpor), the same request, the logits' SHA-256",
            },
            "results": self.results,
            "summary": make_summary(self.results),
            "torpor": self.torpor_doc,
            "errors": self.errors,
            "elapsed_s": round(time.monotonic() - self.t0, 1),
        }

    def save(self) -> Json:
        """Writes the JSON as it stands (after every row: a device call cut off at its time
        limit still leaves the rows it measured)."""
        doc = self.document()
        tmp = self.a.out.with_name(f".{self.a.out.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.a.out)
        return doc


def device_used_bytes() -> int | None:
    """Used memory of GPU 0 (NVML, through nvidia-smi), None without one."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--id=0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = r.stdout.strip()
    return int(text) * (1 << 20) if r.returncode == 0 and text.isdigit() else None


def gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def finish_row(row: Json) -> Json:
    """Adds a row's wall-time summary, its median and its digests."""
    walls = [r["wall_s"] for r in row.get("runs") or []]
    row["wall_s"] = summary(walls) if walls else None
    row["median"] = row["wall_s"]["median"] if row["wall_s"] else None
    digests = sorted({str(r.get("digest")) for r in row.get("runs") or []})
    row["digests"] = digests
    row["digests_identical"] = len(digests) == 1 if digests else None
    return row


def versions() -> Json:
    out: Json = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "safetensors", "runai-model-streamer", "fastsafetensors", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def resident(row: Json) -> Json | None:
    """What a peer keeps while idle, between requests: nothing for a scratch start; the kept
    process's RSS and GPU memory (median over its runs) for pool and built; for Torpor, the
    node's cost while the function is idle (the daemon's, shared by every function on it,
    and the function's standby's)."""
    mode = row["mode"]
    if row.get("skipped") or not row.get("runs"):
        return None
    if mode.startswith("scratch"):
        return {"host_bytes": 0, "gpu_bytes": 0, "what": "nothing: a process starts per request"}
    if mode in PEER_MODES:
        idles = [r["idle"] for r in row["runs"] if r.get("idle")]
        host = summary([i["host_rss_bytes"] for i in idles if i.get("host_rss_bytes") is not None])
        gpu = summary([i["gpu_bytes"] for i in idles if i.get("gpu_bytes") is not None])
        what = "a process per function: torch + transformers imported, CUDA context"
        if mode != "pool":
            what += ", the model built on the meta device"
        return {
            "host_bytes": int(host["median"]) if host else None,
            "gpu_bytes": int(gpu["median"]) if gpu else None,
            "what": what + " (RSS and NVML of the kept process)",
        }
    idle = row.get("idle")
    if not idle:
        return None
    metrics = idle.get("metrics") or {}
    standby_host = sum(v for k, v in metrics.items() if k.startswith("torpor_standby_host_memory_bytes"))
    standby_gpu = sum(v for k, v in metrics.items() if k.startswith("torpor_standby_gpu_memory_bytes"))
    caches = {k: int(v) for k, v in metrics.items() if k.startswith(("torpor_restore_cache_bytes", "torpor_stage_bytes"))}
    # The stage area is a tmpfs (not in the daemon's RSS); the GPU cache is device memory that
    # NVML shows for the daemon where it allocates it, else counted from its gauge.
    stage = sum(v for k, v in caches.items() if k.startswith("torpor_stage_bytes"))
    gpu_cache = sum(v for k, v in caches.items() if 'cache="gpu"' in k)
    daemon_gpu = max(float(idle.get("daemon_gpu_bytes") or 0), gpu_cache)
    return {
        "host_bytes": int((idle.get("daemon_rss_bytes") or 0) + stage + standby_host),
        "gpu_bytes": int(daemon_gpu + standby_gpu),
        "standby_host_bytes": int(standby_host),
        "standby_gpu_bytes": int(standby_gpu),
        "caches": caches,
        "what": "torpord: its RSS (the pinned host cache), the stage tmpfs and its GPU memory (NVML, at least the GPU "
        "cache), shared by every function on the node" + (", and the function's standby instance" if mode == "standby" else ""),
    }


def targets(medians: dict[str, dict[str, float]]) -> list[Json]:
    out = []
    for t in TARGETS:
        value = medians.get(t["model"], {}).get(t["mode"])
        if "limit_s" in t:
            limit, text = t["limit_s"], f"{t['mode']} ≤ {t['limit_s']:.2f} s"
        else:
            ref = medians.get(t["model"], {}).get(t["limit_of"])
            limit = round(ref / t["divisor"], 4) if ref is not None else None
            text = f"{t['mode']} ≤ {t['limit_of']} / {t['divisor']}"
        out.append(
            {
                "model": t["model"],
                "mode": t["mode"],
                "target": text,
                "limit_s": limit,
                "value_s": value,
                "met": None if value is None or limit is None else value <= limit,
                "by": None if value is None or limit is None else round(value / limit, 3),
            }
        )
    return out


def make_summary(results: list[Json]) -> Json:
    models: list[str] = []
    for r in results:
        models += [r["model"]] if r["model"] not in models else []
    medians: dict[str, dict[str, float]] = {m: {} for m in models}
    digests: Json = {}
    idle: Json = {m: {} for m in models}
    for m in models:
        rows = [r for r in results if r["model"] == m]
        seen = sorted({d for r in rows for d in r.get("digests") or []})
        digests[m] = {"digests": seen, "identical": len(seen) == 1 if seen else None}
        for mode in MODES:
            found = [x for x in rows if x["mode"] == mode]
            if not found:
                continue
            row = found[-1]
            if row.get("median") is not None:
                medians[m][mode] = row["median"]
            cost = resident(row)
            if cost is not None:
                idle[m][mode] = cost
    measured = [d["identical"] for d in digests.values() if d["identical"] is not None]
    return {
        "medians": medians,
        "digests_identical": bool(measured) and all(measured),
        "digests": digests,
        "targets": targets(medians),
        "resident_idle": idle,
        "skipped": {f"{r['model']}/{r['mode']}": r["skipped"] for r in results if r.get("skipped")},
    }


def machine() -> Json:
    out: Json = coldstart.machine()
    out["versions"] = versions()
    return out


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    # split.py's llama-8b function finds the generated weights here too.
    os.environ["TORPOR_PEERS_DIR"] = str(a.weights_dir.resolve())
    bench = Bench(a)
    bench.say(f"device {bench.info['device'] or 'none'} ({bench.device}); models {a.models}; modes {a.modes}")
    try:
        bench.run()
    finally:
        bench.torpor_doc = bench.close_torpor()
        bench.log.close()
        doc = bench.save()
    print(table.render(doc))
    print(f"\n{a.out} ({doc['elapsed_s']:.0f} s)")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
