"""Device memory this process mapped, handed to a framework as a DLPack tensor on the device we
name.

torpor.data and torpor.store map GPU memory torpord made (`cuMemImportFromShareableHandle`,
`cuMemMap`, `cuMemSetAccess` on the worker's GPU 0) and give it to the function as a torch
tensor. Through `__cuda_array_interface__` torch asks the driver which GPU the pointer is on
(`cudaPointerGetAttributes`), and in a process restored onto another GPU (torpord's placement:
the driver's GPU pairs swap the deploy's GPU 0 and the chosen one under it) driver 580 answers
the physical ordinal for such memory, not the process's: on a node of two H200s a worker placed
on GPU 1 got a tensor on its cuda:1 over memory mapped for its cuda:0, and the first use failed
("invalid argument", or an illegal address from a kernel: bench/sandbox/placed_pointer_probe.py,
docs/sandboxes.md, "On a node of several GPUs"). DLPack carries the device with the pointer (`kDLCUDA`, ordinal),
and torch's `from_dlpack` takes it as given, so the tensor is on the GPU the mapping was made for.

A dtype DLPack cannot name (torch's float8 types) is refused; callers pass bytes and view them.
The capsule is the legacy `DLManagedTensor` one (`"dltensor"`), which torch, NumPy and CuPy all
take. `keep` (the object owning the mapping) is held until the consumer calls the tensor's
deleter, i.e. until the last tensor or view of it is gone, or until the capsule itself goes
unconsumed. ctypes here, not a compiled extension: the worker carries no build of its own, and
these are four C structs and three calls of Python's C API.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import threading
from typing import Any

# DLPack's device types (dlpack.h).
KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1

_CAPSULE_NAME = b"dltensor"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# What each capsule's tensor holds, by its manager_ctx: the structs and `keep`.
_live: dict[int, tuple[_DLManagedTensor, Any, Any]] = {}
_live_lock = threading.Lock()
_ids = itertools.count(1)


def _release(ctx: int | None) -> None:
    if ctx is not None:
        with _live_lock:
            _live.pop(ctx, None)


def _on_delete(managed: Any) -> None:
    # The consumer's tensor is gone: what it held goes.
    _release(managed.contents.manager_ctx)


def _on_capsule_gone(capsule: int | None) -> None:
    # A consumer renames the capsule it took ("used_dltensor") and calls the deleter itself;
    # one never consumed still holds its tensor.
    if capsule and _capsule_is_valid(capsule, _CAPSULE_NAME):
        managed = ctypes.cast(_capsule_pointer(capsule, _CAPSULE_NAME), ctypes.POINTER(_DLManagedTensor))
        _release(managed.contents.manager_ctx)


# Module-level, so the C function pointers outlive every capsule and tensor.
_deleter = _Deleter(_on_delete)
_capsule_gone = _CapsuleDestructor(_on_capsule_gone)


def live() -> int:
    """How many tensors handed out still hold their memory (for tests)."""
    with _live_lock:
        return len(_live)


# DLPack's type codes (dlpack.h) by dtype name (torch's and NumPy's names): (code, bits).
DTYPES = {
    "bool": (6, 8),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
    "bfloat16": (4, 16),
    "complex64": (5, 64), "complex128": (5, 128),
}


class Tensor:
    """A C-contiguous tensor of `shape` and `dtype` (a name of `DTYPES`) at `va` on device
    (`device_type`, `ordinal`), for any DLPack consumer (`__dlpack__`, `__dlpack_device__`):
    `torch.from_dlpack(Tensor(...))`, `cupy.from_dlpack`. Each `__dlpack__` gives a capsule
    holding `keep`."""

    def __init__(
        self,
        va: int,
        shape: tuple[int, ...],
        dtype: str,
        ordinal: int,
        keep: Any,
        device_type: int = KDL_CUDA,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"DLPack has no type for {dtype!r}: one of {', '.join(DTYPES)}")
        self.va, self.shape, self.dtype, self.ordinal = va, shape, dtype, ordinal
        self.keep, self.device_type = keep, device_type

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device_type, self.ordinal)

    def __dlpack__(self, **_consumer: Any) -> Any:
        # The consumer's stream needs no wait: torpord's memory was filled and synchronised
        # before it was handed over, and nothing of this process writes it.
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        code, bits = DTYPES[self.dtype]
        managed = _DLManagedTensor()
        managed.dl_tensor.data = self.va
        managed.dl_tensor.device = _DLDevice(self.device_type, self.ordinal)
        managed.dl_tensor.ndim = ndim
        managed.dl_tensor.dtype = _DLDataType(code, bits, 1)
        managed.dl_tensor.shape = shape
        # NULL strides: compact, row-major.
        managed.dl_tensor.strides = None
        managed.dl_tensor.byte_offset = 0
        ctx = next(_ids)
        managed.manager_ctx = ctx
        managed.deleter = _deleter
        with _live_lock:
            _live[ctx] = (managed, shape, self.keep)
        try:
            return _capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, _capsule_gone)
        except BaseException:
            _release(ctx)
            raise


def torch_tensor(va: int, shape: tuple[int, ...], dtype: str, ordinal: int, keep: Any) -> Any:
    """A torch tensor of `shape` and `dtype` at `va` on `cuda:{ordinal}`, holding `keep` while
    it or any view of it lives."""
    torch: Any = importlib.import_module("torch")
    return torch.from_dlpack(Tensor(va, shape, dtype, ordinal, keep))
