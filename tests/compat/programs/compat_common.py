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

from linesrv import Endpoint, Request, listen, serve as serve_lines  # noqa: E402


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
                except Exception as e:  # the answer names the failure instead of dying
                    return f"error {type(e).__name__}: {e} {traceback.format_exc(limit=2)!r}"
                return f"ok {got}" if got == reference else f"mismatch {got} {reference}"
        if extra is not None:
            reply = extra(req.words)
            if reply is not None:
                return reply
        return "error unknown request"

    print(f"compat program {Path(sys.argv[0]).name} pid {os.getpid()} reference {reference}", flush=True)
    serve_lines(listen(Endpoint(unix=args.unix)), handle, args.ready)
