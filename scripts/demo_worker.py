"""The process `make demo-snapshot` snapshots: boots slowly once, then answers requests fast.

With a GPU and PyTorch it holds a ResNet-50 on the GPU (fixed seed) and answers `infer` with a
digest of the output; otherwise it builds a CPU "model" (a large table computed at boot) and
answers with a digest of a computation over it. It listens on an abstract Unix socket, so every
restored copy, each in its own network namespace, answers under the same name.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time

SOCKET_NAME = "\0torpor-demo"


def boot_gpu() -> tuple[str, object]:
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda().eval()
    inp = torch.randn(8, 3, 224, 224, device="cuda")

    def infer() -> str:
        with torch.no_grad():
            out = model(inp)
        torch.cuda.synchronize()
        return hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:16]

    infer()  # warm-up: cuDNN/cuBLAS initialised before the snapshot
    return f"gpu:{torch.cuda.get_device_name(0)}", infer


def boot_cpu() -> tuple[str, object]:
    # Stands in for an expensive initialisation: ~1.5 s of work into 64 MiB of state.
    table = bytearray(64 << 20)
    seed = hashlib.sha256(b"torpor").digest()
    for i in range(0, len(table), 32 * 1024):
        seed = hashlib.sha256(seed).digest()
        table[i : i + 32 * 1024] = seed * 1024
        if i % (1 << 22) == 0:
            time.sleep(0.1)

    def infer() -> str:
        return hashlib.sha256(table).hexdigest()[:16]

    return "cpu", infer


def main() -> None:
    use_gpu = len(sys.argv) > 1 and sys.argv[1] == "gpu"
    kind, infer = boot_gpu() if use_gpu else boot_cpu()
    served = 0
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(SOCKET_NAME)
    srv.listen(16)
    print(f"ready ({kind})", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            if not conn.recv(64):
                continue
            served += 1
            t = time.perf_counter()
            digest = infer()  # type: ignore[operator]
            reply = {"kind": kind, "digest": digest, "served": served,
                     "ms": round((time.perf_counter() - t) * 1e3, 2), "pid": os.getpid()}
            conn.sendall(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
