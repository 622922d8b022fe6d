"""Declared data (EDAS): the files a function's torpor.toml lists under [[data]].

In a worker, the harness binds the files the daemon names in the `load` frame before setup()
runs; torpor.load(name) then returns the path of one of them and torpor.load_bytes(name) its
contents. Only declared names are served. Read-only data is opened read-only; its declared size
is checked on every load_bytes, so a file changed behind the function's back is an error rather
than wrong weights. (A memory-mapped view of the file is deliberately not offered: a mapping of
a file would tie every snapshot of the worker to that file staying in place and unchanged.)

torpor.load(name, buffer=True) returns the data as a memoryview of memory in a segment of the
device-memory hook (torpor.hook): read once into memfd-backed memory that a split snapshot
stores outside the CRIU image. Read-only data is then sealed: the view is read-only, a write
through any pointer to it faults, and the daemon may map one copy into every instance. Writable
data gets a writable view of a private copy (the file is not written back). The view is made
once per name and process; later calls return the same one.

Outside a worker, torpor.use_dir(DIR) binds DIR/torpor.toml's data, for trying a function in a
plain Python session or a test.

Platform-managed GPU data (EDAS; docs/sandboxes.md). A [[data]] entry with `device = "cuda"`
(in a function with gpus = 1) is filled into GPU memory by torpord while the instance starts
(from its GPU cache or a shared read-only copy when there is one, else from the file through
the node's fair PCIe scheduler) and mapped into the worker before setup() runs:
torpor.load(name, device="cuda") is then a PyTorch uint8 tensor of the data's bytes on that
memory (no copy of the function's own; read-only data is mapped read-only, so a write to it
fails on the GPU). Reinterpret it with tensor.view(dtype) and reshape. The file itself stays
readable through torpor.load(name).

Platform-loaded data (EDAS; docs/data.md). A [[data]] entry with `source = "s3://BUCKET/KEY"`
is loaded by torpord from its object store while the instance starts and handed over as a
memfd (sealed when read-only): torpor.load(name) is then `/proc/self/fd/N`, usable in setup()
and the warm-up only (the memfd is closed before the snapshot; keep what setup() made of it).
A request may pass inputs by reference, `{"$ref": "s3://BUCKET/KEY"}` anywhere in its JSON:
torpord loads the object before the handler runs and the handler gets its contents as `bytes`
in that place. torpor.dump(name, obj) writes a result to the object of a writable source
entry without waiting for the store (torpord writes it in the background).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from torpor.errors import DataError, HookError

if TYPE_CHECKING:
    from torpor.spec import Spec


@dataclass(frozen=True)
class Bound:
    """A declared data file as the running function sees it."""

    name: str
    path: Path
    size: int
    access: str  # "read-only" or "writable"
    source: str | None = None  # s3://BUCKET/KEY: loaded by torpord (path is /proc/self/fd/N)
    device: str = "host"  # "cuda": torpord fills GPU memory with it (gpu_data frames)


@dataclass(frozen=True)
class GpuData:
    """Platform-managed GPU memory mapped into this worker: `size` bytes of data at `va`."""

    va: int
    size: int
    padded: int
    readonly: bool


@dataclass
class _Binding:
    """One function's declared data in this process, and what was made of it."""

    entries: dict[str, Bound]
    source: str
    buffers: dict[str, memoryview] = field(default_factory=dict)
    # Platform-managed GPU data mapped into this process, and the tensors made of it.
    gpu: dict[str, GpuData] = field(default_factory=dict)
    tensors: dict[str, object] = field(default_factory=dict)
    # Source entries whose memfd was closed after setup() (their path no longer opens).
    gone: set[str] = field(default_factory=set)


