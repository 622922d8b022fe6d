"""A model's weights as views of platform-managed GPU memory, without a copy.

A [[data]] entry with `device = "cuda"` is filled into GPU memory by torpord while the instance
starts (from the GPU cache or the tenant's shared copy when there is one) and mapped into the
worker before setup() runs (torpor.data). When that entry is a safetensors file,
`torpor.load_tensors(name)` gives its tensors as views of that memory, and `torpor.assign(model,
tensors)` makes them the parameters and buffers of a model built on the meta device:

    with torch.device("meta"):
        model = build()
    torpor.assign(model, torpor.load_tensors("weights"))

setup() then allocates and copies nothing for its weights, which is what makes a start in a ready
sandbox of the live-context pool short for a big model (docs/sandboxes.md, "The live-context
pool"): the memory was filled while the sandbox bound the function in. Read-only data is mapped
read-only: the views are for inference (a write faults on the GPU), and `assign` turns gradients
off.

The safetensors header is read here, not with the `safetensors` package, because that package
reads a file or bytes on the host, while these bytes are already on the GPU: only the header
(a length and a JSON object, documented in safetensors' README) is copied to the host.
A tensor whose offset is not a multiple of its element size cannot be a view and is refused;
files written by safetensors' `save_file` never have one. cuBLAS picks kernels by address
alignment, so the views' addresses (the file's offsets) may give other output bits than the
same weights copied into allocations of their own; a function's instances all map the data at
the same offsets, so its outputs agree with each other.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torpor.errors import DataError

# safetensors' dtype names (its README, "Format") and torch's names for them.
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_ITEM_SIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own bound
ALIGN = 256  # the most PyTorch's cuBLASLt path looks at (CUDABlas.cpp, _getAlignment)


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are in the file, and what they are."""

    name: str
    dtype: str  # torch's name (float32, bfloat16, …)
    shape: tuple[int, ...]
    start: int  # offset in the file
    end: int


