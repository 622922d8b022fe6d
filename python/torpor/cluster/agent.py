"""The node agent: the local torpord's API, as a Ray actor pinned to its node.

One agent per node, named `agent:<node>` in the Ray namespace `torpor`, created by `torpor
cluster up` on that node (`torpor.cluster.node`) with a hard `NodeAffinitySchedulingStrategy` to
the node's own Ray node id, so that it lives and dies with the node: when the node goes, calls to
its agent fail, and that is how the ingress learns that the requests it had there died with it.

The agent is a thin, stateless translation of actor calls into requests on the daemon's Unix
socket (`torpor.client.request`); everything durable (functions, snapshots, instances) is in the
daemon's registry and in the bucket, never in Ray, so a restarted Ray cluster finds it all again.
It is a threaded actor (`max_concurrency`): each call blocks one thread on the socket, and
requests of many clients run side by side.

Capabilities: a daemon with the object tier (issue 12 item 1) serves `POST /v1/functions/{name}/
pull` and `GET /v1/functions/{name}/placement`; the agent reads its OpenAPI document to know. A
daemon without them still works: placement is then composed from `GET /v1/functions/{name}`
(nothing staged or in a bucket is known), and the ingress deploys from the function's directory
on every node instead of pulling.
"""

from __future__ import annotations

import json
import os
import socket
import http.client
import time
from dataclasses import asdict, dataclass
from typing import Any

from torpor import client

PULL_ROUTE = "/v1/functions/{name}/pull"
PLACEMENT_ROUTE = "/v1/functions/{name}/placement"
NAMESPACE = "torpor"
ACTOR_PREFIX = "agent:"


def actor_name(node: str) -> str:
    return f"{ACTOR_PREFIX}{node}"


@dataclass(frozen=True)
class Answer:
    """What the daemon answered to an invocation, or why there was no answer.

    `sent`: False when the request provably never reached the daemon (the connection was
    refused or the socket is missing): it did not run. `status` 0: no answer."""

    node: str
    status: int
    headers: dict[str, str]
    body: bytes
    sent: bool = True
    error: str | None = None


