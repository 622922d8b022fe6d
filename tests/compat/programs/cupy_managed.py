"""CuPy on managed memory (UVM): the driver's checkpoint cannot restore it, so the snapshot must
be refused before the driver is touched, and the program must keep answering."""

from __future__ import annotations

import cupy
from compat_common import digest, serve

REQUIRES = ("cupy",)
EXPECT = "refused"

cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
rng = cupy.random.default_rng(4)
a = rng.standard_normal((512, 512), dtype=cupy.float32)


def compute() -> str:
    return digest(cupy.tanh(a @ a))


serve(compute)
