"""resnet152: image classification with torchvision's ResNet-152 on one GPU.

Request:  {"seed": 1}                 a deterministic 1x3x224x224 input drawn from torch.Generator(seed)
          {"seed": 1, "batch": 8}     a batch of 1 to 64 such images
Response: {"top5": [[class, probability], ...] per image, "digest": sha256 of the logits' bytes,
           "device": "cuda"}

setup() builds the network on the meta device (nothing allocated, no random init), loads the
declared weights (torpor.toml, [[data]] "weights", written by make_weights.py) with
safetensors.torch.load_file, materialises the network on the GPU, fills it and puts it in eval
mode. A restored copy starts after all of that, with the weights already in GPU memory.

Try it without torpord (on a GPU machine, the repository's python/ on PYTHONPATH):
    python3 examples/resnet152/model.py '{"seed": 1}'
    python3 examples/resnet152/model.py --graphed '{"seed": 1}'    # ResNet152Graphed: the same answer
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torchvision
import torpor

MAX_BATCH = 64


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (as bench/coldstart/models.py)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def load_into(model: torch.nn.Module, path: str) -> None:
    """Copy the safetensors file at `path` into `model`'s tensors; every name must match."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(path, device="cpu")
    with safe_open(path, framework="pt") as f:
        aliases: dict[str, str] = json.loads((f.metadata() or {}).get("aliases", "{}"))
    missing, used = [], set()
    with torch.no_grad():
        for key, t in named_tensors(model):
            src = aliases.get(key, key)
            if src not in state:
                missing.append(key)
                continue
            t.copy_(state[src])
            used.add(src)
    unexpected = sorted(set(state) - used)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit ResNet-152: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "run make_weights.py"
        )


@torpor.function
class ResNet152:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("resnet152 needs a CUDA GPU (torpor.toml: gpus = 1)")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        with torch.device("meta"):
            model = torchvision.models.resnet152(weights=None)
        model = model.to_empty(device="cuda")
        load_into(model, str(torpor.load("weights")))
        torch.cuda.synchronize()
        self.model = model.eval()

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise TypeError(
                f'the request must be {{"seed": int, "batch": int?}}, got {str(request)[:100]}'
            )
        seed, batch = request.get("seed", 0), request.get("batch", 1)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if (
            isinstance(batch, bool)
            or not isinstance(batch, int)
            or not 1 <= batch <= MAX_BATCH
        ):
            raise ValueError(
                f"batch must be an integer from 1 to {MAX_BATCH}, got {batch!r}"
            )
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, 3, 224, 224, generator=gen).to("cuda", non_blocking=True)
        with torch.inference_mode():
            logits = self.model(x)
            probs, classes = torch.softmax(logits.float(), dim=1).topk(5, dim=1)
        logits_cpu = logits.float().cpu().contiguous()
        return {
            "top5": [
                [[int(c), round(float(p), 6)] for c, p in zip(cs, ps, strict=True)]
                for cs, ps in zip(classes.tolist(), probs.tolist(), strict=True)
            ],
            "digest": hashlib.sha256(logits_cpu.numpy().tobytes()).hexdigest(),
            "device": "cuda",
        }


@torpor.function
class ResNet152Graphed(ResNet152):
    """ResNet-152 whose batch-1 forward is a CUDA graph replay (torpor.graphed; docs/sandboxes.md,
    "CUDA graphs"): `GRAPHS` graphs captured in setup(), as many as the spec's requests at once,
    so concurrent requests in a sandbox stop waiting for each other's kernel launches; other
    batch sizes run eager. Deploy it with `entry = "model:ResNet152Graphed"`. Its answers equal
    ResNet152's, digest included."""

    GRAPHS = 4

    def setup(self) -> None:
        super().setup()
        example = torch.zeros(1, 3, 224, 224, device="cuda")
        self.model = torpor.graphed(self.model, example, instances=self.GRAPHS)


if __name__ == "__main__":
    from pathlib import Path

    torpor.use_dir(Path(__file__).resolve().parent)
    fn = ResNet152Graphed() if "--graphed" in sys.argv else ResNet152()
    sys.argv = [a for a in sys.argv if a != "--graphed"]
    fn.setup()
    print(
        json.dumps(fn(json.loads(sys.argv[1] if len(sys.argv) > 1 else '{"seed": 1}')))
    )
