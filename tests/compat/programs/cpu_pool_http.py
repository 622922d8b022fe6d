"""No GPU: a multiprocessing pool of forked workers and an HTTP server asked over a keep-alive
connection that stays open across the snapshot (runs in CI too)."""

from __future__ import annotations

import http.client
import http.server
import multiprocessing
import threading

from compat_common import digest, serve

REQUIRES: tuple[str, ...] = ()
EXPECT = "identical"
GPU = False


def square(n: int) -> int:
    return n * n + 1


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        body = digest(pool.map(square, range(32))).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


if __name__ == "__main__":
    pool = multiprocessing.get_context("fork").Pool(2)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30)

    def compute() -> str:
        client.request("GET", "/")
        resp = client.getresponse()
        return f"{resp.status}:{resp.read().decode()}"

    serve(compute)
