"""A GPU function without a framework (the worker warms CUDA through the driver API) that opens
and closes a CUDA IPC handle on request: {"op": "ipc-open" | "ipc-close" | anything} ->
{"calls": n, "code": CUresult or None}.

The calls go to whatever `cuIpcOpenMemHandle_v2` the process resolves globally: the device-memory
hook torpord preloads into every GPU worker, which records the import (a marker memfd) and passes
the call on to libcuda (on a CPU machine the fake driver, tests/fakes/fake_libcuda.c, which the
worker loaded with RTLD_LOCAL). Without the hook the name is not found globally and the call
raises AttributeError. `IpcInSetup` opens one in setup(), before the function snapshot.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torpor


class IpcHandle(ctypes.Structure):
    """CUipcMemHandle: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


@torpor.function
class Ipc:
    def setup(self) -> None:
        self.calls = 0
        self.ptr = ctypes.c_ulonglong(0)

    def open(self) -> int:
        return int(ctypes.CDLL(None).cuIpcOpenMemHandle_v2(ctypes.byref(self.ptr), IpcHandle(), 1))

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        code = None
        if request.get("op") == "ipc-open":
            code = self.open()
        elif request.get("op") == "ipc-close":
            code = int(ctypes.CDLL(None).cuIpcCloseMemHandle(self.ptr))
        return {"calls": self.calls, "code": code}


@torpor.function
class IpcInSetup(Ipc):
    def setup(self) -> None:
        super().setup()
        code = self.open()
        if code != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle_v2 returned {code}")