class NodeAgent:
    """The daemon at `socket_path`, for the node `node`. Every method is one or two requests."""

    def __init__(self, node: str, socket_path: str, timeout_s: float = 600.0) -> None:
        self.node = node
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._caps: dict[str, bool] | None = None

    # ---- daemon facts

    def capabilities(self) -> dict[str, bool]:
        """Which object-tier routes the daemon serves (from its OpenAPI document)."""
        if self._caps is None:
            r = client.request(self.socket_path, "GET", "/v1/openapi.json", timeout=10)
            paths = r.json().get("paths", {}) if r.status == 200 else {}
            self._caps = {"pull": PULL_ROUTE in paths, "placement": PLACEMENT_ROUTE in paths}
        return dict(self._caps)

    def info(self) -> dict[str, Any]:
        """The node, its Ray node id, the daemon's status and capabilities."""
        import ray

        r = client.request(self.socket_path, "GET", "/v1/status", timeout=10)
        return {
            "node": self.node,
            "socket": self.socket_path,
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "status": r.json() if r.status == 200 else {"error": r.body.decode(errors="replace")},
            "capabilities": self.capabilities(),
        }

    def functions(self) -> list[dict[str, Any]]:
        r = client.request(self.socket_path, "GET", "/v1/functions", timeout=10)
        if r.status != 200:
            raise RuntimeError(f"torpord on {self.node} answered {r.status} to GET /v1/functions: {r.body[:300]!r}")
        return list(r.json()["functions"])

    def placement(self, name: str) -> dict[str, Any]:
        """torpord's placement answer for `name` (`known`, `instances`, `warm_idle`, `starting`,
        `queue_depth`, `max_instances` (the last three: daemons since session 18), `staged`,
        `local_snapshot`, `in_bucket`, `gpu_free_bytes`), composed from the function's detail on
        a daemon without the route (no `starting`: the ingress then keeps its own starts until
        they are expected up)."""
        if self.capabilities()["placement"]:
            r = client.request(self.socket_path, "GET", f"/v1/functions/{name}/placement", timeout=10)
            if r.status == 200:
                return dict(r.json())
            if r.status != 404:
                raise RuntimeError(f"torpord on {self.node}: placement of {name} answered {r.status}: {r.body[:300]!r}")
        r = client.request(self.socket_path, "GET", f"/v1/functions/{name}", timeout=10)
        if r.status == 404:
            return asdict(Unknown())
        if r.status != 200:
            raise RuntimeError(f"torpord on {self.node}: GET /v1/functions/{name} answered {r.status}: {r.body[:300]!r}")
        d = r.json()
        limit = (d.get("spec") or {}).get("scaling", {}).get("max_instances")
        ready = d.get("state") == "ready" and bool(d.get("snapshot"))
        stages = [i.get("stage") for i in d.get("instances", [])]
        return {
            "known": True,
            "instances": len(stages),
            "warm_idle": sum(1 for s in stages if s in ("warm", "gpu_released")),
            "queue_depth": 0,
            "staged": False,
            "local_snapshot": ready,
            "in_bucket": False,
            "gpu_free_bytes": None,
            "max_instances": limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        }

    # ---- actions

    def deploy(self, fdir: str) -> dict[str, Any]:
        """Deploys the function in `fdir` on this node: the daemon's last NDJSON line
        (`{"result": …}` or `{"error": …}`), with `node`."""
        r = client.request(self.socket_path, "POST", "/v1/functions", {"dir": fdir}, timeout=self.timeout_s)
        if r.status != 200:
            return {"node": self.node, "error": _error_text(r), "status": r.status}
        lines = [json.loads(line) for line in r.body.splitlines() if line.strip()]
        last = lines[-1] if lines else {"error": "torpord answered no line"}
        return {"node": self.node, **last, "phases": [ln for ln in lines[:-1] if "phase" in ln]}

    def pull(self, name: str) -> dict[str, Any]:
        """`POST /v1/functions/{name}/pull`: `{"function","pulled_bytes","pulled_chunks","seconds"}`,
        with `node` (and `status`, `error` when it failed)."""
        r = client.request(self.socket_path, "POST", f"/v1/functions/{name}/pull", timeout=self.timeout_s)
        if r.status != 200:
            return {"node": self.node, "status": r.status, "error": _error_text(r)}
        return {"node": self.node, **r.json()}

    def invoke(self, name: str, body: bytes, timeout_s: float | None = None, key: str | None = None) -> Answer:
        """One invocation on this node's daemon. A refused connection (no daemon listening)
        is `sent=False`: the request did not reach it. `key`: its Idempotency-Key (the ingress's
        request id). With one, a request whose daemon went away mid-request (killed and
        restarted, while this node lives) is sent again to the same daemon for
        `DAEMON_BACK_S`: it runs once there, and its worker's answer comes back (docs/torpord.md,
        "Retries"). Only after that is it `sent=True` with no answer, for the ingress to send
        elsewhere."""
        headers = {"Idempotency-Key": key} if key is not None else None
        retry_until = time.monotonic() + DAEMON_BACK_S
        sent = False
        while True:
            try:
                r = client.request(
                    self.socket_path, "POST", f"/v1/functions/{name}/invoke", body,
                    timeout=timeout_s or self.timeout_s, headers=headers,
                )
                return Answer(self.node, r.status, r.headers, r.body)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                error = f"{type(e).__name__}: {e}"
            except (OSError, http.client.HTTPException, socket.timeout) as e:
                sent, error = True, f"{type(e).__name__}: {e}"
            if key is None or not sent or time.monotonic() > retry_until:
                return Answer(self.node, 0, {}, b"", sent=sent, error=error)
            time.sleep(0.2)


# How long a keyed request whose daemon died mid-request waits for it to come back on this node
# (systemd restarts it within a second; its workers are re-adopted within 10 s).
DAEMON_BACK_S = 15.0


@dataclass(frozen=True)
class Unknown:
    """The placement answer of a daemon that does not know the function."""

    known: bool = False
    instances: int = 0
    warm_idle: int = 0
    queue_depth: int = 0
    staged: bool = False
    local_snapshot: bool = False
    in_bucket: bool = False
    gpu_free_bytes: int | None = None
    max_instances: int | None = None


def _error_text(r: client.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        return r.body.decode(errors="replace")[:500]
    err = doc.get("error") if isinstance(doc, dict) else None
    return err if isinstance(err, str) else json.dumps(err)[:500]
