"""The threads a sandbox runs its requests on (torpor.worker): each request on a thread of its
own, as before, but a thread that finished a request waits for the next one instead of exiting.

A new thread per request paid for the thread's start and then ran the request's first steps
cold: the CUDA context made current on that thread, the interpreter's and the CPU's caches
empty for its code. A GPU hand-off between sandboxes (docs/sandboxes.md) is made of such first
steps: its requests to torpord took 0.2-0.3 ms against 0.08 ms in a loop on one thread. A
thread kept for the next request keeps what it made current.

Threads are daemon threads, as the per-request ones were: a handler stuck in a request does
not keep the worker from exiting. At most `keep` threads wait idle; more concurrent requests
start more threads, and the ones beyond `keep` exit when their request ends.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

# Idle threads kept; a sandbox runs as many requests at once as torpord's requests_per_instance
# allows (at most 1 024), usually a few.
DEFAULT_KEEP = 64


class RequestThreads:
    """Runs each job on a thread of its own, reusing threads that are idle."""

    def __init__(self, name: str = "torpor-request", keep: int = DEFAULT_KEEP) -> None:
        self.name = name
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: list[_Thread] = []
        self._started = 0

    def run(self, job: Callable[..., Any], *args: Any) -> None:
        """Runs `job(*args)` on an idle thread, else on a new one; returns at once."""
        with self._lock:
            thread = self._idle.pop() if self._idle else None
            if thread is None:
                self._started += 1
                n = self._started
        if thread is None:
            thread = _Thread(self, f"{self.name}-{n}")
        thread.give(job, args)

    def idle(self) -> int:
        """Threads waiting for a job now."""
        with self._lock:
            return len(self._idle)

    def started(self) -> int:
        """Threads started so far."""
        with self._lock:
            return self._started

    def _done(self, thread: _Thread) -> bool:
        """`thread` finished its job: kept for the next one (True) or to exit (False)."""
        with self._lock:
            if len(self._idle) >= self.keep:
                return False
            self._idle.append(thread)
            return True


class _Thread:
    """One thread of a RequestThreads: a job at a time, handed over through a condition."""

    def __init__(self, owner: RequestThreads, name: str) -> None:
        self.owner = owner
        self.cond = threading.Condition(threading.Lock())
        self.job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.started = False

    def give(self, job: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self.cond:
            assert self.job is None, "a request thread was given a job while it had one"
            self.job = (job, args)
            self.cond.notify()
        if not self.started:
            self.started = True
            self.thread.start()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.job is None:
                    self.cond.wait()
                job, args = self.job
            try:
                job(*args)
            except BaseException:  # noqa: BLE001 (as an exiting thread would, it is printed; the thread goes on)
                traceback.print_exc()
            with self.cond:
                self.job = None
            if not self.owner._done(self):
                return
