"""GPU warm-up, synchronisation and memory limits for whichever CUDA framework a worker preloads.

The runtime must serve any CUDA framework, not only PyTorch. A worker started with --gpu warms
CUDA through the first framework among its preloads that it knows (torch, jax, cupy, in that
order), so that framework's context, libraries and kernels are in the base snapshot; with none of
them it creates the CUDA context through the driver API (libcuda via ctypes), which every
framework then shares.

Frameworks that reserve most of the GPU up front would turn into snapshots of tens of GB of empty
memory, so before anything is imported the worker turns that off (`prepare_environment`):
JAX/XLA's preallocation (XLA_PYTHON_CLIENT_PREALLOCATE=false). When a function is loaded its
spec's gpu_memory becomes the limit of CuPy's default memory pool (`limit_memory`), which
otherwise keeps every block it ever freed. PyTorch gets no limit: its caching allocator reserves
nothing up front, and a hard limit would turn the spec's estimate into out-of-memory errors.
JAX's limit is fixed when its client starts (in the base, shared by every function), so
XLA_PYTHON_CLIENT_MEM_FRACTION is only set from TORPOR_GPU_MEMORY (with TORPOR_GPU_TOTAL_MEMORY)
when a worker is started with them. A variable the user set is never overridden.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torpor import lanes as torpor_lanes

FRAMEWORKS = ("torch", "jax", "cupy")


def prepare_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the memory defaults frameworks read when they start; returns what was set."""
    target = os.environ if env is None else env
    wanted = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    limit = int(target.get("TORPOR_GPU_MEMORY", "0") or "0")
    total = int(target.get("TORPOR_GPU_TOTAL_MEMORY", "0") or "0")
    if limit > 0 and total > 0:
        wanted["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(limit / total, 1.0):.3f}"
    done = {}
    for key, value in wanted.items():
        if key not in target:
            target[key] = value
            done[key] = value
    return done


def framework() -> str | None:
    """The first known CUDA framework that is imported, or None."""
    return next((name for name in FRAMEWORKS if name in sys.modules), None)


def warm() -> str:
    """Warm CUDA through the imported framework (or the driver); returns which one was used."""
    name = framework()
    if name == "torch":
        # On a thread of its own, joined: the thread's cuBLAS handle goes back to PyTorch's pool
        # when it exits, and the first thread to call cuBLAS next takes it: the main thread of
        # a worker of one function, or a sandbox's first lane (torpor.lanes). Warmed on the main
        # thread, the handle stayed there for ever and a sandbox's lanes made another.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torpor-warm") as once:
            once.submit(_warm_torch, sys.modules["torch"]).result()
    elif name == "jax":
        _warm_jax(sys.modules["jax"])
    elif name == "cupy":
        _warm_cupy(sys.modules["cupy"])
        _WARMED["cupy"] = True
    else:
        Driver.load().warm()
        name = "driver"
    return name


def sync() -> bool:
    """Wait for the GPU work of every framework that initialised CUDA; whether any wait ran."""
    synced = False
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None and cuda.is_initialized():
        cuda.synchronize()
        synced = True
    jax: Any = sys.modules.get("jax")
    if jax is not None and _jax_backend_started(jax):
        jax.effects_barrier()
        for arr in jax.live_arrays():
            arr.block_until_ready()
        synced = True
    cupy: Any = sys.modules.get("cupy")
    if cupy is not None and _cupy_initialised(cupy):
        cupy.cuda.Device().synchronize()
        synced = True
    if Driver.loaded is not None:
        synced = Driver.loaded.sync() or synced
    return synced


def release_pinned_caches() -> int:
    """At the quiet point, after the sync: give back the pinned host memory that frameworks keep
    cached for later copies; returns the bytes of shared anonymous memory that went.

    The CUDA driver makes pinned host memory as shared anonymous mappings, and CRIU restores
    shared memory by copying all of it before the process runs (only private memory can be
    served lazily). PyTorch keeps every pinned block it ever used, rounded up to a power of two:
    a Llama-3.2-3B worker that loaded its weights with safetensors held a 1 GiB block for its
    embedding's copy, and CRIU spent 0.7 of its 1.07 s restore copying it (H100,
    bench/results/split-bench-maps-h100.json, docs/split.md). A freed block holds no data, and
    the next copy that needs one pins it again."""
    before = shared_anonymous_bytes()
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is not None and cuda.is_initialized():
        # Frees only blocks no tensor uses: pinned tensors that are still alive stay.
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()
    cupy: Any = sys.modules.get("cupy")
    if cupy is not None and _cupy_initialised(cupy):
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return max(before - shared_anonymous_bytes(), 0)


def shared_anonymous_bytes(pid: int | str = "self") -> int:
    """Resident bytes of `pid`'s shared anonymous mappings (pinned host memory among them), which
    a CRIU restore copies in full; 0 where /proc cannot be read."""
    total = 0
    shared_anon = False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as smaps:
            for line in smaps:
                head = line.split(maxsplit=6)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    # "lo-hi perms offset dev inode [path]": shared ("s") with no file, or the
                    # kernel's name for shared anonymous memory.
                    name = " ".join(head[5:]) if len(head) > 5 else ""
                    shared_anon = head[1].endswith("s") and (name == "" or name.startswith("/dev/zero"))
                elif shared_anon and head and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except OSError:
        return 0
    return total


CU_LIMIT_STACK_SIZE = 0


def shrink_context() -> bool:
    """At the quiet point, before the driver's checkpoint: the current context's per-thread stack
    limit set to 0. The driver reserves that stack for every GPU thread that can be resident, and
    its checkpoint copies the reservation into the process, where CRIU copies it again on every
    cold start: on the H100, 264 of a GPT-2-Large split worker's 688 MiB residue, and 0.10 s of
    its 0.31 s driver restore (bench/results/residue-h100.json). The driver grows the stack again
    when a kernel needs more; outputs stayed bit-identical there. Whether a context was shrunk
    (False where no framework made one current on this thread)."""
    lib = Driver.loaded.lib if Driver.loaded is not None else _libcuda()
    if lib is None:
        return False
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        return False
    return bool(lib.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(0)) == 0)


