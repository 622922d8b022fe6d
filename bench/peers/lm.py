"""The peer benchmark's language models: their shapes, how each path builds them, fills them
with weights and answers, so that every path (a fresh process, a pool process, a pre-built one,
a Torpor function) runs the same code and the same request and yields the same digest.

No torpor import here: bench/coldstart/functions/llama-8b copies this file beside its handler,
and the peers' worker processes import it directly. torch and transformers are imported inside
the functions, so importing this module is free (the scratch path times the imports itself).

The answer is the one examples/gpt2-large/model.py gives: a prompt of `tokens` (default 128)
token ids drawn from torch.Generator(seed), one forward pass, and the SHA-256 of the last
position's logits as float32 bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Spec:
    name: str
    family: str  # "gpt2" or "llama": the transformers class
    dtype: str  # a torch dtype's name: "float32", "bfloat16"
    config: dict[str, Any] = field(default_factory=dict)


SPECS = {
    # examples/gpt2-large: transformers' GPT-2 Large (774 M parameters), fp32, 3.1 GB.
    "gpt2-large": Spec("gpt2-large", "gpt2", "float32", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    # Llama-3-8B's shape (8.0 B parameters), bf16, 16.1 GB of random weights.
    "llama-8b": Spec(
        "llama-8b",
        "llama",
        "bfloat16",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # Llama-2-13B's shape (13.0 B parameters), bf16, 26.0 GB of random weights: issue 10's live
    # migration between the two GPUs of nvidia-h200-x2 (bench/concurrent/measure.py).
    "llama-13b": Spec(
        "llama-13b",
        "llama",
        "bfloat16",
        {
            "hidden_size": 5120,
            "intermediate_size": 13824,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 40,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # Llama-3.2-3B's shape (3.2 B parameters), bf16, 6.4 GB: the middle size of issue 18's
    # per-size phase breakdown (0.8 B, ~3 B, 8 B).
    "llama-3b": Spec(
        "llama-3b",
        "llama",
        "bfloat16",
        {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    ),
    # The CPU smoke test's models: the same classes, a few hundred kB.
    "tiny-gpt2": Spec(
        "tiny-gpt2",
        "gpt2",
        "float32",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0},
    ),
    "tiny-llama": Spec(
        "tiny-llama",
        "llama",
        "bfloat16",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
    ),
}
DEFAULT_TOKENS = 128


def spec(name: str) -> Spec:
    if name not in SPECS:
        raise SystemExit(f"unknown model {name!r}: one of {', '.join(SPECS)}")
    return SPECS[name]


def build(s: Spec, device: str) -> torch.nn.Module:
    """The model with its default (random) initialisation on `device`, in the spec's dtype
    (created in it, never in fp32 first); on "meta" nothing is allocated or initialised."""
    import torch
    import transformers

    if s.family == "gpt2":
        config: Any = transformers.GPT2Config(**s.config)
        cls: Any = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(**s.config)
        cls = transformers.LlamaForCausalLM
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, s.dtype))
    try:
        with torch.device(device):
            model: torch.nn.Module = cls(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) under every name it has: a tied weight
    appears once per name (as bench/coldstart/models.py)."""
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def header_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone (8 bytes of length,
    then JSON), whichever loader reads the tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: a header of {n} bytes is not a safetensors header")
        header = json.loads(f.read(n))
    meta: dict[str, str] = header.get("__metadata__") or {}
    return meta


def aliases(path: str | Path) -> dict[str, str]:
    """Tied names and the stored name each one shares (make_weights.py writes them)."""
    out: dict[str, str] = json.loads(header_metadata(path).get("aliases", "{}"))
    return out


def assign(model: torch.nn.Module, state: dict[str, torch.Tensor], tied: dict[str, str]) -> None:
    """Puts the loaded tensors into a model built on the meta device, without a copy (the
    tensors become the parameters and buffers); a tied name gets the very Parameter of the name
    it shares. Every name of the model must be in `state` (directly or as an alias) and every
    tensor of `state` must be used."""
    import torch

    params: dict[str, torch.nn.Parameter] = {}
    missing: list[str] = []
    used: set[str] = set()
    for name, _ in named_tensors(model):
        src = tied.get(name, name)
        if src not in state:
            missing.append(name)
            continue
        used.add(src)
        path, _, attr = name.rpartition(".")
        mod = model.get_submodule(path)
        if attr in mod._parameters:
            if src not in params:
                params[src] = torch.nn.Parameter(state[src], requires_grad=False)
            mod._parameters[attr] = params[src]
        else:
            mod._buffers[attr] = state[src]
    unexpected = sorted(set(state) - used)
    if missing or unexpected:
        raise ValueError(
            f"the weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "write them with bench/peers/make_weights.py for this model"
        )
    left = [n for n, t in named_tensors(model) if t.is_meta]
    if left:
        raise ValueError(f"tensors left on the meta device after loading: {left[:5]}")


def request_ids(request: Any, vocab: int) -> torch.Tensor:
    """The prompt of a request {"seed": int, "tokens": int?}, on the CPU."""
    import torch

    if not isinstance(request, dict):
        raise TypeError(f'the request must be {{"seed": int, "tokens": int?}}, got {str(request)[:100]}')
    seed, tokens = request.get("seed", 0), request.get("tokens", DEFAULT_TOKENS)
    for key, value, high in (("seed", seed, 2**63 - 1), ("tokens", tokens, 1024)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"{key} must be an integer from 0 to {high}, got {value!r}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, max(1, tokens)), generator=gen)


def answer(model: torch.nn.Module, request: Any, device: str) -> dict[str, Any]:
    """One forward pass over the request's prompt: the top 5 next tokens and the digest of the
    last position's logits (as examples/gpt2-large/model.py answers)."""
    import torch

    config: Any = model.config
    vocab = int(config.vocab_size)
    ids = request_ids(request, vocab).to(device)
    with torch.inference_mode():
        out = model(ids, use_cache=False)
        last = out.logits[0, -1].float()
        probs, top = torch.softmax(last, dim=0).topk(5)
        digest = hashlib.sha256(last.cpu().contiguous().numpy().tobytes()).hexdigest()
    return {
        "next_top5": [[int(t), round(float(p), 6)] for t, p in zip(top.tolist(), probs.tolist(), strict=True)],
        "digest": digest,
        "device": device,
    }
