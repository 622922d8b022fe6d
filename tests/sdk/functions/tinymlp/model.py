"""TinyMLP: a 4-8-3 multilayer perceptron in pure Python, for the SDK tests.

Requests:
    {"x": [4 numbers]}   -> {"y": [3 probabilities], "calls": n}
    {"fail": "text"}     -> raises ValueError("text") (a user exception)
    {"bad_value": true}  -> returns a set, which JSON cannot carry
    {"weird": true}      -> raises an exception whose str() itself raises
    {"echo": value}      -> {"echo": value, "calls": n}
Every request counts in `calls` (the warm-up request too), so a restored instance shows the
state it was snapshotted with.
"""

from __future__ import annotations

import array
import math
import sys
from typing import Any

import torpor

IN, HIDDEN, OUT = 4, 8, 3


class WeirdError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@torpor.function
class TinyMLP:
    def setup(self) -> None:
        w = array.array("f")
        w.frombytes(torpor.load_bytes("weights"))
        if sys.byteorder != "little":
            w.byteswap()
        params = list(w)
        if len(params) != IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT:
            raise ValueError(f"weights hold {len(params)} floats; expected a {IN}-{HIDDEN}-{OUT} MLP")
        at = 0

        def take(n: int) -> list[float]:
            nonlocal at
            at += n
            return params[at - n : at]

        self.w1 = [take(HIDDEN) for _ in range(IN)]
        self.b1 = take(HIDDEN)
        self.w2 = [take(OUT) for _ in range(HIDDEN)]
        self.b2 = take(OUT)
        self.weights_path = str(torpor.load("weights"))
        self.calls = 0

    def __call__(self, request: dict[str, Any]) -> Any:
        self.calls += 1
        if "fail" in request:
            raise ValueError(request["fail"])
        if "weird" in request:
            raise WeirdError()
        if "bad_value" in request:
            return {1, 2}
        if "echo" in request:
            return {"echo": request["echo"], "calls": self.calls}
        x = request["x"]
        h = [max(0.0, self.b1[j] + sum(x[i] * self.w1[i][j] for i in range(IN))) for j in range(HIDDEN)]
        z = [self.b2[k] + sum(h[j] * self.w2[j][k] for j in range(HIDDEN)) for k in range(OUT)]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        return {"y": [v / sum(e) for v in e], "calls": self.calls}
