"""Request lanes: the long-lived threads a sandbox runs its functions' requests and loads on
(docs/sandboxes.md, "The memory pool"; issue 11's memory ratio).

Why lanes and not a new thread per request: under PyTorch every thread that calls cuBLAS holds a
cuBLAS (and cuBLASLt) handle of its own until it exits, and PyTorch keeps a workspace (32 MiB on
Hopper) per handle and stream for the life of the process. A handle costs the GPU memory of the
library's own state besides: on the H100 a sandbox of eight 16 MiB functions held 572 MiB outside
PyTorch's allocator against 427 MiB for one function in a process of its own, and two
workspaces against one (bench/results/sandbox-s38-before-w16-h100.json). With a thread per
request, the next request's thread could start before the last one had exited and given its
handle back, and the loads ran on the main thread, which keeps its handle for ever. A lane keeps
one thread, one CUDA stream and so one handle and one workspace for as long as the worker lives;
a request takes the lane that finished last (so one request at a time uses one lane, one handle,
one workspace), and a new lane starts only when every lane is busy: a sandbox holds as many
handles and workspaces as it ran requests at once, no more.

A lane's stream (and its cuBLAS handle and workspace) is made on the lane by
`torpor.gpu.prepare_lane` the first time a job there runs under torch with CUDA initialised, and
`torpor.gpu.request_stream` runs every later job of that lane on it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# The lane the current thread is (None on other threads).
_on_lane = threading.local()


class Lane:
    """One long-lived thread and what it keeps between jobs (its CUDA stream)."""

    def __init__(self, lanes: Lanes, number: int) -> None:
        self.lanes = lanes
        self.number = number
        # The lane's CUDA stream (torpor.gpu.prepare_lane makes it on the lane's first job
        # under torch).
        self.stream: Any = None
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Whether the job running now has given the lane back already (`release`).
        self.released = True
        self.thread = threading.Thread(target=self._run, name=f"torpor-lane-{number}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        _on_lane.lane = self
        while True:
            job = self.jobs.get()
            self.released = False
            try:
                job()
            except BaseException:  # the job's own failure: told, and the lane lives on
                traceback.print_exc(file=sys.stderr)
            finally:
                release()


class Lanes:
    """The lanes of one worker: `submit` runs a job on the lane that finished last, or on a new
    lane when all are busy; `run` does the same and waits for the job's value (or its
    exception)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Lane] = []
        self._all: list[Lane] = []

    def submit(self, job: Callable[[], None]) -> None:
        """Runs `job` on a lane and returns at once. An exception the job raises ends the job,
        not the lane (the caller's job reports its own failures)."""
        with self._lock:
            lane = self._free.pop() if self._free else None
            if lane is None:
                lane = Lane(self, len(self._all))
                self._all.append(lane)
        lane.jobs.put(job)

    def run(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on a lane and waits for it: its value, or its exception raised here."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            try:
                value = fn()
            except BaseException as e:  # handed to the caller, who raises it
                release()
                done.set_exception(e)
            else:
                release()
                done.set_result(value)

        self.submit(job)
        return done.result()

    def count(self) -> int:
        """How many lanes have been started (each holds its thread, stream and handle)."""
        with self._lock:
            return len(self._all)

    def free(self) -> int:
        """How many lanes wait for a job now."""
        with self._lock:
            return len(self._free)

    def _idle(self, lane: Lane) -> None:
        with self._lock:
            self._free.append(lane)


def release() -> None:
    """On a lane: the lane takes its next job once the running one returns. A job calls it just
    before it lets the caller know it is done (a request before its result), so that the next
    job, which may be submitted at once, finds this lane free instead of starting another (which
    would cost another handle and workspace). Elsewhere, or a second time, it does nothing."""
    lane = current()
    if lane is not None and not lane.released:
        lane.released = True
        lane.lanes._idle(lane)


def current() -> Lane | None:
    """The lane the calling thread is, or None."""
    lane: Lane | None = getattr(_on_lane, "lane", None)
    return lane