def _libcuda() -> ctypes.CDLL | None:
    """The driver this process already uses ($TORPOR_LIBCUDA, else libcuda.so.1), or None."""
    try:
        return ctypes.CDLL(os.environ.get("TORPOR_LIBCUDA") or "libcuda.so.1")
    except OSError:
        return None


def limit_memory(limit: int) -> dict[str, Any]:
    """Make `limit` bytes the memory limit of every imported framework that can take one now."""
    done: dict[str, Any] = {}
    if limit <= 0:
        return done
    cupy: Any = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().set_limit(size=limit)
        done["cupy_pool_limit"] = limit
    return done


def _warm_torch(torch: Any) -> None:
    """Matmul, linear, softmax and conv in fp32 and fp16 so cuBLAS(Lt) and cuDNN initialise."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "--gpu, but torch sees no CUDA device (torch.cuda.is_available() is False); "
            "run on a GPU node or drop --gpu"
        )
    _warm_torch_ops(torch)
    torch.cuda.empty_cache()


def _warm_torch_ops(torch: Any) -> None:
    functional: Any = importlib.import_module("torch.nn.functional")
    dev = torch.device("cuda", torch.cuda.current_device())
    with torch.no_grad():
        for dtype in (torch.float32, torch.float16):
            a = torch.randn(256, 256, device=dev, dtype=dtype)
            bias = torch.randn(256, device=dev, dtype=dtype)
            b = torch.softmax(a @ a, dim=-1)
            c = functional.linear(b, a, bias)
            x = torch.randn(2, 3, 32, 32, device=dev, dtype=dtype)
            w = torch.randn(8, 3, 3, 3, device=dev, dtype=dtype)
            y = functional.conv2d(x, w, padding=1)
            del a, bias, b, c, x, w, y
    torch.cuda.synchronize()


def warm_requests(
    framework_name: str | None,
    on_lane: Callable[[Callable[[], None]], None],
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16"),
) -> int:
    """A ready sandbox of the live-context pool, before it is counted ready: the kernels common
    functions' requests use, loaded into its context on a request's thread and stream, so a
    function loaded into it later does not load them on its first request; returns how many
    op runs it made (0: not torch, or no CUDA).

    Why: CUDA loads a kernel when it is first launched (`CUDA_MODULE_LOADING=LAZY`, PyTorch's
    default), 5-30 ms each on the H100. A pooled function's first request (`torch.ones`, a
    matmul, `tanh`, `sum`) took 45-130 ms against 1.5 ms for the next, nearly all of it in those
    loads (bench/sandbox/first_request.py, bench/results/sandbox-first-request-s32-h100.json);
    loading every kernel of every library at the context's start (`EAGER`) took 6-9 s and 764
    MiB more. A snapshotted worker does not need this: its kernels are in the snapshot. Run by
    `on_lane` on a lane of the sandbox (torpor.lanes) inside `request_stream`, it also leaves that
    lane's stream, handle and workspace made for the first request. It only saves time: an op
    that fails here (a dtype the GPU lacks) ends it with one line on stderr, and the sandbox is
    ready all the same."""
    if framework_name != "torch":
        return 0
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    runs = [0]

    def on_a_request_thread() -> None:
        try:
            prepare_lane("torch")
            with request_stream("torch"):
                runs[0] = _warm_torch_requests(torch, tuple(getattr(torch, d) for d in dtypes))
        except Exception as e:  # an optimisation: its failure is reported, not raised
            print(
                f"torpor worker: loading the common kernels ahead stopped ({type(e).__name__}: {e}); "
                "a function's first request loads what it needs",
                file=sys.stderr,
            )

    on_lane(on_a_request_thread)
    torch.cuda.empty_cache()
    return runs[0]


def _warm_torch_requests(torch: Any, dtypes: tuple[Any, ...]) -> int:
    """Fills, matmuls (the row counts of small batches), the common activations, arithmetic,
    reductions, softmax, layer norm, casts, copies and an embedding, then a vision and an
    attention block (_warm_vision_and_attention), in each of `dtypes`; then one result read
    back. Returns the op runs made."""
    functional: Any = importlib.import_module("torch.nn.functional")
    dev = torch.device("cuda", torch.cuda.current_device())
    n = 0
    with torch.no_grad():
        for dtype in dtypes:
            w = torch.full((1024, 1024), 0.01, device=dev, dtype=dtype)
            bias = torch.zeros(1024, device=dev, dtype=dtype)
            y = w
            for rows in (1, 8, 32, 128, 512):
                x = torch.ones(rows, 1024, device=dev, dtype=dtype)
                y = x @ w
                y = functional.linear(x, w, bias)
                n += 3
            unary = (torch.tanh, torch.relu, functional.gelu, torch.sigmoid, functional.silu, torch.exp)
            for f in unary:
                f(y)
            outs = (
                y + y, y * y, y - bias, y / 2, y * 2, y + 1,
                y.sum(), y.sum(dim=-1), y.mean(dim=-1), y.max(dim=-1), y.argmax(dim=-1),
                torch.softmax(y, dim=-1), functional.layer_norm(y, (1024,)),
                y.float(), y.half(), y.t().contiguous(), torch.cat([y, y]),
                functional.embedding(torch.arange(8, device=dev), w),
            )
            n += len(unary) + len(outs)
            del w, bias, y, outs
            n += _warm_vision_and_attention(torch, functional, dev, dtype)
        float(torch.ones(4, device=dev).sum())
    torch.cuda.synchronize()
    return n + 1


def _warm_vision_and_attention(torch: Any, functional: Any, dev: Any, dtype: Any) -> int:
    """A ResNet stem and bottleneck (convolutions, batch norm, pooling: cuDNN's libraries and
    handle are loaded by the first convolution) and a causal multi-head attention with its
    GPT-style pieces (addmm, pow, topk), in `dtype`; returns the op runs made. Shapes are
    ImageNet's and GPT-2's, whose kernels functions most often ask for first."""
    def full(*shape: int, value: float = 0.01) -> Any:
        return torch.full(shape, value, device=dev, dtype=dtype)

    ran = []  # each op's result, counted at the end
    x = full(1, 3, 224, 224, value=1.0)
    ran.append(y := functional.conv2d(x, full(64, 3, 7, 7), stride=2, padding=3))
    ran.append(y := functional.batch_norm(y, full(64, value=0.0), full(64, value=1.0)))
    ran.append(y := functional.relu(y))
    ran.append(y := functional.max_pool2d(y, 3, stride=2, padding=1))
    ran.append(y := functional.conv2d(y, full(64, 64, 1, 1)))
    ran.append(y := functional.conv2d(y, full(64, 64, 3, 3), padding=1))
    ran.append(y := functional.conv2d(y, full(256, 64, 1, 1)))
    ran.append(functional.adaptive_avg_pool2d(y, 1).flatten(1))
    heads, seq, dim = 20, 16, 64
    h, proj = full(seq, heads * dim, value=1.0), full(heads * dim, 3 * heads * dim)
    ran.append(qkv := torch.addmm(full(3 * heads * dim, value=0.0), h, proj))
    q, k, v = (t.view(1, seq, heads, dim).transpose(1, 2) for t in qkv.split(heads * dim, dim=-1))
    ran.append(att := functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    g = att.transpose(1, 2).reshape(seq, heads * dim)
    ran.append(g := 0.5 * g * (1.0 + torch.tanh(0.79788456 * (g + 0.044715 * torch.pow(g, 3.0)))))
    ran.append(torch.topk(g[-1].float(), 5))
    n = len(ran)
    del x, y, h, proj, qkv, q, k, v, att, g, ran
    return n


def _warm_jax(jax: Any) -> None:
    """A matmul and a softmax on the first GPU, compiled and run."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError as e:
        raise RuntimeError(f"--gpu, but JAX sees no GPU ({e}); install jax[cuda13] or drop --gpu") from None
    jnp: Any = importlib.import_module("jax.numpy")
    x = jax.device_put(jnp.ones((256, 256), dtype=jnp.float32), devices[0])
    y = jax.nn.softmax(x @ x, axis=-1)
    y.block_until_ready()
    del x, y


