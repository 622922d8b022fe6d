"""GPU memory of 8 functions of one tenant: one sandbox against one process each (issue 11,
"Measure"; docs/sandboxes.md). Starts its own torpord twice (fresh state each time), deploys
N functions (a small PyTorch MLP each, its weights on the GPU), invokes each once so that each
is live, and reads the GPU memory the workers hold: first with one process per function
(scaling.sandbox = false), then with every function in one sandbox (sandbox = true, one
tenant and workflow). In the sandbox it then hands 100 MiB from one function to another
through the store, three times each way: the same object (`torpor.put`/`get`; a CUDA tensor on
the GPU) and `shared=True` (a sealed memfd through torpord; host memory), timed inside the
handlers. Writes bench/results/sandbox-<device>.json with a top-level `summary`:
`memory_ratio_8fn` (processes ÷ sandbox, 1 s after the requests), `memory_ratio_8fn_idle` (the
same once every function has been idle past its `keepalive.memory_release_s`, when a sandbox has
given its functions' request pools back), `handoff_100mb_ms` (same object, put + get, best of
--handoff-runs, 15), `handoff_100mb_shared_ms` and, on the GPU, `handoff_100mb_other_sandbox_ms` (a CUDA tensor
with shared=True to a function in another sandbox of the tenant, put + get; the get alone is
`handoff_100mb_other_sandbox_get_ms`; both null with --cpu); `pooled_start_s`: a sandboxed function's first start into a
ready sandbox of the live-context pool (`[sandbox_pool] size = 1`) → its first answer, median of
3 functions each new to the node, each invoked once the daemon's `torpor_sandbox_pool_ready`
gauge says a sandbox is ready, i.e. warm (its preloads imported and CUDA warmed: the worker's
`warmed` frame), so the figure is a start into a warm sandbox, not one that waits for torch's
import (that wait is each start's `pool_ready_wait_s`), against `cold_restore_start_s`, the
same with the pool off (a
restore of the function snapshot), and `pooled_setup_s` (the function's own setup() and warm-up
inside it, from its deploy); `small_p99_ratio` is null here: bench/pcie/run.py measures it
(sandbox-pcie-*.json).

    python3 bench/sandbox/run.py [--functions 8] [--weights-mib 64] [--out FILE]
    python3 bench/sandbox/run.py --cpu      # NumPy functions, host memory (PSS), for a machine without a GPU

GPU memory is NVML's per-process figure (nvidia-smi --query-compute-apps) summed over the
workers of the daemon (when NVML lists none of them, the growth of the GPU's memory in use
since before the daemon started; both are recorded); host memory with --cpu is the workers' PSS
(/proc/PID/smaps_rollup).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "python"))

from torpor import client  # noqa: E402

# The store's hand-off, in both models' source (formatted with them: braces doubled).
HANDOFF = '''
def handoff(request, make, sync):
    """The store's hand-off, timed inside the handlers: "put" makes a value of `mib` MiB and puts
    it (shared: through torpord's store, as NumPy bytes; shared "gpu": the value made here, a
    CUDA tensor on the GPU variant, through torpord's store, with the steps it took); "get"
    takes it (with its steps when asked)."""
    import time
    import numpy as np
    from torpor import store_gpu
    if request["handoff"] == "round_trip":
        # A get of a key nobody put: one round trip to torpord's store and back, nothing else.
        took = []
        for _ in range(request["n"]):
            t = time.perf_counter()
            try:
                torpor.get("handoff-nobody-put-this")
            except KeyError:
                pass
            took.append(time.perf_counter() - t)
        return {{"s": took}}
    key, mib, shared = request["key"], request["mib"], request.get("shared", False)
    if request["handoff"] == "put":
        value = make(mib << 20) if shared in (False, "gpu") else np.ones(mib << 20, dtype=np.uint8)
        gpu, shared = shared == "gpu", bool(shared)
        sync()
        t = time.perf_counter()
        torpor.put(key, value, shared=shared)
        s = time.perf_counter() - t
        return {{"s": s, "steps": store_gpu.steps() if gpu else None}}
    t = time.perf_counter()
    value = torpor.get(key)
    n = int(value.nbytes)
    s = time.perf_counter() - t
    return {{"s": s, "bytes": n, "steps": store_gpu.steps() if request.get("steps") else None}}
'''

# What the worker's PyTorch allocator holds, by pool, stream and kind of segment, and the sizes
# of its live blocks of 1 MiB or more (a cuBLAS workspace is one of 32 MiB on Hopper): the part of
# NVML's per-process figure that is PyTorch's; the rest is the context, loaded kernels and the
# libraries' own allocations. Formatted with the models' source (braces doubled).
ALLOCATOR = '''
def allocator():
    import collections
    import threading
    pools = collections.defaultdict(lambda: [0, 0, 0])
    live = collections.Counter()
    for seg in torch.cuda.memory_snapshot():
        key = f"{{seg.get('segment_pool_id')}} stream={{seg['stream']}} {{seg['segment_type']}}"
        pools[key][0] += 1
        pools[key][1] += seg["total_size"]
        pools[key][2] += seg["allocated_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["size"] >= 1 << 20:
                live[b["size"]] += 1
    return {{
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
        "pools": {{k: {{"segments": v[0], "bytes": v[1], "allocated": v[2]}} for k, v in pools.items()}},
        "live_blocks_1mib_up": {{str(k): v for k, v in sorted(live.items())}},
        "threads": threading.active_count(),
        "limits": context_limits(),
    }}


def context_limits():
    # The context's per-thread stack, printf FIFO and device heap (cuCtxGetLimit 0, 1, 2): the
    # driver reserves the stack for every resident GPU thread (264 MiB at 1 KiB on the H100).
    import ctypes
    torch.zeros(1, device="cuda")  # the primary context current on this thread
    lib = ctypes.CDLL("libcuda.so.1")
    out = {{}}
    for name, which in (("stack", 0), ("printf_fifo", 1), ("malloc_heap", 2)):
        v = ctypes.c_size_t(0)
        out[name] = v.value if lib.cuCtxGetLimit(ctypes.byref(v), which) == 0 else None
    return out
'''

GPU_MODEL = '''
import torch
import torpor

MIB = {mib}


''' + HANDOFF + ALLOCATOR + '''

@torpor.function
class Fn:
    def setup(self) -> None:
        width = 1024
        layers = max(1, MIB * (1 << 20) // (4 * width * width))
        self.layers = [torch.randn(width, width, device="cuda") / 32 for _ in range(layers)]

    def __call__(self, request):
        if "handoff" in request:
            return handoff(request, lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"), torch.cuda.synchronize)
        if "allocator" in request:
            return allocator()
        x = torch.ones(8, 1024, device="cuda")
        for w in self.layers:
            x = torch.tanh(x @ w)
        return {{"sum": float(x.sum())}}
'''

CPU_MODEL = '''
import numpy as np
import torpor

MIB = {mib}


''' + HANDOFF + '''

@torpor.function
class Fn:
    def setup(self) -> None:
        width = 512
        layers = max(1, MIB * (1 << 20) // (4 * width * width))
        rng = np.random.default_rng(0)
        self.layers = [rng.standard_normal((width, width), dtype=np.float32) / 23 for _ in range(layers)]

    def __call__(self, request):
        if "handoff" in request:
            return handoff(request, lambda n: np.ones(n, dtype=np.uint8), lambda: None)
        x = np.ones((8, 512), dtype=np.float32)
        for w in self.layers:
            x = np.tanh(x @ w)
        return {{"sum": float(x.sum())}}
'''


# The functions' keepalive.memory_release_s: a sandboxed function gives its request pool's
# memory back after this long idle (torpor.mempool); the memory is read again past it.
MEMORY_RELEASE_S = 2.0
IDLE_READ_AFTER_S = MEMORY_RELEASE_S + 2.0


def write_functions(root: Path, n: int, sandbox: bool, mib: int, cpu: bool) -> list[Path]:
    dirs = []
    for i in range(n):
        d = root / f"fn{i}"
        d.mkdir(parents=True)
        (d / "model.py").write_text((CPU_MODEL if cpu else GPU_MODEL).format(mib=mib))
        spec = [
            f'name = "bench-fn{i}"',
            'tenant = "bench"',
            'workflow = "eight"',
            'entry = "model:Fn"',
            f'preload = ["{"numpy" if cpu else "torch"}"]',
            f"gpus = {0 if cpu else 1}",
            f'gpu_memory = "{0 if cpu else "1GiB"}"',
            "timeout_s = 60",
            "load_timeout_s = 300",
            "[scaling]",
            "max_instances = 1",
            f"requests_per_instance = {n if sandbox else 1}",
            f"sandbox = {'true' if sandbox else 'false'}",
            "[keepalive]",
            "gpu_release_s = 3600",
            "hibernate_s = 3600",
            "evict_s = 3600",
            f"memory_release_s = {MEMORY_RELEASE_S}",
        ]
        (d / "torpor.toml").write_text("\n".join(spec) + "\n")
        dirs.append(d)
    return dirs


def worker_pids(state: Path) -> list[int]:
    """The torpor.worker processes of the daemon of `state` (their environment names it)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            # The Python worker itself, not the init whose command line names it.
            if b"torpor.worker" not in argv or b"python" not in Path(argv[0].decode(errors="replace")).name.encode():
                continue
            if f"TORPORD_STATE_DIR={state}".encode() not in (p / "environ").read_bytes():
                continue
        except OSError:
            continue
        pids.append(int(p.name))
    return pids


def gpu_mib(pids: list[int]) -> float:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total = 0.0
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            total += float(parts[1])
    return total


def gpu_used_mib() -> float:
    """The GPU's memory in use, all processes (NVML), MiB."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.split()[0])


def pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def call(sock: Path, name: str, request: dict[str, Any]) -> dict[str, Any]:
    a = client.request(sock, "POST", f"/v1/functions/{name}/invoke", json.dumps(request).encode(), 300)
    if a.status != 200:
        raise RuntimeError(f"invoke {name}: {a.status} {a.body[:300]!r}")
    return dict(json.loads(a.body))


def measure_handoffs(sock: Path, n: int, cpu: bool, runs_each: int = 3) -> dict[str, Any]:
    """100 MiB from bench-fn0 to bench-fn1 in the sandbox through torpor.put/get: the same
    object (GPU memory under torch), and shared=True (a sealed memfd through torpord, host
    memory); on the GPU, also a CUDA tensor with shared=True from bench-fn0 to bench-other, a
    function in another sandbox of the tenant (GPU memory torpord owns, mapped read-only there:
    `other_sandbox_gpu`, with each put's and get's steps from torpor.store_gpu.steps(); null on
    the CPU). Seconds inside the handlers, put and get apart, `runs_each` times each way."""
    out: dict[str, Any] = {"other_sandbox_gpu": None}
    other = "bench-fn1" if n > 1 else "bench-fn0"
    modes: list[tuple[str, bool | str, str]] = [("same_object", False, other), ("shared_memfd", True, other)]
    if not cpu:
        modes.append(("other_sandbox_gpu", "gpu", "bench-other"))
    for how, shared, getter in modes:
        runs = []
        for i in range(runs_each):
            key = f"handoff-{how}-{i}"
            put = call(sock, "bench-fn0", {"handoff": "put", "key": key, "mib": 100, "shared": shared})
            got = call(sock, getter, {"handoff": "get", "key": key, "mib": 100, "steps": shared == "gpu"})
            assert got["bytes"] == 100 << 20, got
            run: dict[str, Any] = {"put_s": put["s"], "get_s": got["s"]}
            if shared == "gpu":
                run["put_steps"], run["get_steps"] = put.get("steps"), got.get("steps")
            runs.append(run)
        out[how] = runs
    # What one request to torpord's store costs a handler, alone (a get of a missing key).
    out["round_trip_s"] = call(sock, "bench-fn0", {"handoff": "round_trip", "n": 50})["s"]
    # The same, but each the first store request of its own invoke, as a hand-off's requests are.
    out["round_trip_first_s"] = [
        call(sock, "bench-fn0", {"handoff": "round_trip", "n": 1})["s"][0] for _ in range(runs_each)
    ]
    return out


def start_daemon(torpor: Path, root: Path, config: str) -> tuple[subprocess.Popen[bytes], Any, Path]:
    """Starts `torpor serve` with `config` as its torpord.toml, its state, socket and log
    (stderr) in `root`, and waits for its socket (20 s at most, else RuntimeError naming the
    log). Returns the daemon, its open log and its socket; stop_daemon ends all three."""
    state, sock = root / "state", root / "torpord.sock"
    (root / "torpord.toml").write_text(config)
    log = open(root / "torpord.log", "wb")  # noqa: SIM115 (closed by stop_daemon)
    daemon = subprocess.Popen(
        [torpor, "serve", "--config", root / "torpord.toml", "--state-dir", state, "--socket", sock],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    deadline = time.monotonic() + 20
    while not sock.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            log.close()
            raise RuntimeError(f"torpord did not open {sock}; see {root / 'torpord.log'}")
        time.sleep(0.05)
    return daemon, log, sock


def stop_daemon(daemon: subprocess.Popen[bytes], log: Any, root: Path) -> None:
    """Stops a daemon this script started (SIGTERM, then kill after 60 s), closes its log and
    removes its state."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        daemon.kill()
    log.close()
    shutil.rmtree(root, ignore_errors=True)


def one_mode(torpor: Path, n: int, sandbox: bool, mib: int, cpu: bool, handoff_runs: int = 3) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="torpor-sandbox-bench-"))
    before = None if cpu else gpu_used_mib()
    daemon, log, sock = start_daemon(torpor, root, "split = false\n")
    state = root / "state"
    try:
        env = dict(os.environ, TORPOR_SOCKET=str(sock))
        dirs = write_functions(root / "fns", n, sandbox, mib, cpu)
        t = time.monotonic()
        for d in dirs:
            r = subprocess.run([torpor, "deploy", d], capture_output=True, text=True, env=env, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"deploy {d.name} failed: {r.stdout}{r.stderr}")
        deploy_s = time.monotonic() - t
        # The GPU's memory in use (all processes, MiB above `before`) after the deploys and after
        # each invoke: where a sandbox grows, function by function.
        growth: list[tuple[str, float]] = []
        if before is not None:
            growth.append(("deployed", gpu_used_mib() - before))
        first: list[float] = []
        warm: list[float] = []
        for i in range(n):
            for kind, what in ((first, "first"), (warm, "warm")):
                t = time.monotonic()
                a = client.request(sock, "POST", f"/v1/functions/bench-fn{i}/invoke", b"{}", 300)
                if a.status != 200:
                    raise RuntimeError(f"invoke bench-fn{i}: {a.status} {a.body[:300]!r}")
                kind.append(time.monotonic() - t)
                if before is not None:
                    growth.append((f"bench-fn{i} {what}", gpu_used_mib() - before))
        time.sleep(1.0)
        pids = worker_pids(state)
        used = pss_mib(pids) if cpu else gpu_mib(pids)
        delta = None if before is None else gpu_used_mib() - before
        # After the memory is read: the hand-offs' values are gone by then, but an allocator may
        # keep what they freed.
        # Again once every function has been idle past its memory_release_s (a sandbox gives its
        # functions' request pools back then; a process per function keeps PyTorch's cache).
        time.sleep(IDLE_READ_AFTER_S - 1.0)
        used_idle = pss_mib(pids) if cpu else gpu_mib(pids)
        delta_idle = None if before is None else gpu_used_mib() - before
        if not cpu and used_idle == 0 and delta_idle is not None:
            used_idle = delta_idle
        # What PyTorch's allocator holds in each worker (one function's request asks its worker),
        # after the idle read, so the requests that ask do not count there.
        allocators = None if cpu else [call(sock, f"bench-fn{i}", {"allocator": True}) for i in range(1 if sandbox else n)]
        handoffs = None
        if sandbox and handoff_runs > 0:
            if not cpu:
                # Another sandbox of the tenant (another workflow), for the GPU hand-off between
                # processes; deployed after the memory was read, so it is not counted there.
                (extra,) = write_functions(root / "other", 1, True, mib, cpu)
                spec = (extra / "torpor.toml").read_text()
                (extra / "torpor.toml").write_text(
                    spec.replace('name = "bench-fn0"', 'name = "bench-other"').replace('workflow = "eight"', 'workflow = "other"')
                )
                r = subprocess.run([torpor, "deploy", extra], capture_output=True, text=True, env=env, check=False)
                if r.returncode != 0:
                    raise RuntimeError(f"deploy {extra}: {r.stdout}{r.stderr}")
            handoffs = measure_handoffs(sock, n, cpu, handoff_runs)
        if not cpu and used == 0 and delta is not None:
            # NVML lists no process of the workers' PID namespaces here: the whole GPU's growth.
            used = delta
        return {
            "sandbox": sandbox,
            "workers": len(pids),
            ("host_pss_mib" if cpu else "gpu_mib"): used,
            "gpu_used_delta_mib": delta,
            # The same IDLE_READ_AFTER_S after the last request.
            ("host_pss_mib_idle" if cpu else "gpu_mib_idle"): used_idle,
            "gpu_used_delta_mib_idle": delta_idle,
            "deploy_s": deploy_s,
            "handoff": handoffs,
            "gpu_growth_mib": growth,
            "allocators": allocators,
            "first_invoke_s": first,
            "warm_invoke_s": warm,
        }
    finally:
        stop_daemon(daemon, log, root)


