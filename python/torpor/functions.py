"""@torpor.function and finding the decorated class that a spec's `entry` names."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any, TypeVar, overload

from torpor.errors import DefinitionError

MARK = "__torpor_function__"
T = TypeVar("T", bound=type)

_SHAPE = "a class with setup(self) and __call__(self, request)"


def _find(cls: type, name: str) -> Any:
    """The attribute `name` as defined by cls or a base other than object, else None."""
    for klass in cls.__mro__:
        if klass is object:
            return None
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def _accepts(fn: Callable[..., Any], args: int) -> bool | None:
    """Whether fn can be called with `args` positional arguments (None if it cannot be told)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*([None] * args))
    except TypeError:
        return False
    return True


def _plain(fn: Callable[..., Any]) -> str:
    """fn's parameters as written, without annotations: "(self, request)"."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def validate_class(cls: object) -> None:
    """Raise DefinitionError unless cls is a usable function class."""
    if not isinstance(cls, type):
        what = type(cls).__name__
        name = getattr(cls, "__name__", repr(cls))
        raise DefinitionError(
            f"@torpor.function decorates {_SHAPE}, got the {what} {name}; wrap the code in such a class"
        )
    name = cls.__qualname__
    for method, args, shape in (("setup", 1, "setup(self)"), ("__call__", 2, "__call__(self, request)")):
        fn = _find(cls, method)
        if fn is None:
            raise DefinitionError(f"@torpor.function class {name} has no {method} method; define {shape}")
        if isinstance(fn, (staticmethod, classmethod)) or not callable(fn):
            raise DefinitionError(
                f"@torpor.function class {name}: {method} must be a plain method; define {shape}"
            )
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise DefinitionError(
                f"@torpor.function class {name}: {method} is async, which torpor does not run; "
                f"define a plain {shape}"
            )
        if _accepts(fn, args) is False:
            raise DefinitionError(
                f"@torpor.function class {name}: {method}{_plain(fn)} cannot be called as {shape}; "
                "change its parameters"
            )
    if _accepts(cls, 0) is False:
        raise DefinitionError(
            f"@torpor.function class {name}: {name}{_plain(cls)} needs arguments, but the worker creates it "
            "with none; give them defaults or do that work in setup()"
        )


@overload
def function(cls: T) -> T: ...


@overload
def function(cls: None = None) -> Callable[[T], T]: ...


def function(cls: T | None = None) -> T | Callable[[T], T]:
    """Class decorator marking a serverless function: `setup(self)` runs once (load the model;
    read declared data with torpor.load), then `__call__(self, request)` once per request,
    with the request's JSON value, returning a JSON value. Usable as @torpor.function or
    @torpor.function()."""

    def mark(c: T) -> T:
        validate_class(c)
        setattr(c, MARK, True)
        return c

    if cls is None:
        return mark
    return mark(cls)


def resolve(fdir: str, entry: str) -> type:
    """Import `entry` ("module:Class") with fdir first on sys.path; return the decorated class."""
    module_name, sep, class_name = entry.partition(":")
    if not sep or not module_name or not class_name:
        raise DefinitionError(
            f'entry {entry!r} is not module:Class; fix entry in torpor.toml, e.g. "model:MLP"'
        )
    if sys.path[:1] != [fdir]:
        sys.path.insert(0, fdir)
    module = importlib.import_module(module_name)
    where = getattr(module, "__file__", None) or module_name
    cls = getattr(module, class_name, None)
    if cls is None:
        marked = sorted(n for n, v in vars(module).items() if isinstance(v, type) and getattr(v, MARK, False))
        others = f" (decorated classes there: {', '.join(marked)})" if marked else ""
        raise DefinitionError(
            f"entry {entry}: {where} has no class {class_name}{others}; fix entry in torpor.toml"
        )
    if not isinstance(cls, type) or not cls.__dict__.get(MARK, False):
        raise DefinitionError(
            f"entry {entry}: {class_name} in {where} is not decorated with @torpor.function; "
            f"add @torpor.function above class {class_name}"
        )
    return cls
