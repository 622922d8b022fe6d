"""A block of the README (or of a docs page) that a bench script renders from bench/results, never
typed by hand: the lines between two marker lines, `<!-- NAME: rendered by … -->` and
`<!-- /NAME -->`. Shared by the table scripts (bench/concurrent/table.py, bench/sandbox/table.py,
bench/peers/table.py, bench/cluster/sim_table.py), which each rendered and replaced their block
in a way of their own before.

    replaced(text, begin, end, body)   # text with the block's lines made body
    readme_cli(argv, …)                # --readme FILE / --check FILE [/ --chart PNG] / print
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


class NoBlock(ValueError):
    """The text lacks the block's marker lines."""


def replaced(text: str, begin: str, end: str, body: str) -> str:
    """`text` with the lines between the `begin` marker and the first `end` after it made `body`.
    A marker indented (a block inside a list item) keeps its indentation, and so does each line
    of `body`."""
    start = text.find(begin)
    stop = text.find(end, start) if start >= 0 else -1
    if stop < 0:
        raise NoBlock(f"no block {begin!r} … {end!r}: add both lines where the table goes")
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    if indent.strip():
        # The marker is not alone on its line: only what precedes it there stays.
        indent, line_start = "", start
    lines = "\n".join(indent + line for line in body.splitlines())
    return text[:line_start] + f"{indent}{begin}\n{lines}\n{indent}{end}" + text[stop + len(end):]


def readme_cli(
    argv: list[str] | None,
    *,
    doc: str | None,
    script: str,
    what: str,
    rendered: Callable[[str], str],
    shown: Callable[[], str],
    chart: Callable[[Path], None] | None = None,
) -> int:
    """The command line of a script whose blocks `rendered(text)` renders into `text`:
    `--readme FILE` rewrites them, `--check FILE` exits 1 with one line when FILE's differ,
    `--chart PNG` (when the script draws one) writes it, and no flag prints `shown()`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--readme", type=Path, help="replace this file's block with the table")
    g.add_argument("--check", type=Path, help="exit 1 when this file's block is not the table")
    if chart is not None:
        g.add_argument("--chart", type=Path, help="write the chart (PNG) here")
    a = p.parse_args(argv)
    try:
        if a.readme:
            a.readme.write_text(rendered(a.readme.read_text()))
        elif a.check:
            text = a.check.read_text()
            if rendered(text) != text:
                print(f"{a.check}: {what} is not what the JSON says; run python3 {script} --readme {a.check}",
                      file=sys.stderr)
                return 1
        elif chart is not None and a.chart:
            chart(a.chart)
        else:
            print(shown())
    except NoBlock as e:
        print(f"{script}: {a.readme or a.check}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{script}: {e}", file=sys.stderr)
        return 1
    return 0
