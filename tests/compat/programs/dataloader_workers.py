"""A PyTorch DataLoader with num_workers=2 and persistent workers, forked after CUDA was
initialised: the workers inherit the parent's NVIDIA mappings and descriptors, and must yield
their batches again after the restore."""

from __future__ import annotations

import torch
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"


class Squares(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i * i))


torch.manual_seed(6)
w = torch.randn(16, 16, device="cuda")  # CUDA is initialised before the workers fork
loader = torch.utils.data.DataLoader(
    Squares(), batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
)


def compute() -> str:
    outs = [(batch.cuda() @ w).sum() for batch in loader]
    return digest(torch.stack(outs))


serve(compute)
