"""The cluster's placement rule (torpor.cluster.placement) and the simulator that runs it at scale
(bench/cluster/simulate.py). Pure Python: no Ray, no daemon. The rule is the one the ingress
calls; tests/test_cluster.py runs it on a real cluster."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import ROOT
from torpor.cluster.bookkeeping import Bookkeeping, SentStart, handler_of, pending
from torpor.cluster.placement import (
    Costs,
    FunctionNeeds,
    NodeView,
    StartKind,
    delayed_s,
    estimate_join_s,
    estimate_start_s,
    function_count,
    makes_start,
    place,
    place_random,
)

FN = FunctionNeeds("f", gpu_bytes=4 * 2**30, snapshot_bytes=2 * 10**9)


def load_simulator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cluster_simulate", ROOT / "bench" / "cluster" / "simulate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_warm_first_then_staged_then_local_then_pull() -> None:
    nodes = [
        NodeView("a", in_bucket=True),
        NodeView("b", local_snapshot=True, in_bucket=True),
        NodeView("c", staged=True, local_snapshot=True, in_bucket=True),
        NodeView("d", warm_idle=1, local_snapshot=True, in_bucket=True),
    ]
    assert place(FN, nodes, Costs()) == place(FN, nodes, Costs())  # pure
    order = []
    for _ in range(4):
        p = place(FN, nodes, Costs(), exclude=order)
        assert p is not None
        order.append(p.node)
    assert order == ["d", "c", "b", "a"]
    assert place(FN, nodes, Costs(), exclude=order) is None


def test_gpu_memory_dead_nodes_and_no_snapshot_are_never_chosen() -> None:
    small = NodeView("small", staged=True, gpu_free_bytes=2**30)
    dead = NodeView("dead", staged=True, alive=False)
    nothing = NodeView("nothing", gpu_free_bytes=80 * 2**30)
    far = NodeView("far", in_bucket=True, gpu_free_bytes=80 * 2**30)
    p = place(FN, [small, dead, nothing, far], Costs())
    assert p is not None and (p.node, p.kind) == ("far", StartKind.PULL)
    # A warm instance already holds its GPU memory.
    warm = NodeView("warm", warm_idle=1, gpu_free_bytes=0)
    p = place(FN, [warm, far], Costs())
    assert p is not None and (p.node, p.kind) == ("warm", StartKind.WARM)
    assert place(FN, [small, dead, nothing], Costs()) is None


def test_a_burst_spreads_as_starts_pile_up() -> None:
    """Each start placed on a node makes it slower for the next: a staged node takes a few,
    then local copies, then pulls; a big pull backlog pushes the next pull elsewhere."""
    costs = Costs(restore_staged_s=1.0, restore_local_extra_s=0.3, link_bytes_per_s=1e9, start_contention_s=0.2)
    starting = {"s": 0, "l": 0, "p": 0}
    chosen = []
    for _ in range(20):
        views = [
            NodeView("s", staged=True, in_bucket=True, starting=starting["s"]),
            NodeView("l", local_snapshot=True, in_bucket=True, starting=starting["l"]),
            NodeView("p", in_bucket=True, missing_bytes=10**9, starting=starting["p"]),
        ]
        p = place(FN, views, costs)
        assert p is not None
        starting[p.node] += 1
        chosen.append(p.node)
    assert chosen[0] == "s" and set(chosen) == {"s", "l", "p"}, chosen
    assert chosen.count("s") > chosen.count("l") > chosen.count("p"), chosen
    busy = NodeView("p1", in_bucket=True, missing_bytes=10**9, pull_backlog_bytes=10 * 10**9)
    idle = NodeView("p2", in_bucket=True, missing_bytes=10**9)
    p = place(FN, [busy, idle], costs)
    assert p is not None and p.node == "p2"


JOIN_COSTS = Costs(restore_staged_s=1.0, restore_local_extra_s=0.3, link_bytes_per_s=1e9, start_contention_s=0.2)
QUICK = FunctionNeeds("f", gpu_bytes=4 * 2**30, snapshot_bytes=2 * 10**9, handler_s=0.1)


def test_a_request_joins_the_node_whose_starting_instance_answers_sooner_than_a_new_start() -> None:
    """Late binding: a start of f expected up in 0.3 s on `a` answers this request at 0.4 s
    (its handler after), sooner than a new start on the idle staged `b` (1.0 s): it goes to `a`.
    Its own start there is still estimated, for the bookkeeping (1.0 + 0.3 disk + 1 x 0.2)."""
    a = NodeView("a", local_snapshot=True, in_bucket=True, starting=1, starts_up_in_s=(0.3,))
    b = NodeView("b", staged=True, in_bucket=True)
    p = place(QUICK, [b, a], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN), p
    assert p.estimate_s == pytest.approx(0.4) and p.start_s == pytest.approx(1.5) and p.pull_s == 0.0
    # An instance already up (busy) is free now: the request is answered a handler later.
    up = NodeView("a", local_snapshot=True, in_bucket=True, instances=1)
    p = place(QUICK, [b, up], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN) and p.estimate_s == pytest.approx(0.1)
    # Without the join the starts only count against `a`: the staged node wins (the old rule).
    p = place(QUICK, [b, NodeView("a", local_snapshot=True, in_bucket=True, starting=1)], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("b", StartKind.STAGED)


def test_the_join_estimate_serves_the_requests_ahead_first_come_first_served() -> None:
    """Two instances up and one starting (up in 0.25 s), 5 requests of ours ahead, 0.1 s each:
    the instances up take the first four (free at 0.2 s), the starting one the fifth (0.35 s);
    this request goes to the first free, at 0.2 s, and is answered at 0.3 s."""
    v = NodeView("a", local_snapshot=True, instances=2, starts_up_in_s=(0.25,), inflight=5)
    assert estimate_join_s(QUICK, v) == pytest.approx(0.3)
    # torpord's queue counts when it is longer than what the caller knows it sent.
    assert estimate_join_s(QUICK, NodeView("a", instances=1, queue_depth=3)) == pytest.approx(0.4)
    assert estimate_join_s(QUICK, NodeView("a", local_snapshot=True)) is None  # nothing up or starting
    # No GPU memory for the start the request would make there: no join either.
    assert estimate_join_s(QUICK, NodeView("a", instances=1, gpu_free_bytes=2**30)) is None


def test_a_request_does_not_join_when_the_wait_there_is_longer_than_a_new_start() -> None:
    """The start on `a` is up in 0.3 s but 20 requests are ahead of this one (0.1 s each, one
    instance): 2.4 s; a new start on the staged `b` answers in 1.0 s."""
    a = NodeView("a", local_snapshot=True, in_bucket=True, starting=1, starts_up_in_s=(0.3,), inflight=20)
    b = NodeView("b", staged=True, in_bucket=True)
    p = place(QUICK, [a, b], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("b", StartKind.STAGED) and p.estimate_s == pytest.approx(1.0)
    # ... nor when a new start on the same node answers sooner than the one under way (late).
    late = NodeView("a", staged=True, in_bucket=True, starting=1, starts_up_in_s=(5.0,))
    p = place(QUICK, [late], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.STAGED) and p.estimate_s == pytest.approx(1.2)


def test_an_idle_warm_instance_still_wins_over_a_join_and_the_choice_is_deterministic() -> None:
    join = NodeView("a", local_snapshot=True, in_bucket=True, instances=3, starts_up_in_s=(0.0,))
    warm = NodeView("w", warm_idle=1, instances=1, local_snapshot=True, in_bucket=True)
    p = place(QUICK, [join, warm], JOIN_COSTS)
    assert p is not None and (p.node, p.kind, p.start_s) == ("w", StartKind.WARM, None)
    # Two equal joins: fewer requests in flight, then the smaller name; the same every time.
    x = NodeView("x", local_snapshot=True, in_bucket=True, instances=2, inflight=1)
    y = NodeView("y", local_snapshot=True, in_bucket=True, instances=2, inflight=1)
    z = NodeView("z", local_snapshot=True, in_bucket=True, instances=4, inflight=2)
    picks = {place(QUICK, order, JOIN_COSTS) for order in ([x, y, z], [z, y, x], [y, z, x])}
    assert len(picks) == 1
    p = picks.pop()
    assert p is not None and (p.node, p.kind) == ("x", StartKind.JOIN) and p.estimate_s == pytest.approx(0.1)


def test_a_node_at_max_instances_makes_no_start_and_its_requests_wait_for_its_instances() -> None:
    """torpord starts an instance for a request only while the function's instances on the node,
    up and starting, are below its max_instances; at it the request waits for them. So there a
    join makes no start (`start_s` None, nothing to pull, no driver turn ahead of anyone's
    pull) and needs no free GPU memory; below it a join still makes one and needs it."""
    capped = NodeView("a", local_snapshot=True, in_bucket=True, instances=1, function_starting=1,
                      starts_up_in_s=(0.3,), max_instances=2, gpu_free_bytes=0, pulls_up_in_s=(5.0,))
    assert function_count(capped) == 2 and not makes_start(capped)
    assert estimate_start_s(QUICK, capped, JOIN_COSTS) is None
    assert delayed_s(QUICK, capped, JOIN_COSTS) == 0.0
    assert estimate_join_s(QUICK, capped) == pytest.approx(0.1)  # the instance up is free now
    b = NodeView("b", staged=True, in_bucket=True)
    p = place(QUICK, [capped, b], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN), p
    assert p.start_s is None and p.pull_s == 0.0 and p.estimate_s == pytest.approx(0.1)
    # One below the bound: the request would start an instance, for which there is no memory.
    below = NodeView("a", local_snapshot=True, in_bucket=True, instances=1, starts_up_in_s=(0.3,),
                     max_instances=3, gpu_free_bytes=0)
    assert makes_start(below) and estimate_join_s(QUICK, below) is None
    p = place(QUICK, [below, b], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("b", StartKind.STAGED)
    # ... with the memory it joins and starts one (the behaviour without a bound, None).
    for limit in (3, None):
        p = place(QUICK, [NodeView("a", local_snapshot=True, in_bucket=True, instances=1, starts_up_in_s=(0.3,),
                                   max_instances=limit), b], JOIN_COSTS)
        assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN) and p.start_s == pytest.approx(1.3), p
    # At the bound and nothing up or starting there to wait for (torpord's count only): no join.
    assert estimate_join_s(QUICK, NodeView("a", local_snapshot=True, function_starting=2, max_instances=2)) is None


def test_the_bound_counts_the_starting_instances_torpords_and_the_callers() -> None:
    """What counts towards max_instances: the instances up and those starting, as torpord
    counted them (`function_starting`) or as the caller knows it sent them since (its own
    starts under way there, `starts_up_in_s`), whichever is more."""
    assert not makes_start(NodeView("a", function_starting=4, max_instances=4))
    assert not makes_start(NodeView("a", starts_up_in_s=(0.1, 0.2, 0.3, 0.4), max_instances=4))
    assert not makes_start(NodeView("a", instances=2, function_starting=1, starts_up_in_s=(0.1, 0.2), max_instances=4))
    assert makes_start(NodeView("a", instances=2, function_starting=1, starts_up_in_s=(0.1,), max_instances=4))
    assert makes_start(NodeView("a", instances=100, function_starting=100))  # no bound known
    # At the bound a new start is not an option, whatever memory is free; one below, it is.
    assert estimate_start_s(QUICK, NodeView("a", staged=True, function_starting=4, max_instances=4), JOIN_COSTS) is None
    assert estimate_start_s(QUICK, NodeView("a", staged=True, function_starting=3, max_instances=4),
                            JOIN_COSTS) == pytest.approx(1.0)


def test_the_join_estimate_at_a_capped_node_waits_for_its_starting_instances() -> None:
    """At the bound with two starts under way (up in 0.3 and 0.5 s) and three requests of ours
    ahead (0.1 s each): the first start takes the first two (0.3, 0.4), the second the third
    (0.5); this one is answered at 0.6 s, sooner than a new start on the idle staged `b`
    (1.0 s). With six ahead (0.8 s) it still is; with twelve (1.1 s) `b` answers sooner."""
    def capped(ahead: int) -> NodeView:
        return NodeView("a", local_snapshot=True, in_bucket=True, function_starting=2, starts_up_in_s=(0.3, 0.5),
                        max_instances=2, inflight=ahead)

    b = NodeView("b", staged=True, in_bucket=True)
    assert estimate_join_s(QUICK, capped(3)) == pytest.approx(0.6)
    assert estimate_join_s(QUICK, capped(6)) == pytest.approx(0.8)
    assert estimate_join_s(QUICK, capped(12)) == pytest.approx(1.1)
    for ahead, node in ((3, "a"), (6, "a"), (12, "b")):
        p = place(QUICK, [capped(ahead), b], JOIN_COSTS)
        assert p is not None and p.node == node, (ahead, p)
        assert (p.kind, p.start_s is None) == ((StartKind.JOIN, True) if node == "a" else (StartKind.STAGED, False))
    # torpord's queue counts when longer than what the caller knows it sent.
    assert estimate_join_s(QUICK, NodeView("a", instances=2, max_instances=2, queue_depth=5)) == pytest.approx(0.3)


def test_a_start_that_would_go_ahead_of_other_functions_pulls_counts_their_wait() -> None:
    """torpord restores starts in the order they are ready: a join on `a`, whose bytes are there,
    would hold the driver a turn (0.2 s) ahead of another function's start still pulling there,
    expected up in 1.5 s: its requests would wait until 1.7 s. A node is ranked by the latest
    answer the request makes: 1.7 s on `a` against 1.0 s for a new start on `b`."""
    a = NodeView("a", local_snapshot=True, in_bucket=True, starts_up_in_s=(0.3,), pulls_up_in_s=(0.2, 1.5))
    b = NodeView("b", staged=True, in_bucket=True)
    assert delayed_s(QUICK, a, JOIN_COSTS) == pytest.approx(1.7)
    p = place(QUICK, [a, b], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("b", StartKind.STAGED), p
    # A pull that will be up at 0.5 s anyway, 0.7 s after this one's turn: sooner than b.
    soon = NodeView("a", local_snapshot=True, in_bucket=True, starts_up_in_s=(0.3,), pulls_up_in_s=(0.5,))
    p = place(QUICK, [soon, b], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN) and p.estimate_s == pytest.approx(0.4)
    # A start that pulls its own bytes goes behind the pulls already on the node's link: it
    # delays none of them.
    far = NodeView("p", in_bucket=True, missing_bytes=10**7, pulls_up_in_s=(50.0,))
    assert delayed_s(QUICK, far, JOIN_COSTS) == 0.0
    p = place(QUICK, [a, far], JOIN_COSTS)
    assert p is not None and (p.node, p.kind) == ("p", StartKind.PULL) and p.pull_s == pytest.approx(0.01)
    assert p.estimate_s == pytest.approx(1.31)


def test_bookkeeping_keeps_the_starts_torpord_still_counts_and_expects_them_up_in_time() -> None:
    book = Bookkeeping(fresh_s=1.0)
    for i, start_s in enumerate((1.0, 1.2, 1.4)):  # three requests sent at 0, 0.1, 0.2 s
        book.sent("n", "f", 0.1 * i, start_s, pull_s=0.5 if i == 2 else 0.0)
    assert book.starts_up_in("n", "f", 0.5) == pytest.approx((0.5, 0.8, 1.1))
    assert book.node_starting("n", 0.5) == 3 and book.node_starting("m", 0.5) == 0
    # torpord, asked at 0.6 s, counts 2 starting: the one expected up first is taken as up.
    book.seen("n", "f", 2, 0.6)
    assert book.starts_up_in("n", "f", 0.6) == pytest.approx((0.7, 1.0))
    # An answer older than the one taken changes nothing; a request sent after the answer was
    # asked for is under way whatever it said.
    book.seen("n", "f", 0, 0.55)
    book.sent("n", "f", 0.7, 1.0)
    assert book.starts_up_in("n", "f", 0.7) == pytest.approx((0.6, 0.9, 1.0))
    # Late starts that a fresh count vouches for are due now (0); without a fresh count, a
    # start past its expected up time is taken as up.
    assert book.starts_up_in("n", "f", 1.5) == pytest.approx((0.0, 0.1, 0.2))
    assert book.starts_up_in("n", "f", 1.65) == pytest.approx((0.05,))
    # Other functions' starts on a node: all count for its lane, those still pulling for
    # `pulls_up_in` (not the function's own); a start sent there with its bytes at hand moves
    # each of those a driver turn later.
    book.sent("n", "g", 2.0, 3.0, pull_s=1.0)
    book.sent("n", "g", 2.0, 3.0)
    assert book.node_starting("n", 2.1) == 2 and book.pulls_up_in("n", "f", 2.1) == pytest.approx((2.9,))
    assert book.pulls_up_in("n", "g", 2.1) == () and book.pulls_up_in("n", "f", 3.1) == ()
    book.sent("n", "f", 2.1, 1.0, turn_s=0.25)
    assert book.pulls_up_in("n", "f", 2.1) == pytest.approx((3.15,))
    assert book.starts_up_in("n", "g", 2.1) == pytest.approx((2.9, 3.15))
    book.sent("n", "f", 2.2, 1.0, pull_s=0.5, turn_s=0.25)  # a pull: behind g's on the link
    assert book.pulls_up_in("n", "f", 2.2) == pytest.approx((3.05,))
    book.forget_node("n")
    assert book.node_starting("n", 2.1) == 0 and book.starts_up_in("n", "g", 2.1) == ()
    book.sent("n", "f", 0.0, None)  # a warm request makes no start
    assert book.starts_up_in("n", "f", 0.0) == ()


def test_bookkeeping_averages_the_answers_handler_and_keeps_the_pulls_size() -> None:
    book = Bookkeeping(default_handler_s=0.1, alpha=0.5)
    assert book.handler_s("f") == 0.1
    book.answered("f", json.dumps({"queue": 0.0, "handler": 0.02, "total": 0.6}))
    assert book.handler_s("f") == pytest.approx(0.02)
    book.answered("f", '{"handler": 0.04}')
    assert book.handler_s("f") == pytest.approx(0.03)
    for junk in (None, "", "not json", "[1]", '{"handler": "x"}', '{"handler": -1}', '{"handler": true}'):
        book.answered("f", junk)
    assert book.handler_s("f") == pytest.approx(0.03) and book.handler_s("g") == 0.1
    assert handler_of('{"handler": 1}') == 1.0
    assert book.snapshot_bytes("f") == 0
    for got in (3 * 10**9, None, "x", 10**9):
        book.pulled("f", got)
    assert book.snapshot_bytes("f") == 3 * 10**9


def test_pending_takes_the_latest_expected_of_the_starts_sent_before_the_count() -> None:
    starts = [SentStart(0.0, 2.0, 0.0), SentStart(0.1, 1.0, 0.0), SentStart(0.2, 3.0, 0.0), SentStart(0.9, 0.95, 0.0)]
    # Asked at 0.5: 1 starting of the three sent before: the one expected last (3.0); the one
    # sent after the question counts whatever the answer said.
    got = pending(starts, 0.5, 1, 0.5)
    assert [s.up_at for s in got] == [0.95, 3.0]
    assert [s.up_at for s in pending(starts, None, 0, 0.5)] == [0.95, 1.0, 2.0, 3.0]
    assert [s.up_at for s in pending(starts, None, 0, 1.5)] == [2.0, 3.0]
    assert pending(starts, 0.5, 0, 5.0, fresh_s=10.0) == [starts[3]]


def test_the_ingress_builds_its_views_from_the_answers_and_its_bookkeeping() -> None:
    pytest.importorskip("ray")
    from torpor.cluster.ingress import Router

    r = Router(costs=JOIN_COSTS)
    r.book.answered("f", '{"handler": 0.05}')
    r.book.sent("a", "f", 10.0, 0.6)  # the ingress started f on a at 10.0, up at 10.6
    r.book.sent("a", "g", 10.0, 0.5, pull_s=0.4)  # and g, still pulling at 10.2, up at 10.5
    r.inflight[("a", "f")] = 1
    views = {
        "a": {"known": True, "local_snapshot": True, "in_bucket": True, "instances": 0, "warm_idle": 0, "starting": 1},
        "b": {"known": True, "staged": True, "in_bucket": True, "instances": 0, "warm_idle": 0, "starting": 0},
    }
    # On a: its start answers at 10.6, the request in flight takes it first (10.65), this one
    # 10.70: 0.5 s from 10.2, against 1.0 s on b. Its start there would go ahead of g's (up at
    # 10.5, then 10.7): no later than its own answer.
    p = r.choose("f", views, set(), asked=10.1, now=10.2)
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN) and p.estimate_s == pytest.approx(0.5)
    # torpord on a counts no start of f any more (it is up, not yet listed: instances 0): none
    # to join; the new start on a counts g's start against it, a turn, and its disk read.
    views["a"] = {**views["a"], "starting": 0}
    p = r.choose("f", views, set(), asked=10.15, now=10.2)
    assert p is not None and (p.node, p.kind) == ("b", StartKind.STAGED)
    assert r.choose("f", views, {"a", "b"}) is None


def test_the_ingress_makes_no_start_where_the_agent_says_the_function_is_at_max_instances() -> None:
    """The agent's `max_instances` (from the spec) and torpord's `instances` and `starting` go
    into the views: on `a` f has one instance up and one starting at a bound of 2, so the
    request joins them without a start (none booked); at a bound of 3 it makes one, as it does
    where the agent says nothing of the bound (older agents: none assumed)."""
    pytest.importorskip("ray")
    from torpor.cluster.ingress import Router

    r = Router(costs=JOIN_COSTS)
    r.book.answered("f", '{"handler": 0.05}')
    a = {"known": True, "local_snapshot": True, "in_bucket": True, "instances": 1, "warm_idle": 0, "starting": 1,
         "max_instances": 2}
    b = {"known": True, "staged": True, "in_bucket": True, "instances": 0, "warm_idle": 0, "starting": 0,
         "max_instances": 2}
    p = r.choose("f", {"a": a, "b": b}, set(), asked=10.0, now=10.0)
    assert p is not None and (p.node, p.kind, p.start_s) == ("a", StartKind.JOIN, None), p
    assert p.estimate_s == pytest.approx(0.05)
    r.book.sent(p.node, "f", 10.0, p.start_s, p.pull_s)
    assert r.book.starts_up_in("a", "f", 10.0) == ()  # no start of its own
    for other in ({**a, "max_instances": 3}, {k: v for k, v in a.items() if k != "max_instances"}):
        p = r.choose("f", {"a": other, "b": b}, set(), asked=10.0, now=10.0)
        assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN) and p.start_s is not None, p


def test_the_agents_placement_carries_the_functions_max_instances() -> None:
    """torpord's placement answer carries max_instances and the agent passes it through; on a
    daemon without the placement route the agent takes it from the spec in the detail it
    composes the view from (None where the function is unknown or the spec has none)."""
    from torpor import client
    from torpor.cluster import agent as agent_mod

    calls: list[str] = []
    routes = {"placement": True}
    spec: dict[str, object] = {"scaling": {"max_instances": 4}}

    def fake(sock: str, method: str, path: str, *a: object, **k: object) -> client.Response:
        calls.append(path)
        if path == "/v1/openapi.json":
            paths = {agent_mod.PLACEMENT_ROUTE: {}} if routes["placement"] else {}
            doc: object = {"paths": paths}
        elif path == "/v1/functions/f/placement":
            doc = {"function": "f", "known": True, "instances": 1, "warm_idle": 0, "starting": 3, "queue_depth": 0,
                   "max_instances": 4}
        elif path == "/v1/functions/f":
            doc = {"name": "f", "state": "ready", "snapshot": "s1", "spec": spec, "instances": [{"stage": "busy"}]}
        else:
            return client.Response(404, {}, b'{"error": "no"}')
        return client.Response(200, {}, json.dumps(doc).encode())

    mp = pytest.MonkeyPatch()
    mp.setattr(agent_mod.client, "request", fake)
    try:
        ag = agent_mod.NodeAgent("n", "/nonexistent.sock")
        got = ag.placement("f")
        assert got["max_instances"] == 4 and got["starting"] == 3
        assert "/v1/functions/f" not in calls  # the daemon says it: no detail read
        assert ag.placement("g") == dataclasses.asdict(agent_mod.Unknown()) and ag.placement("g")["max_instances"] is None
        routes["placement"] = False
        old = agent_mod.NodeAgent("n", "/nonexistent.sock")
        assert old.placement("f")["max_instances"] == 4 and old.placement("f")["instances"] == 1
        spec["scaling"] = {}
        assert old.placement("f")["max_instances"] is None
    finally:
        mp.undo()


def test_the_ingress_books_the_start_it_sends_and_the_handler_of_the_answer() -> None:
    """Router.invoke with two fake agents (no Ray cluster): the request goes where `place`
    says, the start it makes is booked with `place`'s estimate, the answer's handler joins the
    function's average, and the next request, seeing that start under way, joins it."""
    pytest.importorskip("ray")
    import asyncio
    import time

    from torpor.cluster.agent import Answer
    from torpor.cluster.ingress import Router

    class Call:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def remote(self, *args: object) -> object:
            async def run() -> object:
                return self.fn(*args)

            return run()

    class Agent:
        def __init__(self, node: str, staged: bool) -> None:
            self.node, self.staged, self.calls = node, staged, 0
            self.placement = Call(lambda name: {
                "known": True, "staged": self.staged, "local_snapshot": True, "in_bucket": True,
                "instances": 0, "warm_idle": 0, "queue_depth": 0, "starting": self.calls,
            })
            self.invoke = Call(self.answer)

        def answer(self, name: str, body: bytes, *rest: object) -> Answer:
            self.calls += 1
            return Answer(self.node, 200, {"x-torpor-timings": '{"handler": 0.04}'}, b"{}")

    r = Router(costs=JOIN_COSTS)
    agents = {"a": Agent("a", staged=True), "b": Agent("b", staged=False)}
    r.agents, r.agents_at = dict(agents), time.monotonic()
    out = asyncio.run(r.invoke("f", b"{}", "rid-1"))
    assert out.status == 200 and out.headers["x-torpor-node"] == "a"
    assert r.book.handler_s("f") == pytest.approx(0.04)
    # The start the request made on a (torpord still counts it) is expected up 1.0 s after it
    # was sent: the next request joins it rather than start on b (1.3 s).
    ups = r.book.starts_up_in("a", "f", time.monotonic())
    assert len(ups) == 1 and 0.9 < ups[0] <= 1.0
    p = r.choose("f", {n: agents[n].placement.fn("f") for n in agents}, set())
    assert p is not None and (p.node, p.kind) == ("a", StartKind.JOIN), p


