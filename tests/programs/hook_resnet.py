"""A ResNet-style forward pass on the GPU, for the hook's GPU test: prints one JSON line.

    {"out": sha256 of the output's bytes, "cuda_segments": n, "segment_bytes": b,
     "marked": segments given a first-use place, "first_use_ok": the stem's weights come first,
     "after_remap": sha256 of the output after the segments were released and mapped back}

Run plainly, and with LD_PRELOAD=libtorpor_hook.so TORPOR_HOOK_CUDA=1 TORPOR_HOOK_LIB=<same>:
the outputs must be bit-identical. With the hook the first pass records first-use order
(torpor.hook.recording_first_use), and it also exports every cuda segment's memory,
releases all segments (the snapshot step), maps the exported memory back at the same addresses
(the restore step) and runs the forward pass again. Deterministic: seeded, cuDNN deterministic.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


def model() -> nn.Sequential:
    widths = [64, 128, 256, 512]
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for i, w in enumerate(widths):
        layers += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def forward(net: nn.Sequential, x: torch.Tensor) -> str:
    with torch.no_grad():
        out = net(x)
    torch.cuda.synchronize()
    return hashlib.sha256(out.float().cpu().contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    net = model().cuda().eval()
    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(1)).cuda()
    result: dict[str, object] = {"cuda_segments": 0}
    if not os.environ.get("TORPOR_HOOK_LIB"):
        result["out"] = forward(net, x)
    else:
        from torpor import hook

        with hook.recording_first_use():
            result["out"] = forward(net, x)
        h = hook.get()
        segments = [s for s in h.segments() if s.backend == "cuda"]
        result["cuda_segments"] = len(segments)
        # The first module to run is the stem convolution: its weight's segment comes first.
        marked = sorted((s for s in segments if s.first_use is not None), key=lambda s: s.first_use or 0)
        result["marked"] = len(marked)
        stem = net[0].weight.data_ptr()
        result["first_use_ok"] = bool(marked) and marked[0].va <= stem < marked[0].va + marked[0].size
        result["segment_bytes"] = sum(s.size for s in segments)
        fds = {s.va: h.export(s.va) for s in segments}
        h.release_all()
        assert all(not s.mapped for s in h.segments()), "a segment kept its memory"
        for va, fd in fds.items():
            h.map(va, fd, False)
            os.close(fd)
        result["after_remap"] = forward(net, x)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
