"""Torpor on a real Ray cluster of three nodes on this host (torpor.cluster, docs/cluster.md).

The fixture gives each node a network of its own (tests/netns.py: a network namespace on a
bridge of this host, a private address; SeaweedFS listens on the bridge's address) and starts in
it the node's torpord (its own state directory, socket and config) and its
`python3 -m torpor.cluster up` supervisor: the head (Ray's GCS, the Serve ingress) and two
workers joining it with `ray start --address`, each with its own Ray temporary directory and
`torpor-node-<name>` resource. So Ray's nodes reach each other by their addresses, as machines
do, and each torpord pulls from the store across the bridge. It is `ray start`, not
`ray.cluster_utils.Cluster`, because that is what `torpor cluster up` runs on real machines, and
because every node is then a process tree of its own that a test can kill -9 as a machine dies.

Every request carries an id; the function prints each id it runs into its instance's log on
its node (`<state>/logs/cluster-ledger/*.log`), which outlives a killed node, so the tests count
what ran where, and how often, from the nodes' own records.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Only the cluster's processes import Ray; this process talks HTTP.
_RAY = importlib.util.find_spec("ray")
if _RAY is None or _RAY.origin is None or not (Path(_RAY.origin).parent / "serve").is_dir():
    pytest.skip('Ray is not installed: pip install "ray[serve]>=2.40,<3" (make test does)', allow_module_level=True)

from conftest import ROOT, alive, kill_tree  # noqa: E402
from daemon.conftest import Torpord  # noqa: E402
from netns import NodeNetwork  # noqa: E402

LEDGER = ROOT / "tests" / "cluster_functions" / "ledger"
NODES = ("head", "w1", "w2")
# Fast failure detection for a test (defaults: a dead node is seen after ~15 s, a worker gives up on
# a lost head after 60 s).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "5",
}


def pids_with_env(entry: str, exact: bool = False) -> list[int]:
    """Live processes whose environment holds `entry` (NAME=VALUE), or an entry that starts
    with it unless `exact`."""
    want = entry.encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (want in env if exact else any(e.startswith(want) for e in env)) and alive(int(name)):
            out.append(int(name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Cluster:
    def __init__(self, binary: Path, base: Path, net: NodeNetwork) -> None:
        self.base = base
        self.binary = binary
        self.net = net
        self.gcs_port = free_port()
        self.http_port = free_port()
        # Ray's socket paths must stay short (AF_UNIX): its temporary directories go under /tmp.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="trc-", dir="/tmp"))
        self.daemons: dict[str, Torpord] = {}
        self.ups: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, list[int]] = {}
        self.seaweed: Any = None
        config = self.objstore_config()
        for n in NODES:
            root = base / n
            root.mkdir()
            if n != NODES[0]:
                # Pulled snapshots are sealed by the node that took them: one key for the cluster.
                (root / "state").mkdir(mode=0o700)
                key = root / "state" / "snapshot.key"
                shutil.copyfile(self.daemons[NODES[0]].state / "snapshot.key", key)
                os.chmod(key, 0o600)
            self.daemons[n] = Torpord(binary, root, config=config, launcher=net.launcher(n))
            self.ports[n] = [free_port() for _ in range(6)]
        try:
            for n in NODES:
                self.start_node(n)
        except BaseException:
            self.stop()
            raise

    def objstore_config(self) -> str:
        """The `[objstore]` table for every torpord when this torpord has the object tier
        (issue 12 item 1: push after deploy, pull, placement), with a SeaweedFS started here;
        "" when it does not (its config refuses the table), and the cluster deploys everywhere."""
        probe = self.base / "probe.toml"
        probe.write_text('[objstore]\nendpoint = "http://127.0.0.1:1"\nbucket = "b"\ncredentials_file = "c"\n')
        r = subprocess.run(
            [str(self.binary), "serve", "--config", str(probe), "--state-dir", str(self.base / "probe"), "--check"],
            capture_output=True, text=True, check=False, timeout=60,
        )
        if r.returncode != 0 and "objstore" in r.stderr:
            return ""
        from objstore_server import Seaweed

        (self.base / "seaweed").mkdir(parents=True, exist_ok=True)
        self.seaweed = Seaweed(self.base / "seaweed", ip=self.net.host_ip)
        self.seaweed.create_bucket("cluster")
        remote = self.seaweed.config(self.base, "cluster")
        return "[objstore]\n" + "\n".join(
            line.replace('credentials_file = "', f'credentials_file = "{self.base}/') for line in remote.read_text().splitlines()
        )

    @property
    def address(self) -> str:
        return f"{self.net.addresses[NODES[0]]}:{self.gcs_port}"

    def start_node(self, n: str) -> None:
        p = self.ports[n]
        argv = [
            *self.net.launcher(n), sys.executable, "-m", "torpor.cluster", "up", "--name", n,
            "--socket", str(self.daemons[n].socket), "--node-ip", self.net.addresses[n],
            "--temp-dir", str(self.ray_tmp / n), "--num-cpus", "1", "--log", str(self.base / f"{n}-ray.log"),
            "--invoke-timeout-s", "90",
        ]
        argv += (
            ["--head", "--port", str(self.gcs_port), "--http-host", self.net.addresses[n], "--http-port", str(self.http_port)]
            if n == "head" else ["--address", self.address]
        )
        argv += [
            "--", f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
            f"--dashboard-agent-listen-port={p[2]}", f"--dashboard-agent-grpc-port={p[3]}",
            f"--runtime-env-agent-port={p[4]}", f"--metrics-export-port={p[5]}",
        ]
        # The markers go last: Ray renames its processes by writing over the start of their
        # environment block (setproctitle), so /proc/PID/environ keeps only its end.
        env = {**os.environ, **RAY_ENV, "PYTHONPATH": f"{ROOT / 'python'}:{os.environ.get('PYTHONPATH', '')}",
               "TORPOR_CLUSTER_TEST_NODE": str(self.ray_tmp / n)}
        with open(self.base / f"{n}-up.log", "ab") as log:
            self.ups[n] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)

    def kill_node(self, n: str) -> None:
        """kill -9 of the whole node: its Ray (supervisor, raylet, workers, agent) and its torpord."""
        kill_tree(self.ups[n].pid)
        self.ups[n].wait()
        for pid in pids_with_env(f"TORPOR_CLUSTER_TEST_NODE={self.ray_tmp / n}", exact=True):
            kill_tree(pid)
        self.daemons[n].proc.kill()
        self.daemons[n].proc.wait()

    def restart_node(self, n: str) -> None:
        self.daemons[n].restart()
        self.start_node(n)

    def logs(self) -> str:
        out = []
        serve_logs = sorted(self.ray_tmp.glob("head/session_latest/logs/serve/replica_*.log"))
        for f in [*sorted(self.base.glob("*.log")), *serve_logs]:
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2500:]}")
        return "\n".join(out)

    def http(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 120) -> Reply:
        c = http.client.HTTPConnection(self.net.addresses[NODES[0]], self.http_port, timeout=timeout)
        try:
            c.request(method, path, body=body, headers=headers or {})
            r = c.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            c.close()

    def wait_nodes(self, want: set[str], timeout: float = 150) -> dict[str, Any]:
        """Until the ingress answers and sees exactly the agents `want` alive."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            for n, up in self.ups.items():
                assert up.poll() is None or n not in want, f"torpor cluster up on {n} exited {up.returncode}\n{self.logs()}"
            try:
                r = self.http("GET", "/v1/cluster", timeout=15)
                last = (r.status, r.body[:500])
                if r.status == 200:
                    nodes = r.json()["nodes"]
                    alive = {k for k, v in nodes.items() if "error" not in v}
                    if alive == want:
                        return dict(nodes)
            except (OSError, http.client.HTTPException) as e:
                last = repr(e)
            time.sleep(1)
        raise AssertionError(f"the cluster did not show nodes {sorted(want)} within {timeout} s (last: {last})\n{self.logs()}")

    def invoke(self, name: str, request: Any, rid: str | None = None, timeout: float = 120) -> Reply:
        headers = {"Content-Type": "application/json"}
        if rid:
            headers["X-Torpor-Request-Id"] = rid
        return self.http("POST", f"/v1/functions/{name}/invoke", json.dumps(request).encode(), headers, timeout)

    def ran(self) -> dict[str, Counter[str]]:
        """Per node, how often each request id ran (from its instances' logs)."""
        out: dict[str, Counter[str]] = {}
        for n, d in self.daemons.items():
            c: Counter[str] = Counter()
            for log in (d.state / "logs").glob("cluster-ledger/*.log"):
                for line in log.read_text(errors="replace").splitlines():
                    if line.startswith("ledger-ran "):
                        c[line.split()[1]] += 1
            out[n] = c
        return out

    def stop(self) -> None:
        for up in self.ups.values():
            if up.poll() is None:
                up.send_signal(signal.SIGTERM)
        for up in self.ups.values():
            try:
                up.wait(timeout=40)
            except subprocess.TimeoutExpired:
                kill_tree(up.pid)
                up.wait()
        # Whatever a killed node's Ray left: Ray renames its processes and some outlive their
        # parents (reparented to init), so they are found by the variable every one inherited.
        for _ in range(5):
            left = pids_with_env(f"TORPOR_CLUSTER_TEST_NODE={self.ray_tmp}/")
            if not left:
                break
            for pid in left:
                kill_tree(pid)
            time.sleep(0.5)
        for d in self.daemons.values():
            d.stop()
        if self.seaweed is not None:
            self.seaweed.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(torpor_bin: Path, criu_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root: torpord starts workers in namespaces and runs CRIU")
    net = NodeNetwork(NODES)
    try:
        c = Cluster(torpor_bin, tmp_path_factory.mktemp("cluster"), net)
        try:
            c.wait_nodes(set(NODES))
            yield c
        finally:
            c.stop()
    finally:
        net.close()


def burst(c: Cluster, n: int, sleep: float, threads: int, on_answer: Any = None) -> list[tuple[str, Reply]]:
    def one(i: int) -> tuple[str, Reply]:
        rid = f"r{i}-{uuid.uuid4().hex[:8]}"
        r = c.invoke("cluster-ledger", {"id": rid, "sleep": sleep}, rid=rid)
        if on_answer is not None:
            on_answer()
        return rid, r

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(n)))


