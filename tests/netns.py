"""A network of its own for each node of a test cluster (issue 12: "each with its own torpord,
state dir and network namespace"): one Linux bridge on this host and, per node, a network
namespace joined to it by a veth pair, with an address of a private /24 and a default route to
the bridge. Nodes reach each other and the host (the bridge's address: where the test's
SeaweedFS listens) and nothing else; every address is on this host, no packet leaves it.

Processes enter a node's network with `nsenter --net=/run/netns/NAME -- CMD`, which changes the
network namespace only and then execs, so the process is the command itself (a kill -9 of it is
a kill of the node's daemon) and it keeps the host's mounts. `ip netns exec` would not do: it
also gives the command a mount namespace of its own with a fresh /sys, without the cgroup
file systems torpord places its workers in.

Names are short (interface names: 15 bytes) and carry a number picked per network, so that two
test runs on one machine do not collide; `close` removes every namespace (the veth pairs go with
them) and the bridge, and is safe to call twice.
"""

from __future__ import annotations

import ipaddress
import os
import random
import subprocess
from pathlib import Path

NETNS_DIR = Path("/run/netns")


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class NodeNetwork:
    """A bridge and one network namespace per name in `nodes`."""

    def __init__(self, nodes: tuple[str, ...]) -> None:
        self.nodes = nodes
        # 10.213.X.0/24 with X not taken by another network on this host.
        taken = {ipaddress.ip_interface(a).network for a in _host_addresses()}
        choices = [x for x in range(1, 255) if ipaddress.ip_network(f"10.213.{x}.0/24") not in taken]
        if not choices:
            raise RuntimeError("no free 10.213.X.0/24 for the test cluster's network")
        x = random.Random(os.getpid()).choice(choices)
        self.subnet = f"10.213.{x}"
        self.tag = f"{x}{os.getpid() % 1000}"
        self.bridge = f"trb{self.tag}"
        self.host_ip = f"{self.subnet}.254"
        self.names = {n: f"trc{self.tag}-{i}" for i, n in enumerate(nodes)}
        self.addresses = {n: f"{self.subnet}.{i + 1}" for i, n in enumerate(nodes)}
        self._made: list[tuple[str, str]] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, n in enumerate(self.nodes):
            ns, veth = self.names[n], f"trv{self.tag}-{i}"
            ip("netns", "add", ns)
            self._made.append(("netns", ns))
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addresses[n]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "default", "via", self.host_ip)

    def path(self, node: str) -> Path:
        """`node`'s network namespace (a file `nsenter --net=` and `setns` take)."""
        return NETNS_DIR / self.names[node]

    def launcher(self, node: str) -> tuple[str, ...]:
        """What runs a command in `node`'s network (prefix its argv)."""
        return ("nsenter", f"--net={self.path(node)}", "--")

    def close(self) -> None:
        """Removes what was made, namespaces first (their veth ends go with them)."""
        for kind, name in reversed(self._made):
            try:
                if kind == "netns":
                    ip("netns", "del", name)
                else:
                    ip("link", "del", name)
            except RuntimeError:
                pass
        self._made = []


def _host_addresses() -> list[str]:
    r = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False, timeout=30)
    return [line.split()[3] for line in r.stdout.splitlines() if len(line.split()) > 3]
