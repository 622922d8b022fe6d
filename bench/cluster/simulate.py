"""A burst of cold starts on a simulated Torpor cluster, placed by the cluster's own rule.

    python3 bench/cluster/simulate.py [--nodes 100] [--starts 1000] [--functions 20] [--window-s 1]
        [--link-gbps 25 100 10] [--seeds 1 2 3] [--gpu-restores 2] [--max-instances 4] [--queue-length 64]
        [--refusal-s 0.01] [--out bench/results/cluster-sim.json]

Every simulated request is placed by `torpor.cluster.placement.place`, the function the ingress
calls for real requests (`place_random` is the baseline), on views of the nodes built the way
torpord's placement answer describes them, and is sent there; the node starts an instance for
it or makes it wait for the instances it has, as torpord decides. The nodes follow torpord since
session 17 (binary 899f8ce; docs/split.md, "Bursts"): requests are bound late, the driver's
restores take turns on a GPU, and a function's instances on a node are bounded by its
`max_instances`. What the simulation models, and where each figure comes from:

- Functions: `--functions` functions, alternately shaped like the two measured models of
  bench/results/split-bench-burst-s17-final-h100.json (split path, H100, one machine, one call,
  binary 899f8ce): resnet152 and GPT-2-Large. `cold`: its `cold` wall median (0.44 s, 0.56 s: a
  fresh restore to the first answer, the snapshot staged); `d`, one driver restore's turn:
  `(median all_up_s of burst8 - cold) / 7` (0.27 s, 0.30 s: 8 simultaneous starts were all up
  after 2.36 s, 2.69 s); `handler`: the median handler time of the burst's answers (0.02 s).
  A start from the local disk instead of staged adds its snapshot directory's size read at
  `--disk-gbps` (assumed 5 GB/s NVMe; not measured there).
- An instance start on a node, once every byte it needs is there: its non-driver part (CRIU, hot
  set, segments) takes `cold - d` (plus the disk read when not staged), then it waits for the
  node's one driver lane (one GPU a node; the driver restores one at a time) and holds it `d`;
  it is up when its turn ends. The lane serves starts in the order they become ready for it. At
  most `--gpu-restores` starts (torpord's `restore_server.gpu_restores`, default 2) are between
  the start of their non-driver part and the end of their turn at once; the others wait for a
  slot, in the order their pulls ended (0: no bound but the lane). An instance stays up after
  serving: it is warm for the later requests of the burst.
- Starts, as torpord's routing (docs/torpord.md, "Routing"; `pool.rs` `acquire`): a request
  starts an instance on its node while its function's instances there, up and starting, are
  below the function's `scaling.max_instances` (`--max-instances`, default 4: every example
  function's value, `examples/*/torpor.toml`, and the spec's default; 0: no bound, the model
  before it); instances never end within the burst, so that is every start made there so far.
  Otherwise it makes no start and waits in the function's queue on the node. Below the bound
  a request starts one even when an instance of its function is idle there (torpord would
  serve it warm, without a start: left out, so the model may make more starts than torpord,
  never more than the bound; the issue's "1 000 cold starts" have none idle at their arrival).
- The queue (torpord's `[queue]`, defaults `length = 64`, `timeout_s = 30`, per function and
  node): a request that would wait while `--queue-length` others of its function already wait
  there is refused, 429, and changes nothing on the node; the ingress sends it again at once
  to the best node it has not tried (`ingress.RETRY_STATUSES`), here `--refusal-s` later
  (0.01 s assumed: the 429's way back, the placement answers asked again, the send; not
  measured). Each run counts the 429s (`refusals_429`) and the requests that got one. A wait
  in the queue past 30 s would be a 503: counted (`queue_timeouts_503`), never re-sent (none
  in a 1 s burst; if ever non-zero, those requests' times are not torpord's).
- Late binding: a request is answered at `max(its arrival at its node, the time an instance of
  its function there is free) + handler`, by the instance that frees first (its own start, or
  any other of that function on that node), requests taken first come first (torpord wakes
  every waiting request of the function when an instance frees and the first to look takes
  it; the model takes them in arrival order). A request that waited in the queue is served
  the same way.
- Bytes: a node pulls the base snapshot once (its `base_dir` bytes, 1.04-1.11 GB) for every
  function on that base, and per function the bytes that are its own: its segments' chunks in
  the store, deduplicated (`sizes.store.stored`: 0.28 GB, 2.86 GB) plus its snapshot directory
  less the base's (the CRIU pages it adds;
  content-defined chunks share the rest with the base: an assumption, the H100 runs did not
  measure the overlap). Two bases: even functions on one, odd on the other.
- Links: each node pulls over its own link at `--link-gbps` (no network was measured on the H100;
  10, 25 and 100 Gb/s are swept), its pulls one after another (FIFO), a second start that needs a
  pull under way waiting for it rather than pulling again. The bucket's own throughput is not a
  limit. A start never begins before every byte it needs is on the node.
- Placement's cost model (`Costs`): `restore_staged_s` = the model's `cold`, and each start under
  way on a node adds the model's `d` (`start_contention_s`), so a burst still spreads.
- What `place` sees (`view`): what torpord's placement answer says of the node at the request's
  arrival (its function's `instances` up, `starting` and `queue_depth`; free GPU memory; staged
  or local), the function's `max_instances` (its spec's, in the same answer),
  the requests of ours not yet answered there (the ingress sees each answer come back), the
  node's starts under way of every function (the sum of torpord's per-function `starting`),
  and, from `torpor.cluster.bookkeeping.Bookkeeping` fed as the ingress feeds it, when each
  start of the function under way there is expected up (the estimate `place` made when the
  request that started it was sent, corrected by torpord's count) and when the other
  functions' starts still pulling there are. The function's handler is the measured one (the
  ingress's average of its answers' handler after earlier traffic). Left out: that the
  ingress's views are up to 0.25 s old; the link backlog and the bytes a node lacks are the
  node model's (torpord does not say them; the ingress assumes the whole snapshot).
  `tests/test_cluster_placement.py` checks that nothing placed later changes what a view said.
- GPU: each node has one 80 GB GPU; an instance holds the model's NVML figure (resnet152 ~1.3 GB,
  GPT-2-Large 3.89 GB, DESIGN.md §1) from the placement of the request that started it on:
  GPU memory is charged per start, never for a request that makes none.
- Initial state: every function's snapshot is in the bucket, staged on its home node (where it
  was deployed) and in the local store of `--copies` nodes in all (earlier traffic).
- Arrivals: `--starts` requests, none finding an idle instance, at uniform random times within
  `--window-s`, the function drawn from a Zipf(1.1) popularity.

Two figures per run, each p50/p99: the time from a request's arrival to its answer, and the time
from a start's request to its instance being up. The headline, `summary.burst_p99_ratio`, is the
first (the locality policy's request p99 over one cold start: the file's `cold` of the mix's
median function): the issue asks for the p99 start time of 1 000 cold starts as a client sees
it, and under late binding a request's start is over when it is answered. The instance-up
figure (`instance_up_p99_ratio`) is kept beside it because it is larger (3.89x against 1.73x at
25 Gb/s in bench/results/cluster-sim.json): most requests of a burst are served by the first
instances up while the later ones still restore.

The JSON (`--out`) records the machine, the commit, the versions, every figure taken and from
which field of which file (`measured`), the model's own burst of 8 on an idle node against the
file's (`calibration`: with the burst copy's `max_instances` of 8, bench/coldstart/split.py, so
all 8 start as on the H100), every run (policy x link x seed) and a top-level `summary` of the
default link (25 Gb/s), with the same for random placement, the bytes moved, the starts made
and the refusals.

The model before session 17 (each restore under way adding `(burst8 - cold) / 7` of
split-bench-session15-h100.json to a start, every request waiting for its own instance) was
dropped, not kept as an option: it models a daemon that no longer exists, and git keeps it
(c968059). So was `--no-start-on-join` (a daemon that made no start for a request joining its
function's instances on a node; never torpord's), once the model bounded the starts by
`max_instances` as torpord does: it no longer showed what the extra starts cost, and was
slower than torpord's rule (e2a8fe1 has it).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from torpor.cluster.bookkeeping import Bookkeeping  # noqa: E402
from torpor.cluster.placement import (  # noqa: E402
    Costs,
    FunctionNeeds,
    NodeView,
    Placement,
    place,
    place_random,
)

SPLIT_BENCH = ROOT / "bench" / "results" / "split-bench-burst-s17-final-h100.json"
GPU_BYTES = 80 * 10**9
# NVML's per-process GPU memory of a restored instance (DESIGN.md §1: GPT-2-Large 3.89 GB; the
# resnet152 figure is its weights plus the ~1 GB context of a PyTorch process, same table).
INSTANCE_GPU_BYTES = {"resnet152": 1_300_000_000, "gpt2-large": 3_890_000_000}
MODEL_NAMES = ("resnet152", "gpt2-large")
BURST = 8
DEFAULT_LINK_GBPS = 25.0
DEFAULT_GPU_RESTORES = 2  # torpord's restore_server.gpu_restores default
# Every example function's scaling.max_instances (examples/*/torpor.toml; spec.py's default too).
DEFAULT_MAX_INSTANCES = 4
# torpord's [queue] defaults (crates/torpord/src/config.rs, QueueLimits): per function and node,
# the requests that may wait for an instance (one more is answered 429) and how long each may.
DEFAULT_QUEUE_LENGTH = 64
QUEUE_TIMEOUT_S = 30.0
# From torpord's 429 to the ingress's next attempt: the refusal's way back, the placement answers
# of every node asked again (the ingress drops its views after each answer) and the send.
# Assumed, not measured (the cluster tests time no retry).
DEFAULT_REFUSAL_S = 0.01
# bench/coldstart/split.py's burst8 deploys its burst copy with max_instances = 8 (all 8 start).
BURST_MAX_INSTANCES = 8
# How close the model's burst of 8 on an idle node must come to the file's (tests and JSON).
CALIBRATION_TOLERANCE = 0.10
# Issue 12's target: request p99 at most this many cold starts (`summary.target_burst_p99_ratio`).
TARGET_RATIO = 3.0


@dataclass(frozen=True)
class Model:
    """A measured model: its cold start, its driver turn, its handler, its snapshot's pieces,
    its GPU memory."""

    name: str
    cold_s: float
    driver_s: float
    handler_s: float
    base_bytes: int
    own_bytes: int
    snapshot_dir_bytes: int
    gpu_bytes: int


def measured_models(path: Path = SPLIT_BENCH) -> tuple[list[Model], dict[str, Any]]:
    """The two models of the split benchmark on the H100, and where each figure came from."""
    doc = json.loads(path.read_text())
    rows = {(r["model"], r["mode"]): r for r in doc["results"]}
    models = []
    for name in MODEL_NAMES:
        if (name, "cold") not in rows or (name, "burst8") not in rows:
            raise ValueError(f"{path.name} has no cold and burst8 rows for {name}: the model needs both")
        cold = float(rows[(name, "cold")]["wall_s"]["median"])
        burst_runs = rows[(name, "burst8")]["runs"]
        ups = [run["all_up_s"] for run in burst_runs if run.get("all_up_s") is not None]
        handlers = [a["timings"]["handler"] for run in burst_runs for a in run.get("answers", [])]
        if not ups or not handlers:
            raise ValueError(f"{path.name}'s burst8 runs of {name} have no all_up_s or answers: a file of 899f8ce or later is needed")
        d = doc["deploys"]["split"][name]
        snap = int(d["snapshot_function"]["bytes"])
        base = int(d["sizes"]["base_dir"]["bytes"])
        # The function's chunks in the store, deduplicated: what a node without them pulls
        # (`stored_bytes` is only what its deploy added, 2 MB when the store held the weights).
        segments = int(d["sizes"]["store"]["stored"])
        models.append(
            Model(
                name,
                cold_s=cold,
                driver_s=round((statistics.median(ups) - cold) / (BURST - 1), 4),
                handler_s=round(statistics.median(handlers), 4),
                base_bytes=base,
                own_bytes=segments + max(0, snap - base),
                snapshot_dir_bytes=snap,
                gpu_bytes=INSTANCE_GPU_BYTES[name],
            )
        )
    source = {
        "file": str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path),
        "device": doc["machine"]["device"],
        "commit": doc["machine"]["torpor_commit"],
        "cold_s": "results[mode=cold].wall_s.median (a fresh restore to the first answer, split path, staged)",
        "driver_s": "(median of results[mode=burst8].runs[].all_up_s - cold_s) / 7: one driver restore's turn",
        "handler_s": "median of results[mode=burst8].runs[].answers[].timings.handler",
        "base_bytes": "deploys.split.<model>.sizes.base_dir.bytes",
        "own_bytes": "deploys.split.<model>.sizes.store.stored (its segments' chunks, deduplicated) + (snapshot_function.bytes - base_dir.bytes)",
        "snapshot_dir_bytes": "deploys.split.<model>.snapshot_function.bytes",
        "gpu_bytes": "not in the file: DESIGN.md §1's NVML figures",
        "models": [m.__dict__ for m in models],
        "burst8_wall_s": {name: rows[(name, "burst8")]["wall_s"]["median"] for name in MODEL_NAMES},
        "burst8_all_up_s": {
            name: statistics.median(r["all_up_s"] for r in rows[(name, "burst8")]["runs"]) for name in MODEL_NAMES
        },
        "burst8": "results[mode=burst8].wall_s.median (all 8 answered) and median runs[].all_up_s (all 8 up): the calibration's targets",
    }
    return models, source


@dataclass
class Fn:
    name: str
    model: Model
    base: str
    home: int


@dataclass
class Start:
    """One instance start on a node: when its bytes are all there, its two parts, when it is up."""

    seq: int
    fn: str
    pull_end: float
    nondriver_s: float
    driver_s: float
    up: float = float("nan")


@dataclass
class Node:
    """A simulated node: when each snapshot piece is (or will be) on it, its link, its starts."""

    index: int
    gpu_restores: int = DEFAULT_GPU_RESTORES
    max_instances: int = DEFAULT_MAX_INSTANCES  # per function (0: no bound)
    queue_length: int = DEFAULT_QUEUE_LENGTH  # per function: requests waiting without a start
    have: dict[str, float] = field(default_factory=dict)  # piece -> time it is all on the node
    staged: set[str] = field(default_factory=set)
    link_free_at: float = 0.0
    starts: list[Start] = field(default_factory=list)
    gpu_used: int = 0
    _ups: list[float] | None = None  # the starts' up times, sorted; None: to recompute
    starts_of: dict[str, list[Start]] = field(default_factory=dict)  # function -> its starts here
    requests_of: dict[str, list[float]] = field(default_factory=dict)  # function -> arrivals here
    waited_of: dict[str, list[bool]] = field(default_factory=dict)  # function -> each made no start
    # function -> (its answer times, sorted; when each of its requests that made no start was
    # taken by an instance, in arrival order (so sorted: first come first served); how many of
    # its first i requests made none, for each i)
    _bound: dict[str, tuple[list[float], list[float], list[int]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"node-{self.index:03d}"

    def add_start(self, fn: str, pull_end: float, nondriver_s: float, driver_s: float) -> Start:
        s = Start(len(self.starts), fn, pull_end, nondriver_s, driver_s)
        self.starts.append(s)
        self.starts_of.setdefault(fn, []).append(s)
        self._ups = None  # a new start can take the lane before later-ready ones
        self._bound.clear()  # ... and so move every answer after it
        return s

    def makes_start(self, fn: str) -> bool:
        """torpord's rule for a request of `fn` that finds no idle instance here: it starts one
        while the function's instances here, up and starting, are below `max_instances`
        (instances never end within a burst: every start made here counts)."""
        return self.max_instances == 0 or len(self.starts_of.get(fn, [])) < self.max_instances

    def add_request(self, fn: str, t: float, waited: bool = False) -> None:
        """A request for `fn` placed here at `t` (after every request placed before); `waited`:
        it made no start (it waits for the function's instances here)."""
        self.requests_of.setdefault(fn, []).append(t)
        self.waited_of.setdefault(fn, []).append(waited)
        self._bound.pop(fn, None)

    def _bind(self, fn: str, handler_s: float) -> tuple[list[float], list[float], list[int]]:
        got = self._bound.get(fn)
        if got is None:
            self.up_times()
            free = [(s.up, s.seq) for s in self.starts_of.get(fn, [])]
            arrivals = self.requests_of.get(fn, [])
            done = bind(free, arrivals, handler_s) if free else [(float("inf"), -1) for _ in arrivals]
            waited = self.waited_of.get(fn, [])
            taken = [a - handler_s for (a, _), w in zip(done, waited, strict=True) if w]
            cum = [0]
            for w in waited:
                cum.append(cum[-1] + w)
            got = (sorted(a for a, _ in done), taken, cum)
            self._bound[fn] = got
        return got

    def function_at(self, fn: str, handler_s: float, t: float) -> tuple[int, int, int, int]:
        """What the node's placement answer and the ingress know of `fn` here at `t`: its
        instances up, its starts under way (torpord's `instances`, `starting`), its requests
        not answered by `t` (the ingress's in-flight count: it sees each answer come back) and
        those of them that made no start and are not yet taken by an instance (torpord's
        `queue_depth`). Exact at `t` whatever is placed after `t`: a later start never takes
        the lane or a slot before it is placed, so nothing up, taken or answered by `t` moves."""
        starts = self.starts_of.get(fn, [])
        if fn not in self.requests_of:
            return 0, 0, 0, 0
        self.up_times()
        up = sum(1 for s in starts if s.up <= t)
        answers, taken, cum = self._bind(fn, handler_s)
        waiting = cum[bisect.bisect_left(self.requests_of[fn], t)]  # placed before t, no start
        queued = waiting - min(waiting, bisect.bisect_right(taken, t))
        return up, len(starts) - up, len(answers) - bisect.bisect_right(answers, t), queued

    def up_times(self) -> list[float]:
        """Every start's up time, sorted (each `Start.up` is set too)."""
        if self._ups is None:
            self._ups = sorted(schedule(self.starts, self.gpu_restores))
        return self._ups

    def pending_starts(self, t: float) -> int:
        """Starts placed here whose instance is not up at `t` (pulling, waiting or restoring)."""
        ups = self.up_times()
        return len(ups) - bisect.bisect_right(ups, t)


def schedule(starts: list[Start], gpu_restores: int) -> list[float]:
    """Sets each start's `up` on one node and returns them: a start takes one of `gpu_restores`
    slots (0: unbounded) in the order the pulls ended, runs its non-driver part, then waits
    for the driver lane (served in the order the starts get ready for it) and holds it."""
    waiting = deque(sorted(starts, key=lambda s: (s.pull_end, s.seq)))
    free_slots = gpu_restores if gpu_restores > 0 else len(starts)
    ready: list[tuple[float, int, Start]] = []  # (ready for the lane, seq, start)
    on_lane: Start | None = None
    lane_free_at = 0.0
    now = 0.0
    while waiting or ready or on_lane is not None:
        if on_lane is not None and lane_free_at <= now:
            on_lane.up = lane_free_at
            on_lane = None
            free_slots += 1
        while free_slots > 0 and waiting and waiting[0].pull_end <= now:
            s = waiting.popleft()
            free_slots -= 1
            heapq.heappush(ready, (now + s.nondriver_s, s.seq, s))
        if on_lane is None and ready and ready[0][0] <= now:
            s = heapq.heappop(ready)[2]
            on_lane, lane_free_at = s, now + s.driver_s
            continue  # look again at the same time: a zero-length turn ends at once
        nxt = [
            *([lane_free_at] if on_lane is not None else []),
            *([waiting[0].pull_end] if free_slots > 0 and waiting else []),
            *([ready[0][0]] if on_lane is None and ready else []),
        ]
        if not nxt:
            break
        now = max(now, min(nxt))
    return [s.up for s in starts]


@dataclass
class Request:
    """One request: where it went and why, the start it made, and (after `answer`) its answer."""

    t: float
    fn: str
    handler_s: float
    node: str | None = None
    kind: str | None = None
    estimate_s: float = 0.0
    pulled_bytes: int = 0
    start: Start | None = None
    answer: float = float("nan")
    served_by: int = -1  # the seq of the start whose instance answered it
    served_by_up: float = float("nan")
    at: float | None = None  # when it reached its node (None: `t`; later after 429s)
    waited: bool = False  # it made no start: it waited in its function's queue on the node
    queue_found: int = 0  # ... which held this many requests when it came
    refusals: int = 0  # 429s before it was placed (torpord: the function's queue was full there)

    @property
    def arrived(self) -> float:
        """When it reached the node that answered it."""
        return self.t if self.at is None else self.at


def bind(free: list[tuple[float, int]], arrivals: list[float], handler_s: float) -> list[tuple[float, int]]:
    """Late binding of one function's requests on one node: `free` holds (time free, seq) of
    each of its instances (from when it is up); each request, in arrival order, takes the one
    that frees first and is answered a handler after max(its arrival, then). Returns each
    request's (answer, seq of the instance that answered it), in arrival order."""
    heap = list(free)
    heapq.heapify(heap)
    out = []
    for t in arrivals:
        at, seq = heapq.heappop(heap)
        done = max(t, at) + handler_s
        out.append((done, seq))
        heapq.heappush(heap, (done, seq))
    return out


def answer(node: Node, requests: list[Request]) -> None:
    """Late binding on one node: each request, in arrival order, takes the instance of its
    function there that frees first (up, or done with the request before) and is answered a
    handler later. Sets `answer`, `served_by` and `served_by_up` of `requests`."""
    node.up_times()
    by_fn: dict[str, list[Request]] = {}
    for r in sorted(requests, key=lambda r: r.arrived):
        by_fn.setdefault(r.fn, []).append(r)
    for fn, reqs in by_fn.items():
        free = [(s.up, s.seq) for s in node.starts_of.get(fn, [])]
        for r in reqs:  # one function, one handler
            assert r.handler_s == reqs[0].handler_s
        for r, (done, seq) in zip(reqs, bind(free, [r.arrived for r in reqs], reqs[0].handler_s), strict=True):
            r.answer = done
            r.served_by, r.served_by_up = seq, node.starts[seq].up


def burst_on_idle_node(
    model: Model, n: int = BURST, gpu_restores: int = DEFAULT_GPU_RESTORES, max_instances: int = BURST_MAX_INSTANCES,
) -> tuple[list[float], list[float]]:
    """`n` requests for one function at t = 0 on an idle node with its snapshot staged, as the
    file's burst8 (whose burst copy allows 8 instances: `max_instances` 8, so all 8 start): the
    instances' up times and the requests' answer times."""
    node = Node(0, gpu_restores=gpu_restores, max_instances=max_instances)
    reqs = []
    for _ in range(n):
        r = Request(0.0, model.name, model.handler_s)
        start = node.makes_start(model.name)
        if start:
            r.start = node.add_start(model.name, 0.0, model.cold_s - model.driver_s, model.driver_s)
        node.add_request(model.name, 0.0, waited=not start)
        reqs.append(r)
    answer(node, reqs)
    return node.up_times(), [r.answer for r in reqs]


def calibration(models: list[Model], source: dict[str, Any], gpu_restores: int) -> dict[str, Any]:
    """The model's burst of 8 on an idle node against the file's, per model, with the burst
    copy's max_instances (8)."""
    out: dict[str, Any] = {
        "tolerance": CALIBRATION_TOLERANCE, "gpu_restores": gpu_restores, "max_instances": BURST_MAX_INSTANCES,
        "max_instances_source": "bench/coldstart/split.py burst8: the burst copy NAME-burst is deployed with "
                                "max_instances = 8, requests_per_instance = 1 (ensure_copy_deployed)",
    }
    for m in models:
        ups, answers = burst_on_idle_node(m, BURST, gpu_restores, BURST_MAX_INSTANCES)
        wall, up = float(source["burst8_wall_s"][m.name]), float(source["burst8_all_up_s"][m.name])
        out[m.name] = {
            "all_answered_s": round(max(answers), 4), "file_wall_s": wall,
            "all_answered_error": round(max(answers) / wall - 1, 4) + 0.0,
            "all_up_s": round(max(ups), 4), "file_all_up_s": up,
            "all_up_error": round(max(ups) / up - 1, 4) + 0.0,  # no "-0.0"
        }
    return out


def make_cluster(
    args: argparse.Namespace, models: list[Model], rng: random.Random
) -> tuple[list[Node], list[Fn], dict[str, int]]:
    nodes = [
        Node(i, gpu_restores=args.gpu_restores, max_instances=args.max_instances, queue_length=args.queue_length)
        for i in range(args.nodes)
    ]
    fns: list[Fn] = []
    sizes: dict[str, int] = {}
    for i in range(args.functions):
        m = models[i % len(models)]
        base = f"base-{i % 2}"
        f = Fn(f"fn-{i:02d}-{m.name}", m, base, rng.randrange(args.nodes))
        fns.append(f)
        sizes[f.name] = m.own_bytes
        sizes[base] = max(sizes.get(base, 0), m.base_bytes)
    for f in fns:
        holders = [f.home, *rng.sample([n for n in range(args.nodes) if n != f.home], max(0, args.copies - 1))]
        for n in holders:
            nodes[n].have[f.name] = 0.0
            nodes[n].have[f.base] = 0.0
        nodes[f.home].staged.add(f.name)
    return nodes, fns, sizes


def draws(args: argparse.Namespace, n_functions: int, rng: random.Random) -> list[tuple[float, int]]:
    """The burst: (arrival time, function index) in arrival order, Zipf(1.1) popularity."""
    weights = [1 / (k + 1) ** 1.1 for k in range(n_functions)]
    arrivals = sorted(rng.uniform(0, args.window_s) for _ in range(args.starts))
    picks = rng.choices(range(n_functions), weights=weights, k=args.starts)
    return list(zip(arrivals, picks, strict=True))


def costs_for(args: argparse.Namespace, m: Model, link_bps: float) -> Costs:
    """Placement's cost model for `m`: its cold start, its disk read, the link, its driver turn."""
    return Costs(
        restore_staged_s=m.cold_s,
        restore_local_extra_s=m.snapshot_dir_bytes / (args.disk_gbps * 1e9),
        link_bytes_per_s=link_bps,
        start_contention_s=m.driver_s,
    )


def needs_of(f: Fn) -> FunctionNeeds:
    """What `place` knows of `f`: its GPU memory, its snapshot's bytes, and its handler (the
    measured median: the ingress's average of its answers' handler, after earlier traffic)."""
    return FunctionNeeds(
        f.name, gpu_bytes=f.model.gpu_bytes, snapshot_bytes=f.model.own_bytes + f.model.base_bytes,
        handler_s=f.model.handler_s,
    )


def view(
    node: Node, f: Fn, sizes: dict[str, int], link_bps: float, t: float, book: Bookkeeping | None = None
) -> NodeView:
    """The node as torpord's placement answer (plus the link backlog the simulator knows), the
    function's `max_instances` (its spec's, in the same answer; 0: None) and the ingress's
    bookkeeping (`book`; None: no join fields, as `place` had before joins).

    From the node model, exactly at `t` (the ingress's views are up to 0.25 s old: left out):
    `instances`, the function's `starting` (`function_starting`) and `queue_depth` (torpord's
    answer), the requests not answered (`inflight`: the ingress sees each answer come back),
    and the starts under way of every function (`starting`: the sum over functions of
    torpord's `starting`, which is what the ingress's `Bookkeeping.node_starting` adds up from
    the answers it has seen). From `book`, fed as the ingress feeds it (the start estimate
    `place` made when each request was sent, corrected by torpord's `starting` for the
    function): `starts_up_in_s`, `pulls_up_in_s`."""
    parts = (f.base, f.name)
    missing = sum(sizes[p] for p in parts if p not in node.have)
    if missing:
        backlog = max(0.0, node.link_free_at - t)
    else:
        backlog = max(0.0, max(node.have[p] for p in parts) - t)
    local = all(node.have.get(p, float("inf")) <= t for p in parts)
    return NodeView(
        node=node.name,
        known=local,
        staged=f.name in node.staged,
        local_snapshot=local,
        in_bucket=True,
        gpu_free_bytes=GPU_BYTES - node.gpu_used,
        missing_bytes=missing,
        pull_backlog_bytes=int(backlog * link_bps),
        starting=node.pending_starts(t),
        max_instances=node.max_instances or None,
        **function_fields(node, f, t, book),
    )


def function_fields(node: Node, f: Fn, t: float, book: Bookkeeping | None) -> dict[str, Any]:
    """`NodeView`'s fields of the function on the node (`view`'s doc)."""
    if f.name not in node.requests_of:
        return {} if book is None else {"pulls_up_in_s": book.pulls_up_in(node.name, f.name, t)}
    up, starting, inflight, queued = node.function_at(f.name, f.model.handler_s, t)
    out: dict[str, Any] = {"instances": up, "function_starting": starting, "queue_depth": queued}
    if book is not None:
        book.seen(node.name, f.name, starting, t)
        out.update(
            inflight=inflight, starts_up_in_s=book.starts_up_in(node.name, f.name, t),
            pulls_up_in_s=book.pulls_up_in(node.name, f.name, t),
        )
    return out


def pull_onto(node: Node, f: Fn, sizes: dict[str, int], link_bps: float, t: float) -> int:
    """Queues on `node`'s link the pieces of `f` it lacks; the bytes that adds."""
    moved = 0
    for piece in (f.base, f.name):
        if piece not in node.have:
            begin = max(t, node.link_free_at)
            node.link_free_at = begin + sizes[piece] / link_bps
            node.have[piece] = node.link_free_at
            moved += sizes[piece]
    return moved


def start_on(
    node: Node, f: Fn, p: Placement, costs: Costs, sizes: dict[str, int], link_bps: float, t: float,
) -> Request | None:
    """A request for `f` arriving at `t`, placed on `node`, as torpord takes it: while the
    function's instances there (up and starting) are below `max_instances`, it pulls what the
    node lacks and starts an instance there once every byte is on the node; otherwise it makes
    no start and waits in the function's queue for those instances (late binding), unless
    `queue_length` requests wait there already: torpord answers 429, nothing changes on the
    node, and None is returned."""
    m = f.model
    r = Request(t, f.name, m.handler_s, node.name, p.kind.value, p.estimate_s, at=t)
    if not node.makes_start(f.name):
        queued = node.function_at(f.name, m.handler_s, t)[3]
        if queued >= node.queue_length:  # none idle either: they would have taken the queue
            return None
        r.waited, r.queue_found = True, queued
        node.add_request(f.name, t, waited=True)
        return r
    node.add_request(f.name, t)
    r.pulled_bytes = pull_onto(node, f, sizes, link_bps, t)
    pull_end = max(t, *(node.have[piece] for piece in (f.base, f.name)))
    disk = 0.0 if f.name in node.staged else costs.restore_local_extra_s
    r.start = node.add_start(f.name, pull_end, m.cold_s - m.driver_s + disk, m.driver_s)
    node.gpu_used += m.gpu_bytes
    return r


def run_once(
    args: argparse.Namespace,
    models: list[Model],
    policy: str,
    link_gbps: float,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    nodes, fns, sizes = make_cluster(args, models, rng)
    choose = random.Random(seed * 7919 + 1)  # the random policy's own draws
    book = Bookkeeping() if policy == "locality" else None  # the ingress's; random places blind
    link_bps = link_gbps * 1e9 / 8
    requests, mispredicted = burst(args, policy, nodes, fns, sizes, link_bps, draws(args, len(fns), rng), book, choose)
    moved = sum(r.pulled_bytes for r in requests)
    out = summarize(policy, link_gbps, seed, requests, moved, nodes, TARGET_RATIO * one_cold_start_s(models, args.functions))
    out["start_mispredicted"] = mispredicted
    return out


# A hook between placing and sending (bench/cluster/prefetch_experiment.py): given the views and
# the placement, it may act on the nodes and return True to have the request placed again.
BeforeSend = Callable[[Fn, float, list[NodeView], Placement | None], bool]


def burst(
    args: argparse.Namespace, policy: str, nodes: list[Node], fns: list[Fn], sizes: dict[str, int], link_bps: float,
    arrivals: list[tuple[float, int]], book: Bookkeeping | None, choose: random.Random,
    before_send: BeforeSend | None = None,
) -> tuple[list[Request], int]:
    """The burst's requests ((arrival, function index), in arrival order) as the ingress routes
    them: each placed by `policy` on the nodes' views and sent (its start booked first, as the
    ingress does); when torpord answers 429 (the function's queue full there), sent again
    `args.refusal_s` later (the refusal's round trip and the ingress's fresh views; assumed)
    to the best node not tried yet (`ingress.RETRY_STATUSES`). Attempts are taken in time
    order, so each node sees its requests in the order they reach it. Returns the requests, in
    arrival order, and how many times `place` said a request would make a start and it made
    none, or the reverse (the node model decides; never while the views are exact)."""
    by_name = {n.name: n for n in nodes}
    done: list[Request | None] = [None] * len(arrivals)
    mispredicted = 0
    # (when the attempt reaches the ingress, request index, the nodes that refused it)
    attempts: list[tuple[float, int, frozenset[str]]] = [(t, i, frozenset()) for i, (t, _) in enumerate(arrivals)]
    heapq.heapify(attempts)
    while attempts:
        at, i, tried = heapq.heappop(attempts)
        t, f = arrivals[i][0], fns[arrivals[i][1]]
        costs = costs_for(args, f.model, link_bps)
        views = [view(n, f, sizes, link_bps, at, book) for n in nodes]
        if policy == "random":
            p = place_random(needs_of(f), views, choose, tried)
        else:
            p = place(needs_of(f), views, costs, tried)
            if before_send is not None and before_send(f, at, views, p):
                views = [view(n, f, sizes, link_bps, at, book) for n in nodes]
                p = place(needs_of(f), views, costs, tried)
        if p is None:
            # Every node refused (the ingress would try them all again 0.2 s later): none in
            # the runs; counted as unplaced.
            done[i] = Request(t, f.name, f.model.handler_s, refusals=len(tried))
            continue
        if book is not None:
            book.sent(p.node, f.name, at, p.start_s, p.pull_s, costs.start_contention_s)
        r = start_on(by_name[p.node], f, p, costs, sizes, link_bps, at)
        if r is None:
            heapq.heappush(attempts, (at + args.refusal_s, i, tried | {p.node}))
            continue
        r.t, r.refusals = t, len(tried)
        mispredicted += policy != "random" and (p.start_s is not None) != (r.start is not None)
        done[i] = r
    requests = [r for r in done if r is not None]
    assert len(requests) == len(arrivals)
    return requests, mispredicted


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(q * len(s)))]) if s else float("nan")