def test_a_fresh_ingress_spreads_a_burst_of_a_function_whose_handler_it_does_not_know() -> None:
    """tests/test_cluster.py's burst: 6 requests at once (a 1.5 s handler) on 3 nodes, the
    function staged on one. Before any answer the handler is taken as long as a cold start, so
    none joins a start under way: they spread as before joins (3, 2, 1); with 0.1 s assumed,
    4 would join the staged node and queue there behind its max_instances (2)."""
    pytest.importorskip("ray")
    from torpor.cluster.ingress import Router

    r = Router()
    views = {n: {"known": True, "staged": n == "head", "local_snapshot": True, "in_bucket": True,
                 "instances": 0, "warm_idle": 0, "queue_depth": 0, "starting": 0} for n in ("head", "w1", "w2")}
    kinds = []
    for i in range(6):
        now = 100.0 + 0.01 * i
        p = r.choose("f", views, set(), asked=100.0, now=now)
        assert p is not None
        kinds.append(p.kind)
        r.book.sent(p.node, "f", now, p.start_s, p.pull_s, r.costs.start_contention_s)
        r.inflight[(p.node, "f")] = r.inflight.get((p.node, "f"), 0) + 1
    assert StartKind.JOIN not in kinds, kinds
    assert r.inflight == {("head", "f"): 3, ("w1", "f"): 2, ("w2", "f"): 1}, r.inflight


