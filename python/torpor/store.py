"""The communication store: hand a value from one function to another without a copy.

    torpor.put("frame-17/boxes", boxes)            # in one function's request
    boxes = torpor.get("frame-17/boxes")           # in another's: the same object

Within one worker process (one sandbox, docs/sandboxes.md: the functions of one tenant and
workflow) `get` returns the very object `put` was given: no copy, no serialisation, whatever
the object is (a NumPy array, a torch tensor on the GPU, a dict). A key holds one value until
it is consumed (`get`, unless keep=True) or expires (`ttl_s` after the put, default 600 s); an
expired or consumed value is dropped, so its memory goes back as soon as nothing else holds
it. Keys are scoped by tenant by construction: a sandbox only ever hosts one tenant's functions.

What is not built (docs/sandboxes.md, "Limitations"): the paths between processes (another
sandbox of the tenant through shared memory the daemon hands over, exported GPU memory, peer
copies, other nodes). A `get` of a key put in another process raises KeyError naming this.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_TTL_S = 600.0
MAX_TTL_S = 86_400.0
MAX_KEY = 256


@dataclass
class _Item:
    value: Any
    expires: float  # time.monotonic()


_lock = threading.Lock()
_items: dict[str, _Item] = {}


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        raise TypeError(f"a store key is a non-empty string of at most {MAX_KEY} characters, got {key!r}")
    return key


def _sweep(now: float) -> None:
    for k in [k for k, item in _items.items() if item.expires <= now]:
        del _items[k]


def put(key: str, value: Any, ttl_s: float = DEFAULT_TTL_S) -> None:
    """Store `value` under `key` (replacing what the key held) until it is consumed or `ttl_s`
    seconds pass. No copy is made: a get in this process returns this object."""
    _check_key(key)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
    now = time.monotonic()
    with _lock:
        _sweep(now)
        _items[key] = _Item(value, now + float(ttl_s))


def get(key: str, keep: bool = False) -> Any:
    """The value put under `key`, consumed (the key is freed) unless keep=True. KeyError when
    no value is there: never put, consumed, expired, or put by another process."""
    _check_key(key)
    now = time.monotonic()
    with _lock:
        _sweep(now)
        item = _items.get(key) if keep else _items.pop(key, None)
    if item is None:
        raise KeyError(
            f"no value under store key {key!r} in this sandbox: it was never put here, was consumed "
            "by an earlier get, or expired (put(..., ttl_s=...) keeps it longer); values put by another "
            "sandbox are not reachable yet (docs/sandboxes.md)"
        )
    return item.value


def keys() -> list[str]:
    """The keys that hold a value now."""
    with _lock:
        _sweep(time.monotonic())
        return sorted(_items)


def clear() -> None:
    """Drop every value (tests)."""
    with _lock:
        _items.clear()
