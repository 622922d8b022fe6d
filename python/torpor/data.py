"""Declared data (EDAS): the files a function's torpor.toml lists under [[data]].

In a worker, the harness binds the files the daemon names in the `load` frame before setup()
runs; torpor.load(name) then returns the path of one of them and torpor.load_bytes(name) its
contents. Only declared names are served. Read-only data is opened read-only; its declared size
is checked on every load_bytes, so a file changed behind the function's back is an error rather
than wrong weights. (A memory-mapped view is deliberately not offered: a mapping of a file
would tie every snapshot of the worker to that file staying in place and unchanged.)

Outside a worker, torpor.use_dir(DIR) binds DIR/torpor.toml's data, for trying a function in a
plain Python session or a test.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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


def bind(entries: Iterable[Bound], source: str) -> None:
    """Make `entries` the declared data (replacing any earlier binding). `source` names where
    they came from, for error messages."""
    global _bound, _source
    _bound = {e.name: e for e in entries}
    _source = source


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


def load(name: str) -> Path:
    """The path of the declared data file `name`."""
    return _lookup(name, "load").path


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
