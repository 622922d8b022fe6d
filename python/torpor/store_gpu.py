"""The communication store's GPU values, the worker's side (torpor.store; the daemon's side is
crates/torpord/src/runtime/store_gpu.rs, which says why the daemon owns the memory).

A CUDA value is a torch tensor on a GPU, or any object with `__cuda_array_interface__` (CuPy,
Numba, ...), C-contiguous. `put(..., shared=True)` of one asks torpord for GPU memory on the
value's GPU (`store_put` with `gpu`), maps the fd it gets writable, copies the value in with
one device-to-device copy after synchronising the context (so the kernels that produced it,
on any stream, are done), synchronises, unmaps it and tells torpord (`store_written`), which
seals it read-only. `get` of one maps the fd torpord sends read-only on the worker's GPU 0 and
returns a torch tensor over it (through DLPack: torpor.dlpack, as torpor.data does), or, without
torch, a `CudaArray` that exposes the interface itself. No copy is made in the worker; the
mapping goes when the returned object is collected (the tensor holds the `CudaArray`).

The driver is libcuda through ctypes (torpor.cuda_driver, as torpor.data uses it), with the
virtual memory management calls: import the fd, reserve addresses, map, set access.

**Kept mappings and leases** (protocol 4; docs/sandboxes.md, "Kept mappings and leases").
Where torpord names the memory's `block` (memory that comes back to the tenant's next puts),
the worker keeps its mapping after the put's copy or after the got object goes, and the next
put or get of that block maps nothing: a mapping's import, reserve, map, set access and unmap
were ~0.6 ms of a 1.3-1.8 ms hand-off on the H100 (bench/results/sandbox-handoff-s34-*-h100.json).
A got object's end is told to torpord (`store_release`, sent before the request's result or
with the worker's next store request) only after the context is synchronised, so nothing
still reads the memory when the next put writes it. A put's answer may carry a lease: memory
for the worker's next put of that size class, which the worker fills before it asks (one
request instead of two); only the worker's word gives a lease back. torpord's `store_unmap`
names blocks it let go of: unmapped at once, or when the object using one goes. At every quiet
point (a snapshot, a GPU release, a migration) the idle kept mappings and the lease go: neither
a snapshot nor the driver's checkpoint carries them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torpor import cuda_driver, dlpack

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3

# torch dtypes by name, as the array interface writes them ("|V2": no interface type).
_TYPESTRS = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "|V2",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1", "uint8": "|u1", "bool": "|b1",
    "complex64": "<c8", "complex128": "<c16",
}


_steps = threading.local()


def steps() -> dict[str, float]:
    """Seconds each step of this thread's last put of a CUDA value or get from torpord's store
    took, in order: the round trips to torpord, each driver call, the copy, the fd's close
    (bench/sandbox/run.py reports them, to say where a hand-off's time goes). Empty before the
    first."""
    return dict(getattr(_steps, "last", {}))


def start_steps() -> None:
    """A GPU put or get begins on this thread: its steps are timed from now."""
    _steps.last = {}
    _steps.at = time.perf_counter()


def note(name: str, seconds: float) -> None:
    """Records `seconds` under `name` among this thread's steps, the clock of the steps left as
    it is (a part of a step measured apart, e.g. by another thread)."""
    last: dict[str, float] | None = getattr(_steps, "last", None)
    if last is not None:
        last[name] = last.get(name, 0.0) + seconds


def step(name: str) -> None:
    """Step `name` ended now (a step done twice adds up)."""
    last: dict[str, float] | None = getattr(_steps, "last", None)
    if last is None:
        return
    now = time.perf_counter()
    last[name] = last.get(name, 0.0) + now - _steps.at
    _steps.at = now


class StoreGpuError(RuntimeError):
    """A GPU value could not be put or mapped (the message names cause and fix)."""


@dataclass(frozen=True)
class Source:
    """A CUDA value to put: where its bytes are and what they are."""

    ptr: int
    nbytes: int
    ordinal: int  # the worker's CUDA ordinal of its GPU
    meta: dict[str, Any]


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


_typed_done = False
_typed_lock = threading.Lock()


def driver() -> Any:
    """libcuda (torpor.cuda_driver) with the VMM calls' argument types set, and a context current
    on this thread."""
    try:
        return _typed(cuda_driver.with_context())
    except cuda_driver.DriverError as e:
        raise StoreGpuError(f"{e}: a GPU value needs a function with gpus = 1") from None


def _typed(cuda: Any) -> Any:
    """`cuda` with the VMM calls' argument types set (once per process)."""
    global _typed_done
    with _typed_lock:
        if not _typed_done:
            u64, c_int, c_size = ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t
            cuda.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, c_int]
            cuda.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), c_size, c_size, u64, u64]
            cuda.cuMemAddressFree.argtypes = [u64, c_size]
            cuda.cuMemMap.argtypes = [u64, c_size, c_size, u64, u64]
            cuda.cuMemUnmap.argtypes = [u64, c_size]
            cuda.cuMemSetAccess.argtypes = [u64, c_size, ctypes.POINTER(_CUmemAccessDesc), c_size]
            cuda.cuMemRelease.argtypes = [u64]
            cuda.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, c_size, ctypes.c_void_p]
            _typed_done = True
    return cuda


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise StoreGpuError(f"{what} failed with CUresult {rc}")


