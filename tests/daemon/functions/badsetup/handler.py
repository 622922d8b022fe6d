"""A function whose setup() fails, for the deploy-failure test."""

from __future__ import annotations

from typing import Any

import torpor


@torpor.function
class BadSetup:
    def setup(self) -> None:
        raise RuntimeError("the model file is corrupt")

    def __call__(self, request: Any) -> Any:
        return request
