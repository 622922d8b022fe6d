"""The peer benchmark's models as torpord functions (bench/coldstart/functions/llama-8b and
tiny-llama name a class of this file as their entry): setup() builds the model on the meta device
and assigns the tensors that safetensors' `load_file` puts on the device, the pre-built peer's
way; a request answers as every peer path does (`lm.answer`: the same prompt, the same digest).

bench/coldstart/split.py copies this file and bench/peers/lm.py beside the function's
torpor.toml (Model.modules) and hard-links the weights bench/peers/make_weights.py wrote as
weights.safetensors.
"""

from __future__ import annotations

from typing import Any

import lm
import torch
import torpor


class PeerModel:
    """A model of lm.SPECS on `device`, its weights the declared data "weights"."""

    model_name = ""
    device = "cuda"

    def setup(self) -> None:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{self.model_name} needs a CUDA GPU (torpor.toml: gpus = 1)")
        from safetensors.torch import load_file

        path = str(torpor.load("weights"))
        model = lm.build(lm.spec(self.model_name), "meta")
        lm.assign(model, load_file(path, device=self.device), lm.aliases(path))
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.model = model

    def __call__(self, request: Any) -> dict[str, Any]:
        return lm.answer(self.model, request, self.device)


@torpor.function
class Llama8B(PeerModel):
    """Llama-3-8B's shape, bf16, on the GPU."""

    model_name = "llama-8b"
    device = "cuda"


@torpor.function
class Llama13B(PeerModel):
    """Llama-2-13B's shape, bf16, on the GPU (the live migration's model, issue 10)."""

    model_name = "llama-13b"
    device = "cuda"


@torpor.function
class Llama3B(PeerModel):
    """Llama-3.2-3B's shape, bf16, on the GPU (the per-size phase breakdown's middle size)."""

    model_name = "llama-3b"
    device = "cuda"


@torpor.function
class TinyLlama(PeerModel):
    """The CPU test's tiny Llama: the same code through torpord on a machine without a GPU."""

    model_name = "tiny-llama"
    device = "cpu"
