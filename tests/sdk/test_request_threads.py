"""torpor.request_threads: a sandbox's requests each run on a thread of their own, and a thread
that finished one runs a later one instead of exiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from torpor.request_threads import RequestThreads


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_requests_one_after_another_run_on_one_thread_kept_between_them() -> None:
    pool = RequestThreads()
    seen: list[int] = []

    def job(done: threading.Event) -> None:
        seen.append(threading.get_ident())
        done.set()

    for _ in range(5):
        done = threading.Event()
        pool.run(job, done)
        assert done.wait(10)
        wait_for(lambda: pool.idle() == 1, "the thread did not wait for the next request")
    assert len(set(seen)) == 1 and pool.started() == 1, seen


def test_requests_at_once_each_get_a_thread_and_only_keep_threads_stay() -> None:
    pool = RequestThreads(name="test-keep", keep=2)
    release = threading.Event()
    running: list[int] = []
    lock = threading.Lock()

    def job() -> None:
        with lock:
            running.append(threading.get_ident())
        release.wait(10)

    for _ in range(4):
        pool.run(job)
    wait_for(lambda: len(running) == 4, "four requests at once did not all run")
    assert len(set(running)) == 4 and pool.started() == 4
    release.set()
    wait_for(lambda: pool.idle() == 2, "the idle threads kept are not two")
    wait_for(
        lambda: sum(t.name.startswith("test-keep-") for t in threading.enumerate()) == 2,
        "the threads beyond keep did not exit",
    )


def test_a_request_that_raises_leaves_its_thread_for_the_next(capsys: pytest.CaptureFixture[str]) -> None:
    pool = RequestThreads()
    first = threading.Event()

    def boom() -> None:
        first.set()
        raise RuntimeError("handler bug")

    pool.run(boom)
    assert first.wait(10)
    wait_for(lambda: pool.idle() == 1, "the thread did not survive its request's exception")
    done = threading.Event()
    pool.run(done.set)
    assert done.wait(10) and pool.started() == 1
    assert "handler bug" in capsys.readouterr().err
