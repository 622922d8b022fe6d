"""llama-8b: Llama-3-8B's shape (bench/peers/lm.py), bf16 random weights, one GPU: the peer
benchmark's second model through torpord.

`lm` is bench/peers/lm.py, copied beside this file by bench/coldstart/split.py (Model.modules);
the weights are bench/peers/make_weights.py's file, hard-linked as weights.safetensors. setup()
builds the model on the meta device and assigns the tensors safetensors' `load_file` puts on the
GPU, the pre-built peer's way; a request answers as every peer path does (`lm.answer`: the same
prompt, the same digest).
"""

from __future__ import annotations

from typing import Any

import lm
import torch
import torpor


@torpor.function
class Llama8B:
    def setup(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("llama-8b needs a CUDA GPU (torpor.toml: gpus = 1)")
        from safetensors.torch import load_file

        path = str(torpor.load("weights"))
        model = lm.build(lm.spec("llama-8b"), "meta")
        lm.assign(model, load_file(path, device="cuda"), lm.aliases(path))
        torch.cuda.synchronize()
        self.model = model

    def __call__(self, request: Any) -> dict[str, Any]:
        return lm.answer(self.model, request, "cuda")
