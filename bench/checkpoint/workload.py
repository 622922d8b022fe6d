"""Training loops for the checkpoint benchmark and tests, deterministic so two runs (or a run and
its restore) can be compared bit for bit. Each step prints

    step N loss L t T

with L as repr() of a float and T the wall-clock time (time.time()) at the end of the step.

    python3 workload.py --kind torch --steps 300          # a small transformer on synthetic data, on the GPU
    python3 workload.py --kind numpy --steps 300          # a two-layer MLP, CPU (tests/programs/train_numpy.py's)

torch: a transformer encoder (`--size small`: 4 layers, d_model 256, 8 heads; `large`: 12 layers,
d_model 1024) regressing a fixed function of random
token sequences, AdamW, deterministic algorithms (CUBLAS_WORKSPACE_CONFIG set before CUDA starts),
its parameters and optimizer state on the GPU. `--hold-mb` adds a GPU buffer the loop
rewrites every step (a bigger model's weights, for the stop-the-world cost).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator


def numpy_losses(steps: int, sleep: float) -> Iterator[float]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32))
    true_w = rng.standard_normal((32, 1))
    y = np.tanh(x @ true_w) + 0.1 * rng.standard_normal((512, 1))
    w1 = rng.standard_normal((32, 64)) * 0.1
    b1 = np.zeros(64)
    w2 = rng.standard_normal((64, 1)) * 0.1
    b2 = np.zeros(1)
    lr = 0.05
    for _ in range(steps):
        h = np.tanh(x @ w1 + b1)
        pred = h @ w2 + b2
        err = pred - y
        yield float(np.mean(err**2))
        g = 2 * err / len(x)
        gw2 = h.T @ g
        gb2 = g.sum(0)
        gh = (g @ w2.T) * (1 - h**2)
        w1 -= lr * (x.T @ gh)
        b1 -= lr * gh.sum(0)
        w2 -= lr * gw2
        b2 -= lr * gb2
        if sleep:
            time.sleep(sleep)


SIZES = {
    # name: (d_model, layers, batch, sequence)
    "small": (256, 4, 32, 64),  # ~3.2 M parameters, a few ms per step on an H100
    "large": (1024, 12, 32, 256),  # ~150 M parameters, ~1.8 GB with AdamW's state
}


def torch_losses(steps: int, sleep: float, hold_mb: int, device: str, size: str = "small") -> Iterator[float]:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    # The math attention kernels: the fused ones' backward passes may not be deterministic.
    for off in ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp"):
        if hasattr(torch.backends.cuda, off):
            getattr(torch.backends.cuda, off)(False)
    dev = torch.device(device)
    d, layers, batch, seq = SIZES[size]
    vocab = 512
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, vocab, (16, batch, seq), generator=gen)
    targets = (data.float().sin().mean(-1, keepdim=True)).to(dev)
    data = data.to(dev)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d)
            layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True)
            self.enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.enc(self.emb(x)).mean(1))

    net = Net().to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    hold = torch.zeros(hold_mb << 18, device=dev) if hold_mb else None  # float32: 4 bytes each
    for i in range(steps):
        b = i % data.shape[0]
        loss = torch.nn.functional.mse_loss(net(data[b]), targets[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if hold is not None:
            hold.add_(1.0)
        yield float(loss.item())
        if sleep:
            time.sleep(sleep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("torch", "numpy"), default="torch")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--hold-mb", type=int, default=0, help="torch: a GPU buffer of this size rewritten every step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="torch: the model's size")
    args = ap.parse_args()
    losses = (
        numpy_losses(args.steps, args.sleep)
        if args.kind == "numpy"
        else torch_losses(args.steps, args.sleep, args.hold_mb, args.device, args.size)
    )
    for step, loss in enumerate(losses, 1):
        print(f"step {step} loss {loss!r} t {time.time():.6f}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
