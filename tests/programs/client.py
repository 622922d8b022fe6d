"""Send one request to a test program and print the answer.

Used through `nsenter --net=/proc/PID/ns/net` to reach an abstract Unix socket or the TCP port of a
program that lives in its own network namespace.

    client.py (--unix PATH | --abstract NAME | --tcp PORT) [--wait SECS] [--timeout SECS] WORD...
"""

from __future__ import annotations

import argparse
import sys

from linesrv import Endpoint, request


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--unix", help="path of a Unix socket")
    g.add_argument("--abstract", help="name of an abstract Unix socket")
    g.add_argument("--tcp", type=int, metavar="PORT", help="TCP port on 127.0.0.1")
    p.add_argument("--wait", type=float, default=0.0, help="retry a refused connection this long")
    p.add_argument("--timeout", type=float, default=10.0, help="socket timeout")
    p.add_argument("words", nargs="+")
    a = p.parse_args(argv)
    endpoint = Endpoint(unix=a.unix, abstract=a.abstract, port=a.tcp)
    try:
        answer = request(endpoint, a.words, timeout=a.timeout, wait=a.wait, tcp=a.tcp is not None)
    except OSError as e:
        print(f"client: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
