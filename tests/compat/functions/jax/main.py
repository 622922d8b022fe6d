"""compat: jit-compiled JAX layers on GPU weights; answers its digest and the reference's."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torpor


@torpor.function
class Jax:
    def setup(self) -> None:
        key = jax.random.PRNGKey(23)
        self.w = jax.random.normal(key, (256, 128))
        self.x = jnp.ones((16, 256))
        self.forward = jax.jit(lambda x, w: jax.nn.softmax(jnp.tanh(x @ w), axis=-1))
        self.reference = self.run()

    def run(self) -> str:
        return hashlib.sha256(np.asarray(self.forward(self.x, self.w)).tobytes()).hexdigest()[:16]

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        got = self.run()
        return {"digest": got, "reference": self.reference, "ok": got == self.reference}
