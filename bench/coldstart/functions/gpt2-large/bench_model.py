"""examples/gpt2-large with `hold_s`.

`model` is examples/gpt2-large/model.py, copied beside this file by bench/coldstart/split.py.
"""

from __future__ import annotations

import time
from typing import Any

import torpor
from model import GPT2Large


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
