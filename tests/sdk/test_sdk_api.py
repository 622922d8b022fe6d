"""@torpor.function validation and the declared-data API (torpor.load, load_bytes, use_dir)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torpor
from sdkd import TINYMLP
from torpor import data as torpor_data
from torpor.functions import MARK, resolve


@pytest.fixture(autouse=True)
def _unbound() -> Iterator[None]:
    torpor_data.unbind()
    yield
    torpor_data.unbind()


def test_decorator_marks_a_valid_class() -> None:
    @torpor.function
    class Good:
        def setup(self) -> None:
            self.k = 2

        def __call__(self, request: Any) -> Any:
            return request * self.k

    @torpor.function()
    class AlsoGood(Good):  # inherits both methods
        pass

    assert Good.__dict__[MARK] is True and AlsoGood.__dict__[MARK] is True
    g = Good()
    g.setup()
    assert g(21) == 42


def _setup(self: object) -> None:
    pass


def _call(self: object, request: Any) -> Any:
    return request


async def _acall(self: object, request: Any) -> Any:
    return request


def _init_arg(self: object, path: str) -> None:
    pass


@pytest.mark.parametrize(
    ("attrs", "words"),
    [
        ({"__call__": _call}, "has no setup method; define setup(self)"),
        ({"setup": _setup}, "has no __call__ method; define __call__(self, request)"),
        ({"setup": _setup, "__call__": _setup}, "__call__(self) cannot be called as __call__(self, request)"),
        ({"setup": _call, "__call__": _call}, "setup(self, request) cannot be called as setup(self)"),
        ({"setup": _setup, "__call__": _acall}, "__call__ is async"),
        ({"setup": _setup, "__call__": staticmethod(_call)}, "must be a plain method"),
        ({"setup": 3, "__call__": _call}, "must be a plain method"),
        (
            {"setup": _setup, "__call__": _call, "__init__": _init_arg},
            "needs arguments, but the worker creates it with none",
        ),
    ],
)
def test_decorator_rejects_bad_classes(attrs: dict[str, Any], words: str) -> None:
    cls = type("Bad", (), attrs)
    with pytest.raises(torpor.DefinitionError) as info:
        torpor.function(cls)
    assert words in str(info.value) and "Bad" in str(info.value)


def test_decorator_rejects_a_function() -> None:
    def handler(request: Any) -> Any:
        return request

    with pytest.raises(
        torpor.DefinitionError, match="got the function handler; wrap the code in such a class"
    ):
        torpor.function(handler)  # type: ignore[call-overload]


def test_resolve_finds_the_decorated_class(tmp_path: Path) -> None:
    (tmp_path / "modx_api.py").write_text(
        "import torpor\n@torpor.function\nclass A:\n"
        "    def setup(self): pass\n    def __call__(self, r): return r\n"
        "class B:\n    def setup(self): pass\n    def __call__(self, r): return r\n"
    )
    try:
        assert resolve(str(tmp_path), "modx_api:A").__name__ == "A"
        with pytest.raises(
            torpor.DefinitionError, match="B in .*modx_api.py is not decorated with @torpor.function"
        ):
            resolve(str(tmp_path), "modx_api:B")
        with pytest.raises(torpor.DefinitionError, match=r"has no class C \(decorated classes there: A\)"):
            resolve(str(tmp_path), "modx_api:C")
        with pytest.raises(torpor.DefinitionError, match="is not module:Class"):
            resolve(str(tmp_path), "modx_api")
    finally:
        sys.modules.pop("modx_api", None)
        sys.path.remove(str(tmp_path))


def test_load_outside_a_worker_says_how_to_bind() -> None:
    with pytest.raises(torpor.DataError, match=r"no declared data is bound .* torpor.use_dir\(DIR\)"):
        torpor.load("weights")


def test_use_dir_binds_declared_data() -> None:
    spec = torpor.use_dir(TINYMLP)
    assert spec.name == "tinymlp"
    assert torpor.load("weights") == TINYMLP / "weights.f32"
    raw = torpor.load_bytes("weights")
    assert raw == (TINYMLP / "weights.f32").read_bytes() and len(raw) == 268
    assert set(torpor.declared()) == {"weights"}
    with pytest.raises(torpor.DataError) as info:
        torpor.load("weigths")
    msg = str(info.value)
    assert "no data named 'weigths'" in msg and "(declared: weights)" in msg and "tinymlp/torpor.toml" in msg


def test_load_bytes_checks_read_only_size(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"abcd")
    torpor_data.bind(
        [torpor_data.Bound("w", f, 4, "read-only"), torpor_data.Bound("log", f, 4, "writable")], "test"
    )
    assert torpor.load_bytes("w") == b"abcd"
    f.write_bytes(b"abcdef")
    with pytest.raises(torpor.DataError, match="has 6 bytes but 4 were declared"):
        torpor.load_bytes("w")
    assert torpor.load_bytes("log") == b"abcdef"  # writable data may change
    f.unlink()
    with pytest.raises(torpor.DataError, match="cannot open .*No such file"):
        torpor.load_bytes("w")


def test_each_function_of_a_sandbox_reads_and_dumps_its_own_data(tmp_path: Path) -> None:
    """A sandbox hosts several functions, each declaring data of its own, maybe under the same
    names: the worker binds each function's at its load and marks whose request runs on each
    thread (torpor.data.serving); torpor.load, load_bytes and dump then use that function's."""
    import threading

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"A")
    b.write_bytes(b"BB")

    def entries(note: Path, size: int) -> list[torpor_data.Bound]:
        return [
            torpor_data.Bound("note", note, size, "read-only"),
            torpor_data.Bound("out", note, 64, "writable", source=f"s3://b-b/{note.stem}.json"),
        ]

    torpor_data.bind(entries(a, 1), "the torpor.toml of fa", function="fa")
    torpor_data.bind(entries(b, 2), "the torpor.toml of fb", function="fb")
    # Where no function is marked (the worker's setup() of the one just loaded): the last bound.
    assert torpor.load_bytes("note") == b"BB" and torpor_data.current_function() == "fb"
    with torpor_data.serving("fa"):
        assert torpor.load_bytes("note") == b"A" and torpor.load("note") == a
    got: dict[str, bytes] = {}
    sent: list[tuple[str, str, bytes]] = []
    torpor_data.set_dump_sink(lambda f, n, d: sent.append((f, n, d)))

    def request(function: str) -> None:
        with torpor_data.serving(function):
            got[function] = torpor.load_bytes("note")
            torpor.dump("out", function)

    try:
        threads = [threading.Thread(target=request, args=(f,)) for f in ("fa", "fb", "fa")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torpor_data.set_dump_sink(None)
    assert got == {"fa": b"A", "fb": b"BB"}
    assert sorted(sent) == [("fa", "out", b"fa"), ("fa", "out", b"fa"), ("fb", "out", b"fb")]
    # A function with no data of its own sees none, not another function's.
    torpor_data.bind([], "the torpor.toml of fc", function="fc")
    with torpor_data.serving("fc"), pytest.raises(torpor.DataError, match="no data named 'note'.*fc"):
        torpor.load("note")
