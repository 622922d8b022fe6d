"""What every compatibility program shares: compute a reference answer at start, then serve.

A program calls `serve(compute)`: `compute()` returns a short text digest of an answer the program
computes on the GPU from state it created at start (weights, compiled kernels, communicators...).
The reference is computed once before serving. Requests (tests/programs/linesrv.py's protocol, on
the Unix socket --unix):

    ping      "pong"
    check     computes again: "ok DIGEST" when it equals the reference, else "mismatch GOT WANT"
    digest    the reference

After a snapshot, kill and restore, `check` must still answer "ok" with the same digest: the
restored process computes what the original computed, with its GPU state and kernels intact.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "programs"))

from linesrv import Endpoint, Request, listen
from linesrv import serve as serve_lines


def digest(*parts: Any) -> str:
    """sha256 of tensors/arrays (their bytes) or other values (their repr), 16 hex digits."""
    h = hashlib.sha256()
    for p in parts:
        if hasattr(p, "detach"):  # torch
            p = p.detach().float().cpu().numpy()
        if hasattr(p, "get") and hasattr(p, "__cuda_array_interface__"):  # cupy
            p = p.get()
        if hasattr(p, "tobytes"):
            h.update(p.tobytes())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


def serve(compute: Callable[[], str], extra: Callable[[list[str]], str | None] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--unix", required=True)
    p.add_argument("--ready", required=True)
    args = p.parse_args()
    reference = compute()

    def handle(req: Request) -> str:
        match req.words:
            case ["ping"]:
                return "pong"
            case ["digest"]:
                return reference
            case ["check"]:
                try:
                    got = compute()
                except Exception as e:  # the answer names the failure instead of dying  # noqa: BLE001
                    return f"error {type(e).__name__}: {e} {traceback.format_exc(limit=2)!r}"
                return f"ok {got}" if got == reference else f"mismatch {got} {reference}"
        if extra is not None:
            reply = extra(req.words)
            if reply is not None:
                return reply
        return "error unknown request"

    print(f"compat program {Path(sys.argv[0]).name} pid {os.getpid()} reference {reference}", flush=True)
    serve_lines(listen(Endpoint(unix=args.unix)), handle, args.ready)


def nccl_world1(init_method: str, seed: int) -> Callable[[], str]:
    """torch.distributed with NCCL, world size 1, through `init_method`: all_reduce and broadcast
    of a GPU tensor made from `seed`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=init_method, rank=0, world_size=1)
    torch.manual_seed(seed)
    x = torch.randn(1 << 16, device="cuda")

    def compute() -> str:
        y = x.clone()
        dist.all_reduce(y)
        z = torch.empty_like(y)
        dist.broadcast(z.copy_(y), src=0)
        torch.cuda.synchronize()
        return digest(y, z)

    return compute


def http_service(answer: Callable[[], str], port: int = 8080) -> Callable[[], str]:
    """Serve GET with `answer()` as the body from a thread of this program, and return a check
    that asks it over one keep-alive connection (a TCP connection held across the snapshot)."""
    import http.client
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            body = answer().encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def compute() -> str:
        client.request("GET", "/")
        resp = client.getresponse()
        return f"{resp.status}:{resp.read().decode()}"

    return compute
