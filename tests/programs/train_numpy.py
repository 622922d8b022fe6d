"""A small, deterministic CPU training loop for checkpoint tests: a two-layer MLP (numpy) fitted by
full-batch gradient descent to fixed synthetic regression data. Prints `step N loss L` per step,
with L as repr() of a float64, so two runs can be compared bit for bit.

    python3 train_numpy.py --steps 300 --sleep 0.05        # under torpor run
    python3 train_numpy.py --steps 300 --sleep 0 --quiet   # the reference curve, in-process
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def curve(steps: int, sleep: float, out: object | None) -> list[float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32))
    true_w = rng.standard_normal((32, 1))
    y = np.tanh(x @ true_w) + 0.1 * rng.standard_normal((512, 1))
    w1 = rng.standard_normal((32, 64)) * 0.1
    b1 = np.zeros(64)
    w2 = rng.standard_normal((64, 1)) * 0.1
    b2 = np.zeros(1)
    lr = 0.05
    losses = []
    for step in range(1, steps + 1):
        h = np.tanh(x @ w1 + b1)
        pred = h @ w2 + b2
        err = pred - y
        loss = float(np.mean(err**2))
        losses.append(loss)
        if out is not None:
            print(f"step {step} loss {loss!r}", file=out, flush=True)  # type: ignore[call-overload]
        g = 2 * err / len(x)
        gw2 = h.T @ g
        gb2 = g.sum(0)
        gh = (g @ w2.T) * (1 - h**2)
        gw1 = x.T @ gh
        gb1 = gh.sum(0)
        w1 -= lr * gw1
        b1 -= lr * gb1
        w2 -= lr * gw2
        b2 -= lr * gb2
        if sleep:
            time.sleep(sleep)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.05)
    args = ap.parse_args()
    curve(args.steps, args.sleep, sys.stdout)
    print("done", flush=True)


if __name__ == "__main__":
    main()
