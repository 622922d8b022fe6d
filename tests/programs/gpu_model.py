"""A CUDA process for the GPU tests: ResNet-50 (random weights, fixed seed) plus a 512 MiB tensor.

Serves line requests (see linesrv.py) on a Unix socket (path or abstract):

    infer   {"out": sha256 of the output tensor's bytes, "extra": sha256 of a checksum of the extra
             tensor, "pid": os.getpid(), "device": torch.cuda.current_device()}
    ping    "pong"

Everything is deterministic (seeded, cuDNN deterministic, no benchmark autotuning), so the same
process state gives bit-identical answers on any GPU of the same model.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torchvision  # noqa: E402

from linesrv import Endpoint, Request, listen, serve  # noqa: E402

EXTRA_BYTES = 512 << 20


class Model:
    def __init__(self) -> None:
        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
        self.model = torchvision.models.resnet50(weights=None).cuda().eval()
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1)
        self.input = torch.randn(4, 3, 224, 224, device="cuda", generator=gen)
        n = EXTRA_BYTES // 4
        self.extra = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=gen)
        torch.cuda.synchronize()

    def infer(self) -> dict[str, object]:
        with torch.no_grad():
            out = self.model(self.input)
        out_bytes = out.float().cpu().contiguous().numpy().tobytes()
        # Integer block sums: exact, so independent of the order the GPU adds in.
        sums = self.extra.view(-1, 1024).sum(dim=1, dtype=torch.int64).cpu().contiguous().numpy().tobytes()
        return {
            "out": hashlib.sha256(out_bytes).hexdigest(),
            "extra": hashlib.sha256(sums).hexdigest(),
            "pid": os.getpid(),
            "device": torch.cuda.current_device(),
        }

    def handle(self, req: Request) -> str:
        for fd in req.fds:
            os.close(fd)
        cmd = req.words[0]
        if cmd == "infer":
            return json.dumps(self.infer())
        if cmd == "ping":
            return "pong"
        return f"error unknown command {cmd!r}"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ready", required=True, help="file created once the socket listens")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--unix", help="listen on this Unix socket path")
    g.add_argument("--abstract", help="listen on this abstract Unix socket name instead")
    a = p.parse_args(argv)
    model = Model()
    model.infer()  # warm up: kernels loaded, cuDNN/cuBLAS handles created before any snapshot
    socks = listen(Endpoint(unix=a.unix, abstract=a.abstract))
    serve(socks, model.handle, a.ready)


if __name__ == "__main__":
    main(sys.argv[1:])