def test_random_placement_is_seeded_and_ignores_locality() -> None:
    nodes = [NodeView(f"n{i}", staged=i == 0, in_bucket=True) for i in range(20)]
    a = [place_random(FN, nodes, random.Random(5)) for _ in range(3)]
    assert len({p.node for p in a if p}) == 1
    picks = {p.node for p in (place_random(FN, nodes, random.Random(s)) for s in range(50)) if p}
    assert len(picks) > 10


def small_args(sim: ModuleType, out: Path, *extra: str) -> object:
    return sim.parse(
        ["--nodes", "12", "--starts", "80", "--functions", "4", "--link-gbps", "25", "--seeds", "1", "2",
         "--out", str(out), *extra]
    )


def test_simulation_invariants_and_determinism(tmp_path: Path) -> None:
    sim = load_simulator()
    doc = sim.simulate(small_args(sim, tmp_path / "a.json"))
    again = sim.simulate(small_args(sim, tmp_path / "b.json"))
    assert doc["runs"] == again["runs"] and doc["summary"] == again["summary"]
    assert len(doc["runs"]) == 4
    for r in doc["runs"]:
        assert r["starts"] == 80 and r["unplaced"] == 0, r
        # No instance up before its bytes were all there and its two parts ran; no answer before
        # its request arrived or before the instance that served it was up.
        assert r["starts_before_pull_end"] == 0 and r["answers_before_instance_up"] == 0, r
        assert 0 < r["p50_s"] <= r["p99_s"] <= r["max_s"], r
        assert 0 < r["instance_up_p50_s"] <= r["instance_up_p99_s"] <= r["instance_up_max_s"], r
        # A request makes a start while its function is below max_instances (4) on its node,
        # else waits in its queue (torpord's behaviour); `place` knew which, every time. `place`
        # sends some to join, never random. Nothing waited past torpord's queue timeout.
        assert r["starts_made"] + r["waited_in_queue"] == 80 and r["start_mispredicted"] == 0, r
        assert r["starts_made"] <= 4 * 4 * r["nodes_used"] and r["queue_timeouts_503"] == 0, r
        assert ("join" in r["kinds"]) == (r["policy"] == "locality"), r
        # The requests over the target (3 cold starts) are those past the p99 when it misses.
        late = r["over_target"]
        assert sum(late["by_function"].values()) == late["requests"], r
        assert (r["p99_s"] > late["s"]) == (late["requests"] > 80 - 1 - int(0.99 * 80)), r
        assert (r["p50_s"] > late["s"]) == (late["requests"] > 80 - 1 - int(0.50 * 80)), r
    assert (doc["settings"]["max_instances"], doc["settings"]["queue_length"]) == (4, 64)
    assert any(r["waited_in_queue"] for r in doc["runs"] if r["policy"] == "locality")
    s = doc["summary"]
    assert s["bytes_moved"] < s["random_bytes_moved"], s
    assert s["burst_p99_ratio"] == pytest.approx(s["p99_s"] / s["one_cold_start_s"], rel=1e-2)
    assert s["instance_up_p99_ratio"] == pytest.approx(s["instance_up_p99_s"] / s["one_cold_start_s"], rel=1e-2)
    # The cold start the ratios divide by is the file's cold median of the mix's median function.
    assert s["one_cold_start_s"] in {m["cold_s"] for m in doc["measured"]["models"]}
    assert all(r["over_target"]["s"] == pytest.approx(3 * s["one_cold_start_s"]) for r in doc["runs"])
    other = sim.simulate(small_args(sim, tmp_path / "c.json", "--seeds", "3"))
    assert other["runs"] != doc["runs"][:2]


