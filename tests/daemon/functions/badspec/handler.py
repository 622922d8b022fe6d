"""A valid function whose torpor.toml is not: deploy must fail on the spec, naming the key."""

from __future__ import annotations

from typing import Any

import torpor


@torpor.function
class Faulty:
    def setup(self) -> None:
        pass

    def __call__(self, request: Any) -> Any:
        return request
