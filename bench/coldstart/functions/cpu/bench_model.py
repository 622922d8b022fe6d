"""The split benchmark's CPU function: state in device-memory hook segments on the host backend.

- `weights`: read-only declared data, torpor.load(name, buffer=True) (a sealed segment);
- `table`: a torpor.buffer() derived from the weights in setup(), only read afterwards (the
  daemon's warm-up probe finds it unchanged: read-only);
- `scratch`: a torpor.buffer() every request writes (writable).
Without the hook (a daemon with `split = false`) the same bytes live in ordinary memory.

A file `anon.bytes` beside this module (split.assemble writes it for `--cpu-anon-mib`) holds a
count of bytes of random anonymous memory the function keeps from setup on: a CRIU image of a
GPU worker's size (GPT-2-Large's: ~1.5 GB of pages) for CPU-only runs of the pull benchmark.

Request:  {"seed": n, "hold_s": s?}   hold_s: sleep after computing, to keep the instance busy
Response: {"digest": sha256 of weights + table + seed, "seed": n}
"""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path
from typing import Any

import torpor

TABLE_SIZE = 4 << 20
SCRATCH_SIZE = 1 << 20


def seed_of(request: Any) -> tuple[int, float]:
    if not isinstance(request, dict):
        raise TypeError(f'the request must be {{"seed": int, "hold_s": number?}}, got {str(request)[:100]}')
    seed, hold = request.get("seed", 0), request.get("hold_s", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 600:
        raise ValueError(f"hold_s must be a number of seconds from 0 to 600, got {hold!r}")
    return seed, float(hold)


def random_bytes(n: int) -> bytearray:
    """`n` random bytes, so that their pages neither compress nor deduplicate (made 64 MiB at a
    time: `randbytes` takes at most 2**31 bits)."""
    rng, out, step = random.Random(0), bytearray(n), 64 << 20
    for at in range(0, n, step):
        out[at:at + step] = rng.randbytes(min(step, n - at))
    return out


def weight_names() -> list[str]:
    """`weights`, then `weights-1`, `weights-2`, … as far as torpor.toml declares them
    (split.py --cpu-weights-parts: the same bytes in several segments)."""
    declared = torpor.declared()
    names = ["weights"]
    while f"weights-{len(names)}" in declared:
        names.append(f"weights-{len(names)}")
    return names


@torpor.function
class BenchCpu:
    def setup(self) -> None:
        names = weight_names()
        try:
            self.weights = [torpor.load(n, buffer=True) for n in names]
            self.table = torpor.buffer(TABLE_SIZE)
            self.scratch = torpor.buffer(SCRATCH_SIZE)
        except torpor.HookError:
            # The transparent path: no hook, the same bytes in ordinary memory.
            self.weights = [memoryview(torpor.load_bytes(n)) for n in names]
            self.table = memoryview(bytearray(TABLE_SIZE))
            self.scratch = memoryview(bytearray(SCRATCH_SIZE))
        block = self.hash_weights(hashlib.sha256()).digest()
        self.table[:] = block * (TABLE_SIZE // len(block))
        self.calls = 0
        anon = Path(__file__).with_name("anon.bytes")
        self.anon = random_bytes(int(anon.read_text())) if anon.is_file() else bytearray()

    def hash_weights(self, h: Any) -> Any:
        """`h` updated with the weights, part after part (the same as one part of them all)."""
        for part in self.weights:
            h.update(part)
        return h

    def answer(self, seed: int) -> dict[str, Any]:
        h = self.hash_weights(hashlib.sha256())
        h.update(self.table)
        h.update(str(seed).encode())
        return {"digest": h.hexdigest(), "seed": seed}

    def __call__(self, request: Any) -> dict[str, Any]:
        seed, hold = seed_of(request)
        self.calls += 1
        self.scratch[:8] = self.calls.to_bytes(8, "little")
        out = self.answer(seed)
        time.sleep(hold)
        return out


@torpor.function
class BenchCpuEmbed(BenchCpu):
    """Same weights and table, another answer (the dedup measurement's second function)."""

    def answer(self, seed: int) -> dict[str, Any]:
        h = self.hash_weights(hashlib.blake2b(self.table, digest_size=32))
        h.update(str(seed).encode())
        return {"embedding": h.hexdigest(), "seed": seed}