def is_cuda(value: Any) -> bool:
    """Whether `value` is a CUDA value (a torch CUDA tensor or an array-interface object)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return bool(value.is_cuda)
    return hasattr(value, "__cuda_array_interface__")


def _contiguous_strides(shape: list[int], itemsize: int) -> list[int]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return list(reversed(strides))


def source(value: Any) -> Source:
    """Where the bytes of CUDA value `value` are; StoreGpuError for a value that is not
    C-contiguous."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if not value.is_contiguous():
            raise StoreGpuError(
                "put(..., shared=True) of a non-contiguous tensor: its bytes are not one block; "
                "pass tensor.contiguous() (one copy on the GPU)"
            )
        dtype = str(value.dtype).removeprefix("torch.")
        shape = list(value.shape)
        meta = {
            "kind": "cuda", "torch": True, "dtype": dtype, "typestr": _TYPESTRS.get(dtype, "|V1"),
            "shape": shape, "device": str(value.device),
        }
        index = value.device.index if value.device.index is not None else torch.cuda.current_device()
        return Source(int(value.data_ptr()), int(value.numel() * value.element_size()), int(index), meta)
    cai = value.__cuda_array_interface__
    shape = [int(n) for n in cai["shape"]]
    typestr = str(cai["typestr"])
    itemsize = int(typestr[2:]) if typestr[2:].isdigit() else 1
    strides = cai.get("strides")
    if strides is not None and list(strides) != _contiguous_strides(shape, itemsize):
        raise StoreGpuError(
            "put(..., shared=True) of a non-contiguous array (strides "
            f"{tuple(strides)}): its bytes are not one block; pass a contiguous copy "
            "(cupy.ascontiguousarray, tensor.contiguous())"
        )
    count = 1
    for n in shape:
        count *= n
    device = getattr(value, "device", None)
    index = getattr(device, "index", getattr(device, "id", device))
    if not isinstance(index, int):
        dev = ctypes.c_int()
        _check(driver().cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
        index = dev.value
    meta = {"kind": "cuda", "typestr": typestr, "shape": shape, "device": f"cuda:{index}"}
    return Source(int(cai["data"][0]), count * itemsize, index, meta)


class _Mapping:
    """GPU memory behind an fd, mapped at addresses reserved for it; unmapped by close()."""

    def __init__(self, fd: int, padded: int, ordinal: int, writable: bool) -> None:
        cuda = driver()
        self.cuda, self.padded = cuda, padded
        handle = ctypes.c_uint64()
        _check(
            cuda.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "importing the store's GPU memory (cuMemImportFromShareableHandle)",
        )
        step("import")
        va = ctypes.c_uint64()
        try:
            _check(cuda.cuMemAddressReserve(ctypes.byref(va), padded, 0, 0, 0), f"reserving {padded} bytes of addresses")
            step("reserve")
            try:
                _check(cuda.cuMemMap(va.value, padded, 0, handle.value, 0), "cuMemMap")
                step("map")
                flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else CU_MEM_ACCESS_FLAGS_PROT_READ
                desc = _CUmemAccessDesc(_CUmemLocation(1, ordinal), flags)
                rc = cuda.cuMemSetAccess(va.value, padded, ctypes.byref(desc), 1)
                step("set_access")
                if rc != 0:
                    cuda.cuMemUnmap(va.value, padded)
                    _check(rc, f"cuMemSetAccess ({'read-write' if writable else 'read-only'}, GPU {ordinal})")
            except BaseException:
                cuda.cuMemAddressFree(va.value, padded)
                raise
        finally:
            # The mapping keeps the memory; the handle is not needed any more.
            cuda.cuMemRelease(handle.value)
        self.va: int | None = va.value

    def close(self) -> None:
        if self.va is None:
            return
        va, self.va = self.va, None
        # Work queued on the memory ends before it goes.
        self.cuda.cuCtxSynchronize()
        self.cuda.cuMemUnmap(va, self.padded)
        self.cuda.cuMemAddressFree(va, self.padded)


def fill(fd: int, padded: int, src: Source, copied: Callable[[], None] | None = None, block: int | None = None) -> None:
    """Copies `src` into the GPU memory behind `fd` (torpord's `store_memory`), calls `copied()`
    once the copy is done (the worker tells torpord then, so its answer and this unmap overlap),
    then unmaps it, or keeps the mapping where torpord named the memory's `block`. On the
    value's own GPU's context: torpord allocated the memory there, and only that GPU is given
    access to the mapping."""
    try:
        # The value's GPU's context, not whatever the thread had (driver() would make GPU 0's).
        with cuda_driver.on_device(src.ordinal) as loaded:
            cuda = _typed(loaded)
            step("context")
            kept = _take(block, fd, padded, src.ordinal, writable=True) if block is not None else None
            m = kept.mapping if kept is not None else _Mapping(fd, padded, src.ordinal, writable=True)
            try:
                assert m.va is not None
                _check(cuda.cuCtxSynchronize(), "synchronising the GPU before the copy")
                step("sync_before")
                _check(cuda.cuMemcpyDtoDAsync_v2(m.va, src.ptr, src.nbytes, None), "copying the value (cuMemcpyDtoDAsync)")
                _check(cuda.cuCtxSynchronize(), "synchronising the GPU after the copy")
                step("copy")
                if copied is not None:
                    copied()
            finally:
                if kept is not None:
                    _give(kept, got=False)
                else:
                    m.close()
                    step("unmap")
    except cuda_driver.DriverError as e:
        raise StoreGpuError(f"{e}: the value's GPU must be one this function sees") from None


class _Kept:
    """A mapping of block `block` of torpord's store memory that this worker keeps."""

    def __init__(self, block: int, mapping: _Mapping, writable: bool) -> None:
        self.block, self.mapping, self.writable = block, mapping, writable
        self.users = 0
        # torpord let go of the block (or a quiet point came): unmapped once unused.
        self.doomed = False


# Kept mappings by block; their users; blocks whose gets ended, for torpord (store_release).
_kept: dict[int, _Kept] = {}
_kept_lock = threading.Lock()
_releases: list[int] = []
# Idle kept mappings beyond this many are unmapped, least recently used first: a steady
# hand-off between two functions cycles through two or three blocks.
MAX_KEPT = 8


def _take(block: int, fd: int, padded: int, ordinal: int, writable: bool) -> _Kept:
    """The kept mapping of `block` for one more user, made (and kept) if there is none."""
    with _kept_lock:
        k = _kept.get(block)
        if k is not None and not k.doomed and (k.writable or not writable) and k.mapping.padded == padded:
            k.users += 1
            # Most recently used last.
            _kept[block] = _kept.pop(block)
            step("kept")
            return k
    k = _Kept(block, _Mapping(fd, padded, ordinal, writable), writable)
    k.users = 1
    idle: list[_Kept] = []
    with _kept_lock:
        old = _kept.get(block)
        if old is None or old.users == 0:
            # A read-only mapping of the block gives way to a writable one.
            if old is not None:
                idle.append(old)
            _kept[block] = k
        else:
            # In use read-only while this put writes the block (the worker got it and puts into
            # it again): this mapping is the put's alone.
            k.doomed = True
        spare = [b for b, kk in _kept.items() if kk.users == 0]
        for b in spare[: max(0, len(spare) - MAX_KEPT)]:
            idle.append(_kept.pop(b))
    for kk in idle:
        kk.mapping.close()
    return k


def _give(k: _Kept, got: bool) -> None:
    """One user of `k` is done (`got`: a get's object, which torpord is told about)."""
    with _kept_lock:
        k.users -= 1
        if got:
            _releases.append(k.block)
        close = k.doomed and k.users == 0
        if close and _kept.get(k.block) is k:
            del _kept[k.block]
    if close:
        k.mapping.close()


@dataclass
class Lease:
    """Memory torpord set aside for this worker's next put of about its size (`store_stored`'s
    `lease`, protocol 4): the worker copies the value in before it asks, so the put is one
    request. The fd is kept until then (the mapping may have gone at a quiet point)."""

    block: int
    padded: int
    min_bytes: int  # the smallest put of its size class
    ordinal: int
    fd: int


_lease: list[Lease] = []  # at most one
# Leases let go of unused, for torpord (store_release's leases): only the worker's word gives a
# lease back, since another of its threads may be filling the one torpord holds for it.
_unleased: list[int] = []


def set_lease(lease: Lease) -> None:
    """torpord's lease for the next put (any older one's fd closed)."""
    drop_lease()
    with _kept_lock:
        _lease.append(lease)


def take_lease(nbytes: int, ordinal: int) -> Lease | None:
    """The lease, for a put of `nbytes` on the worker's GPU `ordinal` of its size class (what
    torpord would allocate for it); None otherwise, or when another thread took it (a lease of
    another size class is let go of: torpord hears of it with the worker's next frame)."""
    with _kept_lock:
        lease = _lease.pop() if _lease else None
    if lease is None:
        return None
    if lease.ordinal == ordinal and lease.min_bytes <= nbytes <= lease.padded:
        return lease
    let_go(lease)
    return None


def drop_lease() -> None:
    """Lets go of the lease unused (torpord hears of it with the worker's next frame to it)."""
    with _kept_lock:
        lease = _lease.pop() if _lease else None
    if lease is not None:
        let_go(lease)


def let_go(lease: Lease) -> None:
    """`lease`, unused, let go of: its fd closed, torpord told with the worker's next frame."""
    os.close(lease.fd)
    with _kept_lock:
        _unleased.append(lease.block)


def take_unleased() -> list[int]:
    """The leases let go of unused since the last call, for torpord's `store_release`."""
    with _kept_lock:
        out = list(_unleased)
        _unleased.clear()
    return out


def take_releases() -> list[int]:
    """The blocks whose gets ended since the last call, for torpord's `store_release`."""
    with _kept_lock:
        out = list(_releases)
        _releases.clear()
    return out


def unmap_blocks(blocks: list[int]) -> None:
    """torpord let go of `blocks`: their kept mappings go, now or when their last user does."""
    idle: list[_Kept] = []
    with _kept_lock:
        for b in blocks:
            k = _kept.get(b)
            if k is None:
                continue
            k.doomed = True
            if k.users == 0:
                idle.append(_kept.pop(b))
    if idle:
        driver()
    for k in idle:
        k.mapping.close()


def drop_kept() -> int:
    """A quiet point: every kept mapping goes (those in use when their user does), and the
    lease with its fd (a snapshot cannot hold an fd of the driver's exported memory). Returns
    how many were unmapped now."""
    drop_lease()
    with _kept_lock:
        blocks = list(_kept)
    before = len(blocks)
    unmap_blocks(blocks)
    with _kept_lock:
        return before - len(_kept)


def kept_blocks() -> list[int]:
    """The blocks whose mappings this worker keeps (tests)."""
    with _kept_lock:
        return sorted(_kept)


class CudaArray:
    """A GPU value of torpord's store mapped read-only: `__cuda_array_interface__` (read-only
    flag set) over it. The mapping lives as long as this object, or, for memory torpord named
    the `block` of, is kept for the block's next put or get (the end of this object is told to
    torpord then)."""

    def __init__(
        self, fd: int, padded: int, nbytes: int, meta: dict[str, Any], source: str, block: int | None = None
    ) -> None:
        if block is None:
            self._mapping = _Mapping(fd, padded, 0, writable=False)
            self._finalizer = weakref.finalize(self, self._mapping.close)
        else:
            try:
                kept = _take(block, fd, padded, 0, writable=False)
            except BaseException:
                # torpord holds the block for this get: the get is over.
                with _kept_lock:
                    _releases.append(block)
                raise
            self._mapping = kept.mapping
            self._finalizer = weakref.finalize(self, functools.partial(_end_get, kept))
        assert self._mapping.va is not None
        self.va, self.nbytes, self.padded, self.source = self._mapping.va, nbytes, padded, source
        self.meta = meta
        self.__cuda_array_interface__ = {
            "shape": tuple(meta.get("shape", (nbytes,))),
            "typestr": str(meta.get("typestr", "|u1")),
            "data": (self.va, True),
            "version": 3,
            "strides": None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.KDL_CUDA, 0)

    def __dlpack__(self, **consumer: Any) -> Any:
        """The value for a DLPack consumer (`cupy.from_dlpack`), on the worker's GPU 0: prefer it
        to `__cuda_array_interface__` in a process restored onto another GPU (torpor.dlpack)."""
        shape = tuple(int(n) for n in self.meta.get("shape", [self.nbytes]))
        return dlpack.Tensor(self.va, shape, dtype_name(self.meta), 0, self).__dlpack__(**consumer)

    def close(self) -> None:
        """Unmaps it now, or gives a kept mapping back (an object still using it then faults,
        or reads what the block's next put writes)."""
        self._finalizer()


def _end_get(kept: _Kept) -> None:
    """A got object's end: the work queued on the memory is finished before torpord hears of
    it (the next put into the block must not overwrite what a kernel still reads)."""
    try:
        # On whichever thread let go of the object: GPU 0's context made current if it has none
        # (a synchronise without one returns at once).
        driver().cuCtxSynchronize()
    except StoreGpuError:
        pass
    finally:
        _give(kept, got=True)


def dtype_name(meta: dict[str, Any]) -> str:
    """The value's dtype name: torch's, as put, else NumPy's name of its typestr."""
    dtype = meta.get("dtype")
    if isinstance(dtype, str):
        return dtype
    import numpy as np

    return str(np.dtype(str(meta.get("typestr", "|u1"))))


def tensor(array: CudaArray) -> Any:
    """A torch tensor of the value's dtype and shape over `array`'s mapping (no copy), on the
    worker's GPU 0, where the mapping was made: through DLPack, which names the device, not
    `__cuda_array_interface__`, whose pointer the driver places wrongly in a process restored
    onto another GPU (torpor.dlpack). The tensor and its views hold `array`, so the mapping."""
    torch: Any = importlib.import_module("torch")
    shape = tuple(int(n) for n in array.meta.get("shape", [array.nbytes]))
    name = dtype_name(array.meta)
    if name in dlpack.DTYPES:
        return dlpack.torch_tensor(array.va, shape, name, 0, array)
    # A type DLPack cannot name (torch's float8s): bytes, viewed as the dtype.
    raw = dlpack.torch_tensor(array.va, (array.nbytes,), "uint8", 0, array)
    return raw.view(getattr(torch, name)).reshape(shape)


def mapped(fd: int, padded: int, nbytes: int, meta: dict[str, Any], source: str, block: int | None = None) -> Any:
    """A GPU value torpord sent (`store_value` with `gpu`): a torch tensor when torch is there,
    else the CudaArray."""
    array = CudaArray(fd, padded, nbytes, meta, source, block)
    if meta.get("torch") or "torch" in sys.modules:
        try:
            t = tensor(array)
            step("tensor")
            return t
        except ImportError:
            pass
    return array
