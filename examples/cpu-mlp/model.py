"""cpu-mlp: a 16-32-4 multilayer perceptron classifier in pure Python.

Request:  {"x": [16 numbers]}
Response: {"label": index of the most likely class, "probs": [4 probabilities]}

The weights are declared data (torpor.toml, [[data]] "weights"), read once in setup().
Try it without torpord:  python3 examples/cpu-mlp/model.py '{"x": [1, 0, ...]}'
(with the repository's python/ directory on PYTHONPATH).
"""

from __future__ import annotations

import array
import math
import sys
from typing import Any

import torpor

IN, HIDDEN, OUT = 16, 32, 4


@torpor.function
class MLP:
    def setup(self) -> None:
        w = array.array("f")
        w.frombytes(torpor.load_bytes("weights"))
        if sys.byteorder != "little":
            w.byteswap()
        expected = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
        if len(w) != expected:
            raise ValueError(
                f"weights.f32 holds {len(w)} floats, a {IN}-{HIDDEN}-{OUT} MLP needs {expected}; "
                "run make_weights.py"
            )
        p = w.tolist()
        w1, at = p[: IN * HIDDEN], IN * HIDDEN
        self.b1 = p[at : at + HIDDEN]
        at += HIDDEN
        w2 = p[at : at + HIDDEN * OUT]
        at += HIDDEN * OUT
        self.b2 = p[at : at + OUT]
        # Columns, so each output is one sum over a zip.
        self.w1_cols = [w1[j::HIDDEN] for j in range(HIDDEN)]
        self.w2_cols = [w2[k::OUT] for k in range(OUT)]

    def __call__(self, request: Any) -> dict[str, Any]:
        x = request.get("x") if isinstance(request, dict) else None
        if not isinstance(x, list) or len(x) != IN or not all(isinstance(v, (int, float)) for v in x):
            raise ValueError(f'the request must be {{"x": [{IN} numbers]}}, got {str(request)[:100]}')
        h = [
            max(0.0, b + sum(a * c for a, c in zip(x, col, strict=True)))
            for b, col in zip(self.b1, self.w1_cols, strict=True)
        ]
        z = [
            b + sum(a * c for a, c in zip(h, col, strict=True))
            for b, col in zip(self.b2, self.w2_cols, strict=True)
        ]
        top = max(z)
        e = [math.exp(v - top) for v in z]
        total = sum(e)
        probs = [v / total for v in e]
        return {"label": probs.index(max(probs)), "probs": probs}


if __name__ == "__main__":
    import json
    from pathlib import Path

    torpor.use_dir(Path(__file__).resolve().parent)
    model = MLP()
    model.setup()
    print(
        json.dumps(
            model(json.loads(sys.argv[1] if len(sys.argv) > 1 else '{"x": [' + ", ".join(["1"] * IN) + "]}"))
        )
    )
