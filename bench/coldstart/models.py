"""The two models of the cold-start benchmark (DESIGN.md section 1), shared by make_weights.py and
worker.py so that both see exactly the same tensors under the same names.

torch, torchvision and transformers are imported inside the functions: importing this module is
free, and the worker can time each import as its own phase.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MODELS = ("resnet152", "gpt2-large")
GPT2_LARGE = {"n_embd": 1280, "n_layer": 36, "n_head": 20}
GPT2_VOCAB = 50257


def check(name: str) -> str:
    if name not in MODELS:
        raise SystemExit(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    return name


def import_libraries(name: str) -> None:
    """Import the library that defines the model (torchvision or transformers)."""
    if name == "resnet152":
        import torchvision  # noqa: F401
    else:
        import transformers  # noqa: F401


def build(name: str) -> torch.nn.Module:
    """The model with its default initialisation, on the current default device (use
    `with torch.device("meta")` to build it without allocating or initialising anything)."""
    if name == "resnet152":
        import torchvision

        return torchvision.models.resnet152(weights=None)
    import transformers

    config = transformers.GPT2Config(**GPT2_LARGE)
    return transformers.GPT2LMHeadModel(config)


def example_input(name: str) -> torch.Tensor:
    """The benchmark's input, on the CPU, always the same (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    if name == "resnet152":
        return torch.randn(1, 3, 224, 224, generator=gen)
    return torch.randint(0, GPT2_VOCAB, (1, 128), generator=gen)


def forward(name: str, model: torch.nn.Module, inp: torch.Tensor) -> torch.Tensor:
    if name == "resnet152":
        out: torch.Tensor = model(inp)
        return out
    logits: torch.Tensor = model(inp, use_cache=False).logits
    return logits


def named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) under every name it has: a tied weight
    appears once per name."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
