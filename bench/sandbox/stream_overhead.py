"""What a sandbox's request threads and streams cost on the GPU beyond the functions' weights
(issue 11, "Measure"; docs/sandboxes.md). On the H100 the sandbox of bench/sandbox/run.py holds
~170 MiB more than one context plus eight functions' weights; this probe takes the suspects apart
in one process per variant, without torpord.

Each variant is a child process (so that its environment, e.g. CUBLAS_WORKSPACE_CONFIG, applies
before torch is imported). A child warms CUDA as a worker does (torpor.gpu.warm: main thread,
default stream), then for k = 1..N adds function k (the bench's function: 64 MiB of weights as
16 fp32 1024x1024 tensors made on the main thread, default stream) and runs its request
(x = ones(8, 1024); x = tanh(x @ w) for every w) the variant's way, and records after each step
NVML's memory of the process, torch.cuda.memory_reserved/allocated and the allocator's live
blocks that are not weights (cuBLAS workspaces show up there: 32 MiB each on Hopper):

- live:    request k on a new thread with a new stream; every thread stays alive to the end
           (N handles, N streams: N concurrent requests). Recorded in three phases per thread:
           stream made, first non-cuBLAS kernel on it, request (cuBLAS).
- exit:    request k on a new thread with a new stream, the thread joined (handles are given
           back at thread exit and reused; streams are new: Torpor before session 16).
- shared:  request k on a new thread, every thread on one shared non-default stream, joined.
- torpor:  Torpor's own code as torpor/worker.py's _request_thread runs it: a FunctionPool per
           function (torpor.mempool, the request inside torch.cuda.use_mem_pool) around
           torpor.gpu.request_stream, two requests per function (the bench's first and warm),
           each on a new thread that is not joined: the next starts --gap-ms after the previous
           one "sent its result" (set an event), as the next invoke reaches the worker while the
           previous thread may still be exiting. At the end the pools are released (what
           memory_release_s does).
- torpor_joined: the same, each thread joined before the next starts.

After the last step: torch.cuda.empty_cache(), then torch._C._cuda_clearCublasWorkspaces() (where
torch has it) and empty_cache() again, each recorded. Each function's output is hashed (sha256 of
its bytes) on its request thread and again on the main thread's default stream (a function in a
process of its own), so the JSON says whether a variant changes any output bit.

    python3 bench/sandbox/stream_overhead.py [--out FILE] [--variants default-live,ws4096x1-shared,...]
                                             [--functions 8] [--weights-mib 64] [--jobs 3]

Exits 2 with one line on stderr where there is no GPU (no nvidia-smi, no torch, or torch sees no
CUDA device); 1 if a variant failed; 0 otherwise. About 20-30 s on an H100 with --jobs 3.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import gpu_mib, gpu_used_mib  # noqa: E402  (bench/sandbox/run.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MIB = 1 << 20
WIDTH = 1024
NO_GPU_EXIT = 2

MODES = ("live", "exit", "shared", "torpor", "torpor_joined")
ENVS: dict[str, dict[str, str]] = {
    "default": {},
    # 4 MiB: one 4096 KiB chunk (the format is ":SIZE_KiB:COUNT", repeated; the sum is the size).
    "ws4096x1": {"CUBLAS_WORKSPACE_CONFIG": ":4096:1"},
    # 128 KiB: the smaller of the two configurations torch accepts for deterministic algorithms.
    "ws16x8": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
    # cuBLASLt on the cuBLAS workspace instead of one (1 MiB by default) of its own per pair.
    "unifiedlt": {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"},
}
DEFAULT_VARIANTS = (
    "default-live",
    "default-exit",
    "default-shared",
    "default-torpor",
    "default-torpor_joined",
    "unifiedlt-live",
    "ws4096x1-live",
    "ws4096x1-shared",
    "ws4096x1-torpor",
    "ws16x8-live",
)


class NoGpu(Exception):
    """There is no GPU to probe: one line, exit 2."""


# -- measuring (both sides) ------------------------------------------------------------------


def chosen_workspace_bytes(env: dict[str, str], sm90: bool) -> int:
    """PyTorch's cuBLAS workspace per (handle, stream) for `env` (aten CublasHandlePool.cpp,
    parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT" pairs summed, else
    32 MiB on sm_90 and 8 MiB + 128 KiB elsewhere."""
    default = 4096 * 8 * 1024 if sm90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default


# -- the child: one variant in one process ---------------------------------------------------


@dataclass
class Probe:
    torch: Any
    pid: int
    weights_bytes: int = 0
    weight_ptrs: set[int] = field(default_factory=set)
    steps: list[dict[str, Any]] = field(default_factory=list)
    nvml_visible: bool = True
    used_before: float = 0.0

    def record(self, label: str, k: int, **extra: Any) -> dict[str, Any]:
        torch = self.torch
        torch.cuda.synchronize()
        # 0: nvidia-smi does not list the process (a PID namespace it cannot see into); a
        # process with a CUDA context always holds some memory.
        nvml = gpu_mib([self.pid]) or None
        if nvml is None:
            self.nvml_visible = False
            nvml = gpu_used_mib() - self.used_before
        active: collections.Counter[int] = collections.Counter()
        by_stream: dict[str, list[int]] = {}
        by_pool: dict[str, int] = {}
        for seg in torch.cuda.memory_snapshot():
            stream = str(seg.get("stream", 0))
            entry = by_stream.setdefault(stream, [0, 0])
            entry[0] += 1
            entry[1] += int(seg["total_size"])
            pool = ",".join(str(x) for x in seg.get("segment_pool_id", (0, 0)))
            by_pool[pool] = by_pool.get(pool, 0) + int(seg["total_size"])
            for block in seg.get("blocks", []):
                if block.get("state") == "active_allocated" and int(block["address"]) not in self.weight_ptrs:
                    active[int(block["size"])] += 1
        step = {
            "label": label,
            "k": k,
            "nvml_mib": nvml,
            "reserved_mib": torch.cuda.memory_reserved() / MIB,
            "allocated_mib": torch.cuda.memory_allocated() / MIB,
            "weights_mib": self.weights_bytes / MIB,
            # Live blocks that are not weights, by size in bytes: cuBLAS(Lt) workspaces, outputs.
            "non_weight_blocks": {str(size): n for size, n in sorted(active.items())},
            # Segments and bytes per stream (the allocator never serves one stream's cached
            # blocks to another) and bytes per pool (a MemPool's id, "0,0" the default pool).
            "segments_by_stream": {s: {"segments": v[0], "mib": v[1] / MIB} for s, v in by_stream.items()},
            "pool_mib": {p: v / MIB for p, v in by_pool.items()},
            **extra,
        }
        self.steps.append(step)
        return step


def sha(torch: Any, x: Any) -> str:
    data = bytes(x.detach().to("cpu").contiguous().view(torch.uint8).flatten().tolist())
    return hashlib.sha256(data).hexdigest()


def make_function(torch: Any, k: int, mib: int) -> list[Any]:
    """The bench's function's setup(): `mib` MiB of fp32 1024x1024 layers (seeded by k)."""
    torch.manual_seed(1000 + k)
    layers = max(1, mib * MIB // (4 * WIDTH * WIDTH))
    return [torch.randn(WIDTH, WIDTH, device="cuda") / 32 for _ in range(layers)]


def request(torch: Any, layers: list[Any]) -> Any:
    """The bench's function's __call__ (its output tensor instead of its sum)."""
    x = torch.ones(8, WIDTH, device="cuda")
    for w in layers:
        x = torch.tanh(x @ w)
    return x


def child(spec: dict[str, Any]) -> dict[str, Any]:
    mode, n, mib, gap_s = spec["mode"], int(spec["functions"]), int(spec["weights_mib"]), spec["gap_ms"] / 1e3
    t_start = time.perf_counter()
    try:
        import torch
    except ImportError as e:
        raise NoGpu(f"torch cannot be imported ({e})") from None
    if not torch.cuda.is_available():
        raise NoGpu(f"torch {torch.__version__} sees no CUDA device")
    sys.path.insert(0, str(ROOT / "python"))
    from torpor import gpu as torpor_gpu
    from torpor import mempool as torpor_mempool

    probe = Probe(torch, os.getpid(), used_before=gpu_used_mib())
    import_s = time.perf_counter() - t_start
    assert torpor_gpu.warm() == "torch"  # the worker's --gpu warm-up: main thread, default stream
    props = torch.cuda.get_device_properties(0)
    sm90 = (props.major, props.minor) == (9, 0)
    ws_bytes = chosen_workspace_bytes(dict(os.environ), sm90)
    probe.record("warm", 0)

    functions: list[list[Any]] = []
    shas: dict[int, list[str]] = {}
    peaks: dict[int, list[int]] = {}
    pools: list[Any] = []
    threads: list[threading.Thread] = []
    timers: list[threading.Timer] = []
    release = threading.Event()
    shared_stream = torch.cuda.Stream() if mode == "shared" else None
    errors: list[BaseException] = []

    def guarded(body: Any) -> Any:
        def run(*args: Any) -> None:
            try:
                body(*args)
            except BaseException as e:  # noqa: BLE001 (reported by the main thread)
                errors.append(e)

        return run

    def wait(ev: threading.Event) -> None:
        """Until `ev`, a request thread's error (raised here) or 60 s."""
        deadline = time.monotonic() + 60
        while not ev.wait(0.01):
            if errors:
                raise errors[0]
            if time.monotonic() > deadline:
                raise TimeoutError("a request thread did not answer within 60 s")

    def one(k: int, stream: Any) -> None:
        with torch.cuda.stream(stream):
            out = request(torch, functions[k - 1])
            shas.setdefault(k, []).append(sha(torch, out))
        stream.synchronize()

    for k in range(1, n + 1):
        if mode.startswith("torpor"):
            pool = torpor_mempool.FunctionPool(f"fn{k}", torpor_mempool.backend_for("torch"))
            with pool.setup():
                functions.append(make_function(torch, k, mib))
            pools.append(pool)
        else:
            functions.append(make_function(torch, k, mib))
        for w in functions[-1]:
            probe.weight_ptrs.add(int(w.data_ptr()))
            probe.weights_bytes += int(w.numel() * w.element_size())
        probe.record("setup", k)
        t0 = time.perf_counter()
        if mode == "live":
            made, ran_plain, go_plain, go_request, done = (threading.Event() for _ in range(5))

            def live(k: int, made: threading.Event, go_plain: threading.Event, ran_plain: threading.Event,
                     go_request: threading.Event, done: threading.Event) -> None:
                stream = torch.cuda.Stream()
                stream.synchronize()
                made.set()
                go_plain.wait()
                with torch.cuda.stream(stream):
                    keep = torch.tanh(torch.ones(8, WIDTH, device="cuda"))  # an allocation, no cuBLAS
                stream.synchronize()
                ran_plain.set()
                go_request.wait()
                one(k, stream)
                done.set()
                release.wait()
                del keep

            t = threading.Thread(
                target=guarded(live), args=(k, made, go_plain, ran_plain, go_request, done), daemon=True
            )
            t.start()
            threads.append(t)
            wait(made)
            probe.record("stream", k)
            go_plain.set()
            wait(ran_plain)
            probe.record("plain_kernel", k)
            go_request.set()
            wait(done)
        elif mode in ("exit", "shared"):

            def short(k: int) -> None:
                one(k, shared_stream if shared_stream is not None else torch.cuda.Stream())

            t = threading.Thread(target=guarded(short), args=(k,))
            t.start()
            t.join(60)
        else:
            pool = pools[k - 1]
            for _ in range(2):  # the bench's first and warm invoke of each function
                sent = threading.Event()

                def torpor_request(k: int, pool: Any, sent: threading.Event) -> None:
                    # torpor/worker.py _request_thread: the pool's scope around request_stream.
                    with pool.request() as used:
                        with torpor_gpu.request_stream("torch"):
                            out = request(torch, functions[k - 1])
                            shas.setdefault(k, []).append(sha(torch, out))
                            del out
                    peaks.setdefault(k, []).append(int(used["peak"]))
                    sent.set()  # send_result: the daemon may send the next invoke now
                    timer = threading.Timer(3600.0, lambda: None)  # _ended's release timer
                    timer.daemon = True
                    timer.start()
                    timers.append(timer)

                t = threading.Thread(target=guarded(torpor_request), args=(k, pool, sent), daemon=True)
                t.start()
                if mode == "torpor_joined":
                    t.join(60)
                else:
                    wait(sent)
                    time.sleep(gap_s)
        if errors:
            raise errors[0]
        probe.record("request", k, request_s=time.perf_counter() - t0, threads_alive=threading.active_count())

    for timer in timers:
        timer.cancel()
    if pools:
        for pool in pools:
            pool.release()  # keepalive.memory_release_s: the request pools given back
        probe.record("pools_released", n)
    torch.cuda.empty_cache()
    probe.record("emptied", n)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
        probe.record("workspaces_cleared", n)
        torch.cuda.empty_cache()
        probe.record("workspaces_cleared_emptied", n)
    release.set()
    for t in threads:
        t.join(60)
    # Each function's request on the main thread's default stream: a function in a process of its own.
    main_shas = {k: sha(torch, request(torch, functions[k - 1])) for k in range(1, n + 1)}
    torch.cuda.synchronize()
    return {
        "variant": spec["name"],
        "mode": mode,
        "env": spec["env"],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "preferred_blas": str(getattr(torch.backends.cuda, "preferred_blas_library", lambda: None)()),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "workspace_bytes": ws_bytes,
        "has_clear_cublas_workspaces": clear is not None,
        "torch_c_workspace_names": sorted(x for x in dir(torch._C) if "ublas" in x.lower() or "workspace" in x.lower()),
        "nvml_pid_visible": probe.nvml_visible,
        "import_s": import_s,
        "total_s": time.perf_counter() - t_start,
        "steps": probe.steps,
        "request_shas": {str(k): v for k, v in shas.items()},
        "main_thread_shas": {str(k): v for k, v in main_shas.items()},
        "pool_peaks_bytes": {str(k): v for k, v in peaks.items()},
    }


