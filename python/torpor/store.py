"""The communication store: hand a value from one function to another without a copy.

    torpor.put("frame-17/boxes", boxes)            # in one function's request
    boxes = torpor.get("frame-17/boxes")           # in another's: the same object

Within one worker process (one sandbox, docs/sandboxes.md: the functions of one tenant and
workflow) `get` returns the very object `put` was given: no copy, no serialisation, whatever
the object is (a NumPy array, a torch tensor on the GPU, a dict).

Between sandboxes of one tenant on the node, `put(key, value, shared=True)` takes bytes or a
NumPy array: it copies the bytes once into a memfd, seals it (no write, no resize) and hands
the fd to torpord, which keeps it under the tenant's key; a `get` in any sandbox of the tenant
that does not hold the key itself asks torpord for it and maps the same pages read-only (a
read-only NumPy array, or a memoryview for bytes): no copy on the way out. Workers have no
shared /dev/shm; the fd passes through the daemon, which scopes keys by tenant. Only sandboxed
functions (scaling.sandbox = true) reach torpord's store: their requests run on threads, so the
harness can read its answer meanwhile.

It also takes a CUDA tensor (torch, or any C-contiguous `__cuda_array_interface__` object):
copied once, GPU to GPU, into GPU memory torpord owns on the tensor's GPU; a `get` on the same
GPU maps that memory read-only and returns a tensor over it (no copy), on another GPU torpord
copies it GPU to GPU first (torpor.store_gpu; crates/torpord/src/runtime/store_gpu.rs). Under
pressure torpord moves the oldest GPU values to host memory; a get copies such a value back up.

Between nodes, `put(key, value, shared=True, nodes="all")` also has torpord upload the value
to the bucket of its [objstore] section, which every node's torpord shares; a `get` on any node
that does not hold the key finds it there (its torpord downloads it into a sealed memfd) and
consumes it for every node. A CUDA tensor goes too: torpord copies it to host memory for the
upload, and a get on another node copies it up onto the getter's GPU (a function with gpus = 1).
Not without [objstore].

A key holds one value until it is consumed (`get`, unless keep=True) or expires (`ttl_s` after
the put, default 600 s); then it is dropped, so its memory goes back once nothing maps it.
Keys are scoped by tenant: a sandbox hosts one tenant's functions, and torpord keeps each
tenant's keys apart.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_TTL_S = 600.0
MAX_TTL_S = 86_400.0
MAX_KEY = 256


@dataclass
class _Item:
    value: Any
    expires: float  # time.monotonic()


_lock = threading.Lock()
_items: dict[str, _Item] = {}


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        raise TypeError(f"a store key is a non-empty string of at most {MAX_KEY} characters, got {key!r}")
    return key


def _sweep(now: float) -> None:
    for k in [k for k, item in _items.items() if item.expires <= now]:
        del _items[k]


# Set by the worker harness of a sandbox (torpor.worker): put a sealed memfd in torpord's store
# ({key, ttl_s, meta}, fd, nodes) -> error or None; put a GPU value ({key, ttl_s, meta}, bytes,
# the worker's GPU ordinal, fill(fd, padded, copied, block), nodes) -> error or None; get one (key, keep) ->
# (meta, bytes, fd, gpu) or None, gpu being store_value's {padded, ordinal, source, block?} for a GPU value.
RemotePut = Callable[[str, float, dict[str, Any], int, "str | None"], "str | None"]
RemotePutGpu = Callable[
    [str, float, dict[str, Any], int, int, Callable[[int, int, Callable[[], None], "int | None"], None], "str | None"],
    "str | None",
]
# The one spelling of `nodes` besides None (this node): every node of the bucket's cluster.
NODES_ALL = "all"
RemoteGet = Callable[[str, bool], "tuple[dict[str, Any], int, int, dict[str, Any] | None] | None"]
_remote: tuple[RemotePut, RemoteGet, RemotePutGpu] | None = None


def connect(put_remote: RemotePut, get_remote: RemoteGet, put_gpu_remote: RemotePutGpu) -> None:
    """The worker harness's hooks to torpord's store (a sandbox only)."""
    global _remote
    _remote = (put_remote, get_remote, put_gpu_remote)


def _encode(value: Any) -> tuple[dict[str, Any], memoryview]:
    """The bytes of a shared value and what they are."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject:
            raise TypeError("put(..., shared=True) takes arrays of numbers, not of Python objects")
        return {"kind": "ndarray", "dtype": a.dtype.str, "shape": list(a.shape)}, memoryview(a).cast("B")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"kind": "bytes"}, memoryview(value).cast("B")
    raise TypeError(
        f"put(..., shared=True) takes bytes, a NumPy array or a CUDA tensor, got {type(value).__name__}; "
        "without shared=True any object is handed over within the sandbox"
    )


