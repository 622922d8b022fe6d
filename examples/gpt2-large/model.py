"""gpt2-large: next-token prediction with transformers' GPT-2 Large (774 M params) on one GPU.

Request:  {"seed": 1}                     a deterministic prompt of 128 token ids drawn from
                                          torch.Generator(seed)
          {"seed": 1, "tokens": 32, "generate": 8}
                                          a prompt of 1 to 1024 tokens; greedily generate 0 to 64
                                          more tokens (default 0: one forward pass)
Response: {"next_top5": [[token id, probability], ...] after the prompt, "generated": [token ids],
           "digest": sha256 of the last position's logits, "device": "cuda"}

setup() builds the model on the meta device (nothing allocated, no random init), loads the declared
weights (torpor.toml, [[data]] "weights", written by make_weights.py) with
safetensors.torch.load_file, materialises the model on the GPU, re-ties the embedding and LM head,
fills it and puts it in eval mode. A restored copy starts after all of that.

Try it without torpord (on a GPU machine, the repository's python/ on PYTHONPATH):
    python3 examples/gpt2-large/model.py '{"seed": 1, "generate": 4}'
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
import torpor
import transformers

GPT2_LARGE = {
    "n_embd": 1280,
    "n_layer": 36,
    "n_head": 20,
}  # as bench/coldstart/models.py
VOCAB = 50257
MAX_POSITIONS = 1024
MAX_GENERATE = 64


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (as bench/coldstart/models.py)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def load_into(model: torch.nn.Module, path: str) -> None:
    """Copy the safetensors file at `path` into `model`'s tensors; tied names come from the file's
    "aliases" metadata; every name must match."""
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
            f"{path} does not fit GPT-2 Large: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "run make_weights.py"
        )


def int_field(
    request: dict[str, Any], key: str, default: int, low: int, high: int
) -> int:
    value = request.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= high
    ):
        raise ValueError(
            f"{key} must be an integer from {low} to {high}, got {value!r}"
        )
    return value


@torpor.function
class GPT2Large:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("gpt2-large needs a CUDA GPU (torpor.toml: gpus = 1)")
        config = transformers.GPT2Config(**GPT2_LARGE)
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(config)
        model = model.to_empty(device="cuda")
        model.tie_weights()  # to_empty may have given the tied embedding and LM head separate storage
        load_into(model, str(torpor.load("weights")))
        torch.cuda.synchronize()
        self.model = model.eval()

    def __call__(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise TypeError(
                f'the request must be {{"seed": int, "tokens": int?, "generate": int?}}, got {str(request)[:100]}'
            )
        seed = int_field(request, "seed", 0, 0, 2**63 - 1)
        tokens = int_field(request, "tokens", 128, 1, MAX_POSITIONS)
        generate = int_field(
            request, "generate", 0, 0, min(MAX_GENERATE, MAX_POSITIONS - tokens)
        )
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (1, tokens), generator=gen).to("cuda")
        generated: list[int] = []
        with torch.inference_mode():
            out = self.model(ids, use_cache=generate > 0)
            last = out.logits[0, -1].float()
            probs, top = torch.softmax(last, dim=0).topk(5)
            digest = hashlib.sha256(
                last.cpu().contiguous().numpy().tobytes()
            ).hexdigest()
            past, nxt = out.past_key_values, int(top[0])
            for _ in range(generate):
                generated.append(nxt)
                step = self.model(
                    torch.tensor([[nxt]], device="cuda"),
                    past_key_values=past,
                    use_cache=True,
                )
                past, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
        return {
            "next_top5": [
                [int(t), round(float(p), 6)]
                for t, p in zip(top.tolist(), probs.tolist(), strict=True)
            ],
            "generated": generated,
            "digest": digest,
            "device": "cuda",
        }


if __name__ == "__main__":
    from pathlib import Path

    torpor.use_dir(Path(__file__).resolve().parent)
    fn = GPT2Large()
    fn.setup()
    print(
        json.dumps(fn(json.loads(sys.argv[1] if len(sys.argv) > 1 else '{"seed": 1}')))
    )
