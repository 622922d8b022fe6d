"""`torpor cluster up`: one node of the cluster, kept up.

`up` runs on every node beside its torpord. It supervises `ray start --block` (the head's with
`--head`, a worker's with `--address`), and each time Ray is up on the node it attaches the node:
a short-lived helper process connects to Ray as a driver, creates the node's agent (a detached
actor pinned to this node's Ray node id, `torpor.cluster.agent`) and, on the head, runs the
Serve ingress. When `ray start --block` exits (a Ray process of the node died, or a worker
lost its head for `gcs_rpc_server_reconnect_timeout_s`), `up` starts it again, with a backoff
(1 s doubling to 10 s), until it is stopped (SIGTERM or SIGINT: Ray is stopped with it).

Why a helper process for the attach: a Ray driver whose GCS goes away exits its whole process,
and the supervisor must outlive the head's restarts. Why the supervisor does not start torpord:
the daemon is the node's service (systemd, packaging/systemd/torpord.service) and outlives Ray;
`up` only needs its socket.

`status` connects to the cluster as a driver and asks every agent for its node's facts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torpor.cluster.agent import NAMESPACE, actor_name

SERVE_APP = "torpor"
RESOURCE_PREFIX = "torpor-node-"


@dataclass(frozen=True)
class NodeConfig:
    """What `up` needs: the node's name, its daemon's socket, where Ray runs and listens."""

    name: str
    socket: str
    head: bool
    address: str | None
    node_ip: str
    port: int
    temp_dir: str | None
    http_host: str
    http_port: int
    num_cpus: int | None
    ray_args: tuple[str, ...]
    invoke_timeout_s: float

    @property
    def gcs_address(self) -> str:
        return f"{self.node_ip}:{self.port}" if self.head else str(self.address)


def ray_start_argv(c: NodeConfig) -> list[str]:
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    if c.head:
        argv += ["--head", f"--port={c.port}", "--include-dashboard=false"]
    else:
        argv += [f"--address={c.address}"]
    argv += [f"--node-ip-address={c.node_ip}", "--resources", json.dumps({f"{RESOURCE_PREFIX}{c.name}": 1})]
    if c.temp_dir:
        argv += [f"--temp-dir={c.temp_dir}"]
    if c.num_cpus is not None:
        argv += [f"--num-cpus={c.num_cpus}"]
    return argv + list(c.ray_args)


def attach(c: NodeConfig, timeout_s: float = 120.0) -> None:
    """Connects to the node's Ray, creates its agent pinned to it and, on the head, the ingress.
    Runs in a helper process (`python3 -m torpor.cluster _attach`)."""
    import ray
    from ray import serve
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from torpor.cluster.agent import NodeAgent

    ray.init(address=c.gcs_address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    resource = f"{RESOURCE_PREFIX}{c.name}"
    deadline = time.monotonic() + timeout_s
    node_id = None
    while node_id is None:
        alive = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
        node_id = next((n["NodeID"] for n in alive if resource in n.get("Resources", {})), None)
        if node_id is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"torpor cluster: node {c.name} did not join Ray at {c.gcs_address} within {timeout_s:g} s")
            time.sleep(0.2)
    remote: Any = ray.remote(NodeAgent)
    agent = remote.options(
        name=actor_name(c.name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=256,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(c.name, c.socket)
    info: dict[str, Any] = ray.get(agent.info.remote(), timeout=timeout_s)
    if info["ray_node_id"] != node_id:
        raise SystemExit(f"torpor cluster: agent {actor_name(c.name)} runs on {info['ray_node_id']}, not on this node {node_id}")
    if c.head:
        from torpor.cluster.ingress import Ingress

        serve.start(http_options={"host": c.http_host, "port": c.http_port, "location": "HeadOnly"})
        # The replica on the head, beside Serve's controller and proxy: placed anywhere, it would
        # die with whichever node Ray put it on, and the requests in it with it.
        pinned = Ingress.options(  # type: ignore[attr-defined]
            ray_actor_options={"num_cpus": 0, "resources": {resource: 0.001}}
        )
        serve.run(
            pinned.bind(invoke_timeout_s=c.invoke_timeout_s),
            name=SERVE_APP,
            route_prefix="/",
            blocking=False,
        )
    print(json.dumps({"attached": c.name, "node_id": node_id, "head": c.head}), flush=True)
    ray.shutdown()


class Supervisor:
    """Keeps `ray start --block` running and the node attached."""

    def __init__(self, c: NodeConfig, log: Path | None) -> None:
        self.c = c
        self.log = log
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def _say(self, msg: str) -> None:
        print(f"torpor cluster up [{self.c.name}]: {msg}", file=sys.stderr, flush=True)

    def _stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        if not Path(self.c.socket).exists():
            self._say(f"no torpord socket at {self.c.socket}: start torpord first (torpor serve --socket {self.c.socket})")
            return 1
        backoff = 1.0
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        while not self.stopping:
            out = open(self.log, "ab") if self.log else None  # noqa: SIM115 (closed below)
            started = time.monotonic()
            try:
                self.child = subprocess.Popen(ray_start_argv(self.c), stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
                attached = False
                while self.child.poll() is None and not self.stopping:
                    if not attached:
                        r = subprocess.run(
                            [sys.executable, "-m", "torpor.cluster", "_attach", json.dumps(self.c.__dict__)],
                            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, check=False, timeout=300,
                        )
                        attached = r.returncode == 0
                        if attached:
                            self._say(f"attached to Ray at {self.c.gcs_address}")
                            backoff = 1.0
                        else:
                            self._say(f"attach failed (exit {r.returncode}); retrying")
                            time.sleep(1)
                            continue
                    time.sleep(0.2)
            finally:
                if self.child is not None and self.child.poll() is None:
                    self.child.send_signal(signal.SIGTERM)
                    try:
                        self.child.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        self.child.kill()
                        self.child.wait()
                if out is not None:
                    out.close()
            if self.stopping:
                break
            self._say(f"ray exited ({self.child.returncode}) after {time.monotonic() - started:.1f} s; starting it again in {backoff:g} s")
            time.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        return 0


def status(address: str, as_json: bool) -> int:
    import ray

    from torpor.cluster.agent import ACTOR_PREFIX

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    try:
        names = sorted(
            e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e.get("namespace") == NAMESPACE and e["name"].startswith(ACTOR_PREFIX)
        )
        nodes: dict[str, Any] = {}
        for name in names:
            try:
                h = ray.get_actor(name, namespace=NAMESPACE)
                info = cast(dict[str, Any], ray.get(h.info.remote(), timeout=10))
                fns = cast(list[dict[str, Any]], ray.get(h.functions.remote(), timeout=10))
                info["functions"] = [f["name"] for f in fns]
                nodes[name[len(ACTOR_PREFIX):]] = info
            except Exception as e:  # noqa: BLE001 (a dead node is reported, not raised)
                nodes[name[len(ACTOR_PREFIX):]] = {"error": f"{type(e).__name__}: {e}"}
        ray_nodes = [n for n in ray.nodes() if n["Alive"]]  # type: ignore[no-untyped-call]
    finally:
        ray.shutdown()
    if as_json:
        print(json.dumps({"address": address, "ray_nodes_alive": len(ray_nodes), "nodes": nodes}, indent=1))
    else:
        print(f"Ray at {address}: {len(ray_nodes)} node(s) alive, {len(nodes)} torpor agent(s)")
        for n, info in nodes.items():
            if "error" in info:
                print(f"  {n:<20} DOWN  {info['error'][:100]}")
            else:
                caps = ",".join(k for k, v in info["capabilities"].items() if v) or "-"
                print(f"  {n:<20} up    torpord {info['status'].get('version', '?')}  functions: {', '.join(info['functions']) or '-'}  object tier: {caps}")
    return 0