def test_the_simulators_views_hold_only_what_the_ingress_knows_when_it_places() -> None:
    """What `view` gives `place` of a node's function at t (instances up, starts under way,
    requests not answered, requests waiting in its queue) is what the run's final outcome says
    of t: nothing placed later changes it, so it is what torpord's answer and the ingress's own
    answers had at t. A short queue (8) makes torpord refuse some (429), sent again elsewhere."""
    sim = load_simulator()
    args = sim.parse(["--nodes", "8", "--starts", "120", "--functions", "3", "--link-gbps", "25",
                      "--queue-length", "8", "--out", "/dev/null"])
    models, _ = sim.measured_models()
    rng = random.Random(4)
    nodes, fns, sizes = sim.make_cluster(args, models, rng)
    link = 25e9 / 8
    seen = []

    def record(f: Any, t: float, views: list[NodeView], p: object) -> bool:
        seen.extend((v.node, f.name, t, v.instances, v.function_starting, len(v.starts_up_in_s), v.inflight,
                     v.queue_depth) for v in views if f.name in sim_nodes[v.node].requests_of)
        return False

    sim_nodes = {n.name: n for n in nodes}
    requests, wrong = sim.burst(args, "locality", nodes, fns, sizes, link, sim.draws(args, len(fns), rng), Bookkeeping(),
                                random.Random(0), record)
    sim.summarize("locality", 25.0, 4, requests, 0, nodes)
    assert wrong == 0 and any(r.kind == "join" for r in requests) and len(seen) > 100
    assert any(r.refusals for r in requests) and any(r.waited for r in requests)
    for node, fn, t, up, starting, booked, inflight, queued in seen:
        before = [r for r in requests if r.node == node and r.fn == fn and r.arrived < t]
        started = [r.start for r in before if r.start is not None]
        assert up == sum(1 for s in started if s.up <= t), (node, fn, t)
        assert starting == booked == sum(1 for s in started if s.up > t), (node, fn, t)
        assert inflight == sum(1 for r in before if r.answer > t), (node, fn, t)
        assert queued == sum(1 for r in before if r.waited and r.answer - r.handler_s > t), (node, fn, t)
        assert queued <= 8


