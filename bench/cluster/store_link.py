"""The object store's link for bench/cluster/pull.py --links: a network namespace for the store
server, joined to this host by a veth pair, whose store side (what the server sends: the GETs'
bytes) a token bucket can hold to a NIC's speed, as a store on another machine would be reached.

Why pyroute2 (netlink from Python) and not `ip`/`tc`: the GPU machine's image has no iproute2,
and pyroute2 is the maintained pure-Python netlink library (one wheel, no C), so the same code
runs here and there. Its tbf takes a 32-bit rate (bytes/s): links up to 34 Gbit/s.

The server enters the namespace with `nsenter --net=/run/netns/NAME -- CMD` (`launcher()`), which
changes only its network namespace (as tests/netns.py says of its nodes). `close()` removes the
namespace, and the veth pair with it; it is safe to call twice.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetNS, netns
from pyroute2.netlink.exceptions import NetlinkError

Json = dict[str, Any]
NETNS_DIR = Path("/run/netns")
# tbf's rate is a u32 of bytes a second (pyroute2 sends no 64-bit rate).
MAX_GBIT = (2**32 - 1) * 8 / 1e9


class StoreLink:
    """A namespace `trs<pid>` holding the store side `eth0` (address `store_ip`) of a veth pair
    whose host side `trh<pid>` has `host_ip`, both in a /24 of 10.214.0.0/16 this host lacks."""

    def __init__(self) -> None:
        with IPRoute() as ipr:
            taken = {
                ipaddress.ip_interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network
                for a in ipr.get_addr(family=2)
            }
        free = [x for x in range(1, 255) if ipaddress.ip_network(f"10.214.{x}.0/24") not in taken]
        if not free:
            raise RuntimeError("no free 10.214.X.0/24 for the store's link")
        x = free[os.getpid() % len(free)]
        tag = os.getpid() % 100000
        self.ns = f"trs{tag}"
        self.host_if = f"trh{tag}"
        self.host_ip, self.store_ip = f"10.214.{x}.1", f"10.214.{x}.2"
        self._made = False
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        netns.create(self.ns)
        self._made = True
        with IPRoute() as ipr:
            ipr.link("add", ifname=self.host_if, kind="veth", peer={"ifname": "eth0", "net_ns_fd": self.ns})
            (i,) = ipr.link_lookup(ifname=self.host_if)
            ipr.addr("add", index=i, address=self.host_ip, prefixlen=24)
            ipr.link("set", index=i, state="up")
        with NetNS(self.ns) as n:
            (i,) = n.link_lookup(ifname="eth0")
            n.addr("add", index=i, address=self.store_ip, prefixlen=24)
            n.link("set", index=i, state="up")
            (lo,) = n.link_lookup(ifname="lo")
            n.link("set", index=lo, state="up")

    def launcher(self) -> tuple[str, ...]:
        """What runs a command in the store's namespace (prefix its argv)."""
        return ("nsenter", f"--net={NETNS_DIR / self.ns}", "--")

    def shape(self, gbit: float) -> Json:
        """Holds what the store sends to `gbit` Gbit/s with a token bucket on its side of the
        veth (what the nodes send, the deploy's push, is not held); 0: no limit, the veth's own
        speed. Returns what was set."""
        if gbit > MAX_GBIT:
            raise ValueError(f"{gbit:g} Gbit/s: tbf here holds at most {MAX_GBIT:.1f} Gbit/s (a 32-bit rate)")
        with NetNS(self.ns) as n:
            (i,) = n.link_lookup(ifname="eth0")
            if gbit == 0:
                try:
                    n.tc("del", index=i, root=True)  # back to the veth's noqueue
                except NetlinkError:
                    pass  # none was set
                return {"gbit": 0, "qdisc": None}
            # The bucket holds 4 ms at the rate (at least 1 MiB: a GSO packet is up to 64 KiB,
            # and the burst must exceed what the rate sends in a timer tick); packets queue for
            # up to 20 ms.
            burst = max(1 << 20, int(gbit * 1e9 / 8 * 0.004))
            n.tc("replace", "tbf", index=i, handle="1:", rate=f"{gbit:g}gbit", burst=burst, latency="20ms")
        return {"gbit": gbit, "qdisc": f"tbf rate {gbit:g}gbit burst {burst} latency 20ms", "device": "eth0 (store side)"}

    def close(self) -> None:
        if self._made:
            try:
                netns.remove(self.ns)  # the veth pair goes with it
            except OSError:
                pass
            self._made = False