# -- the parent: variants, summary -----------------------------------------------------------


def summarise(doc: dict[str, Any], weights_mib: int) -> dict[str, Any]:
    steps = doc["steps"]
    req = {s["k"]: s for s in steps if s["label"] == "request"}
    warm = next(s for s in steps if s["label"] == "warm")
    last = max(req)
    per_fn = (req[last]["nvml_mib"] - req[1]["nvml_mib"]) / (last - 1) if last > 1 else None
    ws = doc["workspace_bytes"]
    final = req[last]
    by_label = {s["label"]: s for s in steps}
    setup = {s["k"]: s for s in steps if s["label"] == "setup"}
    out: dict[str, Any] = {
        # Function k's request step alone (its weights already made): what a request adds.
        "request_growth_mib_by_k": [req[k]["nvml_mib"] - setup[k]["nvml_mib"] for k in sorted(req)],
        # Function k's setup alone: its weights as the allocator rounds them (64 MiB ideal).
        "setup_growth_mib_by_k": [
            setup[k]["nvml_mib"] - (req[k - 1] if k > 1 else warm)["nvml_mib"] for k in sorted(setup)
        ],
        "nvml_warm_mib": warm["nvml_mib"],
        "nvml_final_mib": final["nvml_mib"],
        # Each function after the first: its request step's growth, less its weights.
        "overhead_per_extra_function_mib": None if per_fn is None else per_fn - weights_mib,
        "overhead_first_function_mib": req[1]["nvml_mib"] - warm["nvml_mib"] - weights_mib,
        "nvml_minus_reserved_growth_mib": (final["nvml_mib"] - final["reserved_mib"])
        - (warm["nvml_mib"] - warm["reserved_mib"]),
        "workspace_sized_blocks_final": final["non_weight_blocks"].get(str(ws), 0),
        "streams_with_segments_final": len(final["segments_by_stream"]),
    }
    phases = {(s["label"], s["k"]): s["nvml_mib"] for s in steps}
    if ("stream", 1) in phases:
        # live: what a new thread's stream, its first allocation and kernel (no cuBLAS), and its
        # first cuBLAS call (a handle, its workspace) each add, mean over k (MiB).
        ks = sorted(req)
        out["live_phase_growth_mib"] = {
            "stream": sum(phases[("stream", k)] - phases[("setup", k)] for k in ks) / len(ks),
            "plain_kernel": sum(phases[("plain_kernel", k)] - phases[("stream", k)] for k in ks) / len(ks),
            "cublas_request": sum(phases[("request", k)] - phases[("plain_kernel", k)] for k in ks) / len(ks),
        }
    if doc["pool_peaks_bytes"]:
        # torpor: each request's peak as its FunctionPool reports it to torpord (MiB); a
        # workspace made inside a function's pool shows up in that function's peak.
        out["pool_peaks_mib"] = {k: [b / MIB for b in v] for k, v in doc["pool_peaks_bytes"].items()}
    for label in ("pools_released", "emptied", "workspaces_cleared_emptied"):
        if label in by_label:
            out[f"nvml_{label}_mib"] = by_label[label]["nvml_mib"]
    shas = doc["request_shas"]
    out["outputs_same_on_every_thread_and_main"] = all(
        len(set(shas.get(k, [])) | {doc["main_thread_shas"][k]}) == 1 for k in doc["main_thread_shas"]
    )
    return out