def parse_header(head: bytes, size: int, what: str = "the data") -> tuple[list[Entry], dict[str, str]]:
    """The tensors and `__metadata__` of a safetensors file of `size` bytes whose first bytes
    are `head` (at least its 8-byte length and its header; `header_length(head)` says how many).
    Every offset is checked against the file's size and the tensor's size, and a tensor that
    does not start at a multiple of its element size is refused (it could not be a view)."""
    n = header_length(head, size, what)
    if len(head) < 8 + n:
        raise DataError(f"{what}: {len(head)} bytes given of a {8 + n}-byte header")
    try:
        header = json.loads(head[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{what}: its safetensors header is not JSON ({e}): write it with safetensors' save_file") from None
    if not isinstance(header, dict):
        raise DataError(f"{what}: its safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise DataError(f"{what}: its __metadata__ is not a JSON object")
    data = 8 + n
    entries = [_entry(name, info, data, size, what) for name, info in header.items()]
    return entries, {str(k): str(v) for k, v in metadata.items()}


def header_length(head: bytes, size: int, what: str = "the data") -> int:
    """The length of the JSON header of a safetensors file of `size` bytes starting with `head`."""
    if size < 8 or len(head) < 8:
        raise DataError(f"{what}: {size} bytes is not a safetensors file (it starts with an 8-byte header length)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > min(_MAX_HEADER, size - 8):
        raise DataError(
            f"{what}: header length {n} does not fit in its {size} bytes: not a safetensors file (write it with "
            "safetensors' save_file)"
        )
    return int(n)


def _entry(name: str, info: Any, data: int, size: int, what: str) -> Entry:
    try:
        dtype_name, shape, (lo, hi) = info["dtype"], info["shape"], info["data_offsets"]
        dims = tuple(int(s) for s in shape)
        lo, hi = int(lo), int(hi)
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{what}: tensor {name!r} has no dtype, shape and data_offsets in its header") from None
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise DataError(f"{what}: tensor {name!r} has dtype {dtype_name!r}, which Torpor cannot view")
    item = _ITEM_SIZE[dtype]
    count = 1
    for d in dims:
        count *= d
    if min(dims, default=0) < 0 or not 0 <= lo <= hi or data + hi > size or hi - lo != count * item:
        raise DataError(
            f"{what}: tensor {name!r} ({dtype_name} {list(dims)}) says bytes {lo}..{hi} of a {size - data}-byte "
            "data section: the file is damaged or not safetensors"
        )
    if (data + lo) % item:
        raise DataError(
            f"{what}: tensor {name!r} starts at byte {data + lo}, not a multiple of its {item}-byte {dtype_name} "
            "elements, so it cannot be a view: write the file with safetensors' save_file"
        )
    return Entry(name, dtype, dims, data + lo, data + hi)


def views(blob: Any, what: str = "the data") -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors of the safetensors file whose bytes are the 1-D uint8 tensor `blob` (on any
    device), each a view of `blob` (no copy: only the header is read to the host), and the
    file's `__metadata__`. `what` names the data in errors."""
    torch = _torch(what)
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise DataError(f"{what}: expected a 1-D uint8 tensor of the file's bytes, got {blob.dtype} {tuple(blob.shape)}")
    size = int(blob.numel())
    n = header_length(_host_bytes(blob[: min(8, size)]), size, what)
    entries, metadata = parse_header(_host_bytes(blob[: 8 + n]), size, what)
    out = {}
    for e in entries:
        dtype = getattr(torch, e.dtype, None)
        if dtype is None:
            raise DataError(f"{what}: tensor {e.name!r} is {e.dtype}, which this PyTorch ({torch.__version__}) lacks")
        out[e.name] = blob[e.start : e.end].view(dtype).view(e.shape)
    return out, metadata


def load_tensors(name: str) -> dict[str, Any]:
    """The tensors of the declared `device = "cuda"` data `name`, a safetensors file, as views of
    the GPU memory the platform filled (torpor.load(name, device="cuda"))."""
    return views(_blob(name), f"torpor.load_tensors({name!r})")[0]


def load_metadata(name: str) -> dict[str, str]:
    """The `__metadata__` of the declared `device = "cuda"` safetensors data `name`."""
    return views(_blob(name), f"torpor.load_metadata({name!r})")[1]


def _blob(name: str) -> Any:
    from torpor import data

    return data.load(name, device="cuda")


def assign(model: Any, tensors: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> None:
    """Make `tensors` every parameter and buffer of `model` (built on the meta device), under
    every name each has, non-persistent buffers included; `aliases` maps a name to the name it
    is stored under (tied weights stored once). Parameters get requires_grad=False. Every name
    of the model must be found and every tensor used, with its shape and dtype, else one error
    naming the first few, and the model is left unchanged."""
    torch = _torch("torpor.assign")
    aliases = aliases or {}
    names = [
        *(("p", n) for n, _ in model.named_parameters(remove_duplicate=False)),
        *(("b", n) for n, _ in model.named_buffers(remove_duplicate=False)),
    ]
    current = dict(model.named_parameters(remove_duplicate=False))
    current.update(model.named_buffers(remove_duplicate=False))
    missing, wrong, used = [], [], set()
    plan = []
    for kind, key in names:
        src = aliases.get(key, key)
        t = tensors.get(src)
        if t is None:
            missing.append(key)
            continue
        old = current[key]
        if tuple(old.shape) != tuple(t.shape) or old.dtype != t.dtype:
            wrong.append(f"{key} {tuple(t.shape)} {t.dtype} for {tuple(old.shape)} {old.dtype}")
            continue
        used.add(src)
        plan.append((kind, key, src))
    unused = sorted(set(tensors) - used)
    if missing or wrong or unused:
        raise DataError(
            f"torpor.assign: the tensors do not fit the model: missing {missing[:5]}, mismatched {wrong[:3]}, "
            f"unused {unused[:5]}; give aliases for tied names, or weights written from this model"
        )
    made: dict[str, Any] = {}
    for kind, key, src in plan:
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        if kind == "p":
            if src not in made:
                made[src] = torch.nn.Parameter(tensors[src], requires_grad=False)
            module._parameters[attr] = made[src]
        else:
            module._buffers[attr] = tensors[src]


def save(tensors: Mapping[str, Any], path: str, metadata: Mapping[str, str] | None = None, align: int = ALIGN) -> None:
    """Write `tensors` (PyTorch tensors, any device) to `path` as a safetensors file laid out
    for views: the data section starts at a multiple of `align` bytes (the header is padded with
    spaces, as the format allows) and the tensors whose size is a multiple of `align` come
    first, so each of them starts aligned too; the others (small odd-sized ones, such as
    BatchNorm's counters) follow. Any safetensors reader reads it; `torpor.load_tensors` then
    gives views as aligned as PyTorch's own allocations up to `align`, which is what keeps
    cuBLAS on the kernels it picks for them and the outputs bit-identical (safetensors'
    save_file aligns only to 8 bytes). Written to a temporary file and renamed into place."""
    torch = _torch("torpor.tensors.save")
    if align < 8 or align & (align - 1):
        raise ValueError(f"align must be a power of two of at least 8, got {align}")
    inverse = {v: k for k, v in _DTYPES.items()}
    # Aligned sizes first; then the others by element size, largest first, so that each still
    # starts at a multiple of its own element size (a view needs that).
    items = sorted(
        tensors.items(),
        key=lambda kv: (_nbytes(kv[1]) % align != 0, -int(kv[1].element_size()), kv[0])
        if _nbytes(kv[1]) % align
        else (False, 0, kv[0]),
    )
    header: dict[str, Any] = {}
    offset = 0
    for name, t in items:
        kind = inverse.get(str(t.dtype).removeprefix("torch."))
        if kind is None:
            raise ValueError(f"tensor {name!r}: safetensors has no dtype for {t.dtype}")
        n = _nbytes(t)
        header[name] = {"dtype": kind, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % align)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, t in items:
            if _nbytes(t):
                f.write(memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
    os.replace(tmp, path)


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _host_bytes(t: Any) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


def _torch(what: str) -> Any:
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            raise DataError(f"{what}: needs PyTorch (preload = [\"torch\"])") from None
    return torch