def test_a_node_at_max_instances_starts_no_instance_and_charges_gpu_memory_per_start() -> None:
    """The node model as torpord: of 6 requests at once for one function on a node with
    max_instances 2, two start instances (each charged its GPU memory once), four make none and
    wait in the function's queue, each served by whichever of the two frees first (late
    binding); with queue.length 3, the sixth is refused (429) and changes nothing there."""
    sim = load_simulator()
    models, _ = sim.measured_models()
    m = dataclasses.replace(models[1], handler_s=0.2)  # long enough for both instances to serve
    f = sim.Fn("f", m, "base-0", 0)
    sizes = {"f": m.own_bytes, "base-0": m.base_bytes}
    node = sim.Node(0, max_instances=2, queue_length=3)
    node.have.update({"f": 0.0, "base-0": 0.0})
    node.staged.add("f")
    costs = sim.costs_for(sim.parse(["--out", "/dev/null"]), m, 25e9 / 8)
    p = sim.Placement(node.name, StartKind.STAGED, m.cold_s)
    got = [sim.start_on(node, f, p, costs, sizes, 25e9 / 8, 0.001 * i) for i in range(6)]
    assert got[5] is None, "the queue held 3: torpord answers 429"
    reqs = [r for r in got if r is not None]
    assert [r.start is not None for r in reqs] == [True, True, False, False, False]
    assert [r.queue_found for r in reqs] == [0, 0, 0, 1, 2]
    assert node.gpu_used == 2 * m.gpu_bytes and len(node.starts) == 2
    assert len(node.requests_of["f"]) == 5 and node.function_at("f", m.handler_s, 0.01) == (0, 2, 5, 3)
    sim.answer(node, reqs)
    ups = sorted(s.up for s in node.starts)
    assert {r.served_by for r in reqs} == {0, 1}
    # First come first served on the two instances: the one up first serves three, the other two.
    h = m.handler_s
    assert sorted(r.answer for r in reqs) == pytest.approx(
        sorted([ups[0] + h, ups[0] + 2 * h, ups[0] + 3 * h, ups[1] + h, ups[1] + 2 * h]))
    # A later request, once the queue has drained (everything answered), is taken at once.
    late = sim.start_on(node, f, p, costs, sizes, 25e9 / 8, 10.0)
    assert late is not None and late.start is None and late.queue_found == 0
    # Without a bound (0) every request starts one, as the model did before it.
    free = sim.Node(1, max_instances=0)
    free.have.update({"f": 0.0, "base-0": 0.0})
    assert all(sim.start_on(free, f, p, costs, sizes, 25e9 / 8, 0.0).start is not None for _ in range(6))
    assert free.gpu_used == 6 * m.gpu_bytes


