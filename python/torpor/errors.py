"""The SDK's exceptions. Each one's str() is a single line that names the cause and the fix."""

from __future__ import annotations


class TorporError(Exception):
    """Base of every error the torpor package raises on purpose."""


class SpecError(TorporError, ValueError):
    """torpor.toml is missing, unreadable or invalid.

    `key` is the dotted key path (`scaling.max_instances`, `data[0].size`), or None when the
    error is about the file as a whole."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class FrameError(TorporError, ValueError):
    """A frame of the worker protocol is too long, truncated, not UTF-8 JSON, or not an object."""


class DefinitionError(TorporError, TypeError):
    """A class given to @torpor.function, or named by `entry`, is not a valid function."""


class DataError(TorporError, LookupError):
    """torpor.load was asked for a name the spec does not declare, or the data is unavailable."""


class HookError(TorporError, RuntimeError):
    """The device-memory hook (libtorpor_hook.so) is absent, or one of its operations failed."""