def run_child(name: str, args: argparse.Namespace) -> tuple[int, dict[str, Any] | None, str]:
    env_name, mode = name.split("-", 1)
    if env_name not in ENVS or mode not in MODES:
        raise SystemExit(f"unknown variant {name!r}: ENV-MODE with ENV in {sorted(ENVS)} and MODE in {MODES}")
    env = dict(os.environ)
    for key in ("CUBLAS_WORKSPACE_CONFIG", "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "CUBLASLT_WORKSPACE_SIZE"):
        env.pop(key, None)
    env.update(ENVS[env_name])
    spec = {
        "name": name,
        "mode": mode,
        "env": ENVS[env_name],
        "functions": args.functions,
        "weights_mib": args.weights_mib,
        "gap_ms": args.gap_ms,
    }
    try:
        r = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=args.timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return 1, None, f"{name}: timed out after {args.timeout_s} s"
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines:
        return 0, json.loads(lines[-1]), r.stderr
    return r.returncode, None, (r.stderr.strip().splitlines() or [f"{name}: exit {r.returncode}"])[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sandbox-stream-overhead.json")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated ENV-MODE names")
    ap.add_argument("--functions", type=int, default=8)
    ap.add_argument("--weights-mib", type=int, default=64)
    ap.add_argument("--gap-ms", type=float, default=0.5, help="torpor mode: result sent -> next request thread")
    ap.add_argument("--jobs", type=int, default=3, help="variants at once (1 where NVML cannot see this PID)")
    ap.add_argument("--timeout-s", type=float, default=50.0, help="per variant")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        try:
            doc = child(json.loads(args.child))
        except NoGpu as e:
            print(f"stream_overhead: no GPU: {e}", file=sys.stderr)
            return NO_GPU_EXIT
        print(json.dumps(doc))
        return 0

    if args.functions < 2:
        ap.error("--functions must be at least 2")
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode != 0:
        print("stream_overhead: no GPU: nvidia-smi is missing or lists no device; run this on the GPU machine", file=sys.stderr)
        return NO_GPU_EXIT
    if importlib.util.find_spec("torch") is None:
        print(f"stream_overhead: no GPU: torch is not importable by {sys.executable}", file=sys.stderr)
        return NO_GPU_EXIT
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    failed: dict[str, str] = {}

    def take(name: str, rc: int, doc: dict[str, Any] | None, err: str) -> None:
        if rc == NO_GPU_EXIT:
            print(err, file=sys.stderr)
            raise SystemExit(NO_GPU_EXIT)
        if doc is None:
            failed[name] = err
        else:
            results[name] = doc

    # The first alone: it says whether NVML sees our PIDs (else only one variant at a time is
    # meaningful: the fallback is the whole GPU's memory).
    take(names[0], *run_child(names[0], args))
    jobs = args.jobs if results.get(names[0], {}).get("nvml_pid_visible", True) else 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        futures = {ex.submit(run_child, name, args): name for name in names[1:]}
        for f in concurrent.futures.as_completed(futures):
            take(futures[f], *f.result())

    summary = {name: summarise(doc, args.weights_mib) for name, doc in results.items()}
    # Outputs across variants: function k's output hash, the same everywhere?
    by_fn: dict[str, set[str]] = {}
    for doc in results.values():
        for k, hashes in doc["request_shas"].items():
            by_fn.setdefault(k, set()).update(hashes)
            by_fn[k].add(doc["main_thread_shas"][k])
    any_doc: dict[str, Any] = next(iter(results.values()), {})
    out: dict[str, Any] = {
        "summary": {
            "variants": summary,
            "outputs_bit_identical_across_variants": all(len(v) == 1 for v in by_fn.values()) if by_fn else None,
            "distinct_outputs_per_function": {k: len(v) for k, v in sorted(by_fn.items())},
            "failed": failed,
        },
        "machine": {
            "device": any_doc.get("device"),
            "torch": any_doc.get("torch"),
            "cuda": any_doc.get("cuda"),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "settings": {"functions": args.functions, "weights_mib": args.weights_mib, "gap_ms": args.gap_ms, "jobs": jobs},
        "variants": results,
        "wall_s": time.perf_counter() - t0,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for name in names:
        s = summary.get(name)
        if s is None:
            print(f"{name:24} FAILED: {failed.get(name)}", file=sys.stderr)
            continue
        print(
            f"{name:24} warm {s['nvml_warm_mib']:7.0f}  final {s['nvml_final_mib']:7.0f} MiB  "
            f"first fn +{s['overhead_first_function_mib']:6.1f}  each further fn +{s['overhead_per_extra_function_mib']:6.1f} MiB over weights  "
            f"ws blocks {s['workspace_sized_blocks_final']}  cleared+emptied {s.get('nvml_workspaces_cleared_emptied_mib')}  "
            f"same bits {s['outputs_same_on_every_thread_and_main']}",
            file=sys.stderr,
        )
    print(
        f"outputs bit-identical across variants: {out['summary']['outputs_bit_identical_across_variants']}; "
        f"{out['wall_s']:.1f} s; {args.out}",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
