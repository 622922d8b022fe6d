"""libcuda for the harness, through ctypes: $TORPOR_LIBCUDA (torpord sets it; the tests' fake
driver), else libcuda.so.1. Used where the harness maps GPU memory torpord sends (torpor.data's
platform-managed GPU data, torpor.store_gpu's store values)."""

from __future__ import annotations

import ctypes
import os
import threading
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
