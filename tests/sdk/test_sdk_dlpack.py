"""torpor.dlpack: memory handed to a framework as a DLPack tensor on the device named.

On the CPU with NumPy as the consumer (the same capsule protocol torch's `from_dlpack` takes):
values, dtypes and shapes, the device given back, the owner held for as long as any view lives
and let go after, an unconsumed capsule letting go too, and a dtype DLPack cannot name refused.
The GPU side (a worker restored onto GPU 1 wrapping torpord's memory as a tensor on its cuda:0)
is tests/daemon/test_daemon_store_gpu.py on a node of two GPUs.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest
from torpor import dlpack


class Owner:
    """Stands for the mapping a tensor keeps alive."""


def cpu_tensor(buf: ctypes.Array[ctypes.c_ubyte], shape: tuple[int, ...], dtype: str, keep: object) -> dlpack.Tensor:
    return dlpack.Tensor(ctypes.addressof(buf), shape, dtype, 0, keep, device_type=dlpack.KDL_CPU)


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "int64", "int8", "uint8", "uint16", "bool", "complex64"]
)
def test_a_tensor_has_the_values_dtype_and_shape_of_the_memory(dtype: str) -> None:
    want = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    buf = (ctypes.c_ubyte * want.nbytes).from_buffer_copy(want.tobytes())
    got = np.from_dlpack(cpu_tensor(buf, (2, 3, 4), dtype, Owner()))
    assert got.dtype == want.dtype and got.shape == (2, 3, 4)
    assert np.array_equal(got, want)
    # No copy: the array is the memory.
    assert got.__array_interface__["data"][0] == ctypes.addressof(buf)


def test_the_device_is_the_one_named() -> None:
    t = dlpack.Tensor(0x7000_0000, (4,), "uint8", 3, Owner())
    assert t.__dlpack_device__() == (dlpack.KDL_CUDA, 3)


def test_the_owner_lives_while_any_view_does_and_goes_after() -> None:
    buf = (ctypes.c_ubyte * 16)(*range(16))
    owner = Owner()
    gone = weakref.ref(owner)
    before = dlpack.live()
    a = np.from_dlpack(cpu_tensor(buf, (16,), "uint8", owner))
    del owner
    view = a[4:6]
    del a
    gc.collect()
    assert gone() is not None and dlpack.live() == before + 1
    assert list(view) == [4, 5]
    del view
    gc.collect()
    assert gone() is None and dlpack.live() == before


def test_a_capsule_never_consumed_lets_its_owner_go() -> None:
    buf = (ctypes.c_ubyte * 8)()
    owner = Owner()
    gone = weakref.ref(owner)
    before = dlpack.live()
    capsule = cpu_tensor(buf, (8,), "uint8", owner).__dlpack__(stream=None)
    del owner
    gc.collect()
    assert gone() is not None and dlpack.live() == before + 1
    del capsule
    gc.collect()
    assert gone() is None and dlpack.live() == before


def test_a_scalar_and_an_empty_tensor() -> None:
    buf = (ctypes.c_ubyte * 8).from_buffer_copy(np.array(2.5).tobytes())
    assert np.from_dlpack(cpu_tensor(buf, (), "float64", Owner())) == 2.5
    empty = np.from_dlpack(cpu_tensor(buf, (0, 4), "float32", Owner()))
    assert empty.shape == (0, 4)


def test_a_dtype_dlpack_cannot_name_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dlpack.Tensor(0, (1,), "float8_e4m3fn", 0, Owner())
