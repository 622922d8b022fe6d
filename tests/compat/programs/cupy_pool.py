"""CuPy with its default memory pool: a matmul and an elementwise kernel on GPU arrays."""

from __future__ import annotations

import cupy
from compat_common import digest, serve

REQUIRES = ("cupy",)
EXPECT = "identical"

rng = cupy.random.default_rng(5)
a = rng.standard_normal((512, 512), dtype=cupy.float32)
kernel = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x * x + 1.0f", "square_plus_one")


def compute() -> str:
    return digest(kernel(a @ a))


serve(compute)
