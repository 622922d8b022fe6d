"""Where an invocation goes: the one placement rule of a Torpor cluster.

`place` is a pure function of what the nodes report about one function (`NodeView`, built from
torpord's `GET /v1/functions/{name}/placement` and the ingress's own bookkeeping,
`torpor.cluster.bookkeeping`) and of a cost model (`Costs`). The HTTP ingress
(`torpor.cluster.ingress`) calls it for every request, and the simulator (`bench/cluster/
simulate.py`) calls the very same function for every simulated request, so that what the
simulator says about placement is what the cluster does. Nothing here does I/O, reads a clock
or draws a random number; `place_random`, the simulator's baseline, takes its generator as an
argument.

torpord binds requests late: a request waiting on a node is taken by whichever instance of its
function there frees first, its own start's or any other's. So a request does not have to wait
for a new start: it can **join** a node where its function already has instances up or coming
up. The rule, in order:
1. A node with an idle warm instance of the function (and no request of ours already headed
   for it) answers without any start: the one with the fewest requests in flight wins.
2. Otherwise the node that answers soonest, each node's estimate the sooner of
   - a join (`estimate_join_s`): the instances of the function up there (free now) and those
     starting (free when each is expected up) take, first come first served, the requests
     already sent there and not answered, a handler each (`FunctionNeeds.handler_s`); this one
     is answered a handler after the first instance free after them;
   - a new start (`estimate_start_s`): a staged snapshot (in memory) restores faster than one
     in the local store (disk), which beats one the node must pull from the bucket first (its
     missing bytes over the node's link). Each start already under way on the node (of any
     function: they share the GPU's driver) and each request waiting in its queue adds to the
     estimate, so a burst spreads.
   A join is `StartKind.JOIN`. torpord starts an instance for a request that finds none idle
   while the function's instances on the node, up and starting, are below its
   `max_instances` (`makes_start`; `NodeView.max_instances`, from its spec); at that bound it
   makes none, and the request waits for those instances: a join there makes no start, needs
   no GPU memory and delays nobody, and a new start there is not an option. Below the bound
   the request still makes its node start an instance, so a join needs the GPU memory a start
   does, and `Placement.start_s` says when that start is expected up (the ingress's bookkeeping
   keeps it, for the requests that come next). That start, if its bytes are on the node, goes
   ahead of the other functions' starts still pulling there (torpord restores starts in the
   order they are ready) and delays each by a driver turn (`delayed_s`): a node is ranked by the
   latest answer the request makes, its own or that of the requests it delays (a request
   already waiting on a pull is not pushed past what this one would wait elsewhere).
3. A function that needs GPU memory only goes where that much is free, unless it makes no
   start there (a warm instance, or a join at `max_instances`, holds its memory already). A node that is dead, excluded by the caller (a retry after that node
   failed) or that cannot get the snapshot at all is never chosen.
Ties go to the node with fewer requests in flight, then to the smaller name (deterministic).

What the simulator says (bench/results/cluster-sim.json; docs/cluster.md, "Simulation"): 1 000
requests in 1 s on 100 nodes at 25 Gb/s, each function bounded by its max_instances (4) per node
as torpord bounds it, are answered with a p99 of 1.73x one cold start (the issue's target is 3x;
3.945x in the model that started an instance for every request, 7.15x before joins), with 133
starts and 4.2 GB pulled; 1.72x at 100 Gb/s, 2.14x at 10. The queues of popular functions fill
to torpord's queue.length (64), which this rule does not know: torpord refuses about 250
attempts per run (429, 176-207 of the 1 000 requests), each sent elsewhere by the ingress.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

# What a request's handler is assumed to take when the caller says nothing (the ingress says:
# `torpor.cluster.bookkeeping` keeps an average of its answers' `X-Torpor-Timings`).
DEFAULT_HANDLER_S = 0.1


class StartKind(str, Enum):
    """How the chosen node will serve: from a warm instance, from an instance of the function up
    or starting there (a join), or by starting one from a snapshot that is staged, in its local
    store, or that it must pull first."""

    WARM = "warm"
    JOIN = "join"
    STAGED = "staged"
    LOCAL = "local"
    PULL = "pull"


@dataclass(frozen=True)
class NodeView:
    """What one node says about one function, plus what the caller knows of its own requests.

    From torpord's placement answer: `known`, `warm_idle`, `queue_depth`, `staged`,
    `local_snapshot`, `in_bucket`, `gpu_free_bytes`, and `instances` (the function's live
    instances on the node, busy or idle: up, not starting). `missing_bytes`: the bytes of the
    snapshot this node lacks (None: unknown, then the whole `FunctionNeeds.snapshot_bytes` is
    assumed). `pull_backlog_bytes`: what the node's link must still move before this pull's
    bytes (pulls under way; the simulator knows it, torpord does not say).

    From the caller's bookkeeping (`torpor.cluster.bookkeeping.Bookkeeping`): `inflight`,
    requests the caller has sent to this node for this function and not yet seen answered;
    `starting`, the starts under way on the node, of every function (its driver lane's load:
    the sum over functions of torpord's `starting` for each, as last seen, plus the starts sent
    since); `starts_up_in_s`, for each start of *this* function under way on the node, the
    seconds until it is expected up (the estimate made when the request that started it was
    sent, less the time since, never below 0; torpord's `starting` for the function says how
    many are still under way, and the earliest expected are taken as the ones already up);
    `pulls_up_in_s`, for each start of *another* function under way on the node that is still
    waiting for its bytes (sent as a pull whose estimated pull has not ended), the seconds until
    it is expected up.

    The function's bound: `max_instances`, its spec's `scaling.max_instances` (torpord's
    placement answer's; None: not known, no bound assumed), and `function_starting`, torpord's `starting` for
    the function on the node (its placement answer's, daemons since f309d2f). torpord starts an
    instance for a request that finds none idle only while the function's instances there,
    up and starting, are below `max_instances` (`makes_start`); otherwise the request waits in
    the function's queue and is taken by the first of them to free (late binding)."""

    node: str
    alive: bool = True
    known: bool = False
    warm_idle: int = 0
    queue_depth: int = 0
    staged: bool = False
    local_snapshot: bool = False
    in_bucket: bool = False
    gpu_free_bytes: int | None = None
    missing_bytes: int | None = None
    pull_backlog_bytes: int = 0
    inflight: int = 0
    starting: int = 0
    instances: int = 0
    starts_up_in_s: tuple[float, ...] = ()
    pulls_up_in_s: tuple[float, ...] = ()
    max_instances: int | None = None
    function_starting: int = 0


@dataclass(frozen=True)
class FunctionNeeds:
    """The function's GPU memory (0: CPU only), its snapshot's size (for pull estimates) and the
    seconds its handler takes per request (for join estimates: the ingress keeps an average of
    the `handler` of its answers' `X-Torpor-Timings`, and a cold start's time before the first)."""

    name: str
    gpu_bytes: int = 0
    snapshot_bytes: int = 0
    handler_s: float = DEFAULT_HANDLER_S


@dataclass(frozen=True)
class Costs:
    """Seconds a start takes by where its snapshot is, and what slows it.

    Defaults: the split path on the H100 as session 3 measured it (a fresh restore of GPT-2-Large
    to its first answer, host cache, median 1.39 s; resnet152 1.31 s; session 26's
    bench/results/split-bench-h100.json has 0.59 / 0.49 s: the simulator's figures are kept so
    that its results stay comparable across sessions), a disk copy read
    at `disk_bytes_per_s` and a pull at `link_bytes_per_s` (assumed, not measured: the H100 runs
    have no network figure yet). `start_contention_s`: what each other start under way on the node
    adds (8 concurrent restores of a 4.9 GB snapshot took 6.3 s against 4.8 s for one: +0.21 s
    each, DESIGN.md §1); `queue_wait_s`: what each request queued on the node adds."""

    restore_staged_s: float = 1.39
    restore_local_extra_s: float = 0.35
    link_bytes_per_s: float = 12.5e9
    start_contention_s: float = 0.21
    queue_wait_s: float = 0.05


@dataclass(frozen=True)
class Placement:
    """The chosen node, how it will serve, the estimate the choice was made on (seconds until
    the request is answered), `start_s`: seconds until the instance this request makes the node
    start is expected to answer (`estimate_start_s` there; None: no start, a warm one or a join
    of a function at its `max_instances` there), and
    `pull_s`: seconds until that start's bytes are all on the node (`estimate_pull_s`)."""

    node: str
    kind: StartKind
    estimate_s: float
    start_s: float | None = None
    pull_s: float = 0.0


def function_count(view: NodeView) -> int:
    """The function's instances on `view`'s node that count towards its `max_instances`: those
    up (`instances`) and those starting (torpord's `function_starting`, or the starts the caller
    knows it caused there, `starts_up_in_s`, when they are more: sent since torpord's answer)."""
    return view.instances + max(view.function_starting, len(view.starts_up_in_s))


def makes_start(view: NodeView) -> bool:
    """Whether a request that finds no idle instance on `view`'s node makes torpord start one:
    while the function's instances there, up and starting, are below its `max_instances`
    (unknown: yes). Otherwise it waits in the function's queue for one of them."""
    return view.max_instances is None or function_count(view) < view.max_instances


def start_kind(view: NodeView) -> StartKind | None:
    """How `view`'s node would start a new instance; None: it cannot get the snapshot."""
    if view.staged:
        return StartKind.STAGED
    if view.local_snapshot:
        return StartKind.LOCAL
    if view.in_bucket:
        return StartKind.PULL
    return None


def estimate_start_s(fn: FunctionNeeds, view: NodeView, costs: Costs) -> float | None:
    """Seconds until a new instance of `fn` on `view`'s node could answer; None: it cannot start
    one (no snapshot to be had, not enough free GPU memory, or the function at its
    `max_instances` there: torpord makes no start, `makes_start`)."""
    kind = start_kind(view)
    if kind is None or not makes_start(view):
        return None
    if fn.gpu_bytes > 0 and view.gpu_free_bytes is not None and view.gpu_free_bytes < fn.gpu_bytes:
        return None
    s = costs.restore_staged_s
    if kind is not StartKind.STAGED:
        s += costs.restore_local_extra_s
    if kind is StartKind.PULL:
        missing = fn.snapshot_bytes if view.missing_bytes is None else view.missing_bytes
        s += (view.pull_backlog_bytes + missing) / costs.link_bytes_per_s
    return s + view.starting * costs.start_contention_s + view.queue_depth * costs.queue_wait_s


def estimate_pull_s(fn: FunctionNeeds, view: NodeView, costs: Costs) -> float:
    """Seconds until a start of `fn` on `view`'s node has all its bytes there: 0 unless it must
    pull them (the link's backlog and the bytes it lacks, over the link)."""
    if start_kind(view) is not StartKind.PULL:
        return 0.0
    missing = fn.snapshot_bytes if view.missing_bytes is None else view.missing_bytes
    return (view.pull_backlog_bytes + missing) / costs.link_bytes_per_s


def delayed_s(fn: FunctionNeeds, view: NodeView, costs: Costs) -> float:
    """When the latest of the starts that a start of `fn` on `view`'s node would delay is then
    expected up (0: it delays none). torpord gives its restore slots and driver lane to starts
    in the order they are ready, so a start whose bytes are on the node goes ahead of the other
    functions' starts still pulling there, and each is up a driver turn (`start_contention_s`)
    later; the requests waiting for them (with late binding, each started one) wait as much
    more. A start that itself pulls delays none of them (the node's link serves pulls in order),
    and a request that makes no start (the function at its `max_instances`) delays none."""
    if start_kind(view) is StartKind.PULL or not view.pulls_up_in_s or not makes_start(view):
        return 0.0
    return max(0.0, *view.pulls_up_in_s) + costs.start_contention_s


def estimate_join_s(fn: FunctionNeeds, view: NodeView) -> float | None:
    """Seconds until this request would be answered on `view`'s node by an instance of `fn` that
    is up there (free now) or starting (free when it is expected up), after the requests already
    sent there (`inflight`, or torpord's `queue_depth` when larger), first come first served, a
    handler each. None: no instance of `fn` up or starting there, or no GPU memory for the start
    the request would make (torpord starts one for a request that finds none idle while the
    function is below its `max_instances` there; at it, the request makes none and needs no
    GPU memory)."""
    if not view.instances and not view.starts_up_in_s:
        return None
    if (makes_start(view) and fn.gpu_bytes > 0 and view.gpu_free_bytes is not None
            and view.gpu_free_bytes < fn.gpu_bytes):
        return None
    free = [0.0] * view.instances + sorted(max(0.0, s) for s in view.starts_up_in_s)
    heapq.heapify(free)
    h = max(0.0, fn.handler_s)
    for _ in range(max(view.inflight, view.queue_depth)):
        heapq.heapreplace(free, free[0] + h)
    return free[0] + h


def place(
    fn: FunctionNeeds, views: Sequence[NodeView], costs: Costs, exclude: Iterable[str] = ()
) -> Placement | None:
    """The node for the next request of `fn` (the module doc says the rule); None: no live node,
    outside `exclude`, can serve it."""
    skip = frozenset(exclude)
    live = [v for v in views if v.alive and v.node not in skip]
    warm = [v for v in live if v.warm_idle > v.inflight]
    if warm:
        best = min(warm, key=lambda v: (v.inflight, -(v.warm_idle - v.inflight), v.node))
        return Placement(best.node, StartKind.WARM, 0.0)
    # (the latest answer it makes, in flight, node, kind, its own estimate, its start's (None:
    # it makes none), its pull)
    scored: list[tuple[float, int, str, StartKind, float, float | None, float]] = []
    for v in live:
        kind = start_kind(v)
        if kind is None:
            continue
        join = estimate_join_s(fn, v)
        if not makes_start(v):
            # At max_instances: torpord makes no start, the request waits for the instances.
            if join is not None:
                scored.append((join, v.inflight, v.node, StartKind.JOIN, join, None, 0.0))
            continue
        new = estimate_start_s(fn, v, costs)
        if new is None:
            continue  # the start the request would make cannot be made: no join either
        est, how = (join, StartKind.JOIN) if join is not None and join < new else (new, kind)
        latest = max(est, delayed_s(fn, v, costs))
        scored.append((latest, v.inflight, v.node, how, est, new, estimate_pull_s(fn, v, costs)))
    if not scored:
        return None
    _, _, node, how, est, start, pull = min(scored)
    return Placement(node, how, est, start, pull)


def place_random(
    fn: FunctionNeeds, views: Sequence[NodeView], rng: random.Random, exclude: Iterable[str] = ()
) -> Placement | None:
    """The baseline the simulator compares with: any live node that can serve `fn` (it can get
    the snapshot and has the GPU memory for the start it would make, or makes none: the
    function at its `max_instances` there), chosen uniformly with `rng`; no warm-first, no
    locality, no joins."""
    skip = frozenset(exclude)
    able = [
        v for v in views if v.alive and v.node not in skip
        and (estimate_start_s(fn, v, Costs()) is not None or (start_kind(v) is not None and not makes_start(v)))
    ]
    if not able:
        return None
    v = rng.choice(sorted(able, key=lambda x: x.node))
    kind = start_kind(v)
    assert kind is not None
    return Placement(v.node, kind, 0.0)