# Each function's binding, by name: a sandbox hosts several functions, each with data of its
# own under the same names perhaps. `_current` is the function whose setup() or request runs
# in this thread (the worker sets it); where none is set, the last one bound (a worker of one
# function, torpor.use_dir).
_bindings: dict[str, _Binding] = {}
_last: str | None = None
_current: ContextVar[str | None] = ContextVar("torpor_data_function", default=None)
# Where torpor.dump sends (set by the worker while a request runs): (function, name, data).
_dump_sink: Callable[[str, str, bytes], None] | None = None
# The most bytes of one torpor.dump (torpord's s3data::MAX_DUMP_BYTES: it travels in one frame).
MAX_DUMP_BYTES = 32 << 20


def bind(entries: Iterable[Bound], source: str, function: str = "") -> None:
    """Make `entries` the declared data of `function` (replacing its earlier binding), and the
    binding used where no function is current. `source` names where they came from, for error
    messages."""
    global _last
    _bindings[function] = _Binding({e.name: e for e in entries}, source)
    _last = function


@contextlib.contextmanager
def serving(function: str) -> Iterator[None]:
    """While inside: torpor.load, load_bytes and dump in this thread use `function`'s data
    (the worker: a sandbox's setup() and requests)."""
    token = _current.set(function)
    try:
        yield
    finally:
        _current.reset(token)


def _binding() -> _Binding | None:
    name = _current.get()
    return _bindings.get(name if name is not None else (_last if _last is not None else ""))


def current_function() -> str | None:
    """The function whose data this thread uses (None: none bound)."""
    name = _current.get()
    return name if name is not None else _last


def loaded_done() -> None:
    """After setup() and the warm-up: the memfds of source entries are closed (worker)."""
    b = _binding()
    if b is not None:
        b.gone.update(n for n, e in b.entries.items() if e.source)


def unbind() -> None:
    global _last
    _bindings.clear()
    _last = None


def declared() -> dict[str, Bound]:
    """The bound data by name (empty when nothing is bound)."""
    b = _binding()
    return dict(b.entries) if b is not None else {}


def use_dir(fdir: str | os.PathLike[str]) -> Spec:
    """Parse DIR/torpor.toml and bind its declared data, so torpor.load works outside a worker.
    Returns the parsed spec; raises SpecError if the spec is invalid."""
    from torpor.spec import parse_dir

    spec = parse_dir(fdir)
    bind(
        (Bound(d.name, d.abs_path, d.size, d.access, d.source, d.device) for d in spec.data),
        f"{spec.dir}/torpor.toml",
    )
    # Nothing loads a source outside a worker: those entries are not there to read.
    b = _bindings[""]
    b.gone.update(d.name for d in spec.data if d.source)
    return spec


def _lookup(name: str, caller: str) -> Bound:
    b = _binding()
    if b is None:
        raise DataError(
            f"torpor.{caller}({name!r}): no declared data is bound in this process; call it from setup() "
            "of a function torpor runs, or call torpor.use_dir(DIR) first to try the function locally"
        )
    entry = b.entries.get(name)
    if entry is None:
        names = ", ".join(sorted(b.entries)) or "none"
        raise DataError(
            f"torpor.{caller}({name!r}): no data named {name!r} is declared in {b.source} "
            f"(declared: {names}); "
            "add a [[data]] entry with that name or fix the name"
        )
    if name in b.gone:
        raise DataError(
            f"torpor.{caller}({name!r}): the data comes from {entry.source}, which torpord loads for "
            "setup() and the warm-up of a worker only; read it in setup() and keep what you need "
            "(outside a worker, declare it with path to try the function)"
        )
    return entry


@overload
def load(name: str, *, buffer: Literal[False] = False, device: Literal["host"] | None = None) -> Path: ...


@overload
def load(name: str, *, buffer: Literal[True], device: Literal["host"] | None = None) -> memoryview: ...


@overload
def load(name: str, *, buffer: Literal[False] = False, device: Literal["cuda"]) -> Any: ...


