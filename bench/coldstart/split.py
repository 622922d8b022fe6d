"""Restore → first inference through torpord, transparent path against the split path, side by
side in one run. Run on the GPU machine as root (scripts/gpu-run.sh split-bench):

    python3 bench/coldstart/split.py [--models resnet152,gpt2-large] [--runs 5] --out FILE

For each model (the functions of bench/coldstart/functions/, which run the examples' handlers on
the examples' weights) and each mode, RUNS times, each a fresh restore (`torpor stop NAME` first,
so no instance and no hibernated one is left):
  transparent  a daemon with `split = false`: CRIU and the driver restore everything;
  host-cache   split (`split = true`, `split_gpu = true`), `[restore_server] gpu_cache_bytes = 0`:
               segments filled from the restore server's host cache (pinned on cuda);
  gpu-cache    split, a GPU cache large enough: segments copied device to device (warmed first:
               a store read puts a segment in the host cache, a host-cache hit puts it in the GPU
               cache; warm-up restores run until every fill comes from the GPU cache);
  second       split with the GPU cache: instance 1 restored, kept busy by a request holding
               `hold_s`, then a second request, which the daemon serves by restoring a second
               instance that maps the shared read-only segments of the first (`hold_s` must
               outlast that restore: a request is served by the first instance free, so the
               second would take instance 1 once its hold ended);
  standby      split with the GPU cache, a copy of the function (`NAME-standby`) with
               `[scaling] standby = 1`, `standby_gpu = "released"`: the daemon keeps one instance restored by CRIU without the
               driver restore (gpu_released; a CPU function's is fully restored, warm). Per run:
               wait until the standby is ready (`standby_wait_s`), invoke it (`X-Torpor-Start:
               standby`, timings gpu_resume + segments), then `torpor stop` (the next run waits
               for the next standby). Warm-up runs first, as for gpu-cache.
  standby-live as standby, with `scaling.standby_gpu = "live"` (`NAME-standby-live`): the
               standby's driver restore done ahead, so the request pays only the segments;
  cold         the cold path at its best: nothing of the function resident, split with the GPU
               cache warmed as for gpu-cache, and whatever `--daemon-config cold:KEY=VALUE` adds
               (the page source, for one); the row the cold-start targets are measured on;
  cold-disk    nothing of the function in memory at all: split with no host cache, no GPU cache
               and no stage area (`restore_server.stage_bytes = 0`: CRIU reads the snapshot's
               files), and before each run the kernel's page cache dropped
               (`sync; echo 3 > /proc/sys/vm/drop_caches`; a run records `page_cache_dropped`, false
               where /proc/sys is read-only), so the chunk store and the images come from disk;
  burst8       8 requests sent at once to a copy of the function (`NAME-burst`, max_instances 8)
               with nothing live, so the daemon restores 8 instances side by side from one staged
               image and one restore server (GPU cache warmed first); a run's wall_s is the time
               until the last of the 8 answered, each answer's own in `answers`.
Per run: the client's wall time of the invoke that restores (send to last byte), the daemon's
phases (X-Torpor-Timings: restore = CRIU + driver, reconnect, segments, handler, ...), the fills
of that restore from /metrics (torpor_restore_fill_gbps count and sum per source) and the value,
compared with the first value of the model (bit-identical outputs across modes). Also per model:
deploy phases and the instance's stop time (`stop_s`), snapshot sizes (snapshot directory, segment
bytes, bytes stored in the chunk store from `torpor inspect --store`), and for models with an
`-embed` variant (same base, same weights) the deduplication in the chunk store. The link's
host→device bandwidth comes from a fill_bw JSON (--fill-bw).

With --idle, each mode's row also says what the node keeps while the function is idle after its
runs (`idle`: the daemon's /metrics gauges of the restore server's caches, the stage area and the
function's standbys, once a fresh standby is ready; the daemon's RSS and NVML GPU memory): the
peer benchmark (bench/peers/run.py) reports Torpor's resident cost from it.

The split modes share one state directory: the host-cache daemon deploys, later daemons
(restarted with their config) restore the same snapshots. Extra daemon config per mode:
`--daemon-config [MODE:]KEY=VALUE` (KEY dotted for a table, e.g. restore_server.pages=lazy; VALUE
in TOML, a bare word is a string), repeatable.

On a machine without a GPU: `--models cpu` runs a CPU function with host-backend segments (the
"GPU cache" is then memfd memory), as a smoke test of the whole procedure.
Render the JSON as Markdown: python3 bench/coldstart/split_table.py FILE.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FUNCTIONS = HERE / "functions"
sys.path.insert(0, str(HERE))

from run import disk_usage, find_torpor, machine, summary  # noqa: E402

sys.path.insert(1, str(ROOT / "python"))
from torpor import client  # noqa: E402

Json = dict[str, Any]
GIB = 1 << 30
MODES = (
    "transparent", "host-cache", "gpu-cache", "second", "standby", "standby-live", "cold", "cold-disk", "burst8",
    "pooled", "pooled-later",
)
# Mode pooled: the model's `-pooled` function (bench/coldstart/functions/NAME-pooled: sandboxed,
# weights as platform-managed GPU memory mapped as views) started new to the node in a ready
# sandbox of the live-context pool. Each has a tenant of its own: the pool's gauge counts ready
# sandboxes per tenant, and another model's ready sandbox must not count as this one's.
# Mode pooled-later: the same copy deployed once; after its first start (pooled) and one
# restore, each later cold start with a ready sandbox there, which the daemon makes the faster
# of the two ways (torpord's `sandbox_pool.starts = "faster"`; the run's `start` says which).
# Instances a burst starts at once (mode burst8).
BURST = 8
# Host cache for every split mode: every model's segments fit (GPT-2-Large holds ~3.3 GB).
HOST_CACHE_BYTES = 8 * GIB
GPU_CACHE_BYTES = 8 * GIB
CPU_WEIGHTS_BYTES = 8 << 20
# Random anonymous memory the cpu function keeps (bench/coldstart/functions/cpu/bench_model.py):
# a CRIU image of a GPU worker's size in CPU-only runs (bench/cluster/pull.py --cpu-anon-mib).
CPU_ANON_BYTES = 0
# The cpu function's weights in this many segments (--cpu-weights-parts).
CPU_WEIGHTS_PARTS = 1


@dataclass(frozen=True)
class Model:
    """A function of bench/coldstart/functions/ and what it needs."""

    name: str
    # examples/<example>: its model.py (subclassed by bench_model.py) and weights.safetensors.
    example: str | None
    request: Json
    gpu: bool
    # An `<name>-embed` function on the same base and weights, for the dedup measurement.
    embed: bool
    # Weights made on the machine (bench/peers/make_weights.py, never in the repository): the
    # file generated_weights(name), hard-linked as weights.safetensors.
    generated: bool = False
    # Python files of the repository (relative to its root) copied beside the handler.
    modules: tuple[str, ...] = ()


# The peer benchmark's function code (bench/peers): the models and the handler.
PEER_MODULES = ("bench/peers/lm.py", "bench/peers/peer_function.py")

MODELS = {
    "resnet152": Model("resnet152", "resnet152", {"seed": 1}, True, True),
    "gpt2-large": Model("gpt2-large", "gpt2-large", {"seed": 1}, True, False),
    # Llama-3-8B's shape with random bf16 weights (bench/peers: the peer benchmark).
    "llama-8b": Model("llama-8b", None, {"seed": 1}, True, False, generated=True, modules=PEER_MODULES),
    # Llama-2-13B's shape, the same code: issue 10's live migration (bench/concurrent/measure.py).
    "llama-13b": Model("llama-13b", None, {"seed": 1}, True, False, generated=True, modules=PEER_MODULES),
    # Llama-3.2-3B's shape, the same code: the per-size phase breakdown's middle size.
    "llama-3b": Model("llama-3b", None, {"seed": 1}, True, False, generated=True, modules=PEER_MODULES),
    # Its code on the CPU with a tiny Llama: the peer benchmark's CPU test.
    "tiny-llama": Model("tiny-llama", None, {"seed": 1}, False, False, generated=True, modules=PEER_MODULES),
    "cpu": Model("cpu", None, {"seed": 1}, False, True),
}


def generated_weights(name: str) -> Path:
    """Where bench/peers/make_weights.py's file of model `name` is: $TORPOR_PEERS_DIR (default
    /var/tmp/torpor-peers, beside --work-dir's default so that a hard link works)."""
    return Path(os.environ.get("TORPOR_PEERS_DIR", "/var/tmp/torpor-peers")) / f"{name}.safetensors"


