"""Per-function memory pools inside a sandbox (issue 11 item 2, docs/sandboxes.md, "The memory
pool"): what each function of a sandbox holds, what one of its requests needs at its peak, and
its idle memory given back.

Each function loaded into a worker gets a `FunctionPool`. It measures, and reports to torpord:

- `resident`: what the function holds after setup() (its weights);
- `request_peak`: the most one request needed above that, first from the warm-up request at
  deploy (torpord keeps it as the function's memory model and admits a request into a sandbox
  only where that much is free), then from every request (a larger one raises the model);
- `pool`: what the function's request pool holds now (in use and cached);

and gives the pool's memory back when the function has been idle for the spec's
`keepalive.memory_release_s`.

Two backends, one per kind of device memory:

- **cuda (PyTorch).** `torch.cuda.MemPool`s of the function's own, one per request running at
  once (a request takes an idle one, or makes one; kept for later requests); each request
  thread (and the warm-up) allocates through its pool (`torch.cuda.use_mem_pool`, which routes
  the current thread's allocations), so a function's activations are apart from the others' and
  from the weights setup() made in the default pool. One pool per running request, not one per
  function: PyTorch lets one thread at a time route a pool's allocations, and a second raises
  (pytorch/pytorch#152861; found in session 34, where three of four concurrent requests of a
  sandboxed ResNet-152 were left unanswered). `pool` is the sum of the pools' segments
  (the allocator's snapshot, counted only while no other scope is active: PyTorch's snapshot
  beside another thread's pool work killed workers). At idle the pools are dropped: a
  MemPool's destruction empties its own cached blocks (and only those: after a split restore
  the rest of the cache may hold segments torpord handed over, which only a snapshot's quiet
  point may give back, `empty_cache()`); the next request makes a new one. No pool is emptied
  while any thread routes to a pool or captures a graph (`AllocatorGate`). Why this and not
  `empty_cache()` alone: the caching allocator keeps every block a request freed, and
  `empty_cache()` frees the cached blocks of every function at once (the busy ones' too,
  which then pay cudaMalloc again); a pool per function frees exactly the idle function's
  blocks, and measures them (the allocator's global counters cannot say whose a block is).
  Why not a pool per request: a request would pay cudaMalloc for its activations every time.
  Measured on the GPU machine by bench/sandbox/run.py (`pool_release` in its JSON).
- **host (CPU functions; the host backend of docs/split.md).** Host memory has no caching
  allocator to attribute, so the pool is the function's own: `torpor.scratch(nbytes)` returns a
  writable NumPy array (a ctypes array without NumPy) from the calling function's pool, which
  caches the blocks of arrays that died for the next request, exactly as the CUDA allocator
  does, and frees them at idle. Its figures are the bytes of the blocks it holds, so the daemon's
  admission is driven by what the worker really allocated (tests/daemon/test_daemon_sandbox_memory.py).

Only a sandbox's functions run their warm-up and requests in their pools (admission is a
sandbox's question): a function in a worker of its own allocates as before (its CUDA memory in
PyTorch's default pool, `torpor.scratch` plain memory), and only its `resident` is measured.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

# The pool of the function whose request (or load) runs on this thread.
_current = threading.local()


class AllocatorGate:
    """When PyTorch's caching allocator may empty a pool (a MemPool dropped, empty_cache()).

    Emptying it while any thread routes its allocations to a pool (`use_mem_pool`: every
    request of a sandboxed function) or captures a CUDA graph aborts the whole process: an
    internal assert (`captures_underway.empty()` in synchronize_and_free_events) that found
    in session 36 (tests/sdk/test_sdk_graphs_gpu.py), one function's idle release beside another
    function's request. So request scopes and captures count as `active`, and an empty runs only
    when none is: `try_exclusive` never waits (callers hold the worker's memory lock, and a
    request may be waiting for the worker's main loop), and holds new scopes back only for the
    empty itself; a caller it refuses asks `when_idle` to be called back once the last scope
    ends, and tries again then."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._waiting: list[Any] = []

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Around a pool's routing (a request) or a capture: no empty runs meanwhile."""
        with self._cond:
            self._cond.wait_for(lambda: not self._closed)
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                callbacks = self._waiting if self._active == 0 else []
                if callbacks:
                    self._waiting = []
            for callback in callbacks:
                callback()

    @contextlib.contextmanager
    def try_exclusive(self) -> Iterator[bool]:
        """Yields True, new scopes held back until the block ends, if no scope is active now;
        else False at once."""
        with self._cond:
            ok = self._active == 0 and not self._closed
            if ok:
                self._closed = True
        try:
            yield ok
        finally:
            if ok:
                with self._cond:
                    self._closed = False
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive_within(self, timeout_s: float, step_s: float = 0.01) -> Iterator[bool]:
        """`try_exclusive`, tried again every `step_s` until it holds or `timeout_s` passed: for
        a caller that holds no lock a request waits for (weight packing at a load, which may
        meet another function's idle release or a request ending)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.try_exclusive() as ok:
                if ok or time.monotonic() >= deadline:
                    yield ok
                    return
            time.sleep(step_s)

    def when_idle(self, callback: Any) -> None:
        """Calls `callback` (on the thread whose scope ends last; keep it short) once no scope
        is active, or now if none is."""
        with self._cond:
            if self._active:
                self._waiting.append(callback)
                return
        callback()


# The worker's one gate: PyTorch's allocator is one per process.
GATE = AllocatorGate()

# The private pools the harness made, by id (`MemPool.id`, `CUDAGraph.pool()`), and the function
# each belongs to (None: made outside any function's setup or request). Kept after the pool
# object goes: a segment outlives its MemPool while a block in it lives (a cuBLAS workspace a
# lane's first matmul took in a request pool), and the allocator's snapshot still names the id.
# torpor.pack reads it: in a sandbox, the pools of the functions loaded earlier are not the
# newcomer's, so they do not stop its weights being packed.
_POOL_OWNERS: dict[tuple[int, int], str | None] = {}
_POOL_OWNERS_LOCK = threading.Lock()
# What a request pool is noted as (no function name holds a NUL), and what an unknown pool is.
REQUEST_POOL = "\0request"
_UNKNOWN: Any = object()


def pool_key(pool_id: Any) -> tuple[int, int]:
    """A private pool's id as PyTorch gives it (`MemPool.id`, `CUDAGraph.pool()`, a snapshot
    segment's `segment_pool_id`) as a key; (0, 0) is the default pool."""
    first, second = pool_id
    return (int(first), int(second))


def note_pool(pool_id: Any, owner: str | None) -> None:
    """Records a private pool the harness made (a request pool, a torpor.graphed capture's) as
    `owner`'s."""
    with _POOL_OWNERS_LOCK:
        _POOL_OWNERS[pool_key(pool_id)] = owner


def current_function() -> str | None:
    """The function whose setup() or request runs on this thread (None outside one)."""
    pool = getattr(_current, "pool", None)
    return pool.name if pool is not None else None


def possible_captures(pool_ids: set[tuple[int, int]], function: str | None) -> set[tuple[int, int]]:
    """Those of `pool_ids` that may hold a CUDA graph capture of `function`'s: all but the
    request pools (a request's activations and workspaces, never a capture) and the captures
    the harness made for another function. A pool the harness did not make (a MemPool or a
    graph of the function's own) counts, and so does a capture of no known function, since
    nothing says it is not `function`'s; with `function` None every capture counts."""
    with _POOL_OWNERS_LOCK:
        owners = dict(_POOL_OWNERS)
    out: set[tuple[int, int]] = set()
    for pool_id in pool_ids:
        owner = owners.get(pool_id, _UNKNOWN)
        if owner == REQUEST_POOL:
            continue
        if owner is _UNKNOWN or owner is None or function is None or owner == function:
            out.add(pool_id)
    return out


# What release() returns when it could not run now (another request or a capture was in a
# pool): nothing was given back; ask GATE.when_idle to call back and try again.
DEFERRED = -1


class FunctionPool:
    """One function's memory in its worker (see the module doc)."""

    def __init__(self, name: str, backend: str) -> None:
        self.name = name
        self.backend = backend  # "cuda" or "host"
        self.resident = 0
        self.request_peak = 0
        self.in_flight = 0
        self.lock = threading.Lock()
        # host: blocks held (live or cached) by size, and the cached ones ready for reuse.
        self._held = 0
        self._live = 0
        self._peak_live = 0
        self._cache: dict[int, list[Any]] = {}
        # cuda: the request pools, one per request running at once (none until a request needs
        # one, and after a release), and those no request uses now. One pool per running request
        # because PyTorch routes a pool's allocations for one thread at a time: a second thread
        # entering use_mem_pool on it raises "already recording to mempool_id"
        # (pytorch/pytorch#152861), which left concurrent requests of a function unanswered.
        self._torch_pools: list[Any] = []
        self._torch_idle: list[Any] = []
        # The pools' bytes when last counted (pool_bytes: only while no other scope is active).
        self._torch_bytes = 0

    # -- what the daemon is told ------------------------------------------------------------

    def pool_bytes(self) -> int:
        if self.backend == "cuda":
            with self.lock:
                pools = list(self._torch_pools)
            # A snapshot beside another thread's pool empty killed the worker (SIGSEGV in
            # memory_snapshot, session 36), and one pool's snapshot beside another thread's
            # pool work did too (session 39; _torch_pools_bytes). So the count runs only while no
            # thread routes to a pool, captures or empties; otherwise the last figure stands.
            with GATE.try_exclusive() as ok:
                if ok:
                    self._torch_bytes = _torch_pools_bytes(pools)
            return self._torch_bytes
        with self.lock:
            return self._held

    def report(self, peak: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"function": self.name, "resident": self.resident, "pool": self.pool_bytes()}
        if peak is not None:
            out["peak"] = peak
        return out

    def model(self) -> dict[str, Any]:
        return {"backend": self.backend, "resident": self.resident, "request_peak": self.request_peak}

    # -- scopes ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Around setup(): what it allocates and keeps is the function's resident memory."""
        before = _torch_reserved() if self.backend == "cuda" else 0
        prev = getattr(_current, "pool", None)
        _current.pool = self
        try:
            yield
        finally:
            _current.pool = prev
            if self.backend == "cuda":
                self.resident = max(0, _torch_reserved() - before)
            else:
                with self.lock:
                    # What setup() still holds is the function's own; its cache is not.
                    self.resident = self._live
                    self._drop_cache()
                    self._held = self._live
                    self._peak_live = self._live

    @contextlib.contextmanager
    def request(self) -> Iterator[dict[str, int]]:
        """Around one request (and the warm-up) on this thread: its allocations come from the
        function's pool; on exit `peak` holds the most the pool held above `resident`."""
        out = {"peak": 0}
        with self.lock:
            self.in_flight += 1
            if self.in_flight == 1:
                self._peak_live = self._live
        prev = getattr(_current, "pool", None)
        _current.pool = self
        try:
            if self.backend == "cuda":
                with self._torch_scope():
                    yield out
            else:
                yield out
        finally:
            _current.pool = prev
            if self.backend == "cuda":
                peak = self.pool_bytes()
            else:
                with self.lock:
                    peak = max(0, self._peak_live - self.resident)
            with self.lock:
                self.in_flight -= 1
            out["peak"] = peak
            self.request_peak = max(self.request_peak, peak)

    def release(self) -> int:
        """Gives the pool's idle memory back (nothing while a request of it runs); returns the
        bytes it held before, or DEFERRED where another function's request or a graph capture
        is in a pool now (see AllocatorGate)."""
        with self.lock:
            if self.in_flight:
                return 0
            if self.backend != "cuda":
                before = self._held
                self._drop_cache()
                self._held = self._live
                return before
            if not self._torch_pools:
                return 0
        with GATE.try_exclusive() as ok:
            if not ok:
                return DEFERRED
            with self.lock:
                if self.in_flight:
                    return 0
                pools, self._torch_pools, self._torch_idle = self._torch_pools, [], []
                self._torch_bytes = 0
            before = _torch_pools_bytes(pools)
            torch: Any = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            # The last references: each MemPool's destruction empties its own cached blocks
            # (emptyCache of its id). Not torch.cuda.empty_cache(): that empties every cache,
            # the default pool's too, and after a split restore a segment torpord handed over
            # that became free would go behind its back (its GPU release then names a segment
            # the worker no longer has; session 36). A snapshot's quiet point empties it all
            # (empty_cache below).
            del pools
        return before

    # -- host backend ------------------------------------------------------------------------

    def _drop_cache(self) -> None:
        self._cache.clear()

    def scratch(self, nbytes: int) -> Any:
        with self.lock:
            cached = self._cache.get(nbytes)
            block = cached.pop() if cached else None
            if block is None:
                block = bytearray(nbytes)
                self._held += nbytes
            self._live += nbytes
            self._peak_live = max(self._peak_live, self._live)
        exporter, view = _export(block)
        # The exporter lives as long as any view of it (NumPy keeps its base): when the last
        # one dies, the block goes back to the cache.
        weakref.finalize(exporter, self._returned, block, nbytes)
        return view

    def _returned(self, block: bytearray, nbytes: int) -> None:
        with self.lock:
            self._live -= nbytes
            self._cache.setdefault(nbytes, []).append(block)

    # -- cuda backend ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _torch_scope(self) -> Iterator[None]:
        torch: Any = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized() or not hasattr(torch.cuda, "MemPool"):
            yield
            return
        # The scope covers the pool's making too: PyTorch's allocator state changes there.
        with GATE.scope():
            with self.lock:
                if self._torch_idle:
                    pool = self._torch_idle.pop()
                else:
                    pool = torch.cuda.MemPool()
                    note_pool(pool.id, REQUEST_POOL)
                    self._torch_pools.append(pool)
            try:
                with torch.cuda.use_mem_pool(pool):
                    _current.routing = True
                    try:
                        yield
                    finally:
                        _current.routing = False
            finally:
                # A release waits for in_flight to reach 0, so the pool is still among ours.
                with self.lock:
                    self._torch_idle.append(pool)


def empty_cache() -> bool:
    """PyTorch's whole cache given back, the default pool's included: at a snapshot's quiet
    point only, which lists the worker's segments afresh (see FunctionPool.release). False,
    nothing done, where a request or a capture is in a pool now."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return True
    with GATE.try_exclusive() as ok:
        if ok:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return ok


def routing() -> bool:
    """Whether this thread's CUDA allocations go to a request's pool now (a sandboxed
    function's request or warm-up)."""
    return bool(getattr(_current, "routing", False))


def backend_for(gpu_framework: str | None) -> str:
    """The pool backend of a function loaded now: cuda under PyTorch with CUDA initialised."""
    torch: Any = sys.modules.get("torch")
    if gpu_framework == "torch" and torch is not None and torch.cuda.is_initialized():
        return "cuda"
    return "host"


def scratch(nbytes: int) -> Any:
    """Writable memory of `nbytes` from the calling function's pool (the host backend's
    allocator; see the module doc): a NumPy uint8 array, or a ctypes array without NumPy. Its
    block goes back to the function's pool when the array is garbage, and the pool's idle
    memory back to the system when the function idles. Outside a function's load or request it
    is plain memory, counted nowhere."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"torpor.scratch needs a size in bytes (an integer >= 0), got {nbytes!r}")
    pool: FunctionPool | None = getattr(_current, "pool", None)
    if pool is None or pool.backend != "host":
        return _export(bytearray(nbytes))[1]
    return pool.scratch(nbytes)


def _export(block: bytearray) -> tuple[Any, Any]:
    """A ctypes array over `block` (it supports weak references) and the view the caller gets:
    a NumPy uint8 array over it, or the ctypes array itself without NumPy."""
    exporter = (ctypes.c_uint8 * len(block)).from_buffer(block)
    try:
        import numpy as np
    except ImportError:
        return exporter, exporter
    view: Any = np.frombuffer(exporter, dtype=np.uint8)  # type: ignore[call-overload]
    return exporter, view


def _torch_reserved() -> int:
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_reserved())


def _torch_pools_bytes(pools: list[Any]) -> int:
    """The bytes of the segments `pools` hold: the allocator's segments tagged with their ids,
    from one snapshot. Not `MemPool.snapshot()` (PyTorch's snapshot of one pool): beside another
    thread's pool made, routed to and released, it killed the process by SIGSEGV in 9 of 18 runs
    on the H100 (torch 2.11, session 39), the whole allocator's snapshot in none of 10
    (docs/sandboxes.md, "A pool's bytes")."""
    torch: Any = sys.modules.get("torch")
    if not pools or torch is None:
        return 0
    ids = {tuple(pool.id) for pool in pools}
    return sum(
        int(seg.get("total_size", 0))
        for seg in torch.cuda.memory_snapshot()
        if tuple(seg.get("segment_pool_id", ())) in ids
    )