def load(name: str, *, buffer: bool = False, device: str | None = None) -> Path | memoryview | Any:
    """The path of the declared data file `name`; with buffer=True, its contents in a segment
    (a memoryview, read-only for read-only data); with device="cuda", the GPU memory the
    platform filled with it, as a PyTorch uint8 tensor (see the module's doc)."""
    if device not in (None, "host", "cuda"):
        raise DataError(f'torpor.load({name!r}, device={device!r}): device is "host" (the default) or "cuda"')
    if device == "cuda":
        if buffer:
            raise DataError(
                f'torpor.load({name!r}, buffer=True, device="cuda"): pick one: buffer=True for host memory, '
                'device="cuda" for GPU memory'
            )
        return _load_gpu(name)
    entry = _lookup(name, "load")
    if not buffer:
        return entry.path
    buffers = _binding_of(name).buffers
    cached = buffers.get(name)
    if cached is not None:
        return cached
    view = _load_segment(entry)
    buffers[name] = view
    return view


def _binding_of(name: str) -> _Binding:
    """The current binding, which _lookup(name) found."""
    b = _binding()
    assert b is not None, name
    return b


def _load_gpu(name: str) -> Any:
    what = f'torpor.load({name!r}, device="cuda")'
    entry = _lookup(name, "load")
    b = _binding_of(name)
    if entry.device != "cuda":
        raise DataError(
            f'{what}: {name!r} is not declared device = "cuda" in {b.source}; add device = "cuda" to its '
            f"[[data]] entry (with gpus = 1) so torpord fills GPU memory with it, or call torpor.load({name!r}) for the file"
        )
    mapped = b.gpu.get(name)
    if mapped is None:
        raise DataError(
            f"{what}: no GPU memory was filled for it in this process: torpord fills it in the worker of a "
            f"function with gpus = 1 on a node with a GPU; here use torpor.load({name!r}) for the file"
        )
    cached = b.tensors.get(name)
    if cached is not None:
        return cached
    import sys

    torch: Any = sys.modules.get("torch")
    if torch is None:
        raise DataError(
            f"{what}: the tensor view needs PyTorch: import torch in the function (preload = [\"torch\"]); "
            f"the memory is at {mapped.va:#x} ({mapped.size} bytes)"
        )

    # On the worker's GPU 0, where torpord mapped it, through DLPack (torpor.dlpack: in a
    # process restored onto another GPU the driver places the pointer on the wrong one).
    from torpor import dlpack

    tensor = dlpack.torch_tensor(mapped.va, (mapped.size,), "uint8", 0, mapped)
    b.tensors[name] = tensor
    return tensor


def gpu_data(name: str) -> GpuData | None:
    """Where the platform-managed GPU data `name` of the current function is mapped in this
    process (None: not mapped here)."""
    b = _binding()
    return b.gpu.get(name) if b is not None else None


def map_gpu(name: str, fd: int, size: int, padded: int, readonly: bool) -> None:
    """Maps the GPU memory behind `fd` (torpord's `gpu_data` frame; the fd stays the caller's)
    into a new segment of the device-memory hook, so that torpor.load(name, device="cuda") finds
    it and a split snapshot stores it like any segment (worker; after bind() of the function
    that declares it)."""
    b = _binding()
    if b is None or name not in b.entries:
        raise DataError(f"mapping the GPU data {name!r}: it is not declared by the function being loaded")
    from torpor import cuda_driver, hook

    what = f"mapping the GPU data {name!r} ({size} bytes)"
    try:
        h = hook.get()
    except Exception as e:
        raise DataError(f"{what}: {e}") from None
    try:
        cuda_driver.with_context()
    except cuda_driver.DriverError as e:
        raise DataError(f"{what}: {e}; it needs a GPU and the split GPU path") from None
    # Addresses only, then the daemon's memory mapped there: the worker makes none of its own
    # (allocating the segment's size first, as until session 43, held the GPU memory twice).
    try:
        va = h.reserve_cuda(padded)
        h.map(va, fd, readonly)
    except HookError as e:
        raise DataError(f"{what}: {e}") from None
    b.gpu[name] = GpuData(va, size, padded, readonly)


