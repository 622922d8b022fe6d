"""torpor.lanes: a sandbox's long-lived request threads. One request at a time must keep using
one lane (one cuBLAS handle and workspace under torch), even when the next job is submitted the
moment the last one says it is done, as torpord sends the next request once it has a result."""

from __future__ import annotations

import threading
import time

import pytest

from torpor import lanes as torpor_lanes


def test_jobs_one_after_another_keep_one_lane_even_when_the_next_comes_at_once() -> None:
    lanes = torpor_lanes.Lanes()
    seen: list[int] = []
    for _ in range(200):
        said = threading.Event()

        def job() -> None:
            lane = torpor_lanes.current()
            assert lane is not None
            seen.append(lane.number)
            # As a request does: the lane given back, then the result "sent"; the test submits
            # the next job the moment it has it, while this job is still returning.
            torpor_lanes.release()
            said.set()

        lanes.submit(job)
        said.wait(10)
    assert lanes.count() == 1
    assert set(seen) == {0}


def test_jobs_at_once_each_get_a_lane_and_later_ones_reuse_them() -> None:
    lanes = torpor_lanes.Lanes()
    running = threading.Barrier(4, timeout=10)
    done = threading.Semaphore(0)
    threads: set[int] = set()

    def job() -> None:
        threads.add(threading.get_ident())
        running.wait()  # all four at once: four lanes
        done.release()

    for _ in range(4):
        lanes.submit(job)
    for _ in range(4):
        assert done.acquire(timeout=10)
    assert lanes.count() == 4 and len(threads) == 4
    # Later jobs, one at a time, find a free lane: no fifth.
    for _ in range(10):
        assert lanes.run(lambda: torpor_lanes.current() is not None)
    assert lanes.count() == 4


def test_run_returns_the_value_raises_the_error_and_the_lane_lives_on() -> None:
    lanes = torpor_lanes.Lanes()
    assert lanes.run(lambda: 41 + 1) == 42

    def fails() -> None:
        raise ValueError("setup() failed: no weights")

    with pytest.raises(ValueError, match="no weights"):
        lanes.run(fails)
    assert lanes.run(lambda: threading.current_thread().name) == "torpor-lane-0"
    assert lanes.count() == 1


def test_a_failed_submitted_job_does_not_kill_its_lane() -> None:
    lanes = torpor_lanes.Lanes()

    def fails() -> None:
        raise RuntimeError("a request's harness failed")

    lanes.submit(fails)
    for _ in range(1000):
        if lanes.free() == 1:
            break
        time.sleep(0.01)
    # The lane took its next job: the same thread, no new lane.
    assert lanes.run(lambda: threading.current_thread().name) == "torpor-lane-0"
    assert lanes.count() == 1


def test_not_a_lane_elsewhere_and_release_there_does_nothing() -> None:
    assert torpor_lanes.current() is None
    torpor_lanes.release()
