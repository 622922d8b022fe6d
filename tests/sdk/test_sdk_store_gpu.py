"""torpor.store's CUDA values on the SDK's side, where no daemon or GPU is needed: what counts as
one, the refusals that come before any driver call (outside a sandbox, not one block of bytes,
empty), and the metadata a put records. The put and get themselves run through torpord in
tests/daemon/test_daemon_store_fake_gpu.py (fake GPUs) and test_daemon_store_gpu.py (real)."""

from __future__ import annotations

from typing import Any

import pytest

import torpor
from torpor import store, store_gpu


class Device:
    def __init__(self, index: int) -> None:
        self.index = index


class Cuda:
    """An array-interface object (as CuPy's or Numba's) over a made-up address: never touched."""

    def __init__(self, shape: tuple[int, ...], typestr: str = "<f4", strides: tuple[int, ...] | None = None, device: int = 1) -> None:
        self.device = Device(device)
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": shape, "typestr": typestr, "data": (0x7F0000000000, False), "version": 3, "strides": strides,
        }


def test_an_array_interface_object_is_a_cuda_value_and_records_what_it_is() -> None:
    assert store_gpu.is_cuda(Cuda((2, 3)))
    assert not store_gpu.is_cuda(b"bytes") and not store_gpu.is_cuda(memoryview(b"x"))
    src = store_gpu.source(Cuda((2, 3), strides=(12, 4)))
    assert (src.ptr, src.nbytes, src.ordinal) == (0x7F0000000000, 24, 1)
    assert src.meta == {"kind": "cuda", "typestr": "<f4", "shape": [2, 3], "device": "cuda:1"}


def test_a_non_contiguous_value_is_refused_with_the_fix() -> None:
    with pytest.raises(store_gpu.StoreGpuError, match=r"non-contiguous.*contiguous") as e:
        store_gpu.source(Cuda((2, 3), strides=(4, 8)))
    assert "\n" not in str(e.value)


def test_a_cuda_value_outside_a_sandbox_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "_remote", None)
    with pytest.raises(RuntimeError, match=r"sandbox = true.*gpus = 1"):
        torpor.put("k", Cuda((4,)), shared=True)
    # Nothing was stored on the way.
    with pytest.raises(KeyError):
        torpor.get("k")


def test_an_empty_cuda_value_is_refused_before_torpord_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    def put_gpu(*args: Any) -> None:
        asked.append(args)

    monkeypatch.setattr(store, "_remote", (None, None, put_gpu))
    with pytest.raises(ValueError, match="empty tensor"):
        torpor.put("k", Cuda((0, 3)), shared=True)
    assert asked == []
