"""torpor.graphed where CUDA is not in use (this machine: no torch, no GPU): nothing is captured,
every call runs the function as written, and bad arguments give one line naming the fix. The
captures and replays themselves are tests/sdk/test_sdk_graphs_gpu.py, on the GPU machine."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torpor
from torpor import graphs
from torpor.errors import DefinitionError


def test_without_cuda_every_call_is_the_function_itself() -> None:
    calls: list[Any] = []

    def double(x: Any, scale: int = 2) -> Any:
        calls.append(x)
        return [v * scale for v in x]

    g = torpor.graphed(double, [1, 2], instances=3)
    assert g([1, 2]) == [2, 4] and g([3], scale=3) == [9]
    assert calls == [[1, 2], [3]]  # no warm-up or capture ran the function
    assert g.stats() == {"replays": 0, "eager": 2, "shapes": 0}
    assert g.capture([5, 6]) is False


def test_bad_arguments_are_one_line_naming_the_fix() -> None:
    with pytest.raises(DefinitionError, match=r"instances must be an integer from 1 to 64, got 0; give as many"):
        torpor.graphed(lambda x: x, instances=0)
    with pytest.raises(DefinitionError, match=r"instances must be an integer from 1 to 64, got True"):
        torpor.graphed(lambda x: x, instances=True)
    with pytest.raises(DefinitionError) as e:
        torpor.graphed(42)  # type: ignore[arg-type]
    assert str(e.value) == "torpor.graphed: int is not callable; pass the module or function to graph"


Pair = collections.namedtuple("Pair", "left right")


def test_arguments_and_outputs_keep_their_structure() -> None:
    """The trees a call's arguments and a graph's outputs are flattened to (tensors apart, the rest
    in the key) come back as they were: tuples, lists, dicts, named tuples, dict subclasses."""

    class Output(dict[str, Any]):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)

    for tree in (
        ((1, "a"), {"k": [2, 3.5, None]}),
        Pair(left=[1, (2,)], right={"x": Pair(3, 4)}),
        Output(logits=(1, 2), hidden=[Pair(5, 6)]),
        [],
    ):
        leaves, spec = graphs._flatten(tree)
        assert leaves == []
        back = graphs._unflatten(spec, iter(leaves))
        assert back == tree and type(back) is type(tree)
        hash(spec)  # a key of the captured shapes
    # Keywords in any order make the same key.
    assert graphs._flatten(graphs._call_tree((1,), {"b": 2, "a": 1}))[1] == graphs._flatten(
        graphs._call_tree((1,), {"a": 1, "b": 2})
    )[1]
    with pytest.raises(TypeError):
        graphs._flatten(([1], {"opts": {1, 2}}, bytearray(b"x")))  # an unhashable leaf: such a call runs eager
