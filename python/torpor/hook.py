"""The device-memory hook, libtorpor_hook.so, from Python (ctypes), and torpor.buffer().

The hook keeps a worker's big buffers in *segments*: memory the split snapshot path takes out of
the process at a snapshot and maps back, at the same address, after restore (docs/split.md).
GPU segments are made by the hook itself when it is preloaded (it interposes cudaMalloc); host
segments (memfd-backed memory) are made here, for torpor.buffer() and for declared data loaded
with torpor.load(name, buffer=True).

torpord sets $TORPOR_HOOK_LIB to the library's path (the same file it preloads into GPU
workers, so that both share one segment table). Without it, torpor.buffer() raises HookError.

A segment lives as long as the process: torpor.buffer() memory is never given back, since a
snapshot of the worker refers to its address.

recording_first_use() gives segments their first-use order (what the restore server fills
first): while it is active, each PyTorch module that runs marks the segments holding its
parameters and buffers. The harness records so during the function's warm-up request.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torpor.errors import HookError

ENV_LIB = "TORPOR_HOOK_LIB"
ABI_VERSION = 2
_BACKENDS = ("host", "cuda")


class _Segment(ctypes.Structure):
    """struct torpor_hook_segment (crates/torpor-hook/src/capi.rs)."""

    _fields_ = [
        ("va", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("order", ctypes.c_uint64),
        ("first_use", ctypes.c_int64),
        ("backend", ctypes.c_uint32),
        ("ordinal", ctypes.c_int32),
        ("mapped", ctypes.c_uint32),
        ("read_only", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Segment:
    """One segment as the hook reports it."""

    va: int
    size: int
    backend: str  # "host" or "cuda"
    ordinal: int  # the GPU's CUDA ordinal; -1 for host
    order: int  # creation order
    first_use: int | None  # place in first-use order, None while unused
    mapped: bool  # holds memory (False: released)
    read_only: bool

    def frame(self) -> dict[str, Any]:
        """The segment as the `quiet` frame lists it (docs/split.md)."""
        return {
            "va": self.va,
            "size": self.size,
            "backend": self.backend,
            "ordinal": self.ordinal,
            "order": self.order,
            "first_use": self.first_use,
            "readonly": self.read_only,
        }


class Hook:
    """The hook library loaded from `path`."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise HookError(
                f"cannot load the device-memory hook {path}: {e}; set ${ENV_LIB} to the "
                "libtorpor_hook.so that `make build` (target/debug) or `make release` builds"
            ) from None
        try:
            version = lib.torpor_hook_abi_version
        except AttributeError:
            raise HookError(
                f"{path} is not the device-memory hook (no torpor_hook_abi_version); "
                f"set ${ENV_LIB} to libtorpor_hook.so"
            ) from None
        version.restype = ctypes.c_uint32
        if version() != ABI_VERSION:
            raise HookError(
                f"{path} speaks hook ABI {version()}, this harness {ABI_VERSION}; "
                "install the torpor Python package and libtorpor_hook.so of one release"
            )
        u64, c_int = ctypes.c_uint64, ctypes.c_int
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "torpor_hook_host_alloc": (c_int, [ctypes.c_size_t, ctypes.POINTER(u64)]),
            "torpor_hook_host_free": (c_int, [u64]),
            "torpor_hook_seal": (c_int, [u64]),
            "torpor_hook_mark_first_use": (c_int, [u64]),
            "torpor_hook_list": (ctypes.c_size_t, [ctypes.POINTER(_Segment), ctypes.c_size_t]),
            "torpor_hook_export": (c_int, [u64]),
            "torpor_hook_release_all": (c_int, [ctypes.POINTER(u64)]),
            "torpor_hook_release": (c_int, [u64]),
            "torpor_hook_map": (c_int, [u64, c_int, c_int]),
            "torpor_hook_cuda_reserve": (c_int, [ctypes.c_size_t, ctypes.POINTER(u64)]),
            "torpor_hook_last_error": (ctypes.c_char_p, []),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.path = path
        self._lib = lib

    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            message = (self._lib.torpor_hook_last_error() or b"").decode("utf-8", "replace")
            raise HookError(f"{what}: {message}")
        return rc

    def host_alloc(self, size: int) -> int:
        """A new read-write host segment of at least `size` bytes; its address."""
        va = ctypes.c_uint64()
        self._check(self._lib.torpor_hook_host_alloc(size, ctypes.byref(va)), f"allocating {size} bytes")
        return va.value

    def reserve_cuda(self, size: int) -> int:
        """A new released cuda segment of at least `size` bytes of addresses on the current
        context's GPU, holding no memory (map memory there next); its address."""
        va = ctypes.c_uint64()
        self._check(self._lib.torpor_hook_cuda_reserve(size, ctypes.byref(va)), f"reserving {size} bytes on the GPU")
        return va.value

    def host_free(self, va: int) -> None:
        self._check(self._lib.torpor_hook_host_free(va), f"freeing the segment at {va:#x}")

    def seal(self, va: int) -> None:
        """Make the host segment at `va` read-only for good (a write then faults)."""
        self._check(self._lib.torpor_hook_seal(va), f"sealing the segment at {va:#x}")

    def mark_first_use(self, addr: int) -> None:
        """Give the segment holding `addr` its place in first-use order (once)."""
        self._check(self._lib.torpor_hook_mark_first_use(addr), f"marking {addr:#x} used")

    def segments(self) -> list[Segment]:
        """Every segment, in creation order."""
        capacity = 256  # one call for most workers (an 8B model has 68 segments)
        while True:
            buf = (_Segment * capacity)()
            n = self._lib.torpor_hook_list(buf, capacity)
            if n <= capacity:
                return [
                    Segment(
                        va=s.va,
                        size=s.size,
                        backend=_BACKENDS[s.backend] if s.backend < len(_BACKENDS) else str(s.backend),
                        ordinal=s.ordinal,
                        order=s.order,
                        first_use=None if s.first_use < 0 else s.first_use,
                        mapped=bool(s.mapped),
                        read_only=bool(s.read_only),
                    )
                    for s in buf[:n]
                ]
            capacity = n

    def export(self, va: int) -> int:
        """A new fd for the memory of the segment at `va`; the caller closes it."""
        return self._check(self._lib.torpor_hook_export(va), f"exporting the segment at {va:#x}")

    def release_all(self) -> int:
        """Release every segment's memory, keeping its address (the snapshot step); bytes released."""
        released = ctypes.c_uint64()
        self._check(self._lib.torpor_hook_release_all(ctypes.byref(released)), "releasing the segments")
        return released.value

    def release(self, va: int) -> None:
        """Release the memory of the segment at `va`, keeping its address (its GPU synchronised)."""
        self._check(self._lib.torpor_hook_release(va), f"releasing the segment at {va:#x}")

    def map(self, va: int, fd: int, read_only: bool) -> None:
        """Map the memory behind `fd` (still the caller's) into the released segment at `va`."""
        what = f"mapping fd {fd} at {va:#x}{' read-only' if read_only else ''}"
        self._check(self._lib.torpor_hook_map(va, fd, int(read_only)), what)


