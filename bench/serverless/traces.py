"""Synthetic invocation traces with the three arrival patterns that the Azure Functions trace
characterisation describes (Shahrad et al., "Serverless in the Wild", USENIX ATC 2020): most
functions are invoked rarely and irregularly, a large share by timers, and the rest in bursts.

    sporadic  Poisson arrivals with a long mean gap: requests come rarely and at random, so a
              function is usually cold (or stepped down) when the next one comes.
              Parameter: mean_gap_s (default duration / 6, i.e. about 6 requests per trace).
    periodic  a timer: one request every interval_s (default duration / 15), each shifted by a
              uniform jitter of at most ±jitter (default 2 %) of the interval, first one at
              interval_s / 2.
    bursty    quiet periods, then bursts: a burst every burst_every_s (default duration / 3, each
              start shifted by up to ±10 %), the first at duration / 10; a burst is burst_size
              requests (default 12) arriving uniformly at random within burst_window_s (default
              1 s), more than one instance can serve at once, so a burst scales out.

Defaults scale with the trace's duration, so a trace of a few minutes keeps the shape of the
hours-long original: the ratios between gaps and keep-alive delays are what matter, and the
benchmark scales the keep-alive delays with the duration too (run.py). Everything is seeded: the
same pattern, duration, seed and parameters give the same trace.

    python3 bench/serverless/traces.py sporadic --duration 60 --seed 1     prints the trace as JSON
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass

PATTERNS = ("sporadic", "periodic", "bursty")


@dataclass(frozen=True)
class Params:
    """Every knob of the three patterns; None means "scaled from the duration" (see the module doc)."""

    mean_gap_s: float | None = None  # sporadic
    interval_s: float | None = None  # periodic
    jitter: float = 0.02  # periodic, fraction of the interval
    burst_every_s: float | None = None  # bursty
    burst_size: int = 12  # bursty
    burst_window_s: float = 1.0  # bursty


@dataclass(frozen=True)
class Trace:
    pattern: str
    duration_s: float
    seed: int
    params: dict[str, float | int]  # the resolved parameters
    arrivals_s: list[
        float
    ]  # offsets from the trace's start, sorted, each in [0, duration)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def sporadic(rng: random.Random, duration: float, mean_gap_s: float) -> list[float]:
    out, t = [], rng.expovariate(1 / mean_gap_s)
    while t < duration:
        out.append(t)
        t += rng.expovariate(1 / mean_gap_s)
    if not out:  # a trace with no request measures nothing: keep one, at a random time
        out.append(rng.uniform(0, duration))
    return out


def periodic(
    rng: random.Random, duration: float, interval_s: float, jitter: float
) -> list[float]:
    out, k = [], 0
    while (base := interval_s / 2 + k * interval_s) < duration:
        out.append(
            min(
                max(0.0, base + rng.uniform(-jitter, jitter) * interval_s),
                duration - 1e-3,
            )
        )
        k += 1
    return out


def bursty(
    rng: random.Random,
    duration: float,
    burst_every_s: float,
    burst_size: int,
    burst_window_s: float,
) -> list[float]:
    out, start = [], duration / 10
    while start < duration:
        s = max(0.0, start + rng.uniform(-0.1, 0.1) * burst_every_s)
        out += [
            t
            for t in (s + rng.uniform(0, burst_window_s) for _ in range(burst_size))
            if t < duration
        ]
        start += burst_every_s
    return out


def generate(
    pattern: str, duration_s: float, seed: int = 1, params: Params | None = None
) -> Trace:
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; one of {', '.join(PATTERNS)}")
    if duration_s <= 0:
        raise ValueError(f"the duration must be > 0 s, got {duration_s}")
    p = params or Params()
    # One generator per (pattern, seed): the three patterns of one seed are independent.
    rng = random.Random(f"{pattern}:{seed}")
    resolved: dict[str, float | int]
    if pattern == "sporadic":
        resolved = {"mean_gap_s": p.mean_gap_s or duration_s / 6}
        arrivals = sporadic(rng, duration_s, float(resolved["mean_gap_s"]))
    elif pattern == "periodic":
        resolved = {"interval_s": p.interval_s or duration_s / 15, "jitter": p.jitter}
        arrivals = periodic(rng, duration_s, float(resolved["interval_s"]), p.jitter)
    else:
        resolved = {
            "burst_every_s": p.burst_every_s or duration_s / 3,
            "burst_size": p.burst_size,
            "burst_window_s": p.burst_window_s,
        }
        arrivals = bursty(
            rng,
            duration_s,
            float(resolved["burst_every_s"]),
            p.burst_size,
            p.burst_window_s,
        )
    return Trace(
        pattern, duration_s, seed, resolved, sorted(round(t, 6) for t in arrivals)
    )


def superposed(pattern: str, duration_s: float, seed: int = 1, clients: int = 1) -> Trace:
    """`clients` independent traces of `pattern` (seeds seed, seed + 1, ...) as one: the same
    shape, `clients` times the load (bench/serverless/run.py --clients: a load that the GPU may
    not keep up with, for a throughput comparison). One client is generate()'s trace."""
    if clients < 1:
        raise ValueError(f"clients must be at least 1, got {clients}")
    traces = [generate(pattern, duration_s, seed + i) for i in range(clients)]
    if clients == 1:
        return traces[0]
    arrivals = sorted(t for tr in traces for t in tr.arrivals_s)
    return Trace(pattern, duration_s, seed, {**traces[0].params, "clients": clients}, arrivals)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("pattern", choices=PATTERNS)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    print(json.dumps(generate(a.pattern, a.duration, a.seed).to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
