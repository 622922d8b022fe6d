"""`python3 -m torpor.cluster up|status` (what `torpor cluster …` runs).

    torpor cluster up --head --name NODE --socket /run/torpor/torpord.sock [--port 6379] [--http-port 8000]
    torpor cluster up --address HEAD:6379 --name NODE --socket /run/torpor/torpord.sock
    torpor cluster status --address HEAD:6379 [--json]

Arguments after `--` go to `ray start` unchanged (ports, `--object-store-memory`, …).
Bad arguments are one line and exit 2; Ray missing is one line naming the install.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import NoReturn

from torpor.cluster.node import NodeConfig

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        print('torpor cluster: error: Ray is not installed: pip install "ray[serve]>=2.40,<3"', file=sys.stderr)
        raise SystemExit(1) from None


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument as one line (no usage block): `torpor cluster: error: …`."""

    def error(self, message: str) -> NoReturn:
        print(f"torpor cluster: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ray_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, ray_args = argv[:i], argv[i + 1 :]
    ap = _Parser(prog="torpor cluster", description="Torpor on a Ray cluster (docs/cluster.md)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{up,status}", parser_class=_Parser)
    up = sub.add_parser("up", help="run this node of the cluster: Ray, its agent and (head) the ingress")
    role = up.add_mutually_exclusive_group(required=True)
    role.add_argument("--head", action="store_true", help="this node is the head (Ray's GCS and the HTTP ingress)")
    role.add_argument("--address", help="the head's Ray address, HOST:PORT")
    up.add_argument("--name", required=True, help="this node's name in the cluster ([a-z0-9][a-z0-9_.-]*)")
    up.add_argument("--socket", default="/run/torpor/torpord.sock", help="this node's torpord socket")
    up.add_argument("--node-ip", default="127.0.0.1", help="the address Ray uses for this node")
    up.add_argument("--port", type=int, default=6379, help="the head's Ray (GCS) port")
    up.add_argument("--temp-dir", help="Ray's temporary directory on this node")
    up.add_argument("--http-host", default="127.0.0.1", help="the ingress's address (head only)")
    up.add_argument("--http-port", type=int, default=8000, help="the ingress's port (head only)")
    up.add_argument("--num-cpus", type=int, help="CPUs Ray may schedule on this node")
    up.add_argument("--invoke-timeout-s", type=float, default=600.0, help="how long the ingress tries one request")
    up.add_argument("--log", type=Path, help="append Ray's output here")
    st = sub.add_parser("status", help="the cluster's nodes and what each torpord holds")
    st.add_argument("--address", required=True, help="the head's Ray address, HOST:PORT")
    st.add_argument("--json", action="store_true")
    at = sub.add_parser("_attach")  # internal: run by `up` in a helper process
    at.add_argument("config")
    args = ap.parse_args(argv)

    if args.cmd == "_attach":
        from torpor.cluster.node import attach

        d = json.loads(args.config)
        d["ray_args"] = tuple(d["ray_args"])
        attach(NodeConfig(**d))
        return 0
    _need_ray()
    if args.cmd == "status":
        from torpor.cluster.node import status

        return status(args.address, args.json)
    if not NAME_RE.match(args.name):
        up.error(f"--name {args.name!r} is not a node name: use [a-z0-9][a-z0-9_.-]*, at most 63 characters")
    if args.address is not None and not re.match(r"^[^:\s]+:\d+$", args.address):
        up.error(f"--address {args.address!r} is not HOST:PORT (the head's Ray address, e.g. 10.0.0.1:6379)")
    from torpor.cluster.node import Supervisor

    c = NodeConfig(
        name=args.name, socket=args.socket, head=args.head, address=args.address, node_ip=args.node_ip,
        port=args.port, temp_dir=args.temp_dir, http_host=args.http_host, http_port=args.http_port,
        num_cpus=args.num_cpus, ray_args=tuple(ray_args), invoke_timeout_s=args.invoke_timeout_s,
    )
    return Supervisor(c, args.log).run()


if __name__ == "__main__":
    raise SystemExit(main())
