"""A model behind an HTTP server (a thread of the program), asked over a keep-alive connection
that stays open across the snapshot (a TCP connection inside the tree's network namespace)."""

from __future__ import annotations

import http.client
import http.server
import threading

import torch
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

torch.manual_seed(15)
model = torch.nn.Linear(64, 8).cuda().eval()
x = torch.randn(4, 64, device="cuda")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        with torch.no_grad():
            body = digest(model(x)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 8080), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
client = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30)


def compute() -> str:
    client.request("GET", "/infer")
    resp = client.getresponse()
    return f"{resp.status}:{resp.read().decode()}"


serve(compute)