def check_answers(c: Cluster, got: list[tuple[str, Reply]]) -> None:
    bad = [(rid, r.status, r.body[:200]) for rid, r in got if r.status != 200 or r.json().get("id") != rid]
    assert not bad, f"{len(bad)} of {len(got)} requests lost or wrong: {bad[:5]}\n{c.logs()}"


def test_deploy_once_and_a_burst_runs_on_every_node(cluster: Cluster) -> None:
    r = cluster.http("POST", "/v1/functions", json.dumps({"dir": str(LEDGER)}).encode(), timeout=300)
    assert r.status == 200, f"{r.status} {r.body[:2000]!r}\n{cluster.logs()}"
    doc = r.json()
    assert doc["function"] == "cluster-ledger" and set(doc["nodes"]) == set(NODES), doc
    # Deploy once and pull, when the daemons have the object tier; else deploy on every node.
    assert doc["mode"] == ("pull" if cluster.seaweed is not None else "everywhere"), doc
    if doc["mode"] == "pull":
        pulled = [doc["nodes"][n] for n in NODES if n != doc["deployed_on"]]
        assert all(p["pulled_bytes"] > 0 for p in pulled), pulled
    # Six requests at once, each holding an instance for a while: no node can take them all
    # (two instances each), and placement spreads them over the three.
    got = burst(cluster, 6, sleep=1.5, threads=6)
    check_answers(cluster, got)
    served = Counter(r.headers["x-torpor-node"] for _, r in got)
    assert set(served) == set(NODES), served
    ran = cluster.ran()
    for rid, r in got:
        assert sum(ran[n][rid] for n in NODES) == 1 and ran[r.headers["x-torpor-node"]][rid] == 1, (rid, ran)