def _warm_cupy(cupy: Any) -> None:
    """A matmul (cuBLAS) and an elementwise kernel, then the pool's cached blocks are freed."""
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("--gpu, but CuPy sees no CUDA device; run on a GPU node or drop --gpu")
    a = cupy.ones((256, 256), dtype=cupy.float32)
    b = cupy.exp(a @ a / 256.0)
    cupy.cuda.Device().synchronize()
    del a, b
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _jax_backend_started(jax: Any) -> bool:
    try:
        backends = importlib.import_module("jax._src.xla_bridge")._backends
    except (ImportError, AttributeError):
        return True  # unknown layout: waiting is always safe
    return bool(backends)


def _cupy_initialised(cupy: Any) -> bool:
    """Whether CuPy holds GPU memory (asking the runtime for the device could create a context)."""
    try:
        return bool(cupy.get_default_memory_pool().total_bytes() > 0 or _WARMED.get("cupy"))
    except (AttributeError, RuntimeError):  # CuPy's CUDA errors are RuntimeErrors
        return False


_WARMED: dict[str, bool] = {}


class Driver:
    """The CUDA driver API through ctypes: enough to create and keep a primary context."""

    loaded: Driver | None = None

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.context = ctypes.c_void_p()

    @classmethod
    def load(cls) -> Driver:
        path = os.environ.get("TORPOR_LIBCUDA") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(
                f"--gpu without torch, jax or cupy preloaded warms CUDA through the driver, but {path} "
                f"cannot be loaded ({e}); install the NVIDIA driver or drop --gpu"
            ) from None
        cls.loaded = cls(lib)
        return cls.loaded

    def check(self, what: str, code: int) -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            text = name.value.decode() if name.value else "unknown"
            raise RuntimeError(f"{what} failed with {text} ({code}); check `nvidia-smi` or drop --gpu")

    def warm(self) -> None:
        """cuInit, then retain device 0's primary context and make it current."""
        self.check("cuInit", self.lib.cuInit(0))
        count = ctypes.c_int(0)
        self.check("cuDeviceGetCount", self.lib.cuDeviceGetCount(ctypes.byref(count)))
        if count.value < 1:
            raise RuntimeError("--gpu, but the CUDA driver sees no device; run on a GPU node or drop --gpu")
        device = ctypes.c_int(0)
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(device), 0))
        self.check(
            "cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device)
        )
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.context))

    def sync(self) -> bool:
        if not self.context.value:
            return False
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.context))
        self.check("cuCtxSynchronize", self.lib.cuCtxSynchronize())
        return True


