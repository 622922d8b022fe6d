"""torpor.store_gpu's kept mappings (docs/sandboxes.md, "Kept mappings") in one process over the
fake driver (tests/fakes: VMM memory is memfd memory, so the mappings are real): a block named
by torpord is mapped once and kept across its gets and puts, each get's end is queued for
torpord after the context is synchronised, a block torpord lets go of is unmapped at once or
when the object using it goes, idle mappings beyond MAX_KEPT and every one at a quiet point go.
The daemon's side runs in tests/daemon/test_daemon_store_fake_gpu.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import FakeCuda

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import ctypes, json, os
from torpor import cuda_driver, store_gpu

cuda = store_gpu.driver()
GRANULE = 2 << 20


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8),
                ("reserved", ctypes.c_ubyte * 8)]


def make() -> int:
    """New exportable memory of one granule (as torpord makes it): an fd of it."""
    handle = ctypes.c_uint64()
    prop = Prop(1, 1, 1, 0)
    rc = cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(GRANULE), ctypes.byref(prop), ctypes.c_ulonglong(0))
    assert rc == 0, rc
    fd = ctypes.c_int()
    rc = cuda.cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_uint64(handle.value), 1, ctypes.c_ulonglong(0))
    assert rc == 0, rc
    return fd.value


def maps() -> set:
    with open("/proc/self/maps") as f:
        return {int(l.split()[4]) for l in f if "fake-cuda-memory" in l}


class Src:
    pass


out = {}
fd = make()
ino = os.fstat(fd).st_ino
# A put into block 1 maps it writable and keeps it; the next put of block 1 maps nothing.
# The value: device memory of its own (another mapping of fake VMM memory).
own = store_gpu._Mapping(make(), GRANULE, 0, writable=True)
ctypes.memmove(own.va, b"abc" * 1000, 3000)
src = store_gpu.Source(own.va, 3000, 0, {})
for i in range(2):
    store_gpu.start_steps()
    store_gpu.fill(os.dup(fd), GRANULE, src, None, block=1)
    out[f"put{i}"] = list(store_gpu.steps())
out["after_puts"] = [store_gpu.kept_blocks(), ino in maps()]
# Gets of it: the kept mapping again; each end queued for torpord, the mapping kept.
store_gpu.start_steps()
a = store_gpu.CudaArray(os.dup(fd), GRANULE, 3000, {"shape": [3000]}, "stored", block=1)
out["get_steps"] = list(store_gpu.steps())
out["bytes"] = ctypes.string_at(a.va, 6).decode()
a.close()
out["released"] = store_gpu.take_releases()
out["released_again"] = store_gpu.take_releases()
# torpord lets go of block 1 while a got object uses it: unmapped only when that object goes.
b = store_gpu.CudaArray(os.dup(fd), GRANULE, 3000, {"shape": [3000]}, "stored", block=1)
store_gpu.unmap_blocks([1])
out["in_use"] = [ino in maps(), ctypes.string_at(b.va, 3).decode()]
del b
out["after_use"] = [store_gpu.kept_blocks(), ino in maps(), store_gpu.take_releases()]
# Idle kept mappings beyond MAX_KEPT go, the least recently used first.
fds = {block: make() for block in range(10, 10 + store_gpu.MAX_KEPT + 2)}
for block, f in fds.items():
    store_gpu.CudaArray(os.dup(f), GRANULE, 1, {}, "stored", block=block).close()
out["lru"] = store_gpu.kept_blocks()
out["lru_released"] = store_gpu.take_releases()
# A quiet point: every kept mapping goes.
out["dropped"] = store_gpu.drop_kept()
out["after_quiet"] = [store_gpu.kept_blocks(), len(maps())]
own.close()
# Leases: one thread takes it (the slot is empty for another, which gives nothing back); one of
# another size class is let go of and said so; so is one dropped at a quiet point.
lfd = make()
store_gpu.set_lease(store_gpu.Lease(50, GRANULE, 1, 0, os.dup(lfd)))
taken = store_gpu.take_lease(3000, 0)
out["lease_taken"] = [taken is not None and taken.block, store_gpu.take_lease(3000, 0), store_gpu.take_unleased()]
os.close(taken.fd)
store_gpu.set_lease(store_gpu.Lease(51, GRANULE, GRANULE // 2, 0, os.dup(lfd)))
out["lease_other_size"] = [store_gpu.take_lease(3000, 0), store_gpu.take_unleased()]
store_gpu.set_lease(store_gpu.Lease(52, GRANULE, 1, 0, os.dup(lfd)))
store_gpu.drop_kept()
out["lease_quiet"] = [store_gpu.take_lease(3000, 0), store_gpu.take_unleased()]
# Memory without a block is mapped for its get alone.
c = store_gpu.CudaArray(os.dup(fd), GRANULE, 3000, {}, "peer")
c.close()
out["no_block"] = [store_gpu.kept_blocks(), store_gpu.take_releases(), ino in maps()]
print(json.dumps(out))
'''


def test_a_block_is_mapped_once_released_per_get_and_unmapped_when_let_go(fake_cuda: FakeCuda, tmp_path: Path) -> None:
    # The fake driver with its VMM calls (as tests/daemon's fake_gpu_env builds it).
    lib = tmp_path / "libcuda.so.1"
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (the fake_cuda fixture has one)"
    subprocess.run([cc, "-shared", "-fPIC", "-DFAKE_CUDA_VMM", "-o", lib, ROOT / "tests" / "fakes" / "fake_libcuda.c"], check=True)
    env = {
        **os.environ,
        "TORPOR_LIBCUDA": str(lib),
        "TORPOR_LIBNVML": str(fake_cuda.nvml),
        "FAKE_CUDA_PIDS": "*",
        "FAKE_CUDA_DEFAULT_STATE": "any",
        "PYTHONPATH": str(ROOT / "python"),
    }
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "import" in out["put0"] and "kept" not in out["put0"], out["put0"]
    assert "kept" in out["put1"] and "import" not in out["put1"] and "unmap" not in out["put1"], out["put1"]
    assert out["after_puts"] == [[1], True], "the put's mapping is kept"
    assert out["get_steps"] == ["kept"], "a get of the put's block maps nothing"
    assert out["bytes"] == "abcabc"
    assert out["released"] == [1] and out["released_again"] == []
    assert out["in_use"] == [True, "abc"], "unmapped under an object still using it"
    assert out["after_use"] == [[], False, [1]], "let go of and unused: unmapped, its get released"
    # Each new mapping evicts the idle ones beyond MAX_KEPT (8): the newest one on top of them.
    blocks = list(range(10, 10 + 8 + 2))
    assert out["lru"] == blocks[1:], out["lru"]
    assert out["lru_released"] == blocks
    assert out["dropped"] == 9 and out["after_quiet"] == [[], 1], "the value's own memory alone is mapped"
    assert out["no_block"] == [[], [], False]
    assert out["lease_taken"] == [50, None, []], "a put without the lease gives back nothing"
    assert out["lease_other_size"] == [None, [51]] and out["lease_quiet"] == [None, [52]]