def _sealed_memfd(data: memoryview) -> int:
    """A memfd holding `data`, sealed against writes and resizing. Written with write(2), not
    through a mapping: the kernel then fills the memfd's pages as it copies, instead of one page
    fault per 4 KiB (a 100 MiB hand-off 91 → 44 ms on the development VM,
    bench/results/sandbox-handoff-memfd-s33-{before,after}-cpu.json)."""
    fd = os.memfd_create("torpor-store", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _decode(meta: dict[str, Any], size: int, fd: int, gpu: dict[str, Any] | None) -> Any:
    """The value of a memfd (or GPU memory) from torpord's store, mapped read-only (no copy)."""
    if gpu is not None:
        from torpor import store_gpu

        block = gpu.get("block")
        return store_gpu.mapped(
            fd, int(gpu["padded"]), size, meta, str(gpu.get("source", "")), block if isinstance(block, int) else None
        )
    view: Any = memoryview(b"") if size == 0 else memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    if meta.get("kind") == "ndarray":
        import numpy as np

        return np.frombuffer(view, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])
    return view


def put(key: str, value: Any, ttl_s: float = DEFAULT_TTL_S, shared: bool = False, nodes: str | None = None) -> None:
    """Store `value` under `key` (replacing what the key held) until it is consumed or `ttl_s`
    seconds pass. No copy is made: a get in this process returns this object. With
    shared=True (bytes or a NumPy array, in a sandbox) the value goes to torpord's store
    instead, copied once, for any sandbox of the tenant on the node; with nodes="all" as well,
    for the tenant's sandboxes on every node (torpord uploads it to the [objstore] bucket
    before put returns)."""
    _check_key(key)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
    if not isinstance(shared, bool):
        raise TypeError(f"shared is True or False, got {shared!r}")
    if nodes is not None and nodes != NODES_ALL:
        raise ValueError(f'nodes is None (this node) or "all" (every node), got {nodes!r}')
    if nodes is not None and not shared:
        raise ValueError('nodes="all" goes through torpord\'s store: pass shared=True as well')
    if shared:
        if _remote is None:
            raise RuntimeError(
                "put(..., shared=True) needs torpord's store, which sandboxed functions reach "
                "(set [scaling] sandbox = true in torpor.toml; a CUDA tensor also needs gpus = 1)"
            )
        from torpor import store_gpu

        if store_gpu.is_cuda(value):
            _put_gpu(key, float(ttl_s), value, nodes)
            return
        meta, data = _encode(value)
        fd = _sealed_memfd(data)
        try:
            error = _remote[0](key, float(ttl_s), meta, fd, nodes)
        finally:
            os.close(fd)
        if error is not None:
            raise RuntimeError(f"torpord refused store key {key!r}: {error}")
        with _lock:
            _items.pop(key, None)
        return
    now = time.monotonic()
    with _lock:
        _sweep(now)
        _items[key] = _Item(value, now + float(ttl_s))


def _put_gpu(key: str, ttl_s: float, value: Any, nodes: str | None) -> None:
    """put(..., shared=True) of a CUDA value: into GPU memory torpord allocates (torpor.store_gpu)."""
    from torpor import store_gpu

    assert _remote is not None
    store_gpu.start_steps()
    src = store_gpu.source(value)
    if src.nbytes == 0:
        raise ValueError("put(..., shared=True) of an empty tensor: it has no bytes to share; put it without shared=True")

    def fill(fd: int, padded: int, copied: Callable[[], None], block: int | None) -> None:
        store_gpu.fill(fd, padded, src, copied, block)

    error = _remote[2](key, ttl_s, src.meta, src.nbytes, src.ordinal, fill, nodes)
    if error is not None:
        raise RuntimeError(f"torpord refused store key {key!r}: {error}")
    with _lock:
        _items.pop(key, None)


def get(key: str, keep: bool = False) -> Any:
    """The value put under `key`, consumed (the key is freed) unless keep=True: this
    process's, else (in a sandbox) torpord's, put with shared=True by any sandbox of the
    tenant (on any node, for a value put with nodes="all"). KeyError when no value is there: never put, consumed or expired."""
    _check_key(key)
    now = time.monotonic()
    with _lock:
        _sweep(now)
        item = _items.get(key) if keep else _items.pop(key, None)
    if item is None and _remote is not None:
        from torpor import store_gpu

        store_gpu.start_steps()
        found = _remote[1](key, keep)
        if found is not None:
            meta, size, fd, gpu = found
            try:
                return _decode(meta, size, fd, gpu)
            finally:
                os.close(fd)
                store_gpu.step("close_fd")
    if item is None:
        raise KeyError(
            f"no value under store key {key!r} in this sandbox: it was never put here, was consumed "
            "by an earlier get, or expired (put(..., ttl_s=...) keeps it longer); another sandbox's value "
            "is reachable when it was put with shared=True (docs/sandboxes.md)"
        )
    return item.value


def keys() -> list[str]:
    """The keys that hold a value now."""
    with _lock:
        _sweep(time.monotonic())
        return sorted(_items)


def clear() -> None:
    """Drop every value (tests)."""
    with _lock:
        _items.clear()
