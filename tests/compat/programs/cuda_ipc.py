"""Two processes sharing a CUDA tensor through torch.multiprocessing (CUDA IPC): the driver
cannot restore the importer, so the snapshot must be refused before the driver is touched, and
both processes must keep answering."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "refused"


def child(q_in: mp.Queue, q_out: mp.Queue) -> None:  # type: ignore[type-arg]
    shared = q_in.get()  # imported through cudaIpcOpenMemHandle
    while q_in.get() is not None:
        q_out.put(float((shared * 2).sum()))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(q_in, q_out), daemon=True)
    proc.start()
    torch.manual_seed(9)
    tensor = torch.randn(1 << 16, device="cuda")
    q_in.put(tensor)

    def compute() -> str:
        q_in.put(1)
        return digest(round(q_out.get(timeout=60), 3))

    serve(compute)