def test_status_lists_every_node(cluster: Cluster) -> None:
    r = subprocess.run(
        # Run on a node of the cluster (its network), as on real machines: a Ray driver joins
        # the cluster through the raylet of the machine it runs on.
        [*cluster.net.launcher(NODES[0]), str(cluster.binary), "cluster", "status", "--address", cluster.address, "--json"],
        capture_output=True, text=True, check=False, timeout=120, env={**os.environ, **RAY_ENV},
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ray_nodes_alive"] == 3 and set(doc["nodes"]) == set(NODES), doc
    for n, info in doc["nodes"].items():
        assert info["socket"] == str(cluster.daemons[n].socket) and "cluster-ledger" in info["functions"], info
    # Each node's torpord and Ray run in the node's own network, none in this host's.
    host = os.stat("/proc/self/ns/net").st_ino
    for n in NODES:
        ns = os.stat(cluster.net.path(n)).st_ino
        assert ns != host and os.stat(f"/proc/{cluster.daemons[n].proc.pid}/ns/net").st_ino == ns, n
        assert os.stat(f"/proc/{cluster.ups[n].pid}/ns/net").st_ino == ns, n
    r = subprocess.run(
        [*cluster.net.launcher(NODES[1]), str(cluster.binary), "cluster", "up", "--address", cluster.address,
         "--name", "x", "--socket", "/nonexistent.sock"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "torpor cluster up [x]: no torpord socket at /nonexistent.sock: start torpord first (torpor serve --socket /nonexistent.sock)"
    ], r.stderr


def test_a_request_id_runs_once(cluster: Cluster) -> None:
    rid = f"once-{uuid.uuid4().hex[:8]}"
    first = cluster.invoke("cluster-ledger", {"id": rid}, rid=rid)
    again = cluster.invoke("cluster-ledger", {"id": rid}, rid=rid)
    assert first.status == again.status == 200 and first.body == again.body, (first, again)
    assert again.headers.get("x-torpor-replayed") == "1", again.headers
    assert sum(c[rid] for c in cluster.ran().values()) == 1


def test_a_daemon_killed_mid_request_on_a_live_node_answers_once(cluster: Cluster) -> None:
    """kill -9 of every node's torpord (not of Ray: the nodes live) while a request runs, then
    each torpord started again. The ingress sent the request id as its Idempotency-Key, and the
    agent sends it again to its own restarted daemon, which answers from the run its re-adopted
    worker finished: 200, from the node it ran on, and it ran once in the whole cluster."""
    rid = f"daemon-kill-{uuid.uuid4().hex[:8]}"
    out: list[Reply | BaseException] = []

    def go() -> None:
        try:
            out.append(cluster.invoke("cluster-ledger", {"id": rid, "sleep": 2.0}, rid=rid, timeout=120))
        except BaseException as e:  # noqa: BLE001 (the test reads what happened)
            out.append(e)

    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.8)
    for d in cluster.daemons.values():
        d.proc.kill()
        d.proc.wait()
    time.sleep(0.3)
    for d in cluster.daemons.values():
        d.restart()
    t.join(150)
    r = out[0]
    assert isinstance(r, Reply) and r.status == 200, (r, cluster.logs())
    assert r.json()["id"] == rid, r.body
    ran = cluster.ran()
    assert sum(c[rid] for c in ran.values()) == 1, ran
    assert ran[r.headers["x-torpor-node"]][rid] == 1, (r.headers, ran)


def test_errors_are_one_line(cluster: Cluster) -> None:
    r = cluster.invoke("no-such-function", {})
    assert r.status == 404 and "no node of the cluster knows a function" in r.json()["error"], r
    r = cluster.http("POST", "/v1/functions", b'{"dir": "relative"}')
    assert r.status == 400 and "absolute" in r.json()["error"], r
    r = cluster.http("POST", "/v1/functions", json.dumps({"dir": str(ROOT / "tests" / "daemon" / "functions" / "badspec")}).encode())
    assert r.status == 400 and r.json()["error"], r


def record_kill_result(got: list[tuple[str, Reply]], ran: Any, survivors: tuple[str, ...], wall_s: float) -> None:
    """With $TORPOR_CLUSTER_RESULT set, writes what the kill -9 under load came to there, as
    JSON (bench/cluster/summary.py reads it): requests, lost ones (no right answer), duplicated
    ones (run twice on surviving nodes), ones re-run after the node died, nodes that answered."""
    path = os.environ.get("TORPOR_CLUSTER_RESULT")
    if not path:
        return
    lost = [rid for rid, r in got if r.status != 200 or r.json().get("id") != rid]
    doc = {
        "what": "kill -9 of worker node w2 (Ray and torpord) after 10 of 40 answers, 6 requests at a time, 3-node Ray cluster on one machine",
        "requests": len(got),
        "lost_requests": len(lost),
        "lost_ids": lost,
        "duplicated_on_survivors": sum(1 for rid, _ in got if sum(ran[n][rid] for n in survivors) > 1),
        "rerun_after_node_death": sum(1 for rid, _ in got if ran["w2"][rid] and sum(ran[n][rid] for n in survivors)),
        "served_by": dict(Counter(r.headers.get("x-torpor-node", "?") for _, r in got)),
        "attempts_over_1": sum(1 for _, r in got if int(r.headers.get("x-torpor-attempts", "1") or 1) > 1),
        "wall_s": round(wall_s, 3),
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def test_kill_a_node_under_load_loses_nothing(cluster: Cluster) -> None:
    answered = 0
    lock = threading.Lock()
    killed = threading.Event()

    def on_answer() -> None:
        nonlocal answered
        with lock:
            answered += 1
            if answered == 10 and not killed.is_set():
                killed.set()
                cluster.kill_node("w2")

    t0 = time.monotonic()
    got = burst(cluster, 40, sleep=0.3, threads=6, on_answer=on_answer)
    wall_s = time.monotonic() - t0
    assert killed.is_set()
    ran = cluster.ran()
    survivors = ("head", "w1")
    record_kill_result(got, ran, survivors, wall_s)
    check_answers(cluster, got)
    twice_on_a_survivor = [rid for rid, _ in got if sum(ran[n][rid] for n in survivors) > 1]
    assert not twice_on_a_survivor, twice_on_a_survivor
    never = [rid for rid, _ in got if sum(ran[n][rid] for n in NODES) == 0]
    assert not never, never
    # What ran on the dying node and again elsewhere: its answer died with the node.
    again = [rid for rid, _ in got if ran["w2"][rid] and sum(ran[n][rid] for n in survivors)]
    print(f"kill -9 of w2 under load: 40 answered, {len(again)} re-run after the node died, "
          f"served {dict(Counter(r.headers['x-torpor-node'] for _, r in got))}")
    assert all(r.headers["x-torpor-node"] in survivors for rid, r in got if ran["w2"][rid] and rid in again)
    cluster.wait_nodes({"head", "w1"}, timeout=30)


def test_functions_survive_restarts_of_a_node_and_of_the_head(cluster: Cluster) -> None:
    cluster.restart_node("w2")
    cluster.wait_nodes(set(NODES))
    cluster.kill_node("head")
    cluster.restart_node("head")
    # The workers lose their head: their Ray exits and `up` starts it again on the new head.
    cluster.wait_nodes(set(NODES), timeout=150)
    got = burst(cluster, 6, sleep=1.5, threads=6)
    check_answers(cluster, got)
    assert set(Counter(r.headers["x-torpor-node"] for _, r in got)) == set(NODES)
    with contextlib.suppress(Exception):
        print(json.dumps({k: v.get("functions") for k, v in cluster.wait_nodes(set(NODES)).items()}))
