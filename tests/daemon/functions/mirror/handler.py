"""Mirror: returns its request unchanged, with the repr of every float and int as it arrived
(depth-first), so a test can tell a value changed on the way in from one changed on the way out.
request -> {"echo": request, "arrived": [repr, ...]}."""

from __future__ import annotations

from typing import Any

import torpor


def _numbers(value: Any, out: list[str]) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        out.append(repr(value))
    elif isinstance(value, list):
        for item in value:
            _numbers(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _numbers(item, out)


@torpor.function
class Mirror:
    def setup(self) -> None:
        pass

    def __call__(self, request: Any) -> Any:
        arrived: list[str] = []
        _numbers(request, arrived)
        return {"echo": request, "arrived": arrived}