# ---------------------------------------------------------------------------------------------
# Arguments and daemon configs


def drop_page_cache(allowed: bool) -> Json:
    """Writes dirty pages back and drops the kernel's page cache (root; refused where /proc/sys
    is read-only, as in some containers: then say so rather than pretend); says whether it
    happened and why not. The peer benchmark uses it too."""
    if not allowed:
        return {"page_cache_dropped": False, "why": "--no-drop-cache"}
    t0 = time.perf_counter()
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        return {"page_cache_dropped": False, "why": f"{type(e).__name__}: {e}"}
    return {"page_cache_dropped": True, "drop_s": round(time.perf_counter() - t0, 3)}


def base_mode(mode: str) -> str:
    """The mode of a variant: `burst8@serial` runs burst8 with the daemon config given for
    `burst8@serial:` (an A/B of a daemon setting in one run, on the same deploys)."""
    return mode.split("@", 1)[0]


def choose_modes(p: argparse.ArgumentParser, text: str) -> list[str]:
    """--modes: each a mode or MODE@TAG, in the documented order of their modes (variants
    after their mode, as given)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names:
        base, _, tag = m.partition("@")
        if base not in MODES:
            p.error(f"unknown mode {m!r}: one of {', '.join(MODES)} (or MODE@TAG for a variant)")
        if "@" in m and not re.fullmatch(r"[a-z0-9-]+", tag):
            p.error(f"mode {m!r}: a variant's TAG is lower-case letters, digits and '-'")
    return sorted(dict.fromkeys(names), key=lambda m: (MODES.index(base_mode(m)), "@" in m, names.index(m)))


def choose(p: argparse.ArgumentParser, text: str, allowed: Any, what: str) -> list[str]:
    """The names of a comma list, each one of `allowed` (else argparse's error, naming them)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    for m in names:
        if m not in allowed:
            p.error(f"unknown {what} {m!r}: one of {', '.join(allowed)}")
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet152,gpt2-large", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--runs", type=int, default=5, help="fresh restores per model and mode")
    p.add_argument("--out", type=Path, required=True, help="result JSON")
    p.add_argument("--work-dir", type=Path, default=Path("/var/tmp/torpor-split"), help="state dirs, function copies")
    p.add_argument("--hold-s", type=float, default=4.0, help="second mode: how long instance 1 stays busy")
    p.add_argument("--settle-s", type=float, default=0.5, help="second mode: wait after the holding request is sent")
    p.add_argument("--warm-max", type=int, default=3, help="gpu-cache mode: most warm-up restores per model")
    p.add_argument("--no-dedup", action="store_true", help="skip the -embed deploys (dedup measurement)")
    p.add_argument("--fill-bw", type=Path, help="fill_bw JSON of this machine (the link's host→device GB/s)")
    p.add_argument(
        "--daemon-config",
        action="append",
        default=[],
        metavar="[MODE:]KEY=VALUE",
        help="extra daemon config, for every mode or one; KEY dotted for a table (restore_server.pages)",
    )
    p.add_argument(
        "--idle",
        action="store_true",
        help="after a mode's runs, record what stays resident while the function is idle (idle_resident)",
    )
    p.add_argument(
        "--no-drop-cache",
        action="store_true",
        help="cold-disk: leave the page cache alone (a shared machine); each run says so",
    )
    p.add_argument(
        "--maps",
        action="store_true",
        help="record each restored instance's address space (VMAs, one-page VMAs, huge pages) after its answer",
    )
    p.add_argument(
        "--cpu-weights-mib",
        type=int,
        default=None,
        help="--models cpu: the size of its weights in MiB (default 8), e.g. 2048 for a cold-disk read of GPU-like size",
    )
    p.add_argument(
        "--cpu-weights-parts",
        type=int,
        default=1,
        help="--models cpu: its weights in this many read-only segments of equal size (the same bytes; default 1)",
    )
    p.add_argument("--budget-min", type=float, default=8.0, help="skip the remaining runs past this")
    p.add_argument("--torpor", type=Path, help="torpor binary (default $TORPOR_BIN, target/{release,debug})")
    p.add_argument("--keep", action="store_true", help="keep the work dir (state dirs, daemon logs)")
    a = p.parse_args(argv)
    a.models = choose(p, a.models, MODELS, "model")
    # Modes run in the documented order, whatever order they were given in.
    a.modes = choose_modes(p, a.modes)
    if a.runs < 1 or a.warm_max < 0 or a.hold_s <= 0:
        p.error("--runs must be at least 1, --warm-max at least 0 and --hold-s positive")
    if a.cpu_weights_mib is not None:
        if a.cpu_weights_mib < 1 or "cpu" not in a.models:
            p.error("--cpu-weights-mib takes a size >= 1 and --models cpu")
    if a.cpu_weights_parts != 1:
        mib = 8 if a.cpu_weights_mib is None else a.cpu_weights_mib
        if a.cpu_weights_parts < 1 or "cpu" not in a.models or mib % a.cpu_weights_parts:
            p.error(f"--cpu-weights-parts takes a count >= 1 that divides --cpu-weights-mib ({mib}) and --models cpu")
    try:
        a.extra = parse_daemon_config(a.daemon_config)
    except ValueError as e:
        p.error(str(e))
    return a