_hook: Hook | None = None


def get() -> Hook:
    """The hook named by $TORPOR_HOOK_LIB, loaded once."""
    global _hook
    if _hook is None:
        path = os.environ.get(ENV_LIB)
        if not path:
            raise HookError(
                f"the device-memory hook is not available: ${ENV_LIB} is not set; run the function "
                "under torpord (which sets it), or set it to the libtorpor_hook.so of `make build`"
            )
        _hook = Hook(path)
    return _hook


def available() -> bool:
    """Whether $TORPOR_HOOK_LIB names a library (it is loaded when asked for)."""
    return bool(os.environ.get(ENV_LIB))


def view(va: int, size: int) -> memoryview:
    """A writable memoryview of `size` bytes at `va` (format "B")."""
    return memoryview((ctypes.c_ubyte * size).from_address(va)).cast("B")


def host_segment(size: int) -> tuple[int, memoryview]:
    """A new host segment: its address and a writable view of its first `size` bytes."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"a buffer's size is a positive number of bytes, got {size!r}")
    va = get().host_alloc(size)
    return va, view(va, size)


def buffer(size: int) -> memoryview:
    """`size` bytes of writable memory (zeroed) that live in a segment, so a snapshot of this
    worker stores them outside the CRIU image and a restore maps them back at the same address.
    The memory lives as long as the process."""
    return host_segment(size)[1]


@contextlib.contextmanager
def recording_first_use() -> Iterator[None]:
    """While active, every PyTorch module that runs forward marks the segments holding its CUDA
    parameters and buffers as used, in the order the modules run. Nothing happens without torch
    imported or without the hook."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not available():
        yield
        return
    mark = get()._lib.torpor_hook_mark_first_use
    seen: set[int] = set()

    def pre_hook(module: Any, _args: Any) -> None:
        for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            if t.is_cuda:
                ptr = t.data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    # -1 for memory outside every segment (a small allocation): nothing to mark.
                    mark(ptr)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()
