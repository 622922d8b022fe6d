"""Where an invocation goes: the one placement rule of a Torpor cluster.

`place` is a pure function of what the nodes report about one function (`NodeView`, built from
torpord's `GET /v1/functions/{name}/placement`) and of a cost model (`Costs`). The HTTP ingress
(`torpor.cluster.ingress`) calls it for every request, and the simulator (`bench/cluster/
simulate.py`) calls the very same function for every simulated cold start, so that what the
simulator says about placement is what the cluster does. Nothing here does I/O, reads a clock
or draws a random number; `place_random`, the simulator's baseline, takes its generator as an
argument.

The rule, in order:
1. A node with an idle warm instance of the function (and no request of ours already headed
   for it) answers without any start: the one with the fewest requests in flight wins.
2. Otherwise the node whose estimated start is soonest: a staged snapshot (in memory) restores
   faster than one in the local store (disk), which beats one the node must pull from the
   bucket first (its missing bytes over the node's link). Each start already under way on the
   node, and each request waiting in its queue, adds to the estimate, so a burst spreads.
3. A function that needs GPU memory only goes where that much is free (a warm instance holds
   its memory already). A node that is dead, excluded by the caller (a retry after that node
   failed) or that cannot get the snapshot at all is never chosen.
Ties go to the node with fewer requests in flight, then to the smaller name (deterministic).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


class StartKind(str, Enum):
    """How the chosen node will serve: from a warm instance, or by starting one from a snapshot
    that is staged, in its local store, or that it must pull first."""

    WARM = "warm"
    STAGED = "staged"
    LOCAL = "local"
    PULL = "pull"


@dataclass(frozen=True)
class NodeView:
    """What one node says about one function, plus what the caller knows of its own requests.

    `missing_bytes`: the bytes of the snapshot this node lacks (None: unknown, then the whole
    `FunctionNeeds.snapshot_bytes` is assumed). `pull_backlog_bytes`: what the node's link must still
    move before this pull's bytes (pulls under way; the simulator knows it, torpord does not say).
    `inflight`: requests the caller has sent to this
    node for this function and not yet seen answered. `starting`: starts under way on the node
    (the simulator knows them; the ingress counts its requests that were sent as cold starts)."""

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


@dataclass(frozen=True)
class FunctionNeeds:
    """The function's GPU memory (0: CPU only) and its snapshot's size, for pull estimates."""

    name: str
    gpu_bytes: int = 0
    snapshot_bytes: int = 0


@dataclass(frozen=True)
class Costs:
    """Seconds a start takes by where its snapshot is, and what slows it.

    Defaults: the split path on the H100 (bench/results/split-bench-h100.json: a fresh restore of
    GPT-2-Large to its first answer, host cache, median 1.39 s; resnet152 1.31 s), a disk copy read
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
    """The chosen node, how it will start, and the estimate the choice was made on."""

    node: str
    kind: StartKind
    estimate_s: float


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
    one (no snapshot to be had, or not enough free GPU memory)."""
    kind = start_kind(view)
    if kind is None:
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
    scored: list[tuple[float, int, str, StartKind]] = []
    for v in live:
        est = estimate_start_s(fn, v, costs)
        kind = start_kind(v)
        if est is not None and kind is not None:
            scored.append((est, v.inflight, v.node, kind))
    if not scored:
        return None
    est, _, node, kind = min(scored)
    return Placement(node, kind, est)


def place_random(
    fn: FunctionNeeds, views: Sequence[NodeView], rng: random.Random, exclude: Iterable[str] = ()
) -> Placement | None:
    """The baseline the simulator compares with: any live node that can start `fn` (it can get
    the snapshot and has the GPU memory), chosen uniformly with `rng`; no warm-first, no locality."""
    skip = frozenset(exclude)
    able = [v for v in views if v.alive and v.node not in skip and estimate_start_s(fn, v, Costs()) is not None]
    if not able:
        return None
    v = rng.choice(sorted(able, key=lambda x: x.node))
    kind = start_kind(v)
    assert kind is not None
    return Placement(v.node, kind, 0.0)