def summarize(
    policy: str, link_gbps: float, seed: int, requests: list[Request], moved: int, nodes: list[Node],
    over_s: float | None = None,
) -> dict[str, Any]:
    """One run's figures: request answers (what a client sees) and instance-up times; with
    `over_s` (the target's time), the requests answered later than that, per function."""
    placed = [r for r in requests if r.node is not None]
    by_node: dict[str, list[Request]] = {}
    for r in placed:
        by_node.setdefault(str(r.node), []).append(r)
    for n in nodes:
        if n.name in by_node:
            answer(n, by_node[n.name])
    answers = [r.answer - r.t for r in placed]
    ups = [r.start.up - r.t for r in placed if r.start is not None]
    kinds: dict[str, int] = {}
    for r in placed:
        kinds[str(r.kind)] = kinds.get(str(r.kind), 0) + 1
    return {
        "policy": policy,
        "link_gbps": link_gbps,
        "seed": seed,
        "starts": len(requests),
        "unplaced": len(requests) - len(placed),
        "p50_s": round(pct(answers, 0.50), 4),
        "p99_s": round(pct(answers, 0.99), 4),
        "max_s": round(max(answers), 4) if answers else None,
        "instance_up_p50_s": round(pct(ups, 0.50), 4),
        "instance_up_p99_s": round(pct(ups, 0.99), 4),
        "instance_up_max_s": round(max(ups), 4) if ups else None,
        "served_by_another_start": sum(1 for r in placed if r.start is None or r.served_by != r.start.seq),
        "starts_made": sum(1 for r in placed if r.start is not None),
        # Requests that made no start (the function at max_instances on the node): they waited
        # in its queue (torpord's `queue_depth`), the longest queue one of them found, and the
        # requests torpord would have refused: 429 (that queue full; each was sent again
        # elsewhere by the ingress: `refusals` counts the 429s, `requests_refused` the requests)
        # and 503 (a wait in the queue past queue.timeout_s; none expected in a 1 s burst:
        # counted, not re-sent, so if ever non-zero these requests' times are not torpord's).
        "waited_in_queue": sum(1 for r in placed if r.waited),
        "max_queue_found": max((r.queue_found for r in placed), default=0),
        "refusals_429": sum(r.refusals for r in requests),
        "requests_refused": sum(1 for r in requests if r.refusals),
        "queue_timeouts_503": sum(1 for r in placed if r.waited and r.answer - r.handler_s - r.arrived > QUEUE_TIMEOUT_S),
        "bytes_moved": moved,
        "nodes_used": len(by_node),
        "max_starts_on_one_node": max((len(n.starts) for n in nodes), default=0),
        "max_requests_on_one_node": max((len(rs) for rs in by_node.values()), default=0),
        "kinds": dict(sorted(kinds.items())),
        **({} if over_s is None else {"over_target": over_target(placed, over_s)}),
        # Invariants, checked by the tests: no instance up before its pull ended and its two
        # parts ran; no answer before its arrival or before the instance that served it was up.
        "starts_before_pull_end": sum(
            1 for r in placed if r.start is not None
            and r.start.up < r.start.pull_end + r.start.nondriver_s + r.start.driver_s - 1e-9
        ),
        "answers_before_instance_up": sum(
            1 for r in placed if r.answer - r.handler_s < max(r.arrived, r.served_by_up) - 1e-9
        ),
        "trace_head": [
            {"t": round(r.t, 4), "function": r.fn, "placed": r.node, "kind": r.kind, "estimate_s": round(r.estimate_s, 4),
             "pulled_bytes": r.pulled_bytes, "pull_end": round(r.start.pull_end, 4), "up": round(r.start.up, 4),
             "answer": round(r.answer, 4), "served_by_own_start": r.served_by == r.start.seq}
            for r in [r for r in placed if r.start is not None][:5] if r.start is not None
        ],
    }