def test_the_bound_counts_starts_still_under_way_on_the_node() -> None:
    """max_instances counts instances starting, not only those up: two starts still pulling
    their bytes (up long after) already hold the node at a bound of 2."""
    sim = load_simulator()
    node = sim.Node(0, max_instances=2)
    for _ in range(2):
        node.add_start("f", 5.0, nondriver_s=0.25, driver_s=0.3)
        node.add_request("f", 0.0)
    assert node.function_at("f", 0.02, 0.1)[:2] == (0, 2)
    assert not node.makes_start("f") and node.makes_start("g")


def test_simulator_writes_its_json_and_refuses_bad_arguments(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--nodes", "5", "--starts", "20",
         "--functions", "2", "--copies", "2", "--link-gbps", "25", "--seeds", "1", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert {"machine", "settings", "measured", "runs", "summary"} <= doc.keys()
    assert doc["measured"]["file"] == "bench/results/split-bench-burst-s17-final-h100.json"
    # The driver's turn is the file's own burst measurement, and the settings say which was used.
    turns = {m["name"]: m["driver_s"] for m in doc["measured"]["models"]}
    assert all(0.1 < d < 1.0 for d in turns.values()) and doc["settings"]["driver_s"] == turns, doc["measured"]
    assert doc["calibration"]["gpu_restores"] == doc["settings"]["gpu_restores"] == 2
    assert doc["machine"]["torpor_commit"] and "python" in doc["machine"]["versions"]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--copies", "0", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2 and "--copies must be from 1" in r.stderr.strip().splitlines()[-1], r.stderr
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cluster" / "simulate.py"), "--gpu-restores", "-1", "--out", str(out)],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert r.returncode == 2 and "--gpu-restores must be 0" in r.stderr.strip().splitlines()[-1], r.stderr


def test_cluster_code_is_typed() -> None:
    if subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True, check=False).returncode:
        pytest.skip("mypy is not installed here (make pytest installs it)")
    if importlib.util.find_spec("ray") is None:
        pytest.skip('Ray is not installed: pip install "ray[serve]>=2.40,<3" (make test does)')
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         str(ROOT / "python" / "torpor" / "cluster"), str(ROOT / "bench" / "cluster" / "simulate.py")],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


