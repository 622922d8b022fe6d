"""Prints pytest's path arguments with the paths of one directory together, each directory where
its first path was, the paths of a directory in the order given.

Why: pytest 9.1.1 (the GPU image's) loses a directory's conftest.py fixtures when that
directory's files are given apart with another directory's file between them:
`pytest tests/sdk/a.py tests/b.py tests/sdk/c.py` errors in c.py with "fixture 'cuda' not found"
(session 55, `--setup-plan` on the GPU machine; pytest 9.2.0 here collects it right).
scripts/gpu-run.sh passes $TESTS through this. Usage: tests-by-directory.py PATH...
"""

from __future__ import annotations

import sys


def directory(arg: str) -> str:
    """The directory of a path argument (`tests/sdk/x.py::test_y` -> `tests/sdk`)."""
    path = arg.split("::", 1)[0].rstrip("/")
    return path.rsplit("/", 1)[0] if "/" in path else "."


def grouped(args: list[str]) -> list[str]:
    order: dict[str, list[str]] = {}
    for a in args:
        order.setdefault(directory(a), []).append(a)
    return [a for paths in order.values() for a in paths]


if __name__ == "__main__":
    print(" ".join(grouped(sys.argv[1:])))