def metric(sock: Path, name: str, tenant: str) -> float:
    text = client.request(sock, "GET", "/metrics", None, 30).body.decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{tenant="{tenant}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure_starts(torpor: Path, pooled: bool, mib: int, cpu: bool, rounds: int) -> list[dict[str, Any]]:
    """`rounds` sandboxed functions, each new to the node (a workflow of its own, so it loads
    alone): deployed, then its first invoke timed (client side), with the live-context pool
    (`pooled`: one ready sandbox per tenant and base, awaited before each invoke through the
    `torpor_sandbox_pool_ready` gauge, which counts a sandbox once warm; the wait is the entry's
    `pool_ready_wait_s`) or without (a restore of its function snapshot)."""
    root = Path(tempfile.mkdtemp(prefix="torpor-sandbox-start-"))
    daemon, log, sock = start_daemon(torpor, root, "split = false\n" + ("[sandbox_pool]\nsize = 1\n" if pooled else ""))
    out = []
    try:
        env = dict(os.environ, TORPOR_SOCKET=str(sock))
        for k in range(rounds):
            (d,) = write_functions(root / f"start{k}", 1, True, mib, cpu)
            spec = (d / "torpor.toml").read_text()
            spec = spec.replace('name = "bench-fn0"', f'name = "bench-start{k}"').replace(
                'workflow = "eight"', f'workflow = "start{k}"'
            )
            (d / "torpor.toml").write_text(spec)
            r = subprocess.run([torpor, "deploy", "--json", d], capture_output=True, text=True, env=env, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"deploy {d}: {r.stdout}{r.stderr}")
            load = next(json.loads(x) for x in r.stdout.splitlines() if '"phase":"load"' in x.replace(" ", ""))
            ready_wait_s = None
            if pooled:
                t = time.monotonic()
                while metric(sock, "torpor_sandbox_pool_ready", "bench") < 1:
                    if time.monotonic() - t > 300:
                        raise RuntimeError(f"no ready sandbox within 300 s; see {root / 'torpord.log'}")
                    time.sleep(0.1)
                ready_wait_s = time.monotonic() - t
            t = time.monotonic()
            a = client.request(sock, "POST", f"/v1/functions/bench-start{k}/invoke", b"{}", 300)
            took = time.monotonic() - t
            if a.status != 200:
                raise RuntimeError(f"invoke bench-start{k}: {a.status} {a.body[:300]!r}")
            out.append({
                "total_s": took,
                "start": a.headers.get("x-torpor-start"),
                # After the deploy: until the pool's sandbox was warm (None without the pool).
                "pool_ready_wait_s": ready_wait_s,
                "timings": json.loads(a.headers.get("x-torpor-timings", "{}")),
                "deploy_setup_s": load.get("setup_s"),
                "deploy_warmup_s": load.get("warmup_s"),
            })
        return out
    finally:
        stop_daemon(daemon, log, root)


def best_ms(runs: list[dict[str, float]] | None, of: Any) -> float | None:
    """The least of `of(run)` over `runs`, in ms; None without runs."""
    return min(of(r) for r in runs) * 1e3 if runs else None


def median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def machine(cpu: bool) -> dict[str, Any]:
    """The device and driver, the kernel, Python, and the binary's commit (scripts/gpu-run.sh sets
    TORPOR_COMMIT from the carried binary's)."""
    device, driver = "cpu", None
    if not cpu:
        device, driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip().splitlines()[0].split(", ")
    return {
        "device": device, "driver": driver, "kernel": platform.release(), "python": platform.python_version(),
        "commit": os.environ.get("TORPOR_COMMIT"), "dirty": bool(os.environ.get("TORPOR_DIRTY")),
    }


def handoff_summary(handoff: dict[str, Any]) -> dict[str, Any]:
    """The summary's hand-off figures (ms, best of the runs): the same object in the sandbox,
    a host memfd, and a CUDA tensor to another sandbox of the tenant (null on the CPU)."""
    other_gpu = handoff["other_sandbox_gpu"]
    return {
        # 100 MiB handed from one function to another in the sandbox (put + get, the same
        # object; on the GPU variant a CUDA tensor).
        "handoff_100mb_ms": best_ms(handoff["same_object"], lambda r: r["put_s"] + r["get_s"]),
        "handoff_100mb_shared_ms": best_ms(handoff["shared_memfd"], lambda r: r["put_s"] + r["get_s"]),
        # A CUDA tensor of 100 MiB put with shared=True in one sandbox and got in another
        # sandbox of the tenant on the same GPU (put + get, and the get alone: a mapping, no
        # copy).
        "handoff_100mb_other_sandbox_ms": best_ms(other_gpu, lambda r: r["put_s"] + r["get_s"]),
        "handoff_100mb_other_sandbox_get_ms": best_ms(other_gpu, lambda r: r["get_s"]),
        # Its median without the first hand-off (which loads the kernels and maps the memory):
        # a steady stream's figure.
        "handoff_100mb_other_sandbox_median_ms": (
            None if not other_gpu else (median([r["put_s"] + r["get_s"] for r in other_gpu[1:] or other_gpu]) or 0) * 1e3
        ),
        # One request to torpord's store from a handler and its answer (median of 50).
        "store_round_trip_ms": (median(handoff["round_trip_s"]) or 0) * 1e3,
    }


def handoff_only(args: argparse.Namespace) -> int:
    """--handoff-only: one sandbox of two functions and one other sandbox, the hand-offs alone."""
    sandbox = one_mode(args.torpor, 2, True, args.weights_mib, args.cpu, args.handoff_runs)
    doc = {
        "summary": handoff_summary(sandbox["handoff"]),
        "machine": machine(args.cpu),
        "settings": {"functions": 2, "weights_mib": args.weights_mib, "cpu": args.cpu, "handoff_runs": args.handoff_runs},
        "sandbox": sandbox,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_doc(doc, args.out or ROOT / "bench" / "results" / f"sandbox-handoff-{'cpu' if args.cpu else 'h100'}.json")
    return 0


def write_doc(doc: dict[str, Any], out: Path) -> None:
    text = json.dumps(doc, indent=2)
    print(text)
    out.write_text(text + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--functions", type=int, default=8)
    ap.add_argument("--weights-mib", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="NumPy functions and host memory (no GPU)")
    ap.add_argument("--torpor", type=Path, default=Path(os.environ.get("TORPOR_BIN", ROOT / "target/release/torpor")))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--start-rounds", type=int, default=3, help="functions new to the node per start mode")
    # 15: a run's first hand-offs map the memory, later ones reuse kept mappings (docs/sandboxes.md,
    # "Kept mappings"); with 3 the median was a mapping one.
    ap.add_argument(
        "--handoff-runs", type=int, default=15, help="hand-offs each way, best and median of them in the summary"
    )
    ap.add_argument(
        "--handoff-only", action="store_true",
        help="only the sandbox's hand-offs (no memory ratio, no starts): summary handoff_* only",
    )
    ap.add_argument(
        "--memory-only", action="store_true",
        help="only the memory of processes against one sandbox (no starts, no hand-offs)",
    )
    args = ap.parse_args()
    if args.handoff_only:
        return handoff_only(args)
    starts: dict[str, list[dict[str, Any]]] = {"pooled": [], "restored": []}
    if not args.memory_only:
        starts = {
            "pooled": measure_starts(args.torpor, True, args.weights_mib, args.cpu, args.start_rounds),
            "restored": measure_starts(args.torpor, False, args.weights_mib, args.cpu, args.start_rounds),
        }
    pooled_runs = [r for r in starts["pooled"] if r["start"] == "pooled"]
    processes = one_mode(args.torpor, args.functions, False, args.weights_mib, args.cpu)
    sandbox = one_mode(args.torpor, args.functions, True, args.weights_mib, args.cpu, 0 if args.memory_only else args.handoff_runs)
    key = "host_pss_mib" if args.cpu else "gpu_mib"
    ratio = processes[key] / sandbox[key] if sandbox[key] else None
    ratio_idle = processes[f"{key}_idle"] / sandbox[f"{key}_idle"] if sandbox[f"{key}_idle"] else None
    doc = {
        "summary": {
            "memory_ratio_8fn" if args.functions == 8 else f"memory_ratio_{args.functions}fn": ratio,
            # The same once every function has been idle past its memory_release_s.
            "memory_ratio_8fn_idle" if args.functions == 8 else f"memory_ratio_{args.functions}fn_idle": ratio_idle,
            "memory": key,
            # A function new to the node: first start into a ready sandbox → first answer
            # (median), against a restore of its function snapshot; its own setup and warm-up.
            "pooled_start_s": median([r["total_s"] for r in pooled_runs]),
            "cold_restore_start_s": median([r["total_s"] for r in starts["restored"]]),
            "pooled_setup_s": median([(r["deploy_setup_s"] or 0) + (r["deploy_warmup_s"] or 0) for r in pooled_runs]),
            "pooled_starts": f"{len(pooled_runs)} of {len(starts['pooled'])}",
            **(handoff_summary(sandbox["handoff"]) if sandbox["handoff"] else {}),
            "small_p99_ratio": None,
            "not_built": "small_p99_ratio: bench/pcie/run.py",
        },
        "machine": machine(args.cpu),
        "settings": {
            "functions": args.functions, "weights_mib": args.weights_mib, "cpu": args.cpu,
            "handoff_runs": 0 if args.memory_only else args.handoff_runs,
        },
        "processes": processes,
        "sandbox": sandbox,
        "starts": starts,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_doc(doc, args.out or ROOT / "bench" / "results" / f"sandbox-{'cpu' if args.cpu else 'h100'}.json")
    print(f"{args.functions} functions: {processes[key]:.0f} MiB as processes, {sandbox[key]:.0f} MiB in one sandbox: "
          f"ratio {ratio if ratio is None else round(ratio, 2)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
