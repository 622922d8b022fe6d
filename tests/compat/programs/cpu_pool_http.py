"""No GPU: a multiprocessing pool of forked workers and an HTTP server asked over a keep-alive
connection that stays open across the snapshot (runs in CI too)."""

from __future__ import annotations

import multiprocessing

from compat_common import digest, http_service, serve

REQUIRES: tuple[str, ...] = ()
EXPECT = "identical"
GPU = False


def square(n: int) -> int:
    return n * n + 1


if __name__ == "__main__":
    pool = multiprocessing.get_context("fork").Pool(2)
    serve(http_service(lambda: digest(pool.map(square, range(32)))))
