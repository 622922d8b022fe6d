"""Shared by the three stages of examples/vision-workflow (each stage's directory holds a copy
made by make_weights.py, so each function directory is self-contained): the array backend.

With torch importable (the GPU machine's variant, made by `make_weights.py --gpu DEST`), the
stages compute with torch on CUDA and hand CUDA tensors to each other through the store (the
same tensor, no copy); else with NumPy on the CPU. Both compute the same function of the same
weights."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

import torpor

try:  # the GPU variant
    if os.environ.get("VISION_WORKFLOW_BACKEND", "auto") == "numpy":
        raise ImportError
    import torch

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
except ImportError:
    torch = None
    DEVICE = "cpu"


def load_weights() -> dict[str, Any]:
    """The stage's declared weights (torpor.toml's [[data]] "weights"), as arrays of the backend."""
    with np.load(io.BytesIO(torpor.load_bytes("weights"))) as z:
        arrays = {k: z[k].astype(np.float32) for k in z.files}
    if torch is None:
        return arrays
    return {k: torch.from_numpy(v).to(DEVICE) for k, v in arrays.items()}


def asarray(x: Any) -> Any:
    if torch is None:
        return np.asarray(x, dtype=np.float32)
    return torch.as_tensor(np.asarray(x, dtype=np.float32), device=DEVICE)


def tolist(x: Any) -> Any:
    return x.tolist() if torch is None else x.detach().cpu().tolist()


def relu(x: Any) -> Any:
    return np.maximum(x, 0) if torch is None else torch.relu(x)


def softmax(x: Any) -> Any:
    if torch is None:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return torch.softmax(x, dim=-1)


def argmax(x: Any) -> list[int]:
    return [int(i) for i in (x.argmax(axis=-1) if torch is None else x.argmax(dim=-1).cpu())]