def _load_segment(entry: Bound) -> memoryview:
    from torpor import hook

    what = f"torpor.load({entry.name!r}, buffer=True)"
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DataError(
            f"{what}: cannot open {entry.path}: {e.strerror}; restore the file or redeploy the function"
        ) from None
    with open(fd, "rb", buffering=0, closefd=True) as f:
        size = os.fstat(f.fileno()).st_size
        if entry.access == "read-only" and size != entry.size:
            raise DataError(
                f"{what}: {entry.path} has {size} bytes but {entry.size} were declared; "
                "the file changed after the spec was validated: redeploy the function"
            )
        if size == 0:
            return memoryview(b"")
        va, view = hook.host_segment(size)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise DataError(
                    f"{what}: {entry.path} ended after {got} of {size} bytes while being read; "
                    "it changed under the function: redeploy the function"
                )
            got += n
    if entry.access == "read-only":
        hook.get().seal(va)
        return view.toreadonly()
    return view


def load_bytes(name: str) -> bytes:
    """The whole contents of the declared data file `name` (opened read-only)."""
    entry = _lookup(name, "load_bytes")
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DataError(
            f"torpor.load_bytes({name!r}): cannot open {entry.path}: {e.strerror}; "
            "restore the file or redeploy the function"
        ) from None
    with open(fd, "rb", buffering=0, closefd=True) as f:
        data = f.readall()
    if entry.access == "read-only" and len(data) != entry.size:
        raise DataError(
            f"torpor.load_bytes({name!r}): {entry.path} has {len(data)} bytes "
            f"but {entry.size} were declared; "
            "the file changed after the spec was validated: redeploy the function"
        )
    return data


def set_dump_sink(sink: Callable[[str, str, bytes], None] | None) -> None:
    """Where torpor.dump sends while a request runs (the worker sets it)."""
    global _dump_sink
    _dump_sink = sink


def dump(name: str, obj: object) -> None:
    """Writes `obj` to the object of the declared data `name` (a [[data]] entry with a source
    and access = "writable") and returns at once: torpord writes it to the store in the
    background. bytes-like and str objects are written as they are (str as UTF-8); anything
    else as its JSON. Only while a request runs (not in setup()); at most 32 MiB, and no more
    than the entry's declared size. A write that fails later is in torpord's log."""
    entry = _lookup_for_dump(name)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
    else:
        try:
            data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise DataError(
                f"torpor.dump({name!r}): the object is not bytes, str or JSON ({e}); "
                "pass bytes (e.g. numpy's tobytes()) or a JSON value"
            ) from None
    limit = min(entry.size, MAX_DUMP_BYTES)
    if len(data) > limit:
        raise DataError(
            f"torpor.dump({name!r}): {len(data)} bytes, more than the {limit} allowed "
            f"(the declared size {entry.size}, at most {MAX_DUMP_BYTES}); raise size in torpor.toml or write less"
        )
    sink = _dump_sink
    if sink is None:
        raise DataError(
            f"torpor.dump({name!r}): no request is running; call it from the handler (__call__) "
            "of a function torpor runs"
        )
    sink(current_function() or "", name, data)


def _lookup_for_dump(name: str) -> Bound:
    b = _binding()
    if b is None or name not in b.entries:
        return _lookup(name, "dump")
    entry = b.entries[name]
    if entry.source is None:
        raise DataError(
            f"torpor.dump({name!r}): the data is the file {entry.path}, not an object; "
            'declare it with source = "s3://BUCKET/KEY" and access = "writable"'
        )
    if entry.access != "writable":
        raise DataError(
            f"torpor.dump({name!r}): the data is read-only in {b.source}; declare it access = \"writable\""
        )
    return entry


def with_refs(request: object) -> object:
    """`request` with every object torpord loaded by reference ({"$ref": uri, "data": base64},
    from a {"$ref": uri} the client sent) replaced by its contents, as bytes."""
    if isinstance(request, dict):
        if len(request) == 2 and isinstance(request.get("$ref"), str) and isinstance(request.get("data"), str):
            return base64.b64decode(request["data"])
        return {k: with_refs(v) for k, v in request.items()}
    if isinstance(request, list):
        return [with_refs(v) for v in request]
    return request
