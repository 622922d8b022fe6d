"""JAX (XLA_PYTHON_CLIENT_PREALLOCATE=false, as Torpor's runtime sets it): jit-compiled layers on
weights that live on the GPU."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
from compat_common import digest, serve

REQUIRES = ("jax",)
EXPECT = "identical"
RESTORES = 5  # its driver restore failed once in two (issue 16): count the attempts

key = jax.random.PRNGKey(10)
w1 = jax.random.normal(key, (256, 512))
w2 = jax.random.normal(jax.random.fold_in(key, 1), (512, 64))
x = jnp.ones((32, 256))


@jax.jit
def forward(x: jax.Array) -> jax.Array:
    return jax.nn.softmax(jnp.tanh(x @ w1) @ w2, axis=-1)


def compute() -> str:
    import numpy as np

    return digest(np.asarray(forward(x)))


serve(compute)
