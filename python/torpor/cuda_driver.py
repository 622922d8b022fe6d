"""libcuda for the harness, through ctypes: $TORPOR_LIBCUDA (torpord sets it; the tests' fake
driver), else libcuda.so.1. Used where the harness maps GPU memory torpord sends (torpor.data's
platform-managed GPU data, torpor.store_gpu's store values)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class DriverError(RuntimeError):
    """No driver, no GPU or no context (the message says which)."""


_lock = threading.Lock()
_loaded: Any = None


def load() -> Any:
    """The driver library, loaded once and initialised (cuInit)."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                cuda = ctypes.CDLL(os.environ.get("TORPOR_LIBCUDA") or "libcuda.so.1")
            except OSError as e:
                raise DriverError(f"no CUDA driver in this worker ({e})") from None
            if cuda.cuInit(0) != 0:
                raise DriverError("cuInit failed: the worker has no usable GPU")
            _loaded = cuda
        return _loaded


def with_context() -> Any:
    """The driver, with a context current on this thread: the one already there, else GPU 0's
    primary context."""
    cuda = load()
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        dev = ctypes.c_int()
        if (
            cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0
            or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0
            or cuda.cuCtxSetCurrent(ctx) != 0
        ):
            raise DriverError("no CUDA context on GPU 0")
    return cuda


@contextmanager
def on_device(ordinal: int, keep: bool = False) -> Iterator[Any]:
    """The driver with GPU `ordinal`'s primary context current on this thread while the block
    runs, the thread's previous context current again after (with `keep`, a thread that had none
    keeps this one: PyTorch's cuBLAS warns on a thread with no context current). A copy runs on
    the current context's GPU, which must reach both sides: a value on GPU 1 is copied on GPU 1,
    whatever context the worker's thread had (on the H100s, GPU 0's could not reach memory
    mapped for GPU 1: CUDA_ERROR_INVALID_VALUE)."""
    cuda = load()
    before = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(before)) != 0:
        before.value = None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0 or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        raise DriverError(f"no CUDA context on GPU {ordinal}")
    try:
        if cuda.cuCtxSetCurrent(ctx) != 0:
            raise DriverError(f"cannot make GPU {ordinal}'s context current")
        try:
            yield cuda
        finally:
            if before.value or not keep:
                cuda.cuCtxSetCurrent(before)
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(dev)
