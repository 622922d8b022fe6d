"""A small GPT-2-like decoder built from its config (no downloads): greedy generation with
scaled-dot-product attention under bf16 autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compat_common import digest, serve

REQUIRES = ("torch",)
EXPECT = "identical"

VOCAB, DIM, HEADS, LAYERS, CTX = 1000, 256, 8, 4, 64
torch.manual_seed(3)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(CTX, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


model = GPT().cuda().eval()
prompt = torch.tensor([[1, 2, 3, 4]], device="cuda")


def compute() -> str:
    ids = prompt
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(24):
            nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return digest(ids.cpu().tolist())


serve(compute)