def over_target(placed: list[Request], over_s: float) -> dict[str, Any]:
    """The requests answered more than `over_s` after they arrived, in all and per function."""
    late = [r for r in placed if r.answer - r.t > over_s]
    by_fn: dict[str, int] = {}
    for r in late:
        by_fn[r.fn] = by_fn.get(r.fn, 0) + 1
    return {"s": round(over_s, 4), "requests": len(late), "by_function": dict(sorted(by_fn.items()))}


def one_cold_start_s(models: list[Model], functions: int) -> float:
    """A staged cold start on an idle node (the file's `cold`), the median over the mix's functions."""
    xs = sorted(models[i % len(models)].cold_s for i in range(functions))
    return xs[len(xs) // 2]


def machine() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        r = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else None

    cpu = None
    try:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
            None,
        )
    except OSError:
        pass
    return {
        "device": f"simulation on the CPU ({cpu or platform.machine()}, {os.cpu_count()} cpus); no GPU used",
        "torpor_commit": git("rev-parse", "HEAD"),
        "torpor_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "versions": {"python": platform.python_version()},
        "kernel": platform.release(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    models, source = measured_models(Path(args.split_bench))
    t0 = time.monotonic()
    runs = [
        run_once(args, models, policy, link, seed)
        for link in args.link_gbps
        for seed in args.seeds
        for policy in ("locality", "random")
    ]
    cold = one_cold_start_s(models, args.functions)

    def mean(policy: str, key: str) -> float:
        xs = [float(r[key]) for r in runs if r["policy"] == policy and r["link_gbps"] == args.summary_link_gbps]
        return sum(xs) / len(xs)

    loc_p99, rnd_p99 = mean("locality", "p99_s"), mean("random", "p99_s")
    loc_up99, rnd_up99 = mean("locality", "instance_up_p99_s"), mean("random", "instance_up_p99_s")
    loc_bytes, rnd_bytes = mean("locality", "bytes_moved"), mean("random", "bytes_moved")
    return {
        "benchmark": "cluster-sim",
        "machine": machine(),
        "settings": {
            "nodes": args.nodes, "starts": args.starts, "functions": args.functions, "window_s": args.window_s,
            "link_gbps": args.link_gbps, "seeds": args.seeds, "copies": args.copies, "disk_gbps": args.disk_gbps,
            "gpu_bytes_per_node": GPU_BYTES, "gpu_restores": args.gpu_restores,
            "driver_s": {m.name: m.driver_s for m in models}, "popularity": "zipf 1.1",
            "placement": "torpor.cluster.placement.place (locality) vs place_random (random)",
            "node": "late binding; one driver lane per node (GPU), gpu_restores slots (docstring)",
            "max_instances": args.max_instances, "queue_length": args.queue_length,
            "queue_timeout_s": QUEUE_TIMEOUT_S, "refusal_s": args.refusal_s,
        },
        "measured": source,
        "calibration": calibration(models, source, args.gpu_restores),
        "elapsed_s": round(time.monotonic() - t0, 3),
        "runs": runs,
        "summary": {
            "link_gbps": args.summary_link_gbps,
            "headline": "request answer times (arrival to answer, late binding); instance_up_* beside them",
            "one_cold_start_s": cold,
            "burst_p99_ratio": round(loc_p99 / cold, 3),
            "p50_s": round(mean("locality", "p50_s"), 4),
            "p99_s": round(loc_p99, 4),
            "instance_up_p50_s": round(mean("locality", "instance_up_p50_s"), 4),
            "instance_up_p99_s": round(loc_up99, 4),
            "instance_up_p99_ratio": round(loc_up99 / cold, 3),
            "bytes_moved": int(loc_bytes),
            "random_p50_s": round(mean("random", "p50_s"), 4),
            "random_p99_s": round(rnd_p99, 4),
            "random_burst_p99_ratio": round(rnd_p99 / cold, 3),
            "random_instance_up_p99_s": round(rnd_up99, 4),
            "random_instance_up_p99_ratio": round(rnd_up99 / cold, 3),
            "random_bytes_moved": int(rnd_bytes),
            "starts_made": round(mean("locality", "starts_made"), 1),
            "random_starts_made": round(mean("random", "starts_made"), 1),
            "refusals_429": round(mean("locality", "refusals_429"), 2),
            "random_refusals_429": round(mean("random", "refusals_429"), 2),
            "queue_timeouts_503": round(mean("locality", "queue_timeouts_503"), 2),
            "random_queue_timeouts_503": round(mean("random", "queue_timeouts_503"), 2),
            "bytes_moved_locality_over_random": round(loc_bytes / rnd_bytes, 4) if rnd_bytes else None,
            "target_burst_p99_ratio": TARGET_RATIO,
            "meets_target": loc_p99 / cold <= TARGET_RATIO,
        },
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--starts", type=int, default=1000)
    ap.add_argument("--functions", type=int, default=20)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--copies", type=int, default=3, help="nodes that hold each snapshot at the start (home included)")
    ap.add_argument("--disk-gbps", type=float, default=5.0, help="GB/s a local snapshot is read at (assumed)")
    ap.add_argument("--link-gbps", type=float, nargs="+", default=[DEFAULT_LINK_GBPS, 100.0, 10.0])
    ap.add_argument("--summary-link-gbps", type=float, default=DEFAULT_LINK_GBPS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--gpu-restores", type=int, default=DEFAULT_GPU_RESTORES,
                    help="starts between their non-driver part and the end of their driver turn at once, per node (0: no bound)")
    ap.add_argument("--max-instances", type=int, default=DEFAULT_MAX_INSTANCES,
                    help="every function's scaling.max_instances, per node (the examples' 4; 0: no bound, "
                         "every request starts an instance: the model before the bound)")
    ap.add_argument("--queue-length", type=int, default=DEFAULT_QUEUE_LENGTH,
                    help="torpord's queue.length: requests of a function that may wait on a node (one more: 429)")
    ap.add_argument("--refusal-s", type=float, default=DEFAULT_REFUSAL_S,
                    help="seconds from a 429 to the ingress's next attempt elsewhere (assumed, not measured)")
    ap.add_argument("--split-bench", default=str(SPLIT_BENCH))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster-sim.json"))
    args = ap.parse_args(argv)
    for key in ("nodes", "starts", "functions"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be at least 1, got {getattr(args, key)}")
    if args.copies < 1 or args.copies > args.nodes:
        ap.error(f"--copies must be from 1 to --nodes ({args.nodes}), got {args.copies}")
    if args.max_instances < 0:
        ap.error(f"--max-instances must be 0 (no bound) or more, got {args.max_instances}")
    if args.queue_length < 1:
        ap.error(f"--queue-length must be at least 1, got {args.queue_length}")
    if args.refusal_s < 0:
        ap.error(f"--refusal-s must be 0 or more, got {args.refusal_s}")
    if args.gpu_restores < 0:
        ap.error(f"--gpu-restores must be 0 (no bound) or more, got {args.gpu_restores}")
    if args.summary_link_gbps not in args.link_gbps:
        ap.error(f"--summary-link-gbps {args.summary_link_gbps} is not one of --link-gbps {args.link_gbps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    doc = simulate(args)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["summary"]
    print(
        f"{args.starts} cold starts on {args.nodes} nodes within {args.window_s:g} s, link {s['link_gbps']:g} Gb/s: "
        f"locality requests p50 {s['p50_s']:.3f} s p99 {s['p99_s']:.3f} s ({s['burst_p99_ratio']:.2f}x one cold start "
        f"{s['one_cold_start_s']:.2f} s), instances up p99 {s['instance_up_p99_s']:.3f} s ({s['instance_up_p99_ratio']:.2f}x), "
        f"{s['bytes_moved'] / 1e9:.1f} GB moved, {s['starts_made']:g} starts, {s['refusals_429']:g} 429s "
        f"({s['queue_timeouts_503']:g} 503s); random requests p99 {s['random_p99_s']:.3f} s "
        f"({s['random_burst_p99_ratio']:.2f}x), instances up p99 {s['random_instance_up_p99_s']:.3f} s, "
        f"{s['random_bytes_moved'] / 1e9:.1f} GB moved, {s['random_refusals_429']:g} 429s -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
