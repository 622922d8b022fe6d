"""Write weights.f32, the cpu-mlp example's weights: a 16-32-4 MLP, float32 little-endian, in the
order W1 (16x32, row-major), b1 (32), W2 (32x4), b2 (4). Deterministic (a fixed-seed generator),
so the file in the repository can always be recreated: python3 make_weights.py
"""

from __future__ import annotations

import array
import random
import sys
from pathlib import Path

IN, HIDDEN, OUT = 16, 32, 4


def main() -> None:
    rng = random.Random(20261122)
    count = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
    w = array.array("f", (rng.gauss(0.0, 0.5) for _ in range(count)))
    if sys.byteorder != "little":
        w.byteswap()
    out = Path(__file__).resolve().parent / "weights.f32"
    out.write_bytes(w.tobytes())
    print(f"wrote {out} ({count} floats, {count * 4} bytes)")


if __name__ == "__main__":
    main()
