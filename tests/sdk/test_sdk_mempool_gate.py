"""torpor.mempool.AllocatorGate: when a function pool may be emptied. PyTorch aborts the process
if a pool is emptied while any thread routes allocations to a pool or captures a CUDA graph
(found on the GPU in session 36), so an empty runs only while no such scope is active, never
waits for one (its callers hold the worker's memory lock), and a refused one is called back once
the last scope ends. Plain threads: the gate is pure Python; the GPU side is
tests/sdk/test_sdk_graphs_gpu.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from torpor.mempool import AllocatorGate


@contextlib.contextmanager
def a_scope_held(gate: AllocatorGate) -> Iterator[threading.Event]:
    """Another thread inside a scope of `gate` (a request in its pool) until the yielded event
    is set (at the latest when the block ends)."""
    entered, leave = threading.Event(), threading.Event()

    def request() -> None:
        with gate.scope():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=request)
    t.start()
    assert entered.wait(10)
    try:
        yield leave
    finally:
        leave.set()
        t.join(10)


def test_an_empty_runs_only_while_no_scope_is_active() -> None:
    gate = AllocatorGate()
    with gate.try_exclusive() as ok:
        assert ok
    with a_scope_held(gate):
        t0 = time.monotonic()
        with gate.try_exclusive() as ok:
            assert not ok
        assert time.monotonic() - t0 < 0.5, "a refused empty must not wait"
    with gate.try_exclusive() as ok:
        assert ok


def test_scopes_nest_and_a_refused_empty_is_called_back_when_the_last_one_ends() -> None:
    gate = AllocatorGate()
    called: list[str] = []
    gate.when_idle(lambda: called.append("now"))
    assert called == ["now"]  # nothing active: at once
    with gate.scope():
        with gate.scope():  # a capture inside a request's scope, or two requests
            gate.when_idle(lambda: called.append("later"))
        assert called == ["now"], "called back while a scope was still active"
    assert called == ["now", "later"]
    gate.when_idle(lambda: called.append("again"))
    assert called == ["now", "later", "again"]  # consumed once, not kept


def test_new_scopes_wait_for_a_running_empty_and_then_go_on() -> None:
    gate = AllocatorGate()
    inside = threading.Event()
    order: list[str] = []

    def request() -> None:
        with gate.scope():
            order.append("request")
            inside.set()

    with gate.try_exclusive() as ok:
        assert ok
        t = threading.Thread(target=request)
        t.start()
        assert not inside.wait(0.3), "a scope began while the pool was being emptied"
        order.append("empty done")
    t.join(10)
    assert order == ["empty done", "request"]


def test_a_pools_bytes_are_counted_only_while_no_other_scope_is_active(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's snapshot killed a sandbox worker (SIGSEGV) beside another thread's pool work
    (sessions 36 and 39 on the H100): pool_bytes counts only while no scope is active and
    otherwise answers the last figure it took. The count itself (PyTorch's allocator) is
    replaced by a counter here: no GPU."""
    from torpor import mempool

    held = {"bytes": 3 << 20, "counts": 0}

    def count(pools: list[object]) -> int:
        held["counts"] += 1
        return held["bytes"]

    monkeypatch.setattr(mempool, "_torch_pools_bytes", count)
    fn = mempool.FunctionPool("f", "cuda")
    fn._torch_pools.append(object())
    assert fn.pool_bytes() == 3 << 20 and held["counts"] == 1
    with a_scope_held(mempool.GATE):
        held["bytes"] = 5 << 20
        t0 = time.monotonic()
        assert fn.pool_bytes() == 3 << 20, "the last figure, not a count beside another scope"
        assert held["counts"] == 1 and time.monotonic() - t0 < 0.5
    assert fn.pool_bytes() == 5 << 20 and held["counts"] == 2


def test_packing_counts_only_the_private_pools_that_may_hold_the_functions_captures() -> None:
    """torpor.pack refuses a function whose setup() captured CUDA graphs (they would read the
    weights' old addresses); in a sandbox the pools of the functions loaded before it (their
    request pools, their torpor.graphed captures) are not its own, and must not stop it."""
    from torpor.mempool import REQUEST_POOL, possible_captures, note_pool

    note_pool((1, 901), REQUEST_POOL)  # a request pool (a lane's cuBLAS workspace lives on in it)
    note_pool((1, 902), "detect")  # detect's torpor.graphed capture
    note_pool((1, 903), "classify")  # classify's own capture
    note_pool((1, 904), None)  # a capture outside any function
    unknown = (1, 905)  # a MemPool or graph the function made itself
    pools = {(1, 901), (1, 902), (1, 903), (1, 904), unknown}
    assert possible_captures(pools, "classify") == {(1, 903), (1, 904), unknown}
    assert possible_captures(pools, "describe") == {(1, 904), unknown}
    # Without a name (a function in a worker of its own), every capture counts.
    assert possible_captures(pools, None) == {(1, 902), (1, 903), (1, 904), unknown}
    assert possible_captures({(1, 901)}, "classify") == set()


def test_an_exclusive_wait_holds_once_the_last_scope_ends_and_gives_up_after_its_bound() -> None:
    """Weight packing at a load waits a little for another function's request or release to
    end (AllocatorGate.exclusive_within), then holds the gate; it gives up after its bound."""
    gate = AllocatorGate()
    started = threading.Event()

    def late() -> None:
        with gate.scope():
            started.set()

    with a_scope_held(gate) as leave:
        t0 = time.monotonic()
        with gate.exclusive_within(0.2) as ok:
            assert not ok
        assert 0.2 <= time.monotonic() - t0 < 2, "gave up before or long after its bound"
        threading.Timer(0.2, leave.set).start()
        t0 = time.monotonic()
        with gate.exclusive_within(10) as ok:
            assert ok, "the scope ended, the gate should hold"
            held = time.monotonic() - t0
            # New scopes wait while it holds.
            late_t = threading.Thread(target=late)
            late_t.start()
            assert not started.wait(0.2)
    assert 0.15 <= held < 5, held
    assert started.wait(10)
    late_t.join(10)