BURST_FILE = ROOT / "bench" / "results" / "split-bench-burst-s17-final-h100.json"


def file_burst8(model: str) -> tuple[float, float]:
    """The H100 file's burst of 8 on an idle GPU: median wall time until all 8 answered, median
    time until all 8 instances were up; read here, not through the simulator."""
    doc = json.loads(BURST_FILE.read_text())
    row = next(r for r in doc["results"] if r["model"] == model and r["mode"] == "burst8")
    return float(row["wall_s"]["median"]), statistics.median(run["all_up_s"] for run in row["runs"])


def test_the_model_reproduces_the_measured_burst_of_8_on_an_idle_node() -> None:
    """Calibration: 8 simultaneous starts of one model, staged, on an idle node, as the H100's
    burst8 (899f8ce). All answered within CALIBRATION_TOLERANCE (10 %) of the file's median
    wall time (the model leaves out the ~0.05 s the other starts' CRIU cost the first instance:
    resnet152 comes out 8 % early), all up within 1 % (the driver turn is derived from it)."""
    sim = load_simulator()
    models, _ = sim.measured_models()
    assert [m.name for m in models] == ["resnet152", "gpt2-large"]
    for m in models:
        wall, all_up = file_burst8(m.name)
        ups, answers = sim.burst_on_idle_node(m, 8)
        assert len(ups) == len(answers) == 8
        assert max(answers) == pytest.approx(wall, rel=sim.CALIBRATION_TOLERANCE), (m.name, answers, wall)
        assert max(ups) == pytest.approx(all_up, rel=0.01), (m.name, ups, all_up)
        # As on the H100 (starts: restored 1, warm 7): the first instance up answers all eight.
        assert min(answers) == pytest.approx(m.cold_s + m.handler_s)
        # The file's burst copy allowed 8 instances (split.py: max_instances = 8); at the
        # examples' 4 only 4 would start, the other requests waiting for them.
        ups4, answers4 = sim.burst_on_idle_node(m, 8, max_instances=4)
        assert len(ups4) == 4 and len(answers4) == 8 and max(answers4) <= max(answers)
    doc = sim.calibration(models, sim.measured_models()[1], 2)
    assert doc["max_instances"] == 8 and "max_instances = 8" in doc["max_instances_source"]
    assert "max_instances = {BURST}" in (ROOT / "bench" / "coldstart" / "split.py").read_text()


def test_the_driver_lane_serialises_turns_and_the_slots_bound_restores_in_flight() -> None:
    sim = load_simulator()
    # Two starts at once on an idle node: the second is up one driver turn after the first,
    # whichever function each is (one GPU, one lane).
    node = sim.Node(0)
    a = node.add_start("f", 0.0, nondriver_s=0.25, driver_s=0.3)
    b = node.add_start("g", 0.0, nondriver_s=0.25, driver_s=0.3)
    node.up_times()
    assert (a.up, b.up) == (pytest.approx(0.55), pytest.approx(0.85))
    # The lane takes starts in the order they are ready for it, not the order they were placed:
    # a start placed later whose bytes were there sooner goes first.
    node = sim.Node(0)
    late = node.add_start("f", 2.0, nondriver_s=0.25, driver_s=0.3)
    soon = node.add_start("g", 0.0, nondriver_s=0.25, driver_s=0.3)
    node.up_times()
    assert (soon.up, late.up) == (pytest.approx(0.55), pytest.approx(2.55))
    # With a non-driver part longer than a turn, 2 slots make the third start wait for the
    # first's turn to end before its non-driver part begins; without the bound it does not.
    for slots, third in ((2, 1.3 + 1.0 + 0.3), (0, 1.0 + 0.3 + 0.3 + 0.3)):
        node = sim.Node(0, gpu_restores=slots)
        starts = [node.add_start("f", 0.0, nondriver_s=1.0, driver_s=0.3) for _ in range(3)]
        node.up_times()
        assert [s.up for s in starts][:2] == [pytest.approx(1.3), pytest.approx(1.6)]
        assert starts[2].up == pytest.approx(third), slots
    assert node.pending_starts(1.29) == 3 and node.pending_starts(1.6) == 1 and node.pending_starts(2.0) == 0


