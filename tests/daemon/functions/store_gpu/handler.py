"""A sandboxed gpus = 1 function for the communication store's GPU values
(tests/daemon/test_daemon_store_fake_gpu.py, with tests/fakes as the GPU; the real GPU's test,
test_daemon_store_gpu.py, uses torch instead).

Without torch, a CUDA value is any object with `__cuda_array_interface__`: here one over device
memory from cuMemAlloc_v2 (the hook's, preloaded into GPU workers: a segment, VMM memory the
fake driver copies from), filled by ctypes (the fake's device memory is host memory).

Every answer names its process (`process`: a token). Ops: put {key, n, seed, device?, ttl_s?, strided?, nodes?}: n bytes of pattern(seed) on the worker's GPU
`device` (default 0), put with shared=True (`steps`: the steps store_gpu timed); get {key, keep?}: the value from torpord's store,
its steps, its bytes, where it is mapped (the /proc/self/maps line of its address: permissions and inode)
and what a memset through that mapping returns (the driver's code). With torch (the real GPU's
test): put_torch {key, n, seed, device, dtype, nodes?}: a torch tensor of n values on cuda:device, put
with shared=True; get_torch {key, keep?}: the tensor got, described (dtype, shape, device, the
SHA-256 of its bytes), a memset through it tried, and the context still working after it.
Both answer `digest`, the SHA-256 of the tensor's bytes. kept: the blocks of torpord's store
memory this worker keeps mapped (`kept`) and the inodes of the fake GPU memory it maps."""

from __future__ import annotations

import ctypes
import hashlib
import os
from typing import Any

import torpor
from torpor import store_gpu

HELD: list[int] = []  # device memory put from: kept for the worker's life
TOKEN: list[str] = []  # this process's, drawn at its first request (pids are namespaced)


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


class Device:
    def __init__(self, index: int) -> None:
        self.index = index


class Cuda:
    """`n` bytes of device memory at `ptr`, as the array interface describes them."""

    def __init__(self, ptr: int, n: int, device: int, strided: bool) -> None:
        self.device = Device(device)
        self.__cuda_array_interface__ = {
            "shape": (n // 2, 2) if strided else (n,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            # Columns of a row-major array: not one block.
            "strides": (1, n // 2) if strided else None,
        }


def mapping_of(va: int) -> dict[str, Any]:
    """The /proc/self/maps line holding `va`: its permissions and the inode of what it maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= va < hi:
                return {"perms": parts[1], "inode": int(parts[4]), "path": parts[5] if len(parts) > 5 else ""}
    return {}


def mapped_inodes() -> set[int]:
    """Inodes of the fake GPU memory (memfds) this process maps."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and "fake-cuda-memory" in parts[5]:
                out.add(int(parts[4]))
    return out


@torpor.function
class StoreGpu:
    def setup(self) -> None:
        pass

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if not TOKEN:
            TOKEN.append(os.urandom(8).hex())
        out: dict[str, Any] = {"process": TOKEN[0]}
        if op == "put":
            store_gpu.driver()  # a context on this thread for the allocation
            n = int(request["n"])
            ptr = ctypes.c_uint64()
            rc = ctypes.CDLL(None).cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n))
            assert rc == 0, f"cuMemAlloc_v2: {rc}"
            HELD.append(ptr.value)
            ctypes.memmove(ptr.value, pattern(n, int(request.get("seed", 0))), n)
            value = Cuda(ptr.value, n, int(request.get("device", 0)), bool(request.get("strided")))
            nodes = {"nodes": request["nodes"]} if "nodes" in request else {}
            torpor.put(str(request["key"]), value, shared=True, ttl_s=float(request.get("ttl_s", 600)), **nodes)
            out["steps"] = list(store_gpu.steps())
        elif op == "get":
            cuda = store_gpu.driver()
            v = torpor.get(str(request["key"]), keep=bool(request.get("keep", False)))
            out["steps"] = list(store_gpu.steps())
            out["type"] = type(v).__name__
            out["source"] = v.source
            out["interface"] = {k: v.__cuda_array_interface__[k] for k in ("shape", "typestr", "data")}
            out["data"] = ctypes.string_at(v.va, v.nbytes).hex()
            out["mapping"] = mapping_of(v.va)
            # A write through the read-only mapping: the driver refuses it with an error code.
            out["memset_rc"] = int(cuda.cuMemsetD8_v2(ctypes.c_uint64(v.va), ctypes.c_ubyte(0), ctypes.c_size_t(v.nbytes)))
            out["after_memset"] = ctypes.string_at(v.va, v.nbytes).hex()
            v.close()
        elif op == "kept":
            # The store memory this worker keeps mapped (torpor.store_gpu, "Kept mappings").
            out["kept"] = store_gpu.kept_blocks()
            out["inodes"] = sorted(mapped_inodes())
        elif op == "put_torch":
            import torch

            g = torch.Generator().manual_seed(int(request.get("seed", 0)))
            dtype = getattr(torch, str(request.get("dtype", "float32")))
            device = f"cuda:{int(request.get('device', 0))}"
            t = torch.randn(int(request["n"]), generator=g).to(dtype).to(device)
            out["digest"] = digest(t)
            out["device"] = str(t.device)
            nodes = {"nodes": request["nodes"]} if "nodes" in request else {}
            torpor.put(str(request["key"]), t, shared=True, **nodes)
        elif op == "get_torch":
            import torch

            cuda = store_gpu.driver()
            v = torpor.get(str(request["key"]), keep=bool(request.get("keep", False)))
            out.update(type=type(v).__name__, dtype=str(v.dtype), shape=list(v.shape), device=str(v.device))
            out["digest"] = digest(v)
            nbytes = v.numel() * v.element_size()
            out["memset_rc"] = int(cuda.cuMemsetD8_v2(ctypes.c_uint64(v.data_ptr()), ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)))
            torch.cuda.synchronize()
            out["digest_after"] = digest(v)
            # The context still works: a kernel reads the mapping.
            out["sum"] = float(v.float().sum().item())
        return out


def digest(t: Any) -> str:
    """SHA-256 of a torch tensor's bytes (copied to the host)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
