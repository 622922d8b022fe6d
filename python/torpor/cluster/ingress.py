"""The cluster's HTTP ingress, a Ray Serve deployment: deploy once, invoke from anywhere.

Routes (JSON, the same shapes as torpord's where they overlap):
- `POST /v1/functions` `{"dir": "/abs/path"}`: deploys the function on the whole cluster. On
  daemons with the object tier it deploys on one node (which pushes the snapshot to the bucket)
  and the others pull it; otherwise it deploys from the same directory on every node (it must
  exist on each). Answer: `{"function", "mode", "deployed_on", "nodes": {node: result}}`.
- `POST /v1/functions/{name}/invoke`: routed by `placement.place` (warm first, then the node
  that answers it soonest: by an instance of the function up or starting there, late binding,
  or by a new start; a node where the function is at its `max_instances` makes no start, so
  only the first). Headers: `X-Torpor-Request-Id` (given, or made here),
  `X-Torpor-Node`, `X-Torpor-Attempts`, and torpord's `X-Torpor-Start`/`X-Torpor-Timings`.
- `GET /v1/cluster`: the nodes the ingress sees and what each daemon holds.

Failures, and why this is safe (0 lost, 0 answered twice): every invocation has a request id,
and the ingress makes an invocation **idempotent by its id** instead of trying to prove what did
not run. A node that dies holding a request (its agent's call fails: the actor died with the
node) cannot say whether the handler ran, and waiting to find out is waiting forever; so the
request is sent again, with the same id, to the best other node, and whatever the dead node's
instance did died with that instance. A request refused before it ran (429, 503: torpord never
gave it an instance; or no daemon listening) is retried too. An answer, whatever its status (a
function's exception is a 500), is never retried. Requests with one id share one outcome: a
second request with an id that is running waits for the first's answer, and one whose answer is
recent (`answers_kept`, `answers_ttl_s`) gets that answer again without a second run
(`X-Torpor-Replayed: 1`), so a client may retry an id it got no answer for. What the id cannot
undo: a handler's effects outside its instance (a write to a database) can happen on the dead
node and again on the retry; a function with such effects must key them by an id the caller
puts in the request (docs/cluster.md, Limitations). A node whose *daemon* dies while the node
lives is not such a case: the id goes to the node as the request's Idempotency-Key, and the
agent sends it again to its restarted daemon (`agent.DAEMON_BACK_S`), which answers from the run
its re-adopted worker finished; only a daemon that does not come back sends it elsewhere.

The ingress holds no durable state: its list of nodes comes from the named agents in Ray, and
what each node holds from its daemon, so a restarted head (a new Ray cluster) serves the same
functions as soon as the nodes' agents are back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from starlette.requests import Request
from starlette.responses import Response

from torpor.cluster.agent import ACTOR_PREFIX, DAEMON_BACK_S, NAMESPACE, Answer
from torpor.cluster.bookkeeping import Bookkeeping
from torpor.cluster.placement import Costs, FunctionNeeds, NodeView, Placement, place

log = logging.getLogger("torpor.cluster.ingress")

RETRY_STATUSES = (429, 503)  # torpord refused before any instance took the request
# A deploy's error line with this cause failed for the node's GPU memory, not the function:
# the deploy goes to the next node (torpord's deploy::CAUSE_GPU_MEMORY).
CAUSE_GPU_MEMORY = "gpu_memory"
VIEW_TTL_S = 0.25
AGENTS_TTL_S = 2.0
DEAD_FOR_S = 5.0


@dataclass
class Outcome:
    status: int
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)


def _json(status: int, doc: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(doc), status_code=status, media_type="application/json", headers=headers)


class Router:
    """The ingress's logic, without HTTP: agents, views, placement, retries, the id table."""

    def __init__(
        self,
        costs: Costs | None = None,
        invoke_timeout_s: float = 600.0,
        answers_kept: int = 10000,
        answers_ttl_s: float = 600.0,
    ) -> None:
        self.costs = costs or Costs()
        self.invoke_timeout_s = invoke_timeout_s
        self.answers_kept = answers_kept
        self.answers_ttl_s = answers_ttl_s
        self.agents: dict[str, Any] = {}
        self.agents_at = 0.0
        self.dead: dict[str, float] = {}
        self.inflight: dict[tuple[str, str], int] = {}
        # The starts this ingress caused and when each is expected up, its functions' handler
        # times and snapshot sizes: what `place` needs for joins (torpor.cluster.bookkeeping).
        # Until a function's first answer its handler is taken to be as long as a cold start,
        # so that a burst of a function it knows nothing of spreads rather than queues behind
        # one instance (a 1.5 s handler taken for 0.1 s would send 4 of 6 requests to one node).
        self.book = Bookkeeping(default_handler_s=self.costs.restore_staged_s)
        self.views: dict[str, tuple[float, dict[str, dict[str, Any]]]] = {}
        self.answers: OrderedDict[str, Outcome] = OrderedDict()
        self.running: dict[str, asyncio.Future[Outcome]] = {}

    # ---- nodes

    async def refresh_agents(self, force: bool = False) -> dict[str, Any]:
        now = time.monotonic()
        if not force and now - self.agents_at < AGENTS_TTL_S and self.agents:
            return self.agents
        names = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        found: dict[str, Any] = {}
        for entry in names:
            if entry.get("namespace") != NAMESPACE or not entry.get("name", "").startswith(ACTOR_PREFIX):
                continue
            node = entry["name"][len(ACTOR_PREFIX) :]
            handle = self.agents.get(node)
            if handle is None:
                try:
                    handle = ray.get_actor(entry["name"], namespace=NAMESPACE)
                except ValueError:
                    continue
            found[node] = handle
        self.agents, self.agents_at = found, now
        return found

    def live_agents(self) -> dict[str, Any]:
        now = time.monotonic()
        return {n: h for n, h in self.agents.items() if self.dead.get(n, 0.0) <= now}

    def mark_dead(self, node: str) -> None:
        self.dead[node] = time.monotonic() + DEAD_FOR_S
        self.views.clear()
        self.agents_at = 0.0
        self.book.forget_node(node)

    async def _call(self, node: str, handle: Any, method: str, *args: Any, timeout: float) -> Any:
        ref = getattr(handle, method).remote(*args)
        try:
            return await asyncio.wait_for(ref, timeout)
        except (RayActorError, GetTimeoutError, asyncio.TimeoutError):
            self.mark_dead(node)
            raise

    async def node_views(self, name: str) -> tuple[float, dict[str, dict[str, Any]]]:
        """Each live node's placement answer for `name` (cached `VIEW_TTL_S`), and when they
        were asked for."""
        cached = self.views.get(name)
        if cached and time.monotonic() - cached[0] < VIEW_TTL_S:
            return cached
        asked = time.monotonic()
        await self.refresh_agents()
        live = self.live_agents()

        async def one(node: str, h: Any) -> tuple[str, dict[str, Any] | None]:
            try:
                return node, await self._call(node, h, "placement", name, timeout=5.0)
            except (RayError, asyncio.TimeoutError) as e:
                log.warning("placement of %s on %s failed: %s", name, node, e)
                return node, None

        got = await asyncio.gather(*(one(n, h) for n, h in live.items()))
        views = {n: v for n, v in got if v is not None}
        self.views[name] = (asked, views)
        return asked, views

    def choose(
        self, name: str, views: dict[str, dict[str, Any]], exclude: set[str], asked: float | None = None,
        now: float | None = None,
    ) -> Placement | None:
        """`place` on the nodes' placement answers for `name` (asked for at `asked`, with the
        function's `max_instances`: at it a node makes no start) and this
        ingress's bookkeeping: its requests in flight per node, the starts it caused and when
        each is expected up (corrected by the answers' `starting`), the function's handler time
        (its answers' `X-Torpor-Timings`) and snapshot size (its pulls' `pulled_bytes`)."""
        now = time.monotonic() if now is None else now
        asked = now if asked is None else asked
        nv = []
        for n, v in sorted(views.items()):
            said = v.get("starting")  # absent from daemons before f309d2f
            said_starting = int(said) if isinstance(said, int) and not isinstance(said, bool) else None
            self.book.seen(n, name, said_starting, asked)
            ups = self.book.starts_up_in(n, name, now)
            limit = v.get("max_instances")  # torpord's placement answer (its spec's scaling.max_instances)
            nv.append(
                NodeView(
                    node=n,
                    known=bool(v.get("known")),
                    warm_idle=int(v.get("warm_idle") or 0),
                    queue_depth=int(v.get("queue_depth") or 0),
                    staged=bool(v.get("staged")),
                    local_snapshot=bool(v.get("local_snapshot")),
                    in_bucket=bool(v.get("in_bucket")),
                    gpu_free_bytes=v.get("gpu_free_bytes"),
                    inflight=self.inflight.get((n, name), 0),
                    instances=int(v.get("instances") or 0),
                    # Every function's starts this ingress knows of there, and this function's
                    # that torpord counts beyond them (started by others: standbys, direct calls).
                    starting=self.book.node_starting(n, now) + max(0, (said_starting or 0) - len(ups)),
                    starts_up_in_s=ups,
                    pulls_up_in_s=self.book.pulls_up_in(n, name, now),
                    function_starting=said_starting or 0,
                    max_instances=limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None,
                )
            )
        needs = FunctionNeeds(name, snapshot_bytes=self.book.snapshot_bytes(name), handler_s=self.book.handler_s(name))
        return place(needs, nv, self.costs, exclude)

    # ---- invoke

    async def invoke(self, name: str, body: bytes, rid: str) -> Outcome:
        self._expire()
        done = self.answers.get(rid)
        if done is not None:
            return Outcome(done.status, {**done.headers, "x-torpor-replayed": "1"}, done.body)
        running = self.running.get(rid)
        if running is not None:
            return await asyncio.shield(running)
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.running[rid] = fut
        try:
            out = await self._route(name, body, rid)
            fut.set_result(out)
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            del self.running[rid]
        if out.status != 0:
            self.answers[rid] = out
            while len(self.answers) > self.answers_kept:
                self.answers.popitem(last=False)
        return out

    def _expire(self) -> None:
        now = time.monotonic()
        while self.answers:
            rid, first = next(iter(self.answers.items()))
            if now - first.at <= self.answers_ttl_s:
                break
            del self.answers[rid]

    async def _route(self, name: str, body: bytes, rid: str) -> Outcome:
        tried: set[str] = set()
        attempts = 0
        last: Answer | None = None
        deadline = time.monotonic() + self.invoke_timeout_s
        while time.monotonic() < deadline:
            asked, views = await self.node_views(name)
            if not any(v.get("known") or v.get("in_bucket") for v in views.values()):
                if attempts == 0 and not views:
                    return Outcome(503, {}, json.dumps({"error": "no node of the cluster is up: start `torpor cluster up` on the nodes"}).encode())
                if attempts == 0:
                    return Outcome(404, {}, json.dumps({"error": f'no node of the cluster knows a function named "{name}": deploy it with POST /v1/functions'}).encode())
            chosen = self.choose(name, views, tried, asked)
            if chosen is None:
                if tried and len(tried) >= len(views):
                    # Every node was tried once: start over (a refusal may have been a full queue).
                    tried.clear()
                    await asyncio.sleep(0.2)
                    continue
                await asyncio.sleep(0.2)
                self.views.pop(name, None)
                continue
            node = chosen.node
            handle = self.agents.get(node)
            if handle is None:
                tried.add(node)
                continue
            attempts += 1
            self.book.sent(node, name, time.monotonic(), chosen.start_s, chosen.pull_s, self.costs.start_contention_s)
            key = (node, name)
            self.inflight[key] = self.inflight.get(key, 0) + 1
            try:
                # The request id goes to the node as its Idempotency-Key: a daemon killed and
                # restarted there mid-request answers from the run its worker finished.
                ans: Answer = await self._call(
                    node, handle, "invoke", name, body, self.invoke_timeout_s, rid,
                    timeout=self.invoke_timeout_s + 30 + DAEMON_BACK_S,
                )
            except (RayError, asyncio.TimeoutError) as e:
                # The node died holding the request (or its agent did): its outcome is gone with
                # it, and the id makes sending it again safe.
                log.warning("request %s for %s: node %s failed (%s); retrying elsewhere", rid, name, node, type(e).__name__)
                tried.add(node)
                continue
            finally:
                self.inflight[key] -= 1
                self.views.pop(name, None)
            last = ans
            if ans.status != 0:
                self.book.answered(name, ans.headers.get("x-torpor-timings"))
            if ans.status == 0 or ans.status in RETRY_STATUSES:
                tried.add(node)
                if ans.status == 0 and ans.sent:
                    self.mark_dead(node)
                continue
            headers = {
                k: v for k, v in ans.headers.items() if k in ("x-torpor-start", "x-torpor-timings", "retry-after")
            }
            headers.update({"x-torpor-node": node, "x-torpor-attempts": str(attempts), "x-torpor-request-id": rid})
            return Outcome(ans.status, headers, ans.body)
        why = f"last answer {last.status} from {last.node}: {last.error or last.body[:200]!r}" if last else "no node answered"
        return Outcome(503, {"x-torpor-request-id": rid, "x-torpor-attempts": str(attempts)}, json.dumps({"error": f"request {rid} for {name} got no answer within {self.invoke_timeout_s:g} s ({why})"}).encode())

    # ---- deploy

    async def deploy(self, fdir: str) -> tuple[int, dict[str, Any]]:
        await self.refresh_agents(force=True)
        live = dict(sorted(self.live_agents().items()))
        if not live:
            return 503, {"error": "no node of the cluster is up: start `torpor cluster up` on the nodes"}
        caps = await asyncio.gather(*(self._call(n, h, "capabilities", timeout=30) for n, h in live.items()))
        pulling = all(c["pull"] for c in caps)
        nodes: dict[str, Any] = {}
        if pulling:
            # One node deploys and pushes; a node whose GPU had no room for the deploy (its
            # error's cause) passes it to the next, and pulls it like the others once deployed.
            first = None
            for node in live:
                res = await self._call(node, live[node], "deploy", fdir, timeout=3600)
                nodes[node] = res
                if "result" in res:
                    first = node
                    break
                if res.get("cause") != CAUSE_GPU_MEMORY:
                    return 400 if res.get("status") == 400 else 500, {"error": res.get("error"), "mode": "pull", "nodes": nodes}
                log.info("deploy of %s on %s found its GPU full; trying the next node", fdir, node)
            if first is None:
                return 503, {"error": f"no node had the GPU memory to deploy {fdir}: free GPU memory on one "
                             f"(its other processes, or idle instances) and deploy again; {len(nodes)} tried, "
                             f"the last: {res.get('error')}", "mode": "pull", "nodes": nodes}
            name = nodes[first]["result"]["function"]
            rest = [n for n in live if n != first]
            pulled = await asyncio.gather(*(self._call(n, live[n], "pull", name, timeout=3600) for n in rest))
            for p in pulled:
                self.book.pulled(name, p.get("pulled_bytes"))
            passed_over = {n: r.get("error") for n, r in nodes.items() if n != first}
            nodes.update({n: p for n, p in zip(rest, pulled, strict=True)})
            ok = all("error" not in p for p in pulled)
            self.views.clear()
            out = {"function": name, "mode": "pull", "deployed_on": first, "nodes": nodes}
            if passed_over:
                out["passed_over"] = passed_over
            return (200 if ok else 502), out
        results = await asyncio.gather(*(self._call(n, h, "deploy", fdir, timeout=3600) for n, h in live.items()))
        nodes = {r["node"]: r for r in results}
        self.views.clear()
        failed = [r for r in results if "result" not in r]
        if failed:
            status = 400 if all(r.get("status") == 400 for r in failed) else 502
            return status, {"error": f"deploy failed on {', '.join(r['node'] for r in failed)}: {failed[0].get('error')}", "mode": "everywhere", "nodes": nodes}
        return 200, {"function": results[0]["result"]["function"], "mode": "everywhere", "deployed_on": list(nodes), "nodes": nodes}

    async def cluster(self) -> dict[str, Any]:
        await self.refresh_agents(force=True)

        async def one(node: str, h: Any) -> tuple[str, Any]:
            try:
                info = await self._call(node, h, "info", timeout=10)
                info["functions"] = [f["name"] for f in await self._call(node, h, "functions", timeout=10)]
                return node, info
            except (RayError, asyncio.TimeoutError) as e:
                return node, {"error": f"{type(e).__name__}: {e}"}

        got = await asyncio.gather(*(one(n, h) for n, h in sorted(self.agents.items())))
        return {"nodes": dict(got)}


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
class Ingress:
    """The Serve deployment around `Router` (one replica: the request-id table is in it)."""

    def __init__(self, invoke_timeout_s: float = 600.0) -> None:
        self.router = Router(invoke_timeout_s=invoke_timeout_s)

    async def __call__(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        method = request.method
        try:
            if method == "POST" and parts == ["v1", "functions"]:
                try:
                    doc = json.loads(await request.body())
                    fdir = doc["dir"]
                    assert isinstance(fdir, str) and fdir.startswith("/") and set(doc) == {"dir"}
                except (ValueError, KeyError, TypeError, AssertionError):
                    return _json(400, {"error": 'the body must be {"dir": "/absolute/path/of/the/function"}'})
                status, out = await self.router.deploy(fdir)
                return _json(status, out)
            if method == "POST" and len(parts) == 4 and parts[:2] == ["v1", "functions"] and parts[3] == "invoke":
                rid = request.headers.get("x-torpor-request-id") or uuid.uuid4().hex
                if len(rid) > 128 or not rid.isprintable():
                    return _json(400, {"error": "X-Torpor-Request-Id must be at most 128 printable characters"})
                answer = await self.router.invoke(parts[2], await request.body(), rid)
                return Response(
                    answer.body, status_code=answer.status, headers={**answer.headers, "x-torpor-request-id": rid},
                    media_type="application/json",
                )
            if method == "GET" and parts == ["v1", "cluster"]:
                return _json(200, await self.router.cluster())
        except RayError as e:
            return _json(503, {"error": f"the cluster failed to answer: {type(e).__name__}: {e}"})
        except Exception as e:  # noqa: BLE001 (one JSON line rather than Serve's bare 500)
            log.exception("ingress: %s %s failed", method, request.url.path)
            return _json(500, {"error": f"the ingress failed: {type(e).__name__}: {e}"})
        return _json(404, {"error": f"no route {method} {request.url.path} (routes: POST /v1/functions, POST /v1/functions/NAME/invoke, GET /v1/cluster)"})

