"""examples/gpt2-large with `hold_s`.

`model` is examples/gpt2-large/model.py, copied beside this file by bench/coldstart/split.py.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torpor
import torpor.tensors
import transformers
from model import GPT2_LARGE, GPT2Large


@torpor.function
class HeldGPT2Large(GPT2Large):
    def __call__(self, request: Any) -> dict[str, Any]:
        hold = 0.0
        if isinstance(request, dict) and "hold_s" in request:
            hold = request["hold_s"]
            if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 600:
                raise ValueError(f"hold_s must be a number of seconds from 0 to 600, got {hold!r}")
            request = {k: v for k, v in request.items() if k != "hold_s"}
        out = super().__call__(request)
        time.sleep(float(hold))
        return out


@torpor.function
class MappedGPT2Large(HeldGPT2Large):
    """The same model with its weights as views of the platform-managed GPU memory of its
    `device = "cuda"` data `weights` (torpor.load_tensors; the file's "aliases" metadata names
    the tied LM head): setup() reads and copies nothing (the `-pooled` copy of the split
    benchmark: a start in a ready sandbox)."""

    def setup(self) -> None:
        config = transformers.GPT2Config(**GPT2_LARGE)
        gpt2 = transformers.GPT2LMHeadModel  # imported outside the meta device's mode
        with torch.device("meta"):
            model = gpt2(config)
        aliases = json.loads(torpor.tensors.load_metadata("weights").get("aliases", "{}"))
        torpor.assign(model, torpor.load_tensors("weights"), aliases)
        self.model = model.eval()