@contextlib.contextmanager
def request_stream(framework_name: str | None) -> Iterator[None]:
    """A sandbox's request (torpor.worker runs each on a thread of its own): under torch with
    CUDA initialised, the request's kernels go to a CUDA stream of its own, synchronised before
    its result is sent, so the requests of a sandbox's functions overlap on the GPU while they
    share one context (docs/sandboxes.md). Elsewhere it does nothing."""
    if framework_name != "torch":
        yield
        return
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        yield
        return
    lane = torpor_lanes.current()
    if lane is not None:
        # A lane keeps its stream (and so its cuBLAS handle's one workspace) for every job.
        if lane.stream is None:
            lane.stream = lane_stream(torch)
        stream = lane.stream
    else:
        stream = _take_stream(torch)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        try:
            stream.synchronize()
        finally:
            if lane is None:
                _give_stream(stream)


def prepare_lane(framework_name: str | None) -> None:
    """On a lane (torpor.lanes), before a function's memory pool routes the thread's
    allocations: under torch with CUDA initialised, the lane's stream, and cuBLAS's handle for
    the thread and its workspace for that stream, made now where they are not (the lane's first
    job, or after clear_blas_workspaces). Made inside a request's pool, the workspace (32 MiB on
    Hopper) would land in that pool, whose idle release could then not give its segment back.
    Elsewhere it does nothing."""
    lane = torpor_lanes.current()
    torch: Any = sys.modules.get("torch")
    if framework_name != "torch" or lane is None or torch is None or not torch.cuda.is_initialized():
        return
    if lane.stream is None:
        lane.stream = lane_stream(torch)
    with torch.cuda.stream(lane.stream):
        torch.cuda.current_blas_handle()