def toml_value(text: str) -> Any:
    """VALUE of --daemon-config as TOML; a bare word (lazy) is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_daemon_config(items: list[str]) -> dict[str | None, Json]:
    """`[MODE:]KEY=VALUE` items → {mode or None (every mode): nested {key: value}}."""
    out: dict[str | None, Json] = {}
    for item in items:
        scope, key, value = None, *item.partition("=")[::2]
        if "=" not in item or not key.strip():
            raise ValueError(f"--daemon-config {item!r} is not [MODE:]KEY=VALUE, e.g. restore_server.pages=lazy")
        if ":" in key:
            scope, key = key.split(":", 1)
            if base_mode(scope) not in MODES:
                raise ValueError(f"--daemon-config {item!r}: {scope!r} is not a mode ({', '.join(MODES)}, or MODE@TAG)")
        parts = [k.strip() for k in key.strip().split(".")]
        if len(parts) > 2 or not all(parts):
            raise ValueError(f"--daemon-config {item!r}: KEY is a top-level key or TABLE.KEY")
        table = out.setdefault(scope, {})
        if len(parts) == 2:
            table = table.setdefault(parts[0], {})
        table[parts[-1]] = toml_value(value.strip())
    return out


def mode_config(mode: str, gpu: bool, extra: dict[str | None, Json]) -> Json:
    """The daemon config of a mode: its own keys, then --daemon-config for every mode, then for
    it, then for the variant `mode` is (MODE@TAG)."""
    variant, mode = mode, base_mode(mode)
    if mode == "transparent":
        config: Json = {"split": False}
    else:
        config = {
            "split": True,
            "split_gpu": gpu,
            "restore_server": {
                "host_cache_bytes": HOST_CACHE_BYTES,
                "gpu_cache_bytes": 0 if mode == "host-cache" else GPU_CACHE_BYTES,
            },
        }
        if mode == "cold-disk":
            config["restore_server"] = {"host_cache_bytes": 0, "gpu_cache_bytes": 0, "stage_bytes": 0}
        if mode in ("pooled", "pooled-later"):
            config["sandbox_pool"] = {"size": 1}
    for scope in dict.fromkeys((None, mode, variant)):
        for k, v in extra.get(scope, {}).items():
            if isinstance(v, dict):
                config.setdefault(k, {}).update(v)
            else:
                config[k] = v
    return config


def toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string


def render_toml(config: Json) -> str:
    """Top-level keys first (after a table header they would land in the table), then tables."""
    lines = [f"{k} = {toml_scalar(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for k, v in config.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {toml_scalar(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The daemon, over its Unix socket


def pids_with(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


class Daemon:
    """`torpor serve` on a state directory with one mode's config."""

    def __init__(self, torpor: Path, state: Path, mode: str, config: Json, logs: Path) -> None:
        self.torpor = torpor
        self.state = state
        self.mode = mode
        self.config = config
        self.socket = state.parent / f"{state.name}.sock"
        self.log = logs / f"torpord-{mode}.log"
        config_file = logs / f"torpord-{mode}.toml"
        config_file.write_text(render_toml(config))
        self.socket.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "TORPOR_SOCKET"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(torpor), "serve", "--config", str(config_file), "--state-dir", str(state), "--socket", str(self.socket)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
            )
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"torpor serve ({mode}) did not start:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def request(self, method: str, path: str, body: Any = None, timeout: float = 600) -> tuple[int, dict[str, str], bytes]:
        r = client.request(self.socket, method, path, None if body is None else json.dumps(body).encode(), timeout)
        return r.status, r.headers, r.body

    def invoke(self, name: str, request: Any) -> Json:
        """One invoke, timed from the send to the last byte of the answer."""
        t0 = time.perf_counter()
        status, headers, body = self.request("POST", f"/v1/functions/{name}/invoke", request)
        wall = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"invoke {name} ({self.mode}) answered {status}: {body[:500]!r}\n{self.log_tail()}")
        return {
            "wall_s": round(wall, 6),
            "start": headers.get("x-torpor-start"),
            "timings": json.loads(headers.get("x-torpor-timings", "{}")),
            "value": json.loads(body),
            "t_done": time.perf_counter(),
        }

    def cli(self, *args: str | Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, TORPOR_SOCKET=str(self.socket))
        return subprocess.run(
            [str(self.torpor), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )

    def stop_function(self, name: str) -> Json:
        """`torpor stop NAME --json`: no live or hibernated instance is left, so the next invoke restores."""
        t0 = time.perf_counter()
        r = self.cli("stop", name, "--json", timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"torpor stop {name} failed: {r.stderr.strip()}")
        out: Json = json.loads(r.stdout)
        # Busy ones stop when their request ends; wait until the daemon lists none live.
        deadline = time.monotonic() + 30
        while self.live(name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances of {name} still live 30 s after torpor stop")
            time.sleep(0.02)
        out["wall_s"] = round(time.perf_counter() - t0, 4)
        return out

    def live(self, name: str) -> int:
        return len(self.devices(name))

    def devices(self, name: str) -> list[int]:
        """The device of each live instance of `name` (torpord's placement: on a node of
        several GPUs a second instance may be on another GPU than the first)."""
        status, _, body = self.request("GET", f"/v1/functions/{name}", timeout=30)
        if status != 200:
            raise RuntimeError(f"GET /v1/functions/{name} answered {status}: {body[:300]!r}")
        return [int(i.get("device", 0)) for i in json.loads(body)["instances"] if i.get("pid")]

    def deploy(self, fdir: Path) -> Json:
        t0 = time.perf_counter()
        r = self.cli("deploy", "--json", fdir)
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip().startswith("{")]
        result = next((x["result"] for x in lines if "result" in x), None)
        if r.returncode != 0 or result is None:
            raise RuntimeError(f"deploy of {fdir} ({self.mode}) failed\n{r.stdout}\n{r.stderr}\n{self.log_tail()}")
        return {
            "wall_s": round(time.perf_counter() - t0, 3),
            "phases": {x["phase"]: x.get("s") for x in lines if "phase" in x},
            "snapshot_function": next((x for x in lines if x.get("phase") == "snapshot_function"), None),
            "result": result,
        }

    def restore_metrics(self) -> dict[str, float]:
        """The restore server's series in /metrics (histogram buckets left out)."""
        status, _, body = self.request("GET", "/metrics", timeout=30)
        out: dict[str, float] = {}
        if status != 200:
            return out
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("torpor_restore_") and "_bucket{" not in line:
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def device_instances(self) -> dict[str, int]:
        """Live instances per device (`torpor_device_instances`): where a burst's starts landed
        (`restore_server.placement`)."""
        status, _, body = self.request("GET", "/metrics", timeout=30)
        out: dict[str, int] = {}
        for line in body.decode(errors="replace").splitlines() if status == 200 else []:
            m = re.match(r'^torpor_device_instances\{device="(\d+)"\} (\S+)$', line)
            if m and float(m.group(2)) > 0:
                out[m.group(1)] = int(float(m.group(2)))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in pids_with(f"{self.state}/"):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def tree_of(pid: int) -> list[int]:
    """`pid` and its descendants (through /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for t in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (t / "children").read_text().split())
            except (OSError, ValueError):
                pass
    return out


def address_space(pid: int) -> Json:
    """VMAs of `pid` (all, one page long, anonymous), and its resident and huge-page memory."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return {"pid": pid, "gone": True}
    one_page = anon = 0
    for line in maps:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        one_page += hi - lo == 4096
        anon += len(fields) < 6
    kib = {}
    for line in rollup[1:]:
        key, _, rest = line.partition(":")
        if key in ("Rss", "Anonymous", "AnonHugePages", "Shmem", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty"):
            kib[key] = int(rest.split()[0])
    return {
        "pid": pid,
        "comm": comm,
        "vmas": len(maps),
        "one_page_vmas": one_page,
        "anon_vmas": anon,
        "kib": kib,
        "by_mapping": resident_by_mapping(pid),
    }


# smaps fields summed per mapping: what is resident, and which of it is anonymous, shared or
# private (CRIU restores private anonymous pages lazily, shared and memfd memory by copying).
SMAPS_KEYS = ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty", "Swap")


def resident_by_mapping(pid: int, top: int = 25) -> list[Json]:
    """The `top` mappings of `pid` by resident memory (KiB), VMAs of one file or kind summed."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return []
    sums: dict[str, dict[str, int]] = {}
    name = ""
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            # A VMA's header: "lo-hi perms offset dev inode [path]"; an unnamed one is anonymous.
            name = f"{head[5] if len(head) > 5 else '[anon]'} {head[1]}"
            sums.setdefault(name, {"vmas": 0})["vmas"] += 1
        elif head and head[0].endswith(":") and head[0][:-1] in SMAPS_KEYS:
            key = head[0][:-1]
            sums[name][key] = sums[name].get(key, 0) + int(head[1])
    ranked = sorted(sums.items(), key=lambda kv: kv[1].get("Rss", 0), reverse=True)
    return [{"mapping": k, **v} for k, v in ranked[:top] if v.get("Rss", 0) > 0]


def instance_maps(d: Daemon, name: str) -> list[Json]:
    """The address spaces of every process of `name`'s live instances."""
    status, _, body = d.request("GET", f"/v1/functions/{name}", timeout=30)
    if status != 200:
        return []
    pids = [i["pid"] for i in json.loads(body)["instances"] if i.get("pid")]
    return [address_space(p) for root in pids for p in tree_of(root)]


def process_rss(pid: int) -> int | None:
    """Resident host memory of process `pid` (VmRSS), None where it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory used per process (NVML through nvidia-smi: CUDA contexts included, which
    torch.cuda.memory_reserved() does not count); empty without a GPU."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[int, int] = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1]) * (1 << 20)
    return out


def wait_gpu_idle(base: set[int], bound_s: float = 30.0) -> float:
    """Seconds until no process but those of `base` (the daemon, holding its GPU cache, and
    whatever ran before) holds GPU memory (NVML), at most `bound_s`."""
    t0 = time.perf_counter()
    while set(gpu_memory_by_pid()) - base and time.perf_counter() - t0 < bound_s:
        time.sleep(0.05)
    return round(time.perf_counter() - t0, 3)


def fills(before: dict[str, float], after: dict[str, float]) -> Json:
    """Per source, the segments filled between two /metrics reads and their mean GB/s (the mean
    over segments of each segment's size / fill time)."""
    out: Json = {}
    for key, v in after.items():
        if key.startswith("torpor_restore_fill_gbps_count{"):
            source = key[key.index('source="') + 8 :].split('"', 1)[0]
            n = v - before.get(key, 0.0)
            if n <= 0:
                continue
            sum_key = key.replace("_count{", "_sum{")
            total = after.get(sum_key, 0.0) - before.get(sum_key, 0.0)
            out[source] = {"segments": int(n), "gbps_sum": round(total, 6), "mean_gbps": round(total / n, 3)}
    return out


def merge_fills(runs: list[Json]) -> Json:
    out: Json = {}
    for r in runs:
        for source, f in (r.get("fills") or {}).items():
            o = out.setdefault(source, {"segments": 0, "gbps_sum": 0.0})
            o["segments"] += f["segments"]
            o["gbps_sum"] += f["gbps_sum"]
    for o in out.values():
        o["mean_gbps"] = round(o["gbps_sum"] / o["segments"], 3)
        o["gbps_sum"] = round(o["gbps_sum"], 6)
    return out


# ---------------------------------------------------------------------------------------------
# Functions: assembled from bench/coldstart/functions/, the examples and their weights


def link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def cpu_weight_parts(path: Path, parts: int) -> list[Path]:
    """The cpu function's weights (CPU_WEIGHTS_BYTES) in `parts` files of equal size: `path`
    itself for one part, else PATH.N-I for I < N; the same bytes however they are cut."""
    each = CPU_WEIGHTS_BYTES // parts
    files = [path] if parts == 1 else [path.with_name(f"{path.name}.{parts}-{i}") for i in range(parts)]
    if all(f.is_file() and f.stat().st_size == each for f in files):
        return files
    # In pieces: randbytes of more than ~256 MiB overflows a C int; the first 64 MiB are what
    # one call made before, so small weights files keep their bytes.
    rng, left = random.Random(0), CPU_WEIGHTS_BYTES
    handles = [open(f, "wb") for f in files]
    try:
        at = 0
        while left:
            piece = rng.randbytes(min(left, 64 << 20))
            left -= len(piece)
            while piece:
                i = at // each
                n = min(len(piece), (i + 1) * each - at)
                handles[i].write(piece[:n])
                piece, at = piece[n:], at + n
    finally:
        for h in handles:
            h.close()
    return files


def example_weights(example: str, say: Any) -> Path:
    path = ROOT / "examples" / example / "weights.safetensors"
    if not path.is_file():
        say(f"{example}: writing {path}")
        subprocess.run([sys.executable, str(path.parent / "make_weights.py")], check=True)
    return path


def assemble(name: str, model: Model, dest_root: Path, say: Any) -> Path:
    """A deployable copy of function `name` (`model.name`, or its -embed or -pooled variant) in dest_root."""
    dest = dest_root / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in (FUNCTIONS / model.name).iterdir():
        if f.is_file() and f.suffix == ".py":
            shutil.copy2(f, dest / f.name)
    shutil.copy2(FUNCTIONS / name / "torpor.toml", dest / "torpor.toml")
    for module in model.modules:
        shutil.copy2(ROOT / module, dest / Path(module).name)
    if model.example:
        shutil.copy2(ROOT / "examples" / model.example / "model.py", dest / "model.py")
        link_or_copy(example_weights(model.example, say), dest / "weights.safetensors")
    elif model.generated:
        weights = generated_weights(model.name)
        if not weights.is_file():
            # Made once per machine, on its GPU where there is one (seconds), then written.
            say(f"{model.name}: writing {weights} (bench/peers/make_weights.py)")
            weights.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "make_weights.py"), model.name, str(weights)], check=True)
        link_or_copy(weights, dest / "weights.safetensors")
    else:
        if CPU_ANON_BYTES:
            (dest / "anon.bytes").write_text(str(CPU_ANON_BYTES))
        parts = cpu_weight_parts(dest_root / "cpu-weights.bin", CPU_WEIGHTS_PARTS)
        link_or_copy(parts[0], dest / "weights.bin")
        extra = ""
        for i, part in enumerate(parts[1:], 1):
            link_or_copy(part, dest / f"weights-{i}.bin")
            extra += f'[[data]]\nname = "weights-{i}"\npath = "weights-{i}.bin"\nsize = "auto"\naccess = "read-only"\n\n'
        if extra:
            # Beside the first part's [[data]], before the tables that follow it.
            spec = dest / "torpor.toml"
            text = spec.read_text()
            at = text.index("[warmup]")
            spec.write_text(text[:at] + extra + text[at:])
    return dest


