"""A GPU worker for the CRIU restore benchmark: worker.py's protocol, plus CUDA state.

    python3 gpu_worker.py SOCKET MIB        (GPU_MIB from $TORPOR_BENCH_GPU_MIB, default 1024)

Holds MIB MiB of distinct host data (like worker.py) and, on the GPU, GPU_MIB MiB of weights
and cuBLAS initialised: a restored copy must come back through the driver's restore too, which
reads the process's memory (with lazy pages: through userfaultfd faults). Every answer includes a
digest of a matrix product computed on the GPU, so a restore whose GPU state came back wrong
answers differently from the original.

  touch PERCENT   one byte of every page of the first PERCENT % of the host data, then a GEMM
  sum             SHA-256 of the host data and of the GEMM's result
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import zlib

import torch

PAGE = 4096


def main(argv: list[str]) -> int:
    path, mib = argv[0], int(argv[1])
    gpu_mib = int(os.environ.get("TORPOR_BENCH_GPU_MIB", "1024"))
    data = bytearray(os.urandom(mib << 20))
    view = memoryview(data)
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 4096
    weights = torch.rand((gpu_mib << 20) // 4 // (n * n) or 1, n, n, generator=g, device="cuda")
    x = torch.rand(n, n, generator=g, device="cuda")

    def gemm() -> str:
        y = torch.matmul(weights[-1], x)
        torch.cuda.synchronize()
        return hashlib.sha256(y.cpu().numpy().tobytes()).hexdigest()[:16]

    gemm()
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        conn, _ = server.accept()
        with conn:
            words = conn.recv(256).decode().split()
            if words[:1] == ["touch"] and len(words) == 2:
                end = len(data) * int(words[1]) // 100
                answer = f"{zlib.crc32(view[0:end:PAGE].tobytes())} {gemm()}"
            elif words == ["sum"]:
                answer = f"{hashlib.sha256(view).hexdigest()} {gemm()}"
            else:
                answer = "error: unknown request"
            conn.sendall(answer.encode() + b"\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
