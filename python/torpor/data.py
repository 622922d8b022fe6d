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
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from torpor.errors import DataError

if TYPE_CHECKING:
    from torpor.spec import Spec


@dataclass(frozen=True)
class Bound:
    """A declared data file as the running function sees it."""

    name: str
    path: Path
    size: int
    access: str  # "read-only" or "writable"


_bound: dict[str, Bound] | None = None
_source = ""
_buffers: dict[str, memoryview] = {}


def bind(entries: Iterable[Bound], source: str) -> None:
    """Make `entries` the declared data (replacing any earlier binding). `source` names where
    they came from, for error messages."""
    global _bound, _source
    _bound = {e.name: e for e in entries}
    _source = source
    _buffers.clear()


def unbind() -> None:
    global _bound, _source
    _bound = None
    _source = ""


def declared() -> dict[str, Bound]:
    """The bound data by name (empty when nothing is bound)."""
    return dict(_bound or {})


def use_dir(fdir: str | os.PathLike[str]) -> Spec:
    """Parse DIR/torpor.toml and bind its declared data, so torpor.load works outside a worker.
    Returns the parsed spec; raises SpecError if the spec is invalid."""
    from torpor.spec import parse_dir

    spec = parse_dir(fdir)
    bind((Bound(d.name, d.abs_path, d.size, d.access) for d in spec.data), f"{spec.dir}/torpor.toml")
    return spec


def _lookup(name: str, caller: str) -> Bound:
    if _bound is None:
        raise DataError(
            f"torpor.{caller}({name!r}): no declared data is bound in this process; call it from setup() "
            "of a function torpor runs, or call torpor.use_dir(DIR) first to try the function locally"
        )
    entry = _bound.get(name)
    if entry is None:
        names = ", ".join(sorted(_bound)) or "none"
        raise DataError(
            f"torpor.{caller}({name!r}): no data named {name!r} is declared in {_source} "
            f"(declared: {names}); "
            "add a [[data]] entry with that name or fix the name"
        )
    return entry


@overload
def load(name: str, *, buffer: Literal[False] = False) -> Path: ...


@overload
def load(name: str, *, buffer: Literal[True]) -> memoryview: ...


def load(name: str, *, buffer: bool = False) -> Path | memoryview:
    """The path of the declared data file `name`; with buffer=True, its contents in a segment
    (a memoryview, read-only for read-only data; see the module's doc)."""
    entry = _lookup(name, "load")
    if not buffer:
        return entry.path
    cached = _buffers.get(name)
    if cached is not None:
        return cached
    view = _load_segment(entry)
    _buffers[name] = view
    return view


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
