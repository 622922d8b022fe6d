"""Which segments a request may touch while a restore still maps them (docs/split.md).

After a split restore torpord sends one `map` frame per segment as each fill completes, and the
instance may take its first request before the last one arrives. A request must not touch a
segment before it is mapped: an unmapped host segment faults (SIGSEGV, the worker dies), an
unmapped cuda address fails the kernel and leaves the CUDA context unusable. So:

- Readiness is the generic core: the set of segments still to be mapped, and "wait until the
  segments covering these addresses are mapped", with a timeout whose error names the segment.
  The worker's map thread marks each segment mapped (or refused) as its frame is applied.
- Before a request runs, the harness waits for every pending segment except the *deferrable*
  ones (deferrable_vas): cuda segments that PyTorch's caching allocator fills entirely with the
  parameters and buffers of the function's modules, so nothing but those modules' forwards can
  touch them. Host segments, activation blocks and anything else are waited for up front; so a
  function without torch, or without modules, waits for every segment.
- module_waits installs a global forward pre-hook (as torpor.hook.recording_first_use does)
  that, before a module runs, waits for the segments holding its own CUDA parameters and
  buffers (recurse=False); it removes itself once every segment is mapped.

Limitation: a deferrable segment is waited for only when a module holding it runs forward; a
kernel launched by hand on a module's parameter outside its forward (e.g. `x @ net.fc.weight`
in the handler) may see it unmapped.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from torpor.errors import TorporError
from torpor.shareable import modules_of, segments_holding_only

# As long as torpord gives a restore to map every segment (split/server.rs MAP_TIMEOUT).
WAIT_TIMEOUT_S = 60.0


class SegmentWaitError(TorporError, RuntimeError):
    """A request needed a segment that was not mapped in time, or whose map was refused."""


class Readiness:
    """The segments still to be mapped after a restore: va -> (size, backend)."""

    def __init__(self, pending: Iterable[tuple[int, int, str]]) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[int, str]] = {va: (size, backend) for va, size, backend in pending}
        self._starts = sorted(self._pending)
        self._refused: dict[int, str] = {}

    def done(self) -> bool:
        """Whether every segment is mapped."""
        return not self._pending

    def pending(self) -> set[int]:
        with self._cond:
            return set(self._pending)

    def mapped(self, va: int) -> None:
        with self._cond:
            self._pending.pop(va, None)
            self._cond.notify_all()

    def refused(self, va: int, reason: str) -> None:
        """The map of `va` was refused: it stays unmapped, and whoever waits for it fails now."""
        with self._cond:
            self._refused[va] = reason
            self._cond.notify_all()

    def covering(self, addrs: Iterable[int]) -> set[int]:
        """The pending segments that hold any of `addrs`."""
        out: set[int] = set()
        with self._cond:
            if not self._pending:
                return out
            for addr in addrs:
                i = bisect.bisect_right(self._starts, addr) - 1
                if i >= 0:
                    va = self._starts[i]
                    seg = self._pending.get(va)
                    if seg is not None and addr < va + seg[0]:
                        out.add(va)
        return out

    def wait_for(self, addrs: Iterable[int], timeout: float = WAIT_TIMEOUT_S) -> None:
        """Returns once every segment holding one of `addrs` is mapped."""
        self.wait_segments(self.covering(addrs), timeout)

    def wait_all(self, timeout: float = WAIT_TIMEOUT_S) -> None:
        self.wait_segments(self.pending(), timeout)

    def wait_segments(self, vas: Iterable[int], timeout: float = WAIT_TIMEOUT_S) -> None:
        """Returns once each segment of `vas` (start addresses) is mapped; SegmentWaitError if
        one was refused, or is still unmapped after `timeout` seconds."""
        want = set(vas)
        if not want:
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                waiting = sorted(va for va in want if va in self._pending)
                if not waiting:
                    return
                for va in waiting:
                    if va in self._refused:
                        raise SegmentWaitError(
                            f"the segment at {va:#x} ({self._describe(va)}) could not be mapped: "
                            f"{self._refused[va]}; torpord retires this instance, retry the request"
                        )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SegmentWaitError(
                        f"the segment at {waiting[0]:#x} ({self._describe(waiting[0])}) was not mapped "
                        f"within {timeout:g} s of the request"
                        + (f" ({len(waiting) - 1} more still unmapped)" if len(waiting) > 1 else "")
                        + "; the restore server did not deliver it: see torpord's log"
                    )
                self._cond.wait(left)

    def _describe(self, va: int) -> str:
        size, backend = self._pending[va]
        return f"{size} bytes, {backend}"


def _torch() -> Any:
    return sys.modules.get("torch")


def deferrable_vas(function: Any) -> set[int]:
    """Start addresses of the CUDA allocator segments holding nothing but parameters and buffers
    of the torch.nn.Modules that `function` holds (no free block the allocator could hand out,
    no tensor held outside a module): a request touches them only inside those modules'
    forwards. Empty without torch, without CUDA or without modules."""
    torch = _torch()
    if torch is None or function is None or not torch.cuda.is_initialized():
        return set()
    try:
        weights = {
            t.untyped_storage().data_ptr()
            for m in modules_of(function)
            for t in itertools.chain(m.parameters(), m.buffers())
            if t.is_cuda and t.untyped_storage().nbytes() > 0
        }
    except Exception:  # a torch without these APIs: defer nothing, which is always safe
        return set()
    return segments_holding_only(weights)


class ModuleWaits:
    """A global PyTorch forward pre-hook that makes each module wait for the segments holding its
    own CUDA parameters and buffers; it removes itself once every segment is mapped. Nothing is
    installed without torch."""

    def __init__(self, readiness: Readiness, timeout: float = WAIT_TIMEOUT_S) -> None:
        self.readiness = readiness
        self.timeout = timeout
        self._handle: Any = None
        torch = _torch()
        if torch is not None and not readiness.done():
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)

    def _pre_hook(self, module: Any, _args: Any) -> None:
        readiness = self.readiness
        if readiness.done():
            self.remove()
            return
        addrs = [
            t.data_ptr()
            for t in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
            if t.is_cuda
        ]
        if addrs:
            readiness.wait_for(addrs, self.timeout)

    def installed(self) -> bool:
        return self._handle is not None

    def remove(self) -> None:
        """Uninstalls the hook (torch copies its hooks before calling them, so this is safe from
        inside one)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
