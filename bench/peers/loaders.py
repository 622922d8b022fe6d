"""The three ways the peers read a safetensors file into tensors on the device:

  safetensors      `safetensors.torch.load_file(path, device=...)`, the library's own loader;
  runai            Run:ai Model Streamer's `SafetensorsStreamer` (reads with many threads into a
                   host buffer it reuses; each tensor is copied to the device as it arrives);
  fastsafetensors  `fastsafe_open(path, nogds=True, device=...)`: the file copied into one device
                   buffer, tensors are views of it (no GPUDirect Storage).

runai-model-streamer and fastsafetensors are optional benchmark dependencies (their wheels are
carried to the GPU machine by bench/peers/carry.sh, `make gpu-carry`); `missing()` says why one
cannot be used, and the benchmark records the mode as skipped with that reason.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOADERS = ("safetensors", "runai", "fastsafetensors")
MODULES = {"safetensors": "safetensors", "runai": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}
# The versions bench/peers/carry.sh pins.
PINNED = {"runai": "runai-model-streamer==0.16.1", "fastsafetensors": "fastsafetensors==0.5.0"}


def missing(loader: str) -> str | None:
    """None when `loader` can be imported here, else why not and how to fix it."""
    if loader not in MODULES:
        return f"unknown loader {loader!r}: one of {', '.join(LOADERS)}"
    if importlib.util.find_spec(MODULES[loader]) is None:
        fix = f"pip install {PINNED[loader]} (on the GPU machine: `make gpu-carry` carries it in .whl/)" if loader in PINNED else "pip install safetensors"
        return f"{MODULES[loader]} is not installed: {fix}"
    return None


def load(loader: str, path: str, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file at `path`, on `device` ("cuda" or "cpu")."""
    if loader == "safetensors":
        from safetensors.torch import load_file

        return load_file(path, device=device)
    if loader == "runai":
        from runai_model_streamer import SafetensorsStreamer

        out: dict[str, torch.Tensor] = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            for name, t in streamer.get_tensors():
                # The streamer reuses its buffer: each tensor is copied out before the next.
                out[name] = t.to(device) if device != "cpu" else t.clone()
        return out
    if loader == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        # The tensors share ownership of the device buffer and outlive the context.
        with fastsafe_open(filenames=[path], nogds=True, device="cuda:0" if device == "cuda" else device) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    raise ValueError(f"unknown loader {loader!r}: one of {', '.join(LOADERS)}")