# ---------------------------------------------------------------------------------------------
# The benchmark


def versions() -> Json:
    out: Json = {"python": sys.version.split()[0]}
    for dist in ("torch", "torchvision", "transformers", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def link_bandwidth(path: Path | None) -> Json | None:
    """The best median host→device GB/s of a fill_bw JSON (pinned, any stream count)."""
    if path is None or not path.is_file():
        return None
    d = json.loads(path.read_text())
    h2d = [r["h2d_pinned"]["gb_per_s_median"] for r in d.get("results", []) if "h2d_pinned" in r]
    return {
        "file": str(path),
        "gpu": d.get("gpu"),
        "h2d_pinned_gbps": round(max(h2d), 2) if h2d else None,
        "chunk_bytes": d.get("chunk_bytes"),
    }


class Bench:
    def __init__(self, a: argparse.Namespace, torpor: Path) -> None:
        self.a = a
        self.torpor = torpor
        self.t0 = time.monotonic()
        self.work: Path = a.work_dir
        self.logs = self.work / "logs"
        self.gpu = any(MODELS[m].gpu for m in a.models)
        self.daemon: Daemon | None = None
        self.deployed: dict[str, dict[str, Json]] = {}  # state -> function -> deploy record
        # Copies removed after their mode (standbys): deployed again if a later mode needs them.
        self.removed: set[tuple[str, str]] = set()
        self.gpu_base: set[int] = set()
        self.failed_deploys: set[tuple[str, str]] = set()
        self.references: dict[str, Any] = {}
        # Standby mode: instances already used or stopped, which a run must not take for a standby.
        self.used_standbys: set[str] = set()
        self.results: list[Json] = []
        self.errors: list[str] = []

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def over_budget(self) -> bool:
        return (time.monotonic() - self.t0) / 60 > self.a.budget_min

    def use_daemon(self, mode: str) -> Daemon:
        state = "transparent" if base_mode(mode) == "transparent" else "split"
        config = mode_config(mode, self.gpu, self.a.extra)
        d = self.daemon
        if d is not None and d.state.name == state and d.config == config:
            d.mode = mode
            return d
        if d is not None:
            d.stop()
        self.say(f"{mode}: torpor serve on {state}/ with {json.dumps(config)}")
        self.daemon = Daemon(self.torpor, self.work / state, mode, config, self.logs)
        return self.daemon

    def ensure_deployed(self, d: Daemon, model: Model) -> None:
        state = d.state.name
        names = [model.name]
        if model.embed and state == "split" and not self.a.no_dedup:
            names.append(f"{model.name}-embed")
        for name in names:
            if name in self.deployed.setdefault(state, {}):
                continue
            if (state, name) in self.failed_deploys:
                if name == model.name:
                    raise RuntimeError(f"the deploy of {name} on {state}/ failed earlier (see errors)")
                continue
            fdir = assemble(name, model, self.work / "functions", self.say)
            self.say(f"{name}: deploy ({state})")
            try:
                dep = d.deploy(fdir)
            except RuntimeError as e:
                self.failed_deploys.add((state, name))
                if name == model.name:
                    raise
                # Only the dedup measurement needs it: the model's modes go on.
                self.errors.append(f"{name} ({state}): {e}")
                self.say(f"{name}: deploy FAILED: {str(e).splitlines()[0]}")
                continue
            dep["sizes"] = self.sizes(d, dep)
            self.deployed[state][name] = dep
            snap = dep["snapshot_function"] or {}
            self.say(
                f"{name}: deployed in {dep['wall_s']:.1f} s; stop_s {snap.get('stop_s')}, "
                f"split {snap.get('split')}, segments {snap.get('segments')}"
            )

    def sizes(self, d: Daemon, dep: Json) -> Json:
        snap_id, base_id = dep["result"]["snapshot"], dep["result"]["base"]
        snap_dir = d.state / "snapshots" / snap_id
        out: Json = {
            "snapshot_dir": disk_usage(snap_dir),
            "base_dir": disk_usage(d.state / "snapshots" / base_id) if base_id else None,
        }
        args: list[str | Path] = ["inspect", snap_dir, "--json"]
        chunks = d.state / "chunks"
        split = bool((dep["snapshot_function"] or {}).get("split"))
        if split and chunks.is_dir():
            args += ["--store", chunks]
        r = d.cli(*args, timeout=600)
        if r.returncode == 0:
            doc = json.loads(r.stdout)
            manifest = doc.get("manifest", doc) if split else doc
            out["store"] = doc.get("store") if split else None
            out["criu_version"] = ((manifest or {}).get("host") or {}).get("criu_version")
        else:
            out["inspect_error"] = r.stderr.strip()[-500:]
        return out

    def same(self, model: str, value: Any) -> bool:
        ref = self.references.setdefault(model, value)
        return bool(value == ref)

    def restore_run(self, d: Daemon, model: Model, i: int) -> Json:
        stopped = d.stop_function(model.name)
        before = d.restore_metrics()
        r = d.invoke(model.name, model.request)
        after = d.restore_metrics()
        r.pop("t_done")
        r.update(run=i, stop=stopped, fills=fills(before, after), same=self.same(model.name, r["value"]))
        if self.a.maps:
            r["maps"] = instance_maps(d, model.name)
        if r["start"] != "restored":
            raise RuntimeError(f"{model.name} run {i}: the invoke was {r['start']}, not restored")
        return r

    def warm_gpu_cache(self, d: Daemon, model: Model) -> list[Json]:
        """Restores until every fill of one came from the GPU cache (or a shared copy)."""
        warmups: list[Json] = []
        for i in range(self.a.warm_max):
            r = self.restore_run(d, model, -1 - i)
            warmups.append(r)
            self.say(f"{model.name}/gpu-cache warm-up #{i}: fills {r['fills']}")
            if r["fills"] and set(r["fills"]) <= {"gpu", "shared"}:
                break
        return warmups

    def second_run(self, d: Daemon, model: Model, i: int) -> Json:
        stopped = d.stop_function(model.name)
        first = d.invoke(model.name, model.request)
        if first["start"] != "restored":
            raise RuntimeError(f"{model.name}: instance 1 was {first['start']}, not restored")
        held: list[Json] = []
        failed: list[BaseException] = []

        def hold() -> None:
            try:
                held.append(d.invoke(model.name, {**model.request, "hold_s": self.a.hold_s}))
            except BaseException as e:  # reported after the join
                failed.append(e)

        th = threading.Thread(target=hold, daemon=True)
        th.start()
        time.sleep(self.a.settle_s)
        before = d.restore_metrics()
        second = d.invoke(model.name, model.request)
        after = d.restore_metrics()
        devices = d.devices(model.name)
        th.join(timeout=self.a.hold_s + 600)
        if failed or not held:
            raise RuntimeError(f"{model.name}: the holding request failed: {failed[:1]}")
        h = held[0]
        second.update(
            run=i,
            stop=stopped,
            fills=fills(before, after),
            live_instances=len(devices),
            # Two devices: placement put the second on another GPU, which has no copy to share.
            devices=sorted(devices),
            # Instance 1 was still holding its request when instance 2 answered.
            overlapped=second["t_done"] < h["t_done"],
            first={"wall_s": first["wall_s"], "start": first["start"], "timings": first["timings"]},
            held={"wall_s": h["wall_s"], "start": h["start"], "same": self.same(model.name, h["value"])},
            same=self.same(model.name, second["value"]) and self.same(model.name, first["value"]),
        )
        second.pop("t_done")
        if second["start"] != "restored" or h["start"] != "warm":
            raise RuntimeError(
                f"{model.name} run {i}: the second request was {second['start']} and the held one "
                f"{h['start']}; expected restored and warm (raise --hold-s?)"
            )
        return second

    def ensure_copy_deployed(self, d: Daemon, model: Model, suffix: str, scaling: str) -> str:
        """`NAME-SUFFIX`: the model's function with `scaling` (TOML lines) put first in its
        [scaling] table (later keys of the same name would clash: the copy's replace them), on
        `d`'s state."""
        name = f"{model.name}-{suffix}"
        state = d.state.name
        if name in self.deployed.setdefault(state, {}) and (state, name) not in self.removed:
            return name
        self.removed.discard((state, name))
        fdir = assemble(model.name, model, self.work / f"functions-{suffix}", self.say)
        toml = fdir / "torpor.toml"
        text = toml.read_text().replace(f'name = "{model.name}"', f'name = "{name}"', 1)
        if "[scaling]\n" not in text:
            raise RuntimeError(f"{toml} has no [scaling] table to add {scaling!r} to")
        head, tail = text.split("[scaling]\n", 1)
        body, rest = (tail.split("\n[", 1) + [""])[:2]
        keys = {line.split("=")[0].strip() for line in scaling.splitlines()}
        kept = "\n".join(line for line in body.splitlines() if line.split("=")[0].strip() not in keys)
        text = head + "[scaling]\n" + scaling.rstrip("\n") + "\n" + kept + ("\n[" + rest if rest else "\n")
        toml.write_text(text)
        self.say(f"{name}: deploy ({state})")
        dep = d.deploy(fdir)
        dep["sizes"] = self.sizes(d, dep)
        self.deployed[state][name] = dep
        return name

    def ensure_standby_deployed(self, d: Daemon, model: Model, live: bool = False) -> str:
        """`NAME-standby`: the model's function with `standby = 1` and `standby_gpu = "released"`
        (`NAME-standby-live`: `standby_gpu = "live"`)."""
        if live:
            return self.ensure_copy_deployed(d, model, "standby-live", 'standby = 1\nstandby_gpu = "live"')
        # Explicit: "live" is the spec's default now, and this row measures the released kind.
        return self.ensure_copy_deployed(d, model, "standby", 'standby = 1\nstandby_gpu = "released"')

    def drop_page_cache(self) -> Json:
        return drop_page_cache(not self.a.no_drop_cache)

    def cold_disk_run(self, d: Daemon, model: Model, i: int) -> Json:
        d.stop_function(model.name)
        dropped = self.drop_page_cache()
        r = self.restore_run(d, model, i)
        r.update(dropped)
        return r

    def burst_run(self, d: Daemon, model: Model, name: str, i: int) -> Json:
        """BURST requests at once to `name` with nothing live, on an idle GPU: the time until all
        answered."""
        stopped = d.stop_function(name)
        # The previous burst's eight processes leave the GPU after the stop (the driver tears
        # their contexts down); a burst arriving meanwhile would meet that, not an idle node.
        settle_s = wait_gpu_idle(self.gpu_base) if self.gpu else 0.0
        before = d.restore_metrics()
        answers: list[Json | BaseException] = [RuntimeError("no answer")] * BURST
        go = threading.Barrier(BURST + 1)

        def one(k: int) -> None:
            go.wait()
            try:
                answers[k] = d.invoke(name, model.request)
            except BaseException as e:  # reported below
                answers[k] = e

        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(BURST)]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(timeout=1800)
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            raise RuntimeError(f"{name} burst {i}: {len(failed)} of {BURST} failed: {failed[0]}")
        got = [a for a in answers if not isinstance(a, BaseException)]
        wall = max(a["t_done"] for a in got) - t0
        first = min(a["t_done"] for a in got) - t0
        # The daemon binds a request to the first free instance (late binding): an answer may
        # come from an instance another request's start made ready first ("warm"), while every
        # request still started one. All up: the burst's instances all warm.
        all_up = self.wait_all_up(d, name, t0)
        # The gauges are set at each 200 ms keep-alive tick.
        time.sleep(0.3)
        devices = d.device_instances()
        after = d.restore_metrics()
        starts = {s: sum(1 for a in got if a["start"] == s) for s in sorted({str(a["start"]) for a in got})}
        if not set(starts) <= {"restored", "warm"} or "restored" not in starts:
            raise RuntimeError(f"{name} burst {i}: starts {starts}, expected restored (and warm) ones only")
        return {
            "run": i,
            "wall_s": round(wall, 6),
            "first_answer_s": round(first, 6),
            "all_up_s": all_up,
            "devices": devices,
            "gpu_settle_s": settle_s,
            "starts": starts,
            "start": "restored",
            # The slowest answer's phases: what the burst waited for.
            "timings": max(got, key=lambda a: a["t_done"])["timings"],
            "answers": [{"wall_s": a["wall_s"], "timings": a["timings"]} for a in got],
            "stop": stopped,
            "fills": fills(before, after),
            "value": got[0]["value"],
            "same": all(self.same(model.name, a["value"]) for a in got),
        }

    def wait_all_up(self, d: Daemon, name: str, t0: float) -> float | None:
        """Seconds from `t0` until `name` lists BURST live instances, polled every 20 ms (None
        past 120 s: then fewer came up, and the run says so)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status, _, body = d.request("GET", f"/v1/functions/{name}", timeout=30)
            if status == 200:
                live = [x for x in json.loads(body)["instances"] if x.get("pid") and x.get("stage") == "warm"]
                if len(live) >= BURST:
                    return round(time.perf_counter() - t0, 6)
            time.sleep(0.02)
        return None

    def wait_standby(self, d: Daemon, name: str, gpu: bool, not_ids: set[str], live: bool = False) -> tuple[str, float]:
        """Waits until `name` has an unused standby that is none of `not_ids`: a live instance in
        its stage (gpu_released, or warm on the CPU) while the daemon's
        torpor_standby_instances says 1, twice, a tick apart (the gauge is set at each 200 ms
        keep-alive tick). Returns its id and the seconds waited."""
        stage = "gpu_released" if gpu and not live else "warm"
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        gauge = f'torpor_standby_instances{{function="{name}"}}'
        seen = 0
        while True:
            status, _, body = d.request("GET", f"/v1/functions/{name}", timeout=30)
            if status != 200:
                raise RuntimeError(f"GET /v1/functions/{name} answered {status}: {body[:300]!r}")
            fresh = [i["id"] for i in json.loads(body)["instances"] if i.get("pid") and i["stage"] == stage and i["id"] not in not_ids]
            metrics = d.request("GET", "/metrics", timeout=30)[2].decode(errors="replace")
            ready = any(line == f"{gauge} 1" for line in metrics.splitlines())
            seen = seen + 1 if fresh and ready else 0
            if seen >= 2:
                return fresh[0], round(time.perf_counter() - t0, 3)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no standby of {name} within 600 s\n{d.log_tail()}")
            time.sleep(0.25)

    def standby_run(self, d: Daemon, model: Model, name: str, i: int) -> Json:
        """Waits for the standby, invokes it, then stops every instance (the next standby
        comes from the function snapshot again)."""
        live = name.endswith("-standby-live")
        standby, waited = self.wait_standby(d, name, model.gpu, self.used_standbys, live)
        before = d.restore_metrics()
        r = d.invoke(name, model.request)
        after = d.restore_metrics()
        r.pop("t_done")
        if r["start"] != "standby":
            raise RuntimeError(f"{name} run {i}: the invoke was {r['start']}, not standby")
        stopped = d.cli("stop", name, "--json", timeout=120)
        if stopped.returncode != 0:
            raise RuntimeError(f"torpor stop {name} failed: {stopped.stderr.strip()}")
        stop: Json = json.loads(stopped.stdout)
        self.used_standbys.update([standby, *stop["stopped"], *stop["retiring"]])
        r.update(
            run=i,
            standby_wait_s=waited,
            stop=stop,
            fills=fills(before, after),
            same=self.same(model.name, r["value"]),
        )
        return r

    def pool_ready(self, d: Daemon, tenant: str) -> float:
        status, _, body = d.request("GET", "/metrics", timeout=30)
        prefix = f'torpor_sandbox_pool_ready{{tenant="{tenant}"}} '
        for line in body.decode(errors="replace").splitlines() if status == 200 else []:
            if line.startswith(prefix):
                return float(line[len(prefix) :])
        return 0.0

    def pooled_dir(self, model: Model) -> Path:
        """The model's `-pooled` copy, assembled once: making it again would link the weights
        anew, and a new link changes the file's ctime, which torpord takes for a changed file
        (it hashes it again; gpudata.rs)."""
        name = f"{model.name}-pooled"
        if not (FUNCTIONS / name).is_dir():
            raise RuntimeError(f"{model.name} has no pooled variant (bench/coldstart/functions/{name})")
        fdir = self.work / "functions-pooled" / name
        if not fdir.is_dir():
            fdir = assemble(name, model, self.work / "functions-pooled", self.say)
        return fdir

    def pooled_invoke(self, d: Daemon, model: Model, fdir: Path, i: int, want: str | None) -> Json:
        """The `-pooled` copy's instances stopped, a ready sandbox of its tenant awaited (the
        gauge counts one once its CUDA is warm), then one invoke, whose start must be `want`
        (None: the daemon's choice)."""
        name = fdir.name
        tenant = tomllib.loads((fdir / "torpor.toml").read_text())["tenant"]
        stopped = d.stop_function(name)
        t = time.perf_counter()
        while self.pool_ready(d, tenant) < 1:
            if time.perf_counter() - t > 600:
                raise RuntimeError(f"no ready sandbox of tenant {tenant} within 600 s\n{d.log_tail()}")
            time.sleep(0.1)
        waited = round(time.perf_counter() - t, 3)
        before = d.restore_metrics()
        r = d.invoke(name, model.request)
        after = d.restore_metrics()
        r.pop("t_done")
        if want is not None and r["start"] != want:
            raise RuntimeError(f"{name} run {i}: the invoke was {r['start']}, not {want}")
        d.stop_function(name)
        r.update(
            run=i,
            pool_ready_wait_s=waited,
            stop=stopped,
            fills=fills(before, after),
            same=self.same(model.name, r["value"]),
        )
        return r

    def pooled_run(self, d: Daemon, model: Model, i: int) -> Json:
        """Mode pooled: the `-pooled` copy deployed again (so the node takes its next start for
        its first: a start in a ready sandbox), then pooled_invoke."""
        fdir = self.pooled_dir(model)
        dep = d.deploy(fdir)
        r = self.pooled_invoke(d, model, fdir, i, "pooled")
        r.update(deploy_s=dep["wall_s"], deploy_setup_s=(dep["phases"] or {}).get("load"))
        return r

    def pooled_later_warmups(self, d: Daemon, model: Model) -> list[Json]:
        """Mode pooled-later's warm-ups: the `-pooled` copy deployed once, its first start (in
        a ready sandbox) and its second (a restore), both measured by the daemon, which from
        then on takes the faster way (`sandbox_pool.starts = "faster"`)."""
        fdir = self.pooled_dir(model)
        d.deploy(fdir)
        return [self.pooled_invoke(d, model, fdir, -2, "pooled"), self.pooled_invoke(d, model, fdir, -1, "restored")]

    def pooled_later_run(self, d: Daemon, model: Model, i: int) -> Json:
        """Mode pooled-later: a later cold start of the deployed `-pooled` copy, with a ready
        sandbox there: the daemon takes the way that was faster (its `start` says which)."""
        return self.pooled_invoke(d, model, self.pooled_dir(model), i, None)

    def mode(self, variant: str, model: Model) -> Json:
        d = self.use_daemon(variant)
        mode = base_mode(variant)
        self.ensure_deployed(d, model)
        out: Json = {"model": model.name, "mode": variant, "config": d.config}
        standby = (
            self.ensure_standby_deployed(d, model, live=mode == "standby-live")
            if mode in ("standby", "standby-live")
            else None
        )
        burst = (
            self.ensure_copy_deployed(d, model, "burst", f"max_instances = {BURST}\nrequests_per_instance = 1")
            if mode == "burst8"
            else None
        )
        if mode in ("gpu-cache", "cold", "burst8"):
            out["warmups"] = self.warm_gpu_cache(d, model)
        if mode == "pooled":
            # The first deploy fills the weights from the file; later ones from the GPU cache.
            out["warmups"] = [self.pooled_run(d, model, -1)]
        elif mode == "pooled-later":
            out["warmups"] = self.pooled_later_warmups(d, model)
        # What holds GPU memory with nothing of the function live: a burst waits for the GPU to
        # be back to this (burst_run).
        self.gpu_base = set(gpu_memory_by_pid()) if self.gpu else set()
        if standby is not None:
            warmups: list[Json] = []
            for i in range(self.a.warm_max):
                r = self.standby_run(d, model, standby, -1 - i)
                warmups.append(r)
                self.say(f"{standby} warm-up #{i}: fills {r['fills']}")
                if not r["fills"] or set(r["fills"]) <= {"gpu", "shared"}:
                    break
            out["warmups"] = warmups
        runs: list[Json] = []
        for i in range(self.a.runs):
            if i > 0 and self.over_budget():
                self.say(f"{model.name}/{variant}: time budget spent after {i} runs")
                out["skipped_runs"] = self.a.runs - i
                break
            try:
                if standby is not None:
                    r = self.standby_run(d, model, standby, i)
                elif burst is not None:
                    r = self.burst_run(d, model, burst, i)
                elif mode == "cold-disk":
                    r = self.cold_disk_run(d, model, i)
                elif mode == "second":
                    r = self.second_run(d, model, i)
                elif mode == "pooled":
                    r = self.pooled_run(d, model, i)
                elif mode == "pooled-later":
                    r = self.pooled_later_run(d, model, i)
                else:
                    r = self.restore_run(d, model, i)
            except (RuntimeError, OSError, http.client.HTTPException) as e:
                # The runs so far stand; the error says why the rest are missing.
                out["error"] = f"run {i}: {type(e).__name__}: {e}"
                self.errors.append(f"{model.name}/{variant}: {out['error']}")
                self.say(f"{model.name}/{variant}: FAILED: {out['error']}")
                break
            runs.append(r)
            self.say(
                f"{model.name}/{variant} #{i}: {r['wall_s']:.3f} s, timings {r['timings']}, fills "
                f"{ {k: v['segments'] for k, v in r['fills'].items()} }, same {r['same']}"
            )
        if standby is not None or burst is not None:
            if standby is not None and self.a.idle and runs and "error" not in out:
                # Idle with its standby ready: what the standby keeps costs while no request comes.
                _, waited = self.wait_standby(d, standby, model.gpu, self.used_standbys, mode == "standby-live")
                out["idle"] = {**self.idle_resident(d, standby), "standby_wait_s": waited}
            if standby is not None:
                # Standbys would come back after a stop: removed (deployed again if needed).
                gone = d.cli("rm", standby, timeout=300)
                if gone.returncode != 0:
                    self.errors.append(f"torpor rm {standby}: {gone.stderr.strip()}")
                self.removed.add((d.state.name, standby))
            elif burst is not None:
                # 8 instances would hold memory through later modes; a variant reuses the deploy.
                try:
                    d.stop_function(burst)
                except RuntimeError as e:
                    self.errors.append(f"stopping {burst}: {e}")
        elif "error" not in out:
            d.stop_function(model.name)
            if self.a.idle and runs:
                out["idle"] = self.idle_resident(d, model.name)
        phases: list[str] = []
        for r in runs:
            phases += [p for p in r["timings"] if p not in phases]
        out.update(
            runs=runs,
            wall_s=summary([r["wall_s"] for r in runs]),
            timings={p: summary([r["timings"].get(p) for r in runs]) for p in phases},
            fills=merge_fills(runs),
            all_same=bool(runs) and all(r["same"] for r in runs),
        )
        return out

    def idle_resident(self, d: Daemon, name: str) -> Json:
        """What the node keeps for function `name` while it is idle (no request, nothing live
        but a standby): the daemon's gauges in /metrics (the restore server's caches, the stage
        area, the function's standbys) and the daemon process's own resident host memory and
        GPU memory (NVML: the pinned host cache and the GPU cache live in it)."""
        status, _, body = d.request("GET", "/metrics", timeout=30)
        gauges: Json = {}
        if status == 200:
            wanted = ("torpor_restore_cache_bytes", "torpor_stage_bytes", "torpor_gpu_memory_bytes")
            mine = ("torpor_standby_host_memory_bytes", "torpor_standby_gpu_memory_bytes", "torpor_standby_instances")
            for line in body.decode(errors="replace").splitlines():
                key, _, value = line.rpartition(" ")
                base = key.split("{", 1)[0]
                if base in wanted or (base in mine and f'function="{name}"' in key):
                    try:
                        gauges[key] = float(value)
                    except ValueError:
                        pass
        pid = d.proc.pid
        return {
            "metrics": gauges,
            "daemon_rss_bytes": process_rss(pid),
            "daemon_gpu_bytes": gpu_memory_by_pid().get(pid),
        }

    def dedup(self) -> list[Json]:
        out = []
        split = self.deployed.get("split", {})
        for name, dep in split.items():
            if not name.endswith("-embed") or name[: -len("-embed")] not in split:
                continue
            a = split[name[: -len("-embed")]]["sizes"].get("store") or {}
            b = dep["sizes"].get("store") or {}
            if not a or not b:
                continue
            logical = a["logical"] + b["logical"]
            shared = b["shared_with"].get(a["snapshot"], 0)
            # The union of their distinct chunks: raw, and on disk (zstd).
            raw = a["unique"] + b["unique"] - shared
            together = a["stored"] + b["exclusive"]
            out.append(
                {
                    "functions": [name[: -len("-embed")], name],
                    "logical_bytes": logical,
                    "unique_bytes_together": raw,
                    "shared_bytes": shared,
                    "stored_bytes_apart": a["stored"] + b["stored"],
                    "stored_bytes_together": together,
                    # logical / distinct raw bytes: deduplication alone.
                    "dedup_ratio": round(logical / raw, 3) if raw else None,
                    # logical / bytes on disk: deduplication and compression.
                    "ratio": round(logical / together, 3) if together else None,
                }
            )
        return out


# The cold-start issue's targets (H100, restore → first inference, medians): GPT-2-Large `cold`
# ≤ 0.30 s, ResNet-152 `cold` ≤ 0.25 s, `standby` ≤ 0.15 s, `burst8` ≤ 2× `cold`.
COLD_TARGET_S = {"gpt2-large": 0.30, "resnet152": 0.25}
STANDBY_TARGET_S = 0.15


def headline_summary(results: list[Json], models: list[str]) -> Json:
    """The figures the cold-start issue names, per model: each mode's median wall time, and
    `burst8 / cold` (the burst's target is ≤ 2), with the targets beside them."""
    out: Json = {}
    for model in models:
        med = {r["mode"]: r["wall_s"]["median"] for r in results if r["model"] == model and r.get("runs") and r.get("wall_s")}
        cold, burst = med.get("cold"), med.get("burst8")
        up = [
            run["all_up_s"]
            for r in results
            if r["model"] == model and r["mode"] == "burst8"
            for run in r.get("runs", [])
            if run.get("all_up_s") is not None
        ]
        out[model] = {
            **{mode: med[mode] for mode in MODES if mode in med},
            "burst8_over_cold": round(burst / cold, 3) if cold and burst else None,
            # Until all 8 instances were up (the answers came sooner: late binding).
            "burst8_all_up": round(statistics.median(up), 4) if up else None,
            # MODE@TAG rows: the same mode with another daemon config (an A/B in this run).
            "variants": {
                r["mode"]: r["wall_s"]["median"]
                for r in results
                if r["model"] == model and "@" in r["mode"] and r.get("runs") and r.get("wall_s")
            },
            "targets": {"cold": COLD_TARGET_S.get(model), "standby": STANDBY_TARGET_S, "burst8_over_cold": 2.0},
            "identical": identical(results, model),
        }
    return out


def identical(results: list[Json], model: str) -> bool | None:
    """Whether every run of `model` in every mode gave the reference value; None without runs."""
    rows = [r for r in results if r["model"] == model and r.get("runs")]
    return all(r["all_same"] for r in rows) if rows else None


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    global CPU_WEIGHTS_BYTES, CPU_WEIGHTS_PARTS
    if a.cpu_weights_mib is not None:
        CPU_WEIGHTS_BYTES = a.cpu_weights_mib << 20
    CPU_WEIGHTS_PARTS = a.cpu_weights_parts
    if os.geteuid() != 0:
        raise SystemExit("split.py: run as root: torpord starts workers in namespaces and runs CRIU")
    torpor = find_torpor(a.torpor)
    # A fresh directory per run: nothing of an earlier run (state, caches) is reused.
    a.work_dir = a.work_dir.resolve() / f"run-{int(time.time() * 1000)}"
    longest = a.work_dir / "transparent" / "workers.sock"
    if len(str(longest).encode()) >= 108:
        raise SystemExit(f"split.py: --work-dir is too long for the daemons' sockets ({longest}): use a shorter one")
    (a.work_dir / "logs").mkdir(parents=True)
    bench = Bench(a, torpor)
    info = machine()
    bench.say(f"torpor {torpor}; device {info['device']}; models {a.models}; modes {a.modes}; runs {a.runs}")
    try:
        for mode in a.modes:
            for name in a.models:
                try:
                    bench.results.append(bench.mode(mode, MODELS[name]))
                except Exception as e:  # record and go on: one GPU batch should say all it can
                    bench.say(f"{name}/{mode}: FAILED: {e}")
                    bench.errors.append(f"{name}/{mode}: {type(e).__name__}: {e}")
                    bench.results.append({"model": name, "mode": mode, "error": f"{type(e).__name__}: {e}"})
    finally:
        if bench.daemon is not None:
            bench.daemon.stop()
    criu = next(
        (dep["sizes"].get("criu_version") for deps in bench.deployed.values() for dep in deps.values() if dep["sizes"].get("criu_version")),
        None,
    )
    doc: Json = {
        "benchmark": "coldstart-split",
        "summary": headline_summary(bench.results, a.models),
        "machine": {**info, "criu_version": criu, "versions": versions(), "torpor_binary": str(torpor)},
        "settings": {
            "models": a.models,
            "modes": a.modes,
            "runs": a.runs,
            "hold_s": a.hold_s,
            "warm_max": a.warm_max,
            "cpu_weights_bytes": CPU_WEIGHTS_BYTES if "cpu" in a.models else None,
            "cpu_weights_parts": CPU_WEIGHTS_PARTS if "cpu" in a.models else None,
            "requests": {m: MODELS[m].request for m in a.models},
            "daemon_config": {m: render_toml(mode_config(m, bench.gpu, a.extra)) for m in a.modes},
            "each run": "torpor stop NAME, then one invoke (a fresh restore) timed by the client",
        },
        "link": link_bandwidth(a.fill_bw),
        "deploys": bench.deployed,
        "dedup": bench.dedup(),
        "results": bench.results,
        "outputs": {
            m: {
                "reference": bench.references.get(m),
                "identical_across_modes": identical(bench.results, m),
            }
            for m in a.models
        },
        "errors": bench.errors,
        "elapsed_s": round(time.monotonic() - bench.t0, 1),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    if a.keep or bench.errors:
        # After an error, the daemons' logs and CRIU's are the post-mortem.
        print(f"work dir kept: {a.work_dir}", file=sys.stderr)
    else:
        shutil.rmtree(a.work_dir, ignore_errors=True)
    import split_table

    print(split_table.render(doc))
    print(f"\n{a.out} ({doc['elapsed_s']:.0f} s)")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