CU_STREAM_NON_BLOCKING = 1


def lane_stream(torch: Any) -> Any:
    """A CUDA stream for a lane: made by the driver (`cuStreamCreate`, non-blocking, as PyTorch's
    own streams are) and wrapped as a `torch.cuda.ExternalStream`. Why not `torch.cuda.Stream()`:
    the first one a process asks for makes PyTorch's whole stream pool (32 streams a priority
    level), which held 70 MiB of GPU memory on the H100 for a sandbox that uses one stream a
    lane (bench/sandbox/handle_cost.py, bench/results/sandbox-handle-cost-s38-torchstream-h100.json). Where
    the driver cannot make one, PyTorch's is used, with one line on stderr."""
    from torpor import cuda_driver

    device = torch.cuda.current_device()
    try:
        with cuda_driver.on_device(device, keep=True) as cuda:
            handle = ctypes.c_void_p()
            code = cuda.cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
            if code != 0 or not handle.value:
                raise cuda_driver.DriverError(f"cuStreamCreate failed with code {code}")
        return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", device))
    except (cuda_driver.DriverError, OSError, AttributeError) as e:
        print(
            f"torpor worker: a lane's stream from PyTorch's pool instead of the driver ({e}); "
            "the pool holds about 70 MiB more GPU memory",
            file=sys.stderr,
        )
        return torch.cuda.Stream()


def clear_blas_workspaces() -> bool:
    """Frees PyTorch's cuBLAS(Lt) workspaces (one per handle and stream it was used on; their
    memory stays in PyTorch's cache), where torch has CUDA initialised; whether it ran. Called
    once, when a worker becomes a sandbox: the boot's warm-up left a workspace for the default
    stream, which a sandbox's lanes never use (they run on streams of their own). Only when no
    request runs: a workspace freed under a running cuBLAS call would be reused under it."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    torch.cuda.synchronize()
    clear()
    return True


# The request streams not in use, the last one given back on top, for request_stream on a thread
# that is not a lane (a sandbox's requests run on lanes, which keep a stream each): PyTorch keeps
# a cuBLAS workspace per (handle, stream) for the life of the process, so a new stream per thread
# would grow the process by a workspace (32 MiB on Hopper) every time.
_free_streams: list[Any] = []
_streams_lock = threading.Lock()


def _take_stream(torch: Any) -> Any:
    with _streams_lock:
        if _free_streams:
            return _free_streams.pop()
    return lane_stream(torch)


def _give_stream(stream: Any) -> None:
    with _streams_lock:
        _free_streams.append(stream)