def test_late_binding_answers_no_request_before_its_arrival_or_an_instance_of_its_function_is_up() -> None:
    sim = load_simulator()
    node = sim.Node(0)
    h = 0.02
    plan = [(0.0, "f", 0.0), (0.05, "f", 0.0), (0.1, "g", 0.0), (0.2, "f", 0.0), (3.0, "f", 3.0), (3.0, "g", 3.5)]
    reqs = []
    for t, fn, pull_end in plan:
        r = sim.Request(t, fn, h, node=node.name)
        r.start = node.add_start(fn, pull_end, nondriver_s=0.25, driver_s=0.3)
        reqs.append(r)
    sim.answer(node, reqs)
    for r in reqs:
        served = node.starts[r.served_by]
        assert served.fn == r.fn, r  # only an instance of its own function, on its node
        assert r.answer >= r.t + h - 1e-12 and r.answer >= served.up + h - 1e-12, r
    f0, f1, g0, f2, f3, g1 = reqs
    # The first f instance (up 0.55) answers the first three f requests back to back, before
    # the second f start is up (0.85); g waits for its own start's turn (up 1.15).
    assert [r.served_by for r in (f0, f1, f2)] == [0, 0, 0]
    assert (f0.answer, f1.answer, f2.answer) == (pytest.approx(0.57), pytest.approx(0.59), pytest.approx(0.61))
    assert g0.served_by == 2 and g0.answer == pytest.approx(1.15 + h)
    # Arriving when instances are up and idle: answered at once, by an instance already there.
    assert f3.answer == pytest.approx(3.0 + h) and f3.served_by != f3.start.seq
    assert g1.answer == pytest.approx(3.0 + h) and g1.served_by == 2


def test_measured_names_its_file_and_fields() -> None:
    sim = load_simulator()
    models, source = sim.measured_models()
    assert source["file"] == "bench/results/split-bench-burst-s17-final-h100.json"
    assert source["commit"].startswith("899f8ce") and "H100" in source["device"]
    assert "results[mode=cold].wall_s.median" in source["cold_s"]
    assert "all_up_s" in source["driver_s"] and "/ 7" in source["driver_s"]
    assert "answers[].timings.handler" in source["handler_s"]
    for key in ("base_bytes", "own_bytes", "snapshot_dir_bytes"):
        assert source[key].startswith("deploys.split.<model>."), key
    assert "DESIGN.md" in source["gpu_bytes"]
    doc = json.loads(BURST_FILE.read_text())
    for m in models:
        cold = next(r for r in doc["results"] if r["model"] == m.name and r["mode"] == "cold")["wall_s"]["median"]
        wall, all_up = file_burst8(m.name)
        assert m.cold_s == cold and m.driver_s == pytest.approx((all_up - cold) / 7, abs=1e-4)
        assert m.base_bytes == doc["deploys"]["split"][m.name]["sizes"]["base_dir"]["bytes"]
        assert source["burst8_wall_s"][m.name] == wall


def test_the_simulation_tables_in_readme_and_docs_are_the_rendering_of_the_json() -> None:
    """README.md and docs/cluster.md quote bench/cluster/sim_table.py's output, never typed."""
    spec = importlib.util.spec_from_file_location("sim_table", ROOT / "bench" / "cluster" / "sim_table.py")
    assert spec and spec.loader
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    doc = json.loads((ROOT / "bench" / "results" / "cluster-sim.json").read_text())
    for path, link in ((ROOT / "README.md", 25.0), (ROOT / "docs" / "cluster.md", None)):
        block = table.render(doc, link)
        assert block in path.read_text(), f"re-render {path.name}: python3 bench/cluster/sim_table.py --into {path.name} …"
    # A file without the block's marker is refused in one line naming it.
    with pytest.raises(ValueError, match="no block"):
        table.replace_block("no table here", table.render(doc, 25.0))


def deploying_router(deploys: dict[str, dict[str, Any]]) -> tuple[Any, list[tuple[str, str]]]:
    """The ingress's Router over three nodes a, b, c whose agents answer `deploy` with
    `deploys[node]` (what torpord's last deploy line becomes), `pull` with a pull, and report
    the object tier on every node; with the calls it made, in order."""
    from torpor.cluster.ingress import Router

    calls: list[tuple[str, str]] = []

    class ThreeNodes(Router):
        async def refresh_agents(self, force: bool = False) -> dict[str, Any]:
            return self.live_agents()

        def live_agents(self) -> dict[str, Any]:
            return {"a": "agent-a", "b": "agent-b", "c": "agent-c"}

        async def _call(self, node: str, handle: Any, method: str, *args: Any, timeout: float) -> Any:
            calls.append((node, method))
            if method == "capabilities":
                return {"pull": True}
            if method == "deploy":
                return {"node": node, **deploys[node]}
            assert method == "pull", method
            return {"node": node, "function": "f", "pulled_bytes": 10}

    return ThreeNodes(), calls


def test_a_deploy_that_finds_a_nodes_gpu_full_goes_to_the_next_node_which_the_others_pull_from() -> None:
    """torpord's deploy line says `"cause": "gpu_memory"` when the node's GPU had no room (not
    the function's fault): the cluster deploys on the next node, and every other node, the full
    one too, pulls the function from the bucket."""
    pytest.importorskip("ray")
    import asyncio

    full = {"error": "restore_base: GPU 0 has 10 MiB free but the base snapshot needs 64 MiB", "phase": "restore_base",
            "cause": "gpu_memory"}
    ok = {"result": {"function": "f", "snapshot": "fn-f-1"}}
    r, calls = deploying_router({"a": full, "b": ok, "c": ok})
    status, out = asyncio.run(r.deploy("/srv/f"))
    assert status == 200 and out["deployed_on"] == "b" and out["mode"] == "pull", out
    assert out["passed_over"] == {"a": full["error"]}, out
    assert [c for c in calls if c[1] == "deploy"] == [("a", "deploy"), ("b", "deploy")], calls
    assert sorted(n for n, m in calls if m == "pull") == ["a", "c"], calls

    # The function's own failure is every node's: not tried elsewhere.
    broken = {"error": "the worker failed in its setup step: ValueError: bad weights", "phase": "load"}
    r, calls = deploying_router({"a": broken, "b": ok, "c": ok})
    status, out = asyncio.run(r.deploy("/srv/f"))
    assert status == 500 and out["error"] == broken["error"], out
    assert [c for c in calls if c[1] in ("deploy", "pull")] == [("a", "deploy")], calls

    # Every node full: one 503 naming the cause and the fix, each node tried once.
    r, calls = deploying_router({"a": full, "b": full, "c": full})
    status, out = asyncio.run(r.deploy("/srv/f"))
    assert status == 503 and out["error"].startswith("no node had the GPU memory to deploy /srv/f"), out
    assert "3 tried" in out["error"] and "free GPU memory" in out["error"], out
    assert [c for c in calls if c[1] == "deploy"] == [("a", "deploy"), ("b", "deploy"), ("c", "deploy")], calls
