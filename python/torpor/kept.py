"""The outcomes of a worker's requests that came with an idempotency key.

torpord answers a client's retry of a keyed request from its own table (crates/torpord/src/
idempotency.rs). That table dies with the daemon. The worker outlives it, so it keeps each keyed
outcome here for TTL_S seconds. When it reattaches to a new daemon, it names the keys in its
`hello` and then sends one `settled` frame for each. A retry that reaches the new daemon then
gets the answer of the run that already happened, and the function does not run twice.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

# As long as torpord keeps an answer (idempotency::TTL); as many, and as many bytes, as a worker
# holds (its memory counts against its limit): past either, the oldest go, and their retries run.
TTL_S = 600.0
MAX_KEPT = 1024
MAX_KEPT_BYTES = 64 << 20

Slot = tuple[str | None, str]  # (the sandbox's function, or None; the key)


class KeptAnswers:
    """Keyed requests running and answered, oldest first; safe to use from request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[Slot, str] = {}
        self._done: OrderedDict[Slot, tuple[float, str, dict[str, Any], int]] = OrderedDict()
        self._bytes = 0

    def begin(self, slot: Slot, fingerprint: str) -> None:
        with self._lock:
            self._running[slot] = fingerprint

    def end(self, slot: Slot, result: dict[str, Any], size: int) -> None:
        """The request of `slot` ended with the `result` frame `result`, `size` bytes encoded."""
        now = time.monotonic()
        with self._lock:
            fingerprint = self._running.pop(slot, None)
            if fingerprint is None or size > MAX_KEPT_BYTES:
                return
            old = self._done.pop(slot, None)
            if old is not None:
                self._bytes -= old[3]
            self._done[slot] = (now, fingerprint, result, size)
            self._bytes += size
            while self._done:
                first = next(iter(self._done.values()))
                if len(self._done) <= MAX_KEPT and self._bytes <= MAX_KEPT_BYTES and now - first[0] < TTL_S:
                    break
                self._bytes -= self._done.popitem(last=False)[1][3]

    def held(self) -> list[dict[str, Any]]:
        """hello's `keys`: every key answered or running."""
        with self._lock:
            slots = [(s, kept[1]) for s, kept in self._done.items()] + list(self._running.items())
        return [_named({"key": key, "fingerprint": fp}, function) for (function, key), fp in slots]

    def settled(self, slot: Slot) -> dict[str, Any] | None:
        """The `settled` frame of an answered key, or None."""
        with self._lock:
            kept = self._done.get(slot)
        if kept is None:
            return None
        _, fingerprint, result, _ = kept
        frame = {"type": "settled", "key": slot[1], "fingerprint": fingerprint}
        for field in ("ok", "value", "error", "handler_s"):
            if field in result:
                frame[field] = result[field]
        return _named(frame, slot[0])

    def answered(self) -> list[Slot]:
        with self._lock:
            return list(self._done)


def _named(frame: dict[str, Any], function: str | None) -> dict[str, Any]:
    if function is not None:
        frame["function"] = function
    return frame
