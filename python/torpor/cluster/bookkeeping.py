"""What the ingress remembers between placements, for `placement.place`'s join estimates.

torpord's placement answer says how many instances of a function are up on a node (`instances`)
and how many are starting (`starting`), not when those starts will be up. The ingress knows it
better than anyone: it sent the request that made each start, and `place` estimated then when
that start would answer (`Placement.start_s`). So, per (node, function), the ingress keeps the
expected up time of each start it caused (`sent`), and lets torpord's count correct it
(`seen`): when torpord says fewer are starting than the ingress sent before that answer, the
ones expected earliest are taken as up and forgotten. From these it gives `place`:

- `starts_up_in(node, fn, now)`: seconds until each start of the function under way there is
  expected up (`NodeView.starts_up_in_s`);
- `node_starting(node, now)`: the starts under way on the node, of every function
  (`NodeView.starting`: the node's driver lane's load; torpord answers per function only);
- `pulls_up_in(node, fn, now)`: seconds until each start of another function under way on
  the node whose bytes are expected to be still arriving is expected up
  (`NodeView.pulls_up_in_s`: a start placed there with its bytes at hand would go ahead of
  them, and `sent` moves them a driver turn later when one is);
- `handler_s(fn)`: an average (EWMA) of the `handler` of the function's answers'
  `X-Torpor-Timings` (`FunctionNeeds.handler_s`);
- `snapshot_bytes(fn)`: the most a node's pull of the function moved (`pulled_bytes` of the
  deploy's pulls; `FunctionNeeds.snapshot_bytes`, for pull estimates).

A start stays "under way" while torpord's last count (`FRESH_S` old at most) vouches for it, or,
without such a count, until its expected up time. Everything here is pure bookkeeping: the
clock is an argument, no I/O, no Ray (tests/test_cluster_placement.py tests it directly).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from torpor.cluster.placement import DEFAULT_HANDLER_S

# How old torpord's `starting` may be to keep a start that is past its expected up time
# "under way" (the ingress refreshes a function's views every 0.25 s while it has requests).
FRESH_S = 1.0
# The weight of the newest answer in the handler's average.
HANDLER_ALPHA = 0.2


class SentStart(NamedTuple):
    """A start the ingress caused: when it sent the request, when the start was expected to
    answer (`Placement.start_s` after that) and to have its bytes (`Placement.pull_s`)."""

    sent_at: float
    up_at: float
    ready_at: float


@dataclass
class _Starts:
    """One (node, function): the starts the ingress caused there, and torpord's last `starting`
    for the function there with when that answer was asked for."""

    starts: list[SentStart] = field(default_factory=list)
    seen_at: float | None = None
    seen_starting: int = 0


def pending(
    starts: Sequence[SentStart], seen_at: float | None, seen_starting: int, now: float, fresh_s: float = FRESH_S
) -> list[SentStart]:
    """The starts of `starts` (those the caller caused on one node for one function) still under
    way at `now`, soonest expected up first, given torpord's count `seen_starting` of the
    function's starts under way there when asked at `seen_at` (None: never asked). Of the starts
    sent before then only the `seen_starting` expected up last are still under way (torpord's
    starts end in about the order they began); those sent since (or at that instant) all are. Without a count younger than
    `fresh_s`, a start past its expected up time is taken as up."""
    if seen_at is None:
        kept = list(starts)
    else:
        before = sorted((s for s in starts if s.sent_at < seen_at), key=lambda s: s.up_at)
        kept = before[len(before) - min(len(before), max(0, seen_starting)):]
        kept += [s for s in starts if s.sent_at >= seen_at]
    if seen_at is None or now - seen_at > fresh_s:
        kept = [s for s in kept if s.up_at > now]
    return sorted(kept, key=lambda s: (s.up_at, s.sent_at))


def handler_of(timings: str | None) -> float | None:
    """The `handler` seconds of an `X-Torpor-Timings` header (a JSON object), or None."""
    if not timings:
        return None
    try:
        doc = json.loads(timings)
    except ValueError:
        return None
    h = doc.get("handler") if isinstance(doc, dict) else None
    return float(h) if isinstance(h, (int, float)) and not isinstance(h, bool) and h >= 0 else None


class Bookkeeping:
    """The ingress's memory of its starts and of its functions' handler times (module doc)."""

    def __init__(self, default_handler_s: float = DEFAULT_HANDLER_S, alpha: float = HANDLER_ALPHA,
                 fresh_s: float = FRESH_S) -> None:
        self.default_handler_s = default_handler_s
        self.alpha = alpha
        self.fresh_s = fresh_s
        self._starts: dict[str, dict[str, _Starts]] = {}  # node -> function -> its starts
        self._handler: dict[str, float] = {}
        self._snapshot_bytes: dict[str, int] = {}

    def sent(
        self, node: str, fn: str, now: float, start_s: float | None, pull_s: float = 0.0, turn_s: float = 0.0
    ) -> None:
        """A request of `fn` was sent to `node` at `now`; `start_s` and `pull_s` (`Placement`'s):
        when the start it makes there is expected to answer, and to have its bytes, from now
        (`start_s` None: it makes no start). A start with its bytes at hand goes ahead of the
        other functions' starts still pulling there (torpord takes starts in the order they are
        ready): each of those is expected up `turn_s` (its driver turn) later."""
        if start_s is None:
            return
        starts = self._starts.setdefault(node, {})
        if pull_s <= 0.0 and turn_s > 0.0:
            for g, rec in starts.items():
                if g != fn:
                    rec.starts = [
                        s._replace(up_at=s.up_at + turn_s) if s.ready_at > now else s for s in rec.starts
                    ]
        starts.setdefault(fn, _Starts()).starts.append(SentStart(now, now + max(0.0, start_s), now + max(0.0, pull_s)))

    def seen(self, node: str, fn: str, starting: int | None, at: float) -> None:
        """torpord's placement answer for `fn` on `node`, asked for at `at`, said `starting` (None:
        a daemon that does not say). The starts sent before it that it no longer counts (the
        ones expected up first) are forgotten."""
        if starting is None:
            return
        rec = self._starts.setdefault(node, {}).setdefault(fn, _Starts())
        if rec.seen_at is not None and at < rec.seen_at:
            return  # older than the answer already taken
        rec.seen_at, rec.seen_starting = at, max(0, starting)
        rec.starts = pending(rec.starts, at, rec.seen_starting, at, float("inf"))

    def _pending(self, rec: _Starts, now: float) -> list[SentStart]:
        rec.starts = pending(rec.starts, rec.seen_at, rec.seen_starting, now, self.fresh_s)
        return rec.starts

    def starts_up_in(self, node: str, fn: str, now: float) -> tuple[float, ...]:
        """`NodeView.starts_up_in_s`: seconds until each start of `fn` under way on `node` is
        expected up (0 for one that is late), soonest first."""
        rec = self._starts.get(node, {}).get(fn)
        return () if rec is None else tuple(max(0.0, s.up_at - now) for s in self._pending(rec, now))

    def node_starting(self, node: str, now: float) -> int:
        """`NodeView.starting`: the starts under way on `node`, every function's."""
        return sum(len(self._pending(rec, now)) for rec in self._starts.get(node, {}).values())

    def pulls_up_in(self, node: str, fn: str, now: float) -> tuple[float, ...]:
        """`NodeView.pulls_up_in_s`: seconds until each start under way on `node` of a function
        other than `fn` whose bytes are expected to be still arriving at `now` is expected up."""
        return tuple(sorted(
            max(0.0, s.up_at - now)
            for g, rec in self._starts.get(node, {}).items() if g != fn
            for s in self._pending(rec, now) if s.ready_at > now
        ))

    def answered(self, fn: str, timings: str | None) -> None:
        """An answer of `fn` came back with this `X-Torpor-Timings`: its handler joins the average."""
        h = handler_of(timings)
        if h is None:
            return
        old = self._handler.get(fn)
        self._handler[fn] = h if old is None else (1 - self.alpha) * old + self.alpha * h

    def handler_s(self, fn: str) -> float:
        """`FunctionNeeds.handler_s`: the average handler of `fn`'s answers, or the default."""
        return self._handler.get(fn, self.default_handler_s)

    def pulled(self, fn: str, pulled_bytes: object) -> None:
        """A node pulled `fn` (torpord's pull answer's `pulled_bytes`): the most a node lacking
        it pulls, for `FunctionNeeds.snapshot_bytes`."""
        if isinstance(pulled_bytes, int) and not isinstance(pulled_bytes, bool) and pulled_bytes > 0:
            self._snapshot_bytes[fn] = max(self._snapshot_bytes.get(fn, 0), pulled_bytes)

    def snapshot_bytes(self, fn: str) -> int:
        """`FunctionNeeds.snapshot_bytes`: the most a pull of `fn` moved (0: never seen one)."""
        return self._snapshot_bytes.get(fn, 0)

    def forget_node(self, node: str) -> None:
        """`node` died: its starts died with it."""
        self._starts.pop(node, None)
